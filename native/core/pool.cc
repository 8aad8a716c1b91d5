// The pool (pool.h): opening it (the trusted walk is trusted.cc; the layout check, a new pool's .vmspace/ built
// whole and renamed into place), its staging shards and lease files, spare leases, dispose, handover and adopt.
// Staging and publish are pool_publish.cc, sweep and list pool_sweep.cc, quotas and space pool_quota.cc.
#include "pool.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>

#include "error.h"
#include "io.h"
#include "json_members.h"
#include "layout.h"
#include "lease.h"
#include "metadata.h"
#include "names.h"
#include "remove.h"
#include "rename.h"
#include "trusted.h"

namespace vmspace {
namespace {

constexpr size_t kMaxMetaBytes = 16 << 20;
// Reads a whole small file below `at` (never following a symlink); returns the errno (0 on success).
int readSmallFile(int at, const std::string& name, std::string* out) {
  return readRegularFileAt(at, name.c_str(), O_NOFOLLOW, kMaxMetaBytes, out);
}

// Writes `data` to a fresh temp file in `dirFd` and publishes it as `name` without replacing (publishFileNoReplace:
// renameat2(RENAME_NOREPLACE), or link + unlink where the file system lacks it). Returns false, leaving nothing
// behind, when `name` exists.
bool writeFileNoReplace(int dirFd, const std::string& name, const std::string& data, bool durable,
                        const std::string& shown) {
  std::string tmp = "." + name + layout::kTmpPrefix + randomHex(6);
  TempFile fd(dirFd, tmp, 0644, shown);
  // 0644 exactly, whatever the umask (under umask 0777 the version file would be mode 000 and the pool's owner
  // could not reopen it as a non-root user).
  if (fchmod(fd.fd(), 0644) != 0) throwErrno(errno, "fchmod", shown);
  if (int err = writeAll(fd.fd(), data)) throwErrno(err, "write", shown);
  if (durable && fsync(fd.fd()) != 0) throwErrno(errno, "fsync", shown);
  fd.close();
  const char* step;
  if (int err = publishFileNoReplace(dirFd, tmp.c_str(), dirFd, name.c_str(), &step)) {
    if (err != EEXIST) throwErrno(err, step, shown);
    return false;  // the temp file is removed as `fd` goes
  }
  fd.published();
  return true;
}

// Whether the pool's file system takes renameat2(RENAME_NOREPLACE): 0, or the errno with which it refuses the flag
// (EINVAL, ENOSYS: FUSE without rename2, some network file systems). Asked once, by renaming an empty probe file
// in `dirFd` (.vmspace/, which no sweep pass reads but the probe pass).
// Where no probe can be made (read-only, no permission) it counts as supported: nothing can be published there.
int probeNoReplace(int dirFd) {
  std::string probe = layout::kNoReplaceProbe + randomHex(6), moved = probe + "-b";
  UniqueFd fd(openat(dirFd, probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600));
  if (!fd) return 0;
  fd.reset();
  int err = 0;
  if (renameat2(dirFd, probe.c_str(), dirFd, moved.c_str(), RENAME_NOREPLACE) == 0)
    unlinkat(dirFd, moved.c_str(), 0);
  else {
    err = noReplaceUnsupported(errno) ? errno : 0;
    unlinkat(dirFd, probe.c_str(), 0);
  }
  return err;
}

// Whether the directory `fd` has an entry other than what concurrent openers make: a half-built .vmspace
// (layout::kInitPrefix), or .vmspace itself, renamed into place since this opener found none.
bool hasEntries(int fd, const std::string& shown) {
  bool any = false;
  forEachName(fd, shown, [&](const struct dirent& e) {
    if (!layout::hasPrefix(e.d_name, layout::kInitPrefix) && strcmp(e.d_name, layout::kStateDir) != 0) any = true;
  });
  return any;
}

// Builds a new pool's .vmspace/ whole under a temp name in the root, then renames it into place without
// replacing, so that no opener ever sees a pool without its version or its directories. False when another
// opener's came first (ours is removed).
bool makeState(int rootFd, const std::string& root, long long gid) {
  const std::string tmp = layout::kInitPrefix + randomHex(8), shown = root + "/" + tmp;
  const mode_t stateMode = gid >= 0 ? 02770 : 0755, subMode = gid >= 0 ? 02770 : 0700;
  makeDirExact(rootFd, tmp.c_str(), stateMode, gid, shown);
  auto removeTemp = [&] {
    try {
      removeTreeNoFollow(rootFd, tmp, shown);
    } catch (...) {
      // Left for a sweep (layout::kInitPrefix entries past the grace period); the first error is the one to report.
    }
  };
  try {
    UniqueFd state(openat(rootFd, tmp.c_str(), kDirFlags));
    if (!state) throwErrno(errno, "open", shown);
    writeFileNoReplace(state.get(), layout::kVersion, std::string(layout::kVersionText) + "\n", false,
                       shown + "/" + layout::kVersion);
    const std::pair<const char*, int> subs[] = {
        {layout::kStaging, kStagingShards}, {layout::kTrash, 0}, {layout::kLeases, kLeaseShards}, {layout::kCache, 0}};
    for (auto [sub, shards] : subs) {
      std::string subShown = shown + "/" + sub;
      makeDirExact(state.get(), sub, subMode, gid, subShown);
      UniqueFd dir(openat(state.get(), sub, kDirFlags));
      if (!dir) throwErrno(errno, "open", subShown);
      for (int i = 0; i < shards; i++) {
        std::string n = shards == kStagingShards ? layout::stagingShardName(i) : layout::leaseShardName(i);
        makeDirExact(dir.get(), n.c_str(), subMode, gid, subShown + "/" + n);
      }
    }
    int moved = renameat2(rootFd, tmp.c_str(), rootFd, layout::kStateDir, RENAME_NOREPLACE);
    // Without RENAME_NOREPLACE, rename(2) still never replaces a non-empty .vmspace/ (ENOTEMPTY).
    if (moved != 0 && noReplaceUnsupported(errno)) moved = renameat(rootFd, tmp.c_str(), rootFd, layout::kStateDir);
    if (moved == 0) return true;
    if (errno != EEXIST && errno != ENOTEMPTY) throwErrno(errno, "renameat2", shown, layout::statePath(root));
  } catch (...) {
    removeTemp();
    throw;
  }
  removeTemp();
  return false;
}

// Refuses a pool whose .vmspace/ is not this layout: ERR_POOL_FORMAT naming what is wrong, nothing touched.
[[noreturn]] void throwFormat(const std::string& what, const std::string& shown) {
  throwCode("ERR_POOL_FORMAT", what + " (this vmspace reads '" + layout::kVersionText + "' pools only)", 0, "open",
            shown);
}

}  // namespace

const std::string& bootId() {
  static const std::string id = [] {
    std::string text;
    if (readSmallFile(AT_FDCWD, "/proc/sys/kernel/random/boot_id", &text) != 0) return std::string();
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    return text;
  }();
  return id;
}

std::shared_ptr<Pool> Pool::open(const std::string& root, bool create, long long sharedGid, bool nonEmpty) {
  std::shared_ptr<Pool> pool(new Pool());
  pool->root_ = root;
  const std::string state = layout::statePath(root);
  const Trust trust{geteuid(), sharedGid};
  pool->rootFd_ = openTrustedPath(root, create, sharedGid >= 0 ? 02770 : 0755, trust);
  pool->stateFd_ = openPoolDir(pool->rootFd_.get(), layout::kStateDir, state, false, 0, trust);
  if (!pool->stateFd_) {
    if (!create) throwErrno(ENOENT, "open", state);
    if (!nonEmpty && hasEntries(pool->rootFd_.get(), root))
      throwCode("ERR_POOL_NOT_EMPTY",
                "'" + root + "' is not a pool and holds other entries; a pool is made in an empty directory unless " +
                    "asked for explicitly",
                ENOTEMPTY, "mkdir", state);
    makeState(pool->rootFd_.get(), root, sharedGid);  // false: another opener made it first, opened below
    pool->stateFd_ = openPoolDir(pool->rootFd_.get(), layout::kStateDir, state, false, 0, trust);
    if (!pool->stateFd_) throwErrno(ENOENT, "open", state);
  }

  // Renames between the root and .vmspace/ must stay on one file system (rename(2) cannot cross them).
  struct stat rootSt, stateSt;
  if (fstat(pool->rootFd_.get(), &rootSt) != 0) throwErrno(errno, "fstat", root);
  if (fstat(pool->stateFd_.get(), &stateSt) != 0) throwErrno(errno, "fstat", state);
  if (rootSt.st_dev != stateSt.st_dev) throwErrno(EXDEV, "open", state, root);
  pool->rootDev_ = rootSt.st_dev;

  // The layout is checked before anything is made inside .vmspace/: a pool of another layout, or one that lost
  // its version or a directory of its own, is refused untouched, never initialised again (its sweep would take
  // what it does not know for dead builds).
  std::string versionPath = layout::statePath(root, layout::kVersion), version;
  int err = readSmallFile(pool->stateFd_.get(), layout::kVersion, &version);
  if (err == ENOENT) throwFormat("'" + state + "' has no version file", versionPath);
  if (err) throwErrno(err, "open", versionPath);
  while (!version.empty() && (version.back() == '\n' || version.back() == ' ')) version.pop_back();
  if (version != layout::kVersionText)
    throwFormat("pool layout '" + version.substr(0, 32) + "' is not this one", versionPath);
  auto own = [&](int at, const std::string& name, const std::string& shown) {
    UniqueFd fd = openPoolDir(at, name.c_str(), shown, false, 0, trust);
    if (!fd) throwFormat("'" + shown + "' is missing", shown);
    return fd;
  };
  auto ownState = [&](const char* name) { return own(pool->stateFd_.get(), name, layout::statePath(root, name)); };
  pool->stagingFd_ = ownState(layout::kStaging);
  pool->trashFd_ = ownState(layout::kTrash);
  pool->leasesFd_ = ownState(layout::kLeases);
  pool->cache_ = std::make_unique<TemplateCache>(ownState(layout::kCache), layout::statePath(root, layout::kCache),
                                                 kDefaultCacheBytes);
  for (int i = 0; i < kStagingShards; i++)
    pool->shardFds_[i] = own(pool->stagingFd_.get(), layout::stagingShardName(i), layout::stagingShardPath(root, i));
  // The lease shards are checked here and then named relative to leases/ ("<x>/<name>"): no fd kept for each.
  for (int i = 0; i < kLeaseShards; i++)
    own(pool->leasesFd_.get(), layout::leaseShardName(i), layout::leaseShardPath(root, layout::leaseShardName(i)));
  pool->noReplaceErr_ = probeNoReplace(pool->stateFd_.get());
  pool->sharedGid_ = sharedGid;
  return pool;
}

// templates/ is made on the first commit: pools without templates have none.
TemplateStore* Pool::templates(bool create) {
  std::lock_guard<std::mutex> hold(templatesMu_);
  if (!templates_) templates_ = TemplateStore::open(stateFd_.get(), root_, trashFd_.get(), create, sharedGid_);
  return templates_.get();
}

int Pool::stagingShard() const {
  // Threads of one process take consecutive shards, processes start at shards spread by their pid.
  static std::atomic<unsigned> next{static_cast<unsigned>(getpid()) * 5u};
  thread_local const int shard = static_cast<int>(next.fetch_add(1, std::memory_order_relaxed) % kStagingShards);
  return shard;
}

std::string Pool::stagingPath(int shard, const std::string& name) const {
  return shard < 0 ? path(name) : layout::stagingShardPath(root_, shard) + "/" + name;
}

bool Pool::inStaging(const std::string& name) const {
  struct stat st;
  for (int i = 0; i < kStagingShards; i++)
    if (fstatat(shardFds_[i].get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return true;
  return false;
}

void Pool::syncLeaseDir(const std::string& name) {
  std::string shard = layout::leaseShardOf(name);
  UniqueFd dir(openat(leasesFd_.get(), shard.c_str(), kDirFlags));
  if (!dir) throwErrno(errno, "open", layout::leaseShardPath(root_, shard));
  if (fsync(dir.get()) != 0) throwErrno(errno, "fsync", layout::leaseShardPath(root_, shard));
}

bool Pool::keepSpare(const std::string& name, int fd) {
  {
    // A place is reserved under the lock and the syscalls run outside it: disposes of other threads go on meanwhile.
    std::lock_guard<std::mutex> hold(sparesMu_);
    if (spares_.size() + sparesPending_ >= kMaxSpares) return false;
    sparesPending_++;
  }
  // Only the file this fd holds: whatever else someone put at the name is not taken for a lease file. Renamed within
  // its shard (no cross-directory rename here); what a sweep sees at a spare's name is a lease held by us.
  struct stat own;
  std::string rel = layout::leaseShardOf(name) + "/" + layout::kSparePrefix + randomHex(8);
  bool kept = fstat(fd, &own) == 0 && sameEntry(leasesFd_.get(), leaseRel(name), own) &&
              renameat2(leasesFd_.get(), leaseRel(name).c_str(), leasesFd_.get(), rel.c_str(), RENAME_NOREPLACE) == 0;
  std::lock_guard<std::mutex> hold(sparesMu_);
  sparesPending_--;
  if (kept) spares_.push_back({UniqueFd(fd), std::move(rel)});
  return kept;
}

int Pool::takeSpare(const std::string& name, const std::string& record) {
  Spare spare;
  {
    std::lock_guard<std::mutex> hold(sparesMu_);
    if (spares_.empty()) {
      errno = ENOENT;
      return -1;
    }
    spare = std::move(spares_.back());
    spares_.pop_back();
  }
  // The record first: the lease file is never at a workspace's name without that workspace's record.
  if (writeRecord(spare.fd.get(), record) == 0 &&
      renameat2(leasesFd_.get(), spare.rel.c_str(), leasesFd_.get(), leaseRel(name).c_str(), RENAME_NOREPLACE) == 0)
    return spare.fd.release();
  int err = errno;
  if (err == EEXIST) {  // the name is taken: the spare stays a spare
    std::lock_guard<std::mutex> hold(sparesMu_);
    spares_.push_back(std::move(spare));
  } else {
    unlinkat(leasesFd_.get(), spare.rel.c_str(), 0);  // not reusable: dropped, as a lease file would be
  }
  errno = err;
  return -1;
}

bool Pool::dropLease(const std::string& name) {
  // The name is the caller's: it holds the lease (or a sweep's take of it), and a lease file is only ever linked
  // under a name no other exists at (makeLeaseFile, linkLeaseFile: EEXIST).
  if (unlinkat(leasesFd_.get(), leaseRel(name).c_str(), 0) == 0) return true;
  if (errno != ENOENT) throwErrno(errno, "unlink", leasePath(name));
  return false;  // a dispose that held it unlinked it meanwhile
}

bool Pool::moveToTrash(const std::string& name) {
  // O_PATH: a guest may have made its directory unreadable (chmod 000), which must not keep it from the trash.
  UniqueFd fd(openat(rootFd_.get(), name.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) {
    if (errno == ENOENT) return false;
    throwErrno(errno, "open", path(name));
  }
  struct stat own;
  if (fstat(fd.get(), &own) != 0) throwErrno(errno, "fstat", path(name));
  // The name disappears from the root atomically; from here on nobody can open or adopt it by name. Without
  // RENAME_NOREPLACE (noReplaceErr_), rename(2) could replace only an empty directory of that name in trash,
  // which is garbage there; what moved is checked below either way.
  auto move = [&] {
    return noReplaceErr_ ? renameat(rootFd_.get(), name.c_str(), trashFd_.get(), name.c_str())
                         : renameat2(rootFd_.get(), name.c_str(), trashFd_.get(), name.c_str(), RENAME_NOREPLACE);
  };
  if (move() != 0) {
    int err = errno;
    // EACCES: moving a directory to another parent rewrites its "..", which needs write permission on it
    // (fs/namei.c, vfs_rename), and a guest may have cleared its owner write bit (chmod 500 .). We own it:
    // give the bit back through the fd we hold and try once more; the first errno is what went wrong otherwise.
    bool retried = false;
    if (err == EACCES && (own.st_mode & S_IWUSR) == 0 && chmodFd(fd.get(), (own.st_mode & 07777) | S_IWUSR) == 0) {
      retried = true;
      if (move() == 0)
        err = 0;
      else if (errno == ENOENT)
        err = ENOENT;
    }
    if (err != 0) {
      if (retried) chmodFd(fd.get(), own.st_mode & 07777);  // best effort: leave its mode as it was
      if (err == ENOENT) return false;
      throwErrno(err, "renameat2", path(name), layout::trashPath(root_, name));
    }
  }
  struct stat moved;
  if (fstatat(trashFd_.get(), name.c_str(), &moved, AT_SYMLINK_NOFOLLOW) != 0)
    throwErrno(errno, "stat", layout::trashPath(root_, name));
  if (moved.st_dev != own.st_dev || moved.st_ino != own.st_ino) {
    // Whatever was at the name is not the directory we opened: put it back untouched.
    renameat2(trashFd_.get(), name.c_str(), rootFd_.get(), name.c_str(), RENAME_NOREPLACE);
    throwErrno(ESTALE, "rename", path(name));
  }
  return true;
}

void Pool::dispose(const std::string& name, int leaseFd, int handoverFd, DisposeHints hints) {
  UniqueFd lease(leaseFd);
  // This process's handover description goes first: what still holds the lease then is another process's.
  if (handoverFd >= 0) ::close(handoverFd);
  int held = leaseHeldByOther(lease.get());
  if (held < 0) throwErrno(-held, "fcntl(F_OFD_GETLK)", leasePath(name));
  if (held > 0)
    throwCode("ERR_LEASE_HELD",
              "another process holds the lease of workspace " + name +
                  " (it was handed over): nothing was removed; it is left to its holder and a sweep once free",
              EWOULDBLOCK, "fcntl(F_OFD_GETLK)", path(name));
  // From here the owner's lock stays held: no sweep or adopt can take the workspace while it is removed.
  // An empty workspace (the common case) is removed at its name: one rmdir(2) changes one directory, where the
  // move into trash and the rmdir there change two, twice (under many workers these directory locks are the
  // bottleneck). rmdir removes only an empty directory and refuses a mount point (EBUSY), and the name vanishes
  // atomically as with the rename. Not for a workspace with a quota of its own: a btrfs subvolume (its own st_dev)
  // or a pool that has project-id claims goes through removeWorkspace, which releases them.
  // Made by this process without a quota (hints.claim false): no claim to release and no subvolume of its own,
  // so rmdir(2) first, the checks below only for what it refuses (not empty, not a directory, a mount).
  if (!hints.claim && unlinkat(rootFd_.get(), name.c_str(), AT_REMOVEDIR) == 0) {
    // Never handed over (no handover fd was opened), so no other process has an fd of it: a spare.
    if (handoverFd < 0 && keepSpare(name, lease.get())) {
      (void)lease.release();
      return;
    }
    dropLease(name);
    return;
  }
  struct stat st;
  bool atName = fstatat(rootFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
  // Something else at its name (a symlink, a file): not the workspace, never followed or removed. The lease file
  // stays: the name is still claimed.
  if (atName && !S_ISDIR(st.st_mode)) throwErrno(ESTALE, "rmdir", path(name));
  bool plain = atName && st.st_dev == rootDev_ && (!hints.claim || claimsIfAny() < 0);
  if (!(plain && unlinkat(rootFd_.get(), name.c_str(), AT_REMOVEDIR) == 0)) {
    // Anything else (not empty, gone, a mount) takes the general path, which reports it.
    bool inTrash = atName && moveToTrash(name);
    // Gone from the root: a dispose that failed before may have left it in trash; its lease is ours, so it is too.
    if (!inTrash) inTrash = fstatat(trashFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
    if (inTrash) removeWorkspace(trashFd_.get(), name, layout::trashPath(root_, name));
  }
  dropLease(name);
}

int Pool::openHandover(const std::string& name, int leaseFd) {
  UniqueFd fd(openLeaseFile(leasesFd_.get(), leaseRel(name)));
  if (!fd) throwErrno(errno, "open", leasePath(name));
  struct stat own, got;
  if (fstat(leaseFd, &own) != 0) throwErrno(errno, "fstat", leasePath(name));
  if (fstat(fd.get(), &got) != 0) throwErrno(errno, "fstat", leasePath(name));
  if (own.st_dev != got.st_dev || own.st_ino != got.st_ino) throwErrno(ESTALE, "open", leasePath(name));
  if (int err = holdLease(fd.get(), LeaseByte::Handover)) throwErrno(err, "fcntl(F_OFD_SETLK)", leasePath(name));
  return fd.release();
}

bool Pool::leaseHandedOver(const std::string& name, int leaseFd) {
  int held = leaseHeldByOther(leaseFd);
  if (held < 0) throwErrno(-held, "fcntl(F_OFD_GETLK)", leasePath(name));
  return held > 0;
}

UniqueFd Pool::openWorkspaceDir(const std::string& name) {
  UniqueFd fd(openat(rootFd_.get(), name.c_str(), kDirFlags));
  if (!fd) throwErrno(errno, "open", path(name));
  return fd;
}

AdoptResult Pool::adopt(const std::string& name) {
  AdoptResult r;
  UniqueFd fd(openLeaseFile(leasesFd_.get(), leaseRel(name)));
  // No lease file: no workspace of vmspace's by that name (an entry there is foreign).
  if (!fd) throwErrno(errno == ELOOP || errno == ENOTDIR ? ENOENT : errno, "open", path(name));
  struct stat st;
  if (fstat(fd.get(), &st) != 0) throwErrno(errno, "fstat", leasePath(name));
  if (!S_ISREG(st.st_mode)) throwErrno(ENOENT, "open", path(name));
  const char* step;
  if (!takeFreeLease(fd.get(), &step)) {
    if (errno == EWOULDBLOCK)
      throwCode("ERR_LEASE_HELD", "another process holds the lease of workspace " + name, EWOULDBLOCK, step,
                path(name));
    throwErrno(errno, step, leasePath(name));
  }
  // A sweep may have removed it between our open and our take: its lease file is then unlinked, and its
  // directory gone from the root.
  if (!sameEntry(leasesFd_.get(), leaseRel(name), st) ||
      !(fstatat(rootFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)))
    throwErrno(ENOENT, "open", path(name));
  if (int err = holdLease(fd.get(), LeaseByte::Owner)) throwErrno(err, "fcntl(F_OFD_SETLK)", leasePath(name));
  flock(fd.get(), LOCK_UN);  // the take ends; the owner's lock holds the workspace from here
  r.recordErrno = readRecord(fd.get(), &r.record);
  r.leaseFd = fd.release();
  return r;
}

void Pool::close() {
  templates_.reset();
  cacheEnabled_ = false;
  cache_.reset();  // its directory fd too: a closed pool holds nothing open (an image-backed one must unmount)
  {
    std::lock_guard<std::mutex> lock(projectsMu_);
    projectsFd_.reset();
  }
  for (Spare& spare : spares_) unlinkat(leasesFd_.get(), spare.rel.c_str(), 0);
  spares_.clear();
  leasesFd_.reset();
  trashFd_.reset();
  for (auto& fd : shardFds_) fd.reset();
  stagingFd_.reset();
  stateFd_.reset();
  rootFd_.reset();
}

}  // namespace vmspace

#include "pool.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <new>
#include <unordered_set>

#include "error.h"
#include "io.h"
#include "json_members.h"
#include "lease.h"
#include "names.h"
#include "remove.h"
#include "rename.h"

namespace vmspace {
namespace {

constexpr size_t kMaxMetaBytes = 16 << 20;

// Who may write the pool: the rule of OpenSSH's safe_path() and systemd's CHASE_SAFE. A directory of the pool, or
// one on the path to it, that another user could write lets that user rename, plant or rewrite workspaces and
// metadata; a symlink another user owns on the path lets them point the pool elsewhere.
struct Trust {
  uid_t euid;
  long long sharedGid;  // -1: none; else members of this group are trusted as the owner is
};

// Why `st` (of an fd opened O_NOFOLLOW, never of a path) is not safe, or nullptr. `ancestor`: a directory above
// the pool root, where a sticky directory writable by all (/tmp) is fine: others cannot rename or remove what
// they do not own in it (and what the walk enters next is checked in turn).
const char* untrustedReason(const struct stat& st, const Trust& t, bool ancestor) {
  bool shared = t.sharedGid >= 0 && static_cast<long long>(st.st_gid) == t.sharedGid;
  bool sticky = ancestor && (st.st_mode & S_ISVTX);
  if (st.st_uid != t.euid && st.st_uid != 0 && !shared)
    return S_ISLNK(st.st_mode) ? "a symlink owned by another user" : "owned by another user";
  if (S_ISLNK(st.st_mode)) return nullptr;  // a symlink's own mode means nothing
  if ((st.st_mode & S_IWOTH) && !sticky) return "writable by others";
  if ((st.st_mode & S_IWGRP) && !sticky && !shared) return "writable by its group";
  return nullptr;
}

void checkTrusted(int fd, const std::string& shown, const Trust& t, bool ancestor) {
  struct stat st;
  if (fstat(fd, &st) != 0) throwErrno(errno, "fstat", shown);
  const char* reason = untrustedReason(st, t, ancestor);
  if (!reason) return;
  char mode[8];
  (void)snprintf(mode, sizeof mode, "0%o", static_cast<unsigned>(st.st_mode & 07777));  // at most 5 characters
  std::string detail = "'" + shown + "' is " + reason + " (uid " + std::to_string(st.st_uid) + ", gid " +
                       std::to_string(st.st_gid) + ", mode " + mode + "); a pool and the directories above it " +
                       "must be writable only by this process's user (uid " + std::to_string(t.euid) + ") or root";
  if (t.sharedGid >= 0) detail += ", or group " + std::to_string(t.sharedGid);
  Error e;
  e.code = "ERR_POOL_UNSAFE";
  e.syscall = "open";
  e.path = shown;
  e.detail = std::move(detail);
  e.uid = st.st_uid;
  e.gid = st.st_gid;
  e.mode = static_cast<int>(st.st_mode & 07777);
  throw e;
}

// Makes directory `name` below `at` with exactly `mode` (and group `gid` when >= 0), whatever the umask: made
// 0700, so it is never more open than meant, then fchown and fchmod on the fd (chown first: it clears setgid).
// False when it existed already.
bool makeDirExact(int at, const char* name, mode_t mode, long long gid, const std::string& shown) {
  if (mkdirat(at, name, 0700) != 0) {
    if (errno == EEXIST) return false;
    throwErrno(errno, "mkdir", shown);
  }
  UniqueFd fd(openat(at, name, kDirFlags));
  if (!fd) throwErrno(errno, "open", shown);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) throwErrno(errno, "fstat", shown);
  // A setgid bit the kernel gave it (inherited from a setgid parent, mkdir(2)) is kept: entries keep that group.
  if (gid < 0)
    mode |= st.st_mode & S_ISGID;
  else if (fchown(fd.get(), static_cast<uid_t>(-1), static_cast<gid_t>(gid)) != 0)
    throwErrno(errno, "fchown", shown);
  if (fchmod(fd.get(), mode) != 0) throwErrno(errno, "fchmod", shown);
  return true;
}

// Opens directory `name` of the pool below `at` (never following a symlink), made with `mode` when missing and
// `create`, and checks it. An empty fd when it is missing and not made.
UniqueFd openPoolDir(int at, const char* name, const std::string& shown, bool create, mode_t mode, const Trust& t) {
  for (;;) {
    UniqueFd fd(openat(at, name, kDirFlags));
    if (fd) {
      checkTrusted(fd.get(), shown, t, false);
      return fd;
    }
    if (errno != ENOENT) throwErrno(errno, "open", shown);
    if (!create) return fd;
    makeDirExact(at, name, mode, t.sharedGid, shown);  // EEXIST: made meanwhile by another process, open it
  }
}

// Pushes the components of `p` onto `todo` so that the first is on top ("." and empty ones dropped).
void pushComponents(std::vector<std::string>* todo, const std::string& p) {
  for (size_t end = p.size(); end > 0;) {
    size_t start = p.rfind('/', end - 1);
    start = start == std::string::npos ? 0 : start + 1;
    if (end > start && p.compare(start, end - start, ".") != 0) todo->push_back(p.substr(start, end - start));
    end = start == 0 ? 0 : start - 1;
  }
}

// The target of the symlink opened O_PATH|O_NOFOLLOW as `fd`; an empty or PATH_MAX-long one is an error.
std::string readLinkTarget(int fd, const std::string& shown) {
  char target[PATH_MAX];
  ssize_t n = readlinkat(fd, "", target, sizeof target);
  if (n < 0) throwErrno(errno, "readlink", shown);
  if (n == 0 || static_cast<size_t>(n) == sizeof target) throwErrno(n == 0 ? ENOENT : ENAMETOOLONG, "readlink", shown);
  return std::string(target, static_cast<size_t>(n));
}

// The absolute path shown for the parent of the absolute `shown` ("/" for "/" and "/x").
std::string parentOf(const std::string& shown) {
  size_t slash = shown.rfind('/');
  return slash == 0 || slash == std::string::npos ? "/" : shown.substr(0, slash);
}

constexpr int kMaxSymlinks = 40;  // as the kernel's path walk (MAXSYMLINKS)

// Opens the directory at the absolute `path` component by component from "/", each with O_PATH|O_NOFOLLOW and
// checked by fstat of that fd (what is checked is what the next step uses: no path is looked up twice). A
// symlink is followed by hand after its owner is checked; `..` steps to the parent, checked again. With
// `create`, missing directories are made, 0755 (the last one `rootMode`), after the directory holding them
// passed. Returns an O_RDONLY fd of the pool root, itself checked as a pool directory (no sticky exception).
UniqueFd openTrustedPath(const std::string& path, bool create, mode_t rootMode, const Trust& t) {
  std::vector<std::string> todo;  // components still to walk, the next one last
  pushComponents(&todo, path);
  auto openRoot = [&] {
    UniqueFd fd(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!fd) throwErrno(errno, "open", "/");
    checkTrusted(fd.get(), "/", t, !todo.empty());
    return fd;
  };
  UniqueFd cur = openRoot();
  std::string shown = "/";
  auto join = [](const std::string& dir, const std::string& name) {
    return dir == "/" ? "/" + name : dir + "/" + name;
  };
  int links = 0;
  // Components at or above this depth of `todo` come from a symlink's target, which must exist as mkdir -p
  // requires (mkdir(2) of a dangling symlink is EEXIST): only components of the path as given are made.
  size_t targetFloor = SIZE_MAX;
  while (!todo.empty()) {
    std::string name = std::move(todo.back());
    todo.pop_back();
    const bool fromTarget = todo.size() >= targetFloor;
    if (!fromTarget) targetFloor = SIZE_MAX;
    std::string next = name == ".." ? parentOf(shown) : join(shown, name);
    UniqueFd fd(openat(cur.get(), name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) {
      // As open(2) of the whole path names it; a symlink's missing target is ENOENT, never made.
      if (errno != ENOENT || !create || fromTarget) throwErrno(errno, "open", path);
      makeDirExact(cur.get(), name.c_str(), todo.empty() ? rootMode : 0755, todo.empty() ? t.sharedGid : -1, next);
      todo.push_back(name);  // made or made meanwhile: open and check it as any other
      continue;
    }
    struct stat st;
    if (fstat(fd.get(), &st) != 0) throwErrno(errno, "fstat", next);
    if (S_ISLNK(st.st_mode)) {
      checkTrusted(fd.get(), next, t, true);
      if (++links > kMaxSymlinks) throwErrno(ELOOP, "open", next);
      std::string to = readLinkTarget(fd.get(), next);
      targetFloor = std::min(targetFloor, todo.size());
      pushComponents(&todo, to);
      if (to[0] == '/') {
        cur = openRoot();
        shown = "/";
      }
      continue;
    }
    if (!S_ISDIR(st.st_mode)) throwErrno(ENOTDIR, "open", next);
    checkTrusted(fd.get(), next, t, !todo.empty());
    cur = std::move(fd);
    shown = std::move(next);
  }
  // "." of an O_PATH fd is that same directory: no path lookup that could be raced.
  UniqueFd dir(openat(cur.get(), ".", kDirFlags));
  if (!dir) throwErrno(errno, "open", shown);
  return dir;
}

// Reads a whole small file below `at` (never following a symlink); returns the errno (0 on success).
int readSmallFile(int at, const std::string& name, std::string* out) {
  return readRegularFileAt(at, name.c_str(), O_NOFOLLOW, kMaxMetaBytes, out);
}

// Writes `data` to a fresh temp file in `dirFd` and publishes it as `name` without replacing (publishFileNoReplace:
// renameat2(RENAME_NOREPLACE), or link + unlink where the file system lacks it). Returns false, leaving nothing
// behind, when `name` exists.
bool writeFileNoReplace(int dirFd, const std::string& name, const std::string& data, bool durable,
                        const std::string& shown) {
  std::string tmp = "." + name + ".tmp-" + randomHex(6);
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

constexpr char kNoReplaceProbe[] = ".noreplace-probe-";  // the sweep removes ownerless ones
constexpr char kInitPrefix[] = ".vmspace.init-";         // a new pool's .vmspace/ while it is built

// Whether the pool's file system takes renameat2(RENAME_NOREPLACE): 0, or the errno with which it refuses the flag
// (EINVAL, ENOSYS: FUSE without rename2, some network file systems). Asked once, by renaming an empty probe file
// in `dirFd` (.vmspace/, which no sweep pass reads but the probe pass).
// Where no probe can be made (read-only, no permission) it counts as supported: nothing can be published there.
int probeNoReplace(int dirFd) {
  std::string probe = kNoReplaceProbe + randomHex(6), moved = probe + "-b";
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

// True when `name` in dirFd (not followed) is the file `own` describes: the identity check of a file held by fd
// against what is at its name now, after anything else could have moved it.
bool sameEntry(int dirFd, const std::string& name, const struct stat& own) {
  struct stat at;
  return fstatat(dirFd, name.c_str(), &at, AT_SYMLINK_NOFOLLOW) == 0 && at.st_ino == own.st_ino &&
         at.st_dev == own.st_dev;
}

bool isHexId(const char* s) {
  for (int i = 0; i < kIdHexChars; i++) {
    char c = s[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return s[kIdHexChars] == 0;
}

// <prefix>-<32 lowercase hex>, prefix non-empty.
bool isWorkspaceName(const char* name) {
  size_t len = strlen(name);
  if (len < kIdHexChars + 2 || name[0] == '.') return false;
  return name[len - kIdHexChars - 1] == '-' && isHexId(name + len - kIdHexChars);
}

std::string shardName(int i) { return "s" + std::to_string(i); }
std::string leaseShardName(int i) { return std::string(1, "0123456789abcdef"[i]); }

// Whether the directory `fd` has an entry other than what concurrent openers make: a half-built .vmspace
// (kInitPrefix), or .vmspace itself, renamed into place since this opener found none.
bool hasEntries(int fd, const std::string& shown) {
  bool any = false;
  forEachName(fd, shown, [&](const struct dirent& e) {
    if (strncmp(e.d_name, kInitPrefix, sizeof kInitPrefix - 1) != 0 && strcmp(e.d_name, ".vmspace") != 0) any = true;
  });
  return any;
}

// Builds a new pool's .vmspace/ whole under a temp name in the root, then renames it into place without
// replacing, so that no opener ever sees a pool without its version or its directories. False when another
// opener's came first (ours is removed).
bool makeState(int rootFd, const std::string& root, long long gid) {
  const std::string tmp = kInitPrefix + randomHex(8), shown = root + "/" + tmp;
  const mode_t stateMode = gid >= 0 ? 02770 : 0755, subMode = gid >= 0 ? 02770 : 0700;
  makeDirExact(rootFd, tmp.c_str(), stateMode, gid, shown);
  auto removeTemp = [&] {
    try {
      removeTreeNoFollow(rootFd, tmp, shown);
    } catch (...) {
      // Left for a sweep (kInitPrefix entries past the grace period); the first error is the one to report.
    }
  };
  try {
    UniqueFd state(openat(rootFd, tmp.c_str(), kDirFlags));
    if (!state) throwErrno(errno, "open", shown);
    writeFileNoReplace(state.get(), "version", std::string(kLayoutVersion) + "\n", false, shown + "/version");
    const std::pair<const char*, int> subs[] = {
        {"staging", kStagingShards}, {"trash", 0}, {"leases", kLeaseShards}, {"cache", 0}};
    for (auto [sub, shards] : subs) {
      std::string subShown = shown + "/" + sub;
      makeDirExact(state.get(), sub, subMode, gid, subShown);
      UniqueFd dir(openat(state.get(), sub, kDirFlags));
      if (!dir) throwErrno(errno, "open", subShown);
      for (int i = 0; i < shards; i++) {
        std::string n = shards == kStagingShards ? shardName(i) : leaseShardName(i);
        makeDirExact(dir.get(), n.c_str(), subMode, gid, subShown + "/" + n);
      }
    }
    int moved = renameat2(rootFd, tmp.c_str(), rootFd, ".vmspace", RENAME_NOREPLACE);
    // Without RENAME_NOREPLACE, rename(2) still never replaces a non-empty .vmspace/ (ENOTEMPTY).
    if (moved != 0 && noReplaceUnsupported(errno)) moved = renameat(rootFd, tmp.c_str(), rootFd, ".vmspace");
    if (moved == 0) return true;
    if (errno != EEXIST && errno != ENOTEMPTY) throwErrno(errno, "renameat2", shown, root + "/.vmspace");
  } catch (...) {
    removeTemp();
    throw;
  }
  removeTemp();
  return false;
}

// Milliseconds since the entry was made: its birth time where the file system records it (statx STATX_BTIME:
// ext4, XFS, btrfs), else its last status change.
int64_t ageMs(int dirFd, const std::string& name) {
  struct statx stx;
  if (statx(dirFd, name.c_str(), AT_SYMLINK_NOFOLLOW, STATX_BTIME | STATX_CTIME, &stx) != 0) return 0;
  struct statx_timestamp t = (stx.stx_mask & STATX_BTIME) ? stx.stx_btime : stx.stx_ctime;
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  return (now.tv_sec - t.tv_sec) * 1000 + (now.tv_nsec - static_cast<long>(t.tv_nsec)) / 1000000;
}

#ifdef VMSPACE_TEST_HOOKS
std::mutex g_faultMutex;
std::vector<SweepFault> g_faults;  // guarded by g_faultMutex
bool g_faultsActive = false;       // read without the mutex: a stale false only delays a fault set meanwhile
#endif

// Whether setSweepFaultsForTest set a fault for `name` of that kind (a probe errno, or bad_alloc when
// `probeErrno` is false); taken when it did (it applies once). Returns the errno, or 1 for bad_alloc; 0: none.
int takeSweepFault(const std::string& name, bool probeErrno) {
#ifndef VMSPACE_TEST_HOOKS
  return 0;  // a release build has no seam
#else
  if (!__atomic_load_n(&g_faultsActive, __ATOMIC_ACQUIRE)) return 0;
  std::lock_guard<std::mutex> hold(g_faultMutex);
  for (auto it = g_faults.begin(); it != g_faults.end(); ++it) {
    if (it->name != name || (it->flockErrno != 0) != probeErrno) continue;
    int err = probeErrno ? it->flockErrno : 1;
    g_faults.erase(it);
    return err;
  }
  return 0;
#endif
}

// Refuses a pool whose .vmspace/ is not this layout: ERR_POOL_FORMAT naming what is wrong, nothing touched.
[[noreturn]] void throwFormat(const std::string& what, const std::string& shown) {
  throwCode("ERR_POOL_FORMAT", what + " (this vmspace reads '" + kLayoutVersion + "' pools only)", 0, "open", shown);
}

}  // namespace

#ifdef VMSPACE_TEST_HOOKS
void setSweepFaultsForTest(std::vector<SweepFault> faults) {
  std::lock_guard<std::mutex> hold(g_faultMutex);
  g_faults = std::move(faults);
  __atomic_store_n(&g_faultsActive, !g_faults.empty(), __ATOMIC_RELEASE);
}
#endif

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
  const std::string state = root + "/.vmspace";
  const Trust trust{geteuid(), sharedGid};
  pool->rootFd_ = openTrustedPath(root, create, sharedGid >= 0 ? 02770 : 0755, trust);
  pool->stateFd_ = openPoolDir(pool->rootFd_.get(), ".vmspace", state, false, 0, trust);
  if (!pool->stateFd_) {
    if (!create) throwErrno(ENOENT, "open", state);
    if (!nonEmpty && hasEntries(pool->rootFd_.get(), root))
      throwCode("ERR_POOL_NOT_EMPTY",
                "'" + root + "' is not a pool and holds other entries; a pool is made in an empty directory unless " +
                    "asked for explicitly",
                ENOTEMPTY, "mkdir", state);
    makeState(pool->rootFd_.get(), root, sharedGid);  // false: another opener made it first, opened below
    pool->stateFd_ = openPoolDir(pool->rootFd_.get(), ".vmspace", state, false, 0, trust);
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
  std::string versionPath = state + "/version", version;
  int err = readSmallFile(pool->stateFd_.get(), "version", &version);
  if (err == ENOENT) throwFormat("'" + state + "' has no version file", versionPath);
  if (err) throwErrno(err, "open", versionPath);
  while (!version.empty() && (version.back() == '\n' || version.back() == ' ')) version.pop_back();
  if (version != kLayoutVersion)
    throwFormat("pool layout '" + version.substr(0, 32) + "' is not this one", versionPath);
  auto own = [&](int at, const std::string& name, const std::string& shown) {
    UniqueFd fd = openPoolDir(at, name.c_str(), shown, false, 0, trust);
    if (!fd) throwFormat("'" + shown + "' is missing", shown);
    return fd;
  };
  pool->stagingFd_ = own(pool->stateFd_.get(), "staging", state + "/staging");
  pool->trashFd_ = own(pool->stateFd_.get(), "trash", state + "/trash");
  pool->leasesFd_ = own(pool->stateFd_.get(), "leases", state + "/leases");
  pool->cache_ = std::make_unique<TemplateCache>(own(pool->stateFd_.get(), "cache", state + "/cache"), state + "/cache",
                                                 kDefaultCacheBytes);
  for (int i = 0; i < kStagingShards; i++)
    pool->shardFds_[i] = own(pool->stagingFd_.get(), shardName(i), state + "/staging/" + shardName(i));
  // The lease shards are checked here and then named relative to leases/ ("<x>/<name>"): no fd kept for each.
  for (int i = 0; i < kLeaseShards; i++)
    own(pool->leasesFd_.get(), leaseShardName(i), state + "/leases/" + leaseShardName(i));
  pool->noReplaceErr_ = probeNoReplace(pool->stateFd_.get());
  pool->sharedGid_ = sharedGid;
  return pool;
}

// templates/ is made on the first commit: pools without templates have none.
TemplateStore* Pool::templates(bool create) {
  std::lock_guard<std::mutex> hold(templatesMu_);
  if (!templates_)
    templates_ = TemplateStore::open(stateFd_.get(), root_ + "/.vmspace", trashFd_.get(), create, sharedGid_);
  return templates_.get();
}

int Pool::stagingShard() const {
  // Threads of one process take consecutive shards, processes start at shards spread by their pid.
  static std::atomic<unsigned> next{static_cast<unsigned>(getpid()) * 5u};
  thread_local const int shard = static_cast<int>(next.fetch_add(1, std::memory_order_relaxed) % kStagingShards);
  return shard;
}

std::string Pool::stagingPath(int shard, const std::string& name) const {
  return shard < 0 ? path(name) : root_ + "/.vmspace/staging/" + shardName(shard) + "/" + name;
}

bool Pool::inStaging(const std::string& name) const {
  struct stat st;
  for (int i = 0; i < kStagingShards; i++)
    if (fstatat(shardFds_[i].get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return true;
  return false;
}

void Pool::syncLeaseDir(const std::string& name) {
  std::string shard = leaseShardOf(name);
  UniqueFd dir(openat(leasesFd_.get(), shard.c_str(), kDirFlags));
  if (!dir) throwErrno(errno, "open", root_ + "/.vmspace/leases/" + shard);
  if (fsync(dir.get()) != 0) throwErrno(errno, "fsync", root_ + "/.vmspace/leases/" + shard);
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
  std::string rel = leaseShardOf(name) + "/.spare-" + randomHex(8);
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

namespace {

// Draws the next name, `prefix` (ending in its "-") and a fresh id, for a workspace; `*tries` counts the draws of one
// build (stage and publish together): ERR_NAME_EXHAUSTED past kMaxNameTries.
void drawName(int* tries, const std::string& prefix, const std::string& root, std::string* id, std::string* name) {
  if (*tries == kMaxNameTries)
    throwCode("ERR_NAME_EXHAUSTED",
              "every one of " + std::to_string(kMaxNameTries) + " names drawn for a workspace existed already", EEXIST,
              "mkdir", root);
  ++*tries;
  *id = randomId();
  *name = prefix + *id;
}

// A workspace's record: the caller's members, then its name, its template and the identity (device, inode, size,
// mtime at clone time) of each source cloned into it.
std::string recordJson(const JsonMembers& info, const std::string& name, const std::string& templateId,
                       const std::vector<ClonedEntry>& clones, Reflink reflink) {
  JsonMembers members = info;
  std::string quoted;
  appendJsonString(&quoted, name);
  members.emplace_back("name", std::move(quoted));
  if (!templateId.empty()) members.emplace_back("templateId", "\"" + templateId + "\"");
  std::string json = "[";
  for (size_t i = 0; i < clones.size(); i++) {
    const ClonedEntry& c = clones[i];
    const SourceIdentity& id = c.identity;
    if (i) json += ",";
    json += "{\"dest\":";
    appendJsonString(&json, c.dest);
    json += ",\"source\":";
    appendJsonString(&json, c.source);
    json += std::string(",\"kind\":\"") + (c.result.tree ? "tree" : "file") + "\",\"dev\":\"" + std::to_string(id.dev) +
            "\",\"ino\":\"" + std::to_string(id.ino) + "\",\"size\":" + std::to_string(id.size) + ",\"mtimeNs\":\"" +
            std::to_string(id.mtimeSec * 1000000000LL + id.mtimeNsec) + "\",\"method\":\"" +
            methodName(c.result, reflink) + "\"}";
  }
  json += "]";
  members.emplace_back("template", std::move(json));
  return jsonObject(members) + "\n";
}

// A request that clones nothing and has no quota: its workspace is complete once made, so it is made at its name
// in the root (no staging entry, no publish rename); its lease file, with the whole record, exists before it.
bool isPlain(const AllocateRequest& req) {
  return req.templateDir.empty() && req.entries.empty() && req.fromTemplate.empty() && !req.quota.any();
}

}  // namespace

// One build of a workspace (Pool::stage): a function per phase. The checks and the template come first, so that a
// refused request leaves nothing; then a name is claimed (its lease file, then its directory or snapshot), and the
// quota and the clones go into it. `direct`: a plain request made at its name in the root, its record written with
// the lease.
class PoolStage {
 public:
  PoolStage(Pool& pool, const AllocateRequest& req, bool direct)
      : pool_(pool), req_(req), direct_(direct), shard_(direct ? -1 : pool.stagingShard()),
        dirFd_(pool.stagingDirFd(shard_)) {}
  // A template being read is released when the build ends, after its lease was dropped (a failure).
  ~PoolStage() {
    if (store_) store_->release(reader_);
  }

  StagedWorkspace run() {
    checkCanBuild();
    acquireTemplate();
    // From a template whose tree is a btrfs subvolume, the workspace is a writable snapshot of it (no walk); where
    // the kernel refuses one (EPERM: a template owned by another user; EXDEV), the walk below.
    snapshot_ = reader_.subvolume && req_.clone.reflink != Reflink::Never;
    UniqueFd lease = claimName();
    std::string stagingPath = pool_.stagingPath(shard_, res_.name);
    try {
      if (direct_) return finish(std::move(lease));  // nothing to put in it
      UniqueFd ws(openat(dirFd_, res_.name.c_str(), kDirFlags));
      if (!ws) throwErrno(errno, "open", stagingPath);
      // The quota is on the empty workspace before anything is cloned in (a project id is inherited from here on).
      if (req_.quota.any())
        res_.quota = applyQuota(ws.get(), stagingPath, quotaSupport_, req_.quota,
                                quotaSupport_.backend == QuotaBackend::Project ? pool_.projectsFd(true) : -1,
                                pool_.projectIds_, res_.name);
      cloneSources(ws.get(), stagingPath);
    } catch (...) {
      abandon(stagingPath);
      throw;
    }
    return finish(std::move(lease));
  }

 private:
  StagedWorkspace finish(UniqueFd lease) {
    res_.lease = std::move(lease);
    res_.draws = tries_;
    res_.shard = shard_;
    return std::move(res_);
  }

  // Refusals before anything is made.
  void checkCanBuild() {
    // A workspace is a directory: without RENAME_NOREPLACE nothing publishes or moves it without the risk of
    // replacing one (rename(2) replaces an empty directory; link(2) takes no directory).
    if (pool_.noReplaceErr_)
      throwCode("ERR_RENAME_NOREPLACE_UNSUPPORTED",
                "the pool's file system cannot rename without replacing (renameat2 RENAME_NOREPLACE), which publishing "
                "a workspace needs",
                pool_.noReplaceErr_, "renameat2", pool_.root_);
    // Quota and free-space floor (quota.h).
    if (req_.quota.any()) {
      quotaSupport_ = probeQuota(pool_.rootFd_.get());
      if (quotaSupport_.err)
        throwCode("ERR_QUOTA_UNSUPPORTED", quotaSupport_.detail, quotaSupport_.err, "quotactl", pool_.root_);
      if (req_.quota.inodes && !quotaSupport_.inodes)
        throwCode("ERR_QUOTA_UNSUPPORTED",
                  "btrfs qgroups limit bytes, not inodes: quota.inodes cannot be enforced here", EINVAL,
                  "ioctl(BTRFS_IOC_QGROUP_LIMIT)", pool_.root_);
    }
    if (pool_.minFreeBytes_ && fsSpace(pool_.rootFd_.get(), pool_.root_).available < pool_.minFreeBytes_)
      throwErrno(ENOSPC, "statvfs", pool_.root_);
    subvolume_ = req_.quota.any() && quotaSupport_.backend == QuotaBackend::Btrfs;
  }

  // A template is resolved and held for reading (flock LOCK_SH) before anything is made, so an unknown one
  // (ERR_TEMPLATE_NOT_FOUND) leaves nothing, and a removal or replace waits for this clone.
  void acquireTemplate() {
    if (req_.fromTemplate.empty()) return;
    TemplateStore* s = pool_.templates(false);
    if (!s)
      throwCode("ERR_TEMPLATE_NOT_FOUND", "no template with the id or name '" + req_.fromTemplate + "'", ENOENT, "open",
                pool_.root_ + "/.vmspace/templates");
    reader_ = s->acquire(req_.fromTemplate);
    store_ = s;
    res_.templateId = reader_.id;
    res_.templateMeta = reader_.metaText;
  }

  // The lease file is the claim on a name: made exclusively and already locked, before anything else is made under
  // that name, so no sweep ever sees a build whose lease is free. EEXIST, of the lease or of the directory (an
  // entry that is not vmspace's), draws a new name; nothing existing is ever adopted.
  UniqueFd claimName() {
    for (;; res_.retries++) {
      drawName(&tries_, req_.prefix + "-", pool_.root_, &res_.id, &res_.name);
      std::string record = direct_ ? recordJson(req_.info, res_.name, "", {}, req_.clone.reflink) : std::string();
      UniqueFd lease(direct_ ? pool_.takeSpare(res_.name, record) : -1);
      if (direct_ && !lease && errno == EEXIST) continue;  // a spare renamed onto a taken name
      const char* step = "open";
      if (!lease)
        lease.reset(makeLeaseFile(pool_.leasesFd_.get(), pool_.leaseRel(res_.name), record, pool_.sharedGid_, &step));
      if (!lease) {
        if (errno == EEXIST) continue;
        throwErrno(errno, step, pool_.leasePath(res_.name));
      }
      int err;
      try {
        err = makeEntry();
      } catch (...) {
        dropLeaseQuietly();
        throw;
      }
      if (err == 0) return lease;
      dropLeaseQuietly();  // EEXIST: draw again
    }
  }

  // The workspace's directory at res_.name in dirFd_: a writable snapshot of the template's subvolume, a btrfs
  // subvolume for a quota, or a directory. 0 (made) or EEXIST (a collision).
  int makeEntry() {
    if (snapshot_) {
      int err = makeWorkspaceSnapshot(reader_.subvolume.get(), dirFd_, res_.name, req_.mode);
      if (err == 0 || err == EEXIST) return err;
      if (err != EPERM && err != EACCES && err != EXDEV && err != ENOTTY && err != EOPNOTSUPP)
        throwErrno(err, "ioctl(BTRFS_IOC_SNAP_CREATE_V2)", pool_.stagingPath(shard_, res_.name));
      snapshot_ = false;  // refused: a directory, cloned into
    }
    int err = makeWorkspaceDir(dirFd_, res_.name, req_.mode, subvolume_);
    if (err != 0 && err != EEXIST)
      throwErrno(err, subvolume_ ? "ioctl(BTRFS_IOC_SUBVOL_CREATE)" : "mkdir", pool_.stagingPath(shard_, res_.name));
    return err;
  }

  void dropLeaseQuietly() {
    try {
      pool_.dropLease(res_.name);
    } catch (...) {
      // Left free (closed by the caller): a sweep removes a lease file whose workspace is gone.
    }
  }

  // A failed build: its entry removed, then its lease file. What cannot be removed stays under a free lease (closed
  // by the caller), which a sweep finishes; the original error is the one to report, whatever the cleanup met.
  void abandon(const std::string& stagingPath) {
    // Out of fds (EMFILE/ENFILE, the removal needs a few): other calls of the process give theirs back within
    // milliseconds, so the removal is tried again for up to ~0.2 s rather than left for a sweep.
    for (int tries = 0;; tries++) {
      try {
        pool_.removeWorkspace(dirFd_, res_.name, stagingPath);
        pool_.dropLease(res_.name);
        return;
      } catch (const Error& e) {
        if (!(e.code.empty() && (e.err == EMFILE || e.err == ENFILE)) || tries == 100) return;
      } catch (...) {
        return;
      }
      struct timespec pause = {0, 2000000L};  // 2 ms
      nanosleep(&pause, nullptr);
    }
  }

  // The template's committed tree (a snapshot made already, or cloned here), then the template directory and the
  // entries of the request, into the leased workspace `wsFd`.
  void cloneSources(int wsFd, const std::string& stagingPath) {
    CloneOptions opts = req_.clone;
    opts.overwrite = false;
    if (store_) {  // the committed tree, then the write bits the commit removed
      ClonedEntry c{"", reader_.treePath, {}, {}};
      if (snapshot_) {
        struct stat st;
        if (fstat(reader_.subvolume.get(), &st) != 0) throwErrno(errno, "fstat", reader_.treePath);
        fillIdentity(&c.identity, st);
        c.result.tree = c.result.snapshot = true;
      } else {
        c.result = cloneTreeInto(reader_.treePath, wsFd, stagingPath, opts, req_.progress, &c.identity);
      }
      store_->restoreModes(reader_, wsFd, stagingPath);
      res_.clones.push_back(std::move(c));
    }
    if (!req_.templateDir.empty()) {
      ClonedEntry c{"", req_.templateDir, {}, {}};
      c.result = cloneTreeInto(req_.templateDir, wsFd, stagingPath, opts, req_.progress, &c.identity);
      res_.clones.push_back(std::move(c));
    }
    opts.cache = pool_.templateCache();  // single files from another file system: reflinked from their cached copy
    for (const TemplateEntry& entry : req_.entries) {
      std::string leaf;
      ParentDir parent = openParentBeneath(wsFd, entry.dest, &leaf, stagingPath, true);
      ClonedEntry c{entry.dest, entry.source, {}, {}};
      c.result = clonePathAt(entry.source, parent.get(), leaf, stagingPath + "/" + entry.dest, opts, req_.progress,
                             &c.identity);
      res_.clones.push_back(std::move(c));
    }
  }

  Pool& pool_;
  const AllocateRequest& req_;
  const bool direct_;  // made at its name in the root, record and all
  const int shard_;    // the staging shard built in (-1: the root)
  const int dirFd_;    // the shard, or the root
  StagedWorkspace res_;
  int tries_ = 0;  // names drawn, first or after a collision: ERR_NAME_EXHAUSTED past kMaxNameTries
  QuotaSupport quotaSupport_;
  bool subvolume_ = false;  // the workspace is a btrfs subvolume (its quota is a qgroup)
  TemplateStore* store_ = nullptr;
  TemplateReader reader_;
  bool snapshot_ = false;  // the workspace is a snapshot of the template's subvolume
};

StagedWorkspace Pool::stage(const AllocateRequest& req) { return PoolStage(*this, req, false).run(); }

AllocateResult Pool::allocate(const AllocateRequest& req) {
  if (!isPlain(req)) return publish(stage(req), req.info, req.clone);
  StagedWorkspace made = PoolStage(*this, req, true).run();
  AllocateResult res;
  if (req.clone.durable) {
    // The lease file (record and name) and the workspace's name, on disk before the call returns.
    if (fsync(made.lease.get()) != 0) throwErrno(errno, "fsync", leasePath(made.name));
    syncLeaseDir(made.name);
    if (fsync(rootFd_.get()) != 0) throwErrno(errno, "fsync", root_);
  }
  res.id = std::move(made.id);
  res.name = std::move(made.name);
  res.retries = made.retries;
  res.leaseFd = made.lease.release();
  return res;
}

void Pool::discard(StagedWorkspace&& staged) {
  UniqueFd lease = std::move(staged.lease);  // dropped last: the entry stays ours while it is removed
  removeWorkspace(stagingDirFd(staged.shard), staged.name, stagingPath(staged.shard, staged.name));
  dropLease(staged.name);
}

// One publish of a staged workspace (Pool::publish): its record written to its lease file, then its name claimed
// in the root, a fresh one drawn on each collision; any failure removes the workspace and its lease file.
class PoolPublish {
 public:
  PoolPublish(Pool& pool, StagedWorkspace&& staged, const JsonMembers& info, const CloneOptions& clone)
      : pool_(pool), info_(info), clone_(clone), lease_(std::move(staged.lease)), projectId_(staged.quota.projectId),
        shard_(staged.shard), dirFd_(pool.stagingDirFd(shard_)),
        tries_(staged.draws) {  // ERR_NAME_EXHAUSTED past kMaxNameTries, counting the stage's draws
    res_.id = std::move(staged.id);
    res_.name = std::move(staged.name);
    res_.retries = staged.retries;
    res_.clones = std::move(staged.clones);
    res_.templateId = std::move(staged.templateId);
    res_.templateMeta = std::move(staged.templateMeta);
  }

  AllocateResult run() {
    try {
      writeRecordOrThrow();
      // The workspace name is claimed with RENAME_NOREPLACE: an existing entry (not vmspace's: its lease file
      // would have collided) is answered with a fresh name, never by adopting it.
      while (!claimName()) redraw();
      if (clone_.durable) {
        if (fsync(lease_.get()) != 0) throwErrno(errno, "fsync", pool_.leasePath(res_.name));
        pool_.syncLeaseDir(res_.name);
        if (fsync(pool_.rootFd_.get()) != 0) throwErrno(errno, "fsync", pool_.root_);
      }
    } catch (...) {
      cleanUp();
      throw;
    }
    res_.leaseFd = lease_.release();
    return std::move(res_);
  }

 private:
  // The record, complete before the workspace is visible at its name; written again after a redraw (it names
  // the workspace).
  void writeRecordOrThrow() {
    std::string json = recordJson(info_, res_.name, res_.templateId, res_.clones, clone_.reflink);
    if (int err = writeRecord(lease_.get(), json)) throwErrno(err, "fsetxattr", pool_.leasePath(res_.name));
  }

  bool claimName() {
    if (renameat2(dirFd_, res_.name.c_str(), pool_.rootFd_.get(), res_.name.c_str(), RENAME_NOREPLACE) == 0) {
      published_ = true;
      return true;
    }
    if (errno != EEXIST) throwErrno(errno, "renameat2", pool_.stagingPath(shard_, res_.name), pool_.path(res_.name));
    return false;
  }

  // A fresh name: the lease file linked under it first (the claim, as at stage), then the staging entry renamed
  // to it, then the old lease name unlinked, so the entry is never without its lease file.
  void redraw() {
    std::string oldName = res_.name;
    for (;;) {
      res_.retries++;
      drawName(&tries_, oldName.substr(0, oldName.size() - res_.id.size()), pool_.root_, &res_.id, &res_.name);
      int err = linkLeaseFile(lease_.get(), pool_.leasesFd_.get(), pool_.leaseRel(res_.name));
      if (err == EEXIST) continue;
      if (err) throwErrno(err, "linkat", pool_.leasePath(res_.name));
      if (renameat2(dirFd_, oldName.c_str(), dirFd_, res_.name.c_str(), RENAME_NOREPLACE) == 0) break;
      err = errno;
      unlinkat(pool_.leasesFd_.get(), pool_.leaseRel(res_.name).c_str(), 0);  // ours: just linked
      if (err != EEXIST)
        throwErrno(err, "renameat2", pool_.stagingPath(shard_, oldName), pool_.stagingPath(shard_, res_.name));
    }
    unlinkat(pool_.leasesFd_.get(), pool_.leaseRel(oldName).c_str(), 0);
    if (projectId_) renameProjectClaim(pool_.projectsFd(false), projectId_, res_.name);  // quota
    writeRecordOrThrow();
  }

  void cleanUp() {
    try {
      if (published_)  // only when the final fsync failed
        pool_.removeWorkspace(pool_.rootFd_.get(), res_.name, pool_.path(res_.name));
      else
        pool_.removeWorkspace(dirFd_, res_.name, pool_.stagingPath(shard_, res_.name));
      pool_.dropLease(res_.name);
    } catch (...) {
      // Left with its lease free (closed below): a sweep reclaims it. The original error is the one to report,
      // whatever the cleanup met (an Error, or bad_alloc).
    }
  }

  Pool& pool_;
  const JsonMembers& info_;
  const CloneOptions& clone_;
  UniqueFd lease_;
  AllocateResult res_;
  const uint32_t projectId_;  // quota: its claim follows the name
  const int shard_;           // the staging shard it was built in
  const int dirFd_;           // that shard
  int tries_;
  bool published_ = false;  // the workspace is in the root (only a final fsync can fail then)
};

AllocateResult Pool::publish(StagedWorkspace&& staged, const JsonMembers& info, const CloneOptions& clone) {
  return PoolPublish(*this, std::move(staged), info, clone).run();
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
      throwErrno(err, "renameat2", path(name), root_ + "/.vmspace/trash/" + name);
    }
  }
  struct stat moved;
  if (fstatat(trashFd_.get(), name.c_str(), &moved, AT_SYMLINK_NOFOLLOW) != 0)
    throwErrno(errno, "stat", root_ + "/.vmspace/trash/" + name);
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
    if (inTrash) removeWorkspace(trashFd_.get(), name, root_ + "/.vmspace/trash/" + name);
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
  if (!takeFreeLease(fd.get())) {
    if (errno == EWOULDBLOCK)
      throwCode("ERR_LEASE_HELD", "another process holds the lease of workspace " + name, EWOULDBLOCK,
                "fcntl(F_OFD_GETLK)", path(name));
    throwErrno(errno, "fcntl(F_OFD_GETLK)", leasePath(name));
  }
  // A sweep may have removed it between our open and our take: its lease file is then unlinked, and its
  // directory gone from the root.
  if (!sameEntry(leasesFd_.get(), leaseRel(name), st) ||
      !(fstatat(rootFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)))
    throwErrno(ENOENT, "open", path(name));
  if (int err = holdLease(fd.get(), LeaseByte::Owner)) throwErrno(err, "fcntl(F_OFD_SETLK)", leasePath(name));
  flock(fd.get(), LOCK_UN);  // the take ends; the owner's lock holds the workspace from here
  r.metaErrno = readRecord(fd.get(), &r.metaText);
  r.leaseFd = fd.release();
  return r;
}

namespace {

// A published workspace as readdir shows it: a directory (or an entry of unknown type) named <prefix>-<32 hex>.
bool isWorkspaceEntry(const std::string& name, unsigned char type) {
  return (type == DT_DIR || type == DT_UNKNOWN) && isWorkspaceName(name.c_str());
}

// What handling one sweep entry threw (call inside a catch), as that entry's error: a core Error as it is;
// std::bad_alloc as ENOMEM, as the binding reports it for a whole call; anything else as ERR_INTERNAL naming it.
Error entryError(const std::string& shown) {
  Error e;
  try {
    throw;
  } catch (const Error& err) {
    return err;
  } catch (const std::bad_alloc&) {
    e = outOfMemoryError();
  } catch (const std::exception& x) {
    e.code = "ERR_INTERNAL";
    e.detail = std::string("unexpected C++ exception: ") + x.what();
  } catch (...) {
    e.code = "ERR_INTERNAL";
    e.detail = "unexpected C++ exception";
  }
  e.path = shown;
  return e;
}

// ENOENT at the entry itself (not below it): the entry is gone, finished by someone else.
bool vanished(const Error& e, const std::string& shown) { return e.code.empty() && e.err == ENOENT && e.path == shown; }

// What removing dirFd/name gives back to the file system: the blocks of its entries less the extents they share
// with other files (reflinked or snapshotted ones stay allocated; FIEMAP_EXTENT_SHARED). False where it cannot be
// told (a tree the walk cannot read): the removal's st_blocks count stands then.
bool freedBytes(int dirFd, const std::string& name, const std::string& shown, uint64_t* out) {
  try {
    UniqueFd ws(openat(dirFd, name.c_str(), kDirFlags));
    if (!ws) return false;
    UsageReport u = workspaceUsage(ws.get(), shown, QuotaRef{}, nullptr);
    *out = u.allocatedBytes > u.sharedBytes ? u.allocatedBytes - u.sharedBytes : 0;
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

// One sweep of a pool (Pool::sweep): a function per pass, and the report and per-entry handling they share.
class PoolSweep {
 public:
  PoolSweep(Pool& pool, bool dryRun, int64_t graceMs)
      : pool_(pool), dryRun_(dryRun), graceMs_(graceMs), trashDir_(pool.root_ + "/.vmspace/trash"),
        stagingDir_(pool.root_ + "/.vmspace/staging") {}

  SweepReport run() {
    publishedPass();
    trashPass();
    stagingPass();
    // Half-built templates, retired templates no one reads, names of commits that died.
    if (TemplateStore* store = pool_.templates(false)) store->sweep(dryRun_, graceMs_, report_);
    pool_.cache_->sweep(dryRun_, graceMs_, report_);  // copies no source needs, and beyond the size budget
    leasePass();
    leftoverPass();
    pool_.sweepProjectClaims(dryRun_, graceMs_);  // quota: project ids of workspaces gone without releasing them
    return std::move(report_);
  }

 private:
  enum class Lease { Free, Held, None };

  // One entry's failure (any errno, or an exception such as std::bad_alloc) is reported in that entry and the
  // sweep goes on: one guest's tree must not stop the reclamation of the whole pool. ENOENT at the entry itself
  // is no failure: a dispose, publish or sweep elsewhere finished it meanwhile.
  template <typename Handle>
  void guarded(const std::string& name, const char* from, const std::string& shown, Handle&& handle) {
    try {
      if (takeSweepFault(name, false)) throw std::bad_alloc();  // test seam
      handle();
    } catch (...) {
      Error err = entryError(shown);
      if (!vanished(err, shown)) report_.failed.push_back({name, from, 0, std::move(err)});
    }
  }

  // The lease of workspace `name`: Free (taken into *out: no other sweep or adopt acts on it until *out closes),
  // Held (its owner or a holder lives, or another sweep is taking it), or None (no lease file: not vmspace's).
  Lease probe(const std::string& name, UniqueFd* out) {
    UniqueFd fd(openLeaseFile(pool_.leasesFd_.get(), pool_.leaseRel(name)));
    if (!fd) {
      if (errno == ENOENT || errno == ELOOP) return Lease::None;
      throwErrno(errno, "open", pool_.leasePath(name));
    }
    struct stat st;
    if (fstat(fd.get(), &st) != 0) throwErrno(errno, "fstat", pool_.leasePath(name));
    if (!S_ISREG(st.st_mode)) return Lease::None;
    bool free = takeFreeLease(fd.get());
    if (int fault = takeSweepFault(name, true)) {  // test seam: a probe failing as no local fs makes it
      free = false;
      errno = fault;
    }
    if (!free) {
      if (errno == EWOULDBLOCK) return Lease::Held;
      throwErrno(errno, "fcntl(F_OFD_GETLK)", pool_.leasePath(name));  // a probe that cannot decide
    }
    *out = std::move(fd);
    return Lease::Free;
  }

  // Removes dirFd/name (shown below dirPath), then its lease file (the caller holds its take), and reports it.
  void reclaim(int dirFd, const std::string& dirPath, const std::string& name, const char* from) {
    SweepEntry e{name, from, 0, {}};
    if (!dryRun_) {
      std::string shown = dirPath + "/" + name;
      bool told = freedBytes(dirFd, name, shown, &e.bytes);
      pool_.removeWorkspace(dirFd, name, shown, told ? nullptr : &e.bytes);
      pool_.dropLease(name);
    }
    report_.reclaimed.push_back(std::move(e));
  }

  // An entry of dirFd named like a workspace without a lease file: reported, unless it is gone meanwhile (a dispose
  // removes the directory, then its lease file, between this sweep's readdir and its look for the lease).
  void foreign(int dirFd, const std::string& name, const std::string& shown) {
    struct stat st;
    if (fstatat(dirFd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) report_.foreign.push_back(shown);
  }

  // Published workspaces: a free lease means the owner and every holder are gone. The take is held while the
  // workspace is moved and removed, so no adopt or other sweep acts on it meanwhile.
  void publishedPass() {
    // `name` below is a plain reference: a C++17 lambda may not capture a structured binding (GCC allows it, clang
    // does not).
    for (auto& entry : readNames(pool_.rootFd_.get(), pool_.root_)) {
      const std::string& name = entry.first;
      if (!isWorkspaceEntry(name, entry.second)) continue;
      guarded(name, "published", pool_.path(name), [&] {
        UniqueFd lease;
        switch (probe(name, &lease)) {
          case Lease::None:
            foreign(pool_.rootFd_.get(), name, pool_.path(name));
            return;
          case Lease::Held:
            report_.live++;
            return;
          case Lease::Free:
            break;
        }
        handled_.insert(name);
        if (dryRun_) {
          report_.reclaimed.push_back({name, "published", 0, {}});
          return;
        }
        if (!pool_.moveToTrash(name)) return;  // disposed or reclaimed by someone else meanwhile
        reclaim(pool_.trashFd_.get(), trashDir_, name, "published");
      });
    }
  }

  // A workspace entry of trash or a staging shard: removed when its lease is free, left while held (a dispose
  // removing it, a build), reported as foreign without a lease file.
  bool hasLeaseFile(const std::string& name) {
    struct stat st;
    return fstatat(pool_.leasesFd_.get(), pool_.leaseRel(name).c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
  }

  void leasedEntry(int dirFd, const std::string& dir, const std::string& name, const char* from) {
    guarded(name, from, dir + "/" + name, [&] {
      UniqueFd lease;
      Lease l = probe(name, &lease);
      if (l == Lease::None) foreign(dirFd, name, dir + "/" + name);
      if (l != Lease::Free) return;
      handled_.insert(name);
      reclaim(dirFd, dir, name, from);
    });
  }

  // Trash: workspaces whose dispose died, and templates (template-<id>) whose removal did; a template there is
  // removed when no one holds its directory's lock.
  void trashPass() {
    for (auto& entry : readNames(pool_.trashFd_.get(), trashDir_)) {
      const std::string& name = entry.first;
      if (handled_.count(name)) continue;  // reported by the pass above, removed or failed
      // A template's entry is named template-<32 hex>, as a workspace of the prefix "template" would be: a workspace
      // has a lease file, a template none.
      bool templateName = name.compare(0, 9, "template-") == 0;
      if (isWorkspaceName(name.c_str()) && !(templateName && !hasLeaseFile(name)))
        leasedEntry(pool_.trashFd_.get(), trashDir_, name, "trash");
      else if (templateName)
        guarded(name, "trash", trashDir_ + "/" + name, [&] { reclaimTemplate(name); });
      else
        foreign(pool_.trashFd_.get(), name, trashDir_ + "/" + name);
    }
  }
  void reclaimTemplate(const std::string& name) {
    UniqueFd fd(openat(pool_.trashFd_.get(), name.c_str(), kDirFlags));
    if (!fd && errno == ENOENT) return;  // finished meanwhile
    if (fd && flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK) return;  // its removal is running
      throwErrno(errno, "flock", trashDir_ + "/" + name);
    }
    SweepEntry e{name, "trash", 0, {}};
    if (!dryRun_) pool_.removeWorkspace(pool_.trashFd_.get(), name, trashDir_ + "/" + name, &e.bytes);
    report_.reclaimed.push_back(std::move(e));
  }

  // Staging: builds whose process died. A build's lease file exists, locked, before its entry does, so no build
  // in progress is ever taken, however young.
  void stagingPass() {
    for (auto& entry : readNames(pool_.stagingFd_.get(), stagingDir_))
      if (!isShardName(entry.first)) foreign(pool_.stagingFd_.get(), entry.first, stagingDir_ + "/" + entry.first);
    for (int i = 0; i < kStagingShards; i++) {
      std::string dir = stagingDir_ + "/" + shardName(i);
      for (auto& entry : readNames(pool_.shardFds_[i].get(), dir)) {
        if (isWorkspaceName(entry.first.c_str()))
          leasedEntry(pool_.shardFds_[i].get(), dir, entry.first, "staging");
        else
          foreign(pool_.shardFds_[i].get(), entry.first, dir + "/" + entry.first);
      }
    }
  }
  static bool isShardName(const std::string& name) {
    for (int i = 0; i < kStagingShards; i++)
      if (name == shardName(i)) return true;
    return false;
  }

  // Whether a directory of workspace `name` exists anywhere in the pool (root, a shard, trash).
  bool hasEntry(const std::string& name) {
    struct stat st;
    return pool_.inStaging(name) || fstatat(pool_.rootFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 ||
           fstatat(pool_.trashFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
  }

  // Lease files whose workspace is gone (a build that died before its directory was made, a dispose that died
  // after it was removed), and temp lease files (file systems without O_TMPFILE) of builds that died.
  void leasePass() {
    for (int i = 0; i < kLeaseShards; i++) {
      std::string dir = pool_.root_ + "/.vmspace/leases/" + leaseShardName(i);
      UniqueFd shard(openat(pool_.leasesFd_.get(), leaseShardName(i).c_str(), kDirFlags));
      if (!shard) throwErrno(errno, "open", dir);
      int dirFd = shard.get();
      for (auto& entry : readNames(dirFd, dir)) {
        const std::string& file = entry.first;  // not a structured binding: the lambda below captures it (clang)
        bool spare = file.compare(0, 7, ".spare-") == 0;
        if (spare || file.compare(0, 5, ".tmp-") == 0) {
          // A spare is held while its process lives: free, that process is gone. A temp one may be a build's that
          // has not taken its lock yet: free and past the grace period.
          UniqueFd fd(openLeaseFile(dirFd, file));
          if (!fd || (!spare && ageMs(dirFd, file) < graceMs_) || !takeFreeLease(fd.get())) continue;
          // Counted once: another sweep may have unlinked it between our take and our unlink.
          if (dryRun_ || unlinkat(dirFd, file.c_str(), 0) == 0) report_.leasesRemoved++;
          continue;
        }
        if (!isWorkspaceName(file.c_str()) || handled_.count(file)) continue;
        guarded(file, "lease", dir + "/" + file, [&] {
          UniqueFd lease;
          if (probe(file, &lease) != Lease::Free || hasEntry(file)) return;  // an entry left: the next sweep's
          if (dryRun_ || pool_.dropLease(file)) report_.leasesRemoved++;
        });
      }
    }
  }

  // What a killed opener left: RENAME_NOREPLACE probe files in .vmspace/ (probeNoReplace), half-built
  // .vmspace/ directories in the root (makeState). Each lives for microseconds, so one older than the grace
  // period has no owner left.
  void leftoverPass() {
    if (dryRun_) return;
    for (auto& [file, type] : readNames(pool_.stateFd_.get(), pool_.root_ + "/.vmspace")) {
      if (file.compare(0, sizeof kNoReplaceProbe - 1, kNoReplaceProbe) != 0 || type == DT_DIR) continue;
      if (ageMs(pool_.stateFd_.get(), file) < graceMs_) continue;
      unlinkat(pool_.stateFd_.get(), file.c_str(), 0);  // quietly: an opener or another sweep may remove it first
    }
    for (auto& [file, type] : readNames(pool_.rootFd_.get(), pool_.root_)) {
      if (file.compare(0, sizeof kInitPrefix - 1, kInitPrefix) != 0 || type != DT_DIR) continue;
      if (ageMs(pool_.rootFd_.get(), file) < graceMs_) continue;
      try {
        removeTreeNoFollow(pool_.rootFd_.get(), file, pool_.root_ + "/" + file);
      } catch (...) {
        // left for a later sweep
      }
    }
  }

  Pool& pool_;
  const bool dryRun_;
  const int64_t graceMs_;
  const std::string trashDir_, stagingDir_;
  SweepReport report_;
  std::unordered_set<std::string> handled_;  // workspaces this sweep reclaimed (or failed to)
};

SweepReport Pool::sweep(bool dryRun, int64_t graceMs) { return PoolSweep(*this, dryRun, graceMs).run(); }

std::vector<ListEntry> Pool::list() {
  std::vector<ListEntry> out;
  for (auto& [name, type] : readNames(rootFd_.get(), root_)) {
    if (!isWorkspaceEntry(name, type)) continue;
    UniqueFd lease(openLeaseFile(leasesFd_.get(), leaseRel(name)));
    // No lease file: not vmspace's, or disposed meanwhile (the lease file goes last).
    if (!lease && (errno == ENOENT || errno == ELOOP)) continue;
    struct stat st;
    if (lease && (fstat(lease.get(), &st) != 0 || !S_ISREG(st.st_mode))) continue;  // no lease file: not vmspace's
    ListEntry entry;
    entry.name = name;
    if (!lease) {
      // Any other failure (EACCES, EMFILE, ...) is that entry's error, counted live (never reported reclaimable on
      // its word): a workspace whose lease cannot be opened is not hidden from the listing.
      entry.probeErrno = errno;
      entry.probeSyscall = "open";
      entry.live = true;
      out.push_back(std::move(entry));
      continue;
    }
    entry.metaErrno = readRecord(lease.get(), &entry.metaText);
    // The probe takes no lock: a listing never gets in the way of an adopt or a sweep.
    int held = leaseHeldByOther(lease.get());
    if (int fault = takeSweepFault(name, true)) held = -fault;  // test seam (setSweepFaultsForTest), as in sweep
    // A probe that cannot decide (ENOLCK, ...) is reported in that entry, counted live (never reclaimable on its
    // word), and the listing goes on: one entry does not hide the others.
    if (held < 0) entry.probeErrno = -held;
    entry.live = held != 0;
    // Disposed between the readdir and the open: its directory is gone from its name.
    if (fstatat(rootFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT) continue;
    out.push_back(std::move(entry));
  }
  return out;
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

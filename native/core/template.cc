#include "template.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <set>
#include <unordered_map>
#include <utility>

#include "error.h"
#include "io.h"
#include "json_members.h"
#include "names.h"
#include "pool.h"
#include "quota.h"
#include "remove.h"
#include "rename.h"
#include "statx.h"
#include "trusted.h"

namespace vmspace {
namespace {

// A template's mode list ("modes" in `dirFd`) as a stdio stream, closed by its owner; `flags` add to
// O_CLOEXEC|O_NOCTTY (0600 when created), `mode` is fdopen's.
using ModesFile = std::unique_ptr<FILE, int (*)(FILE*)>;
ModesFile openModesFile(int dirFd, int flags, const char* mode, const std::string& shown) {
  int fd = openat(dirFd, "modes", flags | O_CLOEXEC | O_NOCTTY, 0600);
  if (fd < 0) throwErrno(errno, "open", shown);
  FILE* f = fdopen(fd, mode);
  if (!f) {
    int err = errno;
    ::close(fd);
    throwErrno(err, "fdopen", shown);
  }
  return ModesFile(f, fclose);
}

constexpr size_t kMaxTemplateMetaBytes = 16 << 20;
constexpr int kMaxResolveTries = 16;  // a name swapped or removed under a reader this often in a row: not found

[[noreturn]] void notFound(const std::string& idOrName, const std::string& shown) {
  throwCode("ERR_TEMPLATE_NOT_FOUND", "no template with the id or name '" + idOrName + "'", ENOENT, "open", shown);
}

// A new file `name` in the private directory `dirFd` with exactly `data` and `mode`.
void writeNewFile(int dirFd, const char* name, const std::string& data, mode_t mode, bool durable,
                  const std::string& shown) {
  UniqueFd fd(openat(dirFd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600));
  if (!fd) throwErrno(errno, "open", shown);
  if (int err = writeAll(fd.get(), data)) throwErrno(err, "write", shown);
  if (fchmod(fd.get(), mode) != 0) throwErrno(errno, "fchmod", shown);
  if (durable && fsync(fd.get()) != 0) throwErrno(errno, "fsync", shown);
}

// The mode list (`modes` in a template): the write bits a commit removed, as a walk of the tree replays them.
// Records, each ending in NUL: "m<3 octal digits><name>" (an entry of the current directory had those write
// bits), "d<name>" (into that subdirectory), "u" (back to the parent), "r<3 octal digits>" (the root's own).
// Relative to the walk, never full paths: the list grows with the entries, not with depth times entries.

// Moves `cur` to its parent, checked to be the directory `expect` (device and inode) that the walk came from.
void walkUp(UniqueFd& cur, const struct stat& expect, const std::string& shown) {
  UniqueFd up(openat(cur.get(), "..", kDirFlags));
  if (!up) throwErrno(errno, "open", shown);
  struct stat st;
  if (fstat(up.get(), &st) != 0) throwErrno(errno, "fstat", shown);
  if (st.st_dev != expect.st_dev || st.st_ino != expect.st_ino) throwErrno(ESTALE, "open", shown);
  cur = std::move(up);
}

// Removes the write bits of every entry of the private tree `rootFd` but symlinks (whose mode means nothing),
// recording them in `manifest` (the mode list above), so that a clone can get them back (restoreModes). Adds the
// tree's allocated bytes (st_blocks * 512, hard links once) to *allocated. One directory fd is open at a time
// (the walk goes down by name and up through "..", checked by device and inode), and memory holds the names of
// one directory per level: any depth a clone handles, this handles. The tree is our own build in staging.
// With `strip` false (a read-only subvolume, whose modes stay) it only measures.
void stripWriteBits(int rootFd, const std::string& shown, FILE* manifest, uint64_t* allocated, bool strip) {
  std::set<std::pair<dev_t, ino_t>> linked;  // inodes with several links already counted
  auto put = [&](char kind, mode_t bits, const std::string& name) {
    bool ok = kind == 'm' || kind == 'r' ? fprintf(manifest, "%c%03o", kind, static_cast<unsigned>(bits)) == 4
                                         : fputc(kind, manifest) != EOF;
    if (!ok || fwrite(name.c_str(), 1, name.size() + 1, manifest) != name.size() + 1)
      throwErrno(errno ? errno : EIO, "write", shown);
  };
  struct Level {
    std::vector<std::pair<std::string, unsigned char>> names;
    size_t next = 0;
    struct stat st;
  };
  std::vector<Level> stack(1);
  std::string rel;  // of `cur` below the root, for errors only (grows with depth, not with entries)
  UniqueFd cur(fcntl(rootFd, F_DUPFD_CLOEXEC, 0));
  if (!cur) throwErrno(errno, "fcntl", shown);
  if (fstat(cur.get(), &stack[0].st) != 0) throwErrno(errno, "fstat", shown);
  const struct stat rootSt = stack[0].st;
  *allocated += static_cast<uint64_t>(rootSt.st_blocks) * 512;
  stack[0].names = readNames(cur.get(), shown);
  while (!stack.empty()) {
    Level& top = stack.back();
    if (top.next == top.names.size()) {
      stack.pop_back();
      if (stack.empty()) break;
      walkUp(cur, stack.back().st, shown + rel);
      rel.erase(rel.rfind('/'));
      if (strip) put('u', 0, "");
      continue;
    }
    const std::string name = top.names[top.next++].first;
    struct stat st;
    if (fstatat(cur.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
      throwErrno(errno, "stat", shown + rel + "/" + name);
    if (!S_ISDIR(st.st_mode) && st.st_nlink > 1 && !linked.insert({st.st_dev, st.st_ino}).second) continue;
    *allocated += static_cast<uint64_t>(st.st_blocks) * 512;
    if (S_ISLNK(st.st_mode)) continue;
    if (strip && (st.st_mode & 0222)) {
      put('m', st.st_mode & 0222, name);
      if (fchmodat(cur.get(), name.c_str(), st.st_mode & 07777 & ~0222, 0) != 0)
        throwErrno(errno, "chmod", shown + rel + "/" + name);
    }
    if (!S_ISDIR(st.st_mode)) continue;
    UniqueFd down(openat(cur.get(), name.c_str(), kDirFlags));
    if (!down) throwErrno(errno, "open", shown + rel + "/" + name);
    Level level;
    level.st = st;
    level.names = readNames(down.get(), shown + rel + "/" + name);
    cur = std::move(down);
    rel += "/" + name;
    if (strip) put('d', 0, name);
    stack.push_back(std::move(level));
  }
  if (strip && (rootSt.st_mode & 0222)) {
    put('r', rootSt.st_mode & 0222, "");
    if (fchmod(rootFd, rootSt.st_mode & 07777 & ~0222) != 0) throwErrno(errno, "fchmod", shown);
  }
}

// Whether the directory `fd` is on btrfs (where a template's tree is a read-only subvolume).
bool isSubvolumeFs(int fd) {
  struct statfs sfs;
  return fstatfs(fd, &sfs) == 0 && static_cast<unsigned long>(sfs.f_type) == BTRFS_SUPER_MAGIC;
}

// Snapshots the workspace at `sourcePath` read-only to tree/ below `leaseFd` when it is a subvolume (quota
// workspaces and workspaces allocated from a subvolume template are) with no subvolume inside (a snapshot would
// leave those out). False where it is not, or where the kernel refuses the snapshot (EPERM: a source owned by
// another user; EXDEV: another file system): the caller walks instead. Throws any other errno.
bool snapshotWorkspace(const std::string& sourcePath, int leaseFd) {
  UniqueFd src(open(sourcePath.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY));
  if (!src) throwErrno(errno, "open", sourcePath);
  bool nested = true;
  if (!isSubvolumeRoot(src.get()) || hasChildSubvolumes(src.get(), &nested) != 0 || nested) return false;
  int err = snapshotSubvolume(src.get(), leaseFd, "tree", true);
  if (err == 0) return true;
  if (err == EPERM || err == EACCES || err == EXDEV || err == ENOTTY || err == EINVAL || err == EOPNOTSUPP)
    return false;
  throwErrno(err, "ioctl(BTRFS_IOC_SNAP_CREATE_V2)", sourcePath);
}

}  // namespace

void removeTemplateDir(int parentFd, const std::string& name, const std::string& shown, uint64_t* bytes) {
  UniqueFd dir(openat(parentFd, name.c_str(), kDirFlags));
  if (dir) dropReadOnlySubvolume(dir.get(), "tree");
  dir.reset();
  removeTreeNoFollow(parentFd, name, shown, bytes);
}

bool isTemplateName(const std::string& name) {
  if (name.empty() || name.size() > 128 || isHexId(name)) return false;
  for (size_t i = 0; i < name.size(); i++) {
    char c = name[i];
    bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    if (!alnum && (i == 0 || (c != '.' && c != '_' && c != '-'))) return false;
  }
  return true;
}

std::unique_ptr<TemplateStore> TemplateStore::open(int stateFd, const std::string& statePath, int trashFd, bool create,
                                                   long long sharedGid) {
  std::unique_ptr<TemplateStore> s(new TemplateStore());
  s->dir_ = statePath + "/templates";
  s->trashDir_ = statePath + "/trash";
  s->trashFd_ = trashFd;
  s->sharedGid_ = sharedGid;
  // Checked as every directory of the pool (trusted.h), made with the mode of the pool's own: 0700, or 02770 in
  // the shared group.
  const Trust trust{geteuid(), sharedGid};
  const mode_t mode = sharedGid >= 0 ? 02770 : 0700;
  s->fd_ = openPoolDir(stateFd, "templates", s->dir_, create, mode, trust);
  if (!s->fd_) return nullptr;
  // The subdirectories are made whenever they are missing: a pool whose templates/ an older build of this
  // code made (or a process killed between two mkdirs) is completed, never refused.
  s->stagingFd_ = openPoolDir(s->fd_.get(), "staging", s->dir_ + "/staging", true, mode, trust);
  s->namesFd_ = openPoolDir(s->fd_.get(), "names", s->dir_ + "/names", true, mode, trust);
  s->retiredFd_ = openPoolDir(s->fd_.get(), "retired", s->dir_ + "/retired", true, mode, trust);
  return s;
}

// One commit of a template (TemplateStore::commit): a function per phase. An id is claimed in staging and leased;
// the tree is made there (a snapshot, or a subvolume or directory the walk fills), its write bits stripped into the
// mode list, template.json written; then it is published under its id and named (claimed, or swapped in for
// replace), and a template it replaced is removed. Any failure before the end removes what it made.
class TemplateCommit {
 public:
  TemplateCommit(TemplateStore& store, const CommitRequest& req)
      : store_(store), req_(req), nameShown_(store.dir_ + "/names/" + req.name) {
    opts_ = req.clone;
    opts_.overwrite = false;
  }

  CommitResult run() {
    // Refused before anything is built; the symlinkat below decides for real.
    if (!req_.name.empty() && !req_.replace && entryExists(store_.namesFd_.get(), req_.name))
      throwErrno(EEXIST, "symlink", nameShown_);
    UniqueFd lease = claimLease();
    try {
      makeTree(lease.get());
      UniqueFd tree(openat(lease.get(), "tree", kDirFlags));
      if (!tree) throwErrno(errno, "open", stagingPath_ + "/tree");
      writeModes(lease.get(), tree.get());
      writeMeta(lease.get(), tree.get());
      publish(lease.get());
      if (!req_.name.empty() && req_.replace) swapName();
      lease.reset();
    } catch (...) {
      cleanUp();
      throw;
    }
    // Replaced by another commit while we held the lease (its removal could not lock it): now that the lease is
    // dropped, removed here, as a last reader would, unless someone reads it (then that reader, or a sweep, does).
    try {
      if (entryExists(store_.retiredFd_.get(), res_.id)) store_.removeIfFree(res_.id, -1);
    } catch (const Error&) {
      // Left retired: a sweep removes it.
    }
    if (!res_.replacedId.empty()) removeReplaced();
    return std::move(res_);
  }

 private:
  // A fresh id in staging, leased: flock(LOCK_EX) on its directory, which a sweep honours. A sweep with graceMs 0
  // may take the lease between our mkdir and flock and remove the entry: then the entry is no longer the one we
  // locked (checked by device and inode) and a new id is claimed, so a build never works in a swept entry.
  UniqueFd claimLease() {
    for (int tries = 0;; tries++) {
      claimId();
      stagingPath_ = store_.dir_ + "/staging/" + res_.id;
      UniqueFd lease(openat(store_.stagingFd_.get(), res_.id.c_str(), kDirFlags));
      if (!lease && errno != ENOENT) throwErrno(errno, "open", stagingPath_);
      if (lease) {
        if (flock(lease.get(), LOCK_EX) != 0) throwErrno(errno, "flock", stagingPath_);
        struct stat own;
        if (fstat(lease.get(), &own) != 0) throwErrno(errno, "fstat", stagingPath_);
        if (sameEntry(store_.stagingFd_.get(), res_.id, own)) return lease;
      }
      if (tries + 1 == kMaxNameTries) throwErrno(ENOENT, "open", stagingPath_);
    }
  }

  // The exclusive mkdir in staging claims a fresh id.
  void claimId() {
    for (int tries = 0;; tries++) {
      if (tries == kMaxNameTries)
        throwCode("ERR_NAME_EXHAUSTED", "every template id drawn existed already", EEXIST, "mkdir",
                  store_.dir_ + "/staging");
      res_.id = randomId();
      if (mkdirat(store_.stagingFd_.get(), res_.id.c_str(), 0700) == 0) break;
      if (errno != EEXIST) throwErrno(errno, "mkdir", store_.dir_ + "/staging/" + res_.id);
    }
  }

  // tree/ below the lease. On btrfs (reflink not 'never') the tree is a read-only subvolume (see template.h): a
  // snapshot of a workspace that is a subvolume, else a subvolume the walk fills and that is then made read-only.
  void makeTree(int leaseFd) {
    const bool subvolume = opts_.reflink != Reflink::Never && isSubvolumeFs(leaseFd);
    if (subvolume) res_.clone.snapshot = snapshotWorkspace(req_.sourcePath, leaseFd);
    if (!res_.clone.snapshot) {
      // A subvolume where one can be made (any user may: BTRFS_IOC_SUBVOL_CREATE needs only write access to
      // staging); where it is refused, a plain directory, whose template is then read-only by its modes only.
      bool sub = subvolume && makeWorkspaceDir(leaseFd, "tree", 0700, true) == 0;
      if (!sub && mkdirat(leaseFd, "tree", 0700) != 0) throwErrno(errno, "mkdir", stagingPath_ + "/tree");
      UniqueFd tree(openat(leaseFd, "tree", kDirFlags));
      if (!tree) throwErrno(errno, "open", stagingPath_ + "/tree");
      res_.clone = cloneTreeInto(req_.sourcePath, tree.get(), stagingPath_ + "/tree", opts_, req_.progress);
      res_.readOnlySubvolume = sub;
    }
    res_.clone.tree = true;
    res_.readOnlySubvolume = res_.readOnlySubvolume || res_.clone.snapshot;
  }

  // The mode list (stripWriteBits), read-only once written.
  void writeModes(int leaseFd, int treeFd) {
    const std::string modesShown = stagingPath_ + "/modes";
    ModesFile closer = openModesFile(leaseFd, O_WRONLY | O_CREAT | O_EXCL, "w", modesShown);
    FILE* f = closer.get();
    // A read-only subvolume keeps its modes (the flag refuses every write, root's included): the mode list
    // stays empty, and a walk is made only where one made the tree already (to measure it).
    if (!res_.clone.snapshot)
      stripWriteBits(treeFd, stagingPath_ + "/tree", f, &res_.allocatedBytes, !res_.readOnlySubvolume);
    if (fflush(f) != 0) throwErrno(errno, "write", modesShown);
    if (fchmod(fileno(f), 0444) != 0) throwErrno(errno, "fchmod", modesShown);
    if (opts_.durable && fsync(fileno(f)) != 0) throwErrno(errno, "fsync", modesShown);
    FILE* done = closer.release();
    if (fclose(done) != 0) throwErrno(errno, "close", modesShown);
  }

  // template.json and the last-used file, then the tree made read-only.
  void writeMeta(int leaseFd, int treeFd) {
    // The caller's members, then those known here: the id, the name, how it was cloned, its usage.
    JsonMembers members = req_.info;
    std::string name;
    if (req_.name.empty())
      name = "null";
    else
      appendJsonString(&name, req_.name);
    members.emplace_back("id", "\"" + res_.id + "\"");
    members.emplace_back("name", std::move(name));
    members.emplace_back("method", std::string("\"") + methodName(res_.clone, req_.clone.reflink) + "\"");
    if (res_.readOnlySubvolume) members.emplace_back("subvolume", "true");
    // A snapshot does not walk the tree, so it is not measured: no usage (what it shares is the workspace's).
    if (!res_.clone.snapshot)
      members.emplace_back("usage", "{\"allocatedBytes\":" + std::to_string(res_.allocatedBytes) +
                                        ",\"files\":" + std::to_string(res_.clone.files) +
                                        ",\"bytes\":" + std::to_string(res_.clone.bytes) + "}");
    std::string json = jsonObject(members) + "\n";
    writeNewFile(leaseFd, "template.json", json, 0444, opts_.durable, stagingPath_ + "/template.json");
    res_.metaText = json;
    writeNewFile(leaseFd, "used", "", 0644, false, stagingPath_ + "/used");
    if (opts_.durable && (fsync(treeFd) != 0 || fsync(leaseFd) != 0)) throwErrno(errno, "fsync", stagingPath_);
    // Read-only last (a snapshot was made so): the tree cannot change from here on, whoever holds it.
    if (res_.readOnlySubvolume && !res_.clone.snapshot) {
      if (int err = setSubvolumeReadOnly(treeFd, true))
        throwErrno(err, "ioctl(BTRFS_IOC_SUBVOL_SETFLAGS)", stagingPath_ + "/tree");
    }
  }

  // Publish. Without replace the name is claimed first (symlinkat never replaces: EEXIST, nothing changed),
  // so a name never points at a template another commit of the same name published.
  void publish(int leaseFd) {
    if (!req_.name.empty() && !req_.replace) {
      if (symlinkat(res_.id.c_str(), store_.namesFd_.get(), req_.name.c_str()) != 0)
        throwErrno(errno, "symlink", nameShown_);
      named_ = true;
    }
    if (renameat2(store_.stagingFd_.get(), res_.id.c_str(), store_.fd_.get(), res_.id.c_str(), RENAME_NOREPLACE) != 0)
      throwErrno(errno, "renameat2", stagingPath_, store_.path(res_.id));
    published_ = true;
    // 0555 only once published: moving a directory to another parent needs write permission on it (the kernel
    // rewrites its ".."; vfs_rename), which an owner without CAP_DAC_OVERRIDE lacks on a 0555 one (EACCES).
    if (fchmod(leaseFd, 0555) != 0) throwErrno(errno, "fchmod", store_.path(res_.id));
    if (opts_.durable && fsync(store_.fd_.get()) != 0) throwErrno(errno, "fsync", store_.dir_);
  }

  // Replace: the name's new target is swapped in with RENAME_EXCHANGE: a reader resolving it sees the old template
  // or the new one, never no name. The swapped-out link tells which template was replaced.
  void swapName() {
    const int namesFd = store_.namesFd_.get();
    // Named after the new id, whose directory the commit holds LOCK_EX on until the swap is done: a sweep leaves
    // the link while that lock is held, whatever graceMs (TemplateStore::sweep).
    std::string tmp = "." + req_.name + ".new-" + res_.id;
    if (symlinkat(res_.id.c_str(), namesFd, tmp.c_str()) != 0)
      throwErrno(errno, "symlink", store_.dir_ + "/names/" + tmp);
    UniqueFd namesLock;
    try {
      namesLock = store_.lockNames();
    } catch (const Error&) {
      unlinkat(namesFd, tmp.c_str(), 0);
      throw;
    }
    for (;;) {
      if (renameat2(namesFd, tmp.c_str(), namesFd, req_.name.c_str(), RENAME_EXCHANGE) == 0) {
        named_ = true;
        std::string old;
        if (readLink(namesFd, tmp, &old) && isHexId(old) && old != res_.id) res_.replacedId = old;
        unlinkat(namesFd, tmp.c_str(), 0);  // ours; a leftover is swept as a temp name
        return;
      }
      if (errno == ENOENT) {  // no such name yet: claim it as a plain commit would
        if (renameat2(namesFd, tmp.c_str(), namesFd, req_.name.c_str(), RENAME_NOREPLACE) == 0) {
          named_ = true;
          return;
        }
        if (errno == EEXIST) continue;  // claimed meanwhile: swap with that one
      }
      int err = errno;
      unlinkat(namesFd, tmp.c_str(), 0);
      throwErrno(err, "renameat2", store_.dir_ + "/names/" + tmp, nameShown_);
    }
  }

  void cleanUp() {
    try {
      std::string target;
      UniqueFd namesLock = named_ && !req_.replace ? store_.lockNames() : UniqueFd();
      if (named_ && !req_.replace && readLink(store_.namesFd_.get(), req_.name, &target) && target == res_.id)
        unlinkat(store_.namesFd_.get(), req_.name.c_str(), 0);
      if (published_)
        store_.removeIfFree(res_.id, -1);  // never named: no reader can hold it
      else
        removeTemplateDir(store_.stagingFd_.get(), res_.id, stagingPath_);
    } catch (...) {
      // Left for a sweep; the original error is the one to report.
    }
  }

  // The new template is published and named: the commit has succeeded whatever happens to the old one here.
  // Marked before the removal is tried, so that a reader holding it removes it when it is done. Where the
  // marker cannot be made (EMFILE, ENOSPC), the old template stays as an unnamed one (replacedRemoved false;
  // removeTemplate or pruneTemplates removes it).
  void removeReplaced() {
    try {
      UniqueFd marker(
          openat(store_.retiredFd_.get(), res_.replacedId.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY, 0600));
      if (marker) {
        marker.reset();
        res_.replacedRemoved = store_.removeIfFree(res_.replacedId, -1);
      }
    } catch (const Error&) {
      res_.replacedRemoved = false;  // left in trash or retired: a sweep finishes it
    }
  }

  TemplateStore& store_;
  const CommitRequest& req_;
  const std::string nameShown_;
  CloneOptions opts_;
  CommitResult res_;
  std::string stagingPath_;
  bool named_ = false, published_ = false;  // what a failure undoes: the name claimed, the template published
};

CommitResult TemplateStore::commit(const CommitRequest& req) { return TemplateCommit(*this, req).run(); }

std::string TemplateStore::resolve(const std::string& idOrName, bool* byName) {
  *byName = !isHexId(idOrName);
  if (!*byName) return idOrName;
  std::string shown = dir_ + "/names/" + idOrName;
  if (!isTemplateName(idOrName)) notFound(idOrName, shown);
  std::string id;
  if (!readLink(namesFd_.get(), idOrName, &id)) {
    if (errno == ENOENT || errno == EINVAL) notFound(idOrName, shown);  // EINVAL: not a symlink, not a name
    throwErrno(errno, "readlink", shown);
  }
  if (!isHexId(id)) notFound(idOrName, shown);
  return id;
}

TemplateReader TemplateStore::acquire(const std::string& idOrName) {
  for (int attempt = 0; attempt < kMaxResolveTries; attempt++) {
    bool byName;
    std::string id = resolve(idOrName, &byName);
    TemplateReader r;
    r.fd.reset(openat(fd_.get(), id.c_str(), kDirFlags));
    if (!r.fd) {
      if (errno != ENOENT && errno != ENOTDIR && errno != ELOOP) throwErrno(errno, "open", path(id));
      if (byName) continue;  // swapped or removed since the name was read: read it again
      notFound(idOrName, path(id));
    }
    // Blocks only while a removal holds LOCK_EX, which it takes after our open only to move the template away.
    if (flock(r.fd.get(), LOCK_SH) != 0) throwErrno(errno, "flock", path(id));
    struct stat own;
    if (fstat(r.fd.get(), &own) != 0) throwErrno(errno, "fstat", path(id));
    if (!sameEntry(fd_.get(), id, own) || entryExists(retiredFd_.get(), id)) {
      if (byName) continue;
      notFound(idOrName, path(id));
    }
    r.id = id;
    r.treePath = path(id) + "/tree";
    UniqueFd tree(openat(r.fd.get(), "tree", kDirFlags));
    if (tree && isSubvolumeRoot(tree.get())) r.subvolume = std::move(tree);
    r.metaErrno = readRegularFileAt(r.fd.get(), "template.json", O_NOFOLLOW, kMaxTemplateMetaBytes, &r.metaText);
    // A template whose metadata cannot be read is refused before anything is made (lib/ checks that it parses).
    if (r.metaErrno) throwErrno(r.metaErrno, "open", path(id) + "/template.json");
    return r;
  }
  notFound(idOrName, dir_ + "/names/" + idOrName);
}

namespace {

// The walk of a template's mode list over a clone of its tree (the records stripWriteBits wrote): one directory fd,
// down by name, up through ".." (checked against the way down).
class ModeListWalk {
 public:
  ModeListWalk(int wsFd, const std::string& wsPath) : wsPath_(wsPath), trail_(1) {
    cur_.reset(fcntl(wsFd, F_DUPFD_CLOEXEC, 0));
    if (!cur_) throwErrno(errno, "fcntl", wsPath);
    if (fstat(cur_.get(), &trail_[0]) != 0) throwErrno(errno, "fstat", wsPath);
  }

  // 'u': back to the parent; false at the top (a list that does not parse).
  bool up() {
    if (trail_.size() < 2) return false;
    trail_.pop_back();
    walkUp(cur_, trail_.back(), wsPath_ + rel_);
    rel_.erase(rel_.rfind('/'));
    return true;
  }

  // 'd': down into the directory `name`.
  void down(const char* name) {
    UniqueFd down(openat(cur_.get(), name, kDirFlags));
    if (!down) throwErrno(errno, "open", wsPath_ + rel_ + "/" + name);
    struct stat st;
    if (fstat(down.get(), &st) != 0) throwErrno(errno, "fstat", wsPath_ + rel_ + "/" + name);
    trail_.push_back(st);
    cur_ = std::move(down);
    rel_ += std::string("/") + name;
  }

  // 'm': the write bits `bits` given back to `leaf`.
  void restore(const char* leaf, mode_t bits) {
    struct stat st;
    if (fstatat(cur_.get(), leaf, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return;  // not recreated (a socket, a device without CAP_MKNOD)
      throwErrno(errno, "stat", wsPath_ + rel_ + "/" + leaf);
    }
    if (S_ISLNK(st.st_mode)) return;
    if (fchmodat(cur_.get(), leaf, (st.st_mode & 07777) | bits, 0) != 0)
      throwErrno(errno, "chmod", wsPath_ + rel_ + "/" + leaf);
  }

 private:
  const std::string& wsPath_;
  UniqueFd cur_;
  std::vector<struct stat> trail_;
  std::string rel_;  // of `cur_` below the workspace, for errors only (grows with depth, not with entries)
};

}  // namespace

void TemplateStore::restoreModes(const TemplateReader& reader, int wsFd, const std::string& wsPath) {
  const std::string shown = path(reader.id) + "/modes";
  ModesFile closer = openModesFile(reader.fd.get(), O_RDONLY | O_NOFOLLOW, "r", shown);
  FILE* f = closer.get();
  char* line = nullptr;
  size_t cap = 0;
  std::unique_ptr<char, void (*)(void*)> freeLine(nullptr, free);
  ModeListWalk walk(wsFd, wsPath);
  auto corrupt = [&] {
    throwCode("ERR_CORRUPT_METADATA", "a record of the template's mode list does not parse", EINVAL, "read", shown);
  };
  for (;;) {
    errno = 0;
    ssize_t n = getdelim(&line, &cap, '\0', f);
    (void)freeLine.release();  // getdelim may have moved the buffer (realloc): the old pointer is no longer ours
    freeLine.reset(line);
    if (n < 0) {
      if (errno) throwErrno(errno, "read", shown);
      break;
    }
    if (line[n - 1] != '\0') corrupt();
    char kind = line[0];
    if (kind == 'u') {
      if (!walk.up()) corrupt();
      continue;
    }
    if (kind == 'd') {
      walk.down(line + 1);
      continue;
    }
    if ((kind != 'm' && kind != 'r') || n < 5) corrupt();
    char digits[4] = {line[1], line[2], line[3], 0};
    char* end = nullptr;
    long bits = strtol(digits, &end, 8);
    if (end != digits + 3 || bits < 0 || (bits & ~0222)) corrupt();
    if (kind == 'r') continue;  // the workspace directory keeps the mode allocate gave it
    const char* leaf = line + 4;
    if (!*leaf) corrupt();
    walk.restore(leaf, static_cast<mode_t>(bits));
  }
  // The last-used time (TemplateListing.lastUsedMs): informative only, so a refusal (a pool shared by a group,
  // whose member does not own the file: EPERM) does not fail the allocate.
  if (utimensat(reader.fd.get(), "used", nullptr, AT_SYMLINK_NOFOLLOW) != 0) {
    // deliberately ignored: see above
  }
}

void TemplateStore::release(TemplateReader& reader) noexcept {
  if (!reader.fd) return;
  try {
    if (entryExists(retiredFd_.get(), reader.id)) removeIfFree(reader.id, reader.fd.get());
  } catch (...) {
    // Left retired: a sweep removes it.
  }
  reader.fd.reset();
}

bool TemplateStore::removeIfFree(const std::string& id, int fd, uint64_t* bytes) {
  UniqueFd own;
  if (fd < 0) {
    own.reset(openat(fd_.get(), id.c_str(), kDirFlags));
    if (!own) {
      if (errno != ENOENT) throwErrno(errno, "open", path(id));
      unlinkat(retiredFd_.get(), id.c_str(), 0);  // its template is gone already
      return true;
    }
    fd = own.get();
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) return false;
    throwErrno(errno, "flock", path(id));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) throwErrno(errno, "fstat", path(id));
  if (!sameEntry(fd_.get(), id, st)) return true;  // moved away by another removal meanwhile
  // Into the pool's trash first: the id is gone atomically, and a removal that fails partway is finished by
  // the sweep's trash pass, never left as a partial template.
  std::string trashName = "template-" + id;
  // The move to another parent needs write permission on the 0555 directory (see commit): given back first by
  // its owner. Refused (EPERM: another user's), the renameat2 below reports its EACCES.
  if (!(st.st_mode & S_IWUSR) && fchmod(fd, (st.st_mode & 07777) | S_IWUSR) != 0) {
    // deliberately ignored: see above
  }
  if (renameat2(fd_.get(), id.c_str(), trashFd_, trashName.c_str(), RENAME_NOREPLACE) != 0) {
    if (errno == ENOENT) return true;
    throwErrno(errno, "renameat2", path(id), trashDir_ + "/" + trashName);
  }
  unlinkat(retiredFd_.get(), id.c_str(), 0);
  removeTemplateDir(trashFd_, trashName, trashDir_ + "/" + trashName, bytes);
  return true;
}

std::vector<TemplateListing> TemplateStore::list() {
  std::unordered_map<std::string, std::string> names;  // id -> current name
  for (auto& entry : readNames(namesFd_.get(), dir_ + "/names")) {
    std::string id;
    if (isTemplateName(entry.first) && readLink(namesFd_.get(), entry.first, &id) && isHexId(id))
      names[id] = entry.first;
  }
  std::vector<TemplateListing> out;
  for (auto& entry : readNames(fd_.get(), dir_)) {
    if (!isHexId(entry.first)) continue;
    UniqueFd fd(openat(fd_.get(), entry.first.c_str(), kDirFlags));
    if (!fd) continue;  // removed meanwhile
    TemplateListing t;
    t.id = entry.first;
    auto it = names.find(t.id);
    if (it != names.end()) t.currentName = it->second;
    t.metaErrno = readRegularFileAt(fd.get(), "template.json", O_NOFOLLOW, kMaxTemplateMetaBytes, &t.metaText);
    struct statx stx;
    if (statx(fd.get(), "used", AT_SYMLINK_NOFOLLOW, STATX_MTIME, &stx) == 0)
      t.lastUsedMs = stx.stx_mtime.tv_sec * 1000 + stx.stx_mtime.tv_nsec / 1000000;
    t.retired = entryExists(retiredFd_.get(), t.id);
    out.push_back(std::move(t));
  }
  return out;
}

bool TemplateStore::named(const std::string& id) {
  for (auto& entry : readNames(namesFd_.get(), dir_ + "/names")) {
    std::string target;
    if (isTemplateName(entry.first) && readLink(namesFd_.get(), entry.first, &target) && target == id) return true;
  }
  return false;
}

bool TemplateStore::remove(const std::string& idOrName, std::string* idOut, bool unlessCurrent, bool* kept) {
  bool byName;
  std::string id = resolve(idOrName, &byName);
  if (!entryExists(fd_.get(), id) || entryExists(retiredFd_.get(), id)) notFound(idOrName, path(id));
  *idOut = id;
  if (unlessCurrent) {
    // Prune: a template a name points to is kept. LOCK_EX first: a commit holds it from its publish until its
    // name is swapped in (a published template not named yet may be about to be current), readers hold LOCK_SH;
    // held, the template is kept for a later prune. Got, no name can come to point here any more.
    *kept = true;
    UniqueFd fd(openat(fd_.get(), id.c_str(), kDirFlags));
    if (!fd) {
      if (errno == ENOENT) notFound(idOrName, path(id));
      throwErrno(errno, "open", path(id));
    }
    if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK) return false;
      throwErrno(errno, "flock", path(id));
    }
    if (named(id)) return false;
    *kept = false;
    UniqueFd marker(openat(retiredFd_.get(), id.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY, 0600));
    if (!marker) throwErrno(errno, "open", dir_ + "/retired/" + id);
    marker.reset();
    return removeIfFree(id, fd.get());
  }
  // Retired first, so that a reader resolving the name meanwhile skips it; then every name pointing here goes.
  UniqueFd marker(openat(retiredFd_.get(), id.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY, 0600));
  if (!marker) throwErrno(errno, "open", dir_ + "/retired/" + id);
  marker.reset();
  UniqueFd namesLock = lockNames();  // a replace swapping a new template into the name between check and unlink
  for (auto& entry : readNames(namesFd_.get(), dir_ + "/names")) {
    std::string target;
    if (readLink(namesFd_.get(), entry.first, &target) && target == id &&
        unlinkat(namesFd_.get(), entry.first.c_str(), 0) != 0 && errno != ENOENT)
      throwErrno(errno, "unlink", dir_ + "/names/" + entry.first);
  }
  return removeIfFree(id, -1);
}

UniqueFd TemplateStore::lockNames() {
  // An open file description of our own: flock is per description, and namesFd_ is shared by this process's
  // threads, whose lock would not exclude one another.
  UniqueFd fd(openat(fd_.get(), "names", kDirFlags));
  if (!fd) throwErrno(errno, "open", dir_ + "/names");
  if (flock(fd.get(), LOCK_EX) != 0) throwErrno(errno, "flock", dir_ + "/names");
  return fd;
}

bool TemplateStore::liveSwapLink(const std::string& name) {
  size_t at = name.rfind(".new-");
  if (name.empty() || name[0] != '.' || at == std::string::npos) return false;
  std::string id = name.substr(at + 5);
  if (!isHexId(id)) return false;
  UniqueFd fd(openat(fd_.get(), id.c_str(), kDirFlags));
  if (!fd) return false;
  // The committing process holds LOCK_EX on the template until its swap is done; readers hold LOCK_SH only.
  return flock(fd.get(), LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
}

void TemplateStore::sweep(bool dryRun, int64_t graceMs, SweepReport& report) {
  auto failed = [&](const std::string& name, const char* from, const Error& e) {
    report.failed.push_back({name, from, 0, e});
  };
  // Commits whose builder is gone: a free lease and past the grace period (a build locks its entry at once).
  for (auto& entry : readNames(stagingFd_.get(), dir_ + "/staging")) {
    const std::string& id = entry.first;
    std::string shown = dir_ + "/staging/" + id;
    try {
      if (ageMs(stagingFd_.get(), id) < graceMs) continue;
      UniqueFd fd(openat(stagingFd_.get(), id.c_str(), kDirFlags));
      if (!fd && errno == ENOENT) continue;
      if (fd && flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK) continue;
        throwErrno(errno, "flock", shown);
      }
      SweepEntry e{"template-" + id, "template-staging", 0, {}};
      if (!dryRun) removeTemplateDir(stagingFd_.get(), id, shown, &e.bytes);
      report.reclaimed.push_back(std::move(e));
    } catch (const Error& e) {
      if (!(e.code.empty() && e.err == ENOENT && e.path == shown)) failed("template-" + id, "template-staging", e);
    }
  }
  // Retired templates no reader holds any more (their last reader was killed before it could remove them).
  for (auto& entry : readNames(retiredFd_.get(), dir_ + "/retired")) {
    const std::string& id = entry.first;
    if (!isHexId(id)) continue;
    try {
      if (dryRun) {
        UniqueFd fd(openat(fd_.get(), id.c_str(), kDirFlags));
        if (fd && flock(fd.get(), LOCK_EX | LOCK_NB) == 0)
          report.reclaimed.push_back({"template-" + id, "template", 0, {}});
        continue;
      }
      SweepEntry e{"template-" + id, "template", 0, {}};
      if (entryExists(fd_.get(), id) && removeIfFree(id, -1, &e.bytes))
        report.reclaimed.push_back(std::move(e));
      else if (!entryExists(fd_.get(), id))
        unlinkat(retiredFd_.get(), id.c_str(), 0);
    } catch (const Error& e) {
      failed("template-" + id, "template", e);
    }
  }
  // Names of commits that died between claiming the name and publishing, and swap temp links of dead replaces.
  for (auto& entry : readNames(namesFd_.get(), dir_ + "/names")) {
    const std::string& name = entry.first;
    std::string target;
    bool temp = !isTemplateName(name);
    if (temp && liveSwapLink(name)) continue;  // a replace between its symlink and its swap
    // Checked and unlinked under the names lock: a replace cannot swap a live template into this name between
    // the check and the unlink (the unlink would drop the new link).
    UniqueFd namesLock;
    try {
      namesLock = lockNames();
    } catch (const Error& e) {
      failed(name, "template", e);
      continue;
    }
    if (!temp && readLink(namesFd_.get(), name, &target) && isHexId(target) &&
        (entryExists(stagingFd_.get(), target) || entryExists(fd_.get(), target)))
      continue;  // being built (staging is looked at first: a publish moves it from there) or published
    if (ageMs(namesFd_.get(), name) < graceMs) continue;
    if (!dryRun && unlinkat(namesFd_.get(), name.c_str(), 0) != 0) continue;  // left for a later sweep
  }
}

}  // namespace vmspace

// The layer applier (layer_apply.h): a tar stream (tar.h) applied entry by entry beneath a tree's root. Rules:
// image-spec layer.md ("Changesets", "Whiteouts": `.wh.<name>` hides a lower entry, `.wh..wh..opq` hides every
// lower entry of its directory but keeps this layer's, before or after the marker); what a name may reach: every
// parent resolved as RESOLVE_IN_ROOT resolves it (a lower layer's symlink `evil -> /` leads back to the tree's
// root, never out), the last component acted on with *at calls that never follow it. The paths this layer made are
// kept (as containerd's applier keeps unpackedPaths) for the opaque directories and the whiteout checks.
#include "layer_apply.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <string>
#include <unordered_set>
#include <vector>

#include "error.h"
#include "fallback.h"
#include "fd.h"
#include "io.h"
#include "quota.h"
#include "remove.h"
#include "tar.h"
#include "walk.h"

namespace vmspace {
namespace {

constexpr int kMaxSymlinks = 40;  // the kernel's MAXSYMLINKS, which the component walk keeps too
constexpr size_t kDataChunk = 128 << 10;
constexpr size_t kHoleBlock = 4096;
constexpr uint64_t kFloorCheckBytes = 4 << 20;
const std::string kOpaque = ".wh..wh..opq";
const std::string kWhiteout = ".wh.";

std::atomic<bool> noOpenat2{false};  // ENOSYS seen once: the component walk from then on

[[noreturn]] void unsafe(const std::string& name, const std::string& why) {
  throwCode("ERR_LAYER_UNSAFE", "layer entry '" + name + "': " + why, EINVAL, "open", name);
}

// A call only root may make (chown, mknod, a security.* xattr) refused with EPERM: ERR_OCI_NOT_PERMITTED.
[[noreturn]] void refused(int err, const char* syscall, const std::string& name) {
  if (err == EPERM)
    throwCode("ERR_OCI_NOT_PERMITTED",
              "layer entry '" + name + "': " + syscall + " was refused (EPERM); importing an image needs root", EPERM,
              syscall, name);
  throwErrno(err, syscall, name);
}

// The components of a tar name ("", "." and a leading "./" dropped); `..` or an absolute name is ERR_LAYER_UNSAFE.
std::vector<std::string> components(const std::string& path, const std::string& entry) {
  if (!path.empty() && path[0] == '/') unsafe(entry, "an absolute name ('" + path + "')");
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= path.size()) {
    size_t slash = path.find('/', at);
    if (slash == std::string::npos) slash = path.size();
    std::string c = path.substr(at, slash - at);
    at = slash + 1;
    if (c.empty() || c == ".") continue;
    if (c == "..") unsafe(entry, "a '..' component ('" + path + "')");
    out.push_back(std::move(c));
  }
  return out;
}

std::string joined(const std::vector<std::string>& comps, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; i++) {
    if (i) s += '/';
    s += comps[i];
  }
  return s;
}

bool startsWith(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

// Opens the directory at `rel` beneath `rootFd` by a component walk with the semantics of RESOLVE_IN_ROOT (where
// openat2 is missing): every component opened with O_NOFOLLOW from its parent's fd; a symlink met is read and its
// target walked instead (an absolute one from the root), ".." never climbs above the root, another mount is EXDEV.
// An fd, or -1 with errno.
int walkInRoot(int rootFd, const std::vector<std::string>& rel) {
  struct stat rootSt;
  if (fstat(rootFd, &rootSt) != 0) return -1;
  std::vector<UniqueFd> stack;
  stack.emplace_back(openat(rootFd, ".", kDirFlags));
  if (!stack.back()) return -1;
  std::deque<std::string> todo(rel.begin(), rel.end());
  for (int links = 0; !todo.empty();) {
    std::string c = std::move(todo.front());
    todo.pop_front();
    if (c.empty() || c == ".") continue;
    if (c == "..") {
      if (stack.size() > 1) stack.pop_back();
      continue;
    }
    UniqueFd fd(openat(stack.back().get(), c.c_str(), kDirFlags));
    if (fd) {
      struct stat st;
      if (fstat(fd.get(), &st) != 0) return -1;
      if (st.st_dev != rootSt.st_dev) return errno = EXDEV, -1;
      stack.push_back(std::move(fd));
      continue;
    }
    if (errno != ELOOP && errno != ENOTDIR) return -1;
    std::string target;
    if (!readLink(stack.back().get(), c, &target)) return errno = ENOTDIR, -1;  // EINVAL: not a symlink
    if (++links > kMaxSymlinks) return errno = ELOOP, -1;
    if (target.empty()) return errno = ENOENT, -1;
    if (target[0] == '/') stack.resize(1);
    std::vector<std::string> parts;
    for (size_t at = 0; at <= target.size();) {
      size_t slash = target.find('/', at);
      if (slash == std::string::npos) slash = target.size();
      parts.push_back(target.substr(at, slash - at));
      at = slash + 1;
    }
    todo.insert(todo.begin(), parts.begin(), parts.end());
  }
  return stack.back().release();
}

// The directory at comps[0..n) beneath `rootFd`, resolved in root (openat2, or walkInRoot): an fd, or -1 and errno.
int openInRoot(int rootFd, const std::vector<std::string>& comps, size_t n) {
  if (n == 0) return openat(rootFd, ".", kDirFlags);
  if (!noOpenat2.load(std::memory_order_relaxed) && !kTestFallback.noOpenat2) {
    std::string rel = joined(comps, n);
    for (int tries = 0;; tries++) {
      int fd = openat2Raw(rootFd, rel.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC,
                          kResolveInRoot | kResolveNoMagicLinks | kResolveNoXdev);
      if (fd >= 0) return fd;
      // EAGAIN: a rename anywhere on the system raced the resolution (RESOLVE_IN_ROOT checks for one).
      if ((errno == EINTR || errno == EAGAIN) && tries < kMaxSymlinks) continue;
      if (errno != ENOSYS) return -1;
      noOpenat2.store(true, std::memory_order_relaxed);
      break;
    }
  }
  return walkInRoot(rootFd, std::vector<std::string>(comps.begin(), comps.begin() + static_cast<long>(n)));
}

class LayerApplier {
 public:
  LayerApplier(int fd, int rootFd, const std::string& rootPath, const LayerApplyOptions& opts)
      : tar_(fd, rootPath, opts.progress), rootFd_(rootFd), rootPath_(rootPath), opts_(opts), data_(kDataChunk) {}

  LayerApplyResult run() {
    TarEntry e;
    while (tar_.next(&e)) {
      if (opts_.progress && opts_.progress->cancel.load(std::memory_order_relaxed))
        throwErrno(ECANCELED, "read", e.name);
      apply(e);
      res_.entries++;
      if (opts_.progress) opts_.progress->files.fetch_add(1, std::memory_order_relaxed);
    }
    setDirTimes();
    if (opts_.durable && syncfs(rootFd_) != 0) throwErrno(errno, "syncfs", rootPath_);
    res_.bytes = tar_.bytesRead();
    return res_;
  }

 private:
  struct DirTime {
    std::vector<std::string> comps;
    struct timespec mtime;
  };

  void apply(const TarEntry& e) {
    std::vector<std::string> comps = components(e.name, e.name);
    for (size_t i = 0; i + 1 < comps.size(); i++)
      if (startsWith(comps[i], kWhiteout)) unsafe(e.name, "a whiteout name as a directory on the way");
    if (comps.empty()) {  // the root itself: only its metadata, and only as a directory
      if (e.type != TarType::Dir) unsafe(e.name, "an entry at the layer's root that is not a directory");
      UniqueFd root(openat(rootFd_, ".", kDirFlags));
      if (!root) throwErrno(errno, "open", e.name);
      setMetadata(root.get(), e);
      dirTimes_.push_back({comps, mtimeOf(e)});
      return;
    }
    const std::string& leaf = comps.back();
    if (startsWith(leaf, kWhiteout)) return whiteout(e, comps);
    UniqueFd parent = openParent(comps, e.name);
    if (e.type == TarType::HardLink) return hardLink(e, parent.get(), leaf);
    clearFor(e, parent.get(), leaf);
    switch (e.type) {
      case TarType::File:
        writeFile(e, parent.get(), leaf);
        break;
      case TarType::Dir:
        makeDir(e, parent.get(), leaf, comps);
        break;
      case TarType::Symlink:
        if (e.linkName.empty()) tar_.invalid(e.name, "a symlink without a target");
        if (symlinkat(e.linkName.c_str(), parent.get(), leaf.c_str()) != 0) throwErrno(errno, "symlink", e.name);
        setMetadataAt(parent.get(), leaf, e);
        break;
      default:
        makeNode(e, parent.get(), leaf);
        break;
    }
    made(comps);
  }

  static struct timespec mtimeOf(const TarEntry& e) { return {static_cast<time_t>(e.mtimeSec), e.mtimeNsec}; }

  // This layer made comps (and the directories on its way): kept by an opaque directory, refused as a whiteout.
  void made(const std::vector<std::string>& comps) {
    std::string p;
    for (size_t i = 0; i < comps.size(); i++) {
      if (i) p += '/';
      p += comps[i];
      touched_.insert(p);
    }
    created_.insert(p);
  }

  // The entry's parent directory, resolved in root; missing directories on the way are made (0755, root's), as
  // containerd's applier makes them.
  UniqueFd openParent(const std::vector<std::string>& comps, const std::string& name) {
    const size_t n = comps.size() - 1;
    UniqueFd fd(openInRoot(rootFd_, comps, n));
    if (fd) return fd;
    if (errno != ENOENT) throwErrno(errno, "openat2", name);
    UniqueFd prev(openInRoot(rootFd_, comps, 0));
    if (!prev) throwErrno(errno, "open", name);
    for (size_t i = 1; i <= n; i++) {
      UniqueFd next(openInRoot(rootFd_, comps, i));
      if (!next && errno == ENOENT) {
        if (mkdirat(prev.get(), comps[i - 1].c_str(), 0755) == 0) {
          if (fchmodat(prev.get(), comps[i - 1].c_str(), 0755, 0) != 0) throwErrno(errno, "chmod", name);  // umask
        } else if (errno != EEXIST) {
          throwErrno(errno, "mkdir", name);
        }
        made(std::vector<std::string>(comps.begin(), comps.begin() + static_cast<long>(i)));
        next.reset(openInRoot(rootFd_, comps, i));
      }
      if (!next) throwErrno(errno, "openat2", name);
      prev = std::move(next);
    }
    return prev;
  }

  // What is at `leaf` goes before the entry is made: a directory stays for a directory (it gets the new
  // metadata), anything else is removed (a directory with all below it, never following a symlink).
  void clearFor(const TarEntry& e, int parentFd, const std::string& leaf) {
    struct stat st;
    if (fstatat(parentFd, leaf.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return;
      throwErrno(errno, "fstatat", e.name);
    }
    if (S_ISDIR(st.st_mode)) {
      if (e.type != TarType::Dir) removeTreeNoFollow(parentFd, leaf, rootPath_ + "/" + e.name);
    } else if (unlinkat(parentFd, leaf.c_str(), 0) != 0) {
      throwErrno(errno, "unlink", e.name);
    }
  }

  void writeFile(const TarEntry& e, int parentFd, const std::string& leaf) {
    UniqueFd f(openat(parentFd, leaf.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY, 0600));
    if (!f) throwErrno(errno, "open", e.name);
    uint64_t off = 0;
    for (;;) {
      size_t n = 0;
      while (n < data_.size()) {  // a whole chunk, so that hole blocks stay aligned
        size_t k = tar_.read(data_.data() + n, data_.size() - n);
        if (k == 0) break;
        n += k;
      }
      if (n == 0) break;
      writeKeepingHoles(f.get(), n, off, e.name);
      off += n;
    }
    if (ftruncate(f.get(), static_cast<off_t>(e.size)) != 0) throwErrno(errno, "ftruncate", e.name);
    setMetadata(f.get(), e);
    if (opts_.durable && fsync(f.get()) != 0) throwErrno(errno, "fsync", e.name);
  }

  // data_[0..n) at `off`, all-zero blocks left out (holes: the ftruncate to the size ends the file).
  void writeKeepingHoles(int fd, size_t n, uint64_t off, const std::string& name) {
    size_t i = 0;
    while (i < n) {
      size_t end = std::min(n, i + kHoleBlock);
      bool zero = true;
      for (size_t j = i; j < end && zero; j++) zero = data_[j] == 0;
      if (zero) {
        i = end;
        continue;
      }
      size_t run = end;  // the run of blocks with data
      while (run < n) {
        size_t e2 = std::min(n, run + kHoleBlock);
        bool z = true;
        for (size_t j = run; j < e2 && z; j++) z = data_[j] == 0;
        if (z) break;
        run = e2;
      }
      if (int err = pwriteAll(fd, data_.data() + i, run - i, static_cast<off_t>(off + i)))
        throwErrno(err, "write", name);
      checkFloor(fd, run - i, name);
      i = run;
    }
  }

  // The pool's minFreeBytes, checked every kFloorCheckBytes written: a layer that decompresses to more than the
  // file system can spare (a gzip bomb) stops at the floor instead of filling it under the running VMs.
  void checkFloor(int fd, size_t n, const std::string& name) {
    if (opts_.minFreeBytes == 0) return;
    sinceFloorCheck_ += n;
    if (sinceFloorCheck_ < kFloorCheckBytes) return;
    sinceFloorCheck_ = 0;
    if (fsSpace(fd, name).available < opts_.minFreeBytes) throwErrno(ENOSPC, "statvfs", name);
  }

  void makeDir(const TarEntry& e, int parentFd, const std::string& leaf, const std::vector<std::string>& comps) {
    if (mkdirat(parentFd, leaf.c_str(), 0700) != 0 && errno != EEXIST) throwErrno(errno, "mkdir", e.name);
    UniqueFd d(openat(parentFd, leaf.c_str(), kDirFlags));
    if (!d) throwErrno(errno, "open", e.name);
    setMetadata(d.get(), e);
    dirTimes_.push_back({comps, mtimeOf(e)});  // its entries change its mtime: set after the layer's last one
  }

  void makeNode(const TarEntry& e, int parentFd, const std::string& leaf) {
    mode_t type = e.type == TarType::CharDevice ? S_IFCHR : e.type == TarType::BlockDevice ? S_IFBLK : S_IFIFO;
    dev_t dev = type == S_IFIFO ? 0 : makedev(e.devMajor, e.devMinor);
    if (mknodat(parentFd, leaf.c_str(), type | 0600, dev) != 0) refused(errno, "mknod", e.name);
    setMetadataAt(parentFd, leaf, e);
  }

  // A hard link to an entry of this layer or a lower one: its target resolved in root, the target's last
  // component never followed; it must exist and not be a directory.
  void hardLink(const TarEntry& e, int parentFd, const std::string& leaf) {
    std::vector<std::string> target = components(e.linkName, e.name);
    if (target.empty()) unsafe(e.name, "a hard link to the layer's root");
    UniqueFd tparent(openInRoot(rootFd_, target, target.size() - 1));
    if (!tparent) {
      if (errno == ENOENT || errno == ENOTDIR) unsafe(e.name, "a hard link to a missing entry '" + e.linkName + "'");
      throwErrno(errno, "openat2", e.linkName);
    }
    struct stat ts, ds;
    if (fstatat(tparent.get(), target.back().c_str(), &ts, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) unsafe(e.name, "a hard link to a missing entry '" + e.linkName + "'");
      throwErrno(errno, "fstatat", e.linkName);
    }
    if (S_ISDIR(ts.st_mode)) unsafe(e.name, "a hard link to a directory '" + e.linkName + "'");
    if (fstatat(parentFd, leaf.c_str(), &ds, AT_SYMLINK_NOFOLLOW) == 0 && ds.st_dev == ts.st_dev &&
        ds.st_ino == ts.st_ino) {
      made(components(e.name, e.name));
      return;  // already that file
    }
    TarEntry asFile = e;
    asFile.type = TarType::File;
    clearFor(asFile, parentFd, leaf);
    if (linkat(tparent.get(), target.back().c_str(), parentFd, leaf.c_str(), 0) != 0) throwErrno(errno, "link", e.name);
    made(components(e.name, e.name));
  }

  // A whiteout (image-spec layer.md): never made itself. `.wh..wh..opq` makes its directory opaque; `.wh.<name>`
  // removes <name> of a lower layer, all of it.
  void whiteout(const TarEntry& e, const std::vector<std::string>& comps) {
    if (e.type != TarType::File || e.size != 0) unsafe(e.name, "a whiteout that is not an empty regular file");
    const std::string& leaf = comps.back();
    const std::string dirRel = joined(comps, comps.size() - 1);
    res_.whiteouts++;
    UniqueFd dir(openInRoot(rootFd_, comps, comps.size() - 1));
    if (leaf == kOpaque) {
      if (!dir && errno != ENOENT && errno != ENOTDIR) throwErrno(errno, "openat2", e.name);
      if (dir) hideLower(dir.get(), dirRel);
      return;
    }
    std::string target = leaf.substr(kWhiteout.size());
    if (target.empty() || target == "." || target == ".." || startsWith(target, kWhiteout))
      unsafe(e.name, "a malformed whiteout");
    const std::string rel = dirRel.empty() ? target : dirRel + "/" + target;
    if (created_.count(rel)) unsafe(e.name, "a whiteout of '" + rel + "', which the same layer made");
    if (!dir) {
      if (errno == ENOENT || errno == ENOTDIR) return;  // nothing below to hide
      throwErrno(errno, "openat2", e.name);
    }
    try {
      removeTreeNoFollow(dir.get(), target, rootPath_ + "/" + rel);
    } catch (const Error& err) {
      if (!(err.code.empty() && err.err == ENOENT && err.path == rootPath_ + "/" + rel)) throw;
    }
  }

  // The opaque directory `dirFd` (at `rel`): every entry this layer did not make goes; a directory on the way to
  // one it made stays, with what it holds filtered alike (the lower layer's part of it is hidden too). The walk is
  // walk.h's (its fd budget, the climb checked by device and inode); it enters only directories this layer touched.
  void hideLower(int dirFd, const std::string& rel) {
    TreeWalk walk(rootPath_ + (rel.empty() ? "" : "/" + rel), TreeWalk::Resume::AtPosition);
    std::vector<std::string> rels{rel};  // the walk's directories, as the tar names them
    struct stat st;
    int fd = walk.withFds([&] { return openat(dirFd, ".", kDirFlags); });
    if (fd < 0 || fstat(fd, &st) != 0) throwErrno(errno, "open", walk.path(0));
    if (int err = walk.push(fd, "", st.st_dev, st.st_ino)) throwErrno(err, "fdopendir", walk.path(0));
    while (!walk.empty()) {
      struct dirent* de;
      if (int err = walk.next(&de)) throwErrno(err, "readdir", walk.path(walk.depth()));
      if (!de) {
        TreeWalk::Left left;
        const char* syscall = "openat";
        if (int err = walk.pop(&left, &syscall)) throwErrno(err, syscall, walk.path(walk.depth()));
        rels.pop_back();
        continue;
      }
      const std::string childRel = rels.back().empty() ? de->d_name : rels.back() + "/" + de->d_name;
      if (!touched_.count(childRel)) {
        removeTreeNoFollow(walk.topFd(), de->d_name, walk.path(walk.depth(), de->d_name));
        continue;
      }
      int sub = walk.openDir(walk.topFd(), de->d_name);
      if (sub < 0) {
        if (errno == ENOTDIR || errno == ELOOP) continue;  // a file or link this layer made
        throwErrno(errno, "open", walk.path(walk.depth(), de->d_name));
      }
      if (fstat(sub, &st) != 0) {
        int err = errno;
        ::close(sub);
        throwErrno(err, "fstat", walk.path(walk.depth(), de->d_name));
      }
      if (int err = walk.push(sub, de->d_name, st.st_dev, st.st_ino))
        throwErrno(err, "fdopendir", walk.path(walk.depth(), de->d_name));
      rels.push_back(childRel);
    }
  }

  // Owner, mode, xattrs on the open file or directory `fd` (times: the caller), in that order: chown clears the
  // set-id bits and security.capability, so both are set after it.
  void setMetadata(int fd, const TarEntry& e) {
    if (fchown(fd, e.uid, e.gid) != 0) refused(errno, "chown", e.name);
    if (fchmod(fd, e.mode) != 0) throwErrno(errno, "chmod", e.name);
    for (auto& x : e.xattrs)
      if (fsetxattr(fd, x.first.c_str(), x.second.data(), x.second.size(), 0) != 0) xattrFailed(errno, x.first, e);
    if (e.type == TarType::File) {
      struct timespec ts[2] = {mtimeOf(e), mtimeOf(e)};
      if (futimens(fd, ts) != 0) throwErrno(errno, "futimens", e.name);
    }
  }

  // The same for an entry opened by no fd (a symlink, device node, fifo): *at calls that never follow `leaf`.
  void setMetadataAt(int parentFd, const std::string& leaf, const TarEntry& e) {
    if (fchownat(parentFd, leaf.c_str(), e.uid, e.gid, AT_SYMLINK_NOFOLLOW) != 0) refused(errno, "chown", e.name);
    if (e.type != TarType::Symlink && fchmodat(parentFd, leaf.c_str(), e.mode, 0) != 0)
      throwErrno(errno, "chmod", e.name);
    if (!e.xattrs.empty()) {
      // lsetxattr never follows `leaf`; the parent is reached through its fd's /proc link.
      std::string p = "/proc/self/fd/" + std::to_string(parentFd) + "/" + leaf;
      for (auto& x : e.xattrs)
        if (lsetxattr(p.c_str(), x.first.c_str(), x.second.data(), x.second.size(), 0) != 0)
          xattrFailed(errno, x.first, e);
    }
    struct timespec ts[2] = {mtimeOf(e), mtimeOf(e)};
    if (utimensat(parentFd, leaf.c_str(), ts, AT_SYMLINK_NOFOLLOW) != 0) throwErrno(errno, "utimensat", e.name);
  }

  [[noreturn]] void xattrFailed(int err, const std::string& xattr, const TarEntry& e) {
    if (startsWith(xattr, "security.") || startsWith(xattr, "trusted.")) refused(err, "setxattr", e.name);
    throwErrno(err, "setxattr", e.name);
  }

  // Directories' mtimes, last: each reopened in root, its last component never followed (a later entry may have
  // replaced it); one removed by a later whiteout is skipped.
  void setDirTimes() {
    for (const DirTime& d : dirTimes_) {
      UniqueFd fd;
      if (d.comps.empty()) {
        fd.reset(openat(rootFd_, ".", kDirFlags));
      } else {
        UniqueFd parent(openInRoot(rootFd_, d.comps, d.comps.size() - 1));
        if (parent) fd.reset(openat(parent.get(), d.comps.back().c_str(), kDirFlags));
      }
      if (!fd) {
        if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP) continue;
        throwErrno(errno, "open", joined(d.comps, d.comps.size()));
      }
      struct timespec ts[2] = {d.mtime, d.mtime};
      if (futimens(fd.get(), ts) != 0) throwErrno(errno, "futimens", joined(d.comps, d.comps.size()));
    }
  }

  TarReader tar_;
  const int rootFd_;
  const std::string& rootPath_;
  const LayerApplyOptions& opts_;
  std::vector<char> data_;
  LayerApplyResult res_;
  std::unordered_set<std::string> created_;  // entries this layer made (the paths as the tar names them)
  std::unordered_set<std::string> touched_;  // those and every directory on their way
  std::vector<DirTime> dirTimes_;
  uint64_t sinceFloorCheck_ = 0;  // bytes written since the free space was last checked against the floor
};

}  // namespace

LayerApplyResult applyLayer(int fd, int rootFd, const std::string& rootPath, const LayerApplyOptions& options) {
  return LayerApplier(fd, rootFd, rootPath, options).run();
}

}  // namespace vmspace

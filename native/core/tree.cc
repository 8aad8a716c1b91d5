#include "tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#include "error.h"
#include "fd.h"
#include "names.h"
#include "remove.h"
#include "rename.h"

namespace vmspace {
namespace {

constexpr int kDirFlags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY;

// The process umask, read without changing it (umask(2) can only be read by setting it, which races with other
// threads): the Umask: line of /proc/self/status, Linux 4.7. 022 where it cannot be read.
mode_t currentUmask() {
  FILE* f = fopen("/proc/self/status", "re");
  if (!f) return 022;
  char line[256];
  unsigned mask = 022;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "Umask: %o", &mask) == 1) break;
  fclose(f);
  return static_cast<mode_t>(mask);
}

struct InodeKey {
  dev_t dev;
  ino_t ino;
  bool operator==(const InodeKey& o) const { return dev == o.dev && ino == o.ino; }
};
struct InodeHash {
  size_t operator()(const InodeKey& k) const { return std::hash<uint64_t>()(k.ino * 31 + k.dev); }
};

class TreeCloner {
 public:
  TreeCloner(const CloneOptions& opts, CloneProgress* progress, int dstRootFd, std::string srcRoot,
             std::string dstRoot)
      : opts_(opts), progress_(progress), dstRootFd_(dstRootFd), srcRoot_(std::move(srcRoot)),
        dstRoot_(std::move(dstRoot)), euid_(geteuid()), egid_(getegid()), umask_(currentUmask()) {}

  // Fills the empty directory dstFd with the contents of the directory srcFd (both taken over).
  void cloneContents(int srcFd, int dstFd) {
    struct stat st;
    if (fstat(dstFd, &st) == 0) skip_ = {st.st_dev, st.st_ino};  // never walk into the tree being built
    push(srcFd, dstFd, "", nullptr);
    while (!stack_.empty()) step();
  }

  // Applies a source directory's metadata to a destination directory (used for the root of a tree clone).
  void copyDirMeta(int srcFd, int dstFd, const struct stat& st, const std::string& rel) {
    copyMeta(srcFd, dstFd, st, rel, true);
  }

  CloneSummary summary;

 private:
  struct Frame {
    DIR* src;
    UniqueFd dst;
    std::string rel;  // path below the roots ("" for the roots)
    struct stat st;   // the source directory's, applied to dst when its contents are done
    bool applyMeta;
  };

  std::string srcPath(const std::string& rel) const { return rel.empty() ? srcRoot_ : srcRoot_ + "/" + rel; }
  std::string dstPath(const std::string& rel) const { return rel.empty() ? dstRoot_ : dstRoot_ + "/" + rel; }

  void push(int srcFd, int dstFd, std::string rel, const struct stat* st) {
    UniqueFd dst(dstFd);
    DIR* d = fdopendir(srcFd);
    if (!d) {
      int err = errno;
      ::close(srcFd);
      throwErrno(err, "opendir", srcPath(rel), dstPath(rel));
    }
    Frame f{d, std::move(dst), std::move(rel), {}, st != nullptr};
    if (st) f.st = *st;
    stack_.push_back(std::move(f));
  }

  void step() {
    Frame& top = stack_.back();
    errno = 0;
    struct dirent* de = readdir(top.src);
    if (!de) {
      if (errno) throwErrno(errno, "readdir", srcPath(top.rel));
      // Post-order: a directory's mode and times are set once nothing more is written into it.
      if (top.applyMeta) copyMeta(dirfd(top.src), top.dst.get(), top.st, top.rel, true);
      closedir(top.src);
      stack_.pop_back();
      return;
    }
    const char* name = de->d_name;
    if (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0))) return;
    if (progress_ && progress_->cancel.load(std::memory_order_relaxed))
      throwErrno(ECANCELED, "clone", srcPath(top.rel), dstPath(top.rel));
    entry(top, name);
  }

  void entry(Frame& top, const char* name) {
    int sdir = dirfd(top.src), ddir = top.dst.get();
    std::string rel = top.rel.empty() ? std::string(name) : top.rel + "/" + name;
    struct stat st;
    if (fstatat(sdir, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return;  // removed from the source since readdir
      throwErrno(errno, "stat", srcPath(rel), dstPath(rel));
    }
    switch (st.st_mode & S_IFMT) {
      case S_IFDIR: {
        if (st.st_dev == skip_.dev && st.st_ino == skip_.ino) return;
        if (mkdirat(ddir, name, 0700) != 0) throwErrno(errno, "mkdir", srcPath(rel), dstPath(rel));
        int sfd = openat(sdir, name, kDirFlags);
        if (sfd < 0) throwErrno(errno, "open", srcPath(rel), dstPath(rel));
        int dfd = openat(ddir, name, kDirFlags);
        if (dfd < 0) {
          int err = errno;
          ::close(sfd);
          throwErrno(err, "open", srcPath(rel), dstPath(rel));
        }
        summary.dirs++;
        push(sfd, dfd, std::move(rel), &st);  // invalidates `top`
        return;
      }
      case S_IFREG:
        regular(sdir, ddir, name, rel, st);
        return;
      case S_IFLNK: {
        // The target's bytes verbatim: dangling, absolute or pointing outside, it is never resolved.
        char target[PATH_MAX + 1];
        ssize_t n = readlinkat(sdir, name, target, PATH_MAX);
        if (n < 0) throwErrno(errno, "readlink", srcPath(rel), dstPath(rel));
        target[n] = 0;
        if (symlinkat(target, ddir, name) != 0) throwErrno(errno, "symlink", srcPath(rel), dstPath(rel));
        nodeMeta(ddir, name, st, rel, true);
        summary.symlinks++;
        return;
      }
      case S_IFIFO:
        if (mknodat(ddir, name, S_IFIFO | 0600, 0) != 0) throwErrno(errno, "mknod", srcPath(rel), dstPath(rel));
        nodeMeta(ddir, name, st, rel, false);
        summary.fifos++;
        return;
      case S_IFCHR:
      case S_IFBLK:
        if (mknodat(ddir, name, (st.st_mode & S_IFMT) | 0600, st.st_rdev) != 0) {
          if (errno == EPERM) {  // mknod(2) of a device needs CAP_MKNOD: skipped and counted
            summary.skippedDevices++;
            return;
          }
          throwErrno(errno, "mknod", srcPath(rel), dstPath(rel));
        }
        nodeMeta(ddir, name, st, rel, false);
        summary.devices++;
        return;
      case S_IFSOCK:
        summary.skippedSockets++;
        return;
      default:
        return;
    }
  }

  void regular(int sdir, int ddir, const char* name, const std::string& rel, const struct stat& st) {
    if (st.st_nlink > 1) {
      auto it = links_.find({st.st_dev, st.st_ino});
      if (it != links_.end()) {
        // A hard link to a file already cloned in this tree: link the clone, do not clone twice.
        if (linkat(dstRootFd_, it->second.c_str(), ddir, name, 0) != 0)
          throwErrno(errno, "link", srcPath(rel), dstPath(rel));
        summary.hardlinks++;
        return;
      }
    }
    // O_NOATIME keeps the walk from dirtying every source inode; allowed for the owner and CAP_FOWNER only.
    int flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY;
    if (euid_ == 0 || st.st_uid == euid_) flags |= O_NOATIME;
    UniqueFd src(openat(sdir, name, flags));
    if (!src && errno == EPERM && (flags & O_NOATIME)) src.reset(openat(sdir, name, flags & ~O_NOATIME));
    if (!src) throwErrno(errno, "open", srcPath(rel), dstPath(rel));
    // Created with its final permission bits where the umask keeps them, saving an fchmod per file; the
    // tree is private until published (its root is 0700).
    mode_t perm = st.st_mode & 0777;
    bool exact = (perm & umask_) == 0 && (st.st_mode & 07000) == 0;
    UniqueFd dst(openat(ddir, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, exact ? perm : 0600));
    if (!dst) throwErrno(errno, "open", srcPath(rel), dstPath(rel));
    CloneMethod m = cloneData(src.get(), dst.get(), static_cast<uint64_t>(st.st_size), opts_.reflink, srcPath(rel),
                              dstPath(rel));
    copyMeta(src.get(), dst.get(), st, rel, !exact);
    if (opts_.durable && fsync(dst.get()) != 0) throwErrno(errno, "fsync", dstPath(rel));
    if (st.st_nlink > 1) links_.emplace(InodeKey{st.st_dev, st.st_ino}, rel);
    (m == CloneMethod::Reflink ? summary.reflinked : summary.copied)++;
    summary.files++;
    summary.bytes += static_cast<uint64_t>(st.st_size);
    if (progress_) {
      progress_->files.store(summary.files, std::memory_order_relaxed);
      progress_->bytes.store(summary.bytes, std::memory_order_relaxed);
    }
  }

  // Owner, mode, xattrs, times, in that order: chown(2) clears setuid/setgid and security.capability, so
  // those come after it; writing data clears them too, so all of this follows the data.
  void copyMeta(int sfd, int dfd, const struct stat& st, const std::string& rel, bool chmod) {
    if (st.st_uid != euid_ || st.st_gid != egid_) {
      if (fchown(dfd, st.st_uid, st.st_gid) != 0 && errno != EPERM) throwErrno(errno, "chown", dstPath(rel));
      chmod = true;
    }
    if (chmod && fchmod(dfd, st.st_mode & 07777) != 0) throwErrno(errno, "chmod", dstPath(rel));
    copyXattrs(sfd, dfd, rel);
    struct timespec times[2] = {st.st_atim, st.st_mtim};
    if (futimens(dfd, times) != 0) throwErrno(errno, "utimensat", dstPath(rel));
  }

  // Metadata of an entry that cannot be opened for it (symlink, fifo, device): by name, never following.
  void nodeMeta(int ddir, const char* name, const struct stat& st, const std::string& rel, bool symlink) {
    if ((st.st_uid != euid_ || st.st_gid != egid_) &&
        fchownat(ddir, name, st.st_uid, st.st_gid, AT_SYMLINK_NOFOLLOW) != 0 && errno != EPERM)
      throwErrno(errno, "chown", dstPath(rel));
    if (!symlink && fchmodat(ddir, name, st.st_mode & 07777, 0) != 0) throwErrno(errno, "chmod", dstPath(rel));
    struct timespec times[2] = {st.st_atim, st.st_mtim};
    if (utimensat(ddir, name, times, AT_SYMLINK_NOFOLLOW) != 0) throwErrno(errno, "utimensat", dstPath(rel));
  }

  void copyXattrs(int sfd, int dfd, const std::string& rel) {
    char names[4096];
    ssize_t len = flistxattr(sfd, names, sizeof names);
    std::unique_ptr<char[]> big;
    if (len < 0 && errno == ERANGE) {
      ssize_t need = flistxattr(sfd, nullptr, 0);
      if (need < 0) throwErrno(errno, "flistxattr", srcPath(rel));
      big.reset(new char[need]);
      len = flistxattr(sfd, big.get(), static_cast<size_t>(need));
    }
    if (len < 0) {
      if (errno == ENOTSUP) return;  // the source file system has no xattrs
      throwErrno(errno, "flistxattr", srcPath(rel));
    }
    if (len == 0) return;
    const char* list = big ? big.get() : names;
    std::vector<char> value(4096);
    for (const char* n = list; n < list + len; n += strlen(n) + 1) {
      ssize_t vlen;
      while ((vlen = fgetxattr(sfd, n, value.data(), value.size())) < 0 && errno == ERANGE) {
        ssize_t need = fgetxattr(sfd, n, nullptr, 0);
        if (need < 0) break;
        value.resize(static_cast<size_t>(need) + 1);
      }
      if (vlen < 0) {
        if (errno == ENODATA) continue;  // removed since the list was read
        throwErrno(errno, "fgetxattr", srcPath(rel));
      }
      if (fsetxattr(dfd, n, value.data(), static_cast<size_t>(vlen), 0) != 0) {
        // Not permitted (trusted.* without CAP_SYS_ADMIN) or not supported by the destination: kept where
        // permitted, as cp -a does.
        if (errno == EPERM || errno == ENOTSUP || errno == EACCES) continue;
        throwErrno(errno, "fsetxattr", dstPath(rel));
      }
    }
  }

  const CloneOptions& opts_;
  CloneProgress* progress_;
  int dstRootFd_;
  std::string srcRoot_, dstRoot_;
  uid_t euid_;
  gid_t egid_;
  mode_t umask_;
  InodeKey skip_{0, 0};
  std::vector<Frame> stack_;
  std::unordered_map<InodeKey, std::string, InodeHash> links_;  // source inode -> its clone's path below dstRoot
};


void checkSameFs(const struct stat& src, int dstDirFd, const CloneOptions& opts, const std::string& srcPath,
                 const std::string& dstPath) {
  if (opts.reflink != Reflink::Always) return;
  struct stat d;
  if (fstat(dstDirFd, &d) != 0) throwErrno(errno, "fstat", dstPath);
  if (d.st_dev != src.st_dev)
    throwCode("ERR_REFLINK_UNSUPPORTED", "source and destination are on different file systems (reflink: 'always')",
              EXDEV, "clone", srcPath, dstPath);
}

void fillIdentity(SourceIdentity* identity, const struct stat& st) {
  if (identity)
    *identity = {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
                 static_cast<uint64_t>(st.st_size), st.st_mtim.tv_sec, st.st_mtim.tv_nsec};
}

}  // namespace

const char* methodName(const CloneSummary& s, Reflink reflink) {
  if (s.reflinked && s.copied) return "mixed";
  if (s.reflinked) return "reflink";
  if (s.copied) return "copy";
  return reflink == Reflink::Never ? "copy" : "reflink";
}

CloneSummary cloneTreeInto(const std::string& srcPath, int dstFd, const std::string& dstPath,
                           const CloneOptions& options, CloneProgress* progress, SourceIdentity* identity) {
  UniqueFd src(open(srcPath.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY));
  if (!src) throwErrno(errno, "open", srcPath, dstPath);
  struct stat st;
  if (fstat(src.get(), &st) != 0) throwErrno(errno, "fstat", srcPath);
  fillIdentity(identity, st);
  checkSameFs(st, dstFd, options, srcPath, dstPath);
  int dup = fcntl(dstFd, F_DUPFD_CLOEXEC, 0);
  if (dup < 0) throwErrno(errno, "fcntl", dstPath);
  TreeCloner cloner(options, progress, dstFd, srcPath, dstPath);
  cloner.cloneContents(src.release(), dup);
  cloner.summary.tree = true;
  return cloner.summary;
}

CloneSummary clonePathAt(const std::string& srcPath, int dstDirFd, const std::string& dstName,
                         const std::string& dstPath, const CloneOptions& options, CloneProgress* progress,
                         SourceIdentity* identity) {
  struct stat st;
  if (stat(srcPath.c_str(), &st) != 0) throwErrno(errno, "stat", srcPath, dstPath);
  if (!S_ISDIR(st.st_mode)) {
    CloneFileResult r = cloneFileAt(srcPath, dstDirFd, dstName, dstPath, options, identity);
    CloneSummary s;
    s.files = 1;
    s.bytes = r.bytes;
    (r.method == CloneMethod::Reflink ? s.reflinked : s.copied) = 1;
    if (progress) {
      progress->files.store(1, std::memory_order_relaxed);
      progress->bytes.store(r.bytes, std::memory_order_relaxed);
    }
    return s;
  }
  UniqueFd src(open(srcPath.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY));
  if (!src) throwErrno(errno, "open", srcPath, dstPath);
  if (fstat(src.get(), &st) != 0) throwErrno(errno, "fstat", srcPath);
  fillIdentity(identity, st);
  checkSameFs(st, dstDirFd, options, srcPath, dstPath);

  // The tree is built under a private temp name (0700 until its own metadata is applied, last).
  std::string tmp = ".vmspace-tmp-" + randomHex(8);
  if (mkdirat(dstDirFd, tmp.c_str(), 0700) != 0) throwErrno(errno, "mkdir", dstPath);
  std::string parentPath, leaf;
  splitPath(dstPath, &parentPath, &leaf);
  std::string tmpPath = parentPath + "/" + tmp;
  try {
    UniqueFd root(openat(dstDirFd, tmp.c_str(), kDirFlags));
    if (!root) throwErrno(errno, "open", dstPath);
    UniqueFd srcAgain(openat(src.get(), ".", kDirFlags));  // one fd for the walk, one for the root's metadata
    if (!srcAgain) throwErrno(errno, "open", srcPath);
    int walkDst = fcntl(root.get(), F_DUPFD_CLOEXEC, 0);
    if (walkDst < 0) throwErrno(errno, "fcntl", dstPath);
    TreeCloner cloner(options, progress, root.get(), srcPath, dstPath);
    cloner.cloneContents(srcAgain.release(), walkDst);
    cloner.copyDirMeta(src.get(), root.get(), st, "");
    if (options.durable && fsync(root.get()) != 0) throwErrno(errno, "fsync", dstPath);
    if (renameat2(dstDirFd, tmp.c_str(), dstDirFd, dstName.c_str(), RENAME_NOREPLACE) != 0) {
      if (errno != EEXIST || !options.overwrite) throwErrno(errno, "renameat2", srcPath, dstPath);
      // Replace an existing destination atomically: swap it with the new tree, then remove the old one
      // (now under the temp name).
      if (renameat2(dstDirFd, tmp.c_str(), dstDirFd, dstName.c_str(), RENAME_EXCHANGE) != 0)
        throwErrno(errno, "renameat2", srcPath, dstPath);
      removeTreeNoFollow(dstDirFd, tmp, tmpPath);
    }
    if (options.durable && fsync(dstDirFd) != 0) throwErrno(errno, "fsync", dstPath);
    cloner.summary.tree = true;
    return cloner.summary;
  } catch (...) {
    try {
      removeTreeNoFollow(dstDirFd, tmp, tmpPath);
    } catch (const Error&) {
      // The original error is the one to report; what is left carries a .vmspace-tmp- name.
    }
    throw;
  }
}

CloneSummary clonePath(const std::string& srcPath, const std::string& dstPath, const CloneOptions& options,
                       CloneProgress* progress) {
  std::string parent, leaf;
  splitPath(dstPath, &parent, &leaf);
  UniqueFd dir(open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY));
  if (!dir) throwErrno(errno, "open", dstPath);
  return clonePathAt(srcPath, dir.get(), leaf, dstPath, options, progress);
}

CloneSummary clonePathBeneath(const std::string& srcPath, int baseFd, const std::string& basePath,
                              const std::string& rel, const CloneOptions& options, CloneProgress* progress) {
  std::string leaf;
  UniqueFd dir(openParentBeneath(baseFd, rel, &leaf, basePath, false));
  return clonePathAt(srcPath, dir.get(), leaf, basePath + "/" + rel, options, progress);
}

}  // namespace vmspace

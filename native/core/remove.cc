#include "remove.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <unordered_set>
#include <vector>

#include "error.h"
#include "fd.h"
#include "io.h"
#include "rename.h"
#include "statx.h"

namespace vmspace {
namespace {

// One directory being emptied. No path is kept per level (a chain 100,000 deep would cost the square of its
// depth in memory): a path is built from the names of the stack only when an error is reported.
struct Frame {
  DIR* dir;          // null while closed to bound the fds a deep tree takes (see kMaxOpenFrames)
  std::string name;  // its name in the frame below (empty for the root of the walk)
  dev_t dev;
  ino_t ino;
};

// At most this many directories of the walk are open at once; the ones above them are closed and reopened
// (through "..", checked by device and inode) when the walk climbs back. A guest can nest directories deeper
// than any fd limit; removal must not depend on depth.
constexpr size_t kMaxOpenFrames = 64;

class Remover {
 public:
  Remover(uint64_t mount, uint64_t* bytes) : mount_(mount), root_(geteuid() == 0), bytes_(bytes) {}

  // Empties the directory `fd` (taken over; device `dev`, inode `ino`) at `path`, then, frame by frame, removes
  // each emptied directory.
  void emptyDirectory(int fd, const std::string& path, dev_t dev, ino_t ino) {
    rootPath_ = path;
    DIR* d = fdopendir(fd);
    if (!d) {
      int err = errno;
      ::close(fd);
      record(err, "fdopendir", 0);
      return;
    }
    stack_.push_back(Frame{d, {}, dev, ino});
    while (!stack_.empty()) step();
  }

  ~Remover() {
    for (Frame& f : stack_)
      if (f.dir) closedir(f.dir);
  }

  void rethrowFirst() {
    if (first_) throw *first_;
  }

 private:
  // Records the first error; the path is that of the directory at `depth` in the stack, plus `leaf` if given.
  void record(int err, const char* syscall, size_t depth, const char* leaf = nullptr) {
    if (first_) return;
    first_.emplace();
    first_->err = err;
    first_->syscall = syscall;
    first_->path = rootPath_;
    for (size_t i = 1; i <= depth && i < stack_.size(); i++) first_->path += "/" + stack_[i].name;
    if (leaf) first_->path += std::string("/") + leaf;
  }

  // Climbing back into a parent whose DIR was closed: reopen it through the child's "..", and only if it is
  // still the same directory (a rename meanwhile must not redirect the walk). Restarting its readdir is fine:
  // what was removed is gone, and what could not be removed is in stuck_.
  bool reopenParent(Frame& parent, DIR* child) {
    size_t depth = stack_.size() - 1;  // the parent is the top of the stack
    int fd = openDir(dirfd(child), "..");
    struct stat st {};
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_dev != parent.dev || st.st_ino != parent.ino) {
      int err = fd < 0 ? errno : ESTALE;  // ESTALE: another directory is there now
      if (fd >= 0) ::close(fd);
      record(err, "openat", depth);
      return false;
    }
    parent.dir = fdopendir(fd);
    if (!parent.dir) {
      record(errno, "fdopendir", depth);
      ::close(fd);
      return false;
    }
    return true;
  }

  // Opens the directory `name` in `dfd`. Under a low RLIMIT_NOFILE (EMFILE, ENFILE) it closes the walk's
  // shallowest open directory but the top one and tries again: removal needs two fds, not kMaxOpenFrames.
  int openDir(int dfd, const char* name) {
    for (;;) {
      int fd = openat(dfd, name, kDirFlags);
      if (fd >= 0 || (errno != EMFILE && errno != ENFILE)) return fd;
      int err = errno;
      if (!closeShallowest()) {
        errno = err;
        return -1;
      }
    }
  }

  // Only the kMaxOpenFrames + 1 deepest frames can be open (descend closes the one above them).
  bool closeShallowest() {
    size_t n = stack_.size();
    for (size_t i = n > kMaxOpenFrames + 1 ? n - kMaxOpenFrames - 1 : 0; i + 1 < n; i++) {
      if (stack_[i].dir) {
        closedir(stack_[i].dir);
        stack_[i].dir = nullptr;
        return true;
      }
    }
    return false;
  }

  void step() {
    Frame& top = stack_.back();
    errno = 0;
    struct dirent* de = readdir(top.dir);
    if (!de) {
      if (errno) record(errno, "readdir", stack_.size() - 1);
      Frame done = std::move(top);
      stack_.pop_back();
      if (!stack_.empty() && !stack_.back().dir && !reopenParent(stack_.back(), done.dir)) {
        closedir(done.dir);
        for (Frame& f : stack_)
          if (f.dir) closedir(f.dir);
        stack_.clear();  // the walk cannot go on safely; the first error says why
        return;
      }
      closedir(done.dir);
      if (!stack_.empty()) {
        Frame& parent = stack_.back();
        if (unlinkat(dirfd(parent.dir), done.name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
          record(errno, "rmdir", stack_.size() - 1, done.name.c_str());
          stuck_.insert(InodeKey{done.dev, done.ino});  // not entered again when its parent is read again
        }
      }
      return;
    }
    const char* name = de->d_name;
    if (isDotOrDotDot(name)) return;
    int dfd = dirfd(top.dir);
    // d_type saves a stat per entry; DT_UNKNOWN (some file systems) is resolved by trying to open as a directory.
    if (de->d_type == DT_DIR || de->d_type == DT_UNKNOWN) {
      if (descend(top, dfd, name)) return;
    }
    unlinkEntry(top, dfd, name);
  }

  // Opens `name` as a directory and pushes it; false when it is not a directory (then it is unlinked instead).
  bool descend(Frame& top, int dfd, const char* name) {
    size_t depth = stack_.size() - 1;
    (void)top;
    int fd = openDir(dfd, name);
    int err = fd < 0 ? errno : 0;
    if (fd < 0 && err == EACCES && !root_) {
      // An unreadable directory: give ourselves rwx on it (AT_SYMLINK_NOFOLLOW: it may have become a symlink).
      // Should that fail too (not our directory: EPERM), the openat's EACCES is what went wrong.
      if (chmodDirAtNoFollow(dfd, name, S_IRWXU) == 0) {
        fd = openDir(dfd, name);
        err = fd < 0 ? errno : 0;
      }
    }
    if (fd < 0) {
      if (err == ENOTDIR || err == ELOOP) return false;  // a file or symlink (or became one): unlink it
      if (err != ENOENT) record(err, "openat", depth, name);
      return true;
    }
    struct statx stx;
    if (statxFd(fd, STATX_MODE | kStatxMntId | STATX_BLOCKS | STATX_INO, &stx) != 0) {
      record(errno, "statx", depth, name);
      ::close(fd);
      return true;
    }
    if (mountOf(fd, stx) != mount_) {
      // Another file system (or a bind mount of this one) is mounted here: never enter it.
      record(EBUSY, "rmdir", depth, name);
      ::close(fd);
      return true;
    }
    dev_t dev = makedev(stx.stx_dev_major, stx.stx_dev_minor);
    if (stuck_.count(InodeKey{dev, static_cast<ino_t>(stx.stx_ino)})) {
      ::close(fd);
      return true;
    }
    if (!root_ && (stx.stx_mode & (S_IWUSR | S_IXUSR)) != (S_IWUSR | S_IXUSR)) fchmod(fd, stx.stx_mode | S_IRWXU);
    if (bytes_) *bytes_ += stx.stx_blocks * 512;
    DIR* d = fdopendir(fd);
    if (!d) {
      record(errno, "fdopendir", depth, name);
      ::close(fd);
      return true;
    }
    try {
      stack_.push_back(Frame{d, name, dev, static_cast<ino_t>(stx.stx_ino)});
    } catch (...) {
      closedir(d);
      throw;
    }
    if (stack_.size() > kMaxOpenFrames) {
      Frame& old = stack_[stack_.size() - kMaxOpenFrames - 1];
      if (old.dir) {
        closedir(old.dir);
        old.dir = nullptr;
      }
    }
    return true;
  }

  void unlinkEntry(Frame& top, int dfd, const char* name) {
    if (bytes_) {
      struct stat st;
      if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0) *bytes_ += static_cast<uint64_t>(st.st_blocks) * 512;
    }
    if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT) return;
    // The unlinkat's errno is the one reported: a failed fchmod fallback (EPERM: the directory is another
    // user's) must not hide the EACCES that said why the entry could not be removed.
    int err = errno;
    if ((err == EACCES || err == EPERM) && !root_ && fchmod(dfd, S_IRWXU) == 0) {
      if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT) return;
      err = errno;
    }
    if (err == EISDIR) {
      // Became a directory since readdir: take it on the next pass of this directory.
      if (descend(top, dfd, name)) return;
    }
    record(err, "unlinkat", stack_.size() - 1, name);
  }

  uint64_t mount_;
  bool root_;
  std::string rootPath_;
  uint64_t* bytes_;
  std::vector<Frame> stack_;
  std::optional<Error> first_;
  std::unordered_set<InodeKey, InodeHash> stuck_;  // directories that could not be removed
};

}  // namespace

void removeTreeNoFollow(int parentFd, const std::string& name, const std::string& displayPath, uint64_t* bytes) {
  // Fast path for an empty directory (a workspace nobody wrote into): rmdir(2) alone, which the kernel refuses
  // for a mount point (EBUSY), a non-directory (ENOTDIR) and a non-empty directory (ENOTEMPTY/EEXIST).
  if (!bytes) {
    if (unlinkat(parentFd, name.c_str(), AT_REMOVEDIR) == 0) return;
    if (errno == ENOENT || errno == EBUSY) throwErrno(errno, "rmdir", displayPath);
  }
  struct statx parent;
  if (statxFd(parentFd, kStatxMntId, &parent) != 0) throwErrno(errno, "statx", displayPath);
  int fd = openat(parentFd, name.c_str(), kDirFlags);
  if (fd < 0 && errno == EACCES && geteuid() != 0) {
    // A directory its owner (a guest) made unreadable (chmod 000): we own it, so give ourselves rwx and open
    // again; should that fail (not ours: EPERM), the open's EACCES is what went wrong.
    if (chmodDirAtNoFollow(parentFd, name.c_str(), S_IRWXU) == 0)
      fd = openat(parentFd, name.c_str(), kDirFlags);
    else
      errno = EACCES;
  }
  if (fd < 0) {
    if (errno == ENOTDIR || errno == ELOOP) {
      // Not a directory: a file, or a symlink that is removed itself, never its target.
      struct stat st;
      if (bytes && fstatat(parentFd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0)
        *bytes += static_cast<uint64_t>(st.st_blocks) * 512;
      if (unlinkat(parentFd, name.c_str(), 0) != 0) throwErrno(errno, "unlinkat", displayPath);
      return;
    }
    throwErrno(errno, "openat", displayPath);
  }
  struct statx self;
  if (statxFd(fd, kStatxMntId | STATX_BLOCKS | STATX_INO, &self) != 0) {
    int err = errno;
    ::close(fd);
    throwErrno(err, "statx", displayPath);
  }
  if (mountOf(fd, self) != mountOf(parentFd, parent)) {
    ::close(fd);
    throwErrno(EBUSY, "rmdir", displayPath);
  }
  if (bytes) *bytes += self.stx_blocks * 512;
  Remover remover(mountOf(fd, self), bytes);
  remover.emptyDirectory(fd, displayPath, makedev(self.stx_dev_major, self.stx_dev_minor),
                         static_cast<ino_t>(self.stx_ino));
  remover.rethrowFirst();
  if (unlinkat(parentFd, name.c_str(), AT_REMOVEDIR) != 0) throwErrno(errno, "rmdir", displayPath);
}

void removeTreeNoFollow(const std::string& path) {
  std::string parent, leaf;
  splitPath(path, &parent, &leaf);
  UniqueFd dir(open(parent.c_str(), kDirPathFlags));
  if (!dir) throwErrno(errno, "open", path);
  removeTreeNoFollow(dir.get(), leaf, path);
}

}  // namespace vmspace

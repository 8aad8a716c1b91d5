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
#include "rename.h"
#include "statx.h"

namespace vmspace {
namespace {

struct Frame {
  DIR* dir;          // null while closed to bound the fds a deep tree takes (see kMaxOpenFrames)
  std::string path;  // display path of this directory
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
    DIR* d = fdopendir(fd);
    if (!d) {
      int err = errno;
      ::close(fd);
      record(err, "fdopendir", path);
      return;
    }
    stack_.push_back(Frame{d, path, {}, dev, ino});
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
  void record(int err, const char* syscall, const std::string& path) {
    if (first_) return;
    first_.emplace();
    first_->err = err;
    first_->syscall = syscall;
    first_->path = path;
  }

  // Climbing back into a parent whose DIR was closed: reopen it through the child's "..", and only if it is
  // still the same directory (a rename meanwhile must not redirect the walk). Restarting its readdir is fine:
  // what was removed is gone, and what could not be removed is in stuck_.
  bool reopenParent(Frame& parent, DIR* child) {
    int fd = openat(dirfd(child), "..", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_dev != parent.dev || st.st_ino != parent.ino) {
      if (fd >= 0) ::close(fd);
      record(ESTALE, "openat", parent.path);
      return false;
    }
    parent.dir = fdopendir(fd);
    if (!parent.dir) {
      record(errno, "fdopendir", parent.path);
      ::close(fd);
      return false;
    }
    return true;
  }

  void step() {
    Frame& top = stack_.back();
    errno = 0;
    struct dirent* de = readdir(top.dir);
    if (!de) {
      if (errno) record(errno, "readdir", top.path);
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
          record(errno, "rmdir", done.path);
          stuck_.insert(InodeKey{done.dev, done.ino});  // not entered again when its parent is read again
        }
      }
      return;
    }
    const char* name = de->d_name;
    if (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0))) return;
    int dfd = dirfd(top.dir);
    // d_type saves a stat per entry; DT_UNKNOWN (some file systems) is resolved by trying to open as a directory.
    if (de->d_type == DT_DIR || de->d_type == DT_UNKNOWN) {
      if (descend(top, dfd, name)) return;
    }
    unlinkEntry(top, dfd, name);
  }

  // Opens `name` as a directory and pushes it; false when it is not a directory (then it is unlinked instead).
  bool descend(Frame& top, int dfd, const char* name) {
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
    if (fd < 0 && errno == EACCES && !root_) {
      // An unreadable directory: give ourselves rwx on it (AT_SYMLINK_NOFOLLOW: it may have become a symlink).
      if (fchmodat(dfd, name, S_IRWXU, AT_SYMLINK_NOFOLLOW) == 0)
        fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
    }
    if (fd < 0) {
      if (errno == ENOTDIR || errno == ELOOP) return false;  // a file or symlink (or became one): unlink it
      if (errno != ENOENT) record(errno, "openat", top.path + "/" + name);
      return true;
    }
    std::string path = top.path + "/" + name;
    struct statx stx;
    if (statxFd(fd, STATX_MODE | kStatxMntId | STATX_BLOCKS | STATX_INO, &stx) != 0) {
      record(errno, "statx", path);
      ::close(fd);
      return true;
    }
    if (mountOf(fd, stx) != mount_) {
      // Another file system (or a bind mount of this one) is mounted here: never enter it.
      record(EBUSY, "rmdir", path);
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
      record(errno, "fdopendir", path);
      ::close(fd);
      return true;
    }
    stack_.push_back(Frame{d, std::move(path), name, dev, static_cast<ino_t>(stx.stx_ino)});
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
    if ((errno == EACCES || errno == EPERM) && !root_ && fchmod(dfd, S_IRWXU) == 0 && unlinkat(dfd, name, 0) == 0)
      return;
    if (errno == EISDIR) {
      // Became a directory since readdir: take it on the next pass of this directory.
      if (descend(top, dfd, name)) return;
    }
    record(errno, "unlinkat", top.path + "/" + name);
  }

  uint64_t mount_;
  bool root_;
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
  int fd = openat(parentFd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
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
  UniqueFd dir(open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY));
  if (!dir) throwErrno(errno, "open", path);
  removeTreeNoFollow(dir.get(), leaf, path);
}

}  // namespace vmspace

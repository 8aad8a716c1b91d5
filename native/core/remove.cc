#include "remove.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <unordered_set>

#include "btrfs_subvol.h"
#include "error.h"
#include "fd.h"
#include "io.h"
#include "quota.h"
#include "rename.h"
#include "statx.h"
#include "test_pause.h"
#include "trusted.h"
#include "walk.h"

namespace vmspace {
namespace {

// chmod of the directory `name` in `dirFd` to rwx for its owner, never through a symlink (an O_PATH|O_NOFOLLOW
// descriptor, then chmodFd) and only when it is on the mount `mount`: a directory mounted there from elsewhere (a
// bind mount a guest could not make, but root can) keeps its mode, EBUSY. A symlink in its place is ELOOP,
// anything but a directory ENOTDIR. 0, or -1 with errno.
int chmodDirOnMount(int dirFd, const char* name, uint64_t mount) {
  UniqueFd fd(openat(dirFd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return -1;
  struct statx stx;
  if (statxFd(fd.get(), STATX_MODE | kStatxMntId, &stx) != 0) return -1;
  if (!S_ISDIR(stx.stx_mode)) {
    errno = S_ISLNK(stx.stx_mode) ? ELOOP : ENOTDIR;
    return -1;
  }
  if (mountOf(fd.get(), stx) != mount) {
    errno = EBUSY;
    return -1;
  }
  return chmodFd(fd.get(), S_IRWXU);
}

// The message of ERR_POOL_NESTED for the pool root at `path`.
std::string nestedPoolDetail(const std::string& path) {
  return "'" + path + "' is a pool's root (a .vmspace/ with its version, owned by root or this user): it is " +
         "never removed as part of a workspace; remove it by hand (removeTree) if it is not a pool in use";
}

// Empties a directory tree over the walk of walk.h (its frames, fd budget and climb), removing each directory once
// its entries are gone. Errors are recorded, the first one kept, and the walk goes on with what it can still reach.
class Remover {
 public:
  Remover(uint64_t mount, uint64_t* bytes, const std::string& path, bool keepPools)
      : walk_(path, TreeWalk::Resume::FromStart), mount_(mount), root_(geteuid() == 0), keepPools_(keepPools),
        bytes_(bytes) {}

  // Empties the directory `fd` (taken over; device `dev`, inode `ino`), then, frame by frame, removes each
  // emptied directory below it. Restarting a reopened directory's readdir is fine: what was removed is gone, and
  // what could not be removed is in stuck_.
  void emptyDirectory(int fd, dev_t dev, ino_t ino) {
    if (int err = walk_.push(fd, "", dev, ino)) {
      record(err, "fdopendir", 0);
      return;
    }
    while (!walk_.empty()) step();
  }

  void rethrowFirst() {
    if (first_) throw *first_;
  }

 private:
  // Records the first error; the path is that of the directory at `depth` in the walk, plus `leaf` if given.
  void record(int err, const char* syscall, size_t depth, const char* leaf = nullptr) {
    if (first_) return;
    first_.emplace();
    first_->err = err;
    first_->syscall = syscall;
    first_->path = walk_.path(depth, leaf);
  }

  // A pool's root below the tree: left whole, as a mount point is.
  void recordPool(size_t depth, const char* leaf) {
    if (first_) return;
    record(EBUSY, "rmdir", depth, leaf);
    first_->code = "ERR_POOL_NESTED";
    first_->detail = nestedPoolDetail(first_->path);
  }

  void step() {
    struct dirent* de;
    if (int err = walk_.next(&de)) record(err, "readdir", walk_.depth());
    if (!de) {
      leave();
      return;
    }
    const char* name = de->d_name;
    int dfd = walk_.topFd();
    // d_type saves a stat per entry; DT_UNKNOWN (some file systems) is resolved by trying to open as a directory.
    if (de->d_type == DT_DIR || de->d_type == DT_UNKNOWN) {
      if (descend(dfd, name)) return;
    }
    unlinkEntry(dfd, name);
  }

  // The top directory is empty (or as empty as it gets): back to its parent, and removed from it.
  void leave() {
    TreeWalk::Left done;
    const char* syscall = "openat";
    if (int err = walk_.pop(&done, &syscall)) {
      record(err, syscall, walk_.depth());
      walk_.abandon();  // the walk cannot go on safely; the first error says why
      return;
    }
    if (walk_.empty()) return;
    if (unlinkat(walk_.topFd(), done.name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
      record(errno, "rmdir", walk_.depth(), done.name.c_str());
      stuck_.insert(InodeKey{done.dev, done.ino});  // not entered again when its parent is read again
    }
  }

  // Opens `name` as a directory and pushes it; false when it is not a directory (then it is unlinked instead).
  bool descend(int dfd, const char* name) {
    size_t depth = walk_.depth();
    int fd = walk_.openDir(dfd, name);
    int err = fd < 0 ? errno : 0;
    if (fd < 0 && err == EACCES && !root_) {
      // An unreadable directory: give ourselves rwx on it (never through a symlink, never on another mount).
      // Should that fail too (not our directory: EPERM), the openat's EACCES is what went wrong.
      if (chmodDirOnMount(dfd, name, mount_) == 0) {
        fd = walk_.openDir(dfd, name);
        err = fd < 0 ? errno : 0;
      } else if (errno == EBUSY) {
        record(EBUSY, "rmdir", depth, name);  // another file system (or a bind mount) here: never entered
        return true;
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
    if (keepPools_ && isPoolRoot(fd)) {
      recordPool(depth, name);
      ::close(fd);
      return true;
    }
    dev_t dev = makedev(stx.stx_dev_major, stx.stx_dev_minor);
    if (stuck_.count(InodeKey{dev, static_cast<ino_t>(stx.stx_ino)})) {
      ::close(fd);
      return true;
    }
    // A read-only btrfs subvolume (its owner makes one without privilege: a guest can) refuses every unlink in
    // it: made writable first, as its owner or root may (inode 256 first: no extra syscall for other directories).
    // The flag's failure is recorded (the first errno that went wrong: the unlinks in it then fail too) and the
    // walk goes on, removing what it can.
    if (stx.stx_ino == kBtrfsFirstFreeObjectId && isSubvolumeRoot(fd)) {
      if (int e = setSubvolumeReadOnly(fd, false)) record(e, "ioctl(BTRFS_IOC_SUBVOL_SETFLAGS)", depth, name);
    }
    // The fchmod is a fallback, not a step: a non-owner gets EPERM while the group or other bits may still let it
    // remove every entry. So its failure is no error; an unlink it did not make possible reports its own errno.
    if (!root_ && (stx.stx_mode & (S_IWUSR | S_IXUSR)) != (S_IWUSR | S_IXUSR) &&
        fchmod(fd, stx.stx_mode | S_IRWXU) != 0 && errno != EPERM)
      record(errno, "fchmod", depth, name);
    if (bytes_) *bytes_ += stx.stx_blocks * 512;
    if (int e = walk_.push(fd, name, dev, static_cast<ino_t>(stx.stx_ino))) record(e, "fdopendir", depth, name);
    return true;
  }

  void unlinkEntry(int dfd, const char* name) {
    if (bytes_) {
      struct stat st;
      if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0) *bytes_ += static_cast<uint64_t>(st.st_blocks) * 512;
    }
    if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT) {
      testPausePoint("remove:after-unlink");
      return;
    }
    // The unlinkat's errno is the one reported: a failed fchmod fallback (EPERM: the directory is another
    // user's) must not hide the EACCES that said why the entry could not be removed.
    int err = errno;
    if ((err == EACCES || err == EPERM) && !root_ && fchmod(dfd, S_IRWXU) == 0) {
      if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT) return;
      err = errno;
    }
    if (err == EISDIR) {
      // Became a directory since readdir: take it on the next pass of this directory.
      if (descend(dfd, name)) return;
    }
    record(err, "unlinkat", walk_.depth(), name);
  }

  TreeWalk walk_;
  uint64_t mount_;
  bool root_;
  bool keepPools_;  // pool roots are not entered (removeTreeNoFollow's keepPools)
  uint64_t* bytes_;
  std::optional<Error> first_;
  std::unordered_set<InodeKey, InodeHash> stuck_;  // directories that could not be removed
};

}  // namespace

void removeTreeNoFollow(int parentFd, const std::string& name, const std::string& displayPath, uint64_t* bytes,
                        bool keepPools) {
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
    // again; should that fail (not ours: EPERM), the open's EACCES is what went wrong. A directory mounted there
    // keeps its mode: EBUSY, as below.
    if (chmodDirOnMount(parentFd, name.c_str(), mountOf(parentFd, parent)) == 0)
      fd = openat(parentFd, name.c_str(), kDirFlags);
    else if (errno == EBUSY)
      throwErrno(EBUSY, "rmdir", displayPath);
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
  if (keepPools && isPoolRoot(fd)) {
    ::close(fd);
    throwCode("ERR_POOL_NESTED", nestedPoolDetail(displayPath), EBUSY, "rmdir", displayPath);
  }
  if (bytes) *bytes += self.stx_blocks * 512;
  Remover remover(mountOf(fd, self), bytes, displayPath, keepPools);
  remover.emptyDirectory(fd, makedev(self.stx_dev_major, self.stx_dev_minor), static_cast<ino_t>(self.stx_ino));
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

#include "usage.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <unordered_set>
#include <vector>

#include "error.h"
#include "fd.h"
#include "statx.h"

namespace vmspace {
namespace {

constexpr size_t kMaxOpenFrames = 64;  // as remove.cc: depth must not cost fds
constexpr unsigned kExtentsPerCall = 256;

struct Frame {
  DIR* dir;  // null while closed (see kMaxOpenFrames)
  long pos;  // telldir() when it was closed: where the walk resumes after reopening it
  std::string path;
  dev_t dev;
  ino_t ino;
};

// Adds the extents of regular file `fd` to `r`: shared or exclusive. A file system without FIEMAP (EOPNOTSUPP)
// has its blocks counted exclusive.
void addExtents(int fd, uint64_t blocksBytes, UsageReport* r, const std::string& shown) {
  std::vector<char> buf(sizeof(struct fiemap) + kExtentsPerCall * sizeof(struct fiemap_extent));
  auto* fm = reinterpret_cast<struct fiemap*>(buf.data());
  uint64_t start = 0;
  for (;;) {
    memset(buf.data(), 0, buf.size());
    fm->fm_start = start;
    fm->fm_length = FIEMAP_MAX_OFFSET - start;
    fm->fm_extent_count = kExtentsPerCall;
    if (ioctl(fd, FS_IOC_FIEMAP, fm) != 0) {
      if (errno == EOPNOTSUPP || errno == ENOTTY) {
        r->exclusiveBytes += blocksBytes;
        return;
      }
      throwErrno(errno, "ioctl(FS_IOC_FIEMAP)", shown);
    }
    if (fm->fm_mapped_extents == 0) return;
    const struct fiemap_extent* last = nullptr;
    for (unsigned i = 0; i < fm->fm_mapped_extents; i++) {
      const struct fiemap_extent& e = fm->fm_extents[i];
      if (e.fe_flags & FIEMAP_EXTENT_SHARED)
        r->sharedBytes += e.fe_length;
      else
        r->exclusiveBytes += e.fe_length;
      last = &e;
    }
    if (last->fe_flags & FIEMAP_EXTENT_LAST) return;
    uint64_t next = last->fe_logical + last->fe_length;
    if (next <= start) return;  // no progress: never loop
    start = next;
  }
}

class Walker {
 public:
  Walker(uint64_t mount, UsageReport* r, const std::atomic<bool>* cancel) : mount_(mount), r_(r), cancel_(cancel) {}
  ~Walker() {
    for (Frame& f : stack_)
      if (f.dir) closedir(f.dir);
  }

  void run(int fd, const std::string& path, dev_t dev, ino_t ino) {
    DIR* d = fdopendir(fd);
    if (!d) {
      int err = errno;
      ::close(fd);
      throwErrno(err, "fdopendir", path);
    }
    stack_.push_back(Frame{d, 0, path, dev, ino});
    while (!stack_.empty()) step();
  }

 private:
  void step() {
    if (cancel_ && cancel_->load(std::memory_order_relaxed)) throwErrno(ECANCELED, "usage", stack_.front().path);
    Frame& top = stack_.back();
    errno = 0;
    struct dirent* de = readdir(top.dir);
    if (!de) {
      if (errno) throwErrno(errno, "readdir", top.path);
      DIR* done = top.dir;
      stack_.pop_back();
      if (!stack_.empty() && !stack_.back().dir) reopen(stack_.back(), done);
      closedir(done);
      return;
    }
    const char* name = de->d_name;
    if (isDotOrDotDot(name)) return;
    int dfd = dirfd(top.dir);
    std::string path = top.path + "/" + name;
    struct statx stx;
    if (statx(dfd, name, AT_SYMLINK_NOFOLLOW | AT_STATX_DONT_SYNC,
              STATX_TYPE | STATX_MODE | STATX_INO | STATX_NLINK | STATX_SIZE | STATX_BLOCKS, &stx) != 0) {
      if (errno == ENOENT) return;  // removed meanwhile
      throwErrno(errno, "statx", path);
    }
    if (S_ISDIR(stx.stx_mode))
      enter(dfd, name, std::move(path));
    else
      count(dfd, name, path, stx);
  }

  // The subdirectory `name` of `dfd`: counted and pushed, unless another file system is mounted there.
  void enter(int dfd, const char* name, std::string path) {
    int fd = openat(dfd, name, kDirFlags);
    if (fd < 0) {
      if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP) return;  // changed meanwhile
      throwErrno(errno, "open", path);
    }
    struct statx stx;
    if (statxFd(fd, kStatxMntId | STATX_INO | STATX_BLOCKS, &stx) != 0) {
      int err = errno;
      ::close(fd);
      throwErrno(err, "statx", path);
    }
    if (mountOf(fd, stx) != mount_) {  // another file system mounted here: not this workspace's space
      ::close(fd);
      return;
    }
    r_->dirs++;
    r_->allocatedBytes += stx.stx_blocks * 512;
    DIR* d = fdopendir(fd);
    if (!d) {
      int err = errno;
      ::close(fd);
      throwErrno(err, "fdopendir", path);
    }
    stack_.push_back(
        Frame{d, 0, std::move(path), makedev(stx.stx_dev_major, stx.stx_dev_minor), static_cast<ino_t>(stx.stx_ino)});
    if (stack_.size() > kMaxOpenFrames) {
      Frame& old = stack_[stack_.size() - kMaxOpenFrames - 1];
      if (old.dir) {
        old.pos = telldir(old.dir);
        closedir(old.dir);
        old.dir = nullptr;
      }
    }
  }

  // An entry that is no directory (statx `stx`): its blocks, and for a regular file its size and extents; a hard
  // link of a file counted already is passed over.
  void count(int dfd, const char* name, const std::string& path, const struct statx& stx) {
    if (S_ISREG(stx.stx_mode) && stx.stx_nlink > 1 &&
        !links_.insert(InodeKey{makedev(stx.stx_dev_major, stx.stx_dev_minor), static_cast<ino_t>(stx.stx_ino)}).second)
      return;  // a hard link of a file counted already
    r_->allocatedBytes += stx.stx_blocks * 512;
    if (!S_ISREG(stx.stx_mode)) {
      r_->others++;
      return;
    }
    r_->files++;
    r_->logicalBytes += stx.stx_size;
    if (stx.stx_blocks == 0) return;  // all hole (or inline in the inode): no extents of its own
    // O_PATH cannot FIEMAP; O_RDONLY|O_NOFOLLOW|O_NONBLOCK on what statx saw as a regular file.
    UniqueFd fd(openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
    if (!fd) {
      if (errno == ENOENT || errno == ELOOP) return;
      throwErrno(errno, "open", path);
    }
    addExtents(fd.get(), stx.stx_blocks * 512, r_, path);
  }

  // Climbing back into a parent whose DIR was closed: reopened through the child's "..", only if it is still the
  // same directory, and its readdir resumed where it was (seekdir to the telldir cookie).
  void reopen(Frame& parent, DIR* child) {
    UniqueFd fd(openat(dirfd(child), "..", kDirFlags));
    struct stat st;
    if (!fd || fstat(fd.get(), &st) != 0 || st.st_dev != parent.dev || st.st_ino != parent.ino)
      throwErrno(ESTALE, "open", parent.path);
    parent.dir = fdopendir(fd.get());
    if (!parent.dir) throwErrno(errno, "fdopendir", parent.path);
    fd.release();
    seekdir(parent.dir, parent.pos);
  }

  uint64_t mount_;
  UsageReport* r_;
  const std::atomic<bool>* cancel_;
  std::vector<Frame> stack_;
  std::unordered_set<InodeKey, InodeHash> links_;
};

}  // namespace

uint64_t exclusiveBytesOfFile(int fd, const std::string& shown) {
  struct stat st;
  if (fstat(fd, &st) != 0) throwErrno(errno, "fstat", shown);
  UsageReport r;
  addExtents(fd, static_cast<uint64_t>(st.st_blocks) * 512, &r, shown);
  return r.exclusiveBytes;
}

UsageReport workspaceUsage(int wsFd, const std::string& shown, const QuotaRef& ref, const std::atomic<bool>* cancel) {
  UsageReport r;
  struct statx self;
  if (statxFd(wsFd, kStatxMntId | STATX_INO | STATX_BLOCKS, &self) != 0) throwErrno(errno, "statx", shown);
  r.allocatedBytes += self.stx_blocks * 512;
  int fd = openat(wsFd, ".", kDirFlags);  // a description of our own: the lease fd's readdir offset is not ours
  if (fd < 0) throwErrno(errno, "open", shown);
  Walker w(mountOf(wsFd, self), &r, cancel);
  w.run(fd, shown, makedev(self.stx_dev_major, self.stx_dev_minor), static_cast<ino_t>(self.stx_ino));
  r.quota = quotaUsageOf(wsFd, ref);
  return r;
}

}  // namespace vmspace

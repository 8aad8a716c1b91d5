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
#include <unordered_map>
#include <vector>

#include "error.h"
#include "fd.h"
#include "io.h"
#include "statx.h"
#include "walk.h"

namespace vmspace {
namespace {

constexpr unsigned kExtentsPerCall = 256;

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

// The walk of a workspace's tree (walk.h: its frames, fd budget and climb), counting each entry once.
class Walker {
 public:
  Walker(uint64_t mount, UsageReport* r, const std::atomic<bool>* cancel, const std::string& path)
      : walk_(path, TreeWalk::Resume::AtPosition), mount_(mount), r_(r), cancel_(cancel) {}

  void run(int fd, dev_t dev, ino_t ino) {
    if (int err = walk_.push(fd, "", dev, ino)) throwErrno(err, "fdopendir", walk_.path(0));
    while (!walk_.empty()) step();
    settleLinks();
  }

 private:
  void step() {
    if (cancel_ && cancel_->load(std::memory_order_relaxed)) throwErrno(ECANCELED, "usage", walk_.path(0));
    struct dirent* de;
    if (int err = walk_.next(&de)) throwErrno(err, "readdir", walk_.path(walk_.depth()));
    if (!de) {
      leave();
      return;
    }
    const char* name = de->d_name;
    int dfd = walk_.topFd();
    struct statx stx;
    if (statx(dfd, name, AT_SYMLINK_NOFOLLOW | AT_STATX_DONT_SYNC,
              STATX_TYPE | STATX_MODE | STATX_INO | STATX_NLINK | STATX_SIZE | STATX_BLOCKS, &stx) != 0) {
      if (errno == ENOENT) return;  // removed meanwhile
      throwErrno(errno, "statx", walk_.path(walk_.depth(), name));
    }
    if (S_ISDIR(stx.stx_mode))
      enter(dfd, name);
    else
      count(dfd, name, stx);
  }

  // Back to the parent; a parent that cannot be reopened as the directory the walk came from is ESTALE.
  void leave() {
    TreeWalk::Left done;
    const char* syscall = "openat";
    if (int err = walk_.pop(&done, &syscall)) {
      if (strcmp(syscall, "fdopendir") == 0) throwErrno(err, "fdopendir", walk_.path(walk_.depth()));
      throwErrno(ESTALE, "open", walk_.path(walk_.depth()));
    }
  }

  // The subdirectory `name` of `dfd`: counted and pushed, unless another file system is mounted there.
  void enter(int dfd, const char* name) {
    int fd = walk_.openDir(dfd, name);
    if (fd < 0) {
      if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP) return;  // changed meanwhile
      throwErrno(errno, "open", walk_.path(walk_.depth(), name));
    }
    struct statx stx;
    if (statxFd(fd, kStatxMntId | STATX_INO | STATX_BLOCKS, &stx) != 0) {
      int err = errno;
      ::close(fd);
      throwErrno(err, "statx", walk_.path(walk_.depth(), name));
    }
    if (mountOf(fd, stx) != mount_) {  // another file system mounted here: not this workspace's space
      ::close(fd);
      return;
    }
    r_->dirs++;
    r_->allocatedBytes += stx.stx_blocks * 512;
    if (int err = walk_.push(fd, name, makedev(stx.stx_dev_major, stx.stx_dev_minor), static_cast<ino_t>(stx.stx_ino)))
      throwErrno(err, "fdopendir", walk_.path(walk_.depth(), name));
  }

  // A file with links outside the workspace (a template's shared file, share.h, in every workspace made from it):
  // what counted as its exclusive extents is shared with those, so it moves to sharedBytes.
  void settleLinks() {
    for (const auto& [key, l] : links_) {
      if (l.found >= l.nlink) continue;
      r_->exclusiveBytes -= l.exclusive;
      r_->sharedBytes += l.exclusive;
    }
  }

  // An entry that is no directory (statx `stx`): its blocks, and for a regular file its size and extents; a hard
  // link of a file counted already is passed over.
  void count(int dfd, const char* name, const struct statx& stx) {
    Links* link = nullptr;
    if (S_ISREG(stx.stx_mode) && stx.stx_nlink > 1) {
      auto [it, added] = links_.try_emplace(
          InodeKey{makedev(stx.stx_dev_major, stx.stx_dev_minor), static_cast<ino_t>(stx.stx_ino)}, Links{});
      it->second.nlink = stx.stx_nlink;
      if (++it->second.found > 1) return;  // a hard link of a file counted already
      link = &it->second;
    }
    r_->allocatedBytes += stx.stx_blocks * 512;
    if (!S_ISREG(stx.stx_mode)) {
      r_->others++;
      return;
    }
    r_->files++;
    r_->logicalBytes += stx.stx_size;
    if (stx.stx_blocks == 0) return;  // all hole (or inline in the inode): no extents of its own
    // FIEMAP needs an fd that O_PATH is not; opened only while it is the regular file statx saw (a guest may swap
    // in a device node: it is never opened).
    dev_t dev = makedev(stx.stx_dev_major, stx.stx_dev_minor);
    auto ino = static_cast<ino_t>(stx.stx_ino);
    UniqueFd fd(walk_.withFds([&] { return openRegularAtNoFollow(dfd, name, O_RDONLY | O_NONBLOCK, dev, ino); }));
    if (!fd) {
      if (errno == ENOENT || errno == ELOOP || errno == ESTALE) return;  // changed meanwhile
      throwErrno(errno, "open", walk_.path(walk_.depth(), name));
    }
    try {
      const uint64_t before = r_->exclusiveBytes;
      addExtents(fd.get(), stx.stx_blocks * 512, r_, std::string());  // the path is built only on failure
      if (link) link->exclusive = r_->exclusiveBytes - before;
    } catch (Error& e) {
      e.path = walk_.path(walk_.depth(), name);
      throw;
    }
  }

  TreeWalk walk_;
  uint64_t mount_;
  UsageReport* r_;
  const std::atomic<bool>* cancel_;
  struct Links {
    uint32_t nlink = 0, found = 0;  // st_nlink, and the links this walk met
    uint64_t exclusive = 0;         // what the file added to exclusiveBytes
  };
  std::unordered_map<InodeKey, Links, InodeHash> links_;
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
  Walker w(mountOf(wsFd, self), &r, cancel, shown);
  w.run(fd, makedev(self.stx_dev_major, self.stx_dev_minor), static_cast<ino_t>(self.stx_ino));
  r.quota = quotaUsageOf(wsFd, ref);
  return r;
}

}  // namespace vmspace

#include "io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <memory>

#include "error.h"
#include "fd.h"
#include "statx.h"

namespace vmspace {

int chmodFd(int fd, mode_t mode) {
  if (fchmod(fd, mode) == 0) return 0;
  if (errno != EBADF) return -1;
  std::string link = "/proc/self/fd/" + std::to_string(fd);
  return chmod(link.c_str(), mode);
}

namespace {

// ESTALE unless `st` is the regular file `dev`/`ino` (ELOOP for a symlink): the check of openRegularAtNoFollow.
int regularFileMismatch(const struct stat& st, dev_t dev, ino_t ino) {
  if (S_ISLNK(st.st_mode)) return ELOOP;
  return S_ISREG(st.st_mode) && st.st_dev == dev && st.st_ino == ino ? 0 : ESTALE;
}

}  // namespace

int openRegularAtNoFollow(int dirFd, const char* name, int flags, dev_t dev, ino_t ino) {
  UniqueFd path(openat(dirFd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC));
  if (!path) return -1;
  struct stat st;
  if (fstat(path.get(), &st) != 0) return -1;
  if (int err = regularFileMismatch(st, dev, ino)) {
    errno = err;
    return -1;
  }
  std::string link = "/proc/self/fd/" + std::to_string(path.get());
  int fd = open(link.c_str(), (flags & ~O_NOFOLLOW) | O_CLOEXEC | O_NOCTTY);
  if (fd >= 0 || errno != ENOENT) return fd;
  // No /proc: by name, then the same check on what was opened.
  UniqueFd byName(openat(dirFd, name, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!byName) return -1;
  if (fstat(byName.get(), &st) != 0) return -1;
  if (int err = regularFileMismatch(st, dev, ino)) {
    errno = err;
    return -1;
  }
  return byName.release();
}

int readRegularFileAt(int at, const char* name, int extraFlags, size_t limit, std::string* out, const char** syscall) {
  const char* ignored;
  const char*& step = syscall ? *syscall : ignored;
  step = "open";
  UniqueFd fd(openat(at, name, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY | extraFlags));
  if (!fd) return errno;
  step = "read";
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return errno;
  if (S_ISDIR(st.st_mode)) return EISDIR;
  if (!S_ISREG(st.st_mode)) return EINVAL;  // fifo, device (e.g. /dev/zero), socket
  if (static_cast<size_t>(st.st_size) > limit) return EFBIG;
  out->resize(static_cast<size_t>(st.st_size) + 1);
  size_t got = 0;
  for (;;) {
    if (got == out->size()) {
      if (got > limit) return EFBIG;
      out->resize(got * 2 + 64);
    }
    ssize_t n = read(fd.get(), &(*out)[got], out->size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  out->resize(got);
  return 0;
}

int writeAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    done += static_cast<size_t>(n);
  }
  return 0;
}

std::vector<std::pair<std::string, unsigned char>> readNames(int dirFd, const std::string& shown) {
  std::vector<std::pair<std::string, unsigned char>> out;
  forEachName(dirFd, shown, [&out](const struct dirent& de) { out.emplace_back(de.d_name, de.d_type); });
  return out;
}

void forEachName(int dirFd, const std::string& shown, const std::function<void(const struct dirent&)>& each) {
  int fd = openat(dirFd, ".", kDirFlags);
  if (fd < 0) throwErrno(errno, "open", shown);
  DIR* dir = fdopendir(fd);
  if (!dir) {
    int err = errno;
    ::close(fd);
    throwErrno(err, "opendir", shown);
  }
  std::unique_ptr<DIR, int (*)(DIR*)> closer(dir, closedir);
  for (;;) {
    errno = 0;
    struct dirent* de = readdir(dir);
    if (!de) {
      if (errno) throwErrno(errno, "readdir", shown);
      return;
    }
    if (isDotOrDotDot(de->d_name)) continue;
    each(*de);
  }
}

int pwriteAll(int fd, const char* buf, size_t len, off_t off) {
  int stalls = 0;
  while (len > 0) {
    ssize_t n = pwrite(fd, buf, len, off);
    if (n <= 0) {
      int err = n < 0 ? errno : EIO;
      if ((n == 0 || err == EAGAIN || err == EINTR) && ++stalls < kWriteTries) continue;
      return err;
    }
    stalls = 0;
    buf += n;
    len -= static_cast<size_t>(n);
    off += n;
  }
  return 0;
}

TempFile::TempFile(int dirFd, std::string name, mode_t mode, const std::string& shown)
    : dirFd_(dirFd), name_(std::move(name)) {
  fd_ = openat(dirFd_, name_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, mode);
  if (fd_ < 0) throwErrno(errno, "open", shown);
}

TempFile::~TempFile() {
  close();
  // The temp name is ours alone (O_EXCL, random): nothing else is removed by this.
  if (!published_) unlinkat(dirFd_, name_.c_str(), 0);
}

void TempFile::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

int64_t ageMs(int dirFd, const char* name) {
  struct statx stx;
  if (statx(dirFd, name, AT_SYMLINK_NOFOLLOW, STATX_BTIME | STATX_CTIME, &stx) != 0) return 0;
  struct statx_timestamp t = (stx.stx_mask & STATX_BTIME) ? stx.stx_btime : stx.stx_ctime;
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  return (now.tv_sec - t.tv_sec) * 1000 + (now.tv_nsec - static_cast<long>(t.tv_nsec)) / 1000000;
}

bool sameEntry(int dirFd, const std::string& name, const struct stat& own) {
  struct stat at;
  return fstatat(dirFd, name.c_str(), &at, AT_SYMLINK_NOFOLLOW) == 0 && at.st_ino == own.st_ino &&
         at.st_dev == own.st_dev;
}

bool entryExists(int dirFd, const std::string& name) {
  struct stat st;
  return fstatat(dirFd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
}

bool readLink(int dirFd, const std::string& name, std::string* target) {
  char buf[PATH_MAX];
  ssize_t n = readlinkat(dirFd, name.c_str(), buf, sizeof buf);
  if (n < 0) return false;
  if (static_cast<size_t>(n) == sizeof buf) {
    errno = ENAMETOOLONG;
    return false;
  }
  target->assign(buf, static_cast<size_t>(n));
  return true;
}

}  // namespace vmspace

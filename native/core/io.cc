#include "io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "error.h"
#include "fd.h"

namespace vmspace {

int readRegularFileAt(int at, const char* name, int extraFlags, size_t limit, std::string* out,
                      const char** syscall) {
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
      return out;
    }
    if (isDotOrDotDot(de->d_name)) continue;
    out.emplace_back(de->d_name, de->d_type);
  }
}

}  // namespace vmspace

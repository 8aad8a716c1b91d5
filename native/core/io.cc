#include "io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

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

}  // namespace vmspace

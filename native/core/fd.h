// The fd idioms of the core: an owned file descriptor (closed exactly once, when it goes out of scope, unless
// released), the flags directories are opened with, and the test that skips "." and "..".
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <utility>

namespace vmspace {

// A directory opened to be walked, leased or written in: never through a symlink (O_NOFOLLOW gives ELOOP, and
// O_DIRECTORY ENOTDIR for anything else), and never the controlling terminal of the process.
constexpr int kDirFlags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY;
// A directory given by its path by the caller: a symlink to it is followed, as for any path argument.
constexpr int kDirPathFlags = O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY;

// "." or "..": the entries of every directory that a walk skips.
inline bool isDotOrDotDot(const char* name) {
  return name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0));
}

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  // close(2) errors are not retried: on Linux the descriptor is gone whatever close returns.
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace vmspace

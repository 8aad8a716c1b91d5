#include "lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "error.h"
#include "fd.h"

namespace vmspace {

namespace {
// lockOpen's retries when the file it got the lock on was replaced in between: each one needs another deletion
// or rename at `path` between our open and our check, so only a process replacing the file in a loop reaches it.
constexpr int kMaxReplacedTries = 64;
}  // namespace

int lockOpenFile(const std::string& path, int* err) {
  // O_NOFOLLOW: a symlink at the lock path (dangling: O_CREAT would make its target, anywhere) is refused with
  // ELOOP and nothing is made; only the last component is checked, as for any path the caller gives.
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, 0600);
  if (fd < 0 && (errno == EACCES || errno == EISDIR || errno == EROFS)) {
    int first = errno;
    fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);  // flock needs no write access
    if (fd < 0 && errno == ENOENT) errno = first;  // missing and not creatable: the first
  }
  if (fd < 0) *err = errno;
  return fd;
}

int lockOpen(const std::string& path, bool shared, bool* acquired) {
  int err = 0;
  UniqueFd fd(lockOpenFile(path, &err));
  if (!fd) throwErrno(err, "open", path);
  for (int tries = 1;; tries++) {
    err = lockTry(fd.get(), shared);
    *acquired = err == 0;
    if (err == EWOULDBLOCK) return fd.release();  // the wait checks the file once granted
    if (err != 0) throwErrno(err, "flock", path);
    int raw = fd.release();
    const char* syscall = "";
    err = lockFollowPath(path, &raw, &syscall);
    fd.reset(raw);
    if (err == 0) return fd.release();
    if (err != EAGAIN) throwErrno(err, syscall, path);
    if (tries == kMaxReplacedTries) throwErrno(ESTALE, "flock", path);
  }
}

int lockFollowPath(const std::string& path, int* fd, const char** syscall) {
  struct stat own, at;
  if (fstat(*fd, &own) != 0) {
    *syscall = "fstat";
    return errno;
  }
  // A link count of 0: deleted (the name is gone or names a new file). The last component is not followed, as
  // the open that made *fd did not follow it (a symlink put there meanwhile is a replacement: the reopen refuses it).
  if (own.st_nlink > 0) {
    if (lstat(path.c_str(), &at) == 0) {
      if (at.st_dev == own.st_dev && at.st_ino == own.st_ino) return 0;
    } else if (errno != ENOENT) {
      *syscall = "stat";
      return errno;
    }
  }
  int err = 0;
  int fresh = lockOpenFile(path, &err);
  if (fresh < 0) {
    *syscall = "open";
    return err;
  }
  ::close(*fd);  // drops the lock on the dead file: its other waiters recheck too
  *fd = fresh;
  return EAGAIN;
}

int lockTry(int fd, bool shared) { return flock(fd, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB) == 0 ? 0 : errno; }

int lockWaitBlocking(int fd, bool shared) { return flock(fd, shared ? LOCK_SH : LOCK_EX) == 0 ? 0 : errno; }

namespace {
void onCancelSignal(int) {}
}  // namespace

int lockCancelSignal() {
  static int sig = [] {
    // VMSPACE_LOCK_SIGNAL (read once): "0" never installs a handler (waits poll every 2 ms); "N" takes only the
    // real-time signal N (SIGRTMIN..SIGRTMAX), if it has no handler yet, else polls. Unset: the first free one.
    int first = SIGRTMIN + 4, last = SIGRTMAX;
    if (const char* env = std::getenv("VMSPACE_LOCK_SIGNAL")) {
      char* end = nullptr;
      long n = std::strtol(env, &end, 10);
      if (end == env || *end != '\0' || n == 0 || n < SIGRTMIN || n > SIGRTMAX) return 0;
      first = last = static_cast<int>(n);
    }
    // A real-time signal no one else in the process handles: glibc keeps the first few for itself and
    // SIGRTMIN already starts after them; we take the first free one from SIGRTMIN + 4.
    for (int s = first; s <= last; s++) {
      struct sigaction old;
      if (sigaction(s, nullptr, &old) != 0 || old.sa_handler != SIG_DFL) continue;
      struct sigaction sa = {};
      sa.sa_handler = onCancelSignal;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = 0;  // no SA_RESTART: a blocked flock returns EINTR
      if (sigaction(s, &sa, nullptr) == 0) return s;
    }
    return 0;
  }();
  return sig;
}

}  // namespace vmspace

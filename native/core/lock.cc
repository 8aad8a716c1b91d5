#include "lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "error.h"
#include "fd.h"

namespace vmspace {

namespace {
// lockOpen's retries when the file it got the lock on was replaced in between: each one needs another deletion
// or rename at `path` between our open and our check, so only a process replacing the file in a loop reaches it.
constexpr int kMaxReplacedTries = 64;

// One registered lock fd (lockClaim).
struct Claim {
  dev_t dev;
  ino_t ino;
  bool shared;
  bool create;  // how lockFollowPath reopens the path
  long owner;   // the requesting thread (lib: threadId + 1)
};

std::mutex claimsMu;

// fd -> its claim. Never destroyed: lock waits run on detached threads that may outlive static destructors.
std::unordered_map<int, Claim>& claims() {
  static auto* table = new std::unordered_map<int, Claim>;
  return *table;
}

// Whether a request `want` would wait on the registered `held` (see lockClaim in lock.h). Another thread's
// request waits in flock on an open file description of its own, as another process's does.
bool waitsOnItself(const Claim& held, const Claim& want) {
  if (held.dev != want.dev || held.ino != want.ino) return false;
  if (held.shared && want.shared) return false;
  return held.owner == want.owner;
}

// Registers `fd` as `c`, unless another registered fd makes it wait on itself (EDEADLK). `except` is not
// compared (the fd being replaced by lockFollowPath). Under claimsMu.
int claimLocked(int fd, const Claim& c, int except) {
  for (const auto& [other, held] : claims())
    if (other != except && waitsOnItself(held, c)) return EDEADLK;
  claims()[fd] = c;
  return 0;
}
}  // namespace

int lockClaim(int fd, bool shared, bool create, long owner) {
  struct stat st;
  if (fstat(fd, &st) != 0) return errno;
  std::lock_guard<std::mutex> lock(claimsMu);
  return claimLocked(fd, Claim{st.st_dev, st.st_ino, shared, create, owner}, -1);
}

void lockClose(int fd) {
  {
    std::lock_guard<std::mutex> lock(claimsMu);
    claims().erase(fd);
  }
  ::close(fd);
}

int lockOpenFile(const std::string& path, bool create, int* err) {
  // O_NOFOLLOW: a symlink at the lock path (dangling: O_CREAT would make its target, anywhere) is refused with
  // ELOOP and nothing is made; only the last component is checked, as for any path the caller gives.
  int fd = create ? open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, 0600)
                  : open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0 && create && (errno == EACCES || errno == EISDIR || errno == EROFS)) {
    int first = errno;
    fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);  // flock needs no write access
    if (fd < 0 && errno == ENOENT) errno = first;  // missing and not creatable: the first
  }
  if (fd < 0) *err = errno;
  return fd;
}

namespace {
// A registered lock fd that lockOpen has not handed out yet: closed with its registration on a throw.
struct ClaimedFd {
  int fd = -1;
  ~ClaimedFd() {
    if (fd >= 0) lockClose(fd);
  }
  int release() { return std::exchange(fd, -1); }
};

[[noreturn]] void throwReentrant(const std::string& path) {
  throwCode("ERR_LOCK_REENTRANT",
            "this thread already holds or waits for a lock on the file at " + path +
                " (under this name or another); waiting for it here would wait on itself",
            EDEADLK, "flock", path);
}
}  // namespace

int lockOpen(const std::string& path, bool shared, bool* acquired, bool create, long owner) {
  int err = 0;
  ClaimedFd fd;
  int opened = lockOpenFile(path, create, &err);
  if (opened < 0) throwErrno(err, "open", path);
  // Registered before the first flock, so that two calls of this process racing for a free file cannot both
  // pass the check: the second is refused, never left waiting for the first.
  err = lockClaim(opened, shared, create, owner);
  if (err != 0) {
    ::close(opened);
    if (err == EDEADLK) throwReentrant(path);
    throwErrno(err, "fstat", path);
  }
  fd.fd = opened;
  for (int tries = 1;; tries++) {
    err = lockTry(fd.fd, shared);
    *acquired = err == 0;
    if (err == EWOULDBLOCK) return fd.release();  // the wait checks the file once granted
    if (err != 0) throwErrno(err, "flock", path);
    const char* syscall = "";
    err = lockFollowPath(path, &fd.fd, &syscall);
    if (err == 0) return fd.release();
    if (err == EDEADLK) throwReentrant(path);
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
  bool create = true;
  {
    std::lock_guard<std::mutex> lock(claimsMu);
    auto it = claims().find(*fd);
    if (it != claims().end()) create = it->second.create;
  }
  int err = 0;
  int fresh = lockOpenFile(path, create, &err);
  if (fresh < 0) {
    *syscall = "open";
    return err;
  }
  struct stat st;
  if (fstat(fresh, &st) != 0) {
    err = errno;
    ::close(fresh);
    *syscall = "fstat";
    return err;
  }
  {
    // The new file takes the old one's registration, checked again: it may be one this process holds.
    std::lock_guard<std::mutex> lock(claimsMu);
    auto it = claims().find(*fd);
    if (it != claims().end()) {
      Claim c = it->second;
      c.dev = st.st_dev;
      c.ino = st.st_ino;
      if (claimLocked(fresh, c, *fd) != 0) {
        ::close(fresh);
        *syscall = "flock";
        return EDEADLK;
      }
      claims().erase(*fd);
    }
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

#include "lock.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "error.h"
#include "fd.h"
#include "io.h"
#include "names.h"
#include "process.h"
#include "rename.h"

namespace vmspace {

namespace {
// lockOpen's retries when the file it got the lock on was replaced in between: each one needs another deletion
// or rename at `path` between our open and our check, so only a process replacing the file in a loop reaches it.
constexpr int kMaxReplacedTries = 64;
}  // namespace

int lockOpenFile(const std::string& path, int* err) {
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, 0600);
  if (fd < 0 && (errno == EACCES || errno == EISDIR || errno == EROFS)) {
    int first = errno;
    fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);  // flock needs no write access
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
  // A link count of 0: deleted (the name is gone or names a new file). The path is followed like the open that
  // made *fd (a symlinked lock file locks its target).
  if (own.st_nlink > 0) {
    if (stat(path.c_str(), &at) == 0) {
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

int lockTry(int fd, bool shared) {
  return flock(fd, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB) == 0 ? 0 : errno;
}

int lockWaitBlocking(int fd, bool shared) {
  return flock(fd, shared ? LOCK_SH : LOCK_EX) == 0 ? 0 : errno;
}

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

bool readWholeFile(const std::string& path, std::string* out) {
  const char* syscall;
  int err = readRegularFileAt(AT_FDCWD, path.c_str(), 0, out->max_size() / 2, out, &syscall);
  if (err == ENOENT && syscall == std::string("open")) return false;
  if (err) throwErrno(err, syscall, path);
  return true;
}

namespace {
constexpr size_t kTempHexBytes = 6;  // replaceFile's temp names end in 12 hex characters

// True when `name` is one of replaceFile's temp names for `leaf`: "." + leaf + ".tmp-" + 12 lowercase hex. The
// fixed-length suffix keeps another index's temps out: ".a.tmp-<12 hex>" is a temp of "a" only, never of "a.tmp-…".
bool isIndexTemp(const char* name, const std::string& leaf) {
  size_t n = strlen(name);
  size_t hex = kTempHexBytes * 2;
  if (n != 1 + leaf.size() + 5 + hex || name[0] != '.' || leaf.compare(0, leaf.size(), name + 1, leaf.size()) != 0 ||
      memcmp(name + 1 + leaf.size(), ".tmp-", 5) != 0)
    return false;
  for (const char* c = name + n - hex; *c; c++)
    if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f'))) return false;
  return true;
}
}  // namespace

int removeIndexTemps(int dirFd, const std::string& dirPath, const std::string& leaf) {
  // A fresh open file description: readdir offsets are per description.
  int fd = openat(dirFd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) throwErrno(errno, "open", dirPath);
  DIR* dir = fdopendir(fd);
  if (!dir) {
    int err = errno;
    ::close(fd);
    throwErrno(err, "opendir", dirPath);
  }
  std::unique_ptr<DIR, int (*)(DIR*)> closer(dir, closedir);
  int removed = 0;
  for (;;) {
    errno = 0;
    struct dirent* de = readdir(dir);
    if (!de) {
      if (errno) throwErrno(errno, "readdir", dirPath);
      return removed;
    }
    if (!isIndexTemp(de->d_name, leaf)) continue;
    unsigned char type = de->d_type;
    if (type == DT_UNKNOWN) {
      struct stat st;
      if (fstatat(dirFd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) continue;
        throwErrno(errno, "stat", dirPath + "/" + de->d_name);
      }
      type = S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
    }
    if (type != DT_REG) continue;  // replaceFile makes regular files only: anything else is someone else's
    // ENOENT: removed meanwhile by a holder of a lock file that was deleted under us (see lockFollowPath).
    if (unlinkat(dirFd, de->d_name, 0) != 0) {
      if (errno == ENOENT) continue;
      throwErrno(errno, "unlink", dirPath + "/" + de->d_name);
    }
    removed++;
  }
}

void replaceFile(const std::string& path, const std::string& data, bool durable) {
  std::string dir, leaf;
  splitPath(path, &dir, &leaf);
  UniqueFd dirFd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY));
  if (!dirFd) throwErrno(errno, "open", dir);
  removeIndexTemps(dirFd.get(), dir, leaf);
  std::string tmp = "." + leaf + ".tmp-" + randomHex(kTempHexBytes);
  // Private (0600) until complete; then the mode and owner of the file it replaces, or 0666 less the umask.
  UniqueFd fd(openat(dirFd.get(), tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600));
  if (!fd) throwErrno(errno, "open", dir + "/" + tmp);
  try {
    if (int err = writeAll(fd.get(), data)) throwErrno(err, "write", dir + "/" + tmp);
    // The data reaches the disk before the name points at it: after a crash the index is old or new, never
    // empty (the failure mode of rename without fsync on delayed-allocation file systems).
    if (fsync(fd.get()) != 0) throwErrno(errno, "fsync", dir + "/" + tmp);
    struct stat st;
    if (fstatat(dirFd.get(), leaf.c_str(), &st, 0) == 0) {
      if (fchown(fd.get(), st.st_uid, st.st_gid) != 0 && errno != EPERM) throwErrno(errno, "chown", dir + "/" + tmp);
      if (fchmod(fd.get(), st.st_mode & 07777) != 0) throwErrno(errno, "chmod", dir + "/" + tmp);
    } else if (fchmod(fd.get(), 0666 & ~currentUmask()) != 0) {
      throwErrno(errno, "chmod", dir + "/" + tmp);
    }
    fd.reset();
    if (renameat(dirFd.get(), tmp.c_str(), dirFd.get(), leaf.c_str()) != 0) throwErrno(errno, "rename", dir + "/" + tmp, path);
  } catch (...) {
    unlinkat(dirFd.get(), tmp.c_str(), 0);
    throw;
  }
  if (durable && fsync(dirFd.get()) != 0) throwErrno(errno, "fsync", dir);
}

}  // namespace vmspace

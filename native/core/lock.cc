#include "lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "error.h"
#include "fd.h"
#include "io.h"
#include "names.h"
#include "process.h"
#include "rename.h"

namespace vmspace {

int lockOpen(const std::string& path, bool shared, bool* acquired) {
  UniqueFd fd(open(path.c_str(), O_RDWR | O_CREAT | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, 0600));
  if (!fd && (errno == EACCES || errno == EISDIR || errno == EROFS)) {
    int first = errno;
    fd.reset(open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));  // flock needs no write access
    if (!fd) throwErrno(errno == ENOENT ? first : errno, "open", path);  // missing and not creatable: the first
  }
  if (!fd) throwErrno(errno, "open", path);
  int err = lockTry(fd.get(), shared);
  *acquired = err == 0;
  if (err != 0 && err != EWOULDBLOCK) throwErrno(err, "flock", path);
  return fd.release();
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
    // A real-time signal no one else in the process handles: glibc keeps the first few for itself and
    // SIGRTMIN already starts after them; we take the first free one from SIGRTMIN + 4.
    for (int s = SIGRTMIN + 4; s <= SIGRTMAX; s++) {
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

void replaceFile(const std::string& path, const std::string& data, bool durable) {
  std::string dir, leaf;
  splitPath(path, &dir, &leaf);
  UniqueFd dirFd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY));
  if (!dirFd) throwErrno(errno, "open", dir);
  std::string tmp = "." + leaf + ".tmp-" + randomHex(6);
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

#include "lease.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include "compat.h"
#include "io.h"
#include "layout.h"
#include "metadata.h"
#include "names.h"

namespace vmspace {

namespace {}  // namespace

// AT_EMPTY_PATH where the caller may (CAP_DAC_READ_SEARCH, else ENOENT), else through /proc/self/fd (linkat(2)).
int linkLeaseFile(int fd, int dirFd, const std::string& name) {
  if (linkat(fd, "", dirFd, name.c_str(), AT_EMPTY_PATH) == 0) return 0;
  if (errno != ENOENT) return errno;
  char proc[40];
  (void)snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
  return linkat(AT_FDCWD, proc, dirFd, name.c_str(), AT_SYMLINK_FOLLOW) == 0 ? 0 : errno;
}

int holdLease(int fd, LeaseByte byte) {
  struct flock fl = {};
  fl.l_type = F_RDLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = static_cast<off_t>(byte);
  fl.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : errno;
}

int leaseHeldByOther(int fd) {
  // A write lock over the whole file conflicts with any lock another description (or a process's POSIX lock)
  // holds on any byte of it, and with none of this description's own.
  struct flock fl = {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = 0;
  fl.l_len = 0;
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -errno;
  return fl.l_type == F_UNLCK ? 0 : 1;
}

namespace {

// makeLeaseFile with the file made unnamed (O_TMPFILE, then linkat) or, with `named`, at a hidden temp name in the
// same directory (then renameat2). -1 with errno and *step when it fails.
int makeLeaseFileAs(bool named, int dirFd, const std::string& name, const std::string& record, long long gid,
                    const char** step) {
  const bool root = geteuid() == 0;
  // Root's lease files belong to kLeaseUid and have no write bit; another user's keep the owner's write bit,
  // which the record's xattr needs (setxattr(2) checks write permission), and a holder of that same uid could
  // chmod the file anyway.
  const mode_t mode = root ? (gid >= 0 ? 0440 : 0400) : (gid >= 0 ? 0640 : 0600);
  size_t slash = name.rfind('/');
  std::string dir = slash == std::string::npos ? "." : name.substr(0, slash), tmp;
  UniqueFd fd;
  *step = "open";
  if (!named) {
    fd.reset(openat(dirFd, dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
  } else {
    tmp = (slash == std::string::npos ? "" : dir + "/") + layout::kTmpPrefix + randomHex(8) + "-" +
          name.substr(slash + 1);
    fd.reset(openat(dirFd, tmp.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY, 0600));
  }
  if (!fd) return -1;
  int err = holdLease(fd.get(), LeaseByte::Owner);
  if (err) *step = "fcntl(F_OFD_SETLK)";
  // EINVAL: kLeaseUid is not mapped in this user namespace; the file then stays root's.
  if (err == 0 && root && fchown(fd.get(), kLeaseUid, static_cast<gid_t>(-1)) != 0 && errno != EINVAL) {
    err = errno;
    *step = "fchown";
  }
  if (err == 0 && fchmod(fd.get(), mode) != 0) {  // exact, whatever the umask
    err = errno;
    *step = "fchmod";
  }
  if (err == 0 && !record.empty() && (err = writeRecord(fd.get(), record)) != 0) *step = "fsetxattr";
  if (err == 0 && !named && (err = linkLeaseFile(fd.get(), dirFd, name)) != 0) *step = "linkat";
  if (err == 0 && named && renameat2(dirFd, tmp.c_str(), dirFd, name.c_str(), RENAME_NOREPLACE) != 0) {
    err = errno;
    *step = "renameat2";
  }
  if (err != 0) {
    if (named) unlinkat(dirFd, tmp.c_str(), 0);
    errno = err;
    return -1;
  }
  return fd.release();
}

}  // namespace

int makeLeaseFile(int dirFd, const std::string& name, const std::string& record, long long gid, const char** step) {
  // Unnamed until it is locked and carries its record: a sweep never sees it free, a listing never without its
  // record. Where the file system has no O_TMPFILE (EOPNOTSUPP, EISDIR, EINVAL), or an unnamed file cannot be
  // linked (EPERM: no hard links; ENOENT: neither CAP_DAC_READ_SEARCH nor /proc), a hidden temp name that the
  // sweep removes once free and past its grace period.
  int fd = makeLeaseFileAs(false, dirFd, name, record, gid, step);
  if (fd >= 0 || errno == EEXIST) return fd;
  bool retry = (std::string(*step) == "open" && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) ||
               (std::string(*step) == "linkat" && (errno == EPERM || errno == ENOENT || errno == EOPNOTSUPP));
  return retry ? makeLeaseFileAs(true, dirFd, name, record, gid, step) : -1;
}

int openLeaseFile(int dirFd, const std::string& name) {
  return openat(dirFd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
}

bool takeFreeLease(int fd, const char** step) {
  *step = "flock";
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) return false;
  *step = "fcntl(F_OFD_GETLK)";
  int held = leaseHeldByOther(fd);
  if (held == 0) return true;
  flock(fd, LOCK_UN);
  errno = held > 0 ? EWOULDBLOCK : -held;
  return false;
}

}  // namespace vmspace

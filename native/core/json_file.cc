#include "json_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "error.h"
#include "fd.h"
#include "io.h"
#include "names.h"
#include "process.h"
#include "rename.h"

namespace vmspace {

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
  int fd = openat(dirFd, ".", kDirPathFlags);
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
  UniqueFd dirFd(open(dir.c_str(), kDirPathFlags));
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

#include "json_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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
  int removed = 0;
  // forEachName reads a fresh open file description: readdir offsets are per description.
  forEachName(dirFd, dirPath, [&](const struct dirent& de) {
    if (!isIndexTemp(de.d_name, leaf)) return;
    unsigned char type = de.d_type;
    if (type == DT_UNKNOWN) {
      struct stat st;
      if (fstatat(dirFd, de.d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) return;
        throwErrno(errno, "stat", dirPath + "/" + de.d_name);
      }
      type = S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
    }
    if (type != DT_REG) return;  // replaceFile makes regular files only: anything else is someone else's
    // ENOENT: removed meanwhile by a holder of a lock file that was deleted under us (see lockFollowPath).
    if (unlinkat(dirFd, de.d_name, 0) != 0) {
      if (errno == ENOENT) return;
      throwErrno(errno, "unlink", dirPath + "/" + de.d_name);
    }
    removed++;
  });
  return removed;
}

void replaceFile(const std::string& path, const std::string& data, bool durable) {
  std::string dir, leaf;
  splitPath(path, &dir, &leaf);
  UniqueFd dirFd(open(dir.c_str(), kDirPathFlags));
  if (!dirFd) throwErrno(errno, "open", dir);
  removeIndexTemps(dirFd.get(), dir, leaf);
  std::string tmp = "." + leaf + ".tmp-" + randomHex(kTempHexBytes);
  // Private (0600) until complete; then the mode and owner of the file it replaces, or 0666 less the umask.
  TempFile fd(dirFd.get(), tmp, 0600, dir + "/" + tmp);
  if (int err = writeAll(fd.fd(), data)) throwErrno(err, "write", dir + "/" + tmp);
  // The data reaches the disk before the name points at it: after a crash the index is old or new, never
  // empty (the failure mode of rename without fsync on delayed-allocation file systems).
  if (fsync(fd.fd()) != 0) throwErrno(errno, "fsync", dir + "/" + tmp);
  struct stat st;
  if (fstatat(dirFd.get(), leaf.c_str(), &st, 0) == 0) {
    if (fchown(fd.fd(), st.st_uid, st.st_gid) != 0 && errno != EPERM) throwErrno(errno, "chown", dir + "/" + tmp);
    if (fchmod(fd.fd(), st.st_mode & 07777) != 0) throwErrno(errno, "chmod", dir + "/" + tmp);
  } else if (fchmod(fd.fd(), 0666 & ~currentUmask()) != 0) {
    throwErrno(errno, "chmod", dir + "/" + tmp);
  }
  fd.close();
  if (renameat(dirFd.get(), tmp.c_str(), dirFd.get(), leaf.c_str()) != 0)
    throwErrno(errno, "rename", dir + "/" + tmp, path);
  fd.published();
  if (durable && fsync(dirFd.get()) != 0) throwErrno(errno, "fsync", dir);
}

}  // namespace vmspace

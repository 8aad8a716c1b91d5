#include "rename.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "error.h"

namespace vmspace {

void renameNoReplace(const std::string& from, const std::string& to) {
  if (renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return;
  int err = errno;
  struct stat st;
  // EINVAL is also renameat2's answer to moving a directory beneath itself, so only a non-directory is moved the
  // other way: link(2) never replaces (EEXIST), then the old name goes. A directory keeps renameat2's errno.
  if (!noReplaceUnsupported(err) || fstatat(AT_FDCWD, from.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 ||
      S_ISDIR(st.st_mode))
    throwErrno(err, "renameat2", from, to);
  if (linkat(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), 0) != 0) throwErrno(errno, "link", from, to);
  if (unlinkat(AT_FDCWD, from.c_str(), 0) != 0) {
    err = errno;
    unlinkat(AT_FDCWD, to.c_str(), 0);  // the link made just now: `from` stays where it was
    throwErrno(err, "unlink", from, to);
  }
}

int publishFileNoReplace(int fromDir, const char* from, int toDir, const char* to, const char** syscall) {
  *syscall = "renameat2";
  if (renameat2(fromDir, from, toDir, to, RENAME_NOREPLACE) == 0) return 0;
  int err = errno;
  if (!noReplaceUnsupported(err)) return err;
  // link(2) never replaces (EEXIST), and the name appears with the complete file, as a rename would publish it.
  *syscall = "link";
  if (linkat(fromDir, from, toDir, to, 0) != 0) return errno;
  *syscall = "unlink";
  if (unlinkat(fromDir, from, 0) != 0) {
    err = errno;
    unlinkat(toDir, to, 0);  // ours: linked just now; the caller removes the temp name
    return err;
  }
  return 0;
}

void exchange(const std::string& a, const std::string& b) {
  if (renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) != 0) throwErrno(errno, "renameat2", a, b);
}

void splitPath(const std::string& path, std::string* parent, std::string* leaf) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) {
    *parent = ".";
    *leaf = path;
    return;
  }
  *parent = slash == 0 ? "/" : path.substr(0, slash);
  *leaf = path.substr(slash + 1);
}

}  // namespace vmspace

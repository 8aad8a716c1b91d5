#include "rename.h"

#include <fcntl.h>
#include <stdio.h>

#include <cerrno>

#include "error.h"

namespace vmspace {

void renameNoReplace(const std::string& from, const std::string& to) {
  if (renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) != 0)
    throwErrno(errno, "renameat2", from, to);
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

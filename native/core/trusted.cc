// Trusted directory opening (trusted.h): the walk from "/" to a pool root and the opening of each directory of a
// pool, every one checked by fstat of the fd that is then used.
#include "trusted.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <utility>
#include <vector>

#include "error.h"
#include "io.h"
#include "layout.h"

namespace vmspace {
namespace {

// Why `st` (of an fd opened O_NOFOLLOW, never of a path) is not safe, or nullptr. `ancestor`: a directory above
// the pool root, where a sticky directory writable by all (/tmp) is fine: others cannot rename or remove what
// they do not own in it (and what the walk enters next is checked in turn).
const char* untrustedReason(const struct stat& st, const Trust& t, bool ancestor) {
  bool shared = t.sharedGid >= 0 && static_cast<long long>(st.st_gid) == t.sharedGid;
  bool sticky = ancestor && (st.st_mode & S_ISVTX);
  if (st.st_uid != t.euid && st.st_uid != 0 && !shared)
    return S_ISLNK(st.st_mode) ? "a symlink owned by another user" : "owned by another user";
  if (S_ISLNK(st.st_mode)) return nullptr;  // a symlink's own mode means nothing
  if ((st.st_mode & S_IWOTH) && !sticky) return "writable by others";
  if ((st.st_mode & S_IWGRP) && !sticky && !shared) return "writable by its group";
  return nullptr;
}

// Pushes the components of `p` onto `todo` so that the first is on top ("." and empty ones dropped).
void pushComponents(std::vector<std::string>* todo, const std::string& p) {
  for (size_t end = p.size(); end > 0;) {
    size_t start = p.rfind('/', end - 1);
    start = start == std::string::npos ? 0 : start + 1;
    if (end > start && p.compare(start, end - start, ".") != 0) todo->push_back(p.substr(start, end - start));
    end = start == 0 ? 0 : start - 1;
  }
}

// The target of the symlink opened O_PATH|O_NOFOLLOW as `fd`; an empty or PATH_MAX-long one is an error.
std::string readLinkTarget(int fd, const std::string& shown) {
  char target[PATH_MAX];
  ssize_t n = readlinkat(fd, "", target, sizeof target);
  if (n < 0) throwErrno(errno, "readlink", shown);
  if (n == 0 || static_cast<size_t>(n) == sizeof target) throwErrno(n == 0 ? ENOENT : ENAMETOOLONG, "readlink", shown);
  return std::string(target, static_cast<size_t>(n));
}

// The absolute path shown for the parent of the absolute `shown` ("/" for "/" and "/x").
std::string parentOf(const std::string& shown) {
  size_t slash = shown.rfind('/');
  return slash == 0 || slash == std::string::npos ? "/" : shown.substr(0, slash);
}

constexpr int kMaxSymlinks = 40;  // as the kernel's path walk (MAXSYMLINKS)

// Owned as openPool makes a pool's entries: by root or this process's euid.
bool ownedByPoolOwner(const struct stat& st) { return st.st_uid == 0 || st.st_uid == geteuid(); }

// The path of the open `fd` as the kernel names it (/proc/self/fd), or `fallback` without /proc.
std::string pathOfFd(int fd, const std::string& fallback) {
  char buf[PATH_MAX];
  std::string link = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = readlink(link.c_str(), buf, sizeof buf);
  return n > 0 && static_cast<size_t>(n) < sizeof buf ? std::string(buf, static_cast<size_t>(n)) : fallback;
}

}  // namespace

bool isPoolRoot(int dirFd) {
  UniqueFd state(openat(dirFd, layout::kStateDir, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st;
  if (!state || fstat(state.get(), &st) != 0 || !ownedByPoolOwner(st)) return false;
  if (fstatat(state.get(), layout::kVersion, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
      !ownedByPoolOwner(st))
    return false;
  UniqueFd file(openRegularAtNoFollow(state.get(), layout::kVersion, O_RDONLY, st.st_dev, st.st_ino));
  char buf[64];
  ssize_t n = file ? pread(file.get(), buf, sizeof buf, 0) : -1;
  if (n <= 0) return false;
  std::string text(buf, static_cast<size_t>(n));
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text == layout::kVersionText;
}

void refuseNestedPool(int dirFd, const std::string& root) {
  UniqueFd cur(openat(dirFd, ".", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!cur) throwErrno(errno, "open", root);
  for (int up = 0; up < 4096; ++up) {
    if (isPoolRoot(cur.get()))
      throwCode("ERR_POOL_NESTED",
                "'" + root + "' is inside the pool at '" + pathOfFd(cur.get(), root) +
                    "' (its workspace, .vmspace/ or trash): a dispose or sweep there would remove it; a pool is " +
                    "never made inside another",
                EBUSY, "open", root);
    UniqueFd parent(openat(cur.get(), "..", O_PATH | O_DIRECTORY | O_CLOEXEC));
    struct stat a, b;
    if (!parent || fstat(cur.get(), &a) != 0 || fstat(parent.get(), &b) != 0) throwErrno(errno, "open", root);
    if (a.st_dev == b.st_dev && a.st_ino == b.st_ino) return;  // "/": its ".." is itself
    cur = std::move(parent);
  }
  throwErrno(ELOOP, "open", root);
}

void checkTrusted(int fd, const std::string& shown, const Trust& t, bool ancestor) {
  struct stat st;
  if (fstat(fd, &st) != 0) throwErrno(errno, "fstat", shown);
  const char* reason = untrustedReason(st, t, ancestor);
  if (!reason) return;
  char mode[8];
  (void)snprintf(mode, sizeof mode, "0%o", static_cast<unsigned>(st.st_mode & 07777));  // at most 5 characters
  std::string detail = "'" + shown + "' is " + reason + " (uid " + std::to_string(st.st_uid) + ", gid " +
                       std::to_string(st.st_gid) + ", mode " + mode + "); a pool and the directories above it " +
                       "must be writable only by this process's user (uid " + std::to_string(t.euid) + ") or root";
  if (t.sharedGid >= 0) detail += ", or group " + std::to_string(t.sharedGid);
  Error e;
  e.code = "ERR_POOL_UNSAFE";
  e.syscall = "open";
  e.path = shown;
  e.detail = std::move(detail);
  e.uid = st.st_uid;
  e.gid = st.st_gid;
  e.mode = static_cast<int>(st.st_mode & 07777);
  throw e;
}

// Makes directory `name` below `at` with exactly `mode` (and group `gid` when >= 0), whatever the umask: made
// 0700, so it is never more open than meant, then fchown and fchmod on the fd (chown first: it clears setgid).
// False when it existed already.
bool makeDirExact(int at, const char* name, mode_t mode, long long gid, const std::string& shown) {
  if (mkdirat(at, name, 0700) != 0) {
    if (errno == EEXIST) return false;
    throwErrno(errno, "mkdir", shown);
  }
  UniqueFd fd(openat(at, name, kDirFlags));
  if (!fd) throwErrno(errno, "open", shown);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) throwErrno(errno, "fstat", shown);
  // A setgid bit the kernel gave it (inherited from a setgid parent, mkdir(2)) is kept: entries keep that group.
  if (gid < 0)
    mode |= st.st_mode & S_ISGID;
  else if (fchown(fd.get(), static_cast<uid_t>(-1), static_cast<gid_t>(gid)) != 0)
    throwErrno(errno, "fchown", shown);
  if (fchmod(fd.get(), mode) != 0) throwErrno(errno, "fchmod", shown);
  return true;
}

// Opens directory `name` of the pool below `at` (never following a symlink), made with `mode` when missing and
// `create`, and checks it. An empty fd when it is missing and not made.
UniqueFd openPoolDir(int at, const char* name, const std::string& shown, bool create, mode_t mode, const Trust& t) {
  for (;;) {
    UniqueFd fd(openat(at, name, kDirFlags));
    if (fd) {
      checkTrusted(fd.get(), shown, t, false);
      return fd;
    }
    if (errno != ENOENT) throwErrno(errno, "open", shown);
    if (!create) return fd;
    makeDirExact(at, name, mode, t.sharedGid, shown);  // EEXIST: made meanwhile by another process, open it
  }
}

// Opens the directory at the absolute `path` component by component from "/", each with O_PATH|O_NOFOLLOW and
// checked by fstat of that fd (what is checked is what the next step uses: no path is looked up twice). A
// symlink is followed by hand after its owner is checked; `..` steps to the parent, checked again. With
// `create`, missing directories are made, 0755 (the last one `rootMode`), after the directory holding them
// passed. Returns an O_RDONLY fd of the pool root, itself checked as a pool directory (no sticky exception).
UniqueFd openTrustedPath(const std::string& path, bool create, mode_t rootMode, const Trust& t) {
  std::vector<std::string> todo;  // components still to walk, the next one last
  pushComponents(&todo, path);
  auto openRoot = [&] {
    UniqueFd fd(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!fd) throwErrno(errno, "open", "/");
    checkTrusted(fd.get(), "/", t, !todo.empty());
    return fd;
  };
  UniqueFd cur = openRoot();
  std::string shown = "/";
  auto join = [](const std::string& dir, const std::string& name) {
    return dir == "/" ? "/" + name : dir + "/" + name;
  };
  int links = 0;
  bool nestingChecked = false;
  // Components at or above this depth of `todo` come from a symlink's target, which must exist as mkdir -p
  // requires (mkdir(2) of a dangling symlink is EEXIST): only components of the path as given are made.
  size_t targetFloor = SIZE_MAX;
  while (!todo.empty()) {
    std::string name = std::move(todo.back());
    todo.pop_back();
    const bool fromTarget = todo.size() >= targetFloor;
    if (!fromTarget) targetFloor = SIZE_MAX;
    std::string next = name == ".." ? parentOf(shown) : join(shown, name);
    UniqueFd fd(openat(cur.get(), name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) {
      // As open(2) of the whole path names it; a symlink's missing target is ENOENT, never made.
      if (errno != ENOENT || !create || fromTarget) throwErrno(errno, "open", path);
      // Checked before anything is made: what is made below `cur` is inside whatever `cur` is inside.
      if (!nestingChecked) refuseNestedPool(cur.get(), path);
      nestingChecked = true;
      makeDirExact(cur.get(), name.c_str(), todo.empty() ? rootMode : 0755, todo.empty() ? t.sharedGid : -1, next);
      todo.push_back(name);  // made or made meanwhile: open and check it as any other
      continue;
    }
    struct stat st;
    if (fstat(fd.get(), &st) != 0) throwErrno(errno, "fstat", next);
    if (S_ISLNK(st.st_mode)) {
      checkTrusted(fd.get(), next, t, true);
      if (++links > kMaxSymlinks) throwErrno(ELOOP, "open", next);
      std::string to = readLinkTarget(fd.get(), next);
      targetFloor = std::min(targetFloor, todo.size());
      pushComponents(&todo, to);
      if (to[0] == '/') {
        cur = openRoot();
        shown = "/";
      }
      continue;
    }
    if (!S_ISDIR(st.st_mode)) throwErrno(ENOTDIR, "open", next);
    checkTrusted(fd.get(), next, t, !todo.empty());
    cur = std::move(fd);
    shown = std::move(next);
  }
  // "." of an O_PATH fd is that same directory: no path lookup that could be raced.
  UniqueFd dir(openat(cur.get(), ".", kDirFlags));
  if (!dir) throwErrno(errno, "open", shown);
  if (!nestingChecked) {
    UniqueFd parent(openat(cur.get(), "..", O_PATH | O_DIRECTORY | O_CLOEXEC));
    struct stat self, above;
    if (!parent || fstat(cur.get(), &self) != 0 || fstat(parent.get(), &above) != 0) throwErrno(errno, "open", shown);
    if (self.st_dev != above.st_dev || self.st_ino != above.st_ino) refuseNestedPool(parent.get(), path);
  }
  return dir;
}

}  // namespace vmspace

// A template's mode list: the write bits a commit removes from its tree (stripWriteBits, which also measures the
// tree) and gives back to each clone of it (TemplateStore::restoreModes), and the walks that do both.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "error.h"
#include "fd.h"
#include "io.h"
#include "layout.h"
#include "template.h"
#include "template_modes.h"
#include "walk.h"

namespace vmspace {

ModesFile openModesFile(int dirFd, int flags, const char* mode, const std::string& shown) {
  int fd = openat(dirFd, layout::kModes, flags | O_CLOEXEC | O_NOCTTY, 0600);
  if (fd < 0) throwErrno(errno, "open", shown);
  FILE* f = fdopen(fd, mode);
  if (!f) {
    int err = errno;
    ::close(fd);
    throwErrno(err, "fdopen", shown);
  }
  return ModesFile(f, fclose);
}

namespace {

// Pushes the private tree `rootFd` as the root of `walk`, through a description of our own (the caller's fd's
// readdir offset is not ours to move); returns its stat.
struct stat pushRoot(TreeWalk& walk, int rootFd, const std::string& shown) {
  struct stat rootSt;
  if (fstat(rootFd, &rootSt) != 0) throwErrno(errno, "fstat", shown);
  int fd = openat(rootFd, ".", kDirFlags);
  if (fd < 0) throwErrno(errno, "open", shown);
  if (int err = walk.push(fd, "", rootSt.st_dev, rootSt.st_ino)) throwErrno(err, "fdopendir", shown);
  return rootSt;
}

// The next entry of the walk's top directory; null when it is done, after it was left (popped).
struct dirent* nextOrLeave(TreeWalk& walk) {
  struct dirent* de;
  if (int err = walk.next(&de)) throwErrno(err, "readdir", walk.path(walk.depth()));
  if (de) return de;
  TreeWalk::Left done;
  const char* syscall = "openat";
  if (int err = walk.pop(&done, &syscall)) throwErrno(err, syscall, walk.path(walk.depth(), done.name.c_str()));
  return nullptr;
}

// Enters the subdirectory `name` (stat `st`) of the walk's top directory.
void enter(TreeWalk& walk, const char* name, const struct stat& st) {
  int down = walk.openDir(walk.topFd(), name);
  if (down < 0) throwErrno(errno, "open", walk.path(walk.depth(), name));
  if (int err = walk.push(down, name, st.st_dev, st.st_ino))
    throwErrno(err, "fdopendir", walk.path(walk.depth(), name));
}

}  // namespace

// The mode list (`modes` in a template): the write bits a commit removed, as a walk of the tree replays them.
// Records, each ending in NUL: "m<3 octal digits><name>" (an entry of the current directory had those write
// bits), "d<name>" (into that subdirectory), "u" (back to the parent), "r<3 octal digits>" (the root's own).
// Relative to the walk, never full paths: the list grows with the entries, not with depth times entries.

void stripWriteBits(int rootFd, const std::string& shown, FILE* manifest, uint64_t* allocated, bool strip) {
  std::set<std::pair<dev_t, ino_t>> linked;  // inodes with several links already counted
  auto put = [&](char kind, mode_t bits, const std::string& name) {
    bool ok = kind == 'm' || kind == 'r' ? fprintf(manifest, "%c%03o", kind, static_cast<unsigned>(bits)) == 4
                                         : fputc(kind, manifest) != EOF;
    if (!ok || fwrite(name.c_str(), 1, name.size() + 1, manifest) != name.size() + 1)
      throwErrno(errno ? errno : EIO, "write", shown);
  };
  TreeWalk walk(shown, TreeWalk::Resume::AtPosition);
  const struct stat rootSt = pushRoot(walk, rootFd, shown);
  *allocated += static_cast<uint64_t>(rootSt.st_blocks) * 512;
  while (!walk.empty()) {
    struct dirent* de = nextOrLeave(walk);
    if (!de) {
      if (strip && !walk.empty()) put('u', 0, "");
      continue;
    }
    const std::string name = de->d_name;
    const int cur = walk.topFd();
    struct stat st;
    if (fstatat(cur, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
      throwErrno(errno, "stat", walk.path(walk.depth(), name.c_str()));
    if (!S_ISDIR(st.st_mode) && st.st_nlink > 1 && !linked.insert({st.st_dev, st.st_ino}).second) continue;
    *allocated += static_cast<uint64_t>(st.st_blocks) * 512;
    if (S_ISLNK(st.st_mode)) continue;
    if (strip && (st.st_mode & 0222)) {
      put('m', st.st_mode & 0222, name);
      if (fchmodat(cur, name.c_str(), st.st_mode & 07777 & ~0222, 0) != 0)
        throwErrno(errno, "chmod", walk.path(walk.depth(), name.c_str()));
    }
    if (!S_ISDIR(st.st_mode)) continue;
    enter(walk, name.c_str(), st);
    if (strip) put('d', 0, name);
  }
  if (strip && (rootSt.st_mode & 0222)) {
    put('r', rootSt.st_mode & 0222, "");
    if (fchmod(rootFd, rootSt.st_mode & 07777 & ~0222) != 0) throwErrno(errno, "fchmod", shown);
  }
}

namespace {

// What dropGuestPrivileges does to the entry `name` (stat `st`) of the directory `dirFd`.
void dropEntryPrivileges(int dirFd, const char* name, const struct stat& st, bool devices, bool setId,
                         uint64_t* skippedDevices, const TreeWalk& walk) {
  if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) {
    if (devices) return;
    if (unlinkat(dirFd, name, 0) != 0) throwErrno(errno, "unlinkat", walk.path(walk.depth(), name));
    ++*skippedDevices;
    return;
  }
  if (setId || S_ISLNK(st.st_mode)) return;
  if ((st.st_mode & (S_ISUID | S_ISGID)) && fchmodat(dirFd, name, st.st_mode & 07777 & ~(S_ISUID | S_ISGID), 0) != 0)
    throwErrno(errno, "chmod", walk.path(walk.depth(), name));
  if (!S_ISREG(st.st_mode)) return;
  // No *at form of the xattr calls: the directory's /proc/self/fd link, then the name, not followed. Asked first:
  // removing a security.* name takes CAP_SETFCAP even where there is none (EPERM for a user's commit).
  std::string at = "/proc/self/fd/" + std::to_string(dirFd) + "/" + name;
  if (lgetxattr(at.c_str(), "security.capability", nullptr, 0) < 0) {
    if (errno == ENODATA || errno == ENOTSUP) return;
    throwErrno(errno, "getxattr", walk.path(walk.depth(), name));
  }
  if (lremovexattr(at.c_str(), "security.capability") != 0 && errno != ENODATA)
    throwErrno(errno, "removexattr", walk.path(walk.depth(), name));
}

}  // namespace

void dropGuestPrivileges(int rootFd, const std::string& shown, bool devices, bool setId, uint64_t* skippedDevices) {
  TreeWalk walk(shown, TreeWalk::Resume::AtPosition);
  pushRoot(walk, rootFd, shown);
  while (!walk.empty()) {
    struct dirent* de = nextOrLeave(walk);
    if (!de) continue;
    // Symlinks, fifos and sockets carry nothing to drop (their set-id bits mean nothing): no stat for them.
    if (de->d_type == DT_LNK || de->d_type == DT_FIFO || de->d_type == DT_SOCK) continue;
    const char* name = de->d_name;
    const int cur = walk.topFd();
    struct stat st;
    if (fstatat(cur, name, &st, AT_SYMLINK_NOFOLLOW) != 0) throwErrno(errno, "stat", walk.path(walk.depth(), name));
    if (S_ISDIR(st.st_mode))
      enter(walk, name, st);
    else
      dropEntryPrivileges(cur, name, st, devices, setId, skippedDevices, walk);
  }
}

namespace {

// The walk of a template's mode list over a clone of its tree (the records stripWriteBits wrote): down by name,
// up through the climb of walk.h (checked against the way down). No readdir: the list says where to go.
class ModeListWalk {
 public:
  ModeListWalk(int wsFd, const std::string& wsPath) : walk_(wsPath, TreeWalk::Resume::AtPosition) {
    int fd = fcntl(wsFd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) throwErrno(errno, "fcntl", wsPath);
    struct stat st;
    if (fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      throwErrno(err, "fstat", wsPath);
    }
    if (int err = walk_.push(fd, "", st.st_dev, st.st_ino)) throwErrno(err, "fdopendir", wsPath);
  }

  // 'u': back to the parent; false at the top (a list that does not parse).
  bool up() {
    if (walk_.depth() == 0) return false;
    TreeWalk::Left done;
    const char* syscall = "openat";
    if (int err = walk_.pop(&done, &syscall)) throwErrno(err, syscall, walk_.path(walk_.depth(), done.name.c_str()));
    return true;
  }

  // 'd': down into the directory `name`.
  void down(const char* name) {
    int fd = walk_.openDir(walk_.topFd(), name);
    if (fd < 0) throwErrno(errno, "open", walk_.path(walk_.depth(), name));
    struct stat st;
    if (fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      throwErrno(err, "fstat", walk_.path(walk_.depth(), name));
    }
    if (int err = walk_.push(fd, name, st.st_dev, st.st_ino))
      throwErrno(err, "fdopendir", walk_.path(walk_.depth(), name));
  }

  // 'm': the write bits `bits` given back to `leaf`.
  void restore(const char* leaf, mode_t bits) {
    struct stat st;
    if (fstatat(walk_.topFd(), leaf, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return;  // not recreated (a socket, a device without CAP_MKNOD)
      throwErrno(errno, "stat", walk_.path(walk_.depth(), leaf));
    }
    if (S_ISLNK(st.st_mode)) return;
    if (fchmodat(walk_.topFd(), leaf, (st.st_mode & 07777) | bits, 0) != 0)
      throwErrno(errno, "chmod", walk_.path(walk_.depth(), leaf));
  }

 private:
  TreeWalk walk_;
};

}  // namespace

void TemplateStore::restoreModes(const TemplateReader& reader, int wsFd, const std::string& wsPath) {
  const std::string shown = path(reader.id) + "/modes";
  ModesFile closer = openModesFile(reader.fd.get(), O_RDONLY | O_NOFOLLOW, "r", shown);
  FILE* f = closer.get();
  char* line = nullptr;
  size_t cap = 0;
  std::unique_ptr<char, void (*)(void*)> freeLine(nullptr, free);
  ModeListWalk walk(wsFd, wsPath);
  auto corrupt = [&] {
    throwCode("ERR_CORRUPT_METADATA", "a record of the template's mode list does not parse", EINVAL, "read", shown);
  };
  for (;;) {
    errno = 0;
    ssize_t n = getdelim(&line, &cap, '\0', f);
    (void)freeLine.release();  // getdelim may have moved the buffer (realloc): the old pointer is no longer ours
    freeLine.reset(line);
    if (n < 0) {
      if (errno) throwErrno(errno, "read", shown);
      break;
    }
    if (line[n - 1] != '\0') corrupt();
    char kind = line[0];
    if (kind == 'u') {
      if (!walk.up()) corrupt();
      continue;
    }
    if (kind == 'd') {
      walk.down(line + 1);
      continue;
    }
    if ((kind != 'm' && kind != 'r') || n < 5) corrupt();
    char digits[4] = {line[1], line[2], line[3], 0};
    char* end = nullptr;
    long bits = strtol(digits, &end, 8);
    if (end != digits + 3 || bits < 0 || (bits & ~0222)) corrupt();
    if (kind == 'r') continue;  // the workspace directory keeps the mode allocate gave it
    const char* leaf = line + 4;
    if (!*leaf) corrupt();
    walk.restore(leaf, static_cast<mode_t>(bits));
  }
  // The last-used time (TemplateListing.lastUsedMs): informative only, so a refusal (a pool shared by a group,
  // whose member does not own the file: EPERM) does not fail the allocate.
  if (utimensat(reader.fd.get(), layout::kUsed, nullptr, AT_SYMLINK_NOFOLLOW) != 0) {
    // deliberately ignored: see above
  }
}

}  // namespace vmspace

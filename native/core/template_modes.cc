// A template's mode list: the write bits a commit removes from its tree (stripWriteBits, which also measures the
// tree) and gives back to each clone of it (TemplateStore::restoreModes), and the walks that do both.
#include <fcntl.h>
#include <sys/stat.h>
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
#include "template.h"
#include "template_modes.h"

namespace vmspace {

ModesFile openModesFile(int dirFd, int flags, const char* mode, const std::string& shown) {
  int fd = openat(dirFd, "modes", flags | O_CLOEXEC | O_NOCTTY, 0600);
  if (fd < 0) throwErrno(errno, "open", shown);
  FILE* f = fdopen(fd, mode);
  if (!f) {
    int err = errno;
    ::close(fd);
    throwErrno(err, "fdopen", shown);
  }
  return ModesFile(f, fclose);
}

// The mode list (`modes` in a template): the write bits a commit removed, as a walk of the tree replays them.
// Records, each ending in NUL: "m<3 octal digits><name>" (an entry of the current directory had those write
// bits), "d<name>" (into that subdirectory), "u" (back to the parent), "r<3 octal digits>" (the root's own).
// Relative to the walk, never full paths: the list grows with the entries, not with depth times entries.

namespace {

// Moves `cur` to its parent, checked to be the directory `expect` (device and inode) that the walk came from.
void walkUp(UniqueFd& cur, const struct stat& expect, const std::string& shown) {
  UniqueFd up(openat(cur.get(), "..", kDirFlags));
  if (!up) throwErrno(errno, "open", shown);
  struct stat st;
  if (fstat(up.get(), &st) != 0) throwErrno(errno, "fstat", shown);
  if (st.st_dev != expect.st_dev || st.st_ino != expect.st_ino) throwErrno(ESTALE, "open", shown);
  cur = std::move(up);
}

}  // namespace

void stripWriteBits(int rootFd, const std::string& shown, FILE* manifest, uint64_t* allocated, bool strip) {
  std::set<std::pair<dev_t, ino_t>> linked;  // inodes with several links already counted
  auto put = [&](char kind, mode_t bits, const std::string& name) {
    bool ok = kind == 'm' || kind == 'r' ? fprintf(manifest, "%c%03o", kind, static_cast<unsigned>(bits)) == 4
                                         : fputc(kind, manifest) != EOF;
    if (!ok || fwrite(name.c_str(), 1, name.size() + 1, manifest) != name.size() + 1)
      throwErrno(errno ? errno : EIO, "write", shown);
  };
  struct Level {
    std::vector<std::pair<std::string, unsigned char>> names;
    size_t next = 0;
    struct stat st;
  };
  std::vector<Level> stack(1);
  std::string rel;  // of `cur` below the root, for errors only (grows with depth, not with entries)
  UniqueFd cur(fcntl(rootFd, F_DUPFD_CLOEXEC, 0));
  if (!cur) throwErrno(errno, "fcntl", shown);
  if (fstat(cur.get(), &stack[0].st) != 0) throwErrno(errno, "fstat", shown);
  const struct stat rootSt = stack[0].st;
  *allocated += static_cast<uint64_t>(rootSt.st_blocks) * 512;
  stack[0].names = readNames(cur.get(), shown);
  while (!stack.empty()) {
    Level& top = stack.back();
    if (top.next == top.names.size()) {
      stack.pop_back();
      if (stack.empty()) break;
      walkUp(cur, stack.back().st, shown + rel);
      rel.erase(rel.rfind('/'));
      if (strip) put('u', 0, "");
      continue;
    }
    const std::string name = top.names[top.next++].first;
    struct stat st;
    if (fstatat(cur.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
      throwErrno(errno, "stat", shown + rel + "/" + name);
    if (!S_ISDIR(st.st_mode) && st.st_nlink > 1 && !linked.insert({st.st_dev, st.st_ino}).second) continue;
    *allocated += static_cast<uint64_t>(st.st_blocks) * 512;
    if (S_ISLNK(st.st_mode)) continue;
    if (strip && (st.st_mode & 0222)) {
      put('m', st.st_mode & 0222, name);
      if (fchmodat(cur.get(), name.c_str(), st.st_mode & 07777 & ~0222, 0) != 0)
        throwErrno(errno, "chmod", shown + rel + "/" + name);
    }
    if (!S_ISDIR(st.st_mode)) continue;
    UniqueFd down(openat(cur.get(), name.c_str(), kDirFlags));
    if (!down) throwErrno(errno, "open", shown + rel + "/" + name);
    Level level;
    level.st = st;
    level.names = readNames(down.get(), shown + rel + "/" + name);
    cur = std::move(down);
    rel += "/" + name;
    if (strip) put('d', 0, name);
    stack.push_back(std::move(level));
  }
  if (strip && (rootSt.st_mode & 0222)) {
    put('r', rootSt.st_mode & 0222, "");
    if (fchmod(rootFd, rootSt.st_mode & 07777 & ~0222) != 0) throwErrno(errno, "fchmod", shown);
  }
}

namespace {

// The walk of a template's mode list over a clone of its tree (the records stripWriteBits wrote): one directory fd,
// down by name, up through ".." (checked against the way down).
class ModeListWalk {
 public:
  ModeListWalk(int wsFd, const std::string& wsPath) : wsPath_(wsPath), trail_(1) {
    cur_.reset(fcntl(wsFd, F_DUPFD_CLOEXEC, 0));
    if (!cur_) throwErrno(errno, "fcntl", wsPath);
    if (fstat(cur_.get(), &trail_[0]) != 0) throwErrno(errno, "fstat", wsPath);
  }

  // 'u': back to the parent; false at the top (a list that does not parse).
  bool up() {
    if (trail_.size() < 2) return false;
    trail_.pop_back();
    walkUp(cur_, trail_.back(), wsPath_ + rel_);
    rel_.erase(rel_.rfind('/'));
    return true;
  }

  // 'd': down into the directory `name`.
  void down(const char* name) {
    UniqueFd down(openat(cur_.get(), name, kDirFlags));
    if (!down) throwErrno(errno, "open", wsPath_ + rel_ + "/" + name);
    struct stat st;
    if (fstat(down.get(), &st) != 0) throwErrno(errno, "fstat", wsPath_ + rel_ + "/" + name);
    trail_.push_back(st);
    cur_ = std::move(down);
    rel_ += std::string("/") + name;
  }

  // 'm': the write bits `bits` given back to `leaf`.
  void restore(const char* leaf, mode_t bits) {
    struct stat st;
    if (fstatat(cur_.get(), leaf, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return;  // not recreated (a socket, a device without CAP_MKNOD)
      throwErrno(errno, "stat", wsPath_ + rel_ + "/" + leaf);
    }
    if (S_ISLNK(st.st_mode)) return;
    if (fchmodat(cur_.get(), leaf, (st.st_mode & 07777) | bits, 0) != 0)
      throwErrno(errno, "chmod", wsPath_ + rel_ + "/" + leaf);
  }

 private:
  const std::string& wsPath_;
  UniqueFd cur_;
  std::vector<struct stat> trail_;
  std::string rel_;  // of `cur_` below the workspace, for errors only (grows with depth, not with entries)
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
  if (utimensat(reader.fd.get(), "used", nullptr, AT_SYMLINK_NOFOLLOW) != 0) {
    // deliberately ignored: see above
  }
}

}  // namespace vmspace

#include "json_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

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

void readLockedFile(int fd, const std::string& path, std::string* out) {
  struct stat st;
  if (fstat(fd, &st) != 0) throwErrno(errno, "fstat", path);
  if (S_ISDIR(st.st_mode)) throwErrno(EISDIR, "read", path);
  if (!S_ISREG(st.st_mode)) throwErrno(EINVAL, "read", path);
  out->clear();
  char buf[65536];
  for (off_t off = 0;;) {
    ssize_t n = pread(fd, buf, sizeof buf, off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throwErrno(errno, "read", path);
    if (n == 0) return;  // end of file (st_size is only a hint: the file is read to its end)
    out->append(buf, static_cast<size_t>(n));
    off += n;
  }
}

namespace {
constexpr size_t kTempHexBytes = 6;     // replaceFile's temp names end in 12 hex characters
constexpr char kTempInfix[] = ".tmp-";  // replaceFile's temp of <leaf>: ".<leaf>.tmp-<12 hex>", beside it

bool sameInode(const struct stat& a, const struct stat& b) { return a.st_dev == b.st_dev && a.st_ino == b.st_ino; }

// Whether `leaf` in dirFd still names the inode `locked` (fstat'ed just now): not deleted, nor renamed over.
bool stillAt(int dirFd, const std::string& dir, const std::string& leaf, int lockedFd) {
  struct stat own, at;
  if (fstat(lockedFd, &own) != 0) throwErrno(errno, "fstat", dir + "/" + leaf);
  if (own.st_nlink == 0) return false;
  if (fstatat(dirFd, leaf.c_str(), &at, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return false;
    throwErrno(errno, "stat", dir + "/" + leaf);
  }
  return sameInode(own, at);
}

// True when `name` is one of replaceFile's temp names for `leaf`: "." + leaf + ".tmp-" + 12 lowercase hex. The
// fixed-length suffix keeps another index's temps out: ".a.tmp-<12 hex>" is a temp of "a" only, never of "a.tmp-…".
bool isIndexTemp(const char* name, const std::string& leaf) {
  const std::string_view n(name), infix(kTempInfix);
  const size_t hex = kTempHexBytes * 2;
  if (n.size() != 1 + leaf.size() + infix.size() + hex || n[0] != '.' || n.substr(1, leaf.size()) != leaf ||
      n.substr(1 + leaf.size(), infix.size()) != infix)
    return false;
  for (const char* c = name + n.size() - hex; *c; c++)
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

namespace {
// The temp file of a write, written whole and flushed: after a crash the index is old or new, never empty (the
// failure mode of rename without fsync on delayed-allocation file systems).
void writeTemp(TempFile& tmp, const std::string& data, const std::string& shown) {
  if (int err = writeAll(tmp.fd(), data)) throwErrno(err, "write", shown);
  if (fsync(tmp.fd()) != 0) throwErrno(errno, "fsync", shown);
}

// Keeps what an exchange displaced and could not hand back (see replaceFile) under a name no temp cleanup takes,
// and reports it: ESTALE, with that name as `dest`.
[[noreturn]] void keepDisplaced(int dirFd, const std::string& dir, const std::string& tmp, const std::string& leaf) {
  std::string kept = "." + leaf + ".displaced-" + randomHex(kTempHexBytes);
  const char* syscall = "rename";
  int err = publishFileNoReplace(dirFd, tmp.c_str(), dirFd, kept.c_str(), &syscall);
  if (err != 0) throwErrno(err, syscall, dir + "/" + tmp, dir + "/" + kept);
  throwErrno(ESTALE, "renameat2", dir + "/" + leaf, dir + "/" + kept);
}
}  // namespace

bool replaceFile(const std::string& path, int lockedFd, const std::string& data, bool durable) {
  std::string dir, leaf;
  splitPath(path, &dir, &leaf);
  UniqueFd dirFd(open(dir.c_str(), kDirPathFlags));
  if (!dirFd) throwErrno(errno, "open", dir);
  // Not ours to write (nor to clean up after) once the file at the path is another than the one we locked.
  if (!stillAt(dirFd.get(), dir, leaf, lockedFd)) return false;
  removeIndexTemps(dirFd.get(), dir, leaf);
  std::string tmp = "." + leaf + kTempInfix + randomHex(kTempHexBytes);
  std::string shown = dir + "/" + tmp;
  // Private (0600) until complete; then the mode and owner of the file it replaces.
  TempFile fd(dirFd.get(), tmp, 0600, shown);
  writeTemp(fd, data, shown);
  struct stat own, mine;
  if (fstat(lockedFd, &own) != 0) throwErrno(errno, "fstat", path);
  if (fchown(fd.fd(), own.st_uid, own.st_gid) != 0 && errno != EPERM) throwErrno(errno, "chown", shown);
  if (fchmod(fd.fd(), own.st_mode & 07777) != 0) throwErrno(errno, "chmod", shown);
  if (fstat(fd.fd(), &mine) != 0) throwErrno(errno, "fstat", shown);
  // Nobody knows the temp's name yet: the lock is ours at once, and held until this returns (the fd's close).
  if (flock(fd.fd(), LOCK_EX | LOCK_NB) != 0) throwErrno(errno, "flock", shown);
  if (!stillAt(dirFd.get(), dir, leaf, lockedFd)) return false;
  if (renameat2(dirFd.get(), tmp.c_str(), dirFd.get(), leaf.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno != EINVAL && errno != ENOSYS) throwErrno(errno, "renameat2", shown, path);
    // No RENAME_EXCHANGE here (some FUSE and network file systems): replace after the check above.
    if (renameat(dirFd.get(), tmp.c_str(), dirFd.get(), leaf.c_str()) != 0) throwErrno(errno, "rename", shown, path);
    fd.published();
  } else {
    fd.published();  // the temp name now holds what was at the path: handled here
    struct stat displaced;
    if (fstatat(dirFd.get(), tmp.c_str(), &displaced, AT_SYMLINK_NOFOLLOW) != 0) throwErrno(errno, "stat", shown);
    if (!sameInode(displaced, own)) {
      // The file at the path was replaced between the check and the exchange: it holds another writer's update.
      // Put it back; our file comes back to the temp name unless a second exchange raced this one.
      if (renameat2(dirFd.get(), tmp.c_str(), dirFd.get(), leaf.c_str(), RENAME_EXCHANGE) != 0)
        throwErrno(errno, "renameat2", shown, path);
      struct stat back;
      if (fstatat(dirFd.get(), tmp.c_str(), &back, AT_SYMLINK_NOFOLLOW) != 0) throwErrno(errno, "stat", shown);
      if (!sameInode(back, mine)) keepDisplaced(dirFd.get(), dir, tmp, leaf);
      if (unlinkat(dirFd.get(), tmp.c_str(), 0) != 0) throwErrno(errno, "unlink", shown);
      return false;
    }
    // The old version. Published already: a failure here is reported, and the next writer removes the name.
    if (unlinkat(dirFd.get(), tmp.c_str(), 0) != 0) throwErrno(errno, "unlink", shown);
  }
  if (durable && fsync(dirFd.get()) != 0) throwErrno(errno, "fsync", dir);
  return true;
}

bool createFile(const std::string& path, const std::string& data, bool durable) {
  std::string dir, leaf;
  splitPath(path, &dir, &leaf);
  UniqueFd dirFd(open(dir.c_str(), kDirPathFlags));
  if (!dirFd) throwErrno(errno, "open", dir);
  std::string tmp = "." + leaf + kTempInfix + randomHex(kTempHexBytes);
  std::string shown = dir + "/" + tmp;
  TempFile fd(dirFd.get(), tmp, 0600, shown);
  writeTemp(fd, data, shown);
  if (fchmod(fd.fd(), 0666 & ~currentUmask()) != 0) throwErrno(errno, "chmod", shown);
  const char* syscall = "renameat2";
  int err = publishFileNoReplace(dirFd.get(), tmp.c_str(), dirFd.get(), leaf.c_str(), &syscall);
  if (err == EEXIST) return false;
  if (err == ENOENT) {
    // Our temp removed as a dead writer's by whoever holds the file created meanwhile: start over on that file.
    struct stat mine;
    if (fstat(fd.fd(), &mine) != 0) throwErrno(errno, "fstat", shown);
    if (mine.st_nlink == 0) return false;
  }
  if (err != 0) throwErrno(err, syscall, shown, path);
  fd.published();
  if (durable && fsync(dirFd.get()) != 0) throwErrno(errno, "fsync", dir);
  return true;
}

}  // namespace vmspace

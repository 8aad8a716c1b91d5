#include "clone.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>

#include "error.h"
#include "fd.h"
#include "fs_kind.h"
#include "io.h"
#include "layout.h"
#include "names.h"
#include "remove.h"
#include "rename.h"
#include "template_cache.h"
#include "tree.h"

namespace vmspace {
namespace {

// errnos with which FICLONE says "these two files cannot share extents" rather than "something broke":
// EOPNOTSUPP/ENOTTY (file system without reflink), EXDEV (different file systems), EINVAL (ioctl_ficlone(2):
// unaligned or unsupported ranges on some file systems).
bool reflinkRefused(int err) {
  return err == EOPNOTSUPP || err == ENOTTY || err == EXDEV || err == EINVAL || err == ENOSYS;
}

// EAGAIN and EINTR say "not now" rather than "never": OpenZFS answers EAGAIN to FICLONE and copy_file_range for
// blocks written in the transaction group still open, and a signal may interrupt any of these calls. Each call
// is tried this many times in all, at once, before the data path falls back (or, for reflink 'always', gives up).
// No pause: a transaction group syncs in seconds, and a tree of fresh files would wait that long per file.
constexpr int kTransientTries = 4;

bool transient(int err) { return err == EAGAIN || err == EINTR; }

// pwriteAll (io.h: zero writes and EAGAIN/EINTR tried kWriteTries times, then failed), its errno thrown.
void pwriteAllOrThrow(int fd, const char* buf, size_t len, off_t off, const std::string& dstPath) {
  if (int err = pwriteAll(fd, buf, len, off)) throwErrno(err, "write", dstPath);
}

// pread(2) with EAGAIN/EINTR tried kTransientTries times; 0 is end of file.
size_t readSome(int fd, char* buf, size_t len, off_t off, const std::string& srcPath) {
  for (int attempt = 0;; attempt++) {
    ssize_t n = pread(fd, buf, len, off);
    if (n >= 0) return static_cast<size_t>(n);
    int err = errno;
    if (!transient(err) || attempt + 1 == kTransientTries) throwErrno(err, "read", srcPath);
  }
}

// What a copy tells its CloneProgress (when there is one): the cancel flag, read between chunks, and the bytes
// written so far, added as each chunk lands so that one big file shows progress (the walk counts a file only once
// it is done).
class CopyProgress {
 public:
  explicit CopyProgress(CloneProgress* p) : p_(p) {}
  // ECANCELED once the clone was cancelled.
  void check(const std::string& srcPath, const std::string& dstPath) const {
    if (p_ && p_->cancel.load(std::memory_order_relaxed)) throwErrno(ECANCELED, "clone", srcPath, dstPath);
  }
  void add(uint64_t n) {
    if (!p_) return;
    p_->bytes.fetch_add(n, std::memory_order_relaxed);
    added_ += n;
  }
  // The file is done with `total` bytes: what was not added as chunks (holes, a reflink) is added now.
  void done(uint64_t total) { add(total > added_ ? total - added_ : 0); }

 private:
  CloneProgress* p_;
  uint64_t added_ = 0;
};

// Copies [off, off+len) by read/write; returns the bytes copied, fewer than `len` only where read(2) reported end
// of file first. `len` may exceed what is left (UINT64_MAX: to end of file).
uint64_t copyRangeReadWrite(int src, int dst, off_t off, uint64_t len, const std::string& srcPath,
                            const std::string& dstPath, CopyProgress& progress) {
  // Up to 1 MiB, no more than the range needs (a tree of small files copies one range per file).
  const size_t bufSize = static_cast<size_t>(std::min<uint64_t>(1 << 20, std::max<uint64_t>(len, 1)));
  std::unique_ptr<char[]> buf(new char[bufSize]);
  uint64_t done = 0;
  while (done < len) {
    progress.check(srcPath, dstPath);
    size_t want = static_cast<size_t>(std::min<uint64_t>(bufSize, len - done));
    size_t n = readSome(src, buf.get(), want, off + static_cast<off_t>(done), srcPath);
    if (n == 0) break;
    pwriteAllOrThrow(dst, buf.get(), n, off + static_cast<off_t>(done), dstPath);
    done += n;
    progress.add(n);
  }
  return done;
}

// Copies [off, off+len) at the same offset; copy_file_range(2) where the kernel takes it, read/write otherwise.
// Returns the bytes copied: `len`, or fewer where read(2) reported end of file first. A copy_file_range that
// answers 0 before the range ends is not taken for end of file (FUSE, network file systems and procfs answer 0
// where they cannot copy; Go's io.Copy learned the same): read/write copies the rest, and decides.
// `offload` is false for reflink 'never' (on XFS and btrfs copy_file_range may share extents, which 'never'
// promises not to do), and is cleared for the rest of the file once copy_file_range is refused.
uint64_t copyRange(int src, int dst, off_t off, uint64_t len, bool* offload, const std::string& srcPath,
                   const std::string& dstPath, CopyProgress& progress) {
  constexpr uint64_t kChunk = 64 << 20;  // copy_file_range in chunks, so that a cancel is seen
  uint64_t done = 0;
  int attempt = 0;
  while (*offload && done < len) {
    progress.check(srcPath, dstPath);
    loff_t in = off + static_cast<off_t>(done), out = in;
    ssize_t n = copy_file_range(src, &in, dst, &out, static_cast<size_t>(std::min(kChunk, len - done)), 0);
    if (n > 0) {
      done += static_cast<uint64_t>(n);
      progress.add(static_cast<uint64_t>(n));
      attempt = 0;
      continue;
    }
    int err = n < 0 ? errno : 0;
    if (transient(err) && ++attempt < kTransientTries) continue;
    // 0 before the end, EAGAIN/EINTR past the tries, or refused (old kernel, cross-file-system, special
    // files): read/write for this and every later range of the file.
    if (n == 0 || transient(err) || err == EXDEV || err == EINVAL || err == EOPNOTSUPP || err == ENOSYS ||
        err == EBADF) {
      *offload = false;
      break;
    }
    throwErrno(err, "copy_file_range", srcPath, dstPath);
  }
  if (done < len)
    done += copyRangeReadWrite(src, dst, off + static_cast<off_t>(done), len - done, srcPath, dstPath, progress);
  return done;
}

// What a file's st_size says of the bytes read(2) returns, by its file system (fs_kind.h).
enum class SizeMeaning {
  Length,   // file systems that store files: ext2/3/4, XFS, btrfs, tmpfs, ramfs, F2FS, overlayfs, bcachefs, OpenZFS
  Hint,     // anything else (binfmt_misc, mqueue, configfs, FUSE): may report 0 or a guess; also when fstatfs fails
  Nothing,  // procfs reports 0, sysfs 4096 for every attribute, and the others here are alike
};

SizeMeaning sizeMeaning(int fd) {
  switch (fsKindOf(fd)) {
    case FsKind::Proc:
    case FsKind::Sysfs:
    case FsKind::Debugfs:
    case FsKind::Tracefs:
    case FsKind::Securityfs:
    case FsKind::Cgroup:
    case FsKind::Cgroup2:
      return SizeMeaning::Nothing;
    case FsKind::Ext4:
    case FsKind::Xfs:
    case FsKind::Btrfs:
    case FsKind::Tmpfs:
    case FsKind::Ramfs:
    case FsKind::F2fs:
    case FsKind::Overlayfs:
    case FsKind::Bcachefs:
    case FsKind::Zfs:
      return SizeMeaning::Length;
    case FsKind::Other:
    case FsKind::Unknown:
      return SizeMeaning::Hint;
  }
  return SizeMeaning::Hint;
}

// read(2) found end of file at `at`, before the size of `before`, the version the copy started from. A source that is
// no longer that version (truncated, or truncated and regrown, while it was copied: size, mtime, ctime or inode
// differ) is ERR_SOURCE_CHANGED, which is what went wrong, not a short read; its size alone cannot tell, since a file
// truncated and regrown to the same size reports it again. A file whose size means nothing (procfs, sysfs) is believed.
// A read that stops short of the size the unchanged file still reports is an error (EIO), never a short clone: where
// timestamps are coarse (one per clock tick: kernels before 6.13, ramfs), a truncate and regrow within one tick
// looks unchanged and ends here too.
void checkEndOfFile(int src, off_t at, const struct stat& before, const std::string& srcPath,
                    const std::string& dstPath) {
  if (sizeMeaning(src) == SizeMeaning::Nothing) return;
  struct stat now;
  if (fstat(src, &now) != 0) throwErrno(errno, "fstat", srcPath);
  if (!sameSourceVersion(before, now)) throwSourceChanged(srcPath, dstPath);
  if (now.st_size > at) throwErrno(EIO, "read", srcPath, dstPath);
}

// Copies the data of `src` to `dst`, leaving holes as holes (SEEK_DATA/SEEK_HOLE, lseek(2)), and returns the size
// published. The copy runs to the source's end of file as read(2) finds it, not as st_size said: a file that
// ends earlier (a sysfs attribute reports 4096) is published with the bytes read (checkEndOfFile), and one that
// goes on (procfs reports 0) is copied on to its end, where the version check then decides. On a file system whose
// sizes are lengths (SizeMeaning::Length), data past the size means the file grew while it was copied:
// ERR_SOURCE_CHANGED at once, which the version check may miss where timestamps are coarse and the file shrank back.
// The size is then checked on `dst`.
uint64_t copySparse(int src, int dst, const struct stat& before, bool offload, const std::string& srcPath,
                    const std::string& dstPath, CopyProgress& progress) {
  off_t pos = 0, end = before.st_size;
  bool ended = false;  // read(2) reported end of file before the size the copy started from
  while (pos < end) {
    off_t data = lseek(src, pos, SEEK_DATA);
    if (data < 0) {
      if (errno == ENXIO) break;  // only a hole remains
      if (errno != EINVAL && errno != ESPIPE) throwErrno(errno, "lseek", srcPath);
      data = pos;  // SEEK_DATA unsupported (procfs, sysfs: EINVAL): everything is data
    }
    if (data >= end) break;
    off_t hole = lseek(src, data, SEEK_HOLE);
    if (hole < 0 || hole > end) hole = end;  // no hole known: data to the end, which read(2) then finds
    uint64_t want = static_cast<uint64_t>(hole - data);
    uint64_t got = copyRange(src, dst, data, want, &offload, srcPath, dstPath, progress);
    if (got < want) {
      end = data + static_cast<off_t>(got);
      checkEndOfFile(src, end, before, srcPath, dstPath);
      ended = true;
      break;
    }
    pos = hole;
  }
  if (!ended) {
    // Past st_size: one read, which finds end of file at once for an ordinary file; anything more is copied.
    char probe[4096];
    size_t n = readSome(src, probe, sizeof probe, end, srcPath);
    if (n > 0) {
      if (sizeMeaning(src) == SizeMeaning::Length) throwSourceChanged(srcPath, dstPath);
      pwriteAllOrThrow(dst, probe, n, end, dstPath);
      end += static_cast<off_t>(n);
      progress.add(n);
      end += static_cast<off_t>(
          copyRangeReadWrite(src, dst, end, UINT64_MAX - static_cast<uint64_t>(end), srcPath, dstPath, progress));
    }
  }
  // Trailing hole (and the size itself): extending by ftruncate allocates nothing.
  if (ftruncate(dst, end) != 0) throwErrno(errno, "ftruncate", dstPath);
  // What is published is exactly what was read: a destination of another size (a write that lied) is an error.
  struct stat st;
  if (fstat(dst, &st) != 0) throwErrno(errno, "fstat", dstPath);
  if (st.st_size != end) throwErrno(EIO, "write", dstPath);
  return static_cast<uint64_t>(end);
}

}  // namespace

CloneFileResult cloneData(int src, int dst, const struct stat& before, Reflink reflink, const std::string& srcPath,
                          const std::string& dstPath, CloneProgress* p) {
  const uint64_t size = static_cast<uint64_t>(before.st_size);
  CopyProgress progress(p);
  progress.check(srcPath, dstPath);
  if (reflink != Reflink::Never) {
    int err = 0;
    for (int attempt = 0;; attempt++) {
      if (ioctl(dst, FICLONE, src) == 0) {
        // The clone is the file as it was at the ioctl: another length than the one started from is a change the
        // caller's version check may miss where timestamps are coarse (a resize and its undoing within one tick).
        struct stat got;
        if (fstat(dst, &got) != 0) throwErrno(errno, "fstat", dstPath);
        if (got.st_size != before.st_size) throwSourceChanged(srcPath, dstPath);
        progress.done(size);
        return {CloneMethod::Reflink, size};
      }
      err = errno;
      if (!transient(err) || attempt + 1 == kTransientTries) break;
    }
    if (!reflinkRefused(err) && !transient(err)) throwErrno(err, "ioctl(FICLONE)", srcPath, dstPath);
    if (reflink == Reflink::Always)
      throwCode("ERR_REFLINK_UNSUPPORTED",
                transient(err) ? "the file system kept refusing to share extents for now (reflink: 'always')"
                               : "the file systems of source and destination cannot share extents (reflink: 'always')",
                err, "ioctl(FICLONE)", srcPath, dstPath);
    // A FICLONE that failed part way (EAGAIN, EINTR) may have left some of the range behind: copy into empty.
    if (ftruncate(dst, 0) != 0) throwErrno(errno, "ftruncate", dstPath);
  }
  uint64_t bytes = copySparse(src, dst, before, reflink == Reflink::Auto, srcPath, dstPath, progress);
  progress.done(bytes);
  return {CloneMethod::Copy, bytes};
}

void writeBack(int fd, Writeback writeback, const std::string& path) {
  if (writeback == Writeback::None) return;
  // WAIT_BEFORE|WRITE|WAIT_AFTER is the documented "write out and wait" of sync_file_range(2); WRITE alone only
  // queues the pages (it may block briefly where the device queue is full, never for the whole writeback).
  unsigned flags = writeback == Writeback::Start
                       ? SYNC_FILE_RANGE_WRITE
                       : SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER;
  for (int attempt = 0;; attempt++) {
    if (sync_file_range(fd, 0, 0, flags) == 0) return;
    int err = errno;
    if (err == ESPIPE || err == EINVAL) return;  // nothing to write back here (a pipe, a pseudo-file)
    if (!transient(err) || attempt + 1 == kTransientTries) throwErrno(err, "sync_file_range", path);
  }
}

void fillIdentity(SourceIdentity* identity, const struct stat& st) {
  if (identity)
    *identity = {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
                 st.st_mtim.tv_sec, st.st_mtim.tv_nsec};
}

bool sameSourceVersion(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_size == b.st_size &&
         a.st_mtim.tv_sec == b.st_mtim.tv_sec && a.st_mtim.tv_nsec == b.st_mtim.tv_nsec &&
         a.st_ctim.tv_sec == b.st_ctim.tv_sec && a.st_ctim.tv_nsec == b.st_ctim.tv_nsec;
}

void throwSourceChanged(const std::string& srcPath, const std::string& dstPath) {
  throwCode("ERR_SOURCE_CHANGED",
            "the source changed while it was cloned (size, mtime, ctime or inode); nothing was published", 0, "",
            srcPath, dstPath);
}

void checkSourceUnchanged(int src, const struct stat& before, const std::string& srcPath, const std::string& dstPath,
                          struct stat* after) {
  struct stat now;
  if (fstat(src, &now) != 0) throwErrno(errno, "fstat", srcPath);
  if (!sameSourceVersion(before, now)) throwSourceChanged(srcPath, dstPath);
  if (after) *after = now;
}

namespace {

// Set once a linkat(2) of an O_TMPFILE file was refused (no /proc, EPERM) where a named temp file then worked:
// this process no longer tries O_TMPFILE. Set once AT_EMPTY_PATH was refused (it needs CAP_DAC_READ_SEARCH,
// linkat(2)) where /proc/self/fd worked: only the /proc path is tried after that.
std::atomic<bool> tmpfileLinkRefused{false};
std::atomic<bool> emptyPathRefused{false};

// open(2) with O_TMPFILE is refused with EOPNOTSUPP by a file system without it, EISDIR by kernels before 3.11
// (which take O_TMPFILE's O_DIRECTORY for a plain open of the directory), EINVAL for a flag combination the
// file system does not take (man 2 open); ENOSYS and ENOTSUP alike on FUSE.
bool tmpfileRefused(int err) { return err == EOPNOTSUPP || err == EISDIR || err == EINVAL || err == ENOSYS; }

// linkat(2) of an unnamed file refused by the environment rather than by the destination: ENOENT (no /proc, or
// AT_EMPTY_PATH without the capability), EPERM (a file system without hard links; a seccomp filter), EACCES
// (/proc mounted hidepid), EXDEV, EOPNOTSUPP, ENOSYS, EINVAL. A named temp file is tried then; if the ENOENT
// meant that the directory is gone, the named path fails with that ENOENT too.
bool tmpfileLinkRefusedErr(int err) {
  return err == ENOENT || err == EPERM || err == EACCES || err == EXDEV || err == EOPNOTSUPP || err == ENOSYS ||
         err == EINVAL;
}

}  // namespace

int linkTmpfile(int fd, int dirFd, const char* name) {
  if (!emptyPathRefused.load(std::memory_order_relaxed)) {
    if (linkat(fd, "", dirFd, name, AT_EMPTY_PATH) == 0) return 0;
    if (errno != ENOENT) return errno;
  }
  char proc[40];
  int n = snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
  if (n < 0 || static_cast<size_t>(n) >= sizeof proc) return ENAMETOOLONG;  // an int always fits: checked anyway
  if (linkat(AT_FDCWD, proc, dirFd, name, AT_SYMLINK_FOLLOW) != 0) return errno;
  emptyPathRefused.store(true, std::memory_order_relaxed);
  return 0;
}

namespace {

// Fills the new file `dst` from `src` (stat `st`): data, checked to be of the version `st` names (else
// ERR_SOURCE_CHANGED), mode, writeback, fsync for `durable`. Fills `identity` (when given) from the stat after the
// data.
CloneFileResult fillClone(int src, const struct stat& st, int dst, const CloneOptions& options,
                          const std::string& srcPath, const std::string& dstPath, CloneProgress* progress,
                          SourceIdentity* identity) {
  CloneFileResult result{};
  // The template cache serves a source on another file system by a reflink of its cached copy; 'always' keeps its
  // promise of failing there, 'never' of copying.
  if (!(options.cache && options.reflink == Reflink::Auto &&
        options.cache->fill(src, st, dst, srcPath, dstPath, progress, &result)))
    result = cloneData(src, dst, st, options.reflink, srcPath, dstPath, progress);
  struct stat after;
  checkSourceUnchanged(src, st, srcPath, dstPath, &after);
  fillIdentity(identity, after);
  // The clone is ours, not the source owner's: set-id bits are kept only where owner (group) are the same, so
  // root cloning a user's 4755 file never mints a root-owned set-uid binary. (No set-id bit: no fstat needed.)
  mode_t mode = st.st_mode & 07777;
  if (!options.keepSetId) mode &= ~(S_ISUID | S_ISGID);  // a guest's file (CloneOptions::keepSetId)
  if (mode & (S_ISUID | S_ISGID)) {
    struct stat own;
    if (fstat(dst, &own) != 0) throwErrno(errno, "fstat", dstPath);
    if (own.st_uid != st.st_uid) mode &= ~S_ISUID;
    if (own.st_gid != st.st_gid) mode &= ~S_ISGID;
  }
  if (fchmod(dst, mode) != 0) throwErrno(errno, "fchmod", dstPath);
  if (result.method == CloneMethod::Copy) writeBack(dst, options.writeback, dstPath);
  if (options.durable && fsync(dst) != 0) throwErrno(errno, "fsync", dstPath);
  return result;
}

// What kind of file `mode` is, in words for an error.
const char* fileKind(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFIFO:
      return "a fifo";
    case S_IFSOCK:
      return "a socket";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFLNK:
      return "a symlink";
    default:
      return "not a regular file";
  }
}

// ERR_SOURCE_TYPE: the source is neither a regular file nor a directory. No errno: nothing failed, the source is
// of a kind a clone does not take (a fifo's or a device's data is a stream, not a file to share extents of).
[[noreturn]] void throwSourceType(mode_t mode, const std::string& srcPath, const std::string& dstPath) {
  throwCode("ERR_SOURCE_TYPE",
            std::string("the source is ") + fileKind(mode) + ": a clone source is a regular file or a directory", 0, "",
            srcPath, dstPath);
}

// Opens a clone source, file or directory, once: the caller chooses from its fstat, with no stat(2) of the path
// before (a syscall fewer, and no window between that stat and the open). O_RDONLY opens a directory as well as
// a file (open(2)); O_NONBLOCK keeps a fifo from parking this thread in open(2) waiting for a writer, and has no
// effect on regular files or directories. A symlink given as the source itself is followed, as cp does. A source
// of another kind is ERR_SOURCE_TYPE, from the fstat, or where open(2) refuses it (a socket: ENXIO) from a stat.
UniqueFd openSource(const std::string& srcPath, const std::string& dstPath, struct stat* st) {
  UniqueFd src(open(srcPath.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!src) {
    int err = errno;
    if (err == ENXIO && stat(srcPath.c_str(), st) == 0 && !S_ISREG(st->st_mode) && !S_ISDIR(st->st_mode))
      throwSourceType(st->st_mode, srcPath, dstPath);
    throwErrno(err, "open", srcPath, dstPath);
  }
  if (fstat(src.get(), st) != 0) throwErrno(errno, "fstat", srcPath);
  if (!S_ISREG(st->st_mode) && !S_ISDIR(st->st_mode)) throwSourceType(st->st_mode, srcPath, dstPath);
  return src;
}

// Opens the source `rel` beneath `baseFd` (a workspace: hostile entries) for a clone out of it. Every component is
// opened O_NOFOLLOW (a symlink on the way: ENOTDIR, at the leaf: ELOOP), the leaf first as O_PATH: a device node
// or fifo is refused (ERR_SOURCE_TYPE) before any open(2) of it, which for a device is the driver's open (a
// watchdog arms itself). The O_PATH fd is then reopened through /proc/self/fd: the very inode checked, whatever
// the guest renames meanwhile.
UniqueFd openSourceBeneath(int baseFd, const std::string& basePath, const std::string& rel, const std::string& dstPath,
                           struct stat* st) {
  std::string leaf, srcPath = basePath + "/" + rel;
  ParentDir dir = openParentBeneath(baseFd, rel, &leaf, basePath, false);
  UniqueFd at(openat(dir.get(), leaf.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
  if (!at) throwErrno(errno, "open", srcPath, dstPath);
  if (fstat(at.get(), st) != 0) throwErrno(errno, "fstat", srcPath);
  if (S_ISLNK(st->st_mode)) throwErrno(ELOOP, "open", srcPath, dstPath);
  if (!S_ISREG(st->st_mode) && !S_ISDIR(st->st_mode)) throwSourceType(st->st_mode, srcPath, dstPath);
  std::string proc = "/proc/self/fd/" + std::to_string(at.get());
  UniqueFd src(open(proc.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!src) throwErrno(errno, "open", srcPath, dstPath);
  return src;
}

// cloneFileAt for the source `src` already open (stat `st`, a regular file: openSource).
CloneFileResult cloneOpenFile(int src, const struct stat& st, const std::string& srcPath, int dstDirFd,
                              const std::string& dstName, const std::string& dstPath, const CloneOptions& options,
                              SourceIdentity* identity, CloneProgress* progress) {
  if (S_ISDIR(st.st_mode)) throwErrno(EISDIR, "open", srcPath, dstPath);

  // Without overwrite: an unnamed file (O_TMPFILE), named only once complete by linkat(2), which never replaces
  // (EEXIST). No temp name to draw, rename, or remove on failure (closing the fd frees it): 2 syscalls fewer than
  // the named temp file below, and nothing is ever left behind. Where refused, the named temp file.
  bool linkRefused = false;
  if (!options.overwrite && !tmpfileLinkRefused.load(std::memory_order_relaxed)) {
    UniqueFd dst(openat(dstDirFd, ".", O_TMPFILE | O_WRONLY | O_CLOEXEC | O_NOCTTY, 0600));
    if (dst) {
      CloneFileResult result = fillClone(src, st, dst.get(), options, srcPath, dstPath, progress, identity);
      int err = linkTmpfile(dst.get(), dstDirFd, dstName.c_str());
      if (err == 0) {
        if (options.durable && fsync(dstDirFd) != 0) throwErrno(errno, "fsync", dstPath);
        return result;
      }
      if (!tmpfileLinkRefusedErr(err)) throwErrno(err, "linkat", srcPath, dstPath);
      linkRefused = true;
      // A copy is read again below, from the start (`src`'s offset is unused: pread, copy_file_range with offsets),
      // and counts its bytes again: the first copy's are taken back (once per process: linkRefused is remembered).
      if (progress) progress->bytes.fetch_sub(result.bytes, std::memory_order_relaxed);
    } else if (!tmpfileRefused(errno)) {
      throwErrno(errno, "open", dstPath);
    }
  }

  // The temp file is private (0600) until it is complete; its final mode is set just before publish.
  std::string tmpName = layout::kCloneTmpPrefix + randomHex(8);
  UniqueFd dst(openat(dstDirFd, tmpName.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600));
  if (!dst) throwErrno(errno, "open", dstPath);
  try {
    CloneFileResult result = fillClone(src, st, dst.get(), options, srcPath, dstPath, progress, identity);
    if (options.overwrite) {
      // rename(2) replaces the destination atomically; it refuses (EISDIR) to replace a directory with a file.
      if (renameat(dstDirFd, tmpName.c_str(), dstDirFd, dstName.c_str()) != 0)
        throwErrno(errno, "rename", srcPath, dstPath);
    } else {
      const char* step = "renameat2";
      if (int err = publishFileNoReplace(dstDirFd, tmpName.c_str(), dstDirFd, dstName.c_str(), &step))
        throwErrno(err, step, srcPath, dstPath);
    }
    if (linkRefused) tmpfileLinkRefused.store(true, std::memory_order_relaxed);
    if (options.durable && fsync(dstDirFd) != 0) throwErrno(errno, "fsync", dstPath);
    return result;
  } catch (...) {
    // The temp name is ours alone (O_EXCL, random); after a successful rename it no longer exists.
    unlinkat(dstDirFd, tmpName.c_str(), 0);
    throw;
  }
}

}  // namespace

CloneFileResult cloneFileAt(const std::string& srcPath, int dstDirFd, const std::string& dstName,
                            const std::string& dstPath, const CloneOptions& options, SourceIdentity* identity,
                            CloneProgress* progress) {
  struct stat st;
  UniqueFd src = openSource(srcPath, dstPath, &st);
  return cloneOpenFile(src.get(), st, srcPath, dstDirFd, dstName, dstPath, options, identity, progress);
}

ParentDir openParentBeneath(int baseFd, const std::string& rel, std::string* leaf, const std::string& basePath,
                            bool createParents) {
  size_t start = 0;
  ParentDir parent;  // owned stays empty while the current directory is baseFd itself (not ours to close)
  parent.fd = baseFd;
  for (;;) {
    size_t slash = rel.find('/', start);
    if (slash == std::string::npos) {
      *leaf = rel.substr(start);
      return parent;
    }
    std::string comp = rel.substr(start, slash - start);
    std::string shown = basePath + "/" + rel.substr(0, slash);
    if (createParents && mkdirat(parent.fd, comp.c_str(), 0777) != 0 && errno != EEXIST)
      throwErrno(errno, "mkdir", shown);
    int next = openat(parent.fd, comp.c_str(), kDirFlags);
    if (next < 0) throwErrno(errno == ELOOP ? ENOTDIR : errno, "open", shown);
    parent.owned.reset(next);
    parent.fd = next;
    start = slash + 1;
  }
}

const char* methodName(const CloneSummary& s, Reflink) {
  if (s.snapshot) return "snapshot";
  if (s.reflinked && s.copied) return "mixed";
  if (s.reflinked) return "reflink";
  // Copied files, or none: a tree without regular files shared no extent, whatever `reflink` asked for (on ext4 none
  // could be); its entries were all made anew, as a copy makes them.
  return "copy";
}

namespace {

// clonePathAt of a source that is no directory: one file, counted as the tree walk counts its files.
CloneSummary cloneOneFile(int src, const struct stat& st, const std::string& srcPath, int dstDirFd,
                          const std::string& dstName, const std::string& dstPath, const CloneOptions& options,
                          CloneProgress* progress, SourceIdentity* identity) {
  CloneFileResult r = cloneOpenFile(src, st, srcPath, dstDirFd, dstName, dstPath, options, identity, progress);
  CloneSummary s;
  s.files = 1;
  s.bytes = r.bytes;
  s.cache = r.cache;
  (r.method == CloneMethod::Reflink ? s.reflinked : s.copied) = 1;
  if (progress) progress->files.fetch_add(1, std::memory_order_relaxed);  // its bytes came with its data (cloneData)
  return s;
}

// Publishes the finished tree `tmp` as `dstName` (both in `dstDirFd`) without replacing, or with `overwrite` by
// exchange and removal of the old tree.
void publishTree(int dstDirFd, const std::string& tmp, const std::string& tmpPath, const std::string& dstName,
                 const std::string& srcPath, const std::string& dstPath, const CloneOptions& options) {
  if (renameat2(dstDirFd, tmp.c_str(), dstDirFd, dstName.c_str(), RENAME_NOREPLACE) == 0) return;
  int err = errno;
  // A directory has no link(2) to publish it without replacing, and rename(2) replaces an empty one.
  if (noReplaceUnsupported(err))
    throwCode("ERR_RENAME_NOREPLACE_UNSUPPORTED",
              "the file system cannot rename without replacing (renameat2 RENAME_NOREPLACE), which publishing a "
              "directory needs",
              err, "renameat2", srcPath, dstPath);
  if (err != EEXIST || !options.overwrite) throwErrno(err, "renameat2", srcPath, dstPath);
  // Replace an existing destination atomically: swap it with the new tree, then remove the old one
  // (now under the temp name).
  if (renameat2(dstDirFd, tmp.c_str(), dstDirFd, dstName.c_str(), RENAME_EXCHANGE) != 0)
    throwErrno(errno, "renameat2", srcPath, dstPath);
  removeTreeNoFollow(dstDirFd, tmp, tmpPath);
}

// clonePathAt of the source `src` already open (stat `st`: a regular file or a directory).
CloneSummary cloneOpenSource(int src, const struct stat& st, const std::string& srcPath, int dstDirFd,
                             const std::string& dstName, const std::string& dstPath, const CloneOptions& options,
                             CloneProgress* progress, SourceIdentity* identity) {
  if (!S_ISDIR(st.st_mode))
    return cloneOneFile(src, st, srcPath, dstDirFd, dstName, dstPath, options, progress, identity);
  fillIdentity(identity, st);
  checkSameFs(st, dstDirFd, options, srcPath, dstPath);
  CloneOptions treeOptions = options;
  treeOptions.cache = nullptr;  // trees are cloned as they are (the cache keeps single files)

  // The tree is built under a private temp name (0700 until its own metadata is applied, last).
  std::string tmp = layout::kCloneTmpPrefix + randomHex(8);
  if (mkdirat(dstDirFd, tmp.c_str(), 0700) != 0) throwErrno(errno, "mkdir", dstPath);
  std::string parentPath, leaf;
  splitPath(dstPath, &parentPath, &leaf);
  std::string tmpPath = parentPath + "/" + tmp;
  try {
    UniqueFd root(openat(dstDirFd, tmp.c_str(), kDirFlags));
    if (!root) throwErrno(errno, "open", dstPath);
    CloneSummary summary = cloneTreeAs(src, st, root.get(), srcPath, dstPath, treeOptions, progress);
    if (options.durable && fsync(root.get()) != 0) throwErrno(errno, "fsync", dstPath);
    publishTree(dstDirFd, tmp, tmpPath, dstName, srcPath, dstPath, options);
    if (options.durable && fsync(dstDirFd) != 0) throwErrno(errno, "fsync", dstPath);
    return summary;
  } catch (...) {
    try {
      removeTreeNoFollow(dstDirFd, tmp, tmpPath);
    } catch (...) {
      // The original error is the one to report; what is left carries a .vmspace-tmp- name.
    }
    throw;
  }
}

// The parent directory of the absolute destination `dstPath` (its own path followed as given); *leaf: the last
// component.
UniqueFd openDestParent(const std::string& dstPath, std::string* leaf) {
  std::string parent;
  splitPath(dstPath, &parent, leaf);
  UniqueFd dir(open(parent.c_str(), kDirPathFlags));
  if (!dir) throwErrno(errno, "open", dstPath);
  return dir;
}

}  // namespace

CloneSummary clonePathAt(const std::string& srcPath, int dstDirFd, const std::string& dstName,
                         const std::string& dstPath, const CloneOptions& options, CloneProgress* progress,
                         SourceIdentity* identity) {
  struct stat st;
  UniqueFd src = openSource(srcPath, dstPath, &st);
  return cloneOpenSource(src.get(), st, srcPath, dstDirFd, dstName, dstPath, options, progress, identity);
}

CloneSummary clonePath(const std::string& srcPath, const std::string& dstPath, const CloneOptions& options,
                       CloneProgress* progress) {
  std::string leaf;
  UniqueFd dir = openDestParent(dstPath, &leaf);
  return clonePathAt(srcPath, dir.get(), leaf, dstPath, options, progress);
}

CloneSummary cloneOutBeneath(int baseFd, const std::string& basePath, const std::string& rel,
                             const std::string& dstPath, const CloneOptions& options, CloneProgress* progress) {
  struct stat st;
  UniqueFd src = openSourceBeneath(baseFd, basePath, rel, dstPath, &st);
  std::string leaf;
  UniqueFd dir = openDestParent(dstPath, &leaf);
  return cloneOpenSource(src.get(), st, basePath + "/" + rel, dir.get(), leaf, dstPath, options, progress, nullptr);
}

CloneSummary clonePathBeneath(const std::string& srcPath, int baseFd, const std::string& basePath,
                              const std::string& rel, const CloneOptions& options, CloneProgress* progress) {
  std::string leaf;
  ParentDir dir = openParentBeneath(baseFd, rel, &leaf, basePath, false);
  return clonePathAt(srcPath, dir.get(), leaf, basePath + "/" + rel, options, progress);
}

}  // namespace vmspace

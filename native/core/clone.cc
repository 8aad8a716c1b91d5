// The clone engine's data path (clone.h): FICLONE, the hole-keeping copy and the checks on every answer; the source
// version check; linkTmpfile and openParentBeneath, which the file, tree and shared-file clones all use.
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

// Set once AT_EMPTY_PATH was refused (it needs CAP_DAC_READ_SEARCH, linkat(2)) where /proc/self/fd worked: only
// the /proc path is tried after that.
std::atomic<bool> emptyPathRefused{false};

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
}  // namespace vmspace

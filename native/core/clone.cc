#include "clone.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <memory>

#include "error.h"
#include "fd.h"
#include "names.h"

namespace vmspace {
namespace {

// errnos with which FICLONE says "these two files cannot share extents" rather than "something broke":
// EOPNOTSUPP/ENOTTY (file system without reflink), EXDEV (different file systems), EINVAL (ioctl_ficlone(2):
// unaligned or unsupported ranges on some file systems).
bool reflinkRefused(int err) {
  return err == EOPNOTSUPP || err == ENOTTY || err == EXDEV || err == EINVAL || err == ENOSYS;
}

void writeAll(int fd, const char* buf, size_t len, off_t off, const std::string& dstPath) {
  while (len > 0) {
    ssize_t n = pwrite(fd, buf, len, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      throwErrno(errno, "write", dstPath);
    }
    buf += n;
    len -= static_cast<size_t>(n);
    off += n;
  }
}

// Copies [off, off+len) by read/write; returns the bytes copied (short only at end of file).
uint64_t copyRangeReadWrite(int src, int dst, off_t off, uint64_t len, const std::string& srcPath,
                            const std::string& dstPath, const std::atomic<bool>* cancel) {
  // Up to 1 MiB, no more than the range needs (a tree of small files copies one range per file).
  const size_t bufSize = static_cast<size_t>(std::min<uint64_t>(1 << 20, std::max<uint64_t>(len, 1)));
  std::unique_ptr<char[]> buf(new char[bufSize]);
  uint64_t done = 0;
  while (done < len) {
    if (cancel && cancel->load(std::memory_order_relaxed)) throwErrno(ECANCELED, "clone", srcPath, dstPath);
    size_t want = static_cast<size_t>(std::min<uint64_t>(bufSize, len - done));
    ssize_t n = pread(src, buf.get(), want, off + static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throwErrno(errno, "read", srcPath);
    }
    if (n == 0) break;
    writeAll(dst, buf.get(), static_cast<size_t>(n), off + static_cast<off_t>(done), dstPath);
    done += static_cast<uint64_t>(n);
  }
  return done;
}

// Copies [off, off+len) at the same offset; copy_file_range(2) where the kernel takes it, read/write otherwise.
// `offload` is false for reflink 'never': on XFS and btrfs copy_file_range may share extents, which 'never'
// promises not to do.
void copyRange(int src, int dst, off_t off, uint64_t len, bool* offload, const std::string& srcPath,
               const std::string& dstPath, const std::atomic<bool>* cancel) {
  constexpr uint64_t kChunk = 64 << 20;  // copy_file_range in chunks, so that a cancel is seen
  uint64_t done = 0;
  while (*offload && done < len) {
    if (cancel && cancel->load(std::memory_order_relaxed)) throwErrno(ECANCELED, "clone", srcPath, dstPath);
    loff_t in = off + static_cast<off_t>(done), out = in;
    ssize_t n = copy_file_range(src, &in, dst, &out, static_cast<size_t>(std::min(kChunk, len - done)), 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      // Refused (old kernel, cross-file-system, special files): fall back for this and every later range.
      if (errno == EXDEV || errno == EINVAL || errno == EOPNOTSUPP || errno == ENOSYS || errno == EBADF) {
        *offload = false;
        break;
      }
      throwErrno(errno, "copy_file_range", srcPath, dstPath);
    }
    if (n == 0) return;  // end of file: the source shrank while we copied
    done += static_cast<uint64_t>(n);
  }
  if (done < len) copyRangeReadWrite(src, dst, off + static_cast<off_t>(done), len - done, srcPath, dstPath, cancel);
}

// Copies the data of `src` to `dst`, leaving holes as holes (SEEK_DATA/SEEK_HOLE, lseek(2)).
void copySparse(int src, int dst, uint64_t size, bool offload, const std::string& srcPath,
                const std::string& dstPath, const std::atomic<bool>* cancel) {
  off_t pos = 0, end = static_cast<off_t>(size);
  while (pos < end) {
    off_t data = lseek(src, pos, SEEK_DATA);
    if (data < 0) {
      if (errno == ENXIO) break;  // only a hole remains
      if (errno != EINVAL) throwErrno(errno, "lseek", srcPath);
      data = pos;  // SEEK_DATA unsupported: everything is data
    }
    if (data >= end) break;
    off_t hole = lseek(src, data, SEEK_HOLE);
    if (hole < 0 || hole > end) hole = end;
    copyRange(src, dst, data, static_cast<uint64_t>(hole - data), &offload, srcPath, dstPath, cancel);
    pos = hole;
  }
  // Trailing hole (and the size itself): extending by ftruncate allocates nothing.
  if (ftruncate(dst, end) != 0) throwErrno(errno, "ftruncate", dstPath);
}

}  // namespace

CloneMethod cloneData(int src, int dst, uint64_t size, Reflink reflink, const std::string& srcPath,
                      const std::string& dstPath, const std::atomic<bool>* cancel) {
  if (reflink != Reflink::Never) {
    if (ioctl(dst, FICLONE, src) == 0) return CloneMethod::Reflink;
    int err = errno;
    if (!reflinkRefused(err)) throwErrno(err, "ioctl(FICLONE)", srcPath, dstPath);
    if (reflink == Reflink::Always)
      throwCode("ERR_REFLINK_UNSUPPORTED",
                "the file systems of source and destination cannot share extents (reflink: 'always')", err,
                "ioctl(FICLONE)", srcPath, dstPath);
  }
  copySparse(src, dst, size, reflink == Reflink::Auto, srcPath, dstPath, cancel);
  return CloneMethod::Copy;
}

void fillIdentity(SourceIdentity* identity, const struct stat& st) {
  if (identity)
    *identity = {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
                 static_cast<uint64_t>(st.st_size), st.st_mtim.tv_sec, st.st_mtim.tv_nsec};
}

CloneFileResult cloneFileAt(const std::string& srcPath, int dstDirFd, const std::string& dstName,
                            const std::string& dstPath, const CloneOptions& options, SourceIdentity* identity,
                            const std::atomic<bool>* cancel) {
  // O_NONBLOCK: a fifo given as the source must not park this thread in open(2) waiting for a writer; it is
  // refused below like any other file that is not regular. (No effect on regular files.)
  UniqueFd src(open(srcPath.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!src) throwErrno(errno, "open", srcPath);
  struct stat st;
  if (fstat(src.get(), &st) != 0) throwErrno(errno, "fstat", srcPath);
  if (S_ISDIR(st.st_mode)) throwErrno(EISDIR, "clone", srcPath, dstPath);
  if (!S_ISREG(st.st_mode)) throwErrno(EINVAL, "clone", srcPath, dstPath);
  fillIdentity(identity, st);

  // The temp file is private (0600) until it is complete; its final mode is set just before publish.
  std::string tmpName = ".vmspace-tmp-" + randomHex(8);
  UniqueFd dst(openat(dstDirFd, tmpName.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600));
  if (!dst) throwErrno(errno, "open", dstPath);
  try {
    CloneFileResult result{cloneData(src.get(), dst.get(), static_cast<uint64_t>(st.st_size), options.reflink, srcPath,
                                     dstPath, cancel),
                           static_cast<uint64_t>(st.st_size)};
    if (fchmod(dst.get(), st.st_mode & 07777) != 0) throwErrno(errno, "fchmod", dstPath);
    if (options.durable && fsync(dst.get()) != 0) throwErrno(errno, "fsync", dstPath);
    if (options.overwrite) {
      // rename(2) replaces the destination atomically; it refuses (EISDIR) to replace a directory with a file.
      if (renameat(dstDirFd, tmpName.c_str(), dstDirFd, dstName.c_str()) != 0)
        throwErrno(errno, "rename", srcPath, dstPath);
    } else if (renameat2(dstDirFd, tmpName.c_str(), dstDirFd, dstName.c_str(), RENAME_NOREPLACE) != 0) {
      throwErrno(errno, "renameat2", srcPath, dstPath);
    }
    if (options.durable && fsync(dstDirFd) != 0) throwErrno(errno, "fsync", dstPath);
    return result;
  } catch (...) {
    // The temp name is ours alone (O_EXCL, random); after a successful rename it no longer exists.
    unlinkat(dstDirFd, tmpName.c_str(), 0);
    throw;
  }
}

int openParentBeneath(int baseFd, const std::string& rel, std::string* leaf, const std::string& basePath,
                      bool createParents) {
  size_t start = 0;
  UniqueFd cur;  // empty while the current directory is baseFd itself (not ours to close)
  for (;;) {
    size_t slash = rel.find('/', start);
    if (slash == std::string::npos) {
      *leaf = rel.substr(start);
      if (cur) return cur.release();
      int dup = fcntl(baseFd, F_DUPFD_CLOEXEC, 0);
      if (dup < 0) throwErrno(errno, "fcntl", basePath);
      return dup;
    }
    std::string comp = rel.substr(start, slash - start);
    int at = cur ? cur.get() : baseFd;
    std::string shown = basePath + "/" + rel.substr(0, slash);
    if (createParents && mkdirat(at, comp.c_str(), 0777) != 0 && errno != EEXIST) throwErrno(errno, "mkdir", shown);
    int next = openat(at, comp.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
    if (next < 0) throwErrno(errno == ELOOP ? ENOTDIR : errno, "open", shown);
    cur.reset(next);
    start = slash + 1;
  }
}

}  // namespace vmspace


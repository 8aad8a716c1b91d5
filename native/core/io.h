// Whole-file reads and writes over fds, returning an errno (0 on success) so that callers decide whether a
// failure is an error (throw) or a finding (report per entry).
#pragma once

#include <dirent.h>
#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace vmspace {

// Reads the regular file `name` below `at` (an absolute path with AT_FDCWD) into `out`. Opened O_NONBLOCK, so a
// fifo in its place never parks the thread in open(2); a directory is EISDIR, any other non-regular file EINVAL,
// more than `limit` bytes EFBIG. st_size is only a hint (files under /proc report 0). `extraFlags` is or-ed into
// the open flags (O_NOFOLLOW). `*syscall` names the step that failed.
int readRegularFileAt(int at, const char* name, int extraFlags, size_t limit, std::string* out,
                      const char** syscall = nullptr);

// chmod(2) of the inode `fd` refers to, which may be an O_PATH descriptor (fchmod(2) refuses those with EBADF):
// through its /proc/self/fd link, which names that inode and no path a guest could swap meanwhile. 0, or -1 with
// errno.
int chmodFd(int fd, mode_t mode);

// Opens the entry `name` of `dirFd` with `flags` (an access mode, O_NONBLOCK, O_NOATIME) only while it is the
// regular file of device `dev` and inode `ino` that a stat of that name saw. An O_PATH|O_NOFOLLOW descriptor comes
// first, which opens nothing (no device's open(2) with its side effects, no wait on a FIFO); it is checked with
// fstat, and then opened through its /proc/self/fd link, which names that inode and no path a guest could swap
// meanwhile (systemd's fd_reopen does the same). Without /proc the entry is opened by name (O_NOFOLLOW,
// O_NONBLOCK) and checked after. An fd, or -1 with errno: ESTALE when the name is now another file or no regular
// file, ELOOP for a symlink, or the errno of the open that failed. Takes two fds while it runs.
int openRegularAtNoFollow(int dirFd, const char* name, int flags, dev_t dev, ino_t ino);

// The entry tests of a directory scan, each on `name` in `dirFd` without following a symlink there.

// Milliseconds since the entry was made: its birth time where the file system records it (statx STATX_BTIME:
// ext4, XFS, btrfs), else its last status change. 0 when it cannot be read (gone meanwhile: not old).
int64_t ageMs(int dirFd, const char* name);
inline int64_t ageMs(int dirFd, const std::string& name) { return ageMs(dirFd, name.c_str()); }

// True when `name` is the file `own` describes: the identity check of a file held by fd against what is at its
// name now, after anything else could have moved it.
bool sameEntry(int dirFd, const std::string& name, const struct stat& own);

// True when there is an entry `name` (of any type).
bool entryExists(int dirFd, const std::string& name);

// The target of the symlink `name`; false (errno set) when it is none or longer than PATH_MAX (ENAMETOOLONG).
bool readLink(int dirFd, const std::string& name, std::string* target);

// write(2) until all of `data` is written (EINTR retried).
int writeAll(int fd, const std::string& data);

// pwrite(2) of `len` bytes at `off` until all are written. A write that writes nothing, or answers EAGAIN/EINTR,
// is tried again kWriteTries times in a row, then its errno is returned (EIO for the zero writes): it never loops
// for ever. 0 when all is written.
constexpr int kWriteTries = 4;
int pwriteAll(int fd, const char* buf, size_t len, off_t off);

// The names and d_type of every entry of the directory `dirFd` (without "." and ".."), read through a fresh open
// of "." so the caller's fd keeps its position. Throws the errno of open/opendir/readdir, naming `shown`.
std::vector<std::pair<std::string, unsigned char>> readNames(int dirFd, const std::string& shown);

// readNames one entry at a time (no list: for a directory of any size): calls `each` for every entry but "." and
// "..", in readdir order. Throws as readNames, and whatever `each` throws.
void forEachName(int dirFd, const std::string& shown, const std::function<void(const struct dirent&)>& each);

// A file written under a temp name in `dirFd` and then renamed to its own name by the caller: made with
// O_CREAT|O_EXCL (so the name, random, is ours alone) and `mode`; unlinked when it goes out of scope unless
// published() was called (after the rename: the temp name is gone then). So no failure on the way (a throw, an
// early return) leaves the temp behind. The open's errno is thrown naming `shown`.
class TempFile {
 public:
  TempFile(int dirFd, std::string name, mode_t mode, const std::string& shown);
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile();
  int fd() const { return fd_; }
  const std::string& name() const { return name_; }
  void close();  // the fd only (the data is written); the temp name stays until published or destroyed
  void published() { published_ = true; }

 private:
  int dirFd_;
  std::string name_;
  int fd_ = -1;
  bool published_ = false;
};

}  // namespace vmspace

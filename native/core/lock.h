// Cross-process locks on flock(2), and the atomic file replace of the locked JSON index. flock locks belong to the
// open file description: the kernel releases them when the last fd of it closes (holder exit or SIGKILL
// included), and two opens in one process exclude each other, unlike fcntl(2) record locks.
#pragma once

#include <string>

namespace vmspace {

// Opens (creating, mode 0600) the lock file `path` and tries flock without blocking. Returns the fd (O_CLOEXEC)
// and sets *acquired; when not acquired the fd is still returned, for a wait (lockWaitBlocking). The lock file is
// never deleted: a waiter may hold it open.
int lockOpen(const std::string& path, bool shared, bool* acquired);

// One flock(2) try without blocking: 0 when granted, else the errno (EWOULDBLOCK while another holds it).
int lockTry(int fd, bool shared);

// Blocks in flock(2) until the lock is granted (0) or a signal interrupts the wait (EINTR is returned, so the
// caller can check for cancellation). Any other errno is returned as it is.
int lockWaitBlocking(int fd, bool shared);

// The signal used to interrupt a blocking wait on its dedicated thread (installed once with an empty handler and
// no SA_RESTART, so flock returns EINTR); 0 when no signal could be claimed (the wait then polls).
int lockCancelSignal();

// Reads the whole file; false when it does not exist (ENOENT). Other errors are thrown (EISDIR for a directory).
bool readWholeFile(const std::string& path, std::string* out);

// Replaces `path` atomically with `data`: temp file (O_EXCL, same directory) -> write -> fsync -> rename(2)
// over -> fsync of the directory when `durable`. The temp file never survives a failure.
void replaceFile(const std::string& path, const std::string& data, bool durable);

}  // namespace vmspace

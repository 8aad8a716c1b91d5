// Cross-process locks on flock(2) (the atomic replace of the JSON file kept under one: json_file.h). flock locks
// belong to the open file description: the kernel releases them when the last fd of it closes (holder exit or
// SIGKILL included), and two opens in one process exclude each other, unlike fcntl(2) record locks.
#pragma once

#include <string>

// The JSON-file helpers (readWholeFile, replaceFile, removeIndexTemps) live in json_file.h since issue 11; included
// here for the callers that still name lock.h for them.
#include "json_file.h"

namespace vmspace {

// Opens (creating, mode 0600) the lock file `path` and tries flock without blocking. Returns the fd (O_CLOEXEC)
// and sets *acquired; when not acquired the fd is still returned, for a wait (lockWaitBlocking, then
// lockFollowPath). A lock granted on a file that is no longer at `path` is dropped and the new file is locked
// (lockFollowPath). The lock file is never deleted: a waiter may hold it open (see lockFollowPath).
int lockOpen(const std::string& path, bool shared, bool* acquired);

// Opens the lock file `path` for flock (creating it, mode 0600; read-only where it cannot be created or written):
// the fd, or -1 with *err set to the errno of open(2).
int lockOpenFile(const std::string& path, int* err);

// Called once flock was granted on *fd, which was opened from `path`. A lock file deleted (or renamed over) while
// others wait on it splits the lock: waiters hold the dead inode open, while a newcomer opens and locks the new
// file at `path`, so the old holder's release would grant a waiter alongside the newcomer. Returns 0 when the
// locked inode is still the file at `path` (same device and inode, link count above 0): the lock is good. Returns
// EAGAIN when it is not: *fd is then closed and replaced by a fresh open of `path`, not locked yet, for the caller
// to lock again. Else the errno of fstat/stat/open, with *syscall naming it (*fd is left as it was).
// This is why vmspace never deletes a lock file, on release or anywhere else: a release that unlinked it would
// make exactly this race for every waiter, and the check here cannot help a holder whose file is deleted after it
// was granted (a newcomer then locks the new file alongside it).
int lockFollowPath(const std::string& path, int* fd, const char** syscall);

// One flock(2) try without blocking: 0 when granted, else the errno (EWOULDBLOCK while another holds it).
int lockTry(int fd, bool shared);

// Blocks in flock(2) until the lock is granted (0) or a signal interrupts the wait (EINTR is returned, so the
// caller can check for cancellation). Any other errno is returned as it is.
int lockWaitBlocking(int fd, bool shared);

// The signal used to interrupt a blocking wait on its dedicated thread (installed once with an empty handler and
// no SA_RESTART, so flock returns EINTR); 0 when no signal could be claimed (the wait then polls).
int lockCancelSignal();

}  // namespace vmspace

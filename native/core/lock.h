// Cross-process locks on flock(2) (the atomic replace of the JSON file kept under one: json_file.h). flock locks
// belong to the open file description: the kernel releases them when the last fd of it closes (holder exit or
// SIGKILL included). Two opens in one process exclude each other, so one thread's requests on one file take turns
// in lib (lib/lock-turns.ts) and a second one reaching here would wait on the thread itself: every lock fd is
// registered here (lockClaim), and such a request fails with EDEADLK instead.
#pragma once

#include <string>

// The JSON-file helpers (readWholeFile, replaceFile, removeIndexTemps) live in json_file.h; included here for the
// callers that name lock.h for them.
#include "json_file.h"

namespace vmspace {

// Opens the lock file `path` (with `create`, made if missing, mode 0600; without, ENOENT when missing: an
// updateJsonFile locks the data file itself and never makes it), registers the fd (lockClaim: ERR_LOCK_REENTRANT,
// cause EDEADLK, when the thread `owner` holds or waits for the same file in a way that would wait on itself) and
// tries flock without blocking. Returns the fd (O_CLOEXEC) and sets *acquired; when not acquired the fd is still
// returned, for a wait (lockWaitBlocking, then lockFollowPath). A lock granted on a file that is no longer at
// `path` is dropped and the new file is locked (lockFollowPath). Every fd it returns is closed with lockClose.
int lockOpen(const std::string& path, bool shared, bool* acquired, bool create, long owner);

// Opens the lock file `path` for flock (with `create`, made if missing, mode 0600; read-only where it cannot be
// created or written): the fd, or -1 with *err set to the errno of open(2).
int lockOpenFile(const std::string& path, bool create, int* err);

// The process's lock registry, shared by every thread (worker_threads included). Each lock fd lockOpen made is
// registered, from before its first flock until lockClose, with the file's device and inode (the same file under
// another name is the same file) and the request: shared or not, and `owner` (the requesting thread: lib passes
// threadId + 1). lockClaim refuses with EDEADLK a request that would wait on its own thread: one on a file that
// thread has registered already, except a shared one beside shared ones (flock grants shared beside shared
// whatever waits, so nothing waits on us). Two threads' requests both wait in flock (the kernel orders them as it
// orders two processes). Since lib queues one thread's requests per path, this refuses only the same file under
// two names, or a file replaced by one the thread holds. 0 once registered, else EDEADLK or fstat's errno.
int lockClaim(int fd, bool shared, bool create, long owner);

// Closes a lock fd and drops its registration (every close of an fd lockOpen returned goes through here).
void lockClose(int fd);

// Called once flock was granted on *fd, which was opened from `path`. A lock file deleted (or renamed over) while
// others wait on it splits the lock: waiters hold the dead inode open, while a newcomer opens and locks the new
// file at `path`, so the old holder's release would grant a waiter alongside the newcomer. Returns 0 when the
// locked inode is still the file at `path` (same device and inode, link count above 0): the lock is good. Returns
// EAGAIN when it is not: *fd is then closed and replaced by a fresh open of `path` (registered in its place), not
// locked yet, for the caller to lock again. Else the errno of fstat/stat/open (ENOENT: the file is gone and is not
// to be made), or EDEADLK (syscall "flock") when the new file is one this process holds, with *syscall naming
// it (*fd is left as it was).
// This check cannot help a holder whose file is deleted after it was granted (a newcomer then locks the new file
// alongside it): the JSON index therefore checks again when it writes (json_file.h, replaceFile).
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

// The JSON file kept under a lock (updateJsonFile): read it whole, replace it atomically, clean up the temps of
// writers that died. The lock itself is lock.h's.
#pragma once

#include <string>

namespace vmspace {

// Reads the whole file; false when it does not exist (ENOENT). Other errors are thrown (EISDIR for a directory).
bool readWholeFile(const std::string& path, std::string* out);

// Reads the file open at `fd` (the data file the caller locked), from its start, whole: EISDIR for a directory,
// EINVAL for any other file that is not regular, thrown naming `path`.
void readLockedFile(int fd, const std::string& path, std::string* out);

// Replaces `path`, whose inode the caller holds locked on `lockedFd` (lock.h), by `data`: temp file
// `.<name>.tmp-<12 hex>` (O_EXCL, same directory; the mode and owner of the locked file) -> write -> fsync ->
// flock of the temp -> renameat2(RENAME_EXCHANGE) with `path` -> unlink of the old file, now at the temp name ->
// fsync of the directory when `durable`. Returns false, having written nothing, when `path` no longer names the
// locked inode (it was deleted or replaced by someone who does not take the lock, and whoever locked the new file
// may have written it since): the caller starts over on the file now at `path`. That is checked before the write
// and again by the exchange itself, which hands back what it displaced: anything but the locked inode is
// exchanged back at once. The new file is locked from before it is published until this returns, so no
// newcomer starts on it while the exchange may still be undone. Where the file system refuses RENAME_EXCHANGE
// (EINVAL), rename(2) replaces the file after the check. The temp never survives a failure; the temps of writers
// killed before their rename are removed first (removeIndexTemps).
bool replaceFile(const std::string& path, int lockedFd, const std::string& data, bool durable);

// Publishes `data` as `path`, a file that did not exist: temp file (mode 0666 less the umask) -> write -> fsync
// -> renameat2(RENAME_NOREPLACE) (link(2) where refused) -> fsync of the directory when `durable`. Returns false,
// having written nothing, when a file appeared at `path` meanwhile (or the temp was removed as a dead writer's
// by a holder of that new file): the caller starts over on it. Never replaces anything.
bool createFile(const std::string& path, const std::string& data, bool durable);

// Removes the temp files replaceFile names for the index `leaf` in dirFd (`.<leaf>.tmp-` and exactly 12 lowercase
// hex characters, regular files only; the temps of other names are left alone). Only for the holder of the
// index's lock: writers of an existing file create temps only while holding it, so no live writer owns one (a
// writer creating a missing file holds none, and starts over when its temp goes: createFile). Returns how many it
// removed.
int removeIndexTemps(int dirFd, const std::string& dirPath, const std::string& leaf);

}  // namespace vmspace

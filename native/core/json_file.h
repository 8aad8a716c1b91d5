// The JSON file kept under a lock (updateJsonFile): read it whole, replace it atomically, clean up the temps of
// writers that died. The lock itself is lock.h's.
#pragma once

#include <string>

namespace vmspace {

// Reads the whole file; false when it does not exist (ENOENT). Other errors are thrown (EISDIR for a directory).
bool readWholeFile(const std::string& path, std::string* out);

// Replaces `path` atomically with `data`: temp file `.<name>.tmp-<12 hex>` (O_EXCL, same directory) -> write ->
// fsync -> rename(2) over -> fsync of the directory when `durable`. The temp file never survives a failure; the
// temps of writers killed before their rename are removed first (removeIndexTemps). Only under the index's lock.
void replaceFile(const std::string& path, const std::string& data, bool durable);

// Removes the temp files replaceFile names for the index `leaf` in dirFd (`.<leaf>.tmp-` and exactly 12 lowercase
// hex characters, regular files only; the temps of other names are left alone). Only for the holder of the
// index's lock: writers create temps only while holding it, so no live writer owns one. Returns how many it removed.
int removeIndexTemps(int dirFd, const std::string& dirPath, const std::string& leaf);

}  // namespace vmspace

// Safe recursive removal over directory fds (the rules of systemd's rm-rf.c and Rust's remove_dir_all):
// never follows a symlink (O_NOFOLLOW, unlinkat removes the link itself), never leaves the mount it started on,
// and makes a directory writable where its mode is all that stands in the way.
#pragma once

#include <cstdint>
#include <string>

namespace vmspace {

// Removes the entry `name` in directory `parentFd` and, when it is a directory, everything below it.
// A mount point found below (or at `name` itself) is not entered: removal goes on with its siblings, the
// directories above the mount stay, and EBUSY naming the mount point is thrown at the end. Any other failure
// is thrown the same way (the first one; the rest of the tree is still removed). `displayPath` names
// parentFd/name in errors. ENOENT when `name` does not exist.
// When `bytes` is given, the space the removed entries occupied (st_blocks * 512) is added to it.
// With `keepPools` (a workspace's removal), a directory that is a pool's root (trusted.h, isPoolRoot), `name`
// itself included, is treated as a mount point is: never entered, the rest removed, and ERR_POOL_NESTED (cause
// EBUSY, path: that directory) thrown at the end.
void removeTreeNoFollow(int parentFd, const std::string& name, const std::string& displayPath,
                        uint64_t* bytes = nullptr, bool keepPools = false);

// removeTreeNoFollow for an absolute path: its parent is opened (following the caller's own path as given), the
// last component is never followed. A mount point at `path` itself is EBUSY.
void removeTreeNoFollow(const std::string& path);

}  // namespace vmspace

// Trusted directory opening: who may write a pool, and the opening of its root and of each directory of its own
// (.vmspace/ and below, the template store's too) under that rule. Every check is an fstat of the fd opened
// O_NOFOLLOW that is then used: no path is looked up twice. A directory that fails it is ERR_POOL_UNSAFE.
#pragma once

#include <sys/types.h>

#include <string>

#include "fd.h"

namespace vmspace {

// Who may write the pool: the rule of OpenSSH's safe_path() and systemd's CHASE_SAFE. A directory of the pool, or
// one on the path to it, that another user could write lets that user rename, plant or rewrite workspaces and
// metadata; a symlink another user owns on the path lets them point the pool elsewhere.
struct Trust {
  uid_t euid;
  long long sharedGid;  // -1: none; else members of this group are trusted as the owner is
};

// Throws ERR_POOL_UNSAFE (with the uid, gid and mode found) when the file `fd` is not safe under `t`. `ancestor`:
// a directory above the pool root, where a sticky directory writable by all (/tmp) is fine.
void checkTrusted(int fd, const std::string& shown, const Trust& t, bool ancestor);

// Makes directory `name` below `at` with exactly `mode` (and group `gid` when >= 0), whatever the umask: made
// 0700, so it is never more open than meant, then fchown and fchmod on the fd (chown first: it clears setgid).
// False when it existed already.
bool makeDirExact(int at, const char* name, mode_t mode, long long gid, const std::string& shown);

// Opens directory `name` of the pool below `at` (never following a symlink), made with `mode` (and t.sharedGid)
// when missing and `create`, and checks it. An empty fd when it is missing and not made.
UniqueFd openPoolDir(int at, const char* name, const std::string& shown, bool create, mode_t mode, const Trust& t);

// Opens the directory at the absolute `path` component by component from "/", each with O_PATH|O_NOFOLLOW and
// checked by fstat of that fd. A symlink is followed by hand after its owner is checked; `..` steps to the
// parent, checked again. With `create`, missing directories are made, 0755 (the last one `rootMode`), after the
// directory holding them passed. Returns an O_RDONLY fd of the pool root, itself checked as a pool directory (no
// sticky exception).
UniqueFd openTrustedPath(const std::string& path, bool create, mode_t rootMode, const Trust& t);

// Whether the directory `dirFd` is a pool's root: its `.vmspace/` (a directory) and `.vmspace/version` (a regular
// file reading the layout version) are owned by root or this process's euid, as openPool makes them. A guest
// running under a uid of its own cannot forge that in its workspace; one running as the pool's owner can, and
// its workspace is then refused as a nested pool (reported, never removed: docs/pool-on-disk.md). Never follows
// a symlink and opens nothing but the version file (through its O_PATH fd); any error reads as "not a pool".
bool isPoolRoot(int dirFd);

// ERR_POOL_NESTED (cause EBUSY) when `dirFd` or a directory above it (climbed through "..") is a pool's root: a
// pool made there would sit in that pool's workspace, its .vmspace/ or its trash, where a dispose or sweep
// would remove it. `root` names the pool being opened.
void refuseNestedPool(int dirFd, const std::string& root);

}  // namespace vmspace

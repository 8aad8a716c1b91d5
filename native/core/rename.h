// Atomic renames with the guarantees rename(2) lacks (renameat2(2), Linux 3.15; ext4, XFS, btrfs, tmpfs).
#pragma once

#include <cerrno>
#include <string>

namespace vmspace {

// Moves `from` to `to`; EEXIST when `to` exists (RENAME_NOREPLACE), never replacing it. Where the file system
// refuses the flag (EINVAL/ENOSYS), a non-directory moves by link(2) + unlink(2) (EEXIST as well); a directory
// fails with renameat2's errno.
void renameNoReplace(const std::string& from, const std::string& to);

// Publishes the file `from` in `fromDir` (a temp name of ours) as `to` in `toDir`, never replacing what is there:
// renameat2(RENAME_NOREPLACE), or, where the file system refuses the flag (EINVAL/ENOSYS: FUSE without rename2,
// some network file systems), link(2) then unlink(2) of the temp name, which fails with EEXIST as well. Returns 0
// or the first errno that went wrong (EEXIST: `to` exists, untouched), and sets *syscall to its step. Where the
// temp name cannot be unlinked after the link, the link is undone, so a failure never leaves `to` published.
// For regular files (and symlinks) only: link(2) cannot publish a directory.
int publishFileNoReplace(int fromDir, const char* from, int toDir, const char* to, const char** syscall);

// Whether renameat2 answered `err` because the file system does not take RENAME_NOREPLACE (not "it exists").
inline bool noReplaceUnsupported(int err) { return err == EINVAL || err == ENOSYS; }

// Swaps `a` and `b` atomically (RENAME_EXCHANGE); both must exist (ENOENT otherwise).
void exchange(const std::string& a, const std::string& b);

// Splits an absolute path into its parent directory and last component ("/a/b" -> "/a", "b"; "/a" -> "/", "a").
void splitPath(const std::string& path, std::string* parent, std::string* leaf);

}  // namespace vmspace

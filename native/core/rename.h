// Atomic renames with the guarantees rename(2) lacks (renameat2(2), Linux 3.15; ext4, XFS, btrfs, tmpfs).
#pragma once

#include <string>

namespace vmspace {

// Moves `from` to `to`; EEXIST when `to` exists (RENAME_NOREPLACE), never replacing it.
void renameNoReplace(const std::string& from, const std::string& to);

// Swaps `a` and `b` atomically (RENAME_EXCHANGE); both must exist (ENOENT otherwise).
void exchange(const std::string& a, const std::string& b);

// Splits an absolute path into its parent directory and last component ("/a/b" -> "/a", "b"; "/a" -> "/", "a").
void splitPath(const std::string& path, std::string* parent, std::string* leaf);

}  // namespace vmspace

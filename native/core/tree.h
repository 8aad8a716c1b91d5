// Tree clones: a directory tree recreated entry by entry over directory fds, regular files by reflink (or the
// hole-keeping copy), never following a symlink in the source (O_NOFOLLOW, AT_SYMLINK_NOFOLLOW) nor entering another
// mount (a mount point becomes an empty directory), each file checked unchanged by its copy. The entry points
// that clone a path (a file or a tree) are clone.h's.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "clone.h"
#include "fd.h"

namespace vmspace {

// Clones the contents of the directory `srcPath` into the existing empty directory `dstFd` (a workspace being
// built), whose own metadata is left as it is. The caller removes `dstFd`'s contents on failure.
CloneSummary cloneTreeInto(const std::string& srcPath, int dstFd, const std::string& dstPath,
                           const CloneOptions& options, CloneProgress* progress, SourceIdentity* identity = nullptr);

// With reflink Always, a destination directory `dstDirFd` on another file system than the source (stat `src`) is
// ERR_REFLINK_UNSUPPORTED (cause EXDEV), thrown before anything is written; otherwise nothing.
void checkSameFs(const struct stat& src, int dstDirFd, const CloneOptions& opts, const std::string& srcPath,
                 const std::string& dstPath);

// Opens the source directory `srcPath` of a tree clone (O_DIRECTORY; a symlink given as the source itself is
// followed), fills *st and `identity` from it; with reflink Always, a destination `dstDirFd` on another file
// system is ERR_REFLINK_UNSUPPORTED (cause EXDEV) before anything is written.
UniqueFd openSourceDir(const std::string& srcPath, int dstDirFd, const std::string& dstPath,
                       const CloneOptions& options, SourceIdentity* identity, struct stat* st);

// Clones the contents of the source directory `srcFd` (stat `st`) into the new empty directory `dstFd`, then gives
// `dstFd` the source's owner, xattrs, mode and times (the root of a tree clone: clonePathAt).
CloneSummary cloneTreeAs(int srcFd, const struct stat& st, int dstFd, const std::string& srcPath,
                         const std::string& dstPath, const CloneOptions& options, CloneProgress* progress);

}  // namespace vmspace

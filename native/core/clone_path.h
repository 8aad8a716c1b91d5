// The path entry points of a clone: a source given by its path (or beneath a workspace's fd), opened once and cloned
// as a file or, through tree.h, as a tree, built under a temp name and published whole. Above clone.h (the data) and
// tree.h (the walk), which never include it.
#pragma once

#include <string>

#include "clone.h"

namespace vmspace {

// Clones `srcPath` (a regular file or a directory; a symlink given as the source itself is followed, as cp
// does) to `dstName` in `dstDirFd`. The source is opened once, and file or tree chosen from its fstat (a source
// that cannot be opened: the errno of "open", path and dest). Built under a temp name and published with
// renameat2(RENAME_NOREPLACE) (with `overwrite`: rename(2) for a file, RENAME_EXCHANGE and removal of the old tree for
// a directory). On any failure, or on cancel (ECANCELED), the temp tree is removed and the error names the entry that
// failed (path: the source entry, dest: its destination). With reflink Always, a source on another file system than the
// destination fails (ERR_REFLINK_UNSUPPORTED, cause EXDEV) before anything is written.
// Kept: mode incl. setuid/setgid/sticky, owner and group (where permitted), atime/mtime in ns, xattrs
// (incl. security.capability, set after chown, which clears it); directory metadata is set after its contents.
// A tree never enters another mount (mount id, statx.h's mountOf): a mount point becomes an empty directory with the
// metadata seen at it, as cp -x makes it. A regular file that changed while it was cloned is ERR_SOURCE_CHANGED (a
// file source: its fstat before and after the data; a tree entry: the walk's fstatat of its name and the open fd's
// fstat after the data); a source neither regular nor a directory is ERR_SOURCE_TYPE. `identity`: a file source's
// stat after its data was cloned, a tree's root directory as opened.
CloneSummary clonePathAt(const std::string& srcPath, int dstDirFd, const std::string& dstName,
                         const std::string& dstPath, const CloneOptions& options, CloneProgress* progress,
                         SourceIdentity* identity = nullptr);

// clonePathAt for an absolute destination path; its parent directory must exist (ENOENT otherwise).
CloneSummary clonePath(const std::string& srcPath, const std::string& dstPath, const CloneOptions& options,
                       CloneProgress* progress);

// clonePathAt for `rel`, a normalised relative path resolved beneath the directory `baseFd` (a workspace's lease
// fd): no symlink on the way is followed, and the last component is only ever replaced by rename, so nothing
// planted in the workspace can redirect the write outside it. Its parent directory must exist.
CloneSummary clonePathBeneath(const std::string& srcPath, int baseFd, const std::string& basePath,
                              const std::string& rel, const CloneOptions& options, CloneProgress* progress);

// Clones `rel`, a normalised relative path resolved beneath the directory `baseFd` (a workspace, whose entries are
// the guest's: hostile), out to the absolute `dstPath` (its parent must exist), as clonePathAt does. No symlink on
// the way is followed (ENOTDIR; a symlink as the leaf: ELOOP), so a guest's link to a host file copies nothing; a
// device node, fifo or socket is ERR_SOURCE_TYPE before it is ever opened. Nothing is written at `dstPath` on
// any failure. Reopening the checked entry needs /proc (ENOENT, syscall open, without it).
CloneSummary cloneOutBeneath(int baseFd, const std::string& basePath, const std::string& rel,
                             const std::string& dstPath, const CloneOptions& options, CloneProgress* progress);

}  // namespace vmspace

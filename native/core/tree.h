// Tree clones: a directory tree recreated entry by entry over directory fds, regular files by reflink (or the
// hole-keeping copy), never following a symlink in the source (O_NOFOLLOW, AT_SYMLINK_NOFOLLOW).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "clone.h"

namespace vmspace {

// Shared between the thread that walks and the JS thread that polls it (every 100 ms at most) or cancels it.
struct CloneProgress {
  std::atomic<uint64_t> files{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<bool> cancel{false};  // checked between entries: the clone stops with ECANCELED and rolls back
};

struct CloneSummary {
  bool tree = false;
  uint64_t files = 0;      // regular files (hard links counted once)
  uint64_t bytes = 0;      // their logical bytes
  uint64_t reflinked = 0;  // regular files whose extents are shared with the source
  uint64_t copied = 0;     // regular files copied (reflink refused, or 'never')
  uint64_t dirs = 0, symlinks = 0, hardlinks = 0, fifos = 0, devices = 0;
  uint64_t skippedSockets = 0;  // sockets cannot be recreated meaningfully
  uint64_t skippedDevices = 0;  // device nodes where mknod is not permitted (not root)
  bool snapshot = false;  // a btrfs subvolume snapshot made the tree (issue 14): no walk, the counts stay 0
};

// "snapshot" (a btrfs subvolume snapshot), "reflink", "copy" or "mixed" (both happened); a clone without regular files says what `reflink` asked for.
const char* methodName(const CloneSummary& s, Reflink reflink);

// Clones `srcPath` (a regular file or a directory; a symlink given as the source itself is followed, as cp
// does) to `dstName` in `dstDirFd`. Built under a temp name and published with renameat2(RENAME_NOREPLACE)
// (with `overwrite`: rename(2) for a file, RENAME_EXCHANGE and removal of the old tree for a directory). On any
// failure, or on cancel (ECANCELED), the temp tree is removed and the error names the entry that failed (path:
// the source entry, dest: its destination). With reflink Always, a source on another file system than the
// destination fails (ERR_REFLINK_UNSUPPORTED, cause EXDEV) before anything is written.
// Kept: mode incl. setuid/setgid/sticky, owner and group (where permitted), atime/mtime in ns, xattrs
// (incl. security.capability, set after chown, which clears it); directory metadata is set after its contents.
CloneSummary clonePathAt(const std::string& srcPath, int dstDirFd, const std::string& dstName,
                         const std::string& dstPath, const CloneOptions& options, CloneProgress* progress,
                         SourceIdentity* identity = nullptr);

// Clones the contents of the directory `srcPath` into the existing empty directory `dstFd` (a workspace being
// built), whose own metadata is left as it is. The caller removes `dstFd`'s contents on failure.
CloneSummary cloneTreeInto(const std::string& srcPath, int dstFd, const std::string& dstPath,
                           const CloneOptions& options, CloneProgress* progress, SourceIdentity* identity = nullptr);

// clonePathAt for an absolute destination path; its parent directory must exist (ENOENT otherwise).
CloneSummary clonePath(const std::string& srcPath, const std::string& dstPath, const CloneOptions& options,
                       CloneProgress* progress);

// clonePathAt for `rel`, a normalised relative path resolved beneath the directory `baseFd` (a workspace's lease
// fd): no symlink on the way is followed, and the last component is only ever replaced by rename, so nothing
// planted in the workspace can redirect the write outside it. Its parent directory must exist.
CloneSummary clonePathBeneath(const std::string& srcPath, int baseFd, const std::string& basePath,
                              const std::string& rel, const CloneOptions& options, CloneProgress* progress);

}  // namespace vmspace

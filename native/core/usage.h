// Space accounting of a workspace: what it occupies, what of that only it holds, and what it shares
// with other files (reflinked template extents), learnt from FIEMAP_EXTENT_SHARED per extent.
// Cost: one walk of the tree (an fstatat per entry, one or more FIEMAP per regular file); fds bounded whatever the
// depth; cancellable between entries.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "quota.h"

namespace vmspace {

struct UsageReport {
  uint64_t allocatedBytes = 0;               // st_blocks * 512 of every entry (hard links once)
  uint64_t exclusiveBytes = 0;               // data extents only this workspace's files reference (delalloc included)
  uint64_t sharedBytes = 0;                  // FIEMAP_EXTENT_SHARED extents, and files linked outside the walk
  uint64_t logicalBytes = 0;                 // st_size of regular files
  uint64_t files = 0, dirs = 0, others = 0;  // regular files, directories below the root, everything else
  QuotaUsage quota;
};

// Walks the workspace directory `wsFd` (never following a symlink, never entering another mount). `cancel`
// (optional) stops it with ECANCELED. `ref`: its quota, whose limits and use are added.
// The bytes of the regular file `fd` that no other file shares (its extents not flagged FIEMAP_EXTENT_SHARED): what
// the file system gets back when it is removed.
uint64_t exclusiveBytesOfFile(int fd, const std::string& shown);

UsageReport workspaceUsage(int wsFd, const std::string& shown, const QuotaRef& ref, const std::atomic<bool>* cancel);

}  // namespace vmspace

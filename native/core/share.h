// Shared files of a template (share.cc): read-only files every workspace made from the template holds as a hard
// link of one inode. A commit opens them in the workspace (openShareSources) and links or clones each into
// staging/<id>/shared/<n> (writeSharedFiles); an allocate links each shared/<n> at its path in the new tree
// (linkSharedFiles). The paths, in index order, are the template's `shared-paths` (NUL after each), the core's own
// copy of template.json's "shared" (which lib/ reads). No N-API here.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <vector>

#include "clone.h"
#include "fd.h"

namespace vmspace {

constexpr size_t kMaxSharedFiles = 64;

// One file a commit shares: its workspace-relative path, an O_PATH descriptor of the inode found there (reached
// without a symlink), and that inode's stat.
struct ShareSource {
  std::string path;
  UniqueFd fd;
  struct stat st {};
  bool inherited = false;  // the parent template's shared inode at this same path: linked, no data read
};

// The shared files of a commit of the workspace directory `wsFd` (shown as `wsPath`): each of `share` (checked by
// lib/ for shape), then each path the parent template shared (its directory `parentFd`, -1 for none) whose file in
// the workspace is still the parent's inode. A path of `share` that is missing is ENOENT; not a regular file, a
// symlink on the way, or on another mount is ERR_INVALID_ARG_VALUE naming it. Nothing is made.
std::vector<ShareSource> openShareSources(int wsFd, const std::string& wsPath, const std::vector<std::string>& share,
                                          int parentFd, const std::string& parentPath);

// Makes shared/ below the staging entry `leaseFd` (shown as `stagingPath`) with shared/<n> for each source: the
// same inode where it is inherited, else its data cloned once (reflink where the pool reflinks, else copied) into a
// new file made read-only (0444, owned by kLeaseUid when root makes it). Returns the bytes of each.
std::vector<uint64_t> writeSharedFiles(int leaseFd, const std::string& stagingPath, std::vector<ShareSource>& sources,
                                       const CloneOptions& options);

// The paths of the template `templateFd` (shown as `shown`) shares, in index order; none without shared-paths.
std::vector<std::string> readSharedPaths(int templateFd, const std::string& shown);

// Links shared/<n> of the template `templateFd` at paths[n] below the new workspace `wsFd` (its parents are in the
// tree cloned there). EXDEV (another subvolume, another project id) is ERR_SHARE_UNSUPPORTED naming the path.
void linkSharedFiles(int templateFd, const std::string& templatePath, const std::vector<std::string>& paths, int wsFd,
                     const std::string& wsPath);

// ERR_SHARE_UNSUPPORTED (cause EXDEV) for the shared file `path`: `why` says where.
[[noreturn]] void throwShareUnsupported(const std::string& path, const std::string& why);

}  // namespace vmspace

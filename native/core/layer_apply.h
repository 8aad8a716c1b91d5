// The layer applier: one image layer (an uncompressed tar stream, read from an fd to its end) applied to a tree
// of our own in staging, per the OCI image spec's layer rules (image-spec layer.md: changesets, whiteouts, opaque
// directories). The tar is hostile input: every name, link target and whiteout is resolved beneath the tree's root
// (openat2 RESOLVE_IN_ROOT, or a component walk that never follows a symlink out), never outside it. No N-API here.
#pragma once

#include <cstdint>
#include <string>

#include "clone.h"

namespace vmspace {

struct LayerApplyOptions {
  bool durable = false;               // each regular file fsynced, and the tree's directories at the end
  CloneProgress* progress = nullptr;  // bytes: the tar's bytes read; files: entries applied; cancel: ECANCELED
  uint64_t minFreeBytes = 0;          // the pool's floor: ENOSPC (syscall 'statvfs') once the file system has less free
};

struct LayerApplyResult {
  uint64_t entries = 0;    // tar entries applied (whiteouts included, PAX and GNU long-name headers not)
  uint64_t bytes = 0;      // the tar stream's bytes read
  uint64_t whiteouts = 0;  // `.wh.` entries and opaque markers applied
};

// Applies the tar stream read from `fd` (read until EOF; the caller closes it) to the directory `rootFd` (our own
// build's tree, shown as `rootPath`). Errors (the message names the entry; `path` is the entry's name):
// ERR_LAYER_UNSAFE (a name or link reaching outside the root, `..` components, an absolute name, a hard link to a
// missing entry or a directory, a malformed whiteout), ERR_LAYER_INVALID (not a tar this reads: bad checksum,
// truncated, an unsupported entry type, a number or size out of range), ERR_OCI_NOT_PERMITTED (cause EPERM: chown,
// mknod or a security.* xattr refused), ECANCELED (progress->cancel), or the first errno of a system call. A
// failure leaves the tree partly applied: the caller abandons it.
LayerApplyResult applyLayer(int fd, int rootFd, const std::string& rootPath, const LayerApplyOptions& options);

}  // namespace vmspace

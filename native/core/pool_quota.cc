// The pool's side of quotas and space accounting (the kernel side is quota.cc, the walk usage.cc):
// removal that releases a workspace's quota, the project id claims in .vmspace/projects/, per-workspace usage.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <ctime>

#include "btrfs_subvol.h"
#include "error.h"
#include "fs_kind.h"
#include "io.h"
#include "pool.h"
#include "remove.h"

namespace vmspace {

int Pool::projectsFd(bool create) {
  std::lock_guard<std::mutex> lock(projectsMu_);
  if (projectsFd_) return projectsFd_.get();
  UniqueFd fd(openat(stateFd_.get(), layout::kProjects, kDirFlags));
  if (!fd && errno == ENOENT && create) {
    if (mkdirat(stateFd_.get(), layout::kProjects, 0700) != 0 && errno != EEXIST)
      throwErrno(errno, "mkdir", layout::statePath(root_, layout::kProjects));
    fd.reset(openat(stateFd_.get(), layout::kProjects, kDirFlags));
  }
  if (!fd) {
    if (errno == ENOENT && !create) return -1;
    throwErrno(errno, "open", layout::statePath(root_, layout::kProjects));
  }
  projectsFd_ = std::move(fd);
  return projectsFd_.get();
}

int Pool::claimsIfAny() {
  int kind = projectFs_.load(std::memory_order_relaxed);
  if (kind < 0) {
    // Unknown (fstatfs failed): claims may exist, looked for as on XFS and ext4.
    FsKind fs = fsKindOf(rootFd_.get());
    kind = fs == FsKind::Unknown || hasProjectQuotas(fs);
    projectFs_.store(kind, std::memory_order_relaxed);
  }
  if (!kind) return -1;
  try {
    return projectsFd(false);
  } catch (const Error&) {
    return -1;  // unreadable: no claim can be released through it now; a later sweep retries
  }
}

void Pool::removeWorkspace(int parentFd, const std::string& name, const std::string& shown, uint64_t* bytes) {
  int claims = claimsIfAny();
  QuotaRef ref = quotaRefOf(parentFd, name, projectIds_, claims >= 0);
  // A template moved into trash (template-<id>, by a removal that did not finish) keeps its tree as a
  // read-only btrfs subvolume, which the walk could not empty (EROFS): destroyed or made writable first.
  const bool trashedTemplate = layout::hasPrefix(name, layout::kTrashedTemplatePrefix);
  if (trashedTemplate) {
    UniqueFd dir(openat(parentFd, name.c_str(), kDirFlags));
    if (dir) dropReadOnlySubvolume(dir.get(), layout::kTree);
  }
  try {
    // A pool found inside a workspace is not the workspace's to remove (a template's tree holds no live pool).
    removeTreeNoFollow(parentFd, name, shown, bytes, !trashedTemplate);
  } catch (const Error& e) {
    // The walk emptied the subvolume and only its rmdir(2) was refused (kernels before 4.18, or a mount that
    // refuses it): delete the empty subvolume by ioctl instead. Anything else (EBUSY at a mount inside) stands.
    bool emptied = ref.subvolId && e.code.empty() && e.syscall == "rmdir" && e.path == shown &&
                   (e.err == EPERM || e.err == EINVAL);
    if (!emptied || destroySubvolume(parentFd, name) != 0) throw;
  }
  releaseQuota(rootFd_.get(), ref, claims, name);
}

void Pool::sweepProjectClaims(bool dryRun, int64_t graceMs) {
  int claims = claimsIfAny();
  if (claims < 0 || dryRun) return;
  std::vector<std::string> files;
  try {
    forEachName(claims, layout::statePath(root_, layout::kProjects), [&files](const struct dirent& de) {
      if (de.d_name[0] >= '0' && de.d_name[0] <= '9') files.push_back(de.d_name);
    });
  } catch (const Error&) {
    // Quietly: claims that cannot be listed (or the rest of them, after a failed readdir) wait for a later sweep.
  }
  for (const std::string& file : files) {
    std::string owner;
    if (readRegularFileAt(claims, file.c_str(), O_NOFOLLOW, 4096, &owner) != 0) continue;
    while (!owner.empty() && owner.back() == '\n') owner.pop_back();
    if (owner.empty() || owner.find('/') != std::string::npos || owner[0] == '.') continue;
    // Staging, then root, then trash: the order a workspace moves in, so one moving meanwhile is never missed.
    struct stat st;
    if (inStaging(owner) || fstatat(rootFd_.get(), owner.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 ||
        fstatat(trashFd_.get(), owner.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0)
      continue;
    if (ageMs(claims, file) < graceMs) continue;
    QuotaRef ref;
    ref.projectId = static_cast<uint32_t>(strtoul(file.c_str(), nullptr, 10));
    releaseQuota(rootFd_.get(), ref, claims, owner);
  }
}

UsageReport Pool::usage(const std::string& name, const std::atomic<bool>* cancel) {
  UniqueFd fd(openat(rootFd_.get(), name.c_str(), kDirFlags));
  if (!fd) throwErrno(errno == ENOTDIR || errno == ELOOP ? ENOENT : errno, "open", path(name));
  QuotaRef ref = quotaRefOf(rootFd_.get(), name, projectIds_, claimsIfAny() >= 0);
  return workspaceUsage(fd.get(), path(name), ref, cancel);
}

}  // namespace vmspace

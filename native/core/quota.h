// Per-workspace disk quotas enforced by the kernel, and the free-space floor.
//   btrfs: the workspace is a subvolume (btrfs_subvol.h) whose qgroup 0/<subvolume id> gets an exclusive-
//          bytes limit (BTRFS_IOC_QGROUP_LIMIT). Quotas must be enabled on the file system (`btrfs quota enable`).
//   XFS (prjquota) and ext4 (project,quota; prjquota): a project id, claimed in the pool, set on the workspace
//          directory with FS_XFLAG_PROJINHERIT before anything is made in it (FS_IOC_FSSETXATTR), limits set with
//          quotactl_fd(2) (Linux 5.14).
// Elsewhere a quota is refused (ERR_QUOTA_UNSUPPORTED), never silently dropped.
#pragma once

#include <cstdint>
#include <string>

namespace vmspace {

// Limits asked for one workspace; 0: no limit of that kind.
struct QuotaLimits {
  uint64_t bytes = 0;
  uint64_t inodes = 0;
  bool any() const { return bytes || inodes; }
};

enum class QuotaBackend { None, Btrfs, Project };

// What the file system of a directory can enforce. `err` 0: quotas work (backend says how); else the errno behind
// the refusal (ENOTCONN: btrfs quotas not enabled; EPERM: no CAP_SYS_ADMIN; ESRCH: project quota not on; ENOSYS:
// no quota support or no quotactl_fd; EOPNOTSUPP: a file system without either) and `detail` says it in words.
struct QuotaSupport {
  QuotaBackend backend = QuotaBackend::None;
  int err = EOPNOTSUPP;
  std::string detail;
  bool inodes = false;  // the backend limits inodes too (project quotas do, btrfs qgroups do not)
};
QuotaSupport probeQuota(int dirFd);
// probeQuota of the directory at `path` (followed as given); throws the errno of opening it.
QuotaSupport probeQuotaAt(const std::string& path);

// Enables quotas on the btrfs mounted at `path` (BTRFS_IOC_QUOTA_CTL): simple quotas when `simple` (Linux 6.7),
// else qgroups. Returns 0 or the errno (EINVAL: the kernel has no simple quotas; ENOTTY: not btrfs; EPERM).
// Throws the errno of opening `path`.
int enableBtrfsQuota(const std::string& path, bool simple);

// Project ids a pool may claim: [first, last], both > 0 (id 0 is every file's default project).
struct ProjectIdRange {
  uint32_t first = 0x40000000;
  uint32_t last = 0x4fffffff;
};

// A workspace's quota as the kernel knows it: the subvolume's qgroup or the project id (0: none).
struct QuotaRef {
  uint64_t subvolId = 0;
  uint32_t projectId = 0;
};

// Applies `limits` to the freshly made, still empty workspace directory `wsFd` (its name `shown`), on the backend
// of `support` (probeQuota of the pool). Project ids are claimed in `claimDirFd` (.vmspace/projects/, one file per
// id made O_EXCL: the claim, naming workspace `name`) from `range`. Throws ERR_QUOTA_UNSUPPORTED (cause: the errno)
// when the kernel refuses, ERR_PROJECT_IDS_EXHAUSTED when no id of the range is free. On failure nothing of the
// quota is left (a claim made is released); the caller removes the directory.
QuotaRef applyQuota(int wsFd, const std::string& shown, const QuotaSupport& support, const QuotaLimits& limits,
                    int claimDirFd, const ProjectIdRange& range, const std::string& name);

// The claim of project `id` now names workspace `name` (a build that drew a fresh name at publish). Never throws.
void renameProjectClaim(int claimDirFd, uint32_t id, const std::string& name);

// The quota of the workspace directory `name` in `parentFd` (not followed if a symlink): its subvolume id when it
// is a btrfs subvolume root, its project id when `projects` (the pool has claims) and that id is in `range`.
// Never throws (an empty ref).
QuotaRef quotaRefOf(int parentFd, const std::string& name, const ProjectIdRange& range, bool projects);

// After the workspace of `ref` was removed: drops the stale qgroup (btrfs; EBUSY/ENOENT are fine: kernels since 6.8
// drop it themselves once the subvolume is cleaned), or resets the project's limits and releases its claim (only
// when the claim names `name`). `fsFd`: any fd on the file system. Never throws: what is left, a sweep retries.
void releaseQuota(int fsFd, const QuotaRef& ref, int claimDirFd, const std::string& name);

// The quota's limits and use (bytes: exclusive bytes on btrfs, blocks charged on project quotas; 0 limit: none).
struct QuotaUsage {
  bool set = false;
  uint64_t limitBytes = 0, limitInodes = 0, usedBytes = 0, usedInodes = 0;
};
QuotaUsage quotaUsageOf(int wsFd, const QuotaRef& ref);

// Space of the file system of `fd`: bytes available to unprivileged users (f_bavail), free (f_bfree), total.
struct FsSpace {
  uint64_t available = 0, free = 0, total = 0;
};
FsSpace fsSpace(int fd, const std::string& shown);

}  // namespace vmspace

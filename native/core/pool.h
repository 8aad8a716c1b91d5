// A pool of workspaces under one root directory (DESIGN.md, "The pool on disk"; every name of it is layout.h's):
//   <root>/.vmspace/{version, staging/s0..s7/, trash/, leases/0..f/<name>, cache/}, and <root>/<prefix>-<32 hex> per
//   workspace. A workspace is vmspace's own only while its lease file exists (lease.h): made before its directory,
//   removed after it; anything else in the root is foreign and never touched.
// Thread-safe: a Pool's fds are opened once and only read by concurrent operations; close() is called by the
// owner once no operation is running.
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "clone.h"
#include "error.h"
#include "fd.h"
#include "json_members.h"
#include "layout.h"
#include "lease.h"
#include "metadata.h"
#include "quota.h"
#include "sweep_report.h"
#include "template.h"
#include "template_cache.h"
#include "usage.h"

namespace vmspace {

constexpr int kMaxNameTries = 16;  // DESIGN.md: EEXIST -> fresh name, at most 16 tries, then ERR_NAME_EXHAUSTED
// Builds run in staging/s<i>/ (i fixed per thread) so that parallel builds do not all wait on one directory's lock.
constexpr int kStagingShards = 8;

struct TemplateEntry {
  std::string dest;    // workspace-relative, normalised (checked by the caller)
  std::string source;  // absolute path of a regular file or a directory
};

struct AllocateRequest {
  std::string prefix;       // checked by the caller (lib/pool.ts PREFIX): [A-Za-z0-9][A-Za-z0-9_-]{0,63}, mixed case
  mode_t mode = 0700;       // of the workspace directory, less the umask (as mkdir(2))
  std::string templateDir;  // a directory whose contents become the workspace's contents (empty: none)
  std::vector<TemplateEntry> entries;  // and/or single sources cloned to workspace-relative paths
  CloneProgress* progress = nullptr;   // running totals, and cancel (ECANCELED, rolled back)
  JsonMembers info;                    // the caller's members of the metadata record (the name and template are added)
  CloneOptions clone;                  // reflink and durable apply to every template entry; overwrite is ignored
  std::string fromTemplate;            // the id or name of a committed template cloned first ("" none)
  QuotaLimits quota;  // quota.cc: a kernel-enforced limit of the workspace's own (none when !quota.any())
};

struct AllocateResult {
  std::string id, name;
  int leaseFd = -1;  // the owner's fd of the lease file (O_RDWR, close-on-exec), holding LeaseByte::Owner
  int retries = 0;   // names drawn again: the one drawn existed
  std::vector<ClonedEntry> clones;
  std::string templateId, templateRecord;  // the template cloned (fromTemplate) and its template.json
};

// What the caller knows of a workspace it disposes, from its allocation by this process (each saves a syscall on
// every dispose). claim false: it was made without a quota, so it holds no project id claim and
// .vmspace/projects/ is not probed. Default: unknown (adopted workspaces). A claim there anyway (never made by
// vmspace for such a workspace) would be an orphan for a sweep.
struct DisposeHints {
  bool claim = true;
};

// A workspace built in .vmspace/staging/s<shard>/<name> under its lease, not yet published (Pool::stage). To a
// sweep it is a build in progress for as long as the lease is held, and a dead build once it is free.
struct StagedWorkspace {
  std::string id, name;  // name: of the staging entry and its lease, and the one it is published under
  UniqueFd lease;
  int retries = 0;
  int draws = 0;  // names drawn so far: publish counts on from here towards ERR_NAME_EXHAUSTED
  std::vector<ClonedEntry> clones;
  std::string templateId, templateRecord;  // as in AllocateResult
  QuotaRef quota;                          // quota.cc: its project id claim follows the name at publish
  int shard = -1;                          // built in staging/s<shard>/; -1: made at its name in the root already
};

struct ListEntry {
  std::string name;
  bool live = false;
  std::string record;  // its record (the lease file's) when recordErrno == 0
  int recordErrno = 0;
  int probeErrno = 0;                               // the lease probe failed with this: liveness undecided, `live` set
  const char* probeSyscall = "fcntl(F_OFD_GETLK)";  // of probeErrno: "open" of the lease file, or the probe
};

struct AdoptResult {
  int leaseFd = -1;
  std::string record;
  int recordErrno = 0;
};

class Pool {
 public:
  // Opens (with `create`, makes) the pool at `root`, an absolute path. Every directory on the path and of the
  // pool is checked before it is used (checkTrusted in trusted.cc): ERR_POOL_UNSAFE (path, uid, gid, mode set)
  // when another user could write it, nothing made. `sharedGid` >= 0 trusts that group: directories of that
  // group may be group-writable (and owned by any user); those made are given it, mode 02770. Directories made
  // get exact modes whatever the umask: 0755 (root, .vmspace/, parents), 0700 (staging/, trash/, leases/).
  // A new pool's .vmspace/ is built whole under a temp name and renamed into place (RENAME_NOREPLACE), so
  // concurrent first opens make one pool and none ever sees it half made; made only in an empty (or missing)
  // directory unless `nonEmpty` (ERR_POOL_NOT_EMPTY, nothing made).
  // Errors: the errno of the failing syscall; ERR_POOL_FORMAT when .vmspace/version is not layout::kVersionText or one
  // of the pool's own directories is missing (never made again: a pool that lost them is not re-initialised);
  // EXDEV when .vmspace is on another file system. A file system without RENAME_NOREPLACE (FUSE, some network
  // file systems) opens, and its allocate fails with ERR_RENAME_NOREPLACE_UNSUPPORTED (cause EINVAL/ENOSYS).
  static std::shared_ptr<Pool> open(const std::string& root, bool create, long long sharedGid = -1,
                                    bool nonEmpty = false);

  // Builds a workspace in staging, takes its lease, clones the template, writes metadata, publishes it.
  // Any failure removes everything it made and throws. ERR_NAME_EXHAUSTED after kMaxNameTries collisions.
  AllocateResult allocate(const AllocateRequest& request);

  // allocate() in two steps, so that the slow one can run ahead of time (a warm reserve): stage() builds and
  // leases the workspace in staging (any failure removes it and throws); publish() writes its metadata
  // (`info`, as AllocateRequest::info; `options` as the build's) and renames it into the root; on
  // failure it removes the staged workspace and throws. discard() removes a staged workspace that will not be
  // published, then drops its lease.
  StagedWorkspace stage(const AllocateRequest& request);
  AllocateResult publish(StagedWorkspace&& staged, const JsonMembers& info, const CloneOptions& options);
  void discard(StagedWorkspace&& staged);

  // Removes workspace `name` (rmdir at its name, or moved into trash and removed safely), then its lease file;
  // closes `leaseFd` and `handoverFd` (-1: none). When another open file description holds the lease (a child
  // given the handover fd), nothing is removed, the fds are closed and ERR_LEASE_HELD is thrown: the workspace is
  // its holder's, and a sweep's once it is free. The fds are closed on every path, so that a sweep can finish
  // what a failed removal left in trash.
  void dispose(const std::string& name, int leaseFd, int handoverFd, DisposeHints hints = {});

  // Takes over the published workspace `name` whose lease is free: ENOENT when there is none (or it is not
  // vmspace's: no lease file), ERR_LEASE_HELD while any process holds its lease.
  AdoptResult adopt(const std::string& name);

  // A new open file description of the lease of workspace `name` (owned through `leaseFd`), read-only and
  // close-on-exec, holding LeaseByte::Handover: what a caller hands to the sandbox's process.
  int openHandover(const std::string& name, int leaseFd);

  // Whether an open file description other than `leaseFd`'s (a child given the handover fd) holds the lease of
  // workspace `name` (F_OFD_GETLK); throws the errno when the kernel cannot tell.
  bool leaseHandedOver(const std::string& name, int leaseFd);

  // The published workspace `name`'s directory (O_DIRECTORY|O_NOFOLLOW), for clones into it.
  UniqueFd openWorkspaceDir(const std::string& name);

  // Reclaims what no live process holds: workspaces (published, in staging or in trash) whose lease is free, lease
  // files whose workspace is gone, templates as TemplateStore::sweep. Only what has a lease file: an entry named
  // like a workspace without one is reported in `foreign` and left. A lease is probed without taking it
  // (F_OFD_GETLK), and a free one is taken (flock LOCK_EX|LOCK_NB) for as long as it is removed. `graceMs` applies
  // to what has no lease (temp files, half-built templates and pools).
  SweepReport sweep(bool dryRun, int64_t graceMs);

  // Published workspaces (every <prefix>-<32 hex> directory of the root with a lease file), with liveness and
  // their record.
  std::vector<ListEntry> list();

  // ---- quotas and space (quota.h, usage.h) ----
  // Set once, right after open and before any operation: allocate refuses (ENOSPC, nothing made) while the file
  // system has less than `minFreeBytes` available; project ids are claimed from `projectIds`.
  void setSpaceConfig(uint64_t minFreeBytes, ProjectIdRange projectIds) {
    minFreeBytes_ = minFreeBytes;
    projectIds_ = projectIds;
  }
  uint64_t minFreeBytes() const { return minFreeBytes_; }
  // The template cache (template_cache.h): `enabled` false clones every source as it is (a copy per workspace
  // where it is on another file system); `maxBytes` is what a sweep keeps of it. Set once, right after open.
  void setCacheConfig(bool enabled, uint64_t maxBytes) {
    cacheEnabled_ = enabled;
    cache_->setMaxBytes(maxBytes);
  }
  // The cache single-file sources are cloned through; nullptr when disabled.
  TemplateCache* templateCache() { return cacheEnabled_ ? cache_.get() : nullptr; }
  // Space accounting of the published workspace `name` (ENOENT when there is none); `cancel` stops it.
  UsageReport usage(const std::string& name, const std::atomic<bool>* cancel);
  FsSpace space() { return fsSpace(rootFd_.get(), root_); }
  QuotaSupport quotaSupport() { return probeQuota(rootFd_.get()); }

  void close();
  const std::string& root() const { return root_; }
  // The pool's templates (.vmspace/templates/, made on first use with `create`); nullptr when the
  // pool has none and `create` is false.
  TemplateStore* templates(bool create);
  // The lease file of workspace `name`, as errors show it (it holds the workspace's record).
  std::string leasePath(const std::string& name) const { return layout::leasePath(root_, name); }

 private:
  friend class PoolSweep;     // pool_sweep.cc: Pool::sweep's passes
  friend class PoolStage;     // pool_publish.cc: Pool::stage's phases
  friend class PoolPublish;   // pool_publish.cc: Pool::publish's phases
  friend class PoolRollback;  // rollback.cc: rollbackWorkspace's phases
  Pool() = default;
  std::string path(const std::string& name) const { return root_ + "/" + name; }
  // Moves the published `name` into trash; false when it is no longer in the root. Verifies that what moved is
  // the directory that was at the name, and puts anything else back.
  bool moveToTrash(const std::string& name);
  // The lease file of `name` relative to leases/ ("<x>/<name>").
  static std::string leaseRel(const std::string& name) { return layout::leaseRel(name); }
  // fsync of the shard of leases/ that holds the lease file of `name` (durable pools).
  void syncLeaseDir(const std::string& name);
  // Spare lease files (this process's, still locked, at leases/<x>/.spare-<hex>): a lease file whose workspace was
  // disposed here is kept for the next empty allocate, which renames it to its new name instead of making and
  // later unlinking an inode of its own (on XFS that inode's allocation and free halved the pairs per second of the
  // bare sequence). Only lease files no other process ever had an fd of (never handed over) are kept.
  struct Spare {
    UniqueFd fd;
    std::string rel;  // its name below leases/
  };
  static constexpr size_t kMaxSpares = 32;  // fds held for them, at most, per pool
  // Keeps the lease `fd` of the disposed workspace `name` as a spare; false (nothing done) when there is no room.
  bool keepSpare(const std::string& name, int fd);
  // A spare renamed to the lease file of `name` and given `record`: its fd, or -1 when there is none (or it could
  // not be reused: then it is dropped). EEXIST from the rename: -1 with errno EEXIST, the spare kept.
  int takeSpare(const std::string& name, const std::string& record);
  // Unlinks the lease file of `name`, whose lease (or a sweep's take of it) the caller holds; false when it was gone.
  bool dropLease(const std::string& name);
  // removeTreeNoFollow of a workspace, and then its quota released (a btrfs subvolume's qgroup, a project id).
  void removeWorkspace(int parentFd, const std::string& name, const std::string& shown, uint64_t* bytes = nullptr);
  // .vmspace/projects/ (project id claims), made on first use; -1 when it does not exist and !create.
  int projectsFd(bool create);
  // The staging shard of the calling thread (fixed per thread, spread over processes).
  int stagingShard() const;
  // The directory a workspace is built in (staging/s<shard>/, or the root for shard -1), and the path of `name`
  // in it as errors show it.
  int stagingDirFd(int shard) const { return shard < 0 ? rootFd_.get() : shardFds_[shard].get(); }
  std::string stagingPath(int shard, const std::string& name) const;
  // Whether `name` is being built: an entry of a shard.
  bool inStaging(const std::string& name) const;
  // Releases claims whose workspace is nowhere (staging, root, trash) and older than graceMs (sweep).
  void sweepProjectClaims(bool dryRun, int64_t graceMs);

  std::string root_;
  UniqueFd rootFd_, stateFd_, stagingFd_, trashFd_, leasesFd_;
  std::array<UniqueFd, kStagingShards> shardFds_;  // staging/s0 ...
  std::mutex sparesMu_;                            // guards spares_
  std::vector<Spare> spares_;
  size_t sparesPending_ = 0;  // places reserved by keepSpare calls still renaming (guarded by sparesMu_)
  dev_t rootDev_ = 0;         // st_dev of rootFd_ (fixed for the pool's life): a workspace on another is a subvolume
  // 0, or the errno (EINVAL/ENOSYS) with which the pool's file system refuses RENAME_NOREPLACE (asked once, at open):
  // allocate then fails with ERR_RENAME_NOREPLACE_UNSUPPORTED; files still publish by link + unlink.
  int noReplaceErr_ = 0;
  long long sharedGid_ = -1;
  std::unique_ptr<TemplateCache> cache_;  // .vmspace/cache/
  bool cacheEnabled_ = true;
  std::mutex templatesMu_;  // guards templates_ while it is made
  std::unique_ptr<TemplateStore> templates_;
  uint64_t minFreeBytes_ = 0;
  ProjectIdRange projectIds_;
  std::mutex projectsMu_;  // guards projectsFd_, opened lazily
  UniqueFd projectsFd_;
  // Claims exist only on XFS/ext4 (project quotas): elsewhere a removal never looks for them. -1: not asked yet
  // (set once by the first caller; a race sets the same value).
  std::atomic<int> projectFs_{-1};
  // projectsFd(false) where this pool's file system can have claims; -1 otherwise, and where it cannot be opened.
  int claimsIfAny();
};

// Reads /proc/sys/kernel/random/boot_id once (empty where it cannot be read).
const std::string& bootId();

// Test seam: faults no real file system gives on demand. The next sweep entry named `name` fails as if handling it
// threw std::bad_alloc (probeErrno 0), or as if its lease probe failed with `probeErrno` at `probeStep` ("flock"
// or "fcntl(F_OFD_GETLK)"; list() takes no flock, and takes a fault of either step as its probe's); each applies
// once. Process-wide; an empty list clears it. Test builds only (-DVMSPACE_TEST_HOOKS), as setTestIds.
#ifdef VMSPACE_TEST_HOOKS
struct SweepFault {
  std::string name;
  int probeErrno = 0;
  std::string probeStep = "fcntl(F_OFD_GETLK)";
};
void setSweepFaultsForTest(std::vector<SweepFault> faults);
#endif

}  // namespace vmspace

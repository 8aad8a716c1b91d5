// A pool of workspaces under one root directory (DESIGN.md, "The pool on disk"):
//   <root>/.vmspace/{version, staging/, trash/, meta/<name>.json}, and <root>/<prefix>-<32 hex> per workspace.
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
#include "quota.h"
#include "template.h"
#include "tree.h"
#include "usage.h"

namespace vmspace {

constexpr int kMaxNameTries = 16;  // DESIGN.md: EEXIST -> fresh name, at most 16 tries, then ERR_NAME_EXHAUSTED
// On-disk formats this vmspace reads and makes (.vmspace/version). 1: metadata in .vmspace/meta/<name>.json.
// 2: metadata in the xattr kMetaXattr of the workspace directory (one syscall, no directory changed, removed with
// the directory), in the file where the file system refuses the xattr. Older vmspace refuses a format-2 pool
// (ERR_POOL_FORMAT) rather than list its workspaces without metadata. 3: format 2, and workspaces are built in
// kStagingShards subdirectories of staging/ (staging/s<i>/<name>, i chosen per thread) instead of staging/ itself, so
// that parallel builds do not all wait on one directory's lock (issue 12); older vmspace refuses it, as its sweep
// would take a shard for a dead build and remove the live builds inside.
constexpr int kFormatDefault = 1;
constexpr int kFormatLatest = 3;
constexpr int kStagingShards = 8;
constexpr const char* kMetaXattr = "user.vmspace.meta";

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
  std::string fromTemplate;            // issue 14: the id or name of a committed template cloned first ("" none)
  QuotaLimits quota;  // quota.cc: a kernel-enforced limit of the workspace's own (none when !quota.any())
};

struct ClonedEntry {
  std::string dest;  // "" for templateDir
  std::string source;
  CloneSummary result;
  SourceIdentity identity;
};

struct AllocateResult {
  std::string id, name;
  int leaseFd = -1;  // O_RDONLY|O_DIRECTORY|O_CLOEXEC fd of the workspace, holding flock(LOCK_EX): the lease
  int retries = 0;   // names drawn again: the one drawn existed, or a sweep reclaimed its entry before the lease
  std::vector<ClonedEntry> clones;
  std::string templateId, templateMeta;  // issue 14: the template cloned (fromTemplate) and its template.json
  bool metaInXattr = false;  // format 2: its metadata is the directory's xattr, and no file was made (dispose hint)
};

// What the caller knows of a workspace it disposes, from its allocation by this process (issue 12: each saves
// a syscall on every dispose). metaFile false: its metadata is the directory's xattr
// (AllocateResult::metaInXattr), so no meta/ file is looked for (an unlink failing with ENOENT still takes
// meta/'s lock exclusively). claim false: it was made without a quota, so it holds no project id claim and
// .vmspace/projects/ is not probed. Defaults: unknown (adopted workspaces). A file or claim there anyway (never
// made by vmspace for such a workspace) would be an orphan for a sweep.
struct DisposeHints {
  bool metaFile = true;
  bool claim = true;
};

// A workspace built and leased in .vmspace/staging/<name>, not yet published (Pool::stage). To a sweep it is a build
// in progress for as long as the lease is held, and a dead build once it is free.
struct StagedWorkspace {
  std::string id, name;  // name: of the staging entry, and the one it is published under (unless that collides)
  UniqueFd lease;
  int retries = 0;
  int draws = 0;  // names drawn so far: publish counts on from here towards ERR_NAME_EXHAUSTED
  std::vector<ClonedEntry> clones;
  std::string templateId, templateMeta;  // issue 14: as in AllocateResult
  QuotaRef quota;                        // quota.cc: its project id claim follows the name at publish
  int shard = -1;                        // format 3: built in staging/s<shard>/; -1: in staging/
};

struct ListEntry {
  std::string name;
  bool live = false;
  std::string metaText;  // its metadata (kMetaXattr or meta/<name>.json) when metaErrno == 0
  int metaErrno = 0;
  bool metaInXattr = false;  // metaText, or metaErrno, is of the xattr (else of the file)
  int probeErrno = 0;        // the lease probe failed with this (not EWOULDBLOCK): liveness undecided, `live` set
  const char* probeSyscall = "flock";  // of probeErrno: "open" of the workspace directory, or its "flock"
};

struct AdoptResult {
  int leaseFd = -1;
  std::string metaText;
  int metaErrno = 0;
  bool metaInXattr = false;
};

struct SweepEntry {
  std::string name;
  const char* from;    // "published", "staging" or "trash"
  uint64_t bytes = 0;  // space freed (st_blocks * 512); 0 in a dry run
  Error error;         // for failures
};

struct SweepReport {
  std::vector<SweepEntry> reclaimed;
  // Entries whose handling failed (any errno, or an exception such as std::bad_alloc), one each; the sweep goes
  // on with the others. Includes a lease probe that cannot decide (flock fails with an errno other than
  // EWOULDBLOCK: syscall "flock"). An entry that vanished meanwhile (a concurrent dispose, allocate or sweep
  // finished it: ENOENT at its name) is not a failure and is in no list.
  std::vector<SweepEntry> failed;
  uint64_t live = 0;         // published workspaces whose lease is held
  uint64_t metaRemoved = 0;  // metadata files without a workspace
};

class Pool {
 public:
  // Opens (with `create`, makes) the pool at `root`, an absolute path. Every directory on the path and of the
  // pool is checked before it is used (checkTrusted in pool.cc): ERR_POOL_UNSAFE (path, uid, gid, mode set)
  // when another user could write it, nothing made. `sharedGid` >= 0 trusts that group: directories of that
  // group may be group-writable (and owned by any user); those made are given it, mode 02770. Directories made
  // get exact modes whatever the umask: 0755 (root, .vmspace/, parents), 0700 (staging/, trash/, meta/).
  // Errors: the errno of the failing syscall; ERR_POOL_FORMAT when .vmspace/version names another format; EXDEV
  // when .vmspace is on another file system. A file system without RENAME_NOREPLACE (FUSE, some network file
  // systems) opens, and its allocate fails with ERR_RENAME_NOREPLACE_UNSUPPORTED (cause EINVAL/ENOSYS).
  // `newFormat` (1, 2 or 3) is the format of a pool made by this call; an existing pool keeps its own.
  static std::shared_ptr<Pool> open(const std::string& root, bool create, long long sharedGid = -1,
                                    int newFormat = kFormatDefault);

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

  // Moves workspace `name` into trash, removes it safely, drops its metadata, closes `leaseFd`. The lease fd is
  // closed on every path, so that a sweep can finish what a failed removal left in trash.
  void dispose(const std::string& name, int leaseFd, DisposeHints hints = {});

  // Takes over the published workspace `name` whose lease is free: ENOENT when there is none,
  // ERR_LEASE_HELD while any process holds its lease.
  AdoptResult adopt(const std::string& name);

  // Reclaims what no live process holds: published workspaces whose lease is free, everything in trash not
  // being removed right now, staging entries whose lease is free and that are older than `graceMs`, metadata
  // without a workspace older than `graceMs`. A live lease is never taken from its owner (flock LOCK_NB).
  SweepReport sweep(bool dryRun, int64_t graceMs);

  // Published workspaces (every <prefix>-<32 hex> directory of the root) with liveness and metadata text.
  std::vector<ListEntry> list();

  // ---- quotas and space (quota.h, usage.h; issue 13) ----
  // Set once, right after open and before any operation: allocate refuses (ENOSPC, nothing made) while the file
  // system has less than `minFreeBytes` available; project ids are claimed from `projectIds`.
  void setSpaceConfig(uint64_t minFreeBytes, ProjectIdRange projectIds) {
    minFreeBytes_ = minFreeBytes;
    projectIds_ = projectIds;
  }
  // Space accounting of the published workspace `name` (ENOENT when there is none); `cancel` stops it.
  UsageReport usage(const std::string& name, const std::atomic<bool>* cancel);
  FsSpace space() { return fsSpace(rootFd_.get(), root_); }
  QuotaSupport quotaSupport() { return probeQuota(rootFd_.get()); }

  void close();
  const std::string& root() const { return root_; }
  int format() const { return format_; }
  // Issue 14: the pool's templates (.vmspace/templates/, made on first use with `create`); nullptr when the
  // pool has none and `create` is false.
  TemplateStore* templates(bool create);
  // The metadata file of workspace `name`, as errors show it.
  std::string metaPath(const std::string& name) const { return root_ + "/.vmspace/meta/" + name + ".json"; }

 private:
  friend class PoolSweep;    // pool.cc: Pool::sweep's passes
  friend class PoolStage;    // pool.cc: Pool::stage's phases
  friend class PoolPublish;  // pool.cc: Pool::publish's phases
  Pool() = default;
  std::string path(const std::string& name) const { return root_ + "/" + name; }
  // Moves the published `name`, whose directory `fd` refers to, into trash; false when it is no longer in
  // the root. Verifies that what moved is that directory, and puts anything else back.
  bool moveToTrash(const std::string& name, int fd);
  // Removes meta/<name>.json (ENOENT is fine; a directory in its place is removed safely).
  void dropMeta(const std::string& name);
  // removeTreeNoFollow of a workspace, and then its quota released (a btrfs subvolume's qgroup, a project id).
  void removeWorkspace(int parentFd, const std::string& name, const std::string& shown, uint64_t* bytes = nullptr);
  // .vmspace/projects/ (project id claims), made on first use; -1 when it does not exist and !create.
  int projectsFd(bool create);
  // Format 3: the staging shard of the calling thread (fixed per thread, spread over processes); -1 before format 3.
  int stagingShard() const;
  // The directory a workspace is built in (staging/ or staging/s<shard>/), and the path of `name` in it as errors
  // show it.
  int stagingDirFd(int shard) const { return shard < 0 ? stagingFd_.get() : shardFds_[shard].get(); }
  std::string stagingPath(int shard, const std::string& name) const;
  // Whether `name` is being built: an entry of staging/ or of a shard.
  bool inStaging(const std::string& name) const;
  // Releases claims whose workspace is nowhere (staging, root, trash) and older than graceMs (sweep).
  void sweepProjectClaims(bool dryRun, int64_t graceMs);
  // Writes meta/<name>.json atomically; false (nothing written) when it exists already.
  bool publishMeta(const std::string& name, const std::string& json, bool durable);
  // The metadata of workspace `name` whose directory is `wsFd`: the xattr (format 2), else the file. Returns the
  // errno (0: read) and whether it is the xattr's.
  int readMeta(int wsFd, const std::string& name, std::string* text, bool* inXattr);

  std::string root_;
  UniqueFd rootFd_, stateFd_, stagingFd_, trashFd_, metaFd_;
  std::array<UniqueFd, kStagingShards> shardFds_;  // format 3: staging/s0 ... (closed before format 3)
  dev_t rootDev_ = 0;  // st_dev of rootFd_ (fixed for the pool's life): a workspace on another is a subvolume
  // 0, or the errno (EINVAL/ENOSYS) with which the pool's file system refuses RENAME_NOREPLACE (asked once, at open):
  // allocate then fails with ERR_RENAME_NOREPLACE_UNSUPPORTED; files still publish by link + unlink.
  int noReplaceErr_ = 0;
  long long sharedGid_ = -1;
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
  int format_ = kFormatDefault;
};

// Reads /proc/sys/kernel/random/boot_id once (empty where it cannot be read).
const std::string& bootId();

// Test seam: faults no real file system gives on demand. The next sweep entry named `name` fails as if handling it
// threw std::bad_alloc (flockErrno 0), or as if its lease probe failed with `flockErrno`; each applies once.
// Process-wide; an empty list clears it. Test builds only (-DVMSPACE_TEST_HOOKS), as setTestIds.
#ifdef VMSPACE_TEST_HOOKS
struct SweepFault {
  std::string name;
  int flockErrno = 0;
};
void setSweepFaultsForTest(std::vector<SweepFault> faults);
#endif

}  // namespace vmspace

// Rollback of a workspace to one of its checkpoints (rollback.h), and the exclusive bytes of a template's tree.
#include "rollback.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "error.h"
#include "fd.h"
#include "io.h"
#include "lease.h"
#include "pool.h"
#include "quota.h"
#include "test_pause.h"
#include "usage.h"

namespace vmspace {

#ifdef VMSPACE_TEST_HOOKS
void testPausePoint(const char* phase) {
  const char* want = getenv("VMSPACE_TEST_PAUSE");
  if (!want || strcmp(want, phase) != 0) return;
  dprintf(2, "vmspace-test-pause %s\n", phase);
  for (;;) pause();  // until the test's SIGKILL
}
#endif

namespace {

// A btrfs qgroup without a limit reads as the largest u64 in sysfs: no limit to carry over.
constexpr uint64_t kNoLimit = uint64_t(1) << 63;

}  // namespace

// One rollback (rollbackWorkspace): a function per phase, in the order they run.
class PoolRollback {
 public:
  PoolRollback(Pool& pool, const RollbackRequest& req) : pool_(pool), req_(req) {}

  RollbackOutcome run() {
    checkLeaseFree();
    QuotaRef oldQuota;
    AllocateRequest build = buildRequest(&oldQuota);
    StagedWorkspace staged = pool_.stage(build);
    try {
      matchOwner(staged);
      // The new tree's project id is claimed under the workspace's name before it gets there: at no instant does
      // the name hold a tree whose claim a sweep would release (a kill here leaks the id to a later sweep, never
      // the live workspace's limit).
      if (staged.quota.projectId) renameProjectClaim(pool_.projectsFd(false), staged.quota.projectId, req_.name);
      checkLeaseFree();  // a handover opened while the tree was built
      testPausePoint("rollback:before-exchange");
      exchange(staged);
    } catch (...) {
      try {
        // The claim back to the build's name first: its removal releases it.
        if (staged.quota.projectId) renameProjectClaim(pool_.projectsFd(false), staged.quota.projectId, staged.name);
        if (!disowned_) pool_.discard(std::move(staged));
      } catch (...) {
        // Left under its lease file, free once its fd closed: a sweep's. The first error is the one to report.
      }
      throw;
    }
    if (oldQuota.projectId) renameProjectClaim(pool_.projectsFd(false), oldQuota.projectId, staged.name);
    testPausePoint("rollback:after-exchange");
    return removeOld(staged);
  }

 private:
  // The lease rule (docs/checkpoints.md): nobody but the caller holds the workspace's lease.
  void checkLeaseFree() {
    int held = leaseHeldByOther(req_.leaseFd);
    if (held < 0) throwErrno(-held, "fcntl(F_OFD_GETLK)", pool_.leasePath(req_.name));
    if (held > 0)
      throwCode("ERR_LEASE_HELD",
                "another process holds the lease of workspace " + req_.name +
                    ": stop it (close every fd of the lease it was handed) before a rollback; nothing was changed",
                EWOULDBLOCK, "fcntl(F_OFD_GETLK)", pool_.path(req_.name));
  }

  // allocate({ from: checkpoint })'s request, of the workspace's own prefix, mode and quota limits.
  AllocateRequest buildRequest(QuotaRef* oldQuota) {
    const std::string shown = pool_.path(req_.name);
    giveOwnerAccess(shown);
    UniqueFd ws(openat(pool_.rootFd_.get(), req_.name.c_str(), kDirFlags));
    if (!ws) throwErrno(errno == ELOOP || errno == ENOTDIR ? ENOENT : errno, "open", shown);
    if (fstat(ws.get(), &ws_) != 0) throwErrno(errno, "fstat", shown);
    AllocateRequest build;
    build.prefix = req_.name.substr(0, req_.name.size() - 33);  // "<prefix>-<32 hex>"
    build.mode = ws_.st_mode & 07777;
    build.fromTemplate = req_.checkpoint;
    build.progress = req_.progress;
    build.clone.durable = req_.durable;
    *oldQuota = quotaRefOf(pool_.rootFd_.get(), req_.name, pool_.projectIds_, pool_.claimsIfAny() >= 0);
    if (oldQuota->subvolId || oldQuota->projectId) {
      QuotaUsage u = quotaUsageOf(ws.get(), *oldQuota);
      if (u.set && u.limitBytes < kNoLimit) build.quota.bytes = u.limitBytes;
      if (u.set && u.limitInodes < kNoLimit) build.quota.inodes = u.limitInodes;
    }
    return build;
  }

  // A workspace directory whose guest (the pool's own uid, in a pool of an unprivileged user) took its owner's rwx
  // off gets them back first, as dispose gives them: else the build copies a mode it cannot clone into, and the
  // exchange cannot move the old directory (a directory moved to another parent needs write permission on it).
  void giveOwnerAccess(const std::string& shown) {
    if (geteuid() == 0) return;
    UniqueFd dir(openat(pool_.rootFd_.get(), req_.name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
    struct stat st;
    if (!dir || fstat(dir.get(), &st) != 0 || !S_ISDIR(st.st_mode)) return;  // the open that follows reports it
    if ((st.st_mode & S_IRWXU) != S_IRWXU && chmodFd(dir.get(), (st.st_mode & 07777) | S_IRWXU) != 0)
      throwErrno(errno, "chmod", shown);
  }

  // The built directory gets the workspace directory's exact mode (mkdir took the umask off) and owner.
  void matchOwner(const StagedWorkspace& staged) {
    const std::string shown = pool_.stagingPath(staged.shard, staged.name);
    UniqueFd dir(openat(pool_.stagingDirFd(staged.shard), staged.name.c_str(), kDirFlags));
    if (!dir) throwErrno(errno, "open", shown);
    struct stat st;
    if (fstat(dir.get(), &st) != 0) throwErrno(errno, "fstat", shown);
    if ((st.st_uid != ws_.st_uid || st.st_gid != ws_.st_gid) && fchown(dir.get(), ws_.st_uid, ws_.st_gid) != 0)
      throwErrno(errno, "fchown", shown);
    // After the chown, which clears set-id bits.
    if (fchmod(dir.get(), ws_.st_mode & 07777) != 0) throwErrno(errno, "fchmod", shown);
  }

  // The swap: the workspace's name holds the new tree, the staging entry the old one. What moved out of the name
  // must be the directory the build was made for; anything else is put back (ESTALE).
  void exchange(StagedWorkspace& staged) {
    const int shardFd = pool_.stagingDirFd(staged.shard);
    const std::string from = pool_.stagingPath(staged.shard, staged.name), to = pool_.path(req_.name);
    if (renameat2(shardFd, staged.name.c_str(), pool_.rootFd_.get(), req_.name.c_str(), RENAME_EXCHANGE) != 0)
      throwErrno(errno, "renameat2", from, to);
    struct stat moved;
    if (fstatat(shardFd, staged.name.c_str(), &moved, AT_SYMLINK_NOFOLLOW) != 0 || moved.st_dev != ws_.st_dev ||
        moved.st_ino != ws_.st_ino) {
      // Swapped back: the name gets what was there, and the build is removed as any failed one (ESTALE says why).
      if (renameat2(shardFd, staged.name.c_str(), pool_.rootFd_.get(), req_.name.c_str(), RENAME_EXCHANGE) != 0) {
        // What moved into staging is not ours: its lease file goes, so neither this call's cleanup nor a sweep
        // removes it (an entry without a lease file is reported as foreign and left).
        const int err = errno;
        disowned_ = true;
        if (unlinkat(pool_.leasesFd_.get(), pool_.leaseRel(staged.name).c_str(), 0) != 0 && errno != ENOENT)
          disownHeld(staged);
        throwErrno(err, "renameat2", from, to);
      }
      throwErrno(ESTALE, "renameat2", from, to);
    }
    if (req_.durable) {
      if (fsync(pool_.rootFd_.get()) != 0) throwErrno(errno, "fsync", pool_.root_);
      if (fsync(shardFd) != 0) throwErrno(errno, "fsync", from);
    }
  }

  // The lease file of a disowned entry stays (its unlink failed: EROFS, EIO, a leases/ directory made read-only):
  // its lease is then held for the life of the process, the fd never closed, since a sweep takes only a lease no
  // one holds. The error reported stays the swap back's, the first that went wrong. What stands after the process
  // ends: a sweep that can write there again takes the entry for an abandoned build.
  static void disownHeld(StagedWorkspace& staged) { (void)staged.lease.release(); }

  // The old tree into trash and removed as dispose removes it, then its lease file. What cannot be removed (a
  // mount inside, a nested pool) stays in trash under that lease file, free once `lease` closes: a sweep's.
  RollbackOutcome removeOld(StagedWorkspace& staged) {
    RollbackOutcome out;
    UniqueFd lease = std::move(staged.lease);
    const std::string trashed = layout::trashPath(pool_.root_, staged.name);
    try {
      if (renameat2(pool_.stagingDirFd(staged.shard), staged.name.c_str(), pool_.trashFd_.get(), staged.name.c_str(),
                    RENAME_NOREPLACE) != 0)
        throwErrno(errno, "renameat2", pool_.stagingPath(staged.shard, staged.name), trashed);
      pool_.removeWorkspace(pool_.trashFd_.get(), staged.name, trashed, &out.bytes);
      pool_.dropLease(staged.name);
      out.removed = true;
    } catch (...) {
      out.bytes = 0;
    }
    return out;
  }

  Pool& pool_;
  const RollbackRequest& req_;
  struct stat ws_ {};      // the workspace directory as the build found it
  bool disowned_ = false;  // the swap back failed: the staging entry holds what is not ours, left alone
};

RollbackOutcome rollbackWorkspace(Pool& pool, const RollbackRequest& req) { return PoolRollback(pool, req).run(); }

int64_t templateExclusiveBytes(Pool& pool, const std::string& id, const std::atomic<bool>* cancel) {
  TemplateStore* store = pool.templates(false);
  if (!store) return -1;
  TemplateReader reader;
  try {
    reader = store->acquire(id);
  } catch (const Error& e) {
    if (e.code == "ERR_TEMPLATE_NOT_FOUND") return -1;
    throw;
  }
  struct Held {  // the read lock, dropped on every path
    TemplateStore* store;
    TemplateReader& reader;
    ~Held() { store->release(reader); }
  } held{store, reader};
  UniqueFd tree(openat(reader.fd.get(), layout::kTree, kDirFlags));
  if (!tree) throwErrno(errno, "open", reader.treePath);
  return static_cast<int64_t>(workspaceUsage(tree.get(), reader.treePath, QuotaRef{}, cancel).exclusiveBytes);
}

}  // namespace vmspace

// The build of a workspace (pool.h: Pool::stage, Pool::allocate, Pool::discard, Pool::publish): a name claimed in
// staging with its lease file, the quota, template and clones put into it, then its record written to the lease
// file and its name claimed in the root, a fresh one drawn on each collision. Any failure removes what it made.
#include "pool.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <new>

#include "btrfs_subvol.h"
#include "clone_path.h"
#include "error.h"
#include "io.h"
#include "json_members.h"
#include "layout.h"
#include "lease.h"
#include "metadata.h"
#include "names.h"
#include "remove.h"
#include "rename.h"
#include "share.h"
#include "tree.h"

namespace vmspace {

namespace {

// Draws the next name, `prefix` (ending in its "-") and a fresh id, for a workspace; `*tries` counts the draws of one
// build (stage and publish together): ERR_NAME_EXHAUSTED past kMaxNameTries.
void drawName(int* tries, const std::string& prefix, const std::string& root, std::string* id, std::string* name) {
  if (*tries == kMaxNameTries)
    throwCode("ERR_NAME_EXHAUSTED",
              "every one of " + std::to_string(kMaxNameTries) + " names drawn for a workspace existed already", EEXIST,
              "mkdir", root);
  ++*tries;
  *id = randomId();
  *name = prefix + *id;
}

// A request that clones nothing and has no quota: its workspace is complete once made, so it is made at its name
// in the root (no staging entry, no publish rename); its lease file, with the whole record, exists before it.
bool isPlain(const AllocateRequest& req) {
  return req.templateDir.empty() && req.entries.empty() && req.fromTemplate.empty() && !req.quota.any();
}

}  // namespace

// One build of a workspace (Pool::stage): a function per phase. The checks and the template come first, so that a
// refused request leaves nothing; then a name is claimed (its lease file, then its directory or snapshot), and the
// quota and the clones go into it. `direct`: a plain request made at its name in the root, its record written with
// the lease.
class PoolStage {
 public:
  PoolStage(Pool& pool, const AllocateRequest& req, bool direct)
      : pool_(pool), req_(req), direct_(direct), shard_(direct ? -1 : pool.stagingShard()),
        dirFd_(pool.stagingDirFd(shard_)) {}
  // A template being read is released when the build ends, after its lease was dropped (a failure).
  ~PoolStage() {
    if (store_) store_->release(reader_);
  }

  StagedWorkspace run() {
    checkCanBuild();
    acquireTemplate();
    // From a template whose tree is a btrfs subvolume, the workspace is a writable snapshot of it (no walk); where
    // the kernel refuses one (EPERM: a template owned by another user; EXDEV), the walk below.
    // A template with shared files: a directory the walk fills, since a snapshot is a subvolume of its own and a
    // hard link cannot cross subvolumes (EXDEV).
    snapshot_ = reader_.subvolume && req_.clone.reflink != Reflink::Never && reader_.shared.empty();
    if (subvolume_ && !reader_.shared.empty())
      throwShareUnsupported(reader_.shared[0], "into a workspace that is a btrfs subvolume (a quota)");
    UniqueFd lease = claimName();
    std::string stagingPath = pool_.stagingPath(shard_, res_.name);
    try {
      if (direct_) return finish(std::move(lease));  // nothing to put in it
      UniqueFd ws(openat(dirFd_, res_.name.c_str(), kDirFlags));
      if (!ws) throwErrno(errno, "open", stagingPath);
      // The quota is on the empty workspace before anything is cloned in (a project id is inherited from here on).
      if (req_.quota.any())
        res_.quota = applyQuota(ws.get(), stagingPath, quotaSupport_, req_.quota,
                                quotaSupport_.backend == QuotaBackend::Project ? pool_.projectsFd(true) : -1,
                                pool_.projectIds_, res_.name);
      cloneSources(ws.get(), stagingPath);
    } catch (...) {
      abandon(stagingPath);
      throw;
    }
    return finish(std::move(lease));
  }

 private:
  StagedWorkspace finish(UniqueFd lease) {
    res_.lease = std::move(lease);
    res_.draws = tries_;
    res_.shard = shard_;
    return std::move(res_);
  }

  // Refusals before anything is made.
  void checkCanBuild() {
    // A workspace is a directory: without RENAME_NOREPLACE nothing publishes or moves it without the risk of
    // replacing one (rename(2) replaces an empty directory; link(2) takes no directory).
    if (pool_.noReplaceErr_)
      throwCode("ERR_RENAME_NOREPLACE_UNSUPPORTED",
                "the pool's file system cannot rename without replacing (renameat2 RENAME_NOREPLACE), which publishing "
                "a workspace needs",
                pool_.noReplaceErr_, "renameat2", pool_.root_);
    // Quota and free-space floor (quota.h).
    if (req_.quota.any()) {
      quotaSupport_ = probeQuota(pool_.rootFd_.get());
      if (quotaSupport_.err)
        throwCode("ERR_QUOTA_UNSUPPORTED", quotaSupport_.detail, quotaSupport_.err, "quotactl", pool_.root_);
      if (req_.quota.inodes && !quotaSupport_.inodes)
        throwCode("ERR_QUOTA_UNSUPPORTED",
                  "btrfs qgroups limit bytes, not inodes: quota.inodes cannot be enforced here", EINVAL,
                  "ioctl(BTRFS_IOC_QGROUP_LIMIT)", pool_.root_);
    }
    if (pool_.minFreeBytes_ && fsSpace(pool_.rootFd_.get(), pool_.root_).available < pool_.minFreeBytes_)
      throwErrno(ENOSPC, "statvfs", pool_.root_);
    subvolume_ = req_.quota.any() && quotaSupport_.backend == QuotaBackend::Btrfs;
  }

  // A template is resolved and held for reading (flock LOCK_SH) before anything is made, so an unknown one
  // (ERR_TEMPLATE_NOT_FOUND) leaves nothing, and a removal or replace waits for this clone.
  void acquireTemplate() {
    if (req_.fromTemplate.empty()) return;
    TemplateStore* s = pool_.templates(false);
    if (!s)
      throwCode("ERR_TEMPLATE_NOT_FOUND", "no template with the id or name '" + req_.fromTemplate + "'", ENOENT, "open",
                layout::templatesPath(pool_.root_));
    reader_ = s->acquire(req_.fromTemplate);
    store_ = s;
    res_.templateId = reader_.id;
    res_.templateRecord = reader_.record;
  }

  // The lease file is the claim on a name: made exclusively and already locked, before anything else is made under
  // that name, so no sweep ever sees a build whose lease is free. EEXIST, of the lease or of the directory (an
  // entry that is not vmspace's), draws a new name; nothing existing is ever adopted.
  UniqueFd claimName() {
    for (;; res_.retries++) {
      drawName(&tries_, req_.prefix + "-", pool_.root_, &res_.id, &res_.name);
      std::string record = direct_ ? recordJson(req_.info, res_.name, "", {}, req_.clone.reflink) : std::string();
      UniqueFd lease(direct_ ? pool_.takeSpare(res_.name, record) : -1);
      if (direct_ && !lease && errno == EEXIST) continue;  // a spare renamed onto a taken name
      const char* step = "open";
      if (!lease)
        lease.reset(makeLeaseFile(pool_.leasesFd_.get(), pool_.leaseRel(res_.name), record, pool_.sharedGid_, &step));
      if (!lease) {
        if (errno == EEXIST) continue;
        throwErrno(errno, step, pool_.leasePath(res_.name));
      }
      int err;
      try {
        err = makeEntry();
      } catch (...) {
        dropLeaseQuietly();
        throw;
      }
      if (err == 0) return lease;
      dropLeaseQuietly();  // EEXIST: draw again
    }
  }

  // The workspace's directory at res_.name in dirFd_: a writable snapshot of the template's subvolume, a btrfs
  // subvolume for a quota, or a directory. 0 (made) or EEXIST (a collision).
  int makeEntry() {
    if (snapshot_) {
      int err = makeWorkspaceSnapshot(reader_.subvolume.get(), dirFd_, res_.name, req_.mode);
      if (err == 0 || err == EEXIST) return err;
      if (err != EPERM && err != EACCES && err != EXDEV && err != ENOTTY && err != EOPNOTSUPP)
        throwErrno(err, "ioctl(BTRFS_IOC_SNAP_CREATE_V2)", pool_.stagingPath(shard_, res_.name));
      snapshot_ = false;  // refused: a directory, cloned into
    }
    int err = makeWorkspaceDir(dirFd_, res_.name, req_.mode, subvolume_);
    if (err != 0 && err != EEXIST)
      throwErrno(err, subvolume_ ? "ioctl(BTRFS_IOC_SUBVOL_CREATE)" : "mkdir", pool_.stagingPath(shard_, res_.name));
    return err;
  }

  void dropLeaseQuietly() {
    try {
      pool_.dropLease(res_.name);
    } catch (...) {
      // Left free (closed by the caller): a sweep removes a lease file whose workspace is gone.
    }
  }

  // A failed build: its entry removed, then its lease file. What cannot be removed stays under a free lease (closed
  // by the caller), which a sweep finishes; the original error is the one to report, whatever the cleanup met.
  void abandon(const std::string& stagingPath) {
    // Out of fds (EMFILE/ENFILE, the removal needs a few): other calls of the process give theirs back within
    // milliseconds, so the removal is tried again for up to ~0.2 s rather than left for a sweep.
    for (int tries = 0;; tries++) {
      try {
        pool_.removeWorkspace(dirFd_, res_.name, stagingPath);
        pool_.dropLease(res_.name);
        return;
      } catch (const Error& e) {
        if (!(e.code.empty() && (e.err == EMFILE || e.err == ENFILE)) || tries == 100) return;
      } catch (...) {
        return;
      }
      struct timespec pause = {0, 2000000L};  // 2 ms
      nanosleep(&pause, nullptr);
    }
  }

  // The template's committed tree (a snapshot made already, or cloned here), then the template directory and the
  // entries of the request, into the leased workspace `wsFd`.
  void cloneSources(int wsFd, const std::string& stagingPath) {
    CloneOptions opts = req_.clone;
    opts.overwrite = false;
    if (store_) {  // the committed tree, then the write bits the commit removed
      ClonedEntry c{"", reader_.treePath, {}, {}};
      if (snapshot_) {
        struct stat st;
        if (fstat(reader_.subvolume.get(), &st) != 0) throwErrno(errno, "fstat", reader_.treePath);
        fillIdentity(&c.identity, st);
        c.result.tree = c.result.snapshot = true;
      } else {
        c.result = cloneTreeInto(reader_.treePath, wsFd, stagingPath, opts, req_.progress, &c.identity);
      }
      store_->restoreModes(reader_, wsFd, stagingPath);
      // After the modes: the walk that restores them never meets (and never chmods) a shared inode.
      linkSharedFiles(reader_.fd.get(), store_->path(reader_.id), reader_.shared, wsFd, stagingPath);
      res_.clones.push_back(std::move(c));
    }
    if (!req_.templateDir.empty()) {
      ClonedEntry c{"", req_.templateDir, {}, {}};
      c.result = cloneTreeInto(req_.templateDir, wsFd, stagingPath, opts, req_.progress, &c.identity);
      res_.clones.push_back(std::move(c));
    }
    opts.cache = pool_.templateCache();  // single files from another file system: reflinked from their cached copy
    for (const TemplateEntry& entry : req_.entries) {
      std::string leaf;
      ParentDir parent = openParentBeneath(wsFd, entry.dest, &leaf, stagingPath, true);
      ClonedEntry c{entry.dest, entry.source, {}, {}};
      c.result = clonePathAt(entry.source, parent.get(), leaf, stagingPath + "/" + entry.dest, opts, req_.progress,
                             &c.identity);
      res_.clones.push_back(std::move(c));
    }
  }

  Pool& pool_;
  const AllocateRequest& req_;
  const bool direct_;  // made at its name in the root, record and all
  const int shard_;    // the staging shard built in (-1: the root)
  const int dirFd_;    // the shard, or the root
  StagedWorkspace res_;
  int tries_ = 0;  // names drawn, first or after a collision: ERR_NAME_EXHAUSTED past kMaxNameTries
  QuotaSupport quotaSupport_;
  bool subvolume_ = false;  // the workspace is a btrfs subvolume (its quota is a qgroup)
  TemplateStore* store_ = nullptr;
  TemplateReader reader_;
  bool snapshot_ = false;  // the workspace is a snapshot of the template's subvolume
};

StagedWorkspace Pool::stage(const AllocateRequest& req) { return PoolStage(*this, req, false).run(); }

AllocateResult Pool::allocate(const AllocateRequest& req) {
  if (!isPlain(req)) return publish(stage(req), req.info, req.clone);
  StagedWorkspace made = PoolStage(*this, req, true).run();
  AllocateResult res;
  if (req.clone.durable) {
    // The lease file (record and name) and the workspace's name, on disk before the call returns.
    if (fsync(made.lease.get()) != 0) throwErrno(errno, "fsync", leasePath(made.name));
    syncLeaseDir(made.name);
    if (fsync(rootFd_.get()) != 0) throwErrno(errno, "fsync", root_);
  }
  res.id = std::move(made.id);
  res.name = std::move(made.name);
  res.retries = made.retries;
  res.leaseFd = made.lease.release();
  return res;
}

void Pool::discard(StagedWorkspace&& staged) {
  UniqueFd lease = std::move(staged.lease);  // dropped last: the entry stays ours while it is removed
  removeWorkspace(stagingDirFd(staged.shard), staged.name, stagingPath(staged.shard, staged.name));
  dropLease(staged.name);
}

// One publish of a staged workspace (Pool::publish): its record written to its lease file, then its name claimed
// in the root, a fresh one drawn on each collision; any failure removes the workspace and its lease file.
class PoolPublish {
 public:
  PoolPublish(Pool& pool, StagedWorkspace&& staged, const JsonMembers& info, const CloneOptions& clone)
      : pool_(pool), info_(info), clone_(clone), lease_(std::move(staged.lease)), projectId_(staged.quota.projectId),
        shard_(staged.shard), dirFd_(pool.stagingDirFd(shard_)),
        tries_(staged.draws) {  // ERR_NAME_EXHAUSTED past kMaxNameTries, counting the stage's draws
    res_.id = std::move(staged.id);
    res_.name = std::move(staged.name);
    res_.retries = staged.retries;
    res_.clones = std::move(staged.clones);
    res_.templateId = std::move(staged.templateId);
    res_.templateRecord = std::move(staged.templateRecord);
  }

  AllocateResult run() {
    try {
      writeRecordOrThrow();
      // The workspace name is claimed with RENAME_NOREPLACE: an existing entry (not vmspace's: its lease file
      // would have collided) is answered with a fresh name, never by adopting it.
      while (!claimName()) redraw();
      if (clone_.durable) {
        if (fsync(lease_.get()) != 0) throwErrno(errno, "fsync", pool_.leasePath(res_.name));
        pool_.syncLeaseDir(res_.name);
        if (fsync(pool_.rootFd_.get()) != 0) throwErrno(errno, "fsync", pool_.root_);
      }
    } catch (...) {
      cleanUp();
      throw;
    }
    res_.leaseFd = lease_.release();
    return std::move(res_);
  }

 private:
  // The record, complete before the workspace is visible at its name; written again after a redraw (it names
  // the workspace).
  void writeRecordOrThrow() {
    std::string json = recordJson(info_, res_.name, res_.templateId, res_.clones, clone_.reflink);
    if (int err = writeRecord(lease_.get(), json)) throwErrno(err, "fsetxattr", pool_.leasePath(res_.name));
  }

  bool claimName() {
    if (renameat2(dirFd_, res_.name.c_str(), pool_.rootFd_.get(), res_.name.c_str(), RENAME_NOREPLACE) == 0) {
      published_ = true;
      return true;
    }
    if (errno != EEXIST) throwErrno(errno, "renameat2", pool_.stagingPath(shard_, res_.name), pool_.path(res_.name));
    return false;
  }

  // A fresh name: the lease file linked under it first (the claim, as at stage), then the staging entry renamed
  // to it, then the old lease name unlinked, so the entry is never without its lease file.
  void redraw() {
    std::string oldName = res_.name;
    for (;;) {
      res_.retries++;
      drawName(&tries_, oldName.substr(0, oldName.size() - res_.id.size()), pool_.root_, &res_.id, &res_.name);
      int err = linkLeaseFile(lease_.get(), pool_.leasesFd_.get(), pool_.leaseRel(res_.name));
      if (err == EEXIST) continue;
      if (err) throwErrno(err, "linkat", pool_.leasePath(res_.name));
      if (renameat2(dirFd_, oldName.c_str(), dirFd_, res_.name.c_str(), RENAME_NOREPLACE) == 0) break;
      err = errno;
      unlinkat(pool_.leasesFd_.get(), pool_.leaseRel(res_.name).c_str(), 0);  // ours: just linked
      if (err != EEXIST)
        throwErrno(err, "renameat2", pool_.stagingPath(shard_, oldName), pool_.stagingPath(shard_, res_.name));
    }
    unlinkat(pool_.leasesFd_.get(), pool_.leaseRel(oldName).c_str(), 0);
    if (projectId_) renameProjectClaim(pool_.projectsFd(false), projectId_, res_.name);  // quota
    writeRecordOrThrow();
  }

  void cleanUp() {
    try {
      if (published_)  // only when the final fsync failed
        pool_.removeWorkspace(pool_.rootFd_.get(), res_.name, pool_.path(res_.name));
      else
        pool_.removeWorkspace(dirFd_, res_.name, pool_.stagingPath(shard_, res_.name));
      pool_.dropLease(res_.name);
    } catch (...) {
      // Left with its lease free (closed below): a sweep reclaims it. The original error is the one to report,
      // whatever the cleanup met (an Error, or bad_alloc).
    }
  }

  Pool& pool_;
  const JsonMembers& info_;
  const CloneOptions& clone_;
  UniqueFd lease_;
  AllocateResult res_;
  const uint32_t projectId_;  // quota: its claim follows the name
  const int shard_;           // the staging shard it was built in
  const int dirFd_;           // that shard
  int tries_;
  bool published_ = false;  // the workspace is in the root (only a final fsync can fail then)
};

AllocateResult Pool::publish(StagedWorkspace&& staged, const JsonMembers& info, const CloneOptions& clone) {
  return PoolPublish(*this, std::move(staged), info, clone).run();
}

}  // namespace vmspace

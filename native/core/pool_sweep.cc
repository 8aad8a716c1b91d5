// The pool's sweep and listing (pool.h: Pool::sweep, Pool::list): what a crashed or killed process left behind
// (workspaces whose lease no process holds, staging and trash entries, spare leases, lease files without a
// workspace, an opener's probe files and half-built state) found, probed and reclaimed, and the published
// workspaces listed with whether each is held. Also the test seam that makes a probe fail (setSweepFaultsForTest).
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
#include <mutex>
#include <new>
#include <unordered_set>

#include "error.h"
#include "io.h"
#include "json_members.h"
#include "layout.h"
#include "lease.h"
#include "metadata.h"
#include "names.h"
#include "remove.h"
#include "rename.h"

namespace vmspace {
namespace {

// <prefix>-<32 lowercase hex>, prefix non-empty.
bool isWorkspaceName(const char* name) {
  size_t len = strlen(name);
  if (len < kIdHexChars + 2 || name[0] == '.') return false;
  return name[len - kIdHexChars - 1] == '-' && isHexId(name + len - kIdHexChars, kIdHexChars);
}

#ifdef VMSPACE_TEST_HOOKS
std::mutex g_faultMutex;
std::vector<SweepFault> g_faults;  // guarded by g_faultMutex
bool g_faultsActive = false;       // read without the mutex: a stale false only delays a fault set meanwhile
#endif

// Whether setSweepFaultsForTest set a fault for `name` of that kind (a probe errno, or bad_alloc when
// `probeErrno` is false); taken when it did (it applies once). Returns the errno, or 1 for bad_alloc; 0: none.
// *step (probe faults) is the call the fault stands for.
int takeSweepFault(const std::string& name, bool probeErrno, const char** step = nullptr) {
#ifndef VMSPACE_TEST_HOOKS
  (void)name, (void)probeErrno, (void)step;
  return 0;  // a release build has no seam
#else
  if (!__atomic_load_n(&g_faultsActive, __ATOMIC_ACQUIRE)) return 0;
  std::lock_guard<std::mutex> hold(g_faultMutex);
  for (auto it = g_faults.begin(); it != g_faults.end(); ++it) {
    if (it->name != name || (it->probeErrno != 0) != probeErrno) continue;
    int err = probeErrno ? it->probeErrno : 1;
    // The step's own string literal: the fault's std::string dies with the erase below.
    if (step) *step = it->probeStep == "flock" ? "flock" : "fcntl(F_OFD_GETLK)";
    g_faults.erase(it);
    return err;
  }
  return 0;
#endif
}

}  // namespace

#ifdef VMSPACE_TEST_HOOKS
void setSweepFaultsForTest(std::vector<SweepFault> faults) {
  std::lock_guard<std::mutex> hold(g_faultMutex);
  g_faults = std::move(faults);
  __atomic_store_n(&g_faultsActive, !g_faults.empty(), __ATOMIC_RELEASE);
}
#endif

namespace {

// A published workspace as readdir shows it: a directory (or an entry of unknown type) named <prefix>-<32 hex>.
bool isWorkspaceEntry(const std::string& name, unsigned char type) {
  return (type == DT_DIR || type == DT_UNKNOWN) && isWorkspaceName(name.c_str());
}

// ENOENT at the entry itself (not below it): the entry is gone, finished by someone else.
bool vanished(const Error& e, const std::string& shown) { return e.code.empty() && e.err == ENOENT && e.path == shown; }

// What removing dirFd/name gives back to the file system: the blocks of its entries less the extents they share
// with other files (reflinked or snapshotted ones stay allocated; FIEMAP_EXTENT_SHARED). False where it cannot be
// told (a tree the walk cannot read): the removal's st_blocks count stands then.
bool freedBytes(int dirFd, const std::string& name, const std::string& shown, uint64_t* out) {
  try {
    UniqueFd ws(openat(dirFd, name.c_str(), kDirFlags));
    if (!ws) return false;
    UsageReport u = workspaceUsage(ws.get(), shown, QuotaRef{}, nullptr);
    *out = u.allocatedBytes > u.sharedBytes ? u.allocatedBytes - u.sharedBytes : 0;
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

// One sweep of a pool (Pool::sweep): a function per pass, and the report and per-entry handling they share.
class PoolSweep {
 public:
  PoolSweep(Pool& pool, bool dryRun, int64_t graceMs)
      : pool_(pool), dryRun_(dryRun), graceMs_(graceMs), trashDir_(layout::statePath(pool.root_, layout::kTrash)),
        stagingDir_(layout::statePath(pool.root_, layout::kStaging)) {}

  SweepReport run() {
    publishedPass();
    trashPass();
    stagingPass();
    // Half-built templates, retired templates no one reads, names of commits that died.
    if (TemplateStore* store = pool_.templates(false)) store->sweep(dryRun_, graceMs_, report_);
    pool_.cache_->sweep(dryRun_, graceMs_, report_);  // copies no source needs, and beyond the size budget
    leasePass();
    leftoverPass();
    pool_.sweepProjectClaims(dryRun_, graceMs_);  // quota: project ids of workspaces gone without releasing them
    return std::move(report_);
  }

 private:
  enum class Lease { Free, Held, None };

  // One entry's failure (any errno, or an exception such as std::bad_alloc) is reported in that entry and the
  // sweep goes on: one guest's tree must not stop the reclamation of the whole pool. ENOENT at the entry itself
  // is no failure: a dispose, publish or sweep elsewhere finished it meanwhile.
  template <typename Handle>
  void guarded(const std::string& name, const char* from, const std::string& shown, Handle&& handle) {
    try {
      if (takeSweepFault(name, false)) throw std::bad_alloc();  // test seam
      handle();
    } catch (...) {
      Error err = currentErrorAt(shown);
      if (vanished(err, shown)) return;
      // Reported once: a later pass (trash, the lease files) would meet the same name and fail it again.
      handled_.insert(name);
      report_.failed.push_back({name, from, 0, std::move(err)});
    }
  }

  // The lease of workspace `name`: Free (taken into *out: no other sweep or adopt acts on it until *out closes),
  // Held (its owner or a holder lives, or another sweep is taking it), or None (no lease file: not vmspace's).
  Lease probe(const std::string& name, UniqueFd* out) {
    UniqueFd fd(openLeaseFile(pool_.leasesFd_.get(), pool_.leaseRel(name)));
    if (!fd) {
      if (errno == ENOENT || errno == ELOOP) return Lease::None;
      throwErrno(errno, "open", pool_.leasePath(name));
    }
    struct stat st;
    if (fstat(fd.get(), &st) != 0) throwErrno(errno, "fstat", pool_.leasePath(name));
    if (!S_ISREG(st.st_mode)) return Lease::None;
    const char* step;
    bool free = takeFreeLease(fd.get(), &step);
    if (int fault = takeSweepFault(name, true, &step)) {  // test seam: a probe failing as no local fs makes it
      free = false;
      errno = fault;
    }
    if (!free) {
      if (errno == EWOULDBLOCK) return Lease::Held;
      throwErrno(errno, step, pool_.leasePath(name));  // a probe that cannot decide, at the call that failed
    }
    *out = std::move(fd);
    return Lease::Free;
  }

  // Removes dirFd/name (shown below dirPath), then its lease file (the caller holds its take), and reports it.
  void reclaim(int dirFd, const std::string& dirPath, const std::string& name, const char* from) {
    SweepEntry e{name, from, 0, {}};
    if (!dryRun_) {
      std::string shown = dirPath + "/" + name;
      bool told = freedBytes(dirFd, name, shown, &e.bytes);
      pool_.removeWorkspace(dirFd, name, shown, told ? nullptr : &e.bytes);
      pool_.dropLease(name);
    }
    report_.reclaimed.push_back(std::move(e));
  }

  // An entry of dirFd named like a workspace without a lease file: reported, unless it is gone meanwhile (a dispose
  // removes the directory, then its lease file, between this sweep's readdir and its look for the lease).
  void foreign(int dirFd, const std::string& name, const std::string& shown) {
    struct stat st;
    if (fstatat(dirFd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) report_.foreign.push_back(shown);
  }

  // Published workspaces: a free lease means the owner and every holder are gone. The take is held while the
  // workspace is moved and removed, so no adopt or other sweep acts on it meanwhile.
  void publishedPass() {
    // `name` below is a plain reference: a C++17 lambda may not capture a structured binding (GCC allows it, clang
    // does not).
    for (auto& entry : readNames(pool_.rootFd_.get(), pool_.root_)) {
      const std::string& name = entry.first;
      if (!isWorkspaceEntry(name, entry.second)) continue;
      guarded(name, "published", pool_.path(name), [&] {
        UniqueFd lease;
        switch (probe(name, &lease)) {
          case Lease::None:
            foreign(pool_.rootFd_.get(), name, pool_.path(name));
            return;
          case Lease::Held:
            report_.live++;
            return;
          case Lease::Free:
            break;
        }
        handled_.insert(name);
        if (dryRun_) {
          report_.reclaimed.push_back({name, "published", 0, {}});
          return;
        }
        if (!pool_.moveToTrash(name)) return;  // disposed or reclaimed by someone else meanwhile
        reclaim(pool_.trashFd_.get(), trashDir_, name, "published");
      });
    }
  }

  // A workspace entry of trash or a staging shard: removed when its lease is free, left while held (a dispose
  // removing it, a build), reported as foreign without a lease file.
  bool hasLeaseFile(const std::string& name) {
    struct stat st;
    return fstatat(pool_.leasesFd_.get(), pool_.leaseRel(name).c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
  }

  void leasedEntry(int dirFd, const std::string& dir, const std::string& name, const char* from) {
    guarded(name, from, dir + "/" + name, [&] {
      UniqueFd lease;
      Lease l = probe(name, &lease);
      if (l == Lease::None) foreign(dirFd, name, dir + "/" + name);
      if (l != Lease::Free) return;
      handled_.insert(name);
      reclaim(dirFd, dir, name, from);
    });
  }

  // Trash: workspaces whose dispose died, and templates (template-<id>) whose removal did; a template there is
  // removed when no one holds its directory's lock.
  void trashPass() {
    for (auto& entry : readNames(pool_.trashFd_.get(), trashDir_)) {
      const std::string& name = entry.first;
      if (handled_.count(name)) continue;  // reported by the pass above, removed or failed
      // A template's entry is named template-<32 hex>, as a workspace of the prefix "template" would be: a workspace
      // has a lease file, a template none.
      bool templateName = layout::hasPrefix(name, layout::kTrashedTemplatePrefix);
      if (isWorkspaceName(name.c_str()) && !(templateName && !hasLeaseFile(name)))
        leasedEntry(pool_.trashFd_.get(), trashDir_, name, "trash");
      else if (templateName)
        guarded(name, "trash", trashDir_ + "/" + name, [&] { reclaimTemplate(name); });
      else
        foreign(pool_.trashFd_.get(), name, trashDir_ + "/" + name);
    }
  }
  void reclaimTemplate(const std::string& name) {
    UniqueFd fd(openat(pool_.trashFd_.get(), name.c_str(), kDirFlags));
    if (!fd && errno == ENOENT) return;  // finished meanwhile
    if (fd && flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK) return;  // its removal is running
      throwErrno(errno, "flock", trashDir_ + "/" + name);
    }
    SweepEntry e{name, "trash", 0, {}};
    if (!dryRun_) pool_.removeWorkspace(pool_.trashFd_.get(), name, trashDir_ + "/" + name, &e.bytes);
    report_.reclaimed.push_back(std::move(e));
  }

  // Staging: builds whose process died. A build's lease file exists, locked, before its entry does, so no build
  // in progress is ever taken, however young.
  void stagingPass() {
    for (auto& entry : readNames(pool_.stagingFd_.get(), stagingDir_))
      if (!isShardName(entry.first)) foreign(pool_.stagingFd_.get(), entry.first, stagingDir_ + "/" + entry.first);
    for (int i = 0; i < kStagingShards; i++) {
      std::string dir = layout::stagingShardPath(pool_.root_, i);
      for (auto& entry : readNames(pool_.shardFds_[i].get(), dir)) {
        if (isWorkspaceName(entry.first.c_str()))
          leasedEntry(pool_.shardFds_[i].get(), dir, entry.first, "staging");
        else
          foreign(pool_.shardFds_[i].get(), entry.first, dir + "/" + entry.first);
      }
    }
  }
  static bool isShardName(const std::string& name) {
    for (int i = 0; i < kStagingShards; i++)
      if (name == layout::stagingShardName(i)) return true;
    return false;
  }

  // Whether a directory of workspace `name` exists anywhere in the pool (root, a shard, trash).
  bool hasEntry(const std::string& name) {
    struct stat st;
    return pool_.inStaging(name) || fstatat(pool_.rootFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 ||
           fstatat(pool_.trashFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
  }

  // Lease files whose workspace is gone (a build that died before its directory was made, a dispose that died
  // after it was removed), and temp lease files (file systems without O_TMPFILE) of builds that died.
  void leasePass() {
    for (int i = 0; i < kLeaseShards; i++) {
      std::string dir = layout::leaseShardPath(pool_.root_, layout::leaseShardName(i));
      UniqueFd shard(openat(pool_.leasesFd_.get(), layout::leaseShardName(i).c_str(), kDirFlags));
      if (!shard) throwErrno(errno, "open", dir);
      int dirFd = shard.get();
      for (auto& entry : readNames(dirFd, dir)) {
        const std::string& file = entry.first;  // not a structured binding: the lambda below captures it (clang)
        bool spare = layout::hasPrefix(file, layout::kSparePrefix);
        if (spare || layout::hasPrefix(file, layout::kTmpPrefix)) {
          // A spare is held while its process lives: free, that process is gone. A temp one may be a build's that
          // has not taken its lock yet: free and past the grace period.
          UniqueFd fd(openLeaseFile(dirFd, file));
          const char* step;
          if (!fd || (!spare && ageMs(dirFd, file) < graceMs_) || !takeFreeLease(fd.get(), &step)) continue;
          // Counted once: another sweep may have unlinked it between our take and our unlink. A spare was never a
          // workspace's lease file (a dead process's unused one): removed, not counted in leasesRemoved.
          bool removed = dryRun_ || unlinkat(dirFd, file.c_str(), 0) == 0;
          if (removed && !spare) report_.leasesRemoved++;
          continue;
        }
        if (!isWorkspaceName(file.c_str()) || handled_.count(file)) continue;
        guarded(file, "lease", dir + "/" + file, [&] {
          UniqueFd lease;
          if (probe(file, &lease) != Lease::Free || hasEntry(file)) return;  // an entry left: the next sweep's
          if (dryRun_ || pool_.dropLease(file)) report_.leasesRemoved++;
        });
      }
    }
  }

  // What a killed opener left: RENAME_NOREPLACE probe files in .vmspace/ (probeNoReplace), half-built
  // .vmspace/ directories in the root (makeState). Each lives for microseconds, so one older than the grace
  // period has no owner left.
  void leftoverPass() {
    if (dryRun_) return;
    for (auto& [file, type] : readNames(pool_.stateFd_.get(), layout::statePath(pool_.root_))) {
      if (!layout::hasPrefix(file, layout::kNoReplaceProbe) || type == DT_DIR) continue;
      if (ageMs(pool_.stateFd_.get(), file) < graceMs_) continue;
      unlinkat(pool_.stateFd_.get(), file.c_str(), 0);  // quietly: an opener or another sweep may remove it first
    }
    for (auto& [file, type] : readNames(pool_.rootFd_.get(), pool_.root_)) {
      if (!layout::hasPrefix(file, layout::kInitPrefix) || type != DT_DIR) continue;
      if (ageMs(pool_.rootFd_.get(), file) < graceMs_) continue;
      try {
        removeTreeNoFollow(pool_.rootFd_.get(), file, pool_.root_ + "/" + file);
      } catch (...) {
        // left for a later sweep
      }
    }
  }

  Pool& pool_;
  const bool dryRun_;
  const int64_t graceMs_;
  const std::string trashDir_, stagingDir_;
  SweepReport report_;
  std::unordered_set<std::string> handled_;  // workspaces this sweep reclaimed (or failed to)
};

SweepReport Pool::sweep(bool dryRun, int64_t graceMs) { return PoolSweep(*this, dryRun, graceMs).run(); }

std::vector<ListEntry> Pool::list() {
  std::vector<ListEntry> out;
  for (auto& [name, type] : readNames(rootFd_.get(), root_)) {
    if (!isWorkspaceEntry(name, type)) continue;
    UniqueFd lease(openLeaseFile(leasesFd_.get(), leaseRel(name)));
    // No lease file: not vmspace's, or disposed meanwhile (the lease file goes last).
    if (!lease && (errno == ENOENT || errno == ELOOP)) continue;
    struct stat st;
    if (lease && (fstat(lease.get(), &st) != 0 || !S_ISREG(st.st_mode))) continue;  // no lease file: not vmspace's
    ListEntry entry;
    entry.name = name;
    if (!lease) {
      // Any other failure (EACCES, EMFILE, ...) is that entry's error, counted live (never reported reclaimable on
      // its word): a workspace whose lease cannot be opened is not hidden from the listing.
      entry.probeErrno = errno;
      entry.probeSyscall = "open";
      entry.live = true;
      out.push_back(std::move(entry));
      continue;
    }
    entry.recordErrno = readRecord(lease.get(), &entry.record);
    // The probe takes no lock: a listing never gets in the way of an adopt or a sweep.
    int held = leaseHeldByOther(lease.get());
    if (int fault = takeSweepFault(name, true)) held = -fault;  // test seam (setSweepFaultsForTest), as in sweep
    // A probe that cannot decide (ENOLCK, ...) is reported in that entry, counted live (never reclaimable on its
    // word), and the listing goes on: one entry does not hide the others.
    if (held < 0) entry.probeErrno = -held;
    entry.live = held != 0;
    // Disposed between the readdir and the open: its directory is gone from its name.
    if (fstatat(rootFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT) continue;
    out.push_back(std::move(entry));
  }
  return out;
}

}  // namespace vmspace

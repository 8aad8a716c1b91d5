#include "template_cache.h"

#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "error.h"
#include "io.h"
#include "layout.h"
#include "names.h"
#include "rename.h"
#include "sweep_report.h"
#include "usage.h"

namespace vmspace {
namespace {

constexpr const char* kSourceXattr = "user.vmspace.source";
// A hit records its use (the entry's atime and mtime, for the sweep's least-recently-used order) at most once a
// minute: one metadata write per minute of use, not one per allocate.
constexpr int64_t kUseMarkSec = 60;

// A key: digits, '-' and '.', as templateCacheKey makes it.
bool isKey(const std::string& s) {
  if (s.empty() || s.size() > 128) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || c == '-' || c == '.'; });
}

void pause(long ns) {
  struct timespec t = {0, ns};
  nanosleep(&t, nullptr);
}

// The key's lock, held (flock LOCK_EX) by the returned fd: the lock file `.lock-<key>`, made if missing. A lock file
// a sweep removed while we waited on it is no lock (a newcomer locks the new file): after the grant, the file at the
// name must still be the one locked, else it is opened and locked again. The wait polls (every 5 ms) so that a
// cancel is seen while another process copies.
UniqueFd lockKey(int dirFd, const std::string& key, const std::string& shown, CloneProgress* progress) {
  const std::string name = layout::kLockPrefix + key;
  for (;;) {
    UniqueFd fd(openat(dirFd, name.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY, 0600));
    if (!fd) throwErrno(errno, "open", shown + "/" + name);
    while (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) throwErrno(errno, "flock", shown + "/" + name);
      if (progress && progress->cancel.load(std::memory_order_relaxed))
        throwErrno(ECANCELED, "flock", shown + "/" + name);
      pause(5000000L);
    }
    struct stat held, now;
    if (fstat(fd.get(), &held) != 0) throwErrno(errno, "fstat", shown + "/" + name);
    if (held.st_nlink > 0 && fstatat(dirFd, name.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 &&
        now.st_dev == held.st_dev && now.st_ino == held.st_ino)
      return fd;
  }
}

// Records a hit on the entry `fd` (stat `st`) where the last one is older than kUseMarkSec. Best effort: an entry
// of another user (a shared pool) may refuse it (EPERM), and only the sweep's order depends on it.
void markUse(int fd, const struct stat& st) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  if (now.tv_sec - st.st_atim.tv_sec < kUseMarkSec) return;
  (void)futimens(fd, nullptr);
}

}  // namespace

std::string templateCacheKey(const struct stat& st) {
  char buf[160];  // at most 5 numbers of 20 digits, 2 of 9, and 6 separators: always fits
  (void)snprintf(buf, sizeof buf, "%llu-%llu-%llu-%lld.%09ld-%lld.%09ld", static_cast<unsigned long long>(st.st_dev),
                 static_cast<unsigned long long>(st.st_ino), static_cast<unsigned long long>(st.st_size),
                 static_cast<long long>(st.st_mtim.tv_sec), st.st_mtim.tv_nsec,
                 static_cast<long long>(st.st_ctim.tv_sec), st.st_ctim.tv_nsec);
  return buf;
}

bool TemplateCache::canReflink() {
  int known = reflinks_.load(std::memory_order_relaxed);
  if (known >= 0) return known == 1;
  UniqueFd a(openat(dirFd_.get(), ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
  UniqueFd b(openat(dirFd_.get(), ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
  // No O_TMPFILE: every file system that reflinks has it (XFS, btrfs, bcachefs, OCFS2); taken for "no".
  bool yes = a && b && ioctl(b.get(), FICLONE, a.get()) == 0;
  reflinks_.store(yes ? 1 : 0, std::memory_order_relaxed);
  return yes;
}

UniqueFd TemplateCache::openEntry(const std::string& key, uint64_t size) {
  UniqueFd fd(openat(dirFd_.get(), key.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY));
  if (!fd) {
    if (errno == ENOENT) return fd;
    throwErrno(errno, "open", shown_ + "/" + key);
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) throwErrno(errno, "fstat", shown_ + "/" + key);
  // Only vmspace publishes here, complete (checked and fsynced before its name): anything else is not a copy.
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) != size) throwErrno(EIO, "open", shown_ + "/" + key);
  // In use while this fd lives: a sweep takes LOCK_EX|LOCK_NB before it removes an entry. Refused only while a
  // sweep is removing it; its data stays this fd's then.
  (void)flock(fd.get(), LOCK_SH | LOCK_NB);
  markUse(fd.get(), st);
  return fd;
}

bool TemplateCache::fill(int src, const struct stat& st, int dst, const std::string& srcPath,
                         const std::string& dstPath, CloneProgress* progress, CloneFileResult* result) {
  if (!canReflink()) return false;
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (ioctl(dst, FICLONE, src) == 0) {
    if (progress) progress->bytes.fetch_add(size, std::memory_order_relaxed);
    *result = {CloneMethod::Reflink, size, CacheUse::None};
    return true;
  }
  if (errno != EXDEV) return false;  // the clone engine decides (EAGAIN tried again, a refusal copied, ...)
  const std::string key = templateCacheKey(st);
  CacheUse use = CacheUse::Hit;
  UniqueFd entry = openEntry(key, size);
  if (!entry) {
    UniqueFd lock = lockKey(dirFd_.get(), key, shown_, progress);
    entry = openEntry(key, size);  // published while we waited: another's copy serves us
    if (!entry) {
      try {
        entry = copyIn(src, st, key, srcPath, progress);
      } catch (...) {
        // Nothing published: the lock file goes too (a waiter granted it finds it unlinked and makes a new one).
        unlinkat(dirFd_.get(), (layout::kLockPrefix + key).c_str(), 0);
        throw;
      }
      use = CacheUse::Miss;
    }
  }
  if (ioctl(dst, FICLONE, entry.get()) != 0) throwErrno(errno, "ioctl(FICLONE)", shown_ + "/" + key, dstPath);
  if (progress && use == CacheUse::Hit) progress->bytes.fetch_add(size, std::memory_order_relaxed);
  *result = {CloneMethod::Reflink, size, use};
  return true;
}

UniqueFd TemplateCache::copyIn(int src, const struct stat& st, const std::string& key, const std::string& srcPath,
                               CloneProgress* progress) {
  const std::string entryPath = shown_ + "/" + key;
  std::string tmpName;  // empty: unnamed (O_TMPFILE)
  UniqueFd tmp(openat(dirFd_.get(), ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
  if (!tmp) {
    // No O_TMPFILE: a hidden name, locked so that a sweep leaves it while the copy runs (however long).
    tmpName = layout::kTmpPrefix + randomHex(8);
    tmp.reset(openat(dirFd_.get(), tmpName.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600));
    if (!tmp) throwErrno(errno, "open", shown_ + "/" + tmpName);
    if (flock(tmp.get(), LOCK_EX) != 0) {
      int err = errno;
      unlinkat(dirFd_.get(), tmpName.c_str(), 0);
      throwErrno(err, "flock", shown_ + "/" + tmpName);
    }
  }
  try {
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    CloneFileResult copied = cloneData(src, tmp.get(), st, Reflink::Auto, srcPath, entryPath, progress);
    // Never a torn copy: the source must be the version the key names from before the first byte to after the last.
    checkSourceUnchanged(src, st, srcPath, entryPath);
    if (copied.bytes != size) throwSourceChanged(srcPath, entryPath);
    return publishCopy(std::move(tmp), tmpName, key, srcPath);
  } catch (...) {
    if (!tmpName.empty()) unlinkat(dirFd_.get(), tmpName.c_str(), 0);
    throw;
  }
}

UniqueFd TemplateCache::publishCopy(UniqueFd tmp, const std::string& tmpName, const std::string& key,
                                    const std::string& srcPath) {
  const std::string entryPath = shown_ + "/" + key;
  // The source path, for the sweep to tell an entry whose source changed (best effort: without the xattr the entry
  // is only reclaimed by the size budget).
  (void)fsetxattr(tmp.get(), kSourceXattr, srcPath.data(), srcPath.size(), 0);
  if (fchmod(tmp.get(), 0444) != 0) throwErrno(errno, "fchmod", entryPath);
  // On disk before it has a name: after a crash an entry is complete or absent, never served with lost data.
  if (fsync(tmp.get()) != 0) throwErrno(errno, "fsync", entryPath);
  int err;
  const char* step = "linkat";
  if (tmpName.empty()) {
    err = linkTmpfile(tmp.get(), dirFd_.get(), key.c_str());
  } else {
    step = "renameat2";
    err = publishFileNoReplace(dirFd_.get(), tmpName.c_str(), dirFd_.get(), key.c_str(), &step);
  }
  // EEXIST: published by another (its lock file was removed and remade meanwhile): the same version's bytes.
  if (err != 0 && err != EEXIST) throwErrno(err, step, entryPath);
  if (!tmpName.empty() && err == EEXIST) unlinkat(dirFd_.get(), tmpName.c_str(), 0);
  if (flock(tmp.get(), LOCK_SH) != 0) throwErrno(errno, "flock", entryPath);  // in use until the clone is done
  return tmp;
}

namespace {

// An entry the sweep may reclaim, held (flock LOCK_EX|LOCK_NB) so that no clone starts from it meanwhile.
struct Candidate {
  std::string key;
  UniqueFd fd;
  uint64_t allocated = 0;  // st_blocks * 512
  int64_t usedSec = 0;     // last use: the later of atime and mtime (markUse sets both)
  bool obsolete = false;   // its source is gone or is another version now
};

// Whether no clone can ask for the entry `fd` (key `key`) any more: the source path it recorded is gone or holds
// another version. Without the record (no xattr), false: the size budget decides.
bool sourceMoved(int fd, const std::string& key) {
  char buf[4096];
  ssize_t n = fgetxattr(fd, kSourceXattr, buf, sizeof buf);
  if (n <= 0) return false;
  struct stat now;
  if (stat(std::string(buf, static_cast<size_t>(n)).c_str(), &now) != 0) return errno == ENOENT || errno == ENOTDIR;
  return templateCacheKey(now) != key;
}

// Whether the hidden `name` (a temp or lock file) is free to remove: no one holds it, and (temps) it has not
// changed for graceMs. The fd keeps the lock until the caller's unlink.
UniqueFd takeLeftover(int dirFd, const std::string& name, int64_t graceMs, bool isTemp) {
  UniqueFd fd(openat(dirFd, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY));
  if (!fd) return fd;
  struct stat st;
  if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return UniqueFd();
  if (isTemp) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    if ((now.tv_sec - st.st_ctim.tv_sec) * 1000 < graceMs) return UniqueFd();
  }
  if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) return UniqueFd();
  return fd;
}

}  // namespace

void TemplateCache::sweep(bool dryRun, int64_t graceMs, SweepReport& report) {
  std::vector<Candidate> entries;
  uint64_t total = 0;  // allocated bytes of every entry, held or not
  for (auto& [name, type] : readNames(dirFd_.get(), shown_)) {
    const std::string shown = shown_ + "/" + name;
    if (layout::hasPrefix(name, layout::kTmpPrefix) || layout::hasPrefix(name, layout::kLockPrefix)) {
      const bool isTemp = layout::hasPrefix(name, layout::kTmpPrefix);
      // A lock file goes with its entry: kept while the entry exists (the next miss of its key would remake it).
      if (dryRun || (!isTemp && faccessat(dirFd_.get(), name.c_str() + strlen(layout::kLockPrefix), F_OK,
                                          AT_SYMLINK_NOFOLLOW) == 0))
        continue;
      UniqueFd held = takeLeftover(dirFd_.get(), name, graceMs, isTemp);
      if (held) unlinkat(dirFd_.get(), name.c_str(), 0);  // quietly: another sweep may remove it first
      continue;
    }
    if (!isKey(name)) continue;  // not the cache's: left
    try {
      Candidate c;
      c.key = name;
      c.fd.reset(openat(dirFd_.get(), name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY));
      if (!c.fd) {
        if (errno == ENOENT) continue;
        throwErrno(errno, "open", shown);
      }
      struct stat st;
      if (fstat(c.fd.get(), &st) != 0) throwErrno(errno, "fstat", shown);
      if (!S_ISREG(st.st_mode)) continue;
      c.allocated = static_cast<uint64_t>(st.st_blocks) * 512;
      c.usedSec = std::max(st.st_atim.tv_sec, st.st_mtim.tv_sec);
      total += c.allocated;
      if (flock(c.fd.get(), LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK) throwErrno(errno, "flock", shown);
        continue;  // a clone is reading it (or another sweep taking it): never reclaimed in use
      }
      c.obsolete = sourceMoved(c.fd.get(), c.key);
      entries.push_back(std::move(c));
    } catch (...) {
      report.failed.push_back({name, "template-cache", 0, currentErrorAt(shown)});
    }
  }
  // Obsolete ones first, then the least recently used, until what is left fits the budget.
  std::stable_sort(entries.begin(), entries.end(), [](const Candidate& a, const Candidate& b) {
    return a.obsolete != b.obsolete ? a.obsolete : a.usedSec < b.usedSec;
  });
  for (Candidate& c : entries) {
    if (!c.obsolete && total <= maxBytes_) break;
    const std::string shown = shown_ + "/" + c.key;
    try {
      uint64_t freed = 0;
      if (!dryRun) {
        freed = exclusiveBytesOfFile(c.fd.get(), shown);
        if (unlinkat(dirFd_.get(), c.key.c_str(), 0) != 0) {
          if (errno == ENOENT) continue;  // another sweep's
          throwErrno(errno, "unlink", shown);
        }
        std::string lock = layout::kLockPrefix + c.key;
        if (UniqueFd held = takeLeftover(dirFd_.get(), lock, 0, false)) unlinkat(dirFd_.get(), lock.c_str(), 0);
      }
      total -= std::min(total, c.allocated);
      report.reclaimed.push_back({c.key, "template-cache", freed, {}});
    } catch (...) {
      report.failed.push_back({c.key, "template-cache", 0, currentErrorAt(shown)});
    }
  }
}

}  // namespace vmspace

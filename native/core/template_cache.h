// The template cache (DESIGN.md, "Template cache"): a single-file template source on another file system than the
// pool (the host's /images/base.ext4 into a pool on XFS or btrfs) is copied once into .vmspace/cache/, under a key
// that is the source's version (device, inode, size, mtime, ctime), and every clone of that version reflinks from
// the cached copy. On disk:
//   .vmspace/cache/<key>          a published copy, 0444; xattr user.vmspace.source: the source path it was made of
//   .vmspace/cache/.lock-<key>    the key's lock file: flock(LOCK_EX) while one process copies that version
//   .vmspace/cache/.tmp-<16 hex>  a copy being made, where the file system has no O_TMPFILE (held by flock)
// Thread-safe: every operation works on fds of its own; the cache directory's fd is only read.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "clone.h"
#include "fd.h"

namespace vmspace {

struct SweepReport;

// The default size budget of a pool's cache: 8 GiB (docs/templates-cache.md).
constexpr uint64_t kDefaultCacheBytes = uint64_t{8} << 30;

class TemplateCache {
 public:
  // `dirFd`: .vmspace/cache/ (owned), shown as `shown` in errors. `maxBytes`: what a sweep keeps (allocated bytes).
  TemplateCache(UniqueFd dirFd, std::string shown, uint64_t maxBytes)
      : dirFd_(std::move(dirFd)), shown_(std::move(shown)), maxBytes_(maxBytes) {}

  // Fills the empty regular file `dst` (on the pool's file system) with the data of the open source `src` (a
  // regular file of stat `st`) by a reflink: straight from `src` where the two share a file system (`*used`
  // CacheUse::None), else from the cache entry of this version of `src` (Hit), made first by copying `src`
  // (Miss) under the key's lock. False (nothing done) where the pool's file system cannot reflink (ext4: a cache
  // would only add a copy) or the reflink from `src` failed for another reason than EXDEV: the caller then clones
  // as usual. A copy into the cache reports its bytes to `progress` and stops on its cancel (ECANCELED); a
  // source that changed during the copy is ERR_SOURCE_CHANGED, nothing published. Errors: the errno of the
  // failing syscall (ENOSPC of the copy, EIO, ...), path the source or the cache entry.
  bool fill(int src, const struct stat& st, int dst, const std::string& srcPath, const std::string& dstPath,
            CloneProgress* progress, CloneFileResult* result);

  // Sweep pass: removes leftovers (named temps and lock files no one holds, past `graceMs` for temps), then entries
  // no one is cloning from (flock LOCK_EX|LOCK_NB): first those whose source is gone or changed (no later clone
  // can ask for that version), then the least recently used while the entries' allocated bytes exceed maxBytes.
  // Each reclaimed entry is reported in `report` (from "template-cache", bytes: what the file system got back,
  // its extents shared with workspaces excluded); a failure in `failed`.
  void sweep(bool dryRun, int64_t graceMs, SweepReport& report);

  void setMaxBytes(uint64_t maxBytes) { maxBytes_ = maxBytes; }

 private:
  // Whether a reflink works inside the pool's file system (asked once: FICLONE between two new unnamed files).
  bool canReflink();
  // The published entry `key`, opened read-only and checked to be a regular file of `size` bytes; -1 when none.
  UniqueFd openEntry(const std::string& key, uint64_t size);
  // Copies the source into an unnamed (or hidden, locked) file, checks the source is unchanged, publishes it as
  // `key`. Returns it open (O_RDWR).
  UniqueFd copyIn(int src, const struct stat& st, const std::string& key, const std::string& srcPath,
                  CloneProgress* progress);
  // Names the complete copy `tmp` (unnamed, or at the hidden `tmpName`) as `key`, fsynced first; returns it, in use.
  UniqueFd publishCopy(UniqueFd tmp, const std::string& tmpName, const std::string& key, const std::string& srcPath);

  UniqueFd dirFd_;
  std::string shown_;
  uint64_t maxBytes_;
  std::atomic<int> reflinks_{-1};  // -1 not asked yet, 0 no, 1 yes
};

// The cache key of a source version: "<dev>-<ino>-<size>-<mtime s>.<ns>-<ctime s>.<ns>", decimal.
std::string templateCacheKey(const struct stat& st);

}  // namespace vmspace

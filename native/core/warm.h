// The warm reserve's core (docs/warm.md): workspaces staged ahead of time from a template, each with the
// state of the template's sources as they were before it was built, and handed out only while that state is
// unchanged. The reserve itself (how many, when to refill) lives in lib/warm.ts; this is one build and one take.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "pool.h"

namespace vmspace {

// A digest of everything a template's clone depends on: for each source (the directory template and every map
// entry, with its destination), its stat as the clone sees it (a symlink source followed, as the clone does);
// for a directory, the lstat of every entry below it, by relative path. Device, inode, mode, owner, size, link
// count, mtime and ctime each count: a file replaced (rename over it: new inode), rewritten (mtime, ctime),
// touched back to its old mtime (ctime) or chmod-ed gives another digest. Reading (atime) does not.
// Errors: the errno of the stat/walk (ENOENT for a source removed).
uint64_t templateDigest(const AllocateRequest& request);

struct WarmEntry {
  std::mutex mu;            // one build, take or discard at a time
  AllocateRequest request;  // as built (its info unused, progress cleared once built)
  StagedWorkspace staged;   // lease empty until built, and once taken or discarded
  uint64_t digest = 0;      // templateDigest before the build began
};

// Builds a reserve entry from `request` (its progress, when set, can cancel the build: ECANCELED): the digest, then
// Pool::stage with every copied file written back (Writeback::Wait: an entry is ready only once its data is on disk, so
// the VM's first fsync has nothing of it to write), then the digest again; sources that changed during the build make
// the entry stale at once: it is removed and ERR_SOURCE_CHANGED thrown (the clone engine's error for a file written
// while it was copied, which pool.stage throws itself). Errors as Pool::stage.
void buildWarm(Pool& pool, AllocateRequest request, WarmEntry* entry);

// Publishes the entry with `infoJson` as its metadata (Pool::publish) if the template's sources are still as they
// were when it was built, and returns true; otherwise (stale, or already taken or discarded) returns false and
// leaves the entry to discardWarm, so that removing a stale image is not on the caller's path. Errors: as
// Pool::publish (the entry is then removed).
bool takeWarm(Pool& pool, WarmEntry* entry, const JsonMembers& info, AllocateResult* result);

// Removes the entry (nothing when it was taken or discarded already).
void discardWarm(Pool& pool, WarmEntry* entry);

}  // namespace vmspace

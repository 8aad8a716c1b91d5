#include "warm.h"

#include <ftw.h>
#include <sys/stat.h>

#include <cstring>

#include "clone.h"
#include "error.h"

namespace vmspace {
namespace {

// FNV-1a, 64 bits: the digest only needs to tell an accidental change, never to resist a forged one (whoever can
// change the template can change what the reserve builds anyway).
struct Fnv {
  uint64_t h = 1469598103934665603ULL;
  void add(const void* data, size_t len) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < len; i++) h = (h ^ p[i]) * 1099511628211ULL;
  }
  void add(const std::string& s) { add(s.c_str(), s.size() + 1); }
  void add(const struct stat& st) {
    uint64_t f[] = {static_cast<uint64_t>(st.st_dev),          static_cast<uint64_t>(st.st_ino),
                    static_cast<uint64_t>(st.st_mode),         static_cast<uint64_t>(st.st_uid),
                    static_cast<uint64_t>(st.st_gid),          static_cast<uint64_t>(st.st_nlink),
                    static_cast<uint64_t>(st.st_size),         static_cast<uint64_t>(st.st_mtim.tv_sec),
                    static_cast<uint64_t>(st.st_mtim.tv_nsec), static_cast<uint64_t>(st.st_ctim.tv_sec),
                    static_cast<uint64_t>(st.st_ctim.tv_nsec)};
    add(f, sizeof f);
  }
};

// nftw passes no user pointer: the walk's state is per thread (each walk runs on one libuv thread, start to end).
thread_local Fnv* walkHash;
thread_local size_t walkBase;

int walkEntry(const char* path, const struct stat* st, int type, struct FTW*) {
  if (type == FTW_NS || type == FTW_DNR) return errno ? errno : EACCES;  // an entry we cannot see: no digest
  walkHash->add(std::string(path + walkBase));
  walkHash->add(*st);
  return 0;
}

void addSource(Fnv* h, const std::string& dest, const std::string& source) {
  h->add(dest);
  h->add(source);
  struct stat st;
  if (stat(source.c_str(), &st) != 0) throwErrno(errno, "stat", source);
  h->add(st);
  if (!S_ISDIR(st.st_mode)) return;
  // FTW_PHYS: symlinks below the source are recorded as symlinks, never followed (as the tree clone does).
  // FTW_MOUNT is not set: it compares st_dev, and would leave out a btrfs subvolume, which the clone enters (it
  // compares mount ids); what is mounted below the source, which the clone leaves out, is in the digest, so a
  // change there only makes entries stale. At most 16 directory fds at once.
  walkHash = h;
  walkBase = source.size();
  int r = nftw(source.c_str(), walkEntry, 16, FTW_PHYS);
  walkHash = nullptr;
  if (r != 0) throwErrno(r > 0 ? r : errno, "nftw", source);
}

}  // namespace

uint64_t templateDigest(const AllocateRequest& req) {
  Fnv h;
  if (!req.templateDir.empty()) addSource(&h, "", req.templateDir);
  for (const TemplateEntry& e : req.entries) addSource(&h, e.dest, e.source);
  return h.h;
}

void buildWarm(Pool& pool, AllocateRequest r, WarmEntry* entry) {
  std::lock_guard<std::mutex> lock(entry->mu);
  r.clone.writeback = Writeback::Wait;
  uint64_t before = templateDigest(r);
  StagedWorkspace staged = pool.stage(r);
  uint64_t after;
  try {
    after = templateDigest(r);
  } catch (...) {
    pool.discard(std::move(staged));
    throw;
  }
  if (after != before) {
    // Changed while it was built, outside the copy of any one file (which the clone engine checks itself: a file
    // written while it was copied fails pool.stage with this same error): before its copy began or after it
    // ended. The entry would be of a newer version than `before` says, or a mix across files.
    pool.discard(std::move(staged));
    throwSourceChanged(r.templateDir.empty() && !r.entries.empty() ? r.entries[0].source : r.templateDir, "");
  }
  r.progress = nullptr;
  entry->request = std::move(r);
  entry->staged = std::move(staged);
  entry->digest = before;
}

bool takeWarm(Pool& pool, WarmEntry* entry, const JsonMembers& info, AllocateResult* result) {
  std::lock_guard<std::mutex> lock(entry->mu);
  if (!entry->staged.lease) return false;
  uint64_t now;
  try {
    now = templateDigest(entry->request);
  } catch (const Error&) {
    now = ~entry->digest;  // a source gone or unreadable: stale (the fresh build reports why)
  }
  if (now != entry->digest) return false;  // stale: left for discardWarm, off the caller's path
  *result = pool.publish(std::move(entry->staged), info, entry->request.clone);
  return true;
}

void discardWarm(Pool& pool, WarmEntry* entry) {
  std::lock_guard<std::mutex> lock(entry->mu);
  if (entry->staged.lease) pool.discard(std::move(entry->staged));
}

}  // namespace vmspace

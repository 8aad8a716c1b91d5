// The clone engine's shared parts: options, progress and results; a regular file's data (reflink, ioctl(FICLONE), or a
// copy that keeps holes where reflink is refused) and the check that its source did not change meanwhile. Cloning a
// path (a file or a tree, published whole) is clone_path.h's; the tree walk is tree.h's.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "fd.h"

namespace vmspace {

enum class Reflink { Always, Auto, Never };
enum class CloneMethod { Reflink, Copy };
// Whether the template cache (template_cache.h) served a file's data: no (None), from an entry made before (Hit), or
// from the entry this clone copied first (Miss).
enum class CacheUse { None, Hit, Miss };

class TemplateCache;

// What a copy (not a reflink: its extents are the source's, already on disk) does about the dirty pages it leaves.
// A copied image is all dirty page cache, and the first fsync after the clone (the VM's) pays for writing all of
// it back: seconds for hundreds of MiB. Start queues that writeback at once (sync_file_range(2)
// SYNC_FILE_RANGE_WRITE, which does not wait for it); Wait also waits until the data is written back.
enum class Writeback { None, Start, Wait };

struct CloneOptions {
  Reflink reflink = Reflink::Auto;
  bool overwrite = false;                 // replace an existing destination (atomically, by rename) instead of EEXIST
  bool durable = false;                   // fsync the file before publish and the directory after
  Writeback writeback = Writeback::None;  // for copied files only
  // A single-file source on another file system is reflinked from its cached copy (reflink Auto only; trees never).
  TemplateCache* cache = nullptr;
  // What a tree may carry of its privileges (false for a tree a guest made: commit, fork, a workspace as a
  // template). keepDevices false: device nodes are not made, counted in skippedDevices. keepSetId false: no
  // set-user-ID/set-group-ID bit on anything but a directory, and no security.capability xattr.
  bool keepDevices = true;
  bool keepSetId = true;
  // Tree clones: regular files left out, by their path relative to the source root (a commit's shared files, which
  // the template holds once, outside its tree: share.h).
  const std::vector<std::string>* skipFiles = nullptr;
};

// Applies `writeback` to the copied file `fd` (a no-op for None). Errors: the errno of sync_file_range (EIO,
// ENOSPC, ...); ESPIPE/EINVAL (a file that is no regular file of a page-cache file system) are no error.
void writeBack(int fd, Writeback writeback, const std::string& path);

struct CloneFileResult {
  CloneMethod method;
  uint64_t bytes;                   // logical size of the file as published
  CacheUse cache = CacheUse::None;  // the template cache served it (method Reflink)
};

// Identity of a clone source, recorded in workspace metadata.
struct SourceIdentity {
  uint64_t dev, ino, size;
  int64_t mtimeSec;
  int64_t mtimeNsec;
};

// Sets *identity (when given) from the source's stat.
void fillIdentity(SourceIdentity* identity, const struct stat& st);

// Whether `a` and `b`, two stats of one source, describe the same version of it: the same device, inode, size,
// mtime and ctime (ctime catches a rewrite touched back to its old mtime, and a chmod, chown or link). Reading
// changes none of these (atime is not compared); neither does FICLONE of the file as a source (XFS, btrfs).
bool sameSourceVersion(const struct stat& a, const struct stat& b);

// Throws ERR_SOURCE_CHANGED (no errno; path: the source, dest: the destination): the source changed while it was
// cloned, so what was built may be neither version.
[[noreturn]] void throwSourceChanged(const std::string& srcPath, const std::string& dstPath);

// fstat of the open source `src` after its data was cloned: ERR_SOURCE_CHANGED unless it is the version `before`
// (sameSourceVersion). A reflink is atomic, but a change between `before` and the ioctl is a clone of a version
// other than the one `before` names, so it is checked as a copy is. Fills *after (when given) on success.
void checkSourceUnchanged(int src, const struct stat& before, const std::string& srcPath, const std::string& dstPath,
                          struct stat* after = nullptr);

struct CloneProgress;

// Gives the unnamed (O_TMPFILE) file `fd` the name `name` in `dirFd`: linkat(2) with AT_EMPTY_PATH where the caller
// may, else through /proc/self/fd. Never replaces (EEXIST). 0 or the errno.
int linkTmpfile(int fd, int dirFd, const char* name);

// Fills the empty regular file `dst` with the data of `src`, of the version `before` (its fstat): ioctl(FICLONE) unless
// `reflink` is Never; where the file systems refuse to share extents, Auto copies keeping holes, Always throws
// ERR_REFLINK_UNSUPPORTED. EAGAIN/EINTR (OpenZFS, signals) are tried again a few times, then taken as a refusal
// (cause EAGAIN for Always). Other errors are thrown as they are. Returns how the data arrived and the bytes
// published: a copy reads to the source's end of file (procfs reports size 0, sysfs 4096) and publishes exactly
// what it read; every short or zero copy_file_range/read/write is checked (DESIGN.md, "Clone engine"). A read that
// ends early on a source no longer of version `before` is ERR_SOURCE_CHANGED; otherwise whether the source changed
// meanwhile is the caller's check (checkSourceUnchanged). With `progress`, a copy adds its bytes to
// progress->bytes as each chunk is written (a reflink all at once), so that a single big file reports progress, and
// checks progress->cancel between chunks (ECANCELED).
CloneFileResult cloneData(int src, int dst, const struct stat& before, Reflink reflink, const std::string& srcPath,
                          const std::string& dstPath, CloneProgress* progress = nullptr);

// The directory a path beneath a base fd ends in: the base itself (borrowed; `owned` empty) or a directory opened
// beneath it (owned, closed with this).
struct ParentDir {
  UniqueFd owned;
  int fd = -1;
  int get() const { return fd; }
};

// Opens the parent of the relative path `rel` beneath `baseFd`; `leaf` receives the last component. A one-component
// `rel` gives `baseFd` itself, neither duplicated nor closed (it must stay open while the result is used); a deeper
// one a directory opened O_CLOEXEC, closed with the result. With `createParents`, missing directories are made
// (mode 0777 & ~umask); without, a missing one is ENOENT. Every component is opened with O_NOFOLLOW, so a
// symlink anywhere on the way gives ENOTDIR/ELOOP instead of redirecting outside `baseFd`. `rel` must be
// normalised (no empty, "." or ".." components; checked by the caller).
ParentDir openParentBeneath(int baseFd, const std::string& rel, std::string* leaf, const std::string& basePath,
                            bool createParents);

// Shared between the thread that clones and the JS thread that polls it (every 100 ms at most) or cancels it.
struct CloneProgress {
  std::atomic<uint64_t> files{0};   // regular files done
  std::atomic<uint64_t> bytes{0};   // bytes cloned, a copy's added per chunk (cloneData): one big file reports too
  std::atomic<bool> cancel{false};  // checked between entries and between a copy's chunks: ECANCELED, rolled back
};

struct CloneSummary {
  bool tree = false;
  uint64_t files = 0;      // regular files (hard links counted once)
  uint64_t bytes = 0;      // their logical bytes
  uint64_t reflinked = 0;  // regular files whose extents are shared with the source
  uint64_t copied = 0;     // regular files copied (reflink refused, or 'never')
  uint64_t dirs = 0, symlinks = 0, hardlinks = 0, fifos = 0, devices = 0;
  uint64_t skippedSockets = 0;      // sockets cannot be recreated meaningfully
  uint64_t skippedDevices = 0;      // device nodes not made: mknod not permitted (not root), or !keepDevices
  bool snapshot = false;            // a btrfs subvolume snapshot made the tree: no walk, the counts stay 0
  CacheUse cache = CacheUse::None;  // a single file: whether the template cache served it
};

// What happened: "snapshot" (a btrfs subvolume snapshot), "reflink" (every regular file shares its extents), "copy"
// (every regular file was copied, or there were none: no extent was shared, every entry was made anew) or "mixed"
// (both). The Reflink asked for does not change the answer (kept in the signature for its callers).
const char* methodName(const CloneSummary& s, Reflink reflink);

}  // namespace vmspace

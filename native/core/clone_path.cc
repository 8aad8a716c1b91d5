// The path entry points of a clone (clone_path.h): a source opened once by its path, cloned as a file (unnamed
// O_TMPFILE, or a named temp file, published whole) or as a tree (tree.h, under a temp name, published by
// renameat2), out of a workspace or into one.
#include "clone_path.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "error.h"
#include "fd.h"
#include "layout.h"
#include "names.h"
#include "remove.h"
#include "rename.h"
#include "template_cache.h"
#include "tree.h"

namespace vmspace {
namespace {

// Set once a linkat(2) of an O_TMPFILE file was refused (no /proc, EPERM) where a named temp file then worked:
// this process no longer tries O_TMPFILE.
std::atomic<bool> tmpfileLinkRefused{false};

// open(2) with O_TMPFILE is refused with EOPNOTSUPP by a file system without it, EISDIR by kernels before 3.11
// (which take O_TMPFILE's O_DIRECTORY for a plain open of the directory), EINVAL for a flag combination the
// file system does not take (man 2 open); ENOSYS and ENOTSUP alike on FUSE.
bool tmpfileRefused(int err) { return err == EOPNOTSUPP || err == EISDIR || err == EINVAL || err == ENOSYS; }

// linkat(2) of an unnamed file refused by the environment rather than by the destination: ENOENT (no /proc, or
// AT_EMPTY_PATH without the capability), EPERM (a file system without hard links; a seccomp filter), EACCES
// (/proc mounted hidepid), EXDEV, EOPNOTSUPP, ENOSYS, EINVAL. A named temp file is tried then; if the ENOENT
// meant that the directory is gone, the named path fails with that ENOENT too.
bool tmpfileLinkRefusedErr(int err) {
  return err == ENOENT || err == EPERM || err == EACCES || err == EXDEV || err == EOPNOTSUPP || err == ENOSYS ||
         err == EINVAL;
}

// Fills the new file `dst` from `src` (stat `st`): data, checked to be of the version `st` names (else
// ERR_SOURCE_CHANGED), mode, writeback, fsync for `durable`. Fills `identity` (when given) from the stat after the
// data.
CloneFileResult fillClone(int src, const struct stat& st, int dst, const CloneOptions& options,
                          const std::string& srcPath, const std::string& dstPath, CloneProgress* progress,
                          SourceIdentity* identity) {
  CloneFileResult result{};
  // The template cache serves a source on another file system by a reflink of its cached copy; 'always' keeps its
  // promise of failing there, 'never' of copying.
  if (!(options.cache && options.reflink == Reflink::Auto &&
        options.cache->fill(src, st, dst, srcPath, dstPath, progress, &result)))
    result = cloneData(src, dst, st, options.reflink, srcPath, dstPath, progress);
  struct stat after;
  checkSourceUnchanged(src, st, srcPath, dstPath, &after);
  fillIdentity(identity, after);
  // The clone is ours, not the source owner's: set-id bits are kept only where owner (group) are the same, so
  // root cloning a user's 4755 file never mints a root-owned set-uid binary. (No set-id bit: no fstat needed.)
  mode_t mode = st.st_mode & 07777;
  if (!options.keepSetId) mode &= ~(S_ISUID | S_ISGID);  // a guest's file (CloneOptions::keepSetId)
  if (mode & (S_ISUID | S_ISGID)) {
    struct stat own;
    if (fstat(dst, &own) != 0) throwErrno(errno, "fstat", dstPath);
    if (own.st_uid != st.st_uid) mode &= ~S_ISUID;
    if (own.st_gid != st.st_gid) mode &= ~S_ISGID;
  }
  if (fchmod(dst, mode) != 0) throwErrno(errno, "fchmod", dstPath);
  if (result.method == CloneMethod::Copy) writeBack(dst, options.writeback, dstPath);
  if (options.durable && fsync(dst) != 0) throwErrno(errno, "fsync", dstPath);
  return result;
}

// What kind of file `mode` is, in words for an error.
const char* fileKind(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFIFO:
      return "a fifo";
    case S_IFSOCK:
      return "a socket";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFLNK:
      return "a symlink";
    default:
      return "not a regular file";
  }
}

// ERR_SOURCE_TYPE: the source is neither a regular file nor a directory. No errno: nothing failed, the source is
// of a kind a clone does not take (a fifo's or a device's data is a stream, not a file to share extents of).
[[noreturn]] void throwSourceType(mode_t mode, const std::string& srcPath, const std::string& dstPath) {
  throwCode("ERR_SOURCE_TYPE",
            std::string("the source is ") + fileKind(mode) + ": a clone source is a regular file or a directory", 0, "",
            srcPath, dstPath);
}

// Opens a clone source, file or directory, once: the caller chooses from its fstat, with no stat(2) of the path
// before (a syscall fewer, and no window between that stat and the open). O_RDONLY opens a directory as well as
// a file (open(2)); O_NONBLOCK keeps a fifo from parking this thread in open(2) waiting for a writer, and has no
// effect on regular files or directories. A symlink given as the source itself is followed, as cp does. A source
// of another kind is ERR_SOURCE_TYPE, from the fstat, or where open(2) refuses it (a socket: ENXIO) from a stat.
UniqueFd openSource(const std::string& srcPath, const std::string& dstPath, struct stat* st) {
  UniqueFd src(open(srcPath.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!src) {
    int err = errno;
    if (err == ENXIO && stat(srcPath.c_str(), st) == 0 && !S_ISREG(st->st_mode) && !S_ISDIR(st->st_mode))
      throwSourceType(st->st_mode, srcPath, dstPath);
    throwErrno(err, "open", srcPath, dstPath);
  }
  if (fstat(src.get(), st) != 0) throwErrno(errno, "fstat", srcPath);
  if (!S_ISREG(st->st_mode) && !S_ISDIR(st->st_mode)) throwSourceType(st->st_mode, srcPath, dstPath);
  return src;
}

// Opens the source `rel` beneath `baseFd` (a workspace: hostile entries) for a clone out of it. Every component is
// opened O_NOFOLLOW (a symlink on the way: ENOTDIR, at the leaf: ELOOP), the leaf first as O_PATH: a device node
// or fifo is refused (ERR_SOURCE_TYPE) before any open(2) of it, which for a device is the driver's open (a
// watchdog arms itself). The O_PATH fd is then reopened through /proc/self/fd: the very inode checked, whatever
// the guest renames meanwhile.
UniqueFd openSourceBeneath(int baseFd, const std::string& basePath, const std::string& rel, const std::string& dstPath,
                           struct stat* st) {
  std::string leaf, srcPath = basePath + "/" + rel;
  ParentDir dir = openParentBeneath(baseFd, rel, &leaf, basePath, false);
  UniqueFd at(openat(dir.get(), leaf.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
  if (!at) throwErrno(errno, "open", srcPath, dstPath);
  if (fstat(at.get(), st) != 0) throwErrno(errno, "fstat", srcPath);
  if (S_ISLNK(st->st_mode)) throwErrno(ELOOP, "open", srcPath, dstPath);
  if (!S_ISREG(st->st_mode) && !S_ISDIR(st->st_mode)) throwSourceType(st->st_mode, srcPath, dstPath);
  std::string proc = "/proc/self/fd/" + std::to_string(at.get());
  UniqueFd src(open(proc.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!src) throwErrno(errno, "open", srcPath, dstPath);
  return src;
}

// Clones the regular file `src`, open (stat `st`: openSource or openSourceBeneath), to `dstName` in directory
// `dstDirFd` (clonePathAt for a file). The destination appears only complete: without `overwrite` it is
// an unnamed O_TMPFILE file named by linkat(2) (EEXIST, syscall "linkat", never a replace), else (or where
// O_TMPFILE or the link is refused) a named temp file, removed on every failure. `dstPath` names the destination in
// errors. A source that changed while it was cloned (checkSourceUnchanged) is ERR_SOURCE_CHANGED, nothing published.
// Fills `identity` when given, from the source's stat after the data was cloned. The clone is owned by the caller:
// set-user-ID is kept only where that is the source's owner, set-group-ID only where the clone's group is the source's
// (as cp(1) drops them when it does not keep the owner). The named temp file is published with publishFileNoReplace
// (rename.h), or rename(2) with `overwrite`. Errors: the errno of the failing syscall; EISDIR for a directory;
// ERR_SOURCE_TYPE (no errno) for a fifo, socket or device node; ERR_REFLINK_UNSUPPORTED (errno as cause) when reflink
// is Always and the file systems refuse it.
CloneFileResult cloneOpenFile(int src, const struct stat& st, const std::string& srcPath, int dstDirFd,
                              const std::string& dstName, const std::string& dstPath, const CloneOptions& options,
                              SourceIdentity* identity, CloneProgress* progress) {
  if (S_ISDIR(st.st_mode)) throwErrno(EISDIR, "open", srcPath, dstPath);

  // Without overwrite: an unnamed file (O_TMPFILE), named only once complete by linkat(2), which never replaces
  // (EEXIST). No temp name to draw, rename, or remove on failure (closing the fd frees it): 2 syscalls fewer than
  // the named temp file below, and nothing is ever left behind. Where refused, the named temp file.
  bool linkRefused = false;
  if (!options.overwrite && !tmpfileLinkRefused.load(std::memory_order_relaxed)) {
    UniqueFd dst(openat(dstDirFd, ".", O_TMPFILE | O_WRONLY | O_CLOEXEC | O_NOCTTY, 0600));
    if (dst) {
      CloneFileResult result = fillClone(src, st, dst.get(), options, srcPath, dstPath, progress, identity);
      int err = linkTmpfile(dst.get(), dstDirFd, dstName.c_str());
      if (err == 0) {
        if (options.durable && fsync(dstDirFd) != 0) throwErrno(errno, "fsync", dstPath);
        return result;
      }
      if (!tmpfileLinkRefusedErr(err)) throwErrno(err, "linkat", srcPath, dstPath);
      linkRefused = true;
      // A copy is read again below, from the start (`src`'s offset is unused: pread, copy_file_range with offsets),
      // and counts its bytes again: the first copy's are taken back (once per process: linkRefused is remembered).
      if (progress) progress->bytes.fetch_sub(result.bytes, std::memory_order_relaxed);
    } else if (!tmpfileRefused(errno)) {
      throwErrno(errno, "open", dstPath);
    }
  }

  // The temp file is private (0600) until it is complete; its final mode is set just before publish.
  std::string tmpName = layout::kCloneTmpPrefix + randomHex(8);
  UniqueFd dst(openat(dstDirFd, tmpName.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600));
  if (!dst) throwErrno(errno, "open", dstPath);
  try {
    CloneFileResult result = fillClone(src, st, dst.get(), options, srcPath, dstPath, progress, identity);
    if (options.overwrite) {
      // rename(2) replaces the destination atomically; it refuses (EISDIR) to replace a directory with a file.
      if (renameat(dstDirFd, tmpName.c_str(), dstDirFd, dstName.c_str()) != 0)
        throwErrno(errno, "rename", srcPath, dstPath);
    } else {
      const char* step = "renameat2";
      if (int err = publishFileNoReplace(dstDirFd, tmpName.c_str(), dstDirFd, dstName.c_str(), &step))
        throwErrno(err, step, srcPath, dstPath);
    }
    if (linkRefused) tmpfileLinkRefused.store(true, std::memory_order_relaxed);
    if (options.durable && fsync(dstDirFd) != 0) throwErrno(errno, "fsync", dstPath);
    return result;
  } catch (...) {
    // The temp name is ours alone (O_EXCL, random); after a successful rename it no longer exists.
    unlinkat(dstDirFd, tmpName.c_str(), 0);
    throw;
  }
}

}  // namespace

namespace {

// clonePathAt of a source that is no directory: one file, counted as the tree walk counts its files.
CloneSummary cloneOneFile(int src, const struct stat& st, const std::string& srcPath, int dstDirFd,
                          const std::string& dstName, const std::string& dstPath, const CloneOptions& options,
                          CloneProgress* progress, SourceIdentity* identity) {
  CloneFileResult r = cloneOpenFile(src, st, srcPath, dstDirFd, dstName, dstPath, options, identity, progress);
  CloneSummary s;
  s.files = 1;
  s.bytes = r.bytes;
  s.cache = r.cache;
  (r.method == CloneMethod::Reflink ? s.reflinked : s.copied) = 1;
  if (progress) progress->files.fetch_add(1, std::memory_order_relaxed);  // its bytes came with its data (cloneData)
  return s;
}

// Publishes the finished tree `tmp` as `dstName` (both in `dstDirFd`) without replacing, or with `overwrite` by
// exchange and removal of the old tree.
void publishTree(int dstDirFd, const std::string& tmp, const std::string& tmpPath, const std::string& dstName,
                 const std::string& srcPath, const std::string& dstPath, const CloneOptions& options) {
  if (renameat2(dstDirFd, tmp.c_str(), dstDirFd, dstName.c_str(), RENAME_NOREPLACE) == 0) return;
  int err = errno;
  // A directory has no link(2) to publish it without replacing, and rename(2) replaces an empty one.
  if (noReplaceUnsupported(err))
    throwCode("ERR_RENAME_NOREPLACE_UNSUPPORTED",
              "the file system cannot rename without replacing (renameat2 RENAME_NOREPLACE), which publishing a "
              "directory needs",
              err, "renameat2", srcPath, dstPath);
  if (err != EEXIST || !options.overwrite) throwErrno(err, "renameat2", srcPath, dstPath);
  // Replace an existing destination atomically: swap it with the new tree, then remove the old one
  // (now under the temp name).
  if (renameat2(dstDirFd, tmp.c_str(), dstDirFd, dstName.c_str(), RENAME_EXCHANGE) != 0)
    throwErrno(errno, "renameat2", srcPath, dstPath);
  removeTreeNoFollow(dstDirFd, tmp, tmpPath);
}

// clonePathAt of the source `src` already open (stat `st`: a regular file or a directory).
CloneSummary cloneOpenSource(int src, const struct stat& st, const std::string& srcPath, int dstDirFd,
                             const std::string& dstName, const std::string& dstPath, const CloneOptions& options,
                             CloneProgress* progress, SourceIdentity* identity) {
  if (!S_ISDIR(st.st_mode))
    return cloneOneFile(src, st, srcPath, dstDirFd, dstName, dstPath, options, progress, identity);
  fillIdentity(identity, st);
  checkSameFs(st, dstDirFd, options, srcPath, dstPath);
  CloneOptions treeOptions = options;
  treeOptions.cache = nullptr;  // trees are cloned as they are (the cache keeps single files)

  // The tree is built under a private temp name (0700 until its own metadata is applied, last).
  std::string tmp = layout::kCloneTmpPrefix + randomHex(8);
  if (mkdirat(dstDirFd, tmp.c_str(), 0700) != 0) throwErrno(errno, "mkdir", dstPath);
  std::string parentPath, leaf;
  splitPath(dstPath, &parentPath, &leaf);
  std::string tmpPath = parentPath + "/" + tmp;
  try {
    UniqueFd root(openat(dstDirFd, tmp.c_str(), kDirFlags));
    if (!root) throwErrno(errno, "open", dstPath);
    CloneSummary summary = cloneTreeAs(src, st, root.get(), srcPath, dstPath, treeOptions, progress);
    if (options.durable && fsync(root.get()) != 0) throwErrno(errno, "fsync", dstPath);
    publishTree(dstDirFd, tmp, tmpPath, dstName, srcPath, dstPath, options);
    if (options.durable && fsync(dstDirFd) != 0) throwErrno(errno, "fsync", dstPath);
    return summary;
  } catch (...) {
    try {
      removeTreeNoFollow(dstDirFd, tmp, tmpPath);
    } catch (...) {
      // The original error is the one to report; what is left carries a .vmspace-tmp- name.
    }
    throw;
  }
}

// The parent directory of the absolute destination `dstPath` (its own path followed as given); *leaf: the last
// component.
UniqueFd openDestParent(const std::string& dstPath, std::string* leaf) {
  std::string parent;
  splitPath(dstPath, &parent, leaf);
  UniqueFd dir(open(parent.c_str(), kDirPathFlags));
  if (!dir) throwErrno(errno, "open", dstPath);
  return dir;
}

}  // namespace

CloneSummary clonePathAt(const std::string& srcPath, int dstDirFd, const std::string& dstName,
                         const std::string& dstPath, const CloneOptions& options, CloneProgress* progress,
                         SourceIdentity* identity) {
  struct stat st;
  UniqueFd src = openSource(srcPath, dstPath, &st);
  return cloneOpenSource(src.get(), st, srcPath, dstDirFd, dstName, dstPath, options, progress, identity);
}

CloneSummary clonePath(const std::string& srcPath, const std::string& dstPath, const CloneOptions& options,
                       CloneProgress* progress) {
  std::string leaf;
  UniqueFd dir = openDestParent(dstPath, &leaf);
  return clonePathAt(srcPath, dir.get(), leaf, dstPath, options, progress);
}

CloneSummary cloneOutBeneath(int baseFd, const std::string& basePath, const std::string& rel,
                             const std::string& dstPath, const CloneOptions& options, CloneProgress* progress) {
  struct stat st;
  UniqueFd src = openSourceBeneath(baseFd, basePath, rel, dstPath, &st);
  std::string leaf;
  UniqueFd dir = openDestParent(dstPath, &leaf);
  return cloneOpenSource(src.get(), st, basePath + "/" + rel, dir.get(), leaf, dstPath, options, progress, nullptr);
}

CloneSummary clonePathBeneath(const std::string& srcPath, int baseFd, const std::string& basePath,
                              const std::string& rel, const CloneOptions& options, CloneProgress* progress) {
  std::string leaf;
  ParentDir dir = openParentBeneath(baseFd, rel, &leaf, basePath, false);
  return clonePathAt(srcPath, dir.get(), leaf, basePath + "/" + rel, options, progress);
}

}  // namespace vmspace

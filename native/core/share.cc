// Shared files of a template (share.h): opened beneath the workspace without a symlink, linked or cloned into the
// template's staging entry at commit, linked into each workspace at allocate.
#include "share.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <utility>
#include <vector>

#include "clone.h"
#include "error.h"
#include "fallback.h"
#include "fd.h"
#include "io.h"
#include "layout.h"
#include "lease.h"

namespace vmspace {
namespace {

constexpr size_t kMaxSharedPathsBytes = kMaxSharedFiles * 4097;

[[noreturn]] void badShare(const std::string& path, const std::string& why) {
  throwCode("ERR_INVALID_ARG_VALUE", "options.share: '" + path + "' " + why, EINVAL, "open", path);
}

// The entry at `rel` beneath `wsFd` as an O_PATH descriptor, never through a symlink (a symlink at the end is
// returned as itself): openat2 RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_XDEV, or where it is missing a
// component walk with O_NOFOLLOW that refuses a symlink (ELOOP) or another device (EXDEV) on the way. -1 and errno.
int openBeneathNoSymlinks(int wsFd, const std::string& rel) {
  if (!kTestFallback.noOpenat2) {
    int fd = openat2Raw(wsFd, rel.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC,
                        kResolveBeneath | kResolveNoSymlinks | kResolveNoMagicLinks | kResolveNoXdev);
    // EAGAIN: a rename elsewhere raced the resolution; the walk below has no such check to fail.
    if (fd >= 0 || (errno != ENOSYS && errno != EAGAIN)) return fd;
  }
  struct stat root;
  if (fstat(wsFd, &root) != 0) return -1;
  UniqueFd dir(fcntl(wsFd, F_DUPFD_CLOEXEC, 0));
  for (size_t start = 0; dir;) {
    size_t slash = rel.find('/', start);
    UniqueFd next(openat(dir.get(), rel.substr(start, slash - start).c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (!next || slash == std::string::npos) return next.release();
    struct stat st;
    if (fstat(next.get(), &st) != 0) return -1;
    errno = S_ISLNK(st.st_mode) ? ELOOP : !S_ISDIR(st.st_mode) ? ENOTDIR : st.st_dev != root.st_dev ? EXDEV : 0;
    if (errno) return -1;
    dir = std::move(next);
    start = slash + 1;
  }
  return -1;
}

// The regular file at `rel` beneath the workspace (openBeneathNoSymlinks); with `strict` false, an entry that is
// missing or is no such file gives an empty source (an inherited path the guest changed) instead of an error.
ShareSource openSource(int wsFd, const std::string& wsPath, const std::string& rel, bool strict) {
  ShareSource s;
  s.path = rel;
  s.fd.reset(openBeneathNoSymlinks(wsFd, rel));
  if (!s.fd) {
    // An inherited path the guest removed, or turned into (or put under) a symlink or a mount: not shared any more.
    bool changed = errno == ENOENT || errno == ENOTDIR || errno == ELOOP || errno == EXDEV;
    if (!strict && changed) return s;
    if (errno == ELOOP) badShare(rel, "has a symlink on the way (never followed)");
    if (errno == EXDEV) badShare(rel, "is on another mount than the workspace");
    throwErrno(errno, "open", wsPath + "/" + rel);
  }
  if (fstat(s.fd.get(), &s.st) != 0) throwErrno(errno, "fstat", wsPath + "/" + rel);
  if (!S_ISREG(s.st.st_mode)) {
    if (!strict) {
      s.fd.reset();
      return s;
    }
    badShare(rel, S_ISLNK(s.st.st_mode) ? "is a symlink (never followed)" : "is not a regular file");
  }
  return s;
}

// Whether `s` is the inode of shared/<index> of the parent template `parentFd`.
bool isParentInode(int parentFd, size_t index, const ShareSource& s) {
  struct stat st;
  std::string name = std::string(layout::kShared) + "/" + std::to_string(index);
  return fstatat(parentFd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == s.st.st_dev &&
         st.st_ino == s.st.st_ino;
}

// The data of `s` cloned into the new file `name` of `sharedFd`, checked unchanged, made read-only.
uint64_t cloneSharedData(const ShareSource& s, int sharedFd, const std::string& name, const std::string& shown,
                         const CloneOptions& options) {
  std::string proc = "/proc/self/fd/" + std::to_string(s.fd.get());
  // Reopened through the O_PATH descriptor: the inode checked, never a name a guest could swap meanwhile.
  UniqueFd src(open(proc.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!src) throwErrno(errno, "open", s.path);
  struct stat st;
  if (fstat(src.get(), &st) != 0) throwErrno(errno, "fstat", s.path);
  UniqueFd dst(openat(sharedFd, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600));
  if (!dst) throwErrno(errno, "open", shown);
  CloneFileResult r = cloneData(src.get(), dst.get(), st, options.reflink, s.path, shown);
  checkSourceUnchanged(src.get(), st, s.path, shown);
  // As lease files: root's belong to kLeaseUid, so no holder owns (and could chmod) them; EINVAL: not mapped here.
  if (geteuid() == 0 && fchown(dst.get(), kLeaseUid, static_cast<gid_t>(-1)) != 0 && errno != EINVAL)
    throwErrno(errno, "fchown", shown);
  if (fchmod(dst.get(), 0444) != 0) throwErrno(errno, "fchmod", shown);
  if (options.durable && fsync(dst.get()) != 0) throwErrno(errno, "fsync", shown);
  return r.bytes;
}

// linkat(2) into `parentFd`, a directory of the new tree without its owner's write bit (its mode as committed, 0555
// say, which root's linkat ignores): given that bit for the call, then its mode back. False (errno: the linkat's
// EACCES) where that cannot help: the bit is there, or the directory is not ours.
bool linkIntoReadOnlyDir(int sharedFd, const std::string& name, int parentFd, const std::string& leaf,
                         const std::string& shown) {
  struct stat st;
  if (fstat(parentFd, &st) != 0 || (st.st_mode & S_IWUSR) || st.st_uid != geteuid() ||
      fchmod(parentFd, (st.st_mode & 07777) | S_IWUSR) != 0) {
    errno = EACCES;
    return false;
  }
  int rc = linkat(sharedFd, name.c_str(), parentFd, leaf.c_str(), 0), err = errno;
  if (fchmod(parentFd, st.st_mode & 07777) != 0) throwErrno(errno, "fchmod", shown);
  errno = err;
  return rc == 0;
}

}  // namespace

void throwShareUnsupported(const std::string& path, const std::string& why) {
  throwCode("ERR_SHARE_UNSUPPORTED", "the shared file '" + path + "' cannot be hard-linked " + why, EXDEV, "linkat",
            path);
}

std::vector<ShareSource> openShareSources(int wsFd, const std::string& wsPath, const std::vector<std::string>& share,
                                          int parentFd, const std::string& parentPath) {
  std::vector<std::string> inherited;
  if (parentFd >= 0) inherited = readSharedPaths(parentFd, parentPath + "/" + layout::kSharedPaths);
  std::vector<ShareSource> out;
  auto parentIndex = [&](const std::string& rel) {
    for (size_t i = 0; i < inherited.size(); i++)
      if (inherited[i] == rel) return i;
    return inherited.size();
  };
  for (const std::string& rel : share) {
    ShareSource s = openSource(wsFd, wsPath, rel, true);
    size_t i = parentIndex(rel);
    s.inherited = i < inherited.size() && isParentInode(parentFd, i, s);
    out.push_back(std::move(s));
  }
  // A path the parent shared stays shared while the workspace's file is still that inode (a guest that replaced it
  // made it its own).
  for (size_t i = 0; i < inherited.size() && out.size() < kMaxSharedFiles; i++) {
    bool named = false;
    for (const std::string& rel : share) named = named || rel == inherited[i];
    if (named) continue;
    ShareSource s = openSource(wsFd, wsPath, inherited[i], false);
    if (!s.fd || !isParentInode(parentFd, i, s)) continue;
    s.inherited = true;
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<uint64_t> writeSharedFiles(int leaseFd, const std::string& stagingPath, std::vector<ShareSource>& sources,
                                       const CloneOptions& options) {
  const std::string dirShown = stagingPath + "/" + layout::kShared;
  if (mkdirat(leaseFd, layout::kShared, 0700) != 0) throwErrno(errno, "mkdir", dirShown);
  UniqueFd dir(openat(leaseFd, layout::kShared, kDirFlags));
  if (!dir) throwErrno(errno, "open", dirShown);
  std::vector<uint64_t> bytes;
  for (size_t i = 0; i < sources.size(); i++) {
    ShareSource& s = sources[i];
    std::string name = std::to_string(i), shown = dirShown + "/" + name;
    if (s.inherited) {
      // The parent's inode itself, through the descriptor checked against it: no data read.
      int err = linkTmpfile(s.fd.get(), dir.get(), name.c_str());
      if (err == 0) {
        bytes.push_back(static_cast<uint64_t>(s.st.st_size));
        continue;
      }
      if (err != EXDEV) throwErrno(err, "linkat", s.path, shown);
      s.inherited = false;  // another subvolume: its data cloned, as for a file of the workspace's own
    }
    bytes.push_back(cloneSharedData(s, dir.get(), name, shown, options));
  }
  if (options.durable && fsync(dir.get()) != 0) throwErrno(errno, "fsync", dirShown);
  if (fchmod(dir.get(), 0555) != 0) throwErrno(errno, "fchmod", dirShown);
  return bytes;
}

std::vector<std::string> readSharedPaths(int templateFd, const std::string& shown) {
  std::string text;
  int err = readRegularFileAt(templateFd, layout::kSharedPaths, O_NOFOLLOW, kMaxSharedPathsBytes, &text);
  if (err == ENOENT) return {};
  if (err) throwErrno(err, "open", shown);
  std::vector<std::string> paths;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\0', at);
    if (end == std::string::npos) break;  // no NUL after it: not a path the commit wrote
    paths.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  return paths;
}

void linkSharedFiles(int templateFd, const std::string& templatePath, const std::vector<std::string>& paths, int wsFd,
                     const std::string& wsPath) {
  if (paths.empty()) return;
  const std::string dirShown = templatePath + "/" + layout::kShared;
  UniqueFd dir(openat(templateFd, layout::kShared, kDirFlags));
  if (!dir) throwErrno(errno, "open", dirShown);
  for (size_t i = 0; i < paths.size(); i++) {
    std::string leaf, name = std::to_string(i);
    ParentDir parent = openParentBeneath(wsFd, paths[i], &leaf, wsPath, false);
    if (linkat(dir.get(), name.c_str(), parent.get(), leaf.c_str(), 0) == 0) continue;
    if (errno == EACCES && linkIntoReadOnlyDir(dir.get(), name, parent.get(), leaf, wsPath + "/" + paths[i])) continue;
    if (errno == EXDEV) throwShareUnsupported(paths[i], "into the workspace: another subvolume or project id");
    throwErrno(errno, "linkat", dirShown + "/" + name, wsPath + "/" + paths[i]);
  }
}

}  // namespace vmspace

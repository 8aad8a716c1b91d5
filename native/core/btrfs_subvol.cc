#include "btrfs_subvol.h"

#include <fcntl.h>
#include <linux/btrfs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fd.h"
#include "fs_kind.h"
#include "process.h"
#include "remove.h"

namespace vmspace {

int makeWorkspaceDir(int parentFd, const std::string& name, mode_t mode, bool subvolume) {
  if (!subvolume) return mkdirat(parentFd, name.c_str(), mode) == 0 ? 0 : errno;
  struct btrfs_ioctl_vol_args args;
  memset(&args, 0, sizeof args);
  if (name.size() > BTRFS_PATH_NAME_MAX) return ENAMETOOLONG;
  memcpy(args.name, name.data(), name.size());
  // EEXIST for an existing name, as mkdirat: the exclusive claim on the name is the same.
  if (ioctl(parentFd, BTRFS_IOC_SUBVOL_CREATE, &args) != 0) return errno;
  // The subvolume's root is made 0777 less the umask whatever we want (btrfs takes no mode): give it mkdir(2)'s
  // mode (mode & ~umask & 01777, keeping a setgid inherited from the parent). Nobody else can enter staging/.
  UniqueFd fd(openat(parentFd, name.c_str(), kDirFlags));
  struct stat st;
  int err = 0;
  if (!fd || fstat(fd.get(), &st) != 0 ||
      fchmod(fd.get(), (mode & ~currentUmask() & 01777) | (st.st_mode & S_ISGID)) != 0)
    err = errno;
  if (err) {
    fd.reset();
    if (unlinkat(parentFd, name.c_str(), AT_REMOVEDIR) != 0) destroySubvolume(parentFd, name);
    return err;
  }
  return 0;
}

int makeWorkspaceSnapshot(int srcFd, int parentFd, const std::string& name, mode_t mode) {
  struct stat parent;
  if (fstat(parentFd, &parent) != 0) return errno;
  if (int err = snapshotSubvolume(srcFd, parentFd, name, false)) return err;
  // The snapshot's root keeps the source root's mode, owner and group: give it what mkdir(2) would have made
  // (mode & ~umask & 01777; a setgid parent's group and setgid bit).
  UniqueFd fd(openat(parentFd, name.c_str(), kDirFlags));
  int err = 0;
  mode_t bits = mode & ~currentUmask() & 01777;
  if (parent.st_mode & S_ISGID) bits |= S_ISGID;
  if (!fd || ((parent.st_mode & S_ISGID) && fchown(fd.get(), static_cast<uid_t>(-1), parent.st_gid) != 0) ||
      fchmod(fd.get(), bits) != 0)
    err = errno;
  if (err) {
    fd.reset();
    if (destroySubvolume(parentFd, name) != 0) {
      try {
        removeTreeNoFollow(parentFd, name, name);
      } catch (...) {
        // Left in staging, unlocked: a sweep reclaims it. The errno to report is the one above.
      }
    }
    return err;
  }
  return 0;
}

int destroySubvolume(int parentFd, const std::string& name) {
  struct btrfs_ioctl_vol_args args;
  memset(&args, 0, sizeof args);
  if (name.size() > BTRFS_PATH_NAME_MAX) return ENAMETOOLONG;
  memcpy(args.name, name.data(), name.size());
  return ioctl(parentFd, BTRFS_IOC_SNAP_DESTROY, &args) == 0 ? 0 : errno;
}

bool isSubvolumeRoot(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 && st.st_ino == kBtrfsFirstFreeObjectId && S_ISDIR(st.st_mode) &&
         fsKindOf(fd) == FsKind::Btrfs;
}

int hasChildSubvolumes(int fd, bool* has) {
  struct btrfs_ioctl_get_subvol_rootref_args args;
  memset(&args, 0, sizeof args);
  // EOVERFLOW: more than one buffer of them, which answers the question as well.
  if (ioctl(fd, BTRFS_IOC_GET_SUBVOL_ROOTREF, &args) != 0 && errno != EOVERFLOW) return errno;
  *has = args.num_items > 0;
  return 0;
}

int snapshotSubvolume(int srcFd, int parentFd, const std::string& name, bool readOnly) {
  struct btrfs_ioctl_vol_args_v2 args;
  memset(&args, 0, sizeof args);
  if (name.size() > BTRFS_SUBVOL_NAME_MAX) return ENAMETOOLONG;
  args.fd = srcFd;
  args.flags = readOnly ? BTRFS_SUBVOL_RDONLY : 0;
  memcpy(args.name, name.data(), name.size());
  return ioctl(parentFd, BTRFS_IOC_SNAP_CREATE_V2, &args) == 0 ? 0 : errno;
}

int setSubvolumeReadOnly(int fd, bool readOnly) {
  uint64_t flags = 0;
  if (ioctl(fd, BTRFS_IOC_SUBVOL_GETFLAGS, &flags) != 0) return errno;
  // Already so: no SETFLAGS, which needs ownership even when it changes nothing.
  if (((flags & BTRFS_SUBVOL_RDONLY) != 0) == readOnly) return 0;
  flags = readOnly ? (flags | BTRFS_SUBVOL_RDONLY) : (flags & ~uint64_t{BTRFS_SUBVOL_RDONLY});
  return ioctl(fd, BTRFS_IOC_SUBVOL_SETFLAGS, &flags) == 0 ? 0 : errno;
}

bool dropReadOnlySubvolume(int parentFd, const std::string& name) {
  UniqueFd fd(openat(parentFd, name.c_str(), kDirFlags));
  if (!fd || !isSubvolumeRoot(fd.get())) return false;
  uint64_t flags = 0;
  if (ioctl(fd.get(), BTRFS_IOC_SUBVOL_GETFLAGS, &flags) != 0 || !(flags & BTRFS_SUBVOL_RDONLY)) return false;
  fd.reset();
  if (destroySubvolume(parentFd, name) == 0) return true;
  // EPERM without privilege: the owner may still clear the flag, and the walk then removes it entry by entry.
  UniqueFd again(openat(parentFd, name.c_str(), kDirFlags));
  if (again) setSubvolumeReadOnly(again.get(), false);
  return false;
}

// BTRFS_IOC_INO_LOOKUP with objectid 256 answers without privilege.
int subvolumeIdOf(int fd, uint64_t* id) {
  struct btrfs_ioctl_ino_lookup_args a;
  memset(&a, 0, sizeof a);
  a.treeid = 0;
  a.objectid = kBtrfsFirstFreeObjectId;
  if (ioctl(fd, BTRFS_IOC_INO_LOOKUP, &a) != 0) return errno;
  *id = a.treeid;
  return 0;
}

}  // namespace vmspace

// Btrfs subvolumes: workspaces made as subvolumes or snapshots, template trees snapshotted read-only, and their
// removal (BTRFS_IOC_* ioctls, include/uapi/linux/btrfs.h). Quotas on them are quota.h's.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace vmspace {

// BTRFS_FIRST_FREE_OBJECTID: the inode number of every subvolume's root directory.
constexpr uint64_t kBtrfsFirstFreeObjectId = 256;

// Makes directory `name` below `parentFd` with `mode` (less the umask, as mkdir(2)): a btrfs subvolume when
// `subvolume`. Returns 0 or the errno (EEXIST for a name that exists), as mkdirat does.
int makeWorkspaceDir(int parentFd, const std::string& name, mode_t mode, bool subvolume);

// Makes `name` below `parentFd` a writable snapshot of the btrfs subvolume of `srcFd` with mkdir(2)'s mode
// (allocate from a subvolume template). Returns 0 or the errno (EEXIST as mkdirat; EPERM, EXDEV: no
// snapshot here, see snapshotSubvolume).
int makeWorkspaceSnapshot(int srcFd, int parentFd, const std::string& name, mode_t mode);

// Deletes the empty btrfs subvolume `name` in `parentFd` (BTRFS_IOC_SNAP_DESTROY), for kernels or mounts where
// rmdir(2) of it is refused. Returns 0 or the errno.
int destroySubvolume(int parentFd, const std::string& name);

// Btrfs subvolume snapshots (templates). Each int-returning one returns 0 or the errno of the ioctl.
// Whether `fd` is the root directory of a btrfs subvolume (the file system is btrfs and the inode is 256).
bool isSubvolumeRoot(int fd);
// Whether the subvolume of `fd` has subvolumes directly below it (BTRFS_IOC_GET_SUBVOL_ROOTREF, Linux 4.18,
// unprivileged): a snapshot leaves them out (an empty directory in their place), so the caller walks instead.
int hasChildSubvolumes(int fd, bool* has);
// Snapshots the subvolume of `srcFd` to `name` below `parentFd` (BTRFS_IOC_SNAP_CREATE_V2), read-only or not.
// Unprivileged when the caller owns the source's root directory (fs/btrfs/ioctl.c: inode_owner_or_capable),
// else EPERM; EXDEV across file systems.
int snapshotSubvolume(int srcFd, int parentFd, const std::string& name, bool readOnly);
// Sets or clears BTRFS_SUBVOL_RDONLY (BTRFS_IOC_SUBVOL_SETFLAGS; the owner of the subvolume's root or
// CAP_SYS_ADMIN).
int setSubvolumeReadOnly(int fd, bool readOnly);
// Readies the directory `name` below `parentFd` for removal when it is a read-only subvolume root: deleted at
// once by BTRFS_IOC_SNAP_DESTROY (CAP_SYS_ADMIN, or the user_subvol_rm_allowed mount option), else made
// writable so that a walk can empty it and rmdir(2) delete it (Linux 4.18). Returns true when it is gone; false
// when it is not a subvolume or left for the walk. Never throws (the walk reports what stands).
bool dropReadOnlySubvolume(int parentFd, const std::string& name);

// The subvolume id of the tree holding `fd` (its qgroup is 0/<id>). Returns 0 or the errno of the ioctl.
int subvolumeIdOf(int fd, uint64_t* id);

}  // namespace vmspace

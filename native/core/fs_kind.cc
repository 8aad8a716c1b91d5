#include "fs_kind.h"

#include <sys/statfs.h>

namespace vmspace {
namespace {

struct FsMagic {
  unsigned long magic;
  FsKind kind;
  const char* name;
};

// f_type values (include/uapi/linux/magic.h, named in the comment): literals, since older <linux/magic.h> lack
// some (XFS_SUPER_MAGIC was xfs_fs.h's; BCACHEFS_SUPER_MAGIC is recent; OpenZFS is out of tree).
constexpr FsMagic kFsMagics[] = {
    {0xEF53UL, FsKind::Ext4, "ext4"},                  // EXT4_SUPER_MAGIC (EXT2_, EXT3_ too)
    {0x58465342UL, FsKind::Xfs, "XFS"},                // XFS_SUPER_MAGIC ("XFSB")
    {0x9123683EUL, FsKind::Btrfs, "btrfs"},            // BTRFS_SUPER_MAGIC
    {0x01021994UL, FsKind::Tmpfs, "tmpfs"},            // TMPFS_MAGIC
    {0x858458F6UL, FsKind::Ramfs, "ramfs"},            // RAMFS_MAGIC
    {0xF2F52010UL, FsKind::F2fs, "F2FS"},              // F2FS_SUPER_MAGIC
    {0x794C7630UL, FsKind::Overlayfs, "overlayfs"},    // OVERLAYFS_SUPER_MAGIC
    {0xCA451A4EUL, FsKind::Bcachefs, "bcachefs"},      // BCACHEFS_SUPER_MAGIC
    {0x2FC12FC1UL, FsKind::Zfs, "ZFS"},                // OpenZFS (ZFS_SUPER_MAGIC, not in linux/magic.h)
    {0x9FA0UL, FsKind::Proc, "procfs"},                // PROC_SUPER_MAGIC
    {0x62656572UL, FsKind::Sysfs, "sysfs"},            // SYSFS_MAGIC
    {0x64626720UL, FsKind::Debugfs, "debugfs"},        // DEBUGFS_MAGIC
    {0x74726163UL, FsKind::Tracefs, "tracefs"},        // TRACEFS_MAGIC
    {0x73636673UL, FsKind::Securityfs, "securityfs"},  // SECURITYFS_MAGIC
    {0x0027E0EBUL, FsKind::Cgroup, "cgroup"},          // CGROUP_SUPER_MAGIC
    {0x63677270UL, FsKind::Cgroup2, "cgroup2"},        // CGROUP2_SUPER_MAGIC
};

}  // namespace

FsKind fsKindOf(int fd, unsigned long* magic) {
  struct statfs sfs;
  if (magic) *magic = 0;
  if (fstatfs(fd, &sfs) != 0) return FsKind::Unknown;
  auto type = static_cast<unsigned long>(sfs.f_type);
  if (magic) *magic = type;
  for (const FsMagic& m : kFsMagics)
    if (m.magic == type) return m.kind;
  return FsKind::Other;
}

const char* fsKindName(FsKind kind) {
  for (const FsMagic& m : kFsMagics)
    if (m.kind == kind) return m.name;
  return kind == FsKind::Unknown ? "unknown" : "other";
}

}  // namespace vmspace

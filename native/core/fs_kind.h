// The file system an fd is on, by its statfs(2) f_type: the one table of magic numbers the core compares against.
#pragma once

namespace vmspace {

enum class FsKind {
  Ext4,  // ext2 and ext3 share its magic
  Xfs,
  Btrfs,
  Tmpfs,
  Ramfs,
  F2fs,
  Overlayfs,
  Bcachefs,
  Zfs,  // OpenZFS
  Proc,
  Sysfs,
  Debugfs,
  Tracefs,
  Securityfs,
  Cgroup,
  Cgroup2,
  Other,    // a file system not in the table (FUSE, NFS, binfmt_misc, ...)
  Unknown,  // fstatfs(2) failed: errno says why
};

// The kind of the file system holding `fd` (fstatfs(2)); `magic` (optional) receives its f_type (0 when Unknown).
// Unknown with errno set when fstatfs fails; never throws.
FsKind fsKindOf(int fd, unsigned long* magic = nullptr);

// The name of a kind as messages give it ("XFS", "ext4", "btrfs", ...; "other" and "unknown").
const char* fsKindName(FsKind kind);

// The file systems with per-directory project quotas vmspace sets (quota.h): XFS and ext4.
inline bool hasProjectQuotas(FsKind kind) { return kind == FsKind::Xfs || kind == FsKind::Ext4; }

}  // namespace vmspace

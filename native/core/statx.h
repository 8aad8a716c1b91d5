// statx(2) helpers. The mount id (STATX_MNT_ID, Linux 5.8) tells a bind mount of the same file system apart,
// which st_dev cannot; where the kernel does not report it, the device number stands in.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cstdint>
#include <functional>

namespace vmspace {

inline int statxFd(int fd, unsigned mask, struct statx* out) {
  return statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, mask, out);
}

inline uint64_t mountOf(const struct statx& s) {
  if (s.stx_mask & STATX_MNT_ID) return s.stx_mnt_id;
  return (uint64_t{1} << 63) | (uint64_t{s.stx_dev_major} << 32) | s.stx_dev_minor;
}

// A file's identity (device, inode) as a hash key: hard links in a tree clone, directories a removal could not
// remove.
struct InodeKey {
  dev_t dev;
  ino_t ino;
  bool operator==(const InodeKey& o) const { return dev == o.dev && ino == o.ino; }
};
struct InodeHash {
  size_t operator()(const InodeKey& k) const { return std::hash<uint64_t>()(k.ino * 31 + k.dev); }
};

}  // namespace vmspace

// statx(2) helpers. The mount id (STATX_MNT_ID, Linux 5.8) tells a bind mount of the same file system apart,
// which st_dev cannot; where the kernel does not report it, name_to_handle_at(2) gives the same id (Linux 2.6.39),
// and where that fails too, the device number stands in.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cstdint>
#include <functional>

#include "compat.h"
#include "fallback.h"

#if defined(STATX_MNT_ID) && !defined(VMSPACE_TEST_OLD_HEADERS)
#define VMSPACE_HAVE_STATX_MNT_ID 1
#endif

namespace vmspace {

// The statx mask bit to ask for the mount id with; 0 where the headers predate it (glibc < 2.32 with kernel
// headers < 5.8, e.g. RHEL 8), and mountOf asks name_to_handle_at instead.
#ifdef VMSPACE_HAVE_STATX_MNT_ID
constexpr unsigned kStatxMntId = STATX_MNT_ID;
#else
constexpr unsigned kStatxMntId = 0;
#endif

inline int statxFd(int fd, unsigned mask, struct statx* out) {
  return statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, mask, out);
}

// The mount `fd` (whose statx is `s`) is on, as a number that differs between any two mounts.
inline uint64_t mountOf(int fd, const struct statx& s) {
#ifdef VMSPACE_HAVE_STATX_MNT_ID
  if ((s.stx_mask & STATX_MNT_ID) && !kTestFallback.noMountId) return s.stx_mnt_id;
#endif
  if (!kTestFallback.noFileHandle) {
    // The same mnt_id as statx reports (both are the kernel's struct mount id). EOPNOTSUPP/ENOSYS/EPERM: a file
    // system without file handles, or a seccomp filter; the device number is all that is left then.
    alignas(struct file_handle) unsigned char buf[sizeof(struct file_handle) + MAX_HANDLE_SZ];
    auto* handle = reinterpret_cast<struct file_handle*>(buf);
    handle->handle_bytes = MAX_HANDLE_SZ;
    int mnt = 0;
    if (name_to_handle_at(fd, "", handle, &mnt, AT_EMPTY_PATH) == 0) return static_cast<uint32_t>(mnt);
  }
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

// System-call wrappers a libc may lack, as raw syscall(2)s: renameat2 and statx (glibc 2.28; musl 1.2.5 has
// statx, musl 1.2.3 neither). glibc >= 2.28 keeps its own; any other libc gets these (a constant is no sign of
// the wrapper: <linux/fs.h> defines RENAME_NOREPLACE too). -DVMSPACE_TEST_OLD_HEADERS uses them on glibc as well,
// so the tests run this code (see fallback.h).
#pragma once

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 28) && !defined(VMSPACE_TEST_OLD_HEADERS)
#define VMSPACE_LIBC_WRAPPERS 1
#endif

#ifndef VMSPACE_LIBC_WRAPPERS
#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)  // include/uapi/linux/fs.h
#define RENAME_EXCHANGE (1 << 1)
#endif
inline int vmspace_renameat2(int oldDirFd, const char* oldPath, int newDirFd, const char* newPath, unsigned flags) {
  return static_cast<int>(syscall(SYS_renameat2, oldDirFd, oldPath, newDirFd, newPath, flags));
}
#define renameat2(...) vmspace_renameat2(__VA_ARGS__)
#endif

#ifndef STATX_TYPE
#include <linux/stat.h>  // struct statx and STATX_* (kernel headers 4.11) where the libc has none
#endif
#ifndef VMSPACE_LIBC_WRAPPERS
#ifndef AT_STATX_DONT_SYNC
#define AT_STATX_DONT_SYNC 0x4000  // include/uapi/linux/fcntl.h
#endif
inline int vmspace_statx(int dirFd, const char* path, int flags, unsigned mask, struct statx* out) {
  return static_cast<int>(syscall(SYS_statx, dirFd, path, flags, mask, out));
}
#define statx(...) vmspace_statx(__VA_ARGS__)
#endif

// openat2(2) (Linux 5.6), called raw: a libc or kernel headers may lack it. Values of include/uapi/linux/openat2.h.
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
struct VmspaceOpenHow {
  unsigned long long flags, mode, resolve;
};
constexpr unsigned long long kResolveNoXdev = 0x01, kResolveNoMagicLinks = 0x02, kResolveNoSymlinks = 0x04,
                             kResolveBeneath = 0x08, kResolveInRoot = 0x10;
// An fd, or -1 with errno (ENOSYS: no openat2 in this kernel).
inline int openat2Raw(int dirFd, const char* path, unsigned long long flags, unsigned long long resolve) {
  VmspaceOpenHow how{flags, 0, resolve};
  return static_cast<int>(syscall(SYS_openat2, dirFd, path, &how, sizeof how));
}

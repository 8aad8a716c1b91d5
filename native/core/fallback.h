// Kernel and header fallbacks, and the test hook that forces them. Not a public API.
//
// VMSPACE_TEST_FALLBACK, read once when the addon loads, is a comma-separated list that makes the core take the
// path it takes on an older kernel, so tests run those paths on a new one:
//   mntid    statx(2) never reports STATX_MNT_ID (Linux < 5.8): the mount id comes from name_to_handle_at(2)
//   fhandle  name_to_handle_at(2) fails too (file systems without file handles): the device number stands in
//   openat2  openat2(2) is ENOSYS (Linux < 5.6): the layer applier resolves names by its component walk
// (The walks do not use openat2(2): they open each directory with O_NOFOLLOW from its parent's fd, and reopen a
// parent through ".." checked by device and inode, which works on every kernel.)
// Building with -DVMSPACE_TEST_OLD_HEADERS compiles as if STATX_MNT_ID were missing (glibc
// 2.28 with kernel headers 4.18, RHEL 8) and the libc had no renameat2/statx wrappers (compat.h): CI builds the
// core tests that way (cmake -DVMSPACE_TEST_OLD_HEADERS=ON).
#pragma once

#include <cstdlib>
#include <cstring>

namespace vmspace {

struct TestFallback {
  bool noMountId = false;
  bool noFileHandle = false;
  bool noOpenat2 = false;
};

inline TestFallback readTestFallback() {
  TestFallback f;
  const char* v = std::getenv("VMSPACE_TEST_FALLBACK");
  if (!v) return f;
  for (const char* p = v; *p;) {
    size_t n = std::strcspn(p, ",");
    auto is = [&](const char* word) { return n == std::strlen(word) && std::strncmp(p, word, n) == 0; };
    if (is("mntid")) f.noMountId = true;
    if (is("fhandle")) f.noMountId = f.noFileHandle = true;
    if (is("openat2")) f.noOpenat2 = true;
    p += n;
    if (*p == ',') ++p;
  }
  return f;
}

// Initialised when the addon (or a core test binary) is loaded; constant afterwards.
inline const TestFallback kTestFallback = readTestFallback();

}  // namespace vmspace

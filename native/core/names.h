// Workspace ids: 128 bits from getrandom(2) (drawn 256 bytes at a time per thread), as 32 lowercase hex characters.
#pragma once

#include <string>
#include <vector>

namespace vmspace {

constexpr int kIdHexChars = 32;

// True when `s` is an id: exactly kIdHexChars lowercase hex characters.
bool isHexId(const char* s, size_t len);
inline bool isHexId(const std::string& s) { return isHexId(s.data(), s.size()); }

// A fresh id. Draws from the test seam first while it holds ids (see setTestIds).
std::string randomId();

// A random hex string of `bytes` random bytes, for temp names (no test seam).
std::string randomHex(size_t bytes);

// Test seam: the next randomId() calls return these ids in order, then random ones again. Lets tests make a
// drawn name collide with an existing entry, which 128 random bits never do by chance. Process-wide. Test builds
// only (-DVMSPACE_TEST_HOOKS: CMakeLists.txt); the release addon (binding.gyp) has no such seam.
#ifdef VMSPACE_TEST_HOOKS
void setTestIds(std::vector<std::string> ids);
#endif

}  // namespace vmspace

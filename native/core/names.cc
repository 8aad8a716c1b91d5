#include "names.h"

#include <sys/random.h>

#include <cerrno>
#include <deque>
#include <mutex>

#include "error.h"

namespace vmspace {
namespace {

#ifdef VMSPACE_TEST_HOOKS
std::mutex g_testMutex;
std::deque<std::string> g_testIds;  // guarded by g_testMutex
bool g_testActive = false;          // read without the lock as a hint; the deque is the truth
#endif

void fillRandom(unsigned char* buf, size_t len) {
  size_t got = 0;
  while (got < len) {
    // getrandom(2) never returns short for <= 256 bytes once the pool is initialised; loop for EINTR anyway.
    ssize_t n = getrandom(buf + got, len - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throwErrno(errno, "getrandom");
    }
    got += static_cast<size_t>(n);
  }
}

}  // namespace

std::string randomHex(size_t bytes) {
  static const char kHex[] = "0123456789abcdef";
  unsigned char buf[64];
  if (bytes > sizeof buf) bytes = sizeof buf;
  fillRandom(buf, bytes);
  std::string out(bytes * 2, '0');
  for (size_t i = 0; i < bytes; i++) {
    out[2 * i] = kHex[buf[i] >> 4];
    out[2 * i + 1] = kHex[buf[i] & 15];
  }
  return out;
}

std::string randomId() {
#ifdef VMSPACE_TEST_HOOKS
  if (__atomic_load_n(&g_testActive, __ATOMIC_ACQUIRE)) {
    std::lock_guard<std::mutex> lock(g_testMutex);
    if (!g_testIds.empty()) {
      std::string id = std::move(g_testIds.front());
      g_testIds.pop_front();
      if (g_testIds.empty()) __atomic_store_n(&g_testActive, false, __ATOMIC_RELEASE);
      return id;
    }
  }
#endif
  return randomHex(kIdHexChars / 2);
}

#ifdef VMSPACE_TEST_HOOKS
void setTestIds(std::vector<std::string> ids) {
  std::lock_guard<std::mutex> lock(g_testMutex);
  g_testIds.assign(ids.begin(), ids.end());
  __atomic_store_n(&g_testActive, !g_testIds.empty(), __ATOMIC_RELEASE);
}
#endif

}  // namespace vmspace

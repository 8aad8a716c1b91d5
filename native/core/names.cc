#include "names.h"

#include <pthread.h>
#include <sys/random.h>

#include <atomic>
#include <cerrno>
#include <cstring>
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

// Random bytes drawn 256 at a time per thread (one getrandom(2) per 16 ids instead of one per id; 256
// bytes is the most getrandom never returns short). A forked child starts with its parent's unused bytes, so a
// fork (pthread_atfork) discards every thread's buffer: parent and child never draw the same name.
std::atomic<unsigned> g_forkGeneration{0};

struct RandomBuffer {
  unsigned char bytes[256];
  size_t used = sizeof bytes;  // empty until first filled
  unsigned generation = 0;
};

void takeRandom(unsigned char* out, size_t len) {
  static std::once_flag atfork;
  std::call_once(atfork, [] {
    // Failure (ENOMEM) leaves no handler: then every draw goes to the kernel.
    if (pthread_atfork(nullptr, nullptr, [] { g_forkGeneration.fetch_add(1, std::memory_order_relaxed); }) != 0)
      g_forkGeneration.store(1u << 31, std::memory_order_relaxed);
  });
  unsigned generation = g_forkGeneration.load(std::memory_order_relaxed);
  thread_local RandomBuffer buffer;
  if (len > sizeof buffer.bytes || generation & (1u << 31)) {
    fillRandom(out, len);
    return;
  }
  if (buffer.generation != generation || sizeof buffer.bytes - buffer.used < len) {
    fillRandom(buffer.bytes, sizeof buffer.bytes);
    buffer.used = 0;
    buffer.generation = generation;
  }
  std::memcpy(out, buffer.bytes + buffer.used, len);
  std::memset(buffer.bytes + buffer.used, 0, len);  // each byte is used once
  buffer.used += len;
}

}  // namespace

std::string randomHex(size_t bytes) {
  static const char kHex[] = "0123456789abcdef";
  unsigned char buf[64];
  if (bytes > sizeof buf) bytes = sizeof buf;
  takeRandom(buf, bytes);
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

bool isHexId(const char* s, size_t len) {
  if (len != static_cast<size_t>(kIdHexChars)) return false;
  for (size_t i = 0; i < len; i++) {
    char c = s[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace vmspace

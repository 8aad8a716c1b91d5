// The CPU-wait measure of the tree walk's threads (walk_threads.h: what it answers and why) and the summing of
// their counts.
#include "walk_threads.h"

#include <fcntl.h>
#include <time.h>

#include <cerrno>
#include <cstdlib>
#include <string>

#include "io.h"

namespace vmspace {

bool CpuWait::waitedLong() {
  if (!on_) return false;
  int64_t t = now();
  if (t - last_ < kIntervalNs) return false;
  last_ = t;
  uint64_t run, wait;
  if (!read(&run, &wait)) {
    on_ = false;
    return false;
  }
  uint64_t ran = run >= run0_ ? run - run0_ : 0, waited = wait >= wait0_ ? wait - wait0_ : 0;
  if (ran + waited < kMinSpanNs || waited < ran) return false;
  on_ = false;  // asked once: the limit is raised for the whole walk
  return true;
}

int64_t CpuWait::now() {
  struct timespec ts;
  if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) return 0;  // cannot fail with a valid clock id; checked anyway
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

bool CpuWait::read(uint64_t* run, uint64_t* wait) {
  std::string text;
  if (readRegularFileAt(AT_FDCWD, "/proc/thread-self/schedstat", 0, 256, &text) != 0) return false;
  const char* buf = text.c_str();
  char* end = nullptr;
  errno = 0;
  unsigned long long r = strtoull(buf, &end, 10);
  if (end == buf || *end != ' ' || errno != 0) return false;
  char* p = end + 1;
  unsigned long long w = strtoull(p, &end, 10);
  if (end == p || errno != 0) return false;
  *run = r;
  *wait = w;
  return true;
}

void addSummary(CloneSummary& into, const CloneSummary& s) {
  into.files += s.files;
  into.bytes += s.bytes;
  into.reflinked += s.reflinked;
  into.copied += s.copied;
  into.dirs += s.dirs;
  into.symlinks += s.symlinks;
  into.hardlinks += s.hardlinks;
  into.fifos += s.fifos;
  into.devices += s.devices;
  into.skippedSockets += s.skippedSockets;
  into.skippedDevices += s.skippedDevices;
}

}  // namespace vmspace

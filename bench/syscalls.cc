// The bare syscalls of allocate + lease + dispose, in a plain loop: the floor vmspace's overhead is measured
// against (bench/run.mjs). Same sequence as native/core/pool.cc without its checks, error paths or JS hops.
// Usage: syscalls DIR ITERATIONS META [THREADS MS]
//   META: vmspace's sequence with its metadata as 1 a file in meta/ and dispose through trash/ (vmspace before
//   issue 12), 2 a file and dispose by rmdir at the workspace's name (format 1 pools now), 3 an xattr of the
//   workspace directory and rmdir at the name, no meta/ unlink (format 2 pools), 4 as 3 with each thread building in
//   a staging shard of its own, staging/s<i> (format 3 pools); 0: 1 without any metadata; 5: mkdir + rmdir of a
//   random name in one directory, nothing else (the floor of mkdtemp + rm).
//   The name's random bytes come from a per-thread buffer refilled 256 bytes at a time, as in native/core/names.cc.
//   BODY (environment): bytes of metadata, default 200 (what allocate() writes without meta or template).
//   Without THREADS: prints the median ns per allocate+dispose pair of ITERATIONS pairs in one thread.
//   With THREADS: THREADS threads each run pairs back to back for MS milliseconds; prints the pairs per second.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

static std::string hex(size_t n) {
  thread_local unsigned char pool[256];
  thread_local size_t used = sizeof pool;
  if (sizeof pool - used < n) {
    if (getrandom(pool, sizeof pool, 0) != static_cast<ssize_t>(sizeof pool)) abort();
    used = 0;
  }
  unsigned char* b = pool + used;
  used += n;
  static const char* k = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; i++) s += k[b[i] >> 4], s += k[b[i] & 15];
  return s;
}

static int rootFd, staging, trash, metaFd, meta;
static std::string body(getenv("BODY") ? atoi(getenv("BODY")) : 200, 'x');

// Where this thread builds: staging/, or (META 4) staging/s<i>, one per thread as vmspace's pool threads.
static int stagingDir() {
  if (meta != 4) return staging;
  static std::atomic<int> next{0};
  thread_local int fd = -1;
  if (fd < 0) {
    std::string shard = "s" + std::to_string(next++ % 8);
    mkdirat(staging, shard.c_str(), 0700);
    fd = openat(staging, shard.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) abort();
  }
  return fd;
}

static bool pair() {
  const int staging = stagingDir();
  std::string name = "vm-" + hex(16);
  if (meta == 5) return mkdirat(rootFd, name.c_str(), 0700) == 0 && unlinkat(rootFd, name.c_str(), AT_REMOVEDIR) == 0;
  if (mkdirat(staging, name.c_str(), 0700) != 0) return false;
  int fd = openat(staging, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) != 0) return false;
  struct stat own, at;
  if (fstat(fd, &own) != 0 || fstatat(staging, name.c_str(), &at, AT_SYMLINK_NOFOLLOW) != 0) return false;
  std::string mname = name + ".json";
  if (meta == 1 || meta == 2) {
    std::string tmp = "." + mname + ".tmp-" + hex(6);
    int m = openat(metaFd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (m < 0 || fchmod(m, 0644) != 0 || write(m, body.data(), body.size()) != static_cast<ssize_t>(body.size()))
      return false;
    close(m);
    if (renameat2(metaFd, tmp.c_str(), metaFd, mname.c_str(), RENAME_NOREPLACE) != 0) return false;
  } else if (meta == 3 || meta == 4) {
    if (fsetxattr(fd, "user.vmspace.meta", body.data(), body.size(), 0) != 0) return false;
  }
  if (renameat2(staging, name.c_str(), rootFd, name.c_str(), RENAME_NOREPLACE) != 0) return false;
  // dispose
  if (meta >= 2) {
    // rmdir at the name, after the identity check
    if (fstatat(rootFd, name.c_str(), &at, AT_SYMLINK_NOFOLLOW) != 0 || at.st_ino != own.st_ino) return false;
    if (unlinkat(rootFd, name.c_str(), AT_REMOVEDIR) != 0) return false;
  } else {
    if (renameat2(rootFd, name.c_str(), trash, name.c_str(), RENAME_NOREPLACE) != 0) return false;
    if (fstatat(trash, name.c_str(), &at, AT_SYMLINK_NOFOLLOW) != 0) return false;
    if (unlinkat(trash, name.c_str(), AT_REMOVEDIR) != 0) return false;
  }
  if (meta == 1 || meta == 2) unlinkat(metaFd, mname.c_str(), 0);
  close(fd);
  return true;
}

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  std::string root = argv[1];
  int n = atoi(argv[2]);
  meta = atoi(argv[3]);
  mkdir(root.c_str(), 0755);
  rootFd = open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  mkdirat(rootFd, "staging", 0700);
  mkdirat(rootFd, "trash", 0700);
  mkdirat(rootFd, "meta", 0700);
  staging = openat(rootFd, "staging", O_RDONLY | O_DIRECTORY);
  trash = openat(rootFd, "trash", O_RDONLY | O_DIRECTORY);
  metaFd = openat(rootFd, "meta", O_RDONLY | O_DIRECTORY);
  if (argc >= 6) {
    int threads = atoi(argv[4]);
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(atoi(argv[5]));
    std::atomic<long> total{0};
    std::vector<std::thread> ts;
    auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; t++)
      ts.emplace_back([&] {
        long k = 0;
        while (std::chrono::steady_clock::now() < until) {
          if (!pair()) abort();
          k++;
        }
        total += k;
      });
    for (auto& t : ts) t.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("%.0f\n", total / s);
    return 0;
  }
  std::vector<double> ns;
  for (int i = 0; i < n; i++) {
    auto t0 = std::chrono::steady_clock::now();
    if (!pair()) return 1;
    ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ns.begin(), ns.end());
  printf("%.0f\n", ns[ns.size() / 2]);
  return 0;
}

// The bare syscalls of allocate + lease + dispose, in a plain loop: the floor vmspace's overhead is measured
// against (bench/run.mjs). Same sequence as native/core/pool.cc without its checks, error paths or JS hops.
// Usage: syscalls DIR ITERATIONS WITH_META(0|1)  -> prints the median ns per allocate+dispose pair.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static std::string hex(size_t n) {
  unsigned char b[32];
  getrandom(b, n, 0);
  static const char* k = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; i++) s += k[b[i] >> 4], s += k[b[i] & 15];
  return s;
}

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  std::string root = argv[1];
  int n = atoi(argv[2]);
  bool meta = atoi(argv[3]) != 0;
  mkdir(root.c_str(), 0755);
  int rootFd = open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  mkdirat(rootFd, "staging", 0700);
  mkdirat(rootFd, "trash", 0700);
  mkdirat(rootFd, "meta", 0700);
  int staging = openat(rootFd, "staging", O_RDONLY | O_DIRECTORY);
  int trash = openat(rootFd, "trash", O_RDONLY | O_DIRECTORY);
  int metaFd = openat(rootFd, "meta", O_RDONLY | O_DIRECTORY);
  std::string body(300, 'x');
  std::vector<double> ns;
  for (int i = 0; i < n; i++) {
    auto t0 = std::chrono::steady_clock::now();
    std::string name = "vm-" + hex(16);
    if (mkdirat(staging, name.c_str(), 0700) != 0) return 1;
    int fd = openat(staging, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    flock(fd, LOCK_EX | LOCK_NB);
    std::string mname = name + ".json";
    if (meta) {
      std::string tmp = "." + mname + ".tmp-" + hex(6);
      int m = openat(metaFd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (write(m, body.data(), body.size()) < 0) return 1;
      close(m);
      renameat2(metaFd, tmp.c_str(), metaFd, mname.c_str(), RENAME_NOREPLACE);
    }
    if (renameat2(staging, name.c_str(), rootFd, name.c_str(), RENAME_NOREPLACE) != 0) return 1;
    // dispose
    if (renameat2(rootFd, name.c_str(), trash, name.c_str(), RENAME_NOREPLACE) != 0) return 1;
    int d = openat(trash, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    close(d);
    unlinkat(trash, name.c_str(), AT_REMOVEDIR);
    if (meta) unlinkat(metaFd, mname.c_str(), 0);
    close(fd);
    ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ns.begin(), ns.end());
  printf("%.0f\n", ns[ns.size() / 2]);
  return 0;
}

// The bare syscalls of allocate + lease + dispose, in a plain loop: the floor vmspace's overhead is measured
// against (bench/run.mjs, bench/throughput.mjs). The same sequence as native/core/pool.cc and pool_publish.cc
// (PoolStage's direct path, Pool::takeSpare, Pool::dispose, Pool::keepSpare) for an empty workspace, without their
// error paths, fallbacks, locks or JS hops.
// Usage: syscalls DIR ITERATIONS META [THREADS MS]
//   META 6: vmspace's sequence, a spare lease file at hand (the steady state: dispose keeps the lease file of an
//   empty workspace as a spare, allocate takes one). allocate: fsetxattr(lease, user.vmspace.record) →
//   renameat2(leases/<y>/.spare-<r>, leases/<x>/<name>, RENAME_NOREPLACE) (<x>: the id's first hex digit; <y>: the
//   shard it was kept in) → mkdirat(DIR, name, 0700). dispose: fcntl(F_OFD_GETLK) → unlinkat(DIR, name,
//   AT_REMOVEDIR) → fstat(lease) + fstatat(leases/<x>/<name>) (still the inode held) → renameat2(leases/<x>/<name>,
//   leases/<x>/.spare-<r>, RENAME_NOREPLACE). 8 syscalls per pair, as `strace -f` of a serial allocate+dispose shows.
//   Each thread keeps its own spare (vmspace: up to 32 per pool, under a mutex).
//   META 7: the same without a spare (a pool's first allocate, or more than 32 workspaces live): the lease file made
//   unnamed, openat(O_TMPFILE) → fcntl(F_OFD_SETLK, read lock on byte 0) → (root only) fchown(-1, uid 4294967294) →
//   fchmod(0400 as root, else 0600) → fsetxattr → linkat(AT_EMPTY_PATH) under the name; then mkdirat. dispose:
//   fcntl(F_OFD_GETLK) → unlinkat(AT_REMOVEDIR) → unlink the lease file → close.
//   META 5: mkdir + rmdir of a random name in one directory, nothing else (the floor of mkdtemp + rm).
//   The name's random bytes come from a per-thread buffer refilled 256 bytes at a time, as in native/core/names.cc.
//   BODY (environment): bytes of the record, default 192 (what allocate() writes without meta or template).
//   Without THREADS: prints the median ns per allocate+dispose pair of ITERATIONS pairs in one thread.
//   With THREADS: THREADS threads each run pairs back to back for MS milliseconds; prints the pairs per second.
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
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

static int rootFd, meta, leaseDirs[16];
static const bool root = geteuid() == 0;
static std::string body(getenv("BODY") ? atoi(getenv("BODY")) : 192, 'x');

static int shardOf(const std::string& name) {
  char c = name[3];  // "vm-" then the id
  return c <= '9' ? c - '0' : c - 'a' + 10;
}
static int leaseDirOf(const std::string& name) { return leaseDirs[shardOf(name)]; }

// The spare lease file a thread holds between a dispose and the next allocate: its fd and its name below leases/.
struct Spare {
  int fd = -1;
  std::string rel;
};
thread_local Spare spare;
static int leasesFd;

// allocate's lease file: locked and given its record before it has a name, as native/core/lease.cc makeLeaseFile.
static int makeLease(int dir, const std::string& name) {
  int fd = openat(dir, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  struct flock fl = {};
  fl.l_type = F_RDLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = 0;  // the owner's byte
  fl.l_len = 1;
  if (fd < 0 || fcntl(fd, F_OFD_SETLK, &fl) != 0) return -1;
  // EINVAL: uid 4294967294 not mapped in this user namespace; vmspace then leaves the file root's, and so does this.
  if (root && fchown(fd, static_cast<uid_t>(-2), static_cast<gid_t>(-1)) != 0 && errno != EINVAL) return -1;
  if (fchmod(fd, root ? 0400 : 0600) != 0) return -1;
  if (fsetxattr(fd, "user.vmspace.record", body.data(), body.size(), 0) != 0) return -1;
  if (linkat(fd, "", dir, name.c_str(), AT_EMPTY_PATH) != 0) {
    // Without CAP_DAC_READ_SEARCH (not root): ENOENT, and vmspace links through /proc/self/fd instead.
    char proc[40];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    if (errno != ENOENT || linkat(AT_FDCWD, proc, dir, name.c_str(), AT_SYMLINK_FOLLOW) != 0) return -1;
  }
  return fd;
}

// META 7's dispose: the lease file unlinked (only if it is still the inode held) and closed.
static bool disposeFresh(int lease, int dir, const std::string& name) {
  struct flock q = {};
  q.l_type = F_WRLCK;  // over the whole file: any other holder's lock conflicts
  q.l_whence = SEEK_SET;
  if (fcntl(lease, F_OFD_GETLK, &q) != 0 || q.l_type != F_UNLCK) return false;
  if (unlinkat(rootFd, name.c_str(), AT_REMOVEDIR) != 0) return false;
  if (unlinkat(dir, name.c_str(), 0) != 0) return false;
  return close(lease) == 0;
}

// META 6: the spare's record written, the spare renamed to the name (Pool::takeSpare), the directory made.
static int takeSpare(const std::string& name) {
  std::string rel = std::string(1, "0123456789abcdef"[shardOf(name)]) + "/" + name;
  if (fsetxattr(spare.fd, "user.vmspace.record", body.data(), body.size(), 0) != 0) return -1;
  if (renameat2(leasesFd, spare.rel.c_str(), leasesFd, rel.c_str(), RENAME_NOREPLACE) != 0) return -1;
  int fd = spare.fd;
  spare.fd = -1;
  return mkdirat(rootFd, name.c_str(), 0700) == 0 ? fd : -1;
}

// META 6's dispose (Pool::dispose, Pool::keepSpare): rmdir at the name, then the lease file, if still the inode
// held, renamed to a spare name in its shard.
static bool disposeKeep(int lease, const std::string& name) {
  struct flock q = {};
  q.l_type = F_WRLCK;
  q.l_whence = SEEK_SET;
  if (fcntl(lease, F_OFD_GETLK, &q) != 0 || q.l_type != F_UNLCK) return false;
  if (unlinkat(rootFd, name.c_str(), AT_REMOVEDIR) != 0) return false;
  const std::string shard(1, "0123456789abcdef"[shardOf(name)]);
  std::string rel = shard + "/" + name, kept = shard + "/.spare-" + hex(8);
  struct stat at, own;
  if (fstat(lease, &own) != 0 || fstatat(leasesFd, rel.c_str(), &at, AT_SYMLINK_NOFOLLOW) != 0 ||
      at.st_ino != own.st_ino)
    return false;
  if (renameat2(leasesFd, rel.c_str(), leasesFd, kept.c_str(), RENAME_NOREPLACE) != 0) return false;
  spare.fd = lease;
  spare.rel = kept;
  return true;
}

static bool pair() {
  std::string name = "vm-" + hex(16);
  if (meta == 5) return mkdirat(rootFd, name.c_str(), 0700) == 0 && unlinkat(rootFd, name.c_str(), AT_REMOVEDIR) == 0;
  if (meta == 6 && spare.fd >= 0) {
    int lease = takeSpare(name);
    return lease >= 0 && disposeKeep(lease, name);
  }
  const int dir = leaseDirOf(name);
  int lease = makeLease(dir, name);
  if (lease < 0 || mkdirat(rootFd, name.c_str(), 0700) != 0) return false;
  // META 6's first pair of each thread makes the lease file it keeps from then on.
  return meta == 6 ? disposeKeep(lease, name) : disposeFresh(lease, dir, name);
}

// The pool's directories, as openPool makes them (only those the sequence touches).
static void makeDirs(const std::string& root) {
  mkdir(root.c_str(), 0755);
  rootFd = open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  mkdirat(rootFd, ".vmspace", 0755);
  mkdirat(rootFd, ".vmspace/leases", 0700);
  leasesFd = openat(rootFd, ".vmspace/leases", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (leasesFd < 0) abort();
  for (int i = 0; i < 16; i++) {
    std::string shard = std::string(".vmspace/leases/") + "0123456789abcdef"[i];
    mkdirat(rootFd, shard.c_str(), 0700);
    leaseDirs[i] = openat(rootFd, shard.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (leaseDirs[i] < 0) abort();
  }
}

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  int n = atoi(argv[2]);
  meta = atoi(argv[3]);
  if (meta < 5 || meta > 7) return 2;
  makeDirs(argv[1]);
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

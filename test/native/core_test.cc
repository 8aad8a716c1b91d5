// Tests of native/core on its own, without Node (ctest; also built with sanitizers: see .ci/run). Each check
// runs against a fresh directory under $TMPDIR (ext4 here, so clones copy).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../../native/core/clone.h"
#include "../../native/core/clone_path.h"
#include "../../native/core/error.h"
#include "../../native/core/fd.h"
#include "../../native/core/io.h"
#include "../../native/core/json_file.h"
#include "../../native/core/layout.h"
#include "../../native/core/lock.h"
#include "../../native/core/names.h"
#include "../../native/core/pool.h"
#include "../../native/core/remove.h"
#include "../../native/core/rename.h"
#include "../../native/core/tar.h"
#include "../../native/core/tree.h"
#include "../../native/core/walk.h"

using namespace vmspace;

static int failures = 0;
#define CHECK(cond)                                                                       \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      (void)std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                                         \
    }                                                                                     \
  } while (0)

static std::string fresh() {
  const char* base = getenv("TMPDIR");
  std::string t = std::string(base ? base : "/tmp") + "/vmspace-core-XXXXXX";
  return mkdtemp(&t[0]);
}

static void writeFile(const std::string& path, const std::string& data) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  CHECK(fd >= 0 && write(fd, data.data(), data.size()) == static_cast<ssize_t>(data.size()));
  CHECK(fd >= 0 && close(fd) == 0);
}

static bool exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

static int errorOf(const std::function<void()>& fn, std::string* code = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    if (code) *code = e.code;
    return e.err;
  }
  return 0;
}

static void removeNeverFollowsSymlinks() {
  std::string d = fresh();
  mkdir((d + "/outside").c_str(), 0700);
  writeFile(d + "/outside/keep", "keep");
  mkdir((d + "/tree").c_str(), 0700);
  mkdir((d + "/tree/sub").c_str(), 0500);  // read-only directory with an entry
  writeFile(d + "/tree/f", "x");
  symlink((d + "/outside").c_str(), (d + "/tree/link").c_str());
  symlink((d + "/outside").c_str(), (d + "/tree/sub/link2").c_str());
  removeTreeNoFollow(d + "/tree");
  CHECK(!exists(d + "/tree"));
  CHECK(exists(d + "/outside/keep"));
  CHECK(errorOf([&] { removeTreeNoFollow(d + "/tree"); }) == ENOENT);
  removeTreeNoFollow(d);
}

static void cloneKeepsHolesAndRefusesExisting() {
  std::string d = fresh();
  int fd = open((d + "/sparse").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0640);
  CHECK(pwrite(fd, "data", 4, 64 << 20) == 4);  // 64 MiB hole, then 4 bytes
  close(fd);
  CloneOptions opts;
  CloneSummary s = clonePath(d + "/sparse", d + "/copy", opts, nullptr);
  CHECK(s.files == 1 && s.bytes == (64u << 20) + 4);
  struct stat st;
  CHECK(stat((d + "/copy").c_str(), &st) == 0 && st.st_size == (64 << 20) + 4);
  CHECK(st.st_blocks * 512 < (1 << 20));  // the hole stayed a hole
  CHECK((st.st_mode & 0777) == 0640);
  CHECK(errorOf([&] { clonePath(d + "/sparse", d + "/copy", opts, nullptr); }) == EEXIST);
  opts.reflink = Reflink::Always;
  std::string code;
  int err = errorOf([&] { clonePath(d + "/sparse", d + "/always", opts, nullptr); }, &code);
  CHECK(err != 0 && code == "ERR_REFLINK_UNSUPPORTED");  // $TMPDIR on ext4/tmpfs: no reflink
  CHECK(!exists(d + "/always"));
  removeTreeNoFollow(d);
}

static void poolNamesAreDistinctAndCollisionsRetry() {
  std::string d = fresh();
  auto pool = Pool::open(d + "/pool", true);
  std::set<std::string> ids;
  for (int i = 0; i < 200; i++) ids.insert(randomId());
  CHECK(ids.size() == 200);
  AllocateRequest req;
  req.prefix = "vm";
  req.info = {};
  std::string taken(32, 'a');
  mkdir((d + "/pool/vm-" + taken).c_str(), 0700);
  setTestIds({taken, std::string(32, 'b')});
  AllocateResult r = pool->allocate(req);
  CHECK(r.id == std::string(32, 'b') && r.retries == 1);
  CHECK(exists(d + "/pool/vm-" + taken));  // never adopted
  pool->dispose(r.name, r.leaseFd, -1);
  CHECK(!exists(d + "/pool/" + r.name));
  std::vector<std::string> all(kMaxNameTries, taken);
  setTestIds(all);
  std::string code;
  errorOf([&] { pool->allocate(req); }, &code);
  CHECK(code == "ERR_NAME_EXHAUSTED");
  setTestIds({});
  pool->close();
  removeTreeNoFollow(d);
}

// The contents of a file, or "<missing>" (for checks that a failed call changed nothing).
static std::string readAll(const std::string& path) {
  std::string out;
  try {
    if (!readWholeFile(path, &out)) return "<missing>";
  } catch (const Error&) {
    return "<unreadable>";
  }
  return out;
}

// The layout's paths are the documented ones (docs/pool-on-disk.md), and every lease file of a pool made here sits
// where layout::leasePath says; hasPrefix matches whole prefixes only.
static void layoutPathsAreThePoolsOwn() {
  const std::string id = "0123456789abcdef0123456789abcdef";
  CHECK(layout::leasePath("/p", "vm-" + id) == "/p/.vmspace/leases/0/vm-" + id);
  CHECK(layout::leaseRel("a_b-" + std::string(32, 'f')) == "f/a_b-" + std::string(32, 'f'));
  CHECK(layout::stagingShardPath("/p", 7) == "/p/.vmspace/staging/s7");
  CHECK(layout::leaseShardPath("/p", layout::leaseShardName(15)) == "/p/.vmspace/leases/f");
  CHECK(layout::trashPath("/p", "x") == "/p/.vmspace/trash/x");
  CHECK(layout::templateMetaPath("/p", id) == "/p/.vmspace/templates/" + id + "/template.json");
  CHECK(layout::statePath("/p", layout::kProjects) == "/p/.vmspace/projects");
  CHECK(layout::hasPrefix(".spare-00", layout::kSparePrefix) && !layout::hasPrefix(".spare", layout::kSparePrefix));
  CHECK(layout::hasPrefix(".tmp-", layout::kTmpPrefix) && !layout::hasPrefix("x.tmp-", layout::kTmpPrefix));
  std::string d = fresh();
  auto pool = Pool::open(d + "/pool", true);
  AllocateRequest req;
  req.prefix = "vm";
  AllocateResult r = pool->allocate(req);
  CHECK(exists(layout::leasePath(d + "/pool", r.name)) &&
        pool->leasePath(r.name) == layout::leasePath(d + "/pool", r.name));
  pool->dispose(r.name, r.leaseFd, -1);
  pool->close();
  removeTreeNoFollow(d);
}

static void namesAreRandomLowercaseHex() {
  std::set<std::string> ids;
  bool allHex = true;
  for (int i = 0; i < 1000; i++) {
    std::string id = randomId();
    allHex = allHex && id.size() == static_cast<size_t>(kIdHexChars);
    for (char c : id) allHex = allHex && (std::isdigit(static_cast<unsigned char>(c)) || (c >= 'a' && c <= 'f'));
    ids.insert(id);
  }
  CHECK(allHex);
  CHECK(ids.size() == 1000);
  CHECK(randomHex(6).size() == 12);
  CHECK(randomHex(6) != randomHex(6));
}

// Ids come from a per-thread buffer of random bytes: a forked child must not draw what its parent draws next.
static void forkedChildDrawsOtherIds() {
  (void)randomId();  // the buffer filled, 240 bytes left in it
  int fds[2];
  CHECK(pipe2(fds, O_CLOEXEC) == 0);
  pid_t pid = fork();
  if (pid == 0) {
    std::string id = randomId();
    _exit(write(fds[1], id.data(), id.size()) == static_cast<ssize_t>(id.size()) ? 0 : 1);
  }
  CHECK(pid > 0);
  close(fds[1]);
  std::string mine = randomId();
  char theirs[64];
  ssize_t n = read(fds[0], theirs, sizeof theirs);
  close(fds[0]);
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(n == kIdHexChars);
  CHECK(std::string(theirs, n) != mine);
}

static void renameNoReplaceNeverReplaces() {
  std::string d = fresh();
  writeFile(d + "/a", "from");
  writeFile(d + "/b", "there");
  CHECK(errorOf([&] { renameNoReplace(d + "/a", d + "/b"); }) == EEXIST);
  CHECK(readAll(d + "/a") == "from" && readAll(d + "/b") == "there");  // both untouched
  CHECK(mkdir((d + "/dir").c_str(), 0700) == 0);
  CHECK(errorOf([&] { renameNoReplace(d + "/a", d + "/dir"); }) == EEXIST);
  CHECK(errorOf([&] { renameNoReplace(d + "/dir", d + "/b"); }) == EEXIST);
  CHECK(readAll(d + "/a") == "from" && readAll(d + "/b") == "there" && exists(d + "/dir"));
  renameNoReplace(d + "/a", d + "/c");
  CHECK(!exists(d + "/a") && readAll(d + "/c") == "from");
  CHECK(errorOf([&] { renameNoReplace(d + "/a", d + "/e"); }) == ENOENT);
  // The fd-relative publish answers EEXIST the same way and leaves both names as they were.
  int dirFd = open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  CHECK(dirFd >= 0);
  const char* syscall = nullptr;
  CHECK(publishFileNoReplace(dirFd, "c", dirFd, "b", &syscall) == EEXIST && syscall != nullptr);
  CHECK(readAll(d + "/c") == "from" && readAll(d + "/b") == "there");
  CHECK(publishFileNoReplace(dirFd, "c", dirFd, "f", &syscall) == 0);
  CHECK(!exists(d + "/c") && readAll(d + "/f") == "from");
  CHECK(close(dirFd) == 0);
  removeTreeNoFollow(d);
}

static void removeTakesSymlinksNeverTheirTargets() {
  std::string d = fresh();
  CHECK(mkdir((d + "/outside").c_str(), 0700) == 0);
  writeFile(d + "/outside/keep", "keep");
  CHECK(mkdir((d + "/tree").c_str(), 0700) == 0);
  CHECK(symlink((d + "/outside/keep").c_str(), (d + "/tree/to-file").c_str()) == 0);
  CHECK(symlink("loop", (d + "/tree/loop").c_str()) == 0);  // a link to itself (ELOOP when followed)
  CHECK(symlink("missing", (d + "/tree/dangling").c_str()) == 0);
  CHECK(symlink("/", (d + "/tree/root").c_str()) == 0);
  removeTreeNoFollow(d + "/tree");
  CHECK(!exists(d + "/tree"));
  CHECK(readAll(d + "/outside/keep") == "keep");
  // A symlink given as the path itself is removed as a link: its target directory stays whole.
  CHECK(symlink((d + "/outside").c_str(), (d + "/link").c_str()) == 0);
  removeTreeNoFollow(d + "/link");
  CHECK(!exists(d + "/link"));
  CHECK(readAll(d + "/outside/keep") == "keep");
  removeTreeNoFollow(d);
}

static void removeTakesAChainDeeperThanPathMax() {
  std::string d = fresh();
  // 3000 levels of "dd": a path of 9000 characters, beyond PATH_MAX (4096), so only fd-relative calls reach it.
  const int depth = 3000;
  int fd = open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  CHECK(fd >= 0);
  bool built = true;
  for (int i = 0; i < depth && built; i++) {
    built = mkdirat(fd, "dd", 0700) == 0;
    int next = openat(fd, "dd", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    built = built && next >= 0;
    CHECK(close(fd) == 0);
    fd = next;
  }
  CHECK(built);
  if (fd >= 0) {
    int file = openat(fd, "leaf", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    CHECK(file >= 0 && write(file, "x", 1) == 1 && close(file) == 0);
    CHECK(close(fd) == 0);
  }
  removeTreeNoFollow(d + "/dd");
  CHECK(!exists(d + "/dd"));
  removeTreeNoFollow(d);
}

// Data regions of a file as (offset, length) pairs, by SEEK_DATA/SEEK_HOLE.
static std::vector<std::pair<off_t, off_t>> dataRegions(const std::string& path) {
  std::vector<std::pair<off_t, off_t>> out;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  off_t at = 0;
  for (;;) {
    off_t data = lseek(fd, at, SEEK_DATA);
    if (data < 0) break;  // ENXIO: no data past `at`
    off_t hole = lseek(fd, data, SEEK_HOLE);
    if (hole < 0) break;
    out.emplace_back(data, hole - data);
    at = hole;
  }
  CHECK(close(fd) == 0);
  return out;
}

static void cloneCopiesSparseDataKeepingHoles() {
  std::string d = fresh();
  const off_t mib = 1 << 20;
  int fd = open((d + "/sparse").c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  CHECK(fd >= 0);
  std::string head(mib, 'h'), middle(mib, 'm'), tail(4096, 't');
  CHECK(pwrite(fd, head.data(), head.size(), 0) == static_cast<ssize_t>(head.size()));
  CHECK(pwrite(fd, middle.data(), middle.size(), 16 * mib) == static_cast<ssize_t>(middle.size()));
  CHECK(pwrite(fd, tail.data(), tail.size(), 64 * mib) == static_cast<ssize_t>(tail.size()));
  CHECK(ftruncate(fd, 80 * mib) == 0);  // a hole at the end too
  CHECK(close(fd) == 0);
  CloneOptions opts;
  opts.reflink = Reflink::Never;  // the copy path: holes are its job (a reflink shares them by itself)
  CloneSummary s = clonePath(d + "/sparse", d + "/copy", opts, nullptr);
  CHECK(s.files == 1 && s.bytes == static_cast<uint64_t>(80 * mib));
  CHECK(readAll(d + "/copy") == readAll(d + "/sparse"));  // every byte, zeros of the holes included
  std::vector<std::pair<off_t, off_t>> src = dataRegions(d + "/sparse"), dst = dataRegions(d + "/copy");
  CHECK(!src.empty() && src == dst);  // the same data regions: no hole filled, none made
  removeTreeNoFollow(d);
}

static void lockFollowsAFileReplacedAtItsPath() {
  std::string d = fresh();
  std::string path = d + "/index.lock";
  bool acquired = false;
  int fd = lockOpen(path, false, &acquired, true, 1);
  CHECK(fd >= 0 && acquired);
  const char* syscall = nullptr;
  CHECK(lockFollowPath(path, &fd, &syscall) == 0);  // still the file at the path: the lock is good
  // Another file renamed over the path: the locked inode is no longer it.
  writeFile(d + "/other", "");
  CHECK(rename((d + "/other").c_str(), path.c_str()) == 0);
  int old = fd;
  CHECK(lockFollowPath(path, &fd, &syscall) == EAGAIN);
  CHECK(fd >= 0 && fd != old);  // the old fd closed, a fresh open of the new file (not locked yet)
  struct stat atPath, opened;
  CHECK(stat(path.c_str(), &atPath) == 0 && fstat(fd, &opened) == 0 && atPath.st_ino == opened.st_ino);
  CHECK(lockTry(fd, false) == 0);
  CHECK(lockFollowPath(path, &fd, &syscall) == 0);
  // Unlinked: the next open makes the file again.
  CHECK(unlink(path.c_str()) == 0);
  CHECK(lockFollowPath(path, &fd, &syscall) == EAGAIN);
  CHECK(exists(path) && lockTry(fd, false) == 0 && lockFollowPath(path, &fd, &syscall) == 0);
  lockClose(fd);  // with its registration: a plain close would leave the process refusing a later lock of the inode
  removeTreeNoFollow(d);
}

// ---- The helpers the core's functions share, and the core's passes on hand-built directories ----

// The names in directory `path` (without "." and ".."), sorted: what a check expects to be left.
static std::set<std::string> namesIn(const std::string& path) {
  std::set<std::string> out;
  int fd = open(path.c_str(), kDirPathFlags);
  if (fd < 0) return {"<cannot open>"};
  for (auto& [name, type] : readNames(fd, path)) out.insert(name);
  CHECK(close(fd) == 0);
  return out;
}

// How many fds the process has open (/proc/self/fd, less the one reading it).
static int openFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return -1;
  int n = 0;
  for (struct dirent* de; (de = readdir(dir));)
    if (!isDotOrDotDot(de->d_name)) n++;
  closedir(dir);
  return n - 1;
}

static void dotTestIsExact() {
  CHECK(isDotOrDotDot("."));
  CHECK(isDotOrDotDot(".."));
  CHECK(!isDotOrDotDot(""));
  CHECK(!isDotOrDotDot("..."));
  CHECK(!isDotOrDotDot(".a"));
  CHECK(!isDotOrDotDot("..a"));
  CHECK(!isDotOrDotDot(".vmspace"));
  CHECK(!isDotOrDotDot("a"));
}

static void readNamesOnEmptyAndLargeDirectories() {
  std::string d = fresh();
  int fd = open(d.c_str(), kDirFlags);
  CHECK(fd >= 0);
  CHECK(readNames(fd, d).empty());  // "." and ".." are never listed
  const int kCount = 5000;          // many getdents(2) buffers' worth
  for (int i = 0; i < kCount; i++) writeFile(d + "/f" + std::to_string(i), "");
  CHECK(mkdir((d + "/sub").c_str(), 0700) == 0);
  std::vector<std::pair<std::string, unsigned char>> names = readNames(fd, d);
  std::set<std::string> unique;
  int files = 0;
  for (auto& [name, type] : names) {
    unique.insert(name);
    if (name[0] == 'f' && (type == DT_REG || type == DT_UNKNOWN)) files++;
  }
  CHECK(names.size() == kCount + 1 && unique.size() == kCount + 1);
  CHECK(files == kCount && unique.count("sub") == 1 && unique.count("f4999") == 1);
  // The caller's fd keeps its position: readNames reads through a fresh open of ".".
  CHECK(lseek(fd, 0, SEEK_CUR) == 0);
  CHECK(close(fd) == 0);
  // Not a directory: ENOTDIR from open, naming the path given.
  int file = open((d + "/f0").c_str(), O_RDONLY | O_CLOEXEC);
  CHECK(file >= 0);
  try {
    readNames(file, d + "/f0");
    CHECK(false);
  } catch (const Error& e) {
    CHECK(e.err == ENOTDIR && e.syscall == "open" && e.path == d + "/f0");
  }
  CHECK(close(file) == 0);
  removeTreeNoFollow(d);
}

static void forEachNameStopsOnAThrowAndClosesItsFd() {
  std::string d = fresh();
  for (int i = 0; i < 10; i++) writeFile(d + "/f" + std::to_string(i), "");
  int fd = open(d.c_str(), kDirFlags);
  CHECK(fd >= 0);
  int before = openFds();
  int seen = 0;
  CHECK(errorOf([&] {
          forEachName(fd, d, [&](const struct dirent&) {
            if (++seen == 3) throwErrno(EIO, "test", d);
          });
        }) == EIO);
  CHECK(seen == 3);            // no entry after the throw
  CHECK(openFds() == before);  // the directory it opened is closed
  CHECK(close(fd) == 0);
  removeTreeNoFollow(d);
}

static void tempFileLeavesNothingUnlessPublished() {
  std::string d = fresh();
  int dir = open(d.c_str(), kDirFlags);
  CHECK(dir >= 0);
  // Destroyed by a throw half way: the temp is gone.
  CHECK(errorOf([&] {
          TempFile t(dir, ".x.tmp-1", 0600, d + "/.x.tmp-1");
          CHECK(writeAll(t.fd(), "half") == 0);
          throwErrno(ENOSPC, "write", d + "/.x.tmp-1");
        }) == ENOSPC);
  CHECK(namesIn(d).empty());
  // Published after its rename: only the final name, with every byte.
  {
    TempFile t(dir, ".x.tmp-2", 0600, d + "/.x.tmp-2");
    CHECK(pwriteAll(t.fd(), "whole", 5, 0) == 0);
    t.close();
    CHECK(t.fd() == -1);
    CHECK(renameat(dir, ".x.tmp-2", dir, "x") == 0);
    t.published();
  }
  CHECK(namesIn(d) == std::set<std::string>{"x"});
  CHECK(readAll(d + "/x") == "whole");
  // A name that exists is EEXIST, and the file that had it is not touched (it was never ours).
  writeFile(d + "/.x.tmp-3", "theirs");
  CHECK(errorOf([&] { TempFile t(dir, ".x.tmp-3", 0600, d + "/.x.tmp-3"); }) == EEXIST);
  CHECK(readAll(d + "/.x.tmp-3") == "theirs");
  CHECK(close(dir) == 0);
  removeTreeNoFollow(d);
}

static void pwriteAllWritesAtItsOffsetOrReturnsTheErrno() {
  std::string d = fresh();
  int fd = open((d + "/f").c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  CHECK(fd >= 0);
  std::string big(3 << 20, 'b');  // more than one write may take
  CHECK(pwriteAll(fd, big.data(), big.size(), 10) == 0);
  CHECK(pwriteAll(fd, "head", 4, 0) == 0);
  struct stat st;
  CHECK(fstat(fd, &st) == 0 && st.st_size == static_cast<off_t>(big.size()) + 10);
  CHECK(lseek(fd, 0, SEEK_CUR) == 0);  // pwrite: the file offset is not moved
  CHECK(close(fd) == 0);
  CHECK(readAll(d + "/f") == "head" + std::string(6, '\0') + big);
  int ro = open((d + "/f").c_str(), O_RDONLY | O_CLOEXEC);
  CHECK(ro >= 0 && pwriteAll(ro, "x", 1, 0) == EBADF);
  CHECK(ro >= 0 && close(ro) == 0);
  removeTreeNoFollow(d);
}

static void badAllocIsEnomemInOnePlace() {
  Error e = outOfMemoryError();
  CHECK(e.err == ENOMEM && e.syscall == "malloc" && e.code.empty());
  Error caught;
  try {
    throw std::bad_alloc();
  } catch (...) {
    caught = currentError();
  }
  CHECK(caught.err == ENOMEM && caught.syscall == "malloc" && caught.code.empty() && caught.detail.empty());
}

// The one exception policy (currentError): a system_error with an errno is that errno, anything unexpected is
// ERR_INTERNAL naming it, and a sweep entry's error names the entry where it names no path.
static void unexpectedExceptionsAreInternal() {
  auto caught = [](auto thrower) {
    try {
      thrower();
    } catch (...) {
      return currentErrorAt("/pool/x");
    }
    return Error{};
  };
  Error sys = caught([] { throw std::system_error(EAGAIN, std::generic_category(), "thread"); });
  CHECK(sys.err == EAGAIN && sys.syscall == "pthread_create" && sys.code.empty() && sys.path == "/pool/x");
  Error odd = caught([] { throw std::logic_error("odd"); });
  CHECK(odd.err == 0 && odd.code == "ERR_INTERNAL" && odd.detail == "unexpected C++ exception: odd");
  Error any = caught([] { throw 7; });
  CHECK(any.code == "ERR_INTERNAL" && any.detail == "unexpected C++ exception" && any.path == "/pool/x");
  Error own = caught([] { throwErrno(ENOENT, "open", "/elsewhere"); });
  CHECK(own.err == ENOENT && own.path == "/elsewhere");
}

// The lock registry: a second request of one owner (thread) on one file (any name) is EDEADLK, shared beside
// shared is not, another owner's is not (it waits in flock), and a close drops the registration.
static void lockRegistryRefusesAWaitOnItself() {
  std::string d = fresh();
  std::string path = d + "/r.lock";
  bool acquired = false;
  int fd = lockOpen(path, false, &acquired, true, 1);
  CHECK(fd >= 0 && acquired);
  CHECK(errorOf([&] { lockOpen(path, false, &acquired, true, 1); }) == EDEADLK);
  CHECK(errorOf([&] { lockOpen(path, true, &acquired, true, 1); }) == EDEADLK);
  CHECK(link(path.c_str(), (d + "/alias.lock").c_str()) == 0);
  CHECK(errorOf([&] { lockOpen(d + "/alias.lock", false, &acquired, true, 1); }) == EDEADLK);
  lockClose(fd);
  int a = lockOpen(path, true, &acquired, true, 1);
  int b = lockOpen(path, true, &acquired, true, 1);  // shared beside shared: granted
  CHECK(a >= 0 && b >= 0 && acquired);
  lockClose(a);
  lockClose(b);
  int u1 = lockOpen(path, false, &acquired, false, 1);
  CHECK(u1 >= 0 && acquired);
  CHECK(errorOf([&] { lockOpen(path, false, &acquired, false, 1); }) == EDEADLK);  // the same thread's
  int u2 = lockOpen(path, false, &acquired, false, 2);                             // another thread's: waits in flock
  CHECK(u2 >= 0 && !acquired);
  lockClose(u1);
  lockClose(u2);
  CHECK(errorOf([&] { lockOpen(d + "/missing.json", false, &acquired, false, 1); }) == ENOENT);
  removeTreeNoFollow(d);
}

// replaceFile writes only while the path names the locked inode: deleted or replaced, nothing is written.
static void replaceFileWritesOnlyTheLockedFile() {
  std::string d = fresh();
  std::string path = d + "/index.json";
  CHECK(createFile(path, "{}", false));
  CHECK(!createFile(path, "{\"x\":1}", false));  // never replaces
  bool acquired = false;
  int fd = lockOpen(path, false, &acquired, false, 1);
  CHECK(fd >= 0 && acquired);
  CHECK(replaceFile(path, fd, "{\"a\":1}", false));
  CHECK(readAll(path) == "{\"a\":1}");
  CHECK(namesIn(d) == std::set<std::string>{"index.json"});
  lockClose(fd);
  fd = lockOpen(path, false, &acquired, false, 1);
  writeFile(d + "/other", "{\"b\":2}");
  CHECK(rename((d + "/other").c_str(), path.c_str()) == 0);  // replaced by someone who takes no lock
  CHECK(!replaceFile(path, fd, "{\"a\":2}", false));
  CHECK(readAll(path) == "{\"b\":2}");
  lockClose(fd);
  fd = lockOpen(path, false, &acquired, false, 1);
  CHECK(unlink(path.c_str()) == 0);  // deleted
  CHECK(!replaceFile(path, fd, "{\"a\":3}", false));
  CHECK(!exists(path) && namesIn(d).empty());
  lockClose(fd);
  removeTreeNoFollow(d);
}

static void replaceFileLeavesNoTempAndRemovesOnlyItsOwn() {
  std::string d = fresh();
  std::string out;
  CHECK(!readWholeFile(d + "/index.json", &out));  // missing: false, not an error
  CHECK(errorOf([&] { readWholeFile(d, &out); }) == EISDIR);
  CHECK(createFile(d + "/index.json", "{\"a\":1}", true));
  CHECK(readAll(d + "/index.json") == "{\"a\":1}");
  CHECK(namesIn(d) == std::set<std::string>{"index.json"});
  // A file (here a directory) at the path already: nothing published, no temp left behind.
  CHECK(mkdir((d + "/busy").c_str(), 0700) == 0);
  writeFile(d + "/busy/x", "");
  CHECK(!createFile(d + "/busy", "{}", false));
  CHECK(namesIn(d) == (std::set<std::string>{"busy", "index.json"}));
  // Temps of dead writers: exactly "." + leaf + ".tmp-" + 12 lowercase hex, regular files only.
  writeFile(d + "/.index.json.tmp-0123456789ab", "dead");
  writeFile(d + "/.index.json.tmp-0123456789a", "short");
  writeFile(d + "/.index.json.tmp-0123456789AB", "upper");
  writeFile(d + "/.other.json.tmp-0123456789ab", "other");
  CHECK(mkdir((d + "/.index.json.tmp-ffffffffffff").c_str(), 0700) == 0);
  int dir = open(d.c_str(), kDirFlags);
  CHECK(dir >= 0 && removeIndexTemps(dir, d, "index.json") == 1);
  CHECK(dir >= 0 && close(dir) == 0);
  CHECK(namesIn(d) ==
        (std::set<std::string>{".index.json.tmp-0123456789a", ".index.json.tmp-0123456789AB",
                               ".index.json.tmp-ffffffffffff", ".other.json.tmp-0123456789ab", "busy", "index.json"}));
  removeTreeNoFollow(d);
}

static void removeTakesASmallTreeAndCountsItsBytes() {
  std::string d = fresh();
  CHECK(mkdir((d + "/t").c_str(), 0700) == 0);
  CHECK(mkdir((d + "/t/a").c_str(), 0700) == 0);
  CHECK(mkdir((d + "/t/a/b").c_str(), 0500) == 0);
  writeFile(d + "/t/one", std::string(8192, '1'));
  writeFile(d + "/t/a/two", "2");
  CHECK(chmod((d + "/t/a/b").c_str(), 0) == 0);  // no permissions: removal needs none of them
  CHECK(mkfifo((d + "/t/a/fifo").c_str(), 0600) == 0);
  CHECK(symlink("/", (d + "/t/a/root").c_str()) == 0);
  int dir = open(d.c_str(), kDirFlags);
  CHECK(dir >= 0);
  uint64_t bytes = 0;
  removeTreeNoFollow(dir, "t", d + "/t", &bytes);
  CHECK(namesIn(d).empty());
  CHECK(bytes >= 8192);  // at least the one file's data (directories and file systems add their blocks)
  CHECK(errorOf([&] { removeTreeNoFollow(dir, "t", d + "/t"); }) == ENOENT);
  CHECK(close(dir) == 0);
  removeTreeNoFollow(d);
}

static void cloneOfATreeCountsEveryKindAndLeavesNoTemp() {
  std::string d = fresh();
  CHECK(mkdir((d + "/src").c_str(), 0750) == 0);
  CHECK(mkdir((d + "/src/sub").c_str(), 0700) == 0);
  writeFile(d + "/src/a", "aa");
  writeFile(d + "/src/sub/b", "bbb");
  CHECK(chmod((d + "/src/sub/b").c_str(), 0640) == 0);
  CHECK(link((d + "/src/a").c_str(), (d + "/src/sub/a-link").c_str()) == 0);
  CHECK(symlink("../a", (d + "/src/sub/sym").c_str()) == 0);
  CHECK(mkfifo((d + "/src/fifo").c_str(), 0600) == 0);
  CloneOptions opts;
  opts.reflink = Reflink::Auto;
  CloneSummary s = clonePath(d + "/src", d + "/dst", opts, nullptr);
  CHECK(s.tree && s.files == 2 && s.bytes == 5 && s.dirs == 1 && s.hardlinks == 1 && s.symlinks == 1 && s.fifos == 1 &&
        s.reflinked + s.copied == 2);
  CHECK(namesIn(d + "/dst") == (std::set<std::string>{"a", "fifo", "sub"}));
  CHECK(namesIn(d + "/dst/sub") == (std::set<std::string>{"a-link", "b", "sym"}));
  CHECK(readAll(d + "/dst/sub/b") == "bbb");
  struct stat root, b, a, alink;
  CHECK(stat((d + "/dst").c_str(), &root) == 0 && (root.st_mode & 07777) == 0750);
  CHECK(stat((d + "/dst/sub/b").c_str(), &b) == 0 && (b.st_mode & 07777) == 0640);
  CHECK(stat((d + "/dst/a").c_str(), &a) == 0 && stat((d + "/dst/sub/a-link").c_str(), &alink) == 0 &&
        a.st_ino == alink.st_ino);
  // Again onto the clone: EEXIST, and the temp tree it built is gone.
  CHECK(errorOf([&] { clonePath(d + "/src", d + "/dst", opts, nullptr); }) == EEXIST);
  CHECK(namesIn(d) == (std::set<std::string>{"dst", "src"}));
  removeTreeNoFollow(d);
}

static void sweepPassesOnAHandBuiltPool() {
  std::string d = fresh();
  std::string root = d + "/pool";
  auto pool = Pool::open(root, true);
  AllocateRequest req;
  req.prefix = "vm";
  req.info = {};
  AllocateResult live = pool->allocate(req);  // its lease held: never reclaimed
  AllocateResult dead = pool->allocate(req);  // its owner gone: reclaimed
  close(dead.leaseFd);
  std::string foreign = "vm-" + std::string(32, 'a'), build = "vm-" + std::string(32, 'b'),
              ghost = "vm-" + std::string(32, 'c');
  CHECK(mkdir((root + "/" + foreign).c_str(), 0700) == 0);  // named like a workspace, no lease file: not ours
  CHECK(mkdir((root + "/notes").c_str(), 0700) == 0);       // not a workspace name: not the pool's
  // A dead build: its lease file (free) and its staging entry.
  UniqueFd leases(open((root + "/.vmspace/leases/b").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  const char* step;
  close(makeLeaseFile(leases.get(), build, "", -1, &step));
  CHECK(mkdir((root + "/.vmspace/staging/s3/" + build).c_str(), 0700) == 0);
  UniqueFd leasesC(open((root + "/.vmspace/leases/c").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  close(makeLeaseFile(leasesC.get(), ghost, "", -1, &step));        // a lease file without a workspace
  writeFile(root + "/.vmspace/.noreplace-probe-0123456789ab", "");  // a probe whose opener died
  // A dry run reports and removes nothing (the leftover pass does not run dry).
  SweepReport dry = pool->sweep(true, 0);
  std::set<std::string> dryFrom;
  for (auto& e : dry.reclaimed) dryFrom.insert(std::string(e.from) + ":" + e.name);
  CHECK(dryFrom == (std::set<std::string>{"published:" + dead.name, "staging:" + build}));
  CHECK(dry.failed.empty() && dry.live == 1 && dry.leasesRemoved == 1);
  CHECK(dry.foreign == std::vector<std::string>{root + "/" + foreign});
  CHECK(exists(root + "/" + dead.name) && exists(root + "/.vmspace/.noreplace-probe-0123456789ab"));
  SweepReport r = pool->sweep(false, 0);
  std::set<std::string> from;
  for (auto& e : r.reclaimed) from.insert(std::string(e.from) + ":" + e.name);
  CHECK(from == dryFrom);
  CHECK(r.failed.empty() && r.live == 1 && r.leasesRemoved == 1 && r.foreign.size() == 1);
  CHECK(namesIn(root) == (std::set<std::string>{".vmspace", live.name, foreign, "notes"}));
  CHECK(namesIn(root + "/.vmspace/trash").empty() && namesIn(root + "/.vmspace/staging/s3").empty());
  CHECK(namesIn(root + "/.vmspace/leases/b").count(build) == 0 &&
        namesIn(root + "/.vmspace/leases/c").count(ghost) == 0);
  CHECK(!exists(root + "/.vmspace/.noreplace-probe-0123456789ab"));
  // Nothing left to do: a second sweep reclaims nothing.
  SweepReport again = pool->sweep(false, 0);
  CHECK(again.reclaimed.empty() && again.failed.empty() && again.live == 1 && again.leasesRemoved == 0);
  pool->dispose(live.name, live.leaseFd, -1);
  CHECK(namesIn(root) == (std::set<std::string>{".vmspace", foreign, "notes"}));
  pool->close();
  removeTreeNoFollow(d);
}

// A condition's detail over kMessageTextMax bytes keeps its head and tail around "…", cut between UTF-8 characters;
// the error's path keeps every byte.
static void errorTextIsBoundedPathIsWhole() {
  std::string euro = "\xE2\x82\xAC";  // U+20AC, 3 bytes: 4096 / 2 falls inside one
  std::string path;
  while (path.size() < 3 * kMessageTextMax) path += "/" + euro;
  CHECK(boundedText("short") == "short");
  try {
    throwCode("ERR_INTERNAL", "at " + path, 0, "", path);
  } catch (const Error& e) {
    CHECK(e.path == path);
    CHECK(e.detail.size() <= kMessageTextMax + 3);
    size_t cut = e.detail.find("\xE2\x80\xA6");
    CHECK(cut != std::string::npos && cut > 0);
    CHECK(e.detail.compare(0, cut, ("at " + path).substr(0, cut)) == 0);
    std::string tail = e.detail.substr(cut + 3);
    CHECK(!tail.empty() && path.compare(path.size() - tail.size(), tail.size(), tail) == 0);
    // Both pieces whole characters: the cuts fall where no continuation byte (10xxxxxx) is.
    CHECK((static_cast<unsigned char>(tail[0]) & 0xC0) != 0x80);
    CHECK((static_cast<unsigned char>(("at " + path)[cut]) & 0xC0) != 0x80);
  }
}

// A ustar header block for `name` (a regular file of `size` bytes), `uid` as its 8 raw bytes, checksum set.
static std::string tarHeader(const std::string& name, size_t size, const std::string& uid) {
  std::string h(512, '\0');
  h.replace(0, name.size(), name);
  h.replace(100, 8, "0000644", 8);
  std::string u = uid;
  u.resize(8, '\0');
  h.replace(108, 8, u);
  h.replace(116, 8, "0000000", 8);
  char num[13];
  (void)std::snprintf(num, sizeof num, "%011zo", size);
  h.replace(124, 12, num, 12);
  h.replace(136, 12, "00000000000", 12);
  h[156] = '0';
  h.replace(257, 8,
            "ustar\0"
            "00",
            8);
  unsigned sum = 0;
  for (size_t i = 0; i < 512; i++) sum += (i >= 148 && i < 156) ? ' ' : static_cast<unsigned char>(h[i]);
  (void)std::snprintf(num, sizeof num, "%06o", sum);
  h.replace(148, 7, num, 7);
  return h;
}

// The code the tar reader throws for `bytes` (read through a pipe), or "" when it reads every entry.
static std::string tarOutcome(const std::string& bytes, std::vector<TarEntry>* entries = nullptr) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return "pipe";
  UniqueFd r(fds[0]), w(fds[1]);
  pid_t pid = fork();
  if (pid == 0) {
    r.reset();
    _exit(writeAll(w.get(), bytes) == 0 ? 0 : 1);
  }
  w.reset();
  std::string code;
  try {
    TarReader tar(r.get(), "pipe", nullptr);
    TarEntry e;
    while (tar.next(&e))
      if (entries) entries->push_back(e);
  } catch (const Error& e) {
    code = e.code.empty() ? "errno" : e.code;
  }
  r.reset();
  int status;
  waitpid(pid, &status, 0);
  return code;
}

static void tarReaderChecksNumbersAndChecksums() {
  const std::string end(1024, '\0');
  std::string base256("\x80\0\0\0\0\0\x03\xe8", 8);  // uid 1000 as GNU base-256
  std::vector<TarEntry> entries;
  CHECK(tarOutcome(tarHeader("a", 3, "0000001") + std::string("abc") + std::string(509, '\0') +
                       tarHeader("b", 0, base256) + end,
                   &entries) == "");
  CHECK(entries.size() == 2 && entries[0].name == "a" && entries[0].uid == 1 && entries[0].size == 3);
  CHECK(entries.size() == 2 && entries[1].uid == 1000);
  std::string bad = tarHeader("a", 0, "0000001");
  bad[0] = 'b';  // the checksum no longer matches
  CHECK(tarOutcome(bad + end) == "ERR_LAYER_INVALID");
  CHECK(tarOutcome(tarHeader("a", 0, "00000x1") + end) == "ERR_LAYER_INVALID");  // not octal
  CHECK(tarOutcome(tarHeader("a", 0, std::string("\xff\xff\xff\xff\xff\xff\xff\xff", 8)) + end) ==
        "ERR_LAYER_INVALID");                                                       // negative
  CHECK(tarOutcome(tarHeader("a", 10, "0000001") + "abc") == "ERR_LAYER_INVALID");  // truncated
  CHECK(tarOutcome(tarHeader("a", 0, "0000001") + std::string(512, '\0') + tarHeader("b", 0, "0000001")) ==
        "ERR_LAYER_INVALID");                                                      // an entry after one end block
  CHECK(tarOutcome(tarHeader("a", 0, "0000001") + std::string(512, '\0')) == "");  // one end block, then EOF
}

// Pushes `name` of the top directory, with its pair of the same name, onto `walk`: true when both opened.
static bool pushPair(TreeWalk& walk, const char* name) {
  int fd = walk.openDir(walk.topFd(), name);
  int pair = walk.openDir(walk.pairFd(), name);
  struct stat s {
  }, p{};
  bool ok = fd >= 0 && pair >= 0 && fstat(fd, &s) == 0 && fstat(pair, &p) == 0;
  CHECK(ok);
  if (!ok) {
    if (fd >= 0) close(fd);
    if (pair >= 0) close(pair);
    return false;
  }
  return walk.push(fd, name, s.st_dev, s.st_ino, TreeWalk::Pair{pair, p.st_dev, p.st_ino}) == 0;
}

// The root of a walk of `d`/src paired with `d`/dst, keeping one frame open.
static void pushPairRoot(TreeWalk& walk, const std::string& d) {
  int fd = open((d + "/src").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  int pair = open((d + "/dst").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  struct stat s {
  }, p{};
  CHECK(fd >= 0 && pair >= 0 && fstat(fd, &s) == 0 && fstat(pair, &p) == 0);
  CHECK(walk.push(fd, "", s.st_dev, s.st_ino, TreeWalk::Pair{pair, p.st_dev, p.st_ino}) == 0);
}

// A walk with pairs (a clone's source and destination) keeping one frame open: every entry is read once, however
// often the frames above are closed and reopened, and a directory moved on either side while its frame was closed
// is ESTALE on the climb back, naming the side.
static void walkPairsClimbCheckedOnBothSides() {
  std::string d = fresh();
  for (const char* side : {"/src", "/dst"})
    for (const char* dir : {"", "/a", "/a/b", "/a/b/c", "/x", "/x/y"})
      CHECK(mkdir((d + side + dir).c_str(), 0700) == 0);
  {
    TreeWalk walk(d + "/src", TreeWalk::Resume::AtPosition, 1);
    pushPairRoot(walk, d);
    size_t seen = 0;
    while (!walk.empty()) {
      struct dirent* de = nullptr;
      CHECK(walk.next(&de) == 0);
      if (de) {
        seen++;
        if (!pushPair(walk, de->d_name)) break;
        continue;
      }
      TreeWalk::Left left;
      const char* syscall = nullptr;
      CHECK(walk.pop(&left, &syscall) == 0);
    }
    CHECK(seen == 5);  // a, a/b, a/b/c, x, x/y
  }
  for (const char* side : {"/src", "/dst"}) {
    TreeWalk walk(d + "/src", TreeWalk::Resume::AtPosition, 1);
    pushPairRoot(walk, d);
    CHECK(pushPair(walk, "a") && pushPair(walk, "b") && pushPair(walk, "c"));
    // c moves under x on one side: its ".." is x now, not the b the walk came down through.
    CHECK(rename((d + side + "/a/b/c").c_str(), (d + side + "/x/c").c_str()) == 0);
    const char* syscall = nullptr;
    bool pairSide = false;
    CHECK(walk.climb(&syscall, &pairSide) == ESTALE);
    CHECK(pairSide == (std::string(side) == "/dst"));
    CHECK(rename((d + side + "/x/c").c_str(), (d + side + "/a/b/c").c_str()) == 0);
  }
  removeTreeNoFollow(d);
}

int main() {
  tarReaderChecksNumbersAndChecksums();
  removeNeverFollowsSymlinks();
  cloneKeepsHolesAndRefusesExisting();
  poolNamesAreDistinctAndCollisionsRetry();
  namesAreRandomLowercaseHex();
  layoutPathsAreThePoolsOwn();
  forkedChildDrawsOtherIds();
  renameNoReplaceNeverReplaces();
  removeTakesSymlinksNeverTheirTargets();
  removeTakesAChainDeeperThanPathMax();
  cloneCopiesSparseDataKeepingHoles();
  lockFollowsAFileReplacedAtItsPath();
  lockRegistryRefusesAWaitOnItself();
  replaceFileWritesOnlyTheLockedFile();
  dotTestIsExact();
  readNamesOnEmptyAndLargeDirectories();
  forEachNameStopsOnAThrowAndClosesItsFd();
  tempFileLeavesNothingUnlessPublished();
  pwriteAllWritesAtItsOffsetOrReturnsTheErrno();
  badAllocIsEnomemInOnePlace();
  unexpectedExceptionsAreInternal();
  replaceFileLeavesNoTempAndRemovesOnlyItsOwn();
  removeTakesASmallTreeAndCountsItsBytes();
  cloneOfATreeCountsEveryKindAndLeavesNoTemp();
  sweepPassesOnAHandBuiltPool();
  errorTextIsBoundedPathIsWhole();
  walkPairsClimbCheckedOnBothSides();
  std::printf("%s\n", failures ? "core tests FAILED" : "core tests passed");
  return failures ? 1 : 0;
}

// Tests of native/core on its own, without Node (ctest; also built with sanitizers: see .ci/run). Each check
// runs against a fresh directory under $TMPDIR (ext4 here, so clones copy).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cctype>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../../native/core/clone.h"
#include "../../native/core/error.h"
#include "../../native/core/lock.h"
#include "../../native/core/names.h"
#include "../../native/core/pool.h"
#include "../../native/core/remove.h"
#include "../../native/core/rename.h"
#include "../../native/core/tree.h"

using namespace vmspace;

static int failures = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      (void)std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                     \
    }                                                                 \
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
  pool->dispose(r.name, r.leaseFd);
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
  int fd = lockOpen(path, false, &acquired);
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
  CHECK(close(fd) == 0);
  removeTreeNoFollow(d);
}

int main() {
  removeNeverFollowsSymlinks();
  cloneKeepsHolesAndRefusesExisting();
  poolNamesAreDistinctAndCollisionsRetry();
  namesAreRandomLowercaseHex();
  renameNoReplaceNeverReplaces();
  removeTakesSymlinksNeverTheirTargets();
  removeTakesAChainDeeperThanPathMax();
  cloneCopiesSparseDataKeepingHoles();
  lockFollowsAFileReplacedAtItsPath();
  std::printf("%s\n", failures ? "core tests FAILED" : "core tests passed");
  return failures ? 1 : 0;
}

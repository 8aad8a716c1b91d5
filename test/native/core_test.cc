// Tests of native/core on its own, without Node (ctest; also built with sanitizers: see .ci/run). Each check
// runs against a fresh directory under $TMPDIR (ext4 here, so clones copy).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <string>

#include "../../native/core/clone.h"
#include "../../native/core/error.h"
#include "../../native/core/names.h"
#include "../../native/core/pool.h"
#include "../../native/core/remove.h"
#include "../../native/core/tree.h"

using namespace vmspace;

static int failures = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                     \
    }                                                                 \
  } while (0)

static std::string fresh() {
  const char* base = getenv("TMPDIR");
  std::string t = std::string(base ? base : "/tmp") + "/vmspace-core-XXXXXX";
  return mkdtemp(&t[0]);
}

static void writeFile(const std::string& path, const std::string& data) {
  FILE* f = std::fopen(path.c_str(), "w");
  std::fwrite(data.data(), 1, data.size(), f);
  std::fclose(f);
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
  int fd = open((d + "/sparse").c_str(), O_WRONLY | O_CREAT, 0640);
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
  req.infoJson = "{}";
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

int main() {
  removeNeverFollowsSymlinks();
  cloneKeepsHolesAndRefusesExisting();
  poolNamesAreDistinctAndCollisionsRetry();
  std::printf("%s\n", failures ? "core tests FAILED" : "core tests passed");
  return failures ? 1 : 0;
}

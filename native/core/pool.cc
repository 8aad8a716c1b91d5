#include "pool.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <new>
#include <unordered_set>

#include "error.h"
#include "io.h"
#include "json_members.h"
#include "names.h"
#include "remove.h"
#include "rename.h"

namespace vmspace {
namespace {

constexpr size_t kMaxMetaBytes = 16 << 20;

// Who may write the pool: the rule of OpenSSH's safe_path() and systemd's CHASE_SAFE. A directory of the pool, or
// one on the path to it, that another user could write lets that user rename, plant or rewrite workspaces and
// metadata; a symlink another user owns on the path lets them point the pool elsewhere.
struct Trust {
  uid_t euid;
  long long sharedGid;  // -1: none; else members of this group are trusted as the owner is
};

// Why `st` (of an fd opened O_NOFOLLOW, never of a path) is not safe, or nullptr. `ancestor`: a directory above
// the pool root, where a sticky directory writable by all (/tmp) is fine: others cannot rename or remove what
// they do not own in it (and what the walk enters next is checked in turn).
const char* untrustedReason(const struct stat& st, const Trust& t, bool ancestor) {
  bool shared = t.sharedGid >= 0 && static_cast<long long>(st.st_gid) == t.sharedGid;
  bool sticky = ancestor && (st.st_mode & S_ISVTX);
  if (st.st_uid != t.euid && st.st_uid != 0 && !shared)
    return S_ISLNK(st.st_mode) ? "a symlink owned by another user" : "owned by another user";
  if (S_ISLNK(st.st_mode)) return nullptr;  // a symlink's own mode means nothing
  if ((st.st_mode & S_IWOTH) && !sticky) return "writable by others";
  if ((st.st_mode & S_IWGRP) && !sticky && !shared) return "writable by its group";
  return nullptr;
}

void checkTrusted(int fd, const std::string& shown, const Trust& t, bool ancestor) {
  struct stat st;
  if (fstat(fd, &st) != 0) throwErrno(errno, "fstat", shown);
  const char* reason = untrustedReason(st, t, ancestor);
  if (!reason) return;
  char mode[8];
  (void)snprintf(mode, sizeof mode, "0%o", static_cast<unsigned>(st.st_mode & 07777));  // at most 5 characters
  std::string detail = "'" + shown + "' is " + reason + " (uid " + std::to_string(st.st_uid) + ", gid " +
                       std::to_string(st.st_gid) + ", mode " + mode + "); a pool and the directories above it " +
                       "must be writable only by this process's user (uid " + std::to_string(t.euid) + ") or root";
  if (t.sharedGid >= 0) detail += ", or group " + std::to_string(t.sharedGid);
  Error e;
  e.code = "ERR_POOL_UNSAFE";
  e.syscall = "open";
  e.path = shown;
  e.detail = std::move(detail);
  e.uid = st.st_uid;
  e.gid = st.st_gid;
  e.mode = static_cast<int>(st.st_mode & 07777);
  throw e;
}

// Makes directory `name` below `at` with exactly `mode` (and group `gid` when >= 0), whatever the umask: made
// 0700, so it is never more open than meant, then fchown and fchmod on the fd (chown first: it clears setgid).
// False when it existed already.
bool makeDirExact(int at, const char* name, mode_t mode, long long gid, const std::string& shown) {
  if (mkdirat(at, name, 0700) != 0) {
    if (errno == EEXIST) return false;
    throwErrno(errno, "mkdir", shown);
  }
  UniqueFd fd(openat(at, name, kDirFlags));
  if (!fd) throwErrno(errno, "open", shown);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) throwErrno(errno, "fstat", shown);
  // A setgid bit the kernel gave it (inherited from a setgid parent, mkdir(2)) is kept: entries keep that group.
  if (gid < 0)
    mode |= st.st_mode & S_ISGID;
  else if (fchown(fd.get(), static_cast<uid_t>(-1), static_cast<gid_t>(gid)) != 0)
    throwErrno(errno, "fchown", shown);
  if (fchmod(fd.get(), mode) != 0) throwErrno(errno, "fchmod", shown);
  return true;
}

// Opens directory `name` of the pool below `at` (never following a symlink), made with `mode` when missing and
// `create`, and checks it. An empty fd when it is missing and not made.
UniqueFd openPoolDir(int at, const char* name, const std::string& shown, bool create, mode_t mode, const Trust& t) {
  for (;;) {
    UniqueFd fd(openat(at, name, kDirFlags));
    if (fd) {
      checkTrusted(fd.get(), shown, t, false);
      return fd;
    }
    if (errno != ENOENT) throwErrno(errno, "open", shown);
    if (!create) return fd;
    makeDirExact(at, name, mode, t.sharedGid, shown);  // EEXIST: made meanwhile by another process, open it
  }
}

// Pushes the components of `p` onto `todo` so that the first is on top ("." and empty ones dropped).
void pushComponents(std::vector<std::string>* todo, const std::string& p) {
  for (size_t end = p.size(); end > 0;) {
    size_t start = p.rfind('/', end - 1);
    start = start == std::string::npos ? 0 : start + 1;
    if (end > start && p.compare(start, end - start, ".") != 0) todo->push_back(p.substr(start, end - start));
    end = start == 0 ? 0 : start - 1;
  }
}

// The target of the symlink opened O_PATH|O_NOFOLLOW as `fd`; an empty or PATH_MAX-long one is an error.
std::string readLinkTarget(int fd, const std::string& shown) {
  char target[PATH_MAX];
  ssize_t n = readlinkat(fd, "", target, sizeof target);
  if (n < 0) throwErrno(errno, "readlink", shown);
  if (n == 0 || static_cast<size_t>(n) == sizeof target) throwErrno(n == 0 ? ENOENT : ENAMETOOLONG, "readlink", shown);
  return std::string(target, static_cast<size_t>(n));
}

// The absolute path shown for the parent of the absolute `shown` ("/" for "/" and "/x").
std::string parentOf(const std::string& shown) {
  size_t slash = shown.rfind('/');
  return slash == 0 || slash == std::string::npos ? "/" : shown.substr(0, slash);
}

constexpr int kMaxSymlinks = 40;  // as the kernel's path walk (MAXSYMLINKS)

// Opens the directory at the absolute `path` component by component from "/", each with O_PATH|O_NOFOLLOW and
// checked by fstat of that fd (what is checked is what the next step uses: no path is looked up twice). A
// symlink is followed by hand after its owner is checked; `..` steps to the parent, checked again. With
// `create`, missing directories are made, 0755 (the last one `rootMode`), after the directory holding them
// passed. Returns an O_RDONLY fd of the pool root, itself checked as a pool directory (no sticky exception).
UniqueFd openTrustedPath(const std::string& path, bool create, mode_t rootMode, const Trust& t) {
  std::vector<std::string> todo;  // components still to walk, the next one last
  pushComponents(&todo, path);
  auto openRoot = [&] {
    UniqueFd fd(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!fd) throwErrno(errno, "open", "/");
    checkTrusted(fd.get(), "/", t, !todo.empty());
    return fd;
  };
  UniqueFd cur = openRoot();
  std::string shown = "/";
  auto join = [](const std::string& dir, const std::string& name) {
    return dir == "/" ? "/" + name : dir + "/" + name;
  };
  int links = 0;
  // Components at or above this depth of `todo` come from a symlink's target, which must exist as mkdir -p
  // requires (mkdir(2) of a dangling symlink is EEXIST): only components of the path as given are made.
  size_t targetFloor = SIZE_MAX;
  while (!todo.empty()) {
    std::string name = std::move(todo.back());
    todo.pop_back();
    const bool fromTarget = todo.size() >= targetFloor;
    if (!fromTarget) targetFloor = SIZE_MAX;
    std::string next = name == ".." ? parentOf(shown) : join(shown, name);
    UniqueFd fd(openat(cur.get(), name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) {
      // As open(2) of the whole path names it; a symlink's missing target is ENOENT, never made.
      if (errno != ENOENT || !create || fromTarget) throwErrno(errno, "open", path);
      makeDirExact(cur.get(), name.c_str(), todo.empty() ? rootMode : 0755, todo.empty() ? t.sharedGid : -1, next);
      todo.push_back(name);  // made or made meanwhile: open and check it as any other
      continue;
    }
    struct stat st;
    if (fstat(fd.get(), &st) != 0) throwErrno(errno, "fstat", next);
    if (S_ISLNK(st.st_mode)) {
      checkTrusted(fd.get(), next, t, true);
      if (++links > kMaxSymlinks) throwErrno(ELOOP, "open", next);
      std::string to = readLinkTarget(fd.get(), next);
      targetFloor = std::min(targetFloor, todo.size());
      pushComponents(&todo, to);
      if (to[0] == '/') {
        cur = openRoot();
        shown = "/";
      }
      continue;
    }
    if (!S_ISDIR(st.st_mode)) throwErrno(ENOTDIR, "open", next);
    checkTrusted(fd.get(), next, t, !todo.empty());
    cur = std::move(fd);
    shown = std::move(next);
  }
  // "." of an O_PATH fd is that same directory: no path lookup that could be raced.
  UniqueFd dir(openat(cur.get(), ".", kDirFlags));
  if (!dir) throwErrno(errno, "open", shown);
  return dir;
}

// Reads a whole small file below `at` (never following a symlink); returns the errno (0 on success).
int readSmallFile(int at, const std::string& name, std::string* out) {
  return readRegularFileAt(at, name.c_str(), O_NOFOLLOW, kMaxMetaBytes, out);
}

// Writes `data` to a fresh temp file in `dirFd` and publishes it as `name` without replacing (publishFileNoReplace:
// renameat2(RENAME_NOREPLACE), or link + unlink where the file system lacks it). Returns false, leaving nothing
// behind, when `name` exists.
bool writeFileNoReplace(int dirFd, const std::string& name, const std::string& data, bool durable,
                        const std::string& shown) {
  std::string tmp = "." + name + ".tmp-" + randomHex(6);
  TempFile fd(dirFd, tmp, 0644, shown);
  // 0644 exactly, whatever the umask (under umask 0777 the version file would be mode 000 and the pool's owner
  // could not reopen it as a non-root user).
  if (fchmod(fd.fd(), 0644) != 0) throwErrno(errno, "fchmod", shown);
  if (int err = writeAll(fd.fd(), data)) throwErrno(err, "write", shown);
  if (durable && fsync(fd.fd()) != 0) throwErrno(errno, "fsync", shown);
  fd.close();
  const char* step;
  if (int err = publishFileNoReplace(dirFd, tmp.c_str(), dirFd, name.c_str(), &step)) {
    if (err != EEXIST) throwErrno(err, step, shown);
    return false;  // the temp file is removed as `fd` goes
  }
  fd.published();
  return true;
}

constexpr char kNoReplaceProbe[] = ".noreplace-probe-";  // the sweep removes ownerless ones

// Whether the pool's file system takes renameat2(RENAME_NOREPLACE): 0, or the errno with which it refuses the flag
// (EINVAL, ENOSYS: FUSE without rename2, some network file systems). Asked once, by renaming an empty probe file
// in `dirFd` (.vmspace/, which no sweep reads: a sweep of meta/ or staging/ would count a probe it removed).
// Where no probe can be made (read-only, no permission) it counts as supported: nothing can be published there.
int probeNoReplace(int dirFd) {
  std::string probe = kNoReplaceProbe + randomHex(6), moved = probe + "-b";
  UniqueFd fd(openat(dirFd, probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600));
  if (!fd) return 0;
  fd.reset();
  int err = 0;
  if (renameat2(dirFd, probe.c_str(), dirFd, moved.c_str(), RENAME_NOREPLACE) == 0)
    unlinkat(dirFd, moved.c_str(), 0);
  else {
    err = noReplaceUnsupported(errno) ? errno : 0;
    unlinkat(dirFd, probe.c_str(), 0);
  }
  return err;
}

// How long a lease held only by shared probes (list() in some process, each a few microseconds) is tried
// again before it counts as held; a free lease is refused only when probes overlap for all that time.
constexpr long kProbeDeadlineNs = 1000L * 1000 * 1000;
constexpr long kProbeFirstPauseUs = 100;
constexpr long kProbeMaxPauseUs = 10000;

long monotonicNs() {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return now.tv_sec * 1000L * 1000 * 1000 + now.tv_nsec;
}

void pauseUs(long us) {
  struct timespec pause = {0, us * 1000};
  nanosleep(&pause, nullptr);
}

// flock(LOCK_EX|LOCK_NB) on a workspace directory. Leases are exclusive and list() probes are shared, so when
// the exclusive try fails a shared try tells them apart: it fails at once under a lease (false, errno
// EWOULDBLOCK), and succeeds when only probes are in the way, which are waited out with a growing pause.
// Probes are waited out until `deadline` (monotonicNs), then the lease counts as held.
bool tryLease(int fd, long deadline) {
  for (long pauseFor = kProbeFirstPauseUs;; pauseFor = std::min(pauseFor * 2, kProbeMaxPauseUs)) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) return true;
    if (errno != EWOULDBLOCK) return false;
    if (flock(fd, LOCK_SH | LOCK_NB) != 0) return false;  // EWOULDBLOCK: an exclusive lease
    flock(fd, LOCK_UN);
    if (monotonicNs() >= deadline) {
      errno = EWOULDBLOCK;
      return false;
    }
    pauseUs(pauseFor);
  }
}

// True when `name` in dirFd (not followed) is the file `own` describes: the identity check of a directory held
// by fd against what is at its name now, after anything else could have moved it.
bool sameEntry(int dirFd, const std::string& name, const struct stat& own) {
  struct stat at;
  return fstatat(dirFd, name.c_str(), &at, AT_SYMLINK_NOFOLLOW) == 0 && at.st_ino == own.st_ino &&
         at.st_dev == own.st_dev;
}

bool isHexId(const char* s) {
  for (int i = 0; i < kIdHexChars; i++) {
    char c = s[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return s[kIdHexChars] == 0;
}

// <prefix>-<32 lowercase hex>, prefix non-empty.
bool isWorkspaceName(const char* name) {
  size_t len = strlen(name);
  if (len < kIdHexChars + 2 || name[0] == '.') return false;
  return name[len - kIdHexChars - 1] == '-' && isHexId(name + len - kIdHexChars);
}

#ifdef VMSPACE_TEST_HOOKS
std::mutex g_faultMutex;
std::vector<SweepFault> g_faults;  // guarded by g_faultMutex
bool g_faultsActive = false;       // read without the mutex: a stale false only delays a fault set meanwhile
#endif

// Whether setSweepFaultsForTest set a fault for `name` of that kind (a flock errno, or bad_alloc when
// `flockErrno` is false); taken when it did (it applies once). Returns the errno, or 1 for bad_alloc; 0: none.
int takeSweepFault(const std::string& name, bool flockErrno) {
#ifndef VMSPACE_TEST_HOOKS
  return 0;  // a release build has no seam
#else
  if (!__atomic_load_n(&g_faultsActive, __ATOMIC_ACQUIRE)) return 0;
  std::lock_guard<std::mutex> hold(g_faultMutex);
  for (auto it = g_faults.begin(); it != g_faults.end(); ++it) {
    if (it->name != name || (it->flockErrno != 0) != flockErrno) continue;
    int err = flockErrno ? it->flockErrno : 1;
    g_faults.erase(it);
    return err;
  }
  return 0;
#endif
}

}  // namespace

#ifdef VMSPACE_TEST_HOOKS
void setSweepFaultsForTest(std::vector<SweepFault> faults) {
  std::lock_guard<std::mutex> hold(g_faultMutex);
  g_faults = std::move(faults);
  __atomic_store_n(&g_faultsActive, !g_faults.empty(), __ATOMIC_RELEASE);
}
#endif

const std::string& bootId() {
  static const std::string id = [] {
    std::string text;
    if (readSmallFile(AT_FDCWD, "/proc/sys/kernel/random/boot_id", &text) != 0) return std::string();
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    return text;
  }();
  return id;
}

namespace {

// The xattr refused by the file system, not failing: none at all (ENOTSUP: tmpfs before 6.6, some FUSE and network
// file systems), or not this big (E2BIG, ENOSPC, ERANGE: ext4 keeps a directory's xattrs in one block). The
// metadata then goes to its file.
bool xattrRefused(int err) { return err == ENOTSUP || err == E2BIG || err == ENOSPC || err == ERANGE; }

// Reads xattr kMetaXattr of `fd` (at most XATTR_SIZE_MAX, 64 KiB, by the kernel's own limit); returns the errno.
int readMetaXattr(int fd, std::string* out) {
  out->resize(512);
  for (;;) {
    ssize_t n = fgetxattr(fd, kMetaXattr, out->data(), out->size());
    if (n >= 0) {
      out->resize(static_cast<size_t>(n));
      return 0;
    }
    if (errno != ERANGE) return errno;
    // Bigger than the buffer: ask its size (it may change again before the next read: then loop).
    ssize_t need = fgetxattr(fd, kMetaXattr, nullptr, 0);
    if (need < 0) return errno;
    out->resize(static_cast<size_t>(need) + 1);
  }
}

}  // namespace

// Format 3: the name of staging shard `i` in .vmspace/staging/ ("s0" ... ).
static std::string shardName(int i) { return "s" + std::to_string(i); }

std::shared_ptr<Pool> Pool::open(const std::string& root, bool create, long long sharedGid, int newFormat) {
  std::shared_ptr<Pool> pool(new Pool());
  pool->root_ = root;
  std::string state = root + "/.vmspace";
  const Trust trust{geteuid(), sharedGid};
  const mode_t dirMode = sharedGid >= 0 ? 02770 : 0755;  // setgid: entries made inside keep the shared group
  pool->rootFd_ = openTrustedPath(root, create, dirMode, trust);
  pool->stateFd_ = openPoolDir(pool->rootFd_.get(), ".vmspace", state, create, dirMode, trust);
  if (!pool->stateFd_) throwErrno(ENOENT, "open", state);

  // The subdirectories that exist are checked before anything (the version file, a missing subdirectory) is
  // made: an unsafe pool is refused unchanged.
  struct Sub {
    const char* name;
    UniqueFd* fd;
  } subs[] = {{"staging", &pool->stagingFd_}, {"trash", &pool->trashFd_}, {"meta", &pool->metaFd_}};
  for (auto& sub : subs) *sub.fd = openPoolDir(pool->stateFd_.get(), sub.name, state + "/" + sub.name, false, 0, trust);

  // Renames between the root and .vmspace/ must stay on one file system (rename(2) cannot cross them).
  struct stat rootSt, stateSt;
  if (fstat(pool->rootFd_.get(), &rootSt) != 0) throwErrno(errno, "fstat", root);
  if (fstat(pool->stateFd_.get(), &stateSt) != 0) throwErrno(errno, "fstat", state);
  if (rootSt.st_dev != stateSt.st_dev) throwErrno(EXDEV, "open", state, root);
  pool->rootDev_ = rootSt.st_dev;

  // The format is checked before anything is made inside .vmspace/, so an unknown pool is never modified.
  std::string versionPath = state + "/version", version;
  int err = readSmallFile(pool->stateFd_.get(), "version", &version);
  if (err == ENOENT && create) {
    writeFileNoReplace(pool->stateFd_.get(), "version", std::to_string(newFormat) + "\n", false, versionPath);
    err = readSmallFile(pool->stateFd_.get(), "version", &version);
  }
  if (err) throwErrno(err, "open", versionPath);
  while (!version.empty() && (version.back() == '\n' || version.back() == ' ')) version.pop_back();
  if (version == "1" || version == "2" || version == "3")
    pool->format_ = version[0] - '0';
  else
    throwCode("ERR_POOL_FORMAT", "pool format '" + version.substr(0, 32) + "' is not one this vmspace reads (1, 2, 3)",
              0, "open", versionPath);

  // Format 3: the staging shards that exist are checked too before anything is made, so that a pool with an unsafe
  // one is refused unchanged; the missing ones are made below, with the directories above.
  const int shards = pool->format_ >= 3 ? kStagingShards : 0;
  for (int i = 0; i < shards && pool->stagingFd_; i++)
    pool->shardFds_[i] =
        openPoolDir(pool->stagingFd_.get(), shardName(i).c_str(), state + "/staging/" + shardName(i), false, 0, trust);

  const mode_t subMode = sharedGid >= 0 ? 02770 : 0700;
  for (auto& sub : subs) {
    std::string shown = state + "/" + sub.name;
    if (!*sub.fd) *sub.fd = openPoolDir(pool->stateFd_.get(), sub.name, shown, create, subMode, trust);
    if (!*sub.fd) throwErrno(ENOENT, "open", shown);
  }
  for (int i = 0; i < shards; i++) {
    std::string shown = state + "/staging/" + shardName(i);
    if (!pool->shardFds_[i])
      pool->shardFds_[i] = openPoolDir(pool->stagingFd_.get(), shardName(i).c_str(), shown, create, subMode, trust);
    if (!pool->shardFds_[i]) throwErrno(ENOENT, "open", shown);
  }
  pool->noReplaceErr_ = probeNoReplace(pool->stateFd_.get());
  pool->sharedGid_ = sharedGid;
  return pool;
}

// Issue 14: templates/ is made on the first commit, so pools without templates stay as older code made them.
TemplateStore* Pool::templates(bool create) {
  std::lock_guard<std::mutex> hold(templatesMu_);
  if (!templates_)
    templates_ = TemplateStore::open(stateFd_.get(), root_ + "/.vmspace", trashFd_.get(), create, sharedGid_);
  return templates_.get();
}

bool Pool::publishMeta(const std::string& name, const std::string& json, bool durable) {
  return writeFileNoReplace(metaFd_.get(), name + ".json", json, durable, metaPath(name));
}

AllocateResult Pool::allocate(const AllocateRequest& req) { return publish(stage(req), req.info, req.clone); }

int Pool::stagingShard() const {
  if (format_ < 3) return -1;
  // Threads of one process take consecutive shards, processes start at shards spread by their pid.
  static std::atomic<unsigned> next{static_cast<unsigned>(getpid()) * 5u};
  thread_local const int shard = static_cast<int>(next.fetch_add(1, std::memory_order_relaxed) % kStagingShards);
  return shard;
}

std::string Pool::stagingPath(int shard, const std::string& name) const {
  return shard < 0 ? root_ + "/.vmspace/staging/" + name : root_ + "/.vmspace/staging/" + shardName(shard) + "/" + name;
}

bool Pool::inStaging(const std::string& name) const {
  struct stat st;
  if (fstatat(stagingFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return true;
  for (int i = 0; format_ >= 3 && i < kStagingShards; i++)
    if (fstatat(shardFds_[i].get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return true;
  return false;
}

namespace {

// Draws the next name, `prefix` (ending in its "-") and a fresh id, for a workspace; `*tries` counts the draws of one
// build (stage and publish together): ERR_NAME_EXHAUSTED past kMaxNameTries.
void drawName(int* tries, const std::string& prefix, const std::string& root, std::string* id, std::string* name) {
  if (*tries == kMaxNameTries)
    throwCode("ERR_NAME_EXHAUSTED",
              "every one of " + std::to_string(kMaxNameTries) + " names drawn for a workspace existed already", EEXIST,
              "mkdir", root);
  ++*tries;
  *id = randomId();
  *name = prefix + *id;
}

}  // namespace

// One build of a workspace in staging (Pool::stage): a function per phase. The checks and the template come first,
// so that a refused request leaves nothing; then a name is claimed (directory or snapshot, and its lease), and the
// quota and the clones go into it.
class PoolStage {
 public:
  PoolStage(Pool& pool, const AllocateRequest& req)
      : pool_(pool), req_(req), shard_(pool.stagingShard()), dirFd_(pool.stagingDirFd(shard_)),
        stagingDir_(pool.stagingPath(shard_, "")) {}
  // Issue 14: a template being read is released when the build ends, after its lease was dropped (a failure).
  ~PoolStage() {
    if (store_) store_->release(reader_);
  }

  StagedWorkspace run() {
    checkCanBuild();
    acquireTemplate();
    // Issue 14: from a template whose tree is a btrfs subvolume, the workspace is a writable snapshot of it (no
    // walk); where the kernel refuses one (EPERM: a template owned by another user; EXDEV), the walk below.
    snapshot_ = reader_.subvolume && req_.clone.reflink != Reflink::Never;
    UniqueFd lease = claimName();
    std::string stagingPath = stagingDir_ + res_.name;
    try {
      // The quota is on the empty workspace before anything is cloned in (a project id is inherited from here on).
      if (req_.quota.any())
        res_.quota = applyQuota(lease.get(), stagingPath, quotaSupport_, req_.quota,
                                quotaSupport_.backend == QuotaBackend::Project ? pool_.projectsFd(true) : -1,
                                pool_.projectIds_, res_.name);
      cloneSources(lease.get(), stagingPath);
    } catch (...) {
      try {
        pool_.removeWorkspace(dirFd_, res_.name, stagingPath);
      } catch (...) {
        // Left with its lease free (closed below): a sweep reclaims it. The original error is the one to report,
        // whatever the cleanup met (an Error, or bad_alloc).
      }
      throw;
    }
    res_.lease = std::move(lease);
    res_.draws = tries_;
    res_.shard = shard_;
    return std::move(res_);
  }

 private:
  // Refusals before anything is made.
  void checkCanBuild() {
    // A workspace is a directory: without RENAME_NOREPLACE nothing publishes it without the risk of replacing one
    // (rename(2) replaces an empty directory; link(2) takes no directory).
    if (pool_.noReplaceErr_)
      throwCode("ERR_RENAME_NOREPLACE_UNSUPPORTED",
                "the pool's file system cannot rename without replacing (renameat2 RENAME_NOREPLACE), which publishing "
                "a workspace needs",
                pool_.noReplaceErr_, "renameat2", pool_.root_);
    // Quota and free-space floor (issue 13, quota.h).
    if (req_.quota.any()) {
      quotaSupport_ = probeQuota(pool_.rootFd_.get());
      if (quotaSupport_.err)
        throwCode("ERR_QUOTA_UNSUPPORTED", quotaSupport_.detail, quotaSupport_.err, "quotactl", pool_.root_);
      if (req_.quota.inodes && !quotaSupport_.inodes)
        throwCode("ERR_QUOTA_UNSUPPORTED",
                  "btrfs qgroups limit bytes, not inodes: quota.inodes cannot be enforced here", EINVAL,
                  "ioctl(BTRFS_IOC_QGROUP_LIMIT)", pool_.root_);
    }
    if (pool_.minFreeBytes_ && fsSpace(pool_.rootFd_.get(), pool_.root_).available < pool_.minFreeBytes_)
      throwErrno(ENOSPC, "statvfs", pool_.root_);
    subvolume_ = req_.quota.any() && quotaSupport_.backend == QuotaBackend::Btrfs;
  }

  // Issue 14: a template is resolved and held for reading (flock LOCK_SH) before anything is made, so an
  // unknown one (ERR_TEMPLATE_NOT_FOUND) leaves nothing, and a removal or replace waits for this clone.
  void acquireTemplate() {
    if (req_.fromTemplate.empty()) return;
    TemplateStore* s = pool_.templates(false);
    if (!s)
      throwCode("ERR_TEMPLATE_NOT_FOUND", "no template with the id or name '" + req_.fromTemplate + "'", ENOENT, "open",
                pool_.root_ + "/.vmspace/templates");
    reader_ = s->acquire(req_.fromTemplate);
    store_ = s;
    res_.templateId = reader_.id;
    res_.templateMeta = reader_.metaText;
  }

  // The exclusive mkdir is the claim on a name: EEXIST means someone has it, and it is never adopted. The
  // lease is taken before anything is inside, so a sweep sees a leased staging entry as being built.
  UniqueFd claimName() {
    UniqueFd lease;
    for (;; res_.retries++) {
      drawName(&tries_, req_.prefix + "-", pool_.root_, &res_.id, &res_.name);
      if (snapshot_) {
        int err = makeSnapshot();
        if (err == EEXIST) continue;
        snapshot_ = err == 0;
      }
      if (!snapshot_ && makeDir() == EEXIST) continue;
      if (takeLease(&lease)) break;
      tries_--;  // not a collision
    }
    return lease;
  }

  // Issue 14: staging/<name> as a writable snapshot of the template's subvolume. 0 (made), EEXIST (a collision), or
  // the errno with which the kernel refused a snapshot (the caller then makes a directory and clones into it).
  int makeSnapshot() {
    int err = makeWorkspaceSnapshot(reader_.subvolume.get(), dirFd_, res_.name, req_.mode);
    if (err != 0 && err != EEXIST && err != EPERM && err != EACCES && err != EXDEV && err != ENOTTY &&
        err != EOPNOTSUPP)
      throwErrno(err, "ioctl(BTRFS_IOC_SNAP_CREATE_V2)", stagingDir_ + res_.name);
    return err;
  }

  // staging/<name> as a directory, or a btrfs subvolume for a quota. 0 (made) or EEXIST (a collision).
  int makeDir() {
    int err = makeWorkspaceDir(dirFd_, res_.name, req_.mode, subvolume_);
    if (err != 0 && err != EEXIST)
      throwErrno(err, subvolume_ ? "ioctl(BTRFS_IOC_SUBVOL_CREATE)" : "mkdir", stagingDir_ + res_.name);
    return err;
  }

  // The lease on the entry just made: true when held on it. Until the lease is ours, a sweep with a grace period
  // shorter than this build's age may reclaim the entry: then it is gone (ENOENT here) or no longer the directory at
  // the name (below), false is returned, and a fresh name is claimed.
  bool takeLease(UniqueFd* lease) {
    std::string shown = stagingDir_ + res_.name;
    lease->reset(openat(dirFd_, res_.name.c_str(), kDirFlags));
    if (!*lease) {
      int err = errno;
      if (err == ENOENT && ++reclaimed_ < kMaxNameTries) return false;
      unlinkat(dirFd_, res_.name.c_str(), AT_REMOVEDIR);
      throwErrno(err, "open", shown);
    }
    // A probe of that sweep holds the lock for a moment: wait for it.
    if (flock(lease->get(), LOCK_EX | LOCK_NB) != 0 && (errno != EWOULDBLOCK || flock(lease->get(), LOCK_EX) != 0)) {
      int err = errno;
      unlinkat(dirFd_, res_.name.c_str(), AT_REMOVEDIR);
      throwErrno(err, "flock", shown);
    }
    struct stat own;
    if (fstat(lease->get(), &own) != 0) throwErrno(errno, "fstat", shown);
    if (sameEntry(dirFd_, res_.name, own)) return true;
    if (++reclaimed_ == kMaxNameTries) throwErrno(ENOENT, "open", shown);
    return false;
  }

  // The template's committed tree (a snapshot made already, or cloned here), then the template directory and the
  // entries of the request, into the leased workspace `wsFd`.
  void cloneSources(int wsFd, const std::string& stagingPath) {
    CloneOptions opts = req_.clone;
    opts.overwrite = false;
    if (store_) {  // issue 14: the committed tree, then the write bits the commit removed
      ClonedEntry c{"", reader_.treePath, {}, {}};
      if (snapshot_) {
        struct stat st;
        if (fstat(reader_.subvolume.get(), &st) != 0) throwErrno(errno, "fstat", reader_.treePath);
        fillIdentity(&c.identity, st);
        c.result.tree = c.result.snapshot = true;
      } else {
        c.result = cloneTreeInto(reader_.treePath, wsFd, pool_.path(res_.name), opts, req_.progress, &c.identity);
      }
      store_->restoreModes(reader_, wsFd, stagingPath);
      res_.clones.push_back(std::move(c));
    }
    if (!req_.templateDir.empty()) {
      ClonedEntry c{"", req_.templateDir, {}, {}};
      c.result = cloneTreeInto(req_.templateDir, wsFd, pool_.path(res_.name), opts, req_.progress, &c.identity);
      res_.clones.push_back(std::move(c));
    }
    for (const TemplateEntry& entry : req_.entries) {
      std::string leaf;
      ParentDir parent = openParentBeneath(wsFd, entry.dest, &leaf, stagingPath, true);
      ClonedEntry c{entry.dest, entry.source, {}, {}};
      c.result = clonePathAt(entry.source, parent.get(), leaf, pool_.path(res_.name) + "/" + entry.dest, opts,
                             req_.progress, &c.identity);
      res_.clones.push_back(std::move(c));
    }
  }

  Pool& pool_;
  const AllocateRequest& req_;
  const int shard_;               // format 3: the shard built in (-1: staging/ itself)
  const int dirFd_;               // staging/ or the shard
  const std::string stagingDir_;  // "<root>/.vmspace/staging/" (or ".../staging/s<i>/"), as errors show it
  StagedWorkspace res_;
  int tries_ = 0;      // names drawn, first or after a collision: ERR_NAME_EXHAUSTED past kMaxNameTries
  int reclaimed_ = 0;  // entries a sweep (graceMs shorter than a build's first microseconds) took from us
  QuotaSupport quotaSupport_;
  bool subvolume_ = false;  // the workspace is a btrfs subvolume (its quota is a qgroup)
  TemplateStore* store_ = nullptr;
  TemplateReader reader_;
  bool snapshot_ = false;  // issue 14: the workspace is a snapshot of the template's subvolume
};

StagedWorkspace Pool::stage(const AllocateRequest& req) { return PoolStage(*this, req).run(); }

void Pool::discard(StagedWorkspace&& staged) {
  UniqueFd lease = std::move(staged.lease);  // dropped last: the entry stays ours while it is removed
  removeWorkspace(stagingDirFd(staged.shard), staged.name, stagingPath(staged.shard, staged.name));
}

// One publish of a staged workspace (Pool::publish): its metadata written, then its name claimed in the root, a fresh
// one drawn on each collision; any failure removes the workspace and its metadata.
class PoolPublish {
 public:
  PoolPublish(Pool& pool, StagedWorkspace&& staged, const JsonMembers& info, const CloneOptions& clone)
      : pool_(pool), info_(info), clone_(clone), lease_(std::move(staged.lease)), projectId_(staged.quota.projectId),
        shard_(staged.shard), dirFd_(pool.stagingDirFd(shard_)),
        tries_(staged.draws) {  // ERR_NAME_EXHAUSTED past kMaxNameTries, counting the stage's draws
    res_.id = std::move(staged.id);
    res_.name = std::move(staged.name);
    res_.retries = staged.retries;
    res_.clones = std::move(staged.clones);
    res_.templateId = std::move(staged.templateId);  // issue 14
    res_.templateMeta = std::move(staged.templateMeta);
    stagingName_ = res_.name;
    stagingPath_ = pool.stagingPath(shard_, stagingName_);
    inXattr_ = pool.format_ >= 2;
  }

  AllocateResult run() {
    try {
      if (inXattr_) setMetaXattr();
      // The metadata name (format 1) and then the workspace name are each claimed with RENAME_NOREPLACE; an
      // existing entry under either is a collision, answered with a fresh name, never by adopting it.
      while (!claimName()) redraw();
      if (clone_.durable) {
        if (!inXattr_ && fsync(pool_.metaFd_.get()) != 0) throwErrno(errno, "fsync", pool_.root_ + "/.vmspace/meta");
        if (fsync(pool_.rootFd_.get()) != 0) throwErrno(errno, "fsync", pool_.root_);
      }
    } catch (...) {
      cleanUp();
      throw;
    }
    res_.leaseFd = lease_.release();
    res_.metaInXattr = inXattr_;
    return std::move(res_);
  }

 private:
  // The caller's members, then the name and the template sources, added here, where the sources' identity
  // (device, inode, size, mtime at clone time) is known.
  std::string metaJson() const {
    JsonMembers members = info_;
    std::string name;
    appendJsonString(&name, res_.name);
    members.emplace_back("name", std::move(name));
    if (!res_.templateId.empty()) members.emplace_back("templateId", "\"" + res_.templateId + "\"");  // issue 14
    std::string json = "[";
    for (size_t i = 0; i < res_.clones.size(); i++) {
      const ClonedEntry& c = res_.clones[i];
      const SourceIdentity& id = c.identity;
      if (i) json += ",";
      json += "{\"dest\":";
      appendJsonString(&json, c.dest);
      json += ",\"source\":";
      appendJsonString(&json, c.source);
      json += std::string(",\"kind\":\"") + (c.result.tree ? "tree" : "file") + "\",\"dev\":\"" +
              std::to_string(id.dev) + "\",\"ino\":\"" + std::to_string(id.ino) +
              "\",\"size\":" + std::to_string(id.size) + ",\"mtimeNs\":\"" +
              std::to_string(id.mtimeSec * 1000000000LL + id.mtimeNsec) + "\",\"method\":\"" +
              methodName(c.result, clone_.reflink) + "\"}";
    }
    json += "]";
    members.emplace_back("template", std::move(json));
    return jsonObject(members) + "\n";
  }

  // Format 2: the metadata is an xattr of the workspace directory, set (replacing any that a template clone
  // copied onto it) while it is still in staging, so it is never seen without it; written again after a redraw
  // (it names the workspace). A file system that refuses the xattr gets the file, as format 1.
  void setMetaXattr() {
    std::string json = metaJson();
    if (fsetxattr(lease_.get(), kMetaXattr, json.data(), json.size(), 0) == 0) {
      syncXattr();
      return;
    }
    if (!xattrRefused(errno)) throwErrno(errno, "fsetxattr", stagingPath_);
    inXattr_ = false;
    // A copy from the template (which fit, when ours did not) must not shadow the file.
    if (fremovexattr(lease_.get(), kMetaXattr) != 0 && errno != ENODATA && errno != ENOTSUP)
      throwErrno(errno, "fremovexattr", stagingPath_);
  }
  void syncXattr() {
    if (clone_.durable && fsync(lease_.get()) != 0) throwErrno(errno, "fsync", stagingPath_);
  }

  // The metadata file (format 1), then the workspace, under res_.name: false on a collision (nothing left there).
  bool claimName() {
    if (!inXattr_ && !pool_.publishMeta(res_.name, metaJson(), clone_.durable)) return false;
    if (!inXattr_) metaPublished_ = res_.name;
    if (renameat2(dirFd_, stagingName_.c_str(), pool_.rootFd_.get(), res_.name.c_str(), RENAME_NOREPLACE) == 0) {
      published_ = true;
      return true;
    }
    if (errno != EEXIST) throwErrno(errno, "renameat2", stagingPath_, pool_.path(res_.name));
    if (!inXattr_) {
      unlinkat(pool_.metaFd_.get(), (res_.name + ".json").c_str(), 0);  // ours: we just made it
      metaPublished_.clear();
    }
    return false;
  }

  // A fresh name is claimed in staging too (the staging entry is renamed to it with RENAME_NOREPLACE), so that
  // a staging name always belongs to one build, as the first exclusive mkdir made it.
  void redraw() {
    for (;;) {
      res_.retries++;
      drawName(&tries_, res_.name.substr(0, res_.name.size() - res_.id.size()), pool_.root_, &res_.id,
               &res_.name);  // the prefix: "<prefix>-"
      if (renameat2(dirFd_, stagingName_.c_str(), dirFd_, res_.name.c_str(), RENAME_NOREPLACE) == 0) break;
      if (errno != EEXIST) throwErrno(errno, "renameat2", stagingPath_, pool_.stagingPath(shard_, res_.name));
    }
    stagingName_ = res_.name;
    stagingPath_ = pool_.stagingPath(shard_, stagingName_);
    if (projectId_) renameProjectClaim(pool_.projectsFd(false), projectId_, res_.name);  // quota
    if (inXattr_) setMetaXattr();
  }

  void cleanUp() {
    if (!metaPublished_.empty()) unlinkat(pool_.metaFd_.get(), (metaPublished_ + ".json").c_str(), 0);
    try {
      if (published_)  // only when the final fsync failed
        pool_.removeWorkspace(pool_.rootFd_.get(), res_.name, pool_.path(res_.name));
      else
        pool_.removeWorkspace(dirFd_, stagingName_, stagingPath_);
    } catch (...) {
      // Left with its lease free (closed below): a sweep reclaims it. The original error is the one to report,
      // whatever the cleanup met (an Error, or bad_alloc).
    }
  }

  Pool& pool_;
  const JsonMembers& info_;
  const CloneOptions& clone_;
  UniqueFd lease_;
  AllocateResult res_;
  const uint32_t projectId_;  // quota: its claim follows the name
  const int shard_;           // format 3: the staging shard it was built in (-1: staging/)
  const int dirFd_;           // staging/ or the shard
  int tries_;
  std::string stagingName_, stagingPath_;
  std::string metaPublished_;  // format 1: the metadata file made, removed on a failure
  bool published_ = false;     // the workspace is in the root (only a final fsync can fail then)
  bool inXattr_;               // format 2: the metadata is an xattr (false where refused: the file)
};

AllocateResult Pool::publish(StagedWorkspace&& staged, const JsonMembers& info, const CloneOptions& clone) {
  return PoolPublish(*this, std::move(staged), info, clone).run();
}

int Pool::readMeta(int wsFd, const std::string& name, std::string* text, bool* inXattr) {
  *inXattr = false;
  if (format_ >= 2) {
    int err = readMetaXattr(wsFd, text);
    // ENODATA: none, its metadata is in the file (the xattr was refused when it was made).
    if (err != ENODATA && err != ENOTSUP) {
      *inXattr = true;
      return err;
    }
  }
  return readSmallFile(metaFd_.get(), name + ".json", text);
}

void Pool::dropMeta(const std::string& name) {
  std::string file = name + ".json";
  if (unlinkat(metaFd_.get(), file.c_str(), 0) == 0 || errno == ENOENT) return;
  if (errno != EISDIR) throwErrno(errno, "unlink", metaPath(name));
  removeTreeNoFollow(metaFd_.get(), file, metaPath(name));  // a directory in its place: removed safely too
}

bool Pool::moveToTrash(const std::string& name, int fd) {
  struct stat own;
  if (fstat(fd, &own) != 0) throwErrno(errno, "fstat", path(name));
  // The name disappears from the root atomically; from here on nobody can open or adopt it by name. Without
  // RENAME_NOREPLACE (noReplaceErr_), rename(2) could replace only an empty directory of that name in trash,
  // which is garbage there; what moved is checked below either way.
  auto move = [&] {
    return noReplaceErr_ ? renameat(rootFd_.get(), name.c_str(), trashFd_.get(), name.c_str())
                         : renameat2(rootFd_.get(), name.c_str(), trashFd_.get(), name.c_str(), RENAME_NOREPLACE);
  };
  if (move() != 0) {
    int err = errno;
    // EACCES: moving a directory to another parent rewrites its "..", which needs write permission on it
    // (fs/namei.c, vfs_rename), and a guest may have cleared its owner write bit (chmod 500 .). We own it:
    // give the bit back through the fd we hold and try once more; the first errno is what went wrong otherwise.
    bool retried = false;
    if (err == EACCES && (own.st_mode & S_IWUSR) == 0 && fchmod(fd, (own.st_mode & 07777) | S_IWUSR) == 0) {
      retried = true;
      if (move() == 0)
        err = 0;
      else if (errno == ENOENT)
        err = ENOENT;
    }
    if (err != 0) {
      if (retried) fchmod(fd, own.st_mode & 07777);  // best effort: leave its mode as it was
      if (err == ENOENT) return false;
      throwErrno(err, "renameat2", path(name), root_ + "/.vmspace/trash/" + name);
    }
  }
  struct stat moved;
  if (fstatat(trashFd_.get(), name.c_str(), &moved, AT_SYMLINK_NOFOLLOW) != 0)
    throwErrno(errno, "stat", root_ + "/.vmspace/trash/" + name);
  if (moved.st_dev != own.st_dev || moved.st_ino != own.st_ino) {
    // Whatever was at the name is not the directory we hold: put it back untouched.
    renameat2(trashFd_.get(), name.c_str(), rootFd_.get(), name.c_str(), RENAME_NOREPLACE);
    throwErrno(ESTALE, "rename", path(name));
  }
  return true;
}

void Pool::dispose(const std::string& name, int leaseFd, DisposeHints hints) {
  UniqueFd lease(leaseFd);
  // An empty workspace (the common case) is removed at its name: one rmdir(2) changes one directory, where the
  // move into trash and the rmdir there change two, twice (under many workers these directory locks are the
  // bottleneck, issue 12). rmdir removes only an empty directory and refuses a mount point (EBUSY), and the name
  // vanishes atomically as with the rename. The identity check closes what the rename's check closes: the name
  // must still be the directory we hold (only a process of the pool's owner could have swapped it meanwhile).
  // Not for a workspace with a quota of its own (issue 13): a btrfs subvolume (its own st_dev) or a pool that has
  // project-id claims goes through removeWorkspace, which releases them.
  struct stat own;
  bool known = fstat(lease.get(), &own) == 0;
  bool plain = known && own.st_dev == rootDev_ && (!hints.claim || claimsIfAny() < 0);
  if (plain && sameEntry(rootFd_.get(), name, own) && unlinkat(rootFd_.get(), name.c_str(), AT_REMOVEDIR) == 0) {
    if (hints.metaFile) dropMeta(name);
    return;
  }
  // Anything else (not empty, not ours, gone, a mount) takes the general path, which reports it as before.
  std::string trashPath = root_ + "/.vmspace/trash/" + name;
  bool inTrash = moveToTrash(name, lease.get());
  if (!inTrash) {
    // Gone from the root: a dispose that failed before may have left it in trash; finish it if it is ours.
    inTrash = known && sameEntry(trashFd_.get(), name, own);
  }
  if (inTrash) removeWorkspace(trashFd_.get(), name, trashPath);
  if (hints.metaFile) dropMeta(name);
}

AdoptResult Pool::adopt(const std::string& name) {
  AdoptResult r;
  UniqueFd fd(openat(rootFd_.get(), name.c_str(), kDirFlags));
  if (!fd) throwErrno(errno == ENOTDIR || errno == ELOOP ? ENOENT : errno, "open", path(name));
  if (!tryLease(fd.get(), monotonicNs() + kProbeDeadlineNs)) {
    if (errno == EWOULDBLOCK)
      throwCode("ERR_LEASE_HELD", "another process holds the lease of workspace " + name, EWOULDBLOCK, "flock",
                path(name));
    throwErrno(errno, "flock", path(name));
  }
  // A sweep may have removed it between our open and our lock: it must still be the directory at the name.
  struct stat own;
  if (fstat(fd.get(), &own) != 0) throwErrno(errno, "fstat", path(name));
  if (!sameEntry(rootFd_.get(), name, own)) throwErrno(ENOENT, "open", path(name));
  r.metaErrno = readMeta(fd.get(), name, &r.metaText, &r.metaInXattr);
  r.leaseFd = fd.release();
  return r;
}

namespace {

// Names in a directory, read through a fresh open file description (readdir offsets are per description).

// A published workspace as readdir shows it: a directory (or an entry of unknown type) named <prefix>-<32 hex>.
bool isWorkspaceEntry(const std::string& name, unsigned char type) {
  return (type == DT_DIR || type == DT_UNKNOWN) && isWorkspaceName(name.c_str());
}

// Milliseconds since the entry was made: its birth time where the file system records it (statx STATX_BTIME:
// ext4, XFS, btrfs), else its last status change.
int64_t ageMs(int dirFd, const std::string& name) {
  struct statx stx;
  if (statx(dirFd, name.c_str(), AT_SYMLINK_NOFOLLOW, STATX_BTIME | STATX_CTIME, &stx) != 0) return 0;
  struct statx_timestamp t = (stx.stx_mask & STATX_BTIME) ? stx.stx_btime : stx.stx_ctime;
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  return (now.tv_sec - t.tv_sec) * 1000 + (now.tv_nsec - static_cast<long>(t.tv_nsec)) / 1000000;
}

// What handling one sweep entry threw (call inside a catch), as that entry's error: a core Error as it is;
// std::bad_alloc as ENOMEM, as the binding reports it for a whole call; anything else as ERR_INTERNAL naming it.
Error entryError(const std::string& shown) {
  Error e;
  try {
    throw;
  } catch (const Error& err) {
    return err;
  } catch (const std::bad_alloc&) {
    e = outOfMemoryError();
  } catch (const std::exception& x) {
    e.code = "ERR_INTERNAL";
    e.detail = std::string("unexpected C++ exception: ") + x.what();
  } catch (...) {
    e.code = "ERR_INTERNAL";
    e.detail = "unexpected C++ exception";
  }
  e.path = shown;
  return e;
}

// ENOENT at the entry itself (not below it): the entry is gone, finished by someone else.
bool vanished(const Error& e, const std::string& shown) { return e.code.empty() && e.err == ENOENT && e.path == shown; }

}  // namespace

// One sweep of a pool (Pool::sweep): a function per pass, and the report and per-entry handling they share.
class PoolSweep {
 public:
  PoolSweep(Pool& pool, bool dryRun, int64_t graceMs)
      : pool_(pool), dryRun_(dryRun), graceMs_(graceMs), trashDir_(pool.root_ + "/.vmspace/trash"),
        stagingDir_(pool.root_ + "/.vmspace/staging") {}

  SweepReport run() {
    publishedPass();
    trashPass();
    stagingPass();
    // Issue 14: half-built templates, retired templates no one reads, names of commits that died.
    if (TemplateStore* store = pool_.templates(false)) store->sweep(dryRun_, graceMs_, report_);
    metaPass();
    probePass();
    pool_.sweepProjectClaims(dryRun_, graceMs_);  // quota: project ids of workspaces gone without releasing them
    return std::move(report_);
  }

 private:
  // One entry's failure (any errno, or an exception such as std::bad_alloc) is reported in that entry and the
  // sweep goes on: one guest's tree must not stop the reclamation of the whole pool. ENOENT at the entry itself
  // is no failure: a dispose, publish or sweep elsewhere finished it meanwhile.
  template <typename Handle>
  void guarded(const std::string& name, const char* from, const std::string& shown, Handle&& handle) {
    try {
      if (takeSweepFault(name, false)) throw std::bad_alloc();  // test seam
      handle();
    } catch (...) {
      Error err = entryError(shown);
      if (!vanished(err, shown)) report_.failed.push_back({name, from, 0, std::move(err)});
    }
  }

  // Removes dirFd/name (shown below dirPath) and reports it reclaimed (with the bytes freed) or failed.
  void removeEntry(int dirFd, const std::string& dirPath, const std::string& name, const char* from) {
    std::string shown = dirPath + "/" + name;
    guarded(name, from, shown, [&] {
      SweepEntry e{name, from, 0, {}};
      pool_.removeWorkspace(dirFd, name, shown, &e.bytes);
      report_.reclaimed.push_back(std::move(e));
    });
  }

  // Metadata of a workspace this sweep removed; a metadata file it cannot remove is left for a later sweep.
  void dropMetaQuietly(const std::string& name) {
    try {
      pool_.dropMeta(name);
    } catch (...) {
    }
  }

  // Published workspaces: a free lease means the owner is gone. The lock is held while the workspace is moved
  // and removed, so no adopt can take it meanwhile.
  void reclaimPublished(const std::string& name, int fd) {
    handled_.insert(name);
    if (dryRun_) {
      report_.reclaimed.push_back({name, "published", 0, {}});
      return;
    }
    if (!pool_.moveToTrash(name, fd)) return;  // disposed or reclaimed by someone else meanwhile
    removeEntry(pool_.trashFd_.get(), trashDir_, name, "published");
    dropMetaQuietly(name);
  }

  void publishedPass() {
    // One deadline for the whole pass: shared locks on many entries cost at most kProbeDeadlineNs in all.
    const long probeDeadline = monotonicNs() + kProbeDeadlineNs;
    // `name` below is a plain reference: a C++17 lambda may not capture a structured binding (GCC allows it, clang
    // does not).
    for (auto& entry : readNames(pool_.rootFd_.get(), pool_.root_)) {
      const std::string& name = entry.first;
      if (!isWorkspaceEntry(name, entry.second)) continue;
      guarded(name, "published", pool_.path(name), [&] {
        UniqueFd fd(openat(pool_.rootFd_.get(), name.c_str(), kDirFlags));
        if (!fd) {
          // Gone meanwhile, or not a directory (then not a workspace).
          if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP) return;
          throwErrno(errno, "open", pool_.path(name));
        }
        bool leased = tryLease(fd.get(), probeDeadline);
        if (int fault = takeSweepFault(name, true)) {  // test seam: a probe failing as no local fs makes it
          leased = false;
          errno = fault;
        }
        if (!leased) {
          if (errno != EWOULDBLOCK) throwErrno(errno, "flock", pool_.path(name));  // a probe that cannot decide
          report_.live++;
          return;
        }
        reclaimPublished(name, fd.get());
      });
    }
  }

  // An entry of trash or staging that no one holds locked is removed, with the lock held while it is; true when
  // it was (or, dry run, would be) reclaimed.
  bool reclaimUnlocked(int dirFd, const std::string& dirPath, const std::string& name, const char* from) {
    UniqueFd fd(openat(dirFd, name.c_str(), kDirFlags));
    if (!fd && errno == ENOENT) return false;  // finished meanwhile by a dispose, a publish or another sweep
    // Any other open failure (a file, a symlink: no lease to respect) goes on to the removal, which reports it.
    if (fd && flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK) return false;  // a dispose removing it, or a build holding its lease
      throwErrno(errno, "flock", dirPath + "/" + name);
    }
    if (dryRun_) {
      report_.reclaimed.push_back({name, from, 0, {}});
      return true;
    }
    size_t before = report_.reclaimed.size();
    removeEntry(dirFd, dirPath, name, from);
    return report_.reclaimed.size() > before;
  }

  // Trash: everything not locked by a dispose still removing it.
  void trashPass() {
    for (auto& entry : readNames(pool_.trashFd_.get(), trashDir_)) {
      const std::string& name = entry.first;
      if (handled_.count(name)) continue;  // reported by the pass above, removed or failed
      guarded(name, "trash", trashDir_ + "/" + name, [&] {
        if (reclaimUnlocked(pool_.trashFd_.get(), trashDir_, name, "trash") && !dryRun_) dropMetaQuietly(name);
      });
    }
  }

  // Staging: the lease is taken when the entry is made, so a free one past the grace period is a build whose
  // process died; a young free one may be a build that has not taken its lease yet.
  // Format 3: staging/ holds the shards (never reclaimed) and each shard holds builds.
  void stagingPass() {
    stagingPassIn(pool_.stagingFd_.get(), stagingDir_, pool_.format_ >= 3);
    for (int i = 0; pool_.format_ >= 3 && i < kStagingShards; i++)
      stagingPassIn(pool_.shardFds_[i].get(), stagingDir_ + "/" + shardName(i), false);
  }
  void stagingPassIn(int dirFd, const std::string& dir, bool skipShards) {
    for (auto& entry : readNames(dirFd, dir)) {
      const std::string& name = entry.first;
      if (skipShards && isShardName(name)) continue;
      guarded(name, "staging", dir + "/" + name, [&] {
        // Age first: a young entry is never even probed, so a build between its mkdir and its lock is not
        // disturbed.
        if (ageMs(dirFd, name) < graceMs_) return;
        reclaimUnlocked(dirFd, dir, name, "staging");
      });
    }
  }
  // s0 ... s<kStagingShards - 1>: no workspace name (<prefix>-<32 hex>) is one.
  static bool isShardName(const std::string& name) {
    for (int i = 0; i < kStagingShards; i++)
      if (name == shardName(i)) return true;
    return false;
  }

  // Whether the pass looks at `file` of meta/ (any dot file; else "<name>.json" only), and in *name the workspace
  // it belongs to: <name> of "<name>.json" or of a temp file ".<name>.json.tmp-<hex>" (writeFileNoReplace), ""
  // for another dot file.
  static bool metaOwner(const std::string& file, std::string* name) {
    if (file[0] == '.') {
      size_t end = file.rfind(".json.tmp-");
      if (end != std::string::npos && end > 1) *name = file.substr(1, end - 1);
      return true;
    }
    if (file.size() < 6 || file.compare(file.size() - 5, 5, ".json") != 0) return false;
    *name = file.substr(0, file.size() - 5);
    return true;
  }

  // Metadata without a workspace (published or being built), and temp files of writes that died: a temp file
  // of a workspace still being built is a write in progress.
  void metaPass() {
    for (auto& [file, type] : readNames(pool_.metaFd_.get(), pool_.root_ + "/.vmspace/meta")) {
      std::string name;
      if (!metaOwner(file, &name)) continue;
      if (!name.empty()) {
        // Staging first: a publish moves the entry from staging to the root, so looking in that order never
        // misses one being published between the two lookups.
        struct stat st;
        if (pool_.inStaging(name) || fstatat(pool_.rootFd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0)
          continue;
      }
      if (ageMs(pool_.metaFd_.get(), file) < graceMs_) continue;
      if (!dryRun_) {
        try {
          removeTreeNoFollow(pool_.metaFd_.get(), file, pool_.root_ + "/.vmspace/meta/" + file);
        } catch (...) {
          continue;  // left for a later sweep, as any metadata file that cannot be removed
        }
      }
      report_.metaRemoved++;
    }
  }

  // Probe files of openPool's RENAME_NOREPLACE check (probeNoReplace) that a killed opener left in .vmspace/: a
  // probe lives for microseconds, so one older than the grace period has no owner left.
  void probePass() {
    if (dryRun_) return;
    for (auto& [file, type] : readNames(pool_.stateFd_.get(), pool_.root_ + "/.vmspace")) {
      if (file.compare(0, sizeof kNoReplaceProbe - 1, kNoReplaceProbe) != 0 || type == DT_DIR) continue;
      if (ageMs(pool_.stateFd_.get(), file) < graceMs_) continue;
      unlinkat(pool_.stateFd_.get(), file.c_str(), 0);  // quietly: an opener or another sweep may remove it first
    }
  }

  Pool& pool_;
  const bool dryRun_;
  const int64_t graceMs_;
  const std::string trashDir_, stagingDir_;
  SweepReport report_;
  std::unordered_set<std::string> handled_;  // published entries this sweep moved to trash
};

SweepReport Pool::sweep(bool dryRun, int64_t graceMs) { return PoolSweep(*this, dryRun, graceMs).run(); }

std::vector<ListEntry> Pool::list() {
  std::vector<ListEntry> out;
  for (auto& [name, type] : readNames(rootFd_.get(), root_)) {
    if (!isWorkspaceEntry(name, type)) continue;
    UniqueFd ws(openat(rootFd_.get(), name.c_str(), kDirFlags));
    if (!ws && (errno == ENOENT || errno == ENOTDIR || errno == ELOOP)) continue;  // disposed meanwhile, not a dir
    ListEntry entry;
    entry.name = name;
    if (!ws) {
      // Any other failure (EACCES, EMFILE, ...) is that entry's error, counted live (never reported reclaimable on
      // its word): a workspace that cannot be opened is not hidden from the listing.
      entry.probeErrno = errno;
      entry.probeSyscall = "open";
      entry.live = true;
      out.push_back(std::move(entry));
      continue;
    }
    entry.metaErrno = readMeta(ws.get(), name, &entry.metaText, &entry.metaInXattr);
    // A shared probe conflicts with the owner's exclusive lease and with nothing else. It is dropped at once
    // (the close), so an adopt or sweep elsewhere waits out as short a window as possible (tryLease).
    int probe = flock(ws.get(), LOCK_SH | LOCK_NB) == 0 ? 0 : errno;
    if (int fault = takeSweepFault(name, true)) probe = fault;  // test seam (setSweepFaultsForTest), as in sweep
    if (probe != 0) {
      errno = probe;
      // A probe that cannot decide (ENOLCK, ...) is reported in that entry, counted live (never reclaimable on
      // its word), and the listing goes on: one entry does not hide the others.
      if (errno != EWOULDBLOCK) entry.probeErrno = errno;
      entry.live = true;
    }
    // Metadata missing: a dispose (or a sweep) may have taken the workspace between the open and the read (cold
    // review: 38 such entries in ~148k list() calls racing this process's disposes, format 1; the lease may still be
    // held, closed last). Gone from its name, it is no entry; still there, its missing metadata is reported, never
    // read as empty.
    struct stat own;
    if (entry.metaErrno == ENOENT && fstat(ws.get(), &own) == 0 && !sameEntry(rootFd_.get(), name, own)) continue;
    ws.reset();
    out.push_back(std::move(entry));
  }
  return out;
}

void Pool::close() {
  templates_.reset();
  metaFd_.reset();
  trashFd_.reset();
  stagingFd_.reset();
  for (auto& fd : shardFds_) fd.reset();
  stateFd_.reset();
  rootFd_.reset();
}

}  // namespace vmspace

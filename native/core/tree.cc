#include "tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "error.h"
#include "fd.h"
#include "names.h"
#include "process.h"
#include "remove.h"
#include "statx.h"
#include "rename.h"

namespace vmspace {
namespace {

constexpr int kDirFlags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY;

// Opens the directory `rel` (normalised, relative) beneath `rootFd` without following any symlink on the way:
// openat2(2) RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS (Linux 5.6), or an O_NOFOLLOW walk where openat2 is missing.
int openDirBeneath(int rootFd, const std::string& rel) {
  if (rel.empty()) return fcntl(rootFd, F_DUPFD_CLOEXEC, 0);
  static std::atomic<bool> noOpenat2{false};
  if (!noOpenat2.load(std::memory_order_relaxed)) {
    struct open_how how = {};
    how.flags = kDirFlags;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    int fd = static_cast<int>(syscall(SYS_openat2, rootFd, rel.c_str(), &how, sizeof how));
    if (fd >= 0 || errno != ENOSYS) return fd;
    noOpenat2.store(true, std::memory_order_relaxed);
  }
  UniqueFd cur(fcntl(rootFd, F_DUPFD_CLOEXEC, 0));
  size_t start = 0;
  while (cur) {
    size_t slash = rel.find('/', start);
    std::string comp = rel.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    cur.reset(openat(cur.get(), comp.c_str(), kDirFlags));
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return cur.release();
}

// The walk. Each directory is a task: its entries are recreated by whichever thread takes it, regular files
// (reflink or copy) inline, subdirectories made and queued as new tasks. Up to kMaxThreads threads take tasks
// (the calling thread plus helpers started once there is queued work): the per-file cost is kernel work
// (openat(O_CREAT) and FICLONE take most of it), so the walk scales with cores, not with fewer syscalls.
// Tasks hold no fds while queued (they reopen their directory beneath the roots), so a wide tree cannot run
// out of descriptors. A directory's mode and times are set when it and every directory below it are done.
struct Owner {
  uid_t uid;
  gid_t gid;
};

class TreeCloner {
 public:
  static constexpr unsigned kMaxThreads = 4;

  TreeCloner(const CloneOptions& opts, CloneProgress* progress, int srcRootFd, int dstRootFd, std::string srcRoot,
             std::string dstRoot)
      : opts_(opts), progress_(progress), srcRootFd_(srcRootFd), dstRootFd_(dstRootFd), srcRoot_(std::move(srcRoot)),
        dstRoot_(std::move(dstRoot)), euid_(geteuid()), egid_(getegid()), umask_(currentUmask()) {
    unsigned cores = std::thread::hardware_concurrency();
    maxThreads_ = std::max(1u, std::min(kMaxThreads, cores ? cores : 1u));
  }

  ~TreeCloner() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : helpers_) t.join();
  }

  // Fills the (empty) destination root with the contents of the source root. Throws the first error.
  void cloneContents() {
    struct stat st;
    if (fstat(dstRootFd_, &st) == 0) skip_ = {st.st_dev, st.st_ino};  // never walk into the tree being built
    auto root = std::make_unique<Task>();
    root->applyMeta = false;
    Task* r = root.get();
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(root));
      queue_.push_back(r);
    }
    work();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return active_ == 0; });
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : helpers_) t.join();
    helpers_.clear();
    if (failed_) throw firstError_;
  }

  // Applies a source directory's metadata to a destination directory (the root of a tree clone).
  void copyDirMeta(int srcFd, int dstFd, const struct stat& st, const std::string& rel) {
    struct stat now;
    if (fstat(dstFd, &now) != 0) throwErrno(errno, "fstat", dstPath(rel));
    copyOwnerXattrs(srcFd, dstFd, st, rel, {now.st_uid, now.st_gid});
    setModeTimes(dstFd, st, rel);
  }

  CloneSummary summary;  // complete after cloneContents returns

 private:
  struct Task {
    std::string rel;   // below the roots ("" for the roots)
    struct stat st{};  // the source directory's
    bool applyMeta = true;
    Task* parent = nullptr;
    std::atomic<int> pending{1};  // its own entries, plus each subdirectory not yet complete
  };

  std::string srcPath(const std::string& rel) const { return rel.empty() ? srcRoot_ : srcRoot_ + "/" + rel; }
  std::string dstPath(const std::string& rel) const { return rel.empty() ? dstRoot_ : dstRoot_ + "/" + rel; }

  // The loop of every thread: take a task, do it, until no task is queued and none is running.
  void work() {
    CloneSummary local;
    for (;;) {
      Task* t;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty() || active_ == 0; });
        if (stop_ || queue_.empty()) break;
        t = queue_.back();  // LIFO: depth first, so directories complete (and are finished) early
        queue_.pop_back();
        active_++;
      }
      try {
        directory(t, local);
        complete(t);
      } catch (const Error& e) {
        fail(e);
      } catch (const std::bad_alloc&) {
        Error e;
        e.err = ENOMEM;
        e.syscall = "malloc";
        fail(e);
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        active_--;
      }
      cv_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    add(summary, local);
  }

  static void add(CloneSummary& into, const CloneSummary& s) {
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

  void fail(const Error& e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_) {
        failed_ = true;
        firstError_ = e;
      }
      stop_ = true;
    }
    cv_.notify_all();
  }

  void enqueue(std::unique_ptr<Task> task) {
    bool spawn = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(task.get());
      tasks_.push_back(std::move(task));
      spawn = queue_.size() > 1 && helpers_.size() + 1 < maxThreads_ && !stop_;
      if (spawn) helpers_.emplace_back([this] { work(); });
    }
    cv_.notify_one();
  }

  // A task's own entries are done, or one of its subdirectories completed: when nothing is left, set its mode
  // and times (post-order) and tell its parent.
  void complete(Task* t) {
    while (t && t->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      if (t->applyMeta) {
        UniqueFd dst(openDirBeneath(dstRootFd_, t->rel));
        if (!dst) throwErrno(errno, "open", dstPath(t->rel));
        setModeTimes(dst.get(), t->st, t->rel);
      }
      t = t->parent;
    }
  }

  void directory(Task* t, CloneSummary& local) {
    UniqueFd src(openDirBeneath(srcRootFd_, t->rel));
    if (!src) throwErrno(errno, "open", srcPath(t->rel), dstPath(t->rel));
    UniqueFd dst(openDirBeneath(dstRootFd_, t->rel));
    if (!dst) throwErrno(errno, "open", srcPath(t->rel), dstPath(t->rel));
    // Owner and xattrs now; mode and times once everything below is written (complete()).
    struct stat dstSt;
    if (fstat(dst.get(), &dstSt) != 0) throwErrno(errno, "fstat", dstPath(t->rel));
    if (t->applyMeta && copyOwnerXattrs(src.get(), dst.get(), t->st, t->rel, {dstSt.st_uid, dstSt.st_gid}) &&
        fstat(dst.get(), &dstSt) != 0)
      throwErrno(errno, "fstat", dstPath(t->rel));
    // What new entries here are owned by: our uid, and our gid, or the directory's where it is setgid
    // (mkdir(2)/open(2) inherit the group of a setgid directory).
    Owner created{euid_, (dstSt.st_mode & S_ISGID) ? dstSt.st_gid : egid_};
    int sfd = src.get();
    DIR* dir = fdopendir(src.release());
    if (!dir) {
      int err = errno;
      ::close(sfd);
      throwErrno(err, "opendir", srcPath(t->rel));
    }
    std::unique_ptr<DIR, int (*)(DIR*)> closer(dir, closedir);
    for (;;) {
      errno = 0;
      struct dirent* de = readdir(dir);
      if (!de) {
        if (errno) throwErrno(errno, "readdir", srcPath(t->rel));
        return;
      }
      const char* name = de->d_name;
      if (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0))) continue;
      if (stop_ || (progress_ && progress_->cancel.load(std::memory_order_relaxed)))
        throwErrno(ECANCELED, "clone", srcPath(t->rel), dstPath(t->rel));
      entry(t, sfd, dst.get(), name, created, local);
    }
  }

  void entry(Task* t, int sdir, int ddir, const char* name, Owner created, CloneSummary& local) {
    std::string rel = t->rel.empty() ? std::string(name) : t->rel + "/" + name;
    struct stat st;
    if (fstatat(sdir, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return;  // removed from the source since readdir
      throwErrno(errno, "stat", srcPath(rel), dstPath(rel));
    }
    switch (st.st_mode & S_IFMT) {
      case S_IFDIR: {
        if (st.st_dev == skip_.dev && st.st_ino == skip_.ino) return;
        if (mkdirat(ddir, name, 0700) != 0) throwErrno(errno, "mkdir", srcPath(rel), dstPath(rel));
        local.dirs++;
        auto child = std::make_unique<Task>();
        child->rel = std::move(rel);
        child->st = st;
        child->parent = t;
        t->pending.fetch_add(1, std::memory_order_relaxed);
        enqueue(std::move(child));
        return;
      }
      case S_IFREG:
        regular(sdir, ddir, name, rel, st, created, local);
        return;
      case S_IFLNK: {
        // The target's bytes verbatim: dangling, absolute or pointing outside, it is never resolved.
        char target[PATH_MAX + 1];
        ssize_t n = readlinkat(sdir, name, target, PATH_MAX);
        if (n < 0) throwErrno(errno, "readlink", srcPath(rel), dstPath(rel));
        target[n] = 0;
        if (symlinkat(target, ddir, name) != 0) throwErrno(errno, "symlink", srcPath(rel), dstPath(rel));
        nodeMeta(ddir, name, st, rel, created, true);
        local.symlinks++;
        return;
      }
      case S_IFIFO:
        if (mknodat(ddir, name, S_IFIFO | 0600, 0) != 0) throwErrno(errno, "mknod", srcPath(rel), dstPath(rel));
        nodeMeta(ddir, name, st, rel, created, false);
        local.fifos++;
        return;
      case S_IFCHR:
      case S_IFBLK:
        if (mknodat(ddir, name, (st.st_mode & S_IFMT) | 0600, st.st_rdev) != 0) {
          if (errno == EPERM) {  // mknod(2) of a device needs CAP_MKNOD: skipped and counted
            local.skippedDevices++;
            return;
          }
          throwErrno(errno, "mknod", srcPath(rel), dstPath(rel));
        }
        nodeMeta(ddir, name, st, rel, created, false);
        local.devices++;
        return;
      case S_IFSOCK:
        local.skippedSockets++;
        return;
      default:
        return;
    }
  }

  void regular(int sdir, int ddir, const char* name, const std::string& rel, const struct stat& st, Owner created,
               CloneSummary& local) {
    std::unique_lock<std::mutex> linkLock(linkMu_, std::defer_lock);
    if (st.st_nlink > 1) {
      // Hard-linked files are cloned once, under a lock so that two threads never both clone one inode.
      linkLock.lock();
      auto it = links_.find({st.st_dev, st.st_ino});
      if (it != links_.end()) {
        if (linkat(dstRootFd_, it->second.c_str(), ddir, name, 0) != 0)
          throwErrno(errno, "link", srcPath(rel), dstPath(rel));
        local.hardlinks++;
        return;
      }
    }
    // O_NOATIME keeps the walk from dirtying every source inode; allowed for the owner and CAP_FOWNER only.
    // O_NONBLOCK: should the entry have become a fifo since fstatat, open must not wait for a writer (the
    // clone of it then fails: FICLONE and lseek refuse a fifo).
    int flags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY;
    if (euid_ == 0 || st.st_uid == euid_) flags |= O_NOATIME;
    UniqueFd src(openat(sdir, name, flags));
    if (!src && errno == EPERM && (flags & O_NOATIME)) src.reset(openat(sdir, name, flags & ~O_NOATIME));
    if (!src) throwErrno(errno, "open", srcPath(rel), dstPath(rel));
    // Created with its final permission bits where the umask keeps them, saving an fchmod per file; the
    // tree is private until published (its root is 0700).
    mode_t perm = st.st_mode & 0777;
    bool exact = (perm & umask_) == 0 && (st.st_mode & 07000) == 0;
    UniqueFd dst(openat(ddir, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, exact ? perm : 0600));
    if (!dst) throwErrno(errno, "open", srcPath(rel), dstPath(rel));
    CloneFileResult data;
    try {
      // The paths are set by the catch below, so none are built per file here.
      data = cloneData(src.get(), dst.get(), static_cast<uint64_t>(st.st_size), opts_.reflink, std::string(),
                    std::string(), progress_ ? &progress_->cancel : nullptr);
    } catch (Error& e) {
      // Name the entry the way every other failure of the walk does: the source entry and its destination.
      e.path = srcPath(rel);
      e.dest = dstPath(rel);
      throw;
    }
    mode_t dropSetId = 0;
    bool chowned = copyOwnerXattrs(src.get(), dst.get(), st, rel, created, &dropSetId);
    bool chmod = !exact || chowned;
    if (chmod && fchmod(dst.get(), st.st_mode & 07777 & ~dropSetId) != 0) throwErrno(errno, "chmod", dstPath(rel));
    struct timespec times[2] = {st.st_atim, st.st_mtim};
    if (futimens(dst.get(), times) != 0) throwErrno(errno, "utimensat", dstPath(rel));
    if (data.method == CloneMethod::Copy) writeBack(dst.get(), opts_.writeback, dstPath(rel));
    if (opts_.durable && fsync(dst.get()) != 0) throwErrno(errno, "fsync", dstPath(rel));
    if (st.st_nlink > 1) links_.emplace(InodeKey{st.st_dev, st.st_ino}, rel);
    (data.method == CloneMethod::Reflink ? local.reflinked : local.copied)++;
    local.files++;
    local.bytes += data.bytes;
    if (progress_) {
      progress_->files.fetch_add(1, std::memory_order_relaxed);
      progress_->bytes.fetch_add(data.bytes, std::memory_order_relaxed);
    }
  }

  // Owner then xattrs: chown(2) clears setuid/setgid and security.capability, so the xattrs (and the mode,
  // which the caller sets after this) come after it. Returns true when the owner was changed (the mode must
  // then be set again). Where the owner (group) could not be kept, *dropSetId (when given) receives the set-user-ID
  // (set-group-ID) bit to leave out of the mode, and security.capability is not copied: privileges of the
  // source's owner are never handed to another (as cp(1) does).
  bool copyOwnerXattrs(int sfd, int dfd, const struct stat& st, const std::string& rel, Owner now,
                       mode_t* dropSetId = nullptr) {
    bool chowned = false, kept = true;
    if (st.st_uid != now.uid || st.st_gid != now.gid) {
      if (fchown(dfd, st.st_uid, st.st_gid) != 0) {
        if (errno != EPERM) throwErrno(errno, "chown", dstPath(rel));
        kept = false;  // EPERM: neither changed
      }
      chowned = true;
    }
    if (dropSetId) {
      *dropSetId = 0;
      if (!kept && st.st_uid != now.uid) *dropSetId |= S_ISUID;
      if (!kept && st.st_gid != now.gid) *dropSetId |= S_ISGID;
    }
    copyXattrs(sfd, dfd, rel, kept || st.st_uid == now.uid);
    return chowned;
  }

  void setModeTimes(int dfd, const struct stat& st, const std::string& rel) {
    if (fchmod(dfd, st.st_mode & 07777) != 0) throwErrno(errno, "chmod", dstPath(rel));
    struct timespec times[2] = {st.st_atim, st.st_mtim};
    if (futimens(dfd, times) != 0) throwErrno(errno, "utimensat", dstPath(rel));
  }

  // Metadata of an entry that cannot be opened for it (symlink, fifo, device): by name, never following.
  void nodeMeta(int ddir, const char* name, const struct stat& st, const std::string& rel, Owner created,
                bool symlink) {
    mode_t mode = st.st_mode & 07777;
    if ((st.st_uid != created.uid || st.st_gid != created.gid) &&
        fchownat(ddir, name, st.st_uid, st.st_gid, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno != EPERM) throwErrno(errno, "chown", dstPath(rel));
      if (st.st_uid != created.uid) mode &= ~S_ISUID;  // set-id only where the owner is kept (copyOwnerXattrs)
      if (st.st_gid != created.gid) mode &= ~S_ISGID;
    }
    if (!symlink && fchmodat(ddir, name, mode, 0) != 0) throwErrno(errno, "chmod", dstPath(rel));
    struct timespec times[2] = {st.st_atim, st.st_mtim};
    if (utimensat(ddir, name, times, AT_SYMLINK_NOFOLLOW) != 0) throwErrno(errno, "utimensat", dstPath(rel));
  }

  // `capability`: whether security.capability is copied (only where the owner is kept).
  void copyXattrs(int sfd, int dfd, const std::string& rel, bool capability) {
    char names[4096];
    ssize_t len = flistxattr(sfd, names, sizeof names);
    std::unique_ptr<char[]> big;
    if (len < 0 && errno == ERANGE) {
      ssize_t need = flistxattr(sfd, nullptr, 0);
      if (need < 0) throwErrno(errno, "flistxattr", srcPath(rel));
      big.reset(new char[need]);
      len = flistxattr(sfd, big.get(), static_cast<size_t>(need));
    }
    if (len < 0) {
      if (errno == ENOTSUP) return;  // the source file system has no xattrs
      throwErrno(errno, "flistxattr", srcPath(rel));
    }
    if (len == 0) return;
    const char* list = big ? big.get() : names;
    std::vector<char> value(4096);
    for (const char* n = list; n < list + len; n += strlen(n) + 1) {
      if (!capability && strcmp(n, "security.capability") == 0) continue;
      ssize_t vlen;
      while ((vlen = fgetxattr(sfd, n, value.data(), value.size())) < 0 && errno == ERANGE) {
        ssize_t need = fgetxattr(sfd, n, nullptr, 0);
        if (need < 0) break;
        value.resize(static_cast<size_t>(need) + 1);
      }
      if (vlen < 0) {
        if (errno == ENODATA) continue;  // removed since the list was read
        throwErrno(errno, "fgetxattr", srcPath(rel));
      }
      if (fsetxattr(dfd, n, value.data(), static_cast<size_t>(vlen), 0) != 0) {
        // Not permitted (trusted.* without CAP_SYS_ADMIN) or not supported by the destination: kept where
        // permitted, as cp -a does.
        if (errno == EPERM || errno == ENOTSUP || errno == EACCES) continue;
        throwErrno(errno, "fsetxattr", dstPath(rel));
      }
    }
  }

  const CloneOptions& opts_;
  CloneProgress* progress_;
  int srcRootFd_, dstRootFd_;
  std::string srcRoot_, dstRoot_;
  uid_t euid_;
  gid_t egid_;
  mode_t umask_;
  unsigned maxThreads_;
  InodeKey skip_{0, 0};

  std::mutex mu_;  // guards everything below it but the atomics
  std::condition_variable cv_;
  std::vector<Task*> queue_;
  std::vector<std::unique_ptr<Task>> tasks_;  // every task, freed with the cloner
  std::vector<std::thread> helpers_;
  unsigned active_ = 0;
  std::atomic<bool> stop_{false};  // also read without the lock, between entries
  bool failed_ = false;
  Error firstError_;

  std::mutex linkMu_;
  std::unordered_map<InodeKey, std::string, InodeHash> links_;  // source inode -> its clone's path below dstRoot
};

void checkSameFs(const struct stat& src, int dstDirFd, const CloneOptions& opts, const std::string& srcPath,
                 const std::string& dstPath) {
  if (opts.reflink != Reflink::Always) return;
  struct stat d;
  if (fstat(dstDirFd, &d) != 0) throwErrno(errno, "fstat", dstPath);
  if (d.st_dev != src.st_dev)
    throwCode("ERR_REFLINK_UNSUPPORTED", "source and destination are on different file systems (reflink: 'always')",
              EXDEV, "clone", srcPath, dstPath);
}

// Opens the source directory of a tree clone, fills *st and `identity` from it, and applies checkSameFs.
UniqueFd openSourceDir(const std::string& srcPath, int dstDirFd, const std::string& dstPath,
                       const CloneOptions& options, SourceIdentity* identity, struct stat* st) {
  UniqueFd src(open(srcPath.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY));
  if (!src) throwErrno(errno, "open", srcPath, dstPath);
  if (fstat(src.get(), st) != 0) throwErrno(errno, "fstat", srcPath);
  fillIdentity(identity, *st);
  checkSameFs(*st, dstDirFd, options, srcPath, dstPath);
  return src;
}

}  // namespace

const char* methodName(const CloneSummary& s, Reflink reflink) {
  if (s.reflinked && s.copied) return "mixed";
  if (s.reflinked) return "reflink";
  if (s.copied) return "copy";
  return reflink == Reflink::Never ? "copy" : "reflink";
}

CloneSummary cloneTreeInto(const std::string& srcPath, int dstFd, const std::string& dstPath,
                           const CloneOptions& options, CloneProgress* progress, SourceIdentity* identity) {
  struct stat st;
  UniqueFd src = openSourceDir(srcPath, dstFd, dstPath, options, identity, &st);
  TreeCloner cloner(options, progress, src.get(), dstFd, srcPath, dstPath);
  cloner.cloneContents();
  cloner.summary.tree = true;
  return cloner.summary;
}

CloneSummary clonePathAt(const std::string& srcPath, int dstDirFd, const std::string& dstName,
                         const std::string& dstPath, const CloneOptions& options, CloneProgress* progress,
                         SourceIdentity* identity) {
  struct stat st;
  if (stat(srcPath.c_str(), &st) != 0) throwErrno(errno, "stat", srcPath, dstPath);
  if (!S_ISDIR(st.st_mode)) {
    CloneFileResult r =
        cloneFileAt(srcPath, dstDirFd, dstName, dstPath, options, identity, progress ? &progress->cancel : nullptr);
    CloneSummary s;
    s.files = 1;
    s.bytes = r.bytes;
    (r.method == CloneMethod::Reflink ? s.reflinked : s.copied) = 1;
    if (progress) {
      progress->files.fetch_add(1, std::memory_order_relaxed);
      progress->bytes.fetch_add(r.bytes, std::memory_order_relaxed);
    }
    return s;
  }
  UniqueFd src = openSourceDir(srcPath, dstDirFd, dstPath, options, identity, &st);

  // The tree is built under a private temp name (0700 until its own metadata is applied, last).
  std::string tmp = ".vmspace-tmp-" + randomHex(8);
  if (mkdirat(dstDirFd, tmp.c_str(), 0700) != 0) throwErrno(errno, "mkdir", dstPath);
  std::string parentPath, leaf;
  splitPath(dstPath, &parentPath, &leaf);
  std::string tmpPath = parentPath + "/" + tmp;
  try {
    UniqueFd root(openat(dstDirFd, tmp.c_str(), kDirFlags));
    if (!root) throwErrno(errno, "open", dstPath);
    TreeCloner cloner(options, progress, src.get(), root.get(), srcPath, dstPath);
    cloner.cloneContents();
    cloner.copyDirMeta(src.get(), root.get(), st, "");
    if (options.durable && fsync(root.get()) != 0) throwErrno(errno, "fsync", dstPath);
    if (renameat2(dstDirFd, tmp.c_str(), dstDirFd, dstName.c_str(), RENAME_NOREPLACE) != 0) {
      int err = errno;
      // A directory has no link(2) to publish it without replacing, and rename(2) replaces an empty one.
      if (noReplaceUnsupported(err))
        throwCode("ERR_RENAME_NOREPLACE_UNSUPPORTED",
                  "the file system cannot rename without replacing (renameat2 RENAME_NOREPLACE), which publishing a "
                  "directory needs",
                  err, "renameat2", srcPath, dstPath);
      if (err != EEXIST || !options.overwrite) throwErrno(err, "renameat2", srcPath, dstPath);
      // Replace an existing destination atomically: swap it with the new tree, then remove the old one
      // (now under the temp name).
      if (renameat2(dstDirFd, tmp.c_str(), dstDirFd, dstName.c_str(), RENAME_EXCHANGE) != 0)
        throwErrno(errno, "renameat2", srcPath, dstPath);
      removeTreeNoFollow(dstDirFd, tmp, tmpPath);
    }
    if (options.durable && fsync(dstDirFd) != 0) throwErrno(errno, "fsync", dstPath);
    cloner.summary.tree = true;
    return cloner.summary;
  } catch (...) {
    try {
      removeTreeNoFollow(dstDirFd, tmp, tmpPath);
    } catch (const Error&) {
      // The original error is the one to report; what is left carries a .vmspace-tmp- name.
    }
    throw;
  }
}

CloneSummary clonePath(const std::string& srcPath, const std::string& dstPath, const CloneOptions& options,
                       CloneProgress* progress) {
  std::string parent, leaf;
  splitPath(dstPath, &parent, &leaf);
  UniqueFd dir(open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY));
  if (!dir) throwErrno(errno, "open", dstPath);
  return clonePathAt(srcPath, dir.get(), leaf, dstPath, options, progress);
}

CloneSummary clonePathBeneath(const std::string& srcPath, int baseFd, const std::string& basePath,
                              const std::string& rel, const CloneOptions& options, CloneProgress* progress) {
  std::string leaf;
  UniqueFd dir(openParentBeneath(baseFd, rel, &leaf, basePath, false));
  return clonePathAt(srcPath, dir.get(), leaf, basePath + "/" + rel, options, progress);
}

}  // namespace vmspace

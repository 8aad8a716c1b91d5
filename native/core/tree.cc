// Tree clones (tree.h): the walk each thread makes over its stack of directories, the metadata copied onto each
// clone (MetaCopier), hard links kept as links, and the entry points. The threads that share a walk, and the queue
// of directories between them, are walk_threads.h's.
#include "tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "error.h"
#include "fd.h"
#include "io.h"
#include "names.h"
#include "process.h"
#include "remove.h"
#include "rename.h"
#include "statx.h"
#include "walk.h"
#include "walk_threads.h"

namespace vmspace {
namespace {

// The errno of opening (or reading a link at) a source entry the walk stat'ed as something else, or that went
// after that stat: removed (ENOENT), now a file where a directory was (ENOTDIR), a symlink opened O_NOFOLLOW
// (ELOOP), another inode (ESTALE, openRegularAtNoFollow). All are ERR_SOURCE_CHANGED, never a bare errno.
bool goneSinceStat(int err) { return err == ENOENT || err == ENOTDIR || err == ELOOP || err == ESTALE; }

// An entry's name below the roots of a walk, linked to its directory's. No path is kept per level (a chain
// 100,000 deep would cost the square of its depth in memory and outgrow PATH_MAX): one is built from the chain
// only where it is reported (an error) or needed (a hard link to an earlier entry).
struct Name {
  std::shared_ptr<Name> parent;  // null for an entry of the roots
  std::string name;
  Name(std::shared_ptr<Name> p, const char* n) : parent(std::move(p)), name(n) {}
  Name(const Name&) = delete;
  Name& operator=(const Name&) = delete;
  // Iterative: dropping the last reference to a chain 100,000 deep must not recurse once per level.
  ~Name() {
    std::shared_ptr<Name> p = std::move(parent);
    while (p && p.use_count() == 1) p = std::move(p->parent);
  }
};
using NameRef = std::shared_ptr<Name>;

// What an error or a hard link names: the entry `leaf` of the directory `dir` (null: the roots), or with a null
// `leaf` the directory itself.
struct Rel {
  const Name* dir = nullptr;
  const char* leaf = nullptr;
};

// `rel` as a path below `root` ("" for a path relative to the roots).
std::string joinPath(const std::string& root, const Rel& rel) {
  std::vector<const Name*> chain;
  for (const Name* n = rel.dir; n; n = n->parent.get()) chain.push_back(n);
  std::string p = root;
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    if (!p.empty()) p += '/';
    p += (*it)->name;
  }
  if (rel.leaf) {
    if (!p.empty()) p += '/';
    p += rel.leaf;
  }
  return p;
}

// What new entries in a destination directory are owned by (see TreeCloner::subdirectory).
struct Owner {
  uid_t uid;
  gid_t gid;
};

// A source directory's mode and times, set on its clone once everything in it is written.
struct DirMeta {
  mode_t mode;
  struct timespec atime, mtime;
};

DirMeta metaOf(const struct stat& st) { return DirMeta{st.st_mode, st.st_atim, st.st_mtim}; }

// A directory of the walk: what finishing it and climbing back into it need.
struct Dir {
  NameRef name;  // null for the roots
  InodeKey srcId, dstId;
  DirMeta meta;
  Owner created;
  bool applyMeta;
};

// A directory handed to whichever thread is free, with its fds (the queue is bounded, and so are they).
struct Task {
  UniqueFd src, dst;
  Dir dir;
};

// The metadata of one entry copied onto its clone: owner, xattrs, mode and times, as far as permitted. Errors name
// the entry by its path below the source and destination roots.
class MetaCopier {
 public:
  MetaCopier(std::string srcRoot, std::string dstRoot, bool keepSetId)
      : srcRoot_(std::move(srcRoot)), dstRoot_(std::move(dstRoot)), keepSetId_(keepSetId) {}

  std::string srcPath(const Rel& rel) const { return joinPath(srcRoot_, rel); }
  std::string dstPath(const Rel& rel) const { return joinPath(dstRoot_, rel); }

  // Owner then xattrs: chown(2) clears setuid/setgid and security.capability, so the xattrs (and the mode,
  // which the caller sets after this) come after it. Returns true when the owner was changed (the mode must
  // then be set again). Where the owner (group) could not be kept, *dropSetId (when given) receives the set-user-ID
  // (set-group-ID) bit to leave out of the mode, and security.capability is not copied: privileges of the
  // source's owner are never handed to another (as cp(1) does).
  bool copyOwnerXattrs(int sfd, int dfd, const struct stat& st, const Rel& rel, Owner now,
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
    if (dropSetId && !keepSetId_) *dropSetId |= S_ISUID | S_ISGID;  // a directory's setgid is no privilege
    copyXattrs(sfd, dfd, rel, keepSetId_ && (kept || st.st_uid == now.uid));
    return chowned;
  }

  // Owner, xattrs, mode and times of the regular file `dfd`, the clone of `sfd` (stat `st`); `modeSet`: it was
  // created with its final permission bits (the mode is then set only where a chown cleared set-id bits).
  void fileMeta(int sfd, int dfd, const struct stat& st, const Rel& rel, Owner created, bool modeSet) {
    mode_t dropSetId = 0;
    bool chowned = copyOwnerXattrs(sfd, dfd, st, rel, created, &dropSetId);
    bool chmod = !modeSet || chowned;
    if (chmod && fchmod(dfd, st.st_mode & 07777 & ~dropSetId) != 0) throwErrno(errno, "chmod", dstPath(rel));
    struct timespec times[2] = {st.st_atim, st.st_mtim};
    if (futimens(dfd, times) != 0) throwErrno(errno, "utimensat", dstPath(rel));
  }

  void setModeTimes(int dfd, const DirMeta& st, const Rel& rel) {
    if (fchmod(dfd, st.mode & 07777) != 0) throwErrno(errno, "chmod", dstPath(rel));
    struct timespec times[2] = {st.atime, st.mtime};
    if (futimens(dfd, times) != 0) throwErrno(errno, "utimensat", dstPath(rel));
  }

  // Metadata of an entry that cannot be opened for it (symlink, fifo, device): by name, never following.
  void nodeMeta(int ddir, const char* name, const struct stat& st, const Rel& rel, Owner created, bool symlink) {
    mode_t mode = st.st_mode & 07777;
    if ((st.st_uid != created.uid || st.st_gid != created.gid) &&
        fchownat(ddir, name, st.st_uid, st.st_gid, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno != EPERM) throwErrno(errno, "chown", dstPath(rel));
      if (st.st_uid != created.uid) mode &= ~S_ISUID;  // set-id only where the owner is kept (copyOwnerXattrs)
      if (st.st_gid != created.gid) mode &= ~S_ISGID;
    }
    if (!keepSetId_) mode &= ~(S_ISUID | S_ISGID);
    if (!symlink && fchmodat(ddir, name, mode, 0) != 0) throwErrno(errno, "chmod", dstPath(rel));
    struct timespec times[2] = {st.st_atim, st.st_mtim};
    if (utimensat(ddir, name, times, AT_SYMLINK_NOFOLLOW) != 0) throwErrno(errno, "utimensat", dstPath(rel));
  }

 private:
  // `capability`: whether security.capability is copied (only where the owner is kept).
  void copyXattrs(int sfd, int dfd, const Rel& rel, bool capability) {
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

  std::string srcRoot_, dstRoot_;
  bool keepSetId_;  // CloneOptions::keepSetId
};

// The walk: depth first, each thread over walk.h's frames (a source directory, its destination the pair) with its
// share of the fd budget, and beside each frame what finishing its directory needs (Dir). So memory is
// proportional to depth (a name and a few numbers per level), fds are bounded and time is linear in entries, at any
// depth, and a climb back into a closed directory is checked on both sides (walk.h). The threads and the queue of
// directories between them are WalkThreads'; the metadata of each entry is MetaCopier's.
// A directory's mode and times are set when its own entries are done: what is written below it later (by
// another thread, through fds it already holds) changes neither its mtime nor needs a permission of it.
class TreeCloner {
 public:
  TreeCloner(const CloneOptions& opts, CloneProgress* progress, int srcRootFd, int dstRootFd, std::string srcRoot,
             std::string dstRoot)
      : opts_(opts), progress_(progress), srcRootFd_(srcRootFd), dstRootFd_(dstRootFd),
        meta_(std::move(srcRoot), std::move(dstRoot), opts.keepSetId), euid_(geteuid()), egid_(getegid()),
        umask_(currentUmask()), threads_([this](Task& t, CloneSummary& local) { walk(t, local); }) {
    if (!opts.skipFiles) return;
    for (const std::string& p : *opts.skipFiles) {
      skipPaths_.insert(p);
      skipLeaves_.insert(p.substr(p.rfind('/') + 1));
    }
  }

  // Fills the (empty) destination root with the contents of the source root. Throws the first error.
  void cloneContents() {
    auto root = std::make_unique<Task>();
    struct stat s, d;
    if (fstat(srcRootFd_, &s) != 0) throwErrno(errno, "fstat", srcPath(Rel{}));
    if (fstat(dstRootFd_, &d) != 0) throwErrno(errno, "fstat", dstPath(Rel{}));
    skip_ = {d.st_dev, d.st_ino};  // never walk into the tree being built
    struct statx sx;
    if (statxFd(srcRootFd_, kStatxMntId, &sx) != 0) throwErrno(errno, "statx", srcPath(Rel{}));
    srcMount_ = mountOf(srcRootFd_, sx);
    root->src.reset(fcntl(srcRootFd_, F_DUPFD_CLOEXEC, 0));
    if (!root->src) throwErrno(errno, "fcntl", srcPath(Rel{}));
    root->dst.reset(fcntl(dstRootFd_, F_DUPFD_CLOEXEC, 0));
    if (!root->dst) throwErrno(errno, "fcntl", dstPath(Rel{}));
    root->dir = Dir{nullptr, {s.st_dev, s.st_ino}, {d.st_dev, d.st_ino}, metaOf(s), createdIn(d), false};
    threads_.run(std::move(root), summary);
  }

  // Applies a source directory's metadata to a destination directory (the root of a tree clone).
  void copyDirMeta(int srcFd, int dstFd, const struct stat& st) {
    struct stat now;
    if (fstat(dstFd, &now) != 0) throwErrno(errno, "fstat", dstPath(Rel{}));
    meta_.copyOwnerXattrs(srcFd, dstFd, st, Rel{}, {now.st_uid, now.st_gid});
    meta_.setModeTimes(dstFd, metaOf(st), Rel{});
  }

  CloneSummary summary;  // complete after cloneContents returns

 private:
  // Each thread's walk shares the fd budget with the others' (walk.h).
  static constexpr size_t kFramesPerThread = TreeWalk::kMaxOpenFrames / WalkThreads<Task>::kMaxThreads;

  // One thread's walk of a task, its root first: walk.h's frames, and dirs[i] beside frame i.
  struct Stack {
    TreeWalk walk;
    std::vector<Dir> dirs;
    explicit Stack(std::function<void()> fdsShort)
        : walk(std::string(), TreeWalk::Resume::AtPosition, kFramesPerThread, std::move(fdsShort)) {}
  };

  std::string srcPath(const Rel& rel) const { return meta_.srcPath(rel); }
  std::string dstPath(const Rel& rel) const { return meta_.dstPath(rel); }
  static Rel self(const Dir& d) { return Rel{d.name.get(), nullptr}; }
  static Rel self(const Stack& stack) { return self(stack.dirs.back()); }

  // New entries are owned by our uid, and our gid or the directory's where it is setgid (mkdir(2)/open(2)
  // inherit the group of a setgid directory).
  Owner createdIn(const struct stat& dst) const { return Owner{euid_, (dst.st_mode & S_ISGID) ? dst.st_gid : egid_}; }

  void walk(Task& task, CloneSummary& local) {
    Stack stack([this] { threads_.fdsShort(); });
    enter(stack, std::move(task.src), std::move(task.dst), std::move(task.dir));
    while (!stack.walk.empty()) {
      struct dirent* de;
      if (int err = stack.walk.next(&de)) throwErrno(err, "readdir", srcPath(self(stack)));
      if (!de) {
        finish(stack);
        continue;
      }
      if (threads_.stopping() || (progress_ && progress_->cancel.load(std::memory_order_relaxed)))
        throwErrno(ECANCELED, "clone", srcPath(self(stack)), dstPath(self(stack)));
      entry(stack, de->d_name, local);
    }
  }

  // Enters a directory (its fds taken over): the walk's new top frame. Its name is the Dir's (Name, whose chain
  // names entries across threads), not the frame's, which names walk.h's errors only.
  void enter(Stack& stack, UniqueFd src, UniqueFd dst, Dir dir) {
    stack.dirs.push_back(std::move(dir));
    const Dir& d = stack.dirs.back();
    if (int err = stack.walk.push(src.release(), "", d.srcId.dev, d.srcId.ino,
                                  TreeWalk::Pair{dst.release(), d.dstId.dev, d.dstId.ino}))
      throwErrno(err, "opendir", srcPath(self(d)));
  }

  // The top directory's entries are done: reopen its parent if it was closed (while this one still has the
  // permissions that ".." needs), set its mode and times, and leave it.
  void finish(Stack& stack) {
    const char* syscall = "openat";
    bool pairSide = false;
    if (int err = stack.walk.climb(&syscall, &pairSide)) climbFailed(stack, err, syscall, pairSide);
    const Dir& top = stack.dirs.back();
    if (top.applyMeta) meta_.setModeTimes(stack.walk.pairFd(), top.meta, self(top));
    TreeWalk::Left left;
    if (int err = stack.walk.pop(&left, &syscall)) climbFailed(stack, err, syscall, false);
    stack.dirs.pop_back();
  }

  // The climb from the top directory to its parent failed (walk.h: ESTALE where another directory is there now),
  // on the source side or (pairSide) on the destination's: named by that side's path of the parent.
  [[noreturn]] void climbFailed(const Stack& stack, int err, const char* syscall, bool pairSide) const {
    Rel parent = self(stack.dirs[stack.dirs.size() - 2]);
    if (pairSide) throwErrno(err, "open", dstPath(parent));
    throwErrno(err, strcmp(syscall, "fdopendir") == 0 ? "opendir" : "open", srcPath(parent));
  }

  // openat(2) that, under a low RLIMIT_NOFILE (EMFILE, ENFILE), closes the shallowest open frame of the thread's
  // walk but the top one and tries again (walk.h's withFds; the thread pool's queue shrinks first).
  int openIn(Stack& stack, int dirFd, const char* name, int flags, mode_t mode = 0) {
    return stack.walk.withFds([&] { return openat(dirFd, name, flags, mode); });
  }

  void entry(Stack& stack, const char* name, CloneSummary& local) {
    int sdir = stack.walk.topFd(), ddir = stack.walk.pairFd();
    const Dir& top = stack.dirs.back();
    Owner created = top.created;
    Rel rel{top.name.get(), name};
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
        subdirectory(stack, name);
        return;
      }
      case S_IFREG:
        // A path is built only for a name that ends a skipped one.
        if (!skipLeaves_.empty() && skipLeaves_.count(name) && skipPaths_.count(joinPath(std::string(), rel))) return;
        regular(stack, sdir, ddir, name, top.name, rel, st, created, local);
        return;
      default:
        node(sdir, ddir, name, rel, st, created, local);
        return;
    }
  }

  // An entry that is neither a directory nor a regular file: a symlink, fifo or device made anew (a device only
  // where mknod is permitted and keepDevices), a socket skipped; each counted.
  void node(int sdir, int ddir, const char* name, const Rel& rel, const struct stat& st, Owner created,
            CloneSummary& local) {
    switch (st.st_mode & S_IFMT) {
      case S_IFLNK: {
        // The target's bytes verbatim: dangling, absolute or pointing outside, it is never resolved.
        char target[PATH_MAX + 1];
        ssize_t n = readlinkat(sdir, name, target, PATH_MAX);
        // EINVAL: no longer a symlink.
        if (n < 0 && (goneSinceStat(errno) || errno == EINVAL)) throwSourceChanged(srcPath(rel), dstPath(rel));
        if (n < 0) throwErrno(errno, "readlink", srcPath(rel), dstPath(rel));
        target[n] = 0;
        if (symlinkat(target, ddir, name) != 0) throwErrno(errno, "symlink", srcPath(rel), dstPath(rel));
        meta_.nodeMeta(ddir, name, st, rel, created, true);
        local.symlinks++;
        return;
      }
      case S_IFIFO:
        if (mknodat(ddir, name, S_IFIFO | 0600, 0) != 0) throwErrno(errno, "mknod", srcPath(rel), dstPath(rel));
        meta_.nodeMeta(ddir, name, st, rel, created, false);
        local.fifos++;
        return;
      case S_IFCHR:
      case S_IFBLK:
        if (!opts_.keepDevices) {  // a guest's device node (its host's disk, say) is never handed on
          local.skippedDevices++;
          return;
        }
        if (mknodat(ddir, name, (st.st_mode & S_IFMT) | 0600, st.st_rdev) != 0) {
          if (errno == EPERM) {  // mknod(2) of a device needs CAP_MKNOD: skipped and counted
            local.skippedDevices++;
            return;
          }
          throwErrno(errno, "mknod", srcPath(rel), dstPath(rel));
        }
        meta_.nodeMeta(ddir, name, st, rel, created, false);
        local.devices++;
        return;
      case S_IFSOCK:
        local.skippedSockets++;
        return;
      default:
        return;
    }
  }

  // The directory `name` of `top`, just made in the destination: opened on both sides, its owner and xattrs
  // set (mode and times come in finish()), then handed to another thread or entered.
  void subdirectory(Stack& stack, const char* name) {
    auto task = std::make_unique<Task>();
    NameRef node = std::make_shared<Name>(stack.dirs.back().name, name);
    Rel rel{node.get(), nullptr};
    task->src.reset(openIn(stack, stack.walk.topFd(), name, kDirFlags));
    if (!task->src && goneSinceStat(errno)) throwSourceChanged(srcPath(rel), dstPath(rel));
    if (!task->src) throwErrno(errno, "open", srcPath(rel), dstPath(rel));
    task->dst.reset(openIn(stack, stack.walk.pairFd(), name, kDirFlags));
    if (!task->dst) throwErrno(errno, "open", srcPath(rel), dstPath(rel));
    // The metadata of the directory opened (not of the name as fstatat saw it: it may have been replaced).
    struct stat st, dst;
    if (fstat(task->src.get(), &st) != 0) throwErrno(errno, "fstat", srcPath(rel));
    if (st.st_dev == skip_.dev && st.st_ino == skip_.ino) return;
    if (fstat(task->dst.get(), &dst) != 0) throwErrno(errno, "fstat", dstPath(rel));
    if (meta_.copyOwnerXattrs(task->src.get(), task->dst.get(), st, rel, {dst.st_uid, dst.st_gid}) &&
        fstat(task->dst.get(), &dst) != 0)
      throwErrno(errno, "fstat", dstPath(rel));
    if (onOtherMount(task->src.get(), rel)) {
      // A mount point (another file system, or a bind mount): an empty directory with the metadata seen at it, as
      // cp -x and rsync -x make it. What is mounted there is not the source's to copy (removal and usage stop
      // there too).
      meta_.setModeTimes(task->dst.get(), metaOf(st), rel);
      return;
    }
    task->dir =
        Dir{std::move(node), {st.st_dev, st.st_ino}, {dst.st_dev, dst.st_ino}, metaOf(st), createdIn(dst), true};
    if (threads_.handOff(task)) return;
    enter(stack, std::move(task->src), std::move(task->dst), std::move(task->dir));
  }

  // Whether the directory `fd` is on another mount than the source root (statx.h's mountOf, as removal compares).
  bool onOtherMount(int fd, const Rel& rel) const {
    struct statx sx;
    if (statxFd(fd, kStatxMntId, &sx) != 0) throwErrno(errno, "statx", srcPath(rel));
    return mountOf(fd, sx) != srcMount_;
  }

  // Links `name` in `ddir` to the clone `target` made earlier (paths relative to the destination root).
  void linkTo(const Name& target, int ddir, const char* name, const Rel& rel) {
    std::string path = joinPath(std::string(), Rel{&target, nullptr});
    if (linkat(dstRootFd_, path.c_str(), ddir, name, 0) == 0) return;
    if (errno != ENAMETOOLONG) throwErrno(errno, "link", srcPath(rel), dstPath(rel));
    // Deeper than PATH_MAX: open the target's directory one component at a time.
    std::vector<const Name*> chain;
    for (const Name* n = target.parent.get(); n; n = n->parent.get()) chain.push_back(n);
    UniqueFd dir(fcntl(dstRootFd_, F_DUPFD_CLOEXEC, 0));
    for (auto it = chain.rbegin(); dir && it != chain.rend(); ++it)
      dir.reset(openat(dir.get(), (*it)->name.c_str(), kDirFlags));
    if (!dir || linkat(dir.get(), target.name.c_str(), ddir, name, 0) != 0)
      throwErrno(errno, "link", srcPath(rel), dstPath(rel));
  }

  // The source file `name` of `sdir`, opened for its data. O_NOATIME keeps the walk from dirtying every source
  // inode; allowed for the owner and CAP_FOWNER only. O_NONBLOCK: should the entry have become a fifo since
  // fstatat, open must not wait for a writer (the clone of it then fails: FICLONE and lseek refuse a fifo).
  // The regular file `name` of `sdir`, opened only while it is the one `st` saw (openRegularAtNoFollow): a guest
  // swapping in a device or a FIFO after the stat gets no open of it, and the clone ERR_SOURCE_CHANGED.
  UniqueFd openSourceFile(Stack& stack, int sdir, const char* name, const struct stat& st, const Rel& rel) {
    int flags = O_RDONLY | O_NONBLOCK;
    if (euid_ == 0 || st.st_uid == euid_) flags |= O_NOATIME;
    auto open = [&](int f) {
      return stack.walk.withFds([&] { return openRegularAtNoFollow(sdir, name, f, st.st_dev, st.st_ino); });
    };
    UniqueFd src(open(flags));
    if (!src && errno == EPERM && (flags & O_NOATIME)) src.reset(open(flags & ~O_NOATIME));
    if (!src && goneSinceStat(errno)) throwSourceChanged(srcPath(rel), dstPath(rel));
    if (!src) throwErrno(errno, "open", srcPath(rel), dstPath(rel));
    return src;
  }

  // The data of the regular file `src` into the new empty `dst` (cloneData), checked to be of the version the walk
  // saw at its name (`st`, from fstatat): an entry replaced after that stat (another inode), or written while it was
  // cloned, is ERR_SOURCE_CHANGED (checkSourceUnchanged).
  CloneFileResult fileData(int src, int dst, const struct stat& st, const Rel& rel) {
    try {
      // The paths are set by the catch below, so none are built per file here.
      CloneFileResult r = cloneData(src, dst, st, opts_.reflink, std::string(), std::string(), progress_);
      checkSourceUnchanged(src, st, std::string(), std::string());
      return r;
    } catch (Error& e) {
      // Name the entry the way every other failure of the walk does: the source entry and its destination.
      e.path = srcPath(rel);
      e.dest = dstPath(rel);
      throw;
    }
  }

  void regular(Stack& stack, int sdir, int ddir, const char* name, const NameRef& dir, const Rel& rel,
               const struct stat& st, Owner created, CloneSummary& local) {
    std::unique_lock<std::mutex> linkLock(linkMu_, std::defer_lock);
    if (st.st_nlink > 1) {
      // Hard-linked files are cloned once, under a lock so that two threads never both clone one inode.
      linkLock.lock();
      auto it = links_.find({st.st_dev, st.st_ino});
      if (it != links_.end()) {
        linkTo(*it->second, ddir, name, rel);
        local.hardlinks++;
        return;
      }
    }
    UniqueFd src = openSourceFile(stack, sdir, name, st, rel);
    // Created with its final permission bits where the umask keeps them, saving an fchmod per file; the
    // tree is private until published (its root is 0700).
    mode_t perm = st.st_mode & 0777;
    bool exact = (perm & umask_) == 0 && (st.st_mode & 07000) == 0;
    UniqueFd dst(openIn(stack, ddir, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, exact ? perm : 0600));
    if (!dst) throwErrno(errno, "open", srcPath(rel), dstPath(rel));
    CloneFileResult data = fileData(src.get(), dst.get(), st, rel);
    meta_.fileMeta(src.get(), dst.get(), st, rel, created, exact);
    if (data.method == CloneMethod::Copy) writeBack(dst.get(), opts_.writeback, dstPath(rel));
    if (opts_.durable && fsync(dst.get()) != 0) throwErrno(errno, "fsync", dstPath(rel));
    if (st.st_nlink > 1) links_.emplace(InodeKey{st.st_dev, st.st_ino}, std::make_shared<Name>(dir, name));
    (data.method == CloneMethod::Reflink ? local.reflinked : local.copied)++;
    local.files++;
    local.bytes += data.bytes;
    if (progress_) progress_->files.fetch_add(1, std::memory_order_relaxed);  // its bytes came with its data
  }

  const CloneOptions& opts_;
  CloneProgress* progress_;
  int srcRootFd_, dstRootFd_;
  MetaCopier meta_;
  uid_t euid_;
  gid_t egid_;
  mode_t umask_;
  InodeKey skip_{0, 0};
  std::unordered_set<std::string> skipPaths_, skipLeaves_;  // CloneOptions::skipFiles, and their last components
  uint64_t srcMount_ = 0;  // the mount of the source root: the walk never enters another

  std::mutex linkMu_;
  std::unordered_map<InodeKey, NameRef, InodeHash> links_;  // source inode -> its clone's name below dstRoot
  WalkThreads<Task> threads_;  // last: its threads are joined before any member they use goes
};

}  // namespace

void checkSameFs(const struct stat& src, int dstDirFd, const CloneOptions& opts, const std::string& srcPath,
                 const std::string& dstPath) {
  if (opts.reflink != Reflink::Always) return;
  struct stat d;
  if (fstat(dstDirFd, &d) != 0) throwErrno(errno, "fstat", dstPath);
  if (d.st_dev != src.st_dev)
    throwCode("ERR_REFLINK_UNSUPPORTED", "source and destination are on different file systems (reflink: 'always')",
              EXDEV, "clone", srcPath, dstPath);
}

UniqueFd openSourceDir(const std::string& srcPath, int dstDirFd, const std::string& dstPath,
                       const CloneOptions& options, SourceIdentity* identity, struct stat* st) {
  UniqueFd src(open(srcPath.c_str(), kDirPathFlags));
  if (!src) throwErrno(errno, "open", srcPath, dstPath);
  if (fstat(src.get(), st) != 0) throwErrno(errno, "fstat", srcPath);
  fillIdentity(identity, *st);
  checkSameFs(*st, dstDirFd, options, srcPath, dstPath);
  return src;
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

CloneSummary cloneTreeAs(int srcFd, const struct stat& st, int dstFd, const std::string& srcPath,
                         const std::string& dstPath, const CloneOptions& options, CloneProgress* progress) {
  TreeCloner cloner(options, progress, srcFd, dstFd, srcPath, dstPath);
  cloner.cloneContents();
  cloner.copyDirMeta(srcFd, dstFd, st);
  cloner.summary.tree = true;
  return cloner.summary;
}

}  // namespace vmspace

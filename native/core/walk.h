// The depth-first walk of a directory tree over directory fds that removal (remove.cc), usage (usage.cc), a
// template's mode list (template_modes.cc), the layer applier's opaque directories (layer_apply.cc) and the tree
// clone (tree.cc) make: its stack of frames, the one fd budget they all keep, and the climb back to a parent. What
// each does with an entry, and on the way into and out of a directory, is the caller's: it reads the top
// directory's entries (next), opens and pushes the subdirectories it enters (openDir, push), and pops a directory
// when it is done with it (pop). A frame may carry a paired directory (the clone's destination beside its source):
// closed, reopened and checked with it.
//
// The fd budget: a walk keeps at most kMaxOpenFrames frames open, the deepest ones; walks that run at once on the
// threads of one operation (a tree clone's) are each given an equal share of it (maxOpen), so that together they
// keep no more frames open than one walk. Pushing one more closes the shallowest open frame (remembering where its
// readdir was), and opening anything under EMFILE or ENFILE closes the shallowest open frame but the top one and
// tries again (withFds), so whatever the depth and whatever else the process holds, a walk needs only the top
// directory and what it opens in it: two fds (four with pairs; three where usage opens a file through an O_PATH
// descriptor first). A closed frame is reopened only on the climb, through its child's ".." (its pair through the
// child's pair's), and accepted only when it is still the directory the walk came down from (device and inode, the
// pair's too): a tree that a guest renames meanwhile cannot redirect the walk (ESTALE instead). Its readdir then
// resumes at the position it had (seekdir to the telldir cookie: the d_off getdents(2) reports, stable across opens
// on the file systems NFS can export), or restarts (a removal, which took its entries away).
// Memory is a name and a few numbers per level: a path is built from the names only to report an error.
#pragma once

#include <dirent.h>
#include <sys/types.h>

#include <cerrno>
#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace vmspace {

class TreeWalk {
 public:
  static constexpr size_t kMaxOpenFrames = 64;

  // How a reopened directory's readdir goes on: where it was, or from its start.
  enum class Resume { AtPosition, FromStart };

  // The directory paired with a frame's (-1: none), and its device and inode, which its reopening must find.
  struct Pair {
    int fd = -1;
    dev_t dev = 0;
    ino_t ino = 0;
  };

  // `rootPath` names the root in errors (path()). `maxOpen` (at least 1): the frames this walk keeps open, its share
  // of the budget. `fdsShort`, when given, is called each time an open fails with EMFILE or ENFILE, before a frame is
  // closed for it (a clone's threads then queue fewer directories).
  TreeWalk(std::string rootPath, Resume resume, size_t maxOpen = kMaxOpenFrames, std::function<void()> fdsShort = {})
      : rootPath_(std::move(rootPath)), resume_(resume), maxOpen_(maxOpen), fdsShort_(std::move(fdsShort)) {}
  TreeWalk(const TreeWalk&) = delete;
  TreeWalk& operator=(const TreeWalk&) = delete;
  ~TreeWalk() { abandon(); }

  // Opens `name` in the directory `dfd` as a directory to walk (kDirFlags: never through a symlink): an fd, or -1
  // and errno. Under EMFILE or ENFILE it closes the walk's shallowest open directory but the top one and tries
  // again (the budget above).
  int openDir(int dfd, const char* name);

  // Runs `open` (an fd, or -1 with errno) again while it fails with EMFILE or ENFILE and one of the walk's
  // frames but the top one can be closed: any open a caller makes in the top directory keeps to the budget.
  template <typename Open>
  int withFds(Open open) {
    for (;;) {
      int fd = open();
      if (fd >= 0 || (errno != EMFILE && errno != ENFILE)) return fd;
      int err = errno;
      if (fdsShort_) fdsShort_();
      if (!closeShallowest()) {
        errno = err;
        return -1;
      }
    }
  }

  // Pushes the directory `fd` (taken over: closed on failure too), named `name` in the top directory ("" for the
  // root), of device `dev` and inode `ino`, with its `pair` (its fd taken over alike); closes the shallowest open
  // frame when more than maxOpen would be open. 0, or the errno of fdopendir.
  int push(int fd, const char* name, dev_t dev, ino_t ino, Pair pair);
  int push(int fd, const char* name, dev_t dev, ino_t ino) { return push(fd, name, dev, ino, Pair{}); }

  // The next entry of the top directory but "." and "..": 0 with *entry set, 0 with *entry null when there is
  // none left, or readdir's errno.
  int next(struct dirent** entry);

  // Reopens the top directory's parent (and its pair) when it was closed, through the top's ".." (the pair's
  // through the top pair's), and checks it is the directory the walk came from (ESTALE when another is there now).
  // pop climbs itself; a caller that changes the top last in a way that could take away the search permission ".."
  // needs (a clone setting a directory's mode) climbs first. 0, or the errno (*syscall: which call; *pairSide, when
  // given: whether it was the pair's); then the parent stays closed and the walk cannot go on.
  int climb(const char** syscall, bool* pairSide = nullptr);

  // Leaves the top directory, climbing to its parent first (climb). The popped frame's name, device and inode are
  // in `left` until the next pop. 0, or the errno (*syscall: which call) of the climb; then the parent stays closed
  // and the walk cannot go on (abandon, or let the walk go).
  struct Left {
    std::string name;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  int pop(Left* left, const char** syscall);

  // Closes every open directory and empties the stack.
  void abandon();

  bool empty() const { return stack_.empty(); }
  // The depth of the top directory (0: the root).
  size_t depth() const { return stack_.size() - 1; }
  // The fd of the top directory, and of its pair (-1: none).
  int topFd() const { return dirfd(stack_.back().dir); }
  int pairFd() const { return stack_.back().pair.fd; }
  // The path of the directory at `depth` (the root's path at 0), with `leaf` appended when given.
  std::string path(size_t depth, const char* leaf = nullptr) const;

 private:
  struct Frame {
    DIR* dir;          // null while closed (above the maxOpen deepest), and then pair.fd is -1 too
    long pos;          // telldir() when it was closed: where its readdir resumes (Resume::AtPosition)
    std::string name;  // its name in the frame below (empty for the root)
    dev_t dev;
    ino_t ino;
    Pair pair;
  };

  static void close(Frame& f);
  bool closeShallowest();
  int openParent(int childFd, dev_t dev, ino_t ino);
  int reopen(Frame& parent, const Frame& child, const char** syscall, bool* pairSide);

  std::string rootPath_;
  Resume resume_;
  size_t maxOpen_;
  std::function<void()> fdsShort_;
  std::vector<Frame> stack_;
};

}  // namespace vmspace

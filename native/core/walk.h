// The depth-first walk of a directory tree over directory fds that removal (remove.cc), usage (usage.cc) and a
// template's mode list (template_modes.cc) make: its stack of frames, the one fd budget they all keep, and the
// climb back to a parent. What each does with an entry, and on the way into and out of a directory, is the
// caller's: it reads the top directory's entries (next), opens and pushes the subdirectories it enters
// (openDir, push), and pops a directory when it is done with it (pop).
//
// The fd budget: a walk keeps at most kMaxOpenFrames directories open, the deepest ones; pushing one more closes
// the shallowest of them (remembering where its readdir was), and opening anything under EMFILE or ENFILE closes
// the shallowest open directory but the top one and tries again (withFds), so a walk needs two fds (the top
// directory and what it opens in it; three where it opens a file through an O_PATH descriptor first, as usage
// does) whatever the depth and whatever else the process holds. A closed directory is reopened
// only on the climb, through its child's "..", and accepted only when it is still the directory the walk came
// down from (device and inode): a tree that a guest renames meanwhile cannot redirect the walk (ESTALE instead).
// Its readdir then resumes at the position it had (seekdir to the telldir cookie: the d_off getdents(2) reports,
// stable across opens on the file systems NFS can export), or restarts (a removal, which took its entries away).
// Memory is a name and a few numbers per level: a path is built from the names only to report an error.
#pragma once

#include <dirent.h>
#include <sys/types.h>

#include <cerrno>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace vmspace {

class TreeWalk {
 public:
  static constexpr size_t kMaxOpenFrames = 64;

  // How a reopened directory's readdir goes on: where it was, or from its start.
  enum class Resume { AtPosition, FromStart };

  // `rootPath` names the root in errors (path()).
  TreeWalk(std::string rootPath, Resume resume) : rootPath_(std::move(rootPath)), resume_(resume) {}
  TreeWalk(const TreeWalk&) = delete;
  TreeWalk& operator=(const TreeWalk&) = delete;
  ~TreeWalk() { abandon(); }

  // Opens `name` in the directory `dfd` as a directory to walk (kDirFlags: never through a symlink): an fd, or -1
  // and errno. Under EMFILE or ENFILE it closes the walk's shallowest open directory but the top one and tries
  // again (the budget above).
  int openDir(int dfd, const char* name);

  // Runs `open` (an fd, or -1 with errno) again while it fails with EMFILE or ENFILE and one of the walk's
  // directories but the top one can be closed: any open a caller makes in the top directory keeps to the budget.
  template <typename Open>
  int withFds(Open open) {
    for (;;) {
      int fd = open();
      if (fd >= 0 || (errno != EMFILE && errno != ENFILE)) return fd;
      int err = errno;
      if (!closeShallowest()) {
        errno = err;
        return -1;
      }
    }
  }

  // Pushes the directory `fd` (taken over: closed on failure too), named `name` in the top directory ("" for the
  // root), of device `dev` and inode `ino`; closes the shallowest open directory when more than kMaxOpenFrames
  // would be open. 0, or the errno of fdopendir.
  int push(int fd, const char* name, dev_t dev, ino_t ino);

  // The next entry of the top directory but "." and "..": 0 with *entry set, 0 with *entry null when there is
  // none left, or readdir's errno.
  int next(struct dirent** entry);

  // Leaves the top directory: when its parent was closed, reopens the parent through its ".." and checks it is
  // the directory the walk came from (ESTALE when another is there now). The popped frame's name, device and
  // inode are in `left` until the next pop. 0, or the errno (*syscall: which call) of the climb; then the parent
  // stays closed and the walk cannot go on (abandon, or let the walk go).
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
  // The fd of the top directory.
  int topFd() const { return dirfd(stack_.back().dir); }
  // The path of the directory at `depth` (the root's path at 0), with `leaf` appended when given.
  std::string path(size_t depth, const char* leaf = nullptr) const;

 private:
  struct Frame {
    DIR* dir;          // null while closed (above the kMaxOpenFrames deepest)
    long pos;          // telldir() when it was closed: where its readdir resumes (Resume::AtPosition)
    std::string name;  // its name in the frame below (empty for the root)
    dev_t dev;
    ino_t ino;
  };

  static void close(Frame& f);
  bool closeShallowest();
  int reopen(Frame& parent, int childFd, const char** syscall);

  std::string rootPath_;
  Resume resume_;
  std::vector<Frame> stack_;
};

}  // namespace vmspace

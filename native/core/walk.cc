// The frames, fd budget and climb of a tree walk (walk.h: the policy and why).
#include "walk.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "fd.h"

namespace vmspace {

int TreeWalk::openDir(int dfd, const char* name) {
  return withFds([&] { return openat(dfd, name, kDirFlags); });
}

int TreeWalk::push(int fd, const char* name, dev_t dev, ino_t ino) {
  DIR* d = fdopendir(fd);
  if (!d) {
    int err = errno;
    ::close(fd);
    return err;
  }
  try {
    stack_.push_back(Frame{d, 0, name, dev, ino});
  } catch (...) {
    closedir(d);
    throw;
  }
  if (stack_.size() > kMaxOpenFrames) {
    Frame& old = stack_[stack_.size() - kMaxOpenFrames - 1];
    if (old.dir) close(old);
  }
  return 0;
}

int TreeWalk::next(struct dirent** entry) {
  Frame& top = stack_.back();
  for (;;) {
    errno = 0;
    struct dirent* de = readdir(top.dir);
    if (!de) {
      *entry = nullptr;
      return errno;
    }
    if (isDotOrDotDot(de->d_name)) continue;
    *entry = de;
    return 0;
  }
}

int TreeWalk::pop(Left* left, const char** syscall) {
  Frame done = std::move(stack_.back());
  stack_.pop_back();
  int err = 0;
  // The parent is reopened while the child is still open: its ".." is the way back.
  if (!stack_.empty() && !stack_.back().dir) err = reopen(stack_.back(), dirfd(done.dir), syscall);
  closedir(done.dir);
  left->name = std::move(done.name);
  left->dev = done.dev;
  left->ino = done.ino;
  return err;
}

int TreeWalk::reopen(Frame& parent, int childFd, const char** syscall) {
  *syscall = "openat";
  int fd = openDir(childFd, "..");
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0 || st.st_dev != parent.dev || st.st_ino != parent.ino) {
    int err = fd < 0 ? errno : ESTALE;  // ESTALE: another directory is there now
    if (fd >= 0) ::close(fd);
    return err;
  }
  DIR* d = fdopendir(fd);
  if (!d) {
    int err = errno;
    ::close(fd);
    *syscall = "fdopendir";
    return err;
  }
  if (resume_ == Resume::AtPosition) seekdir(d, parent.pos);
  parent.dir = d;
  return 0;
}

void TreeWalk::abandon() {
  for (Frame& f : stack_)
    if (f.dir) closedir(f.dir);
  stack_.clear();
}

// Only the kMaxOpenFrames + 1 deepest frames can be open (push closes the one above them); the top one stays.
bool TreeWalk::closeShallowest() {
  size_t n = stack_.size();
  for (size_t i = n > kMaxOpenFrames + 1 ? n - kMaxOpenFrames - 1 : 0; i + 1 < n; i++) {
    if (stack_[i].dir) {
      close(stack_[i]);
      return true;
    }
  }
  return false;
}

void TreeWalk::close(Frame& f) {
  f.pos = telldir(f.dir);
  closedir(f.dir);
  f.dir = nullptr;
}

std::string TreeWalk::path(size_t depth, const char* leaf) const {
  std::string p = rootPath_;
  for (size_t i = 1; i <= depth && i < stack_.size(); i++) p += "/" + stack_[i].name;
  if (leaf) p += std::string("/") + leaf;
  return p;
}

}  // namespace vmspace

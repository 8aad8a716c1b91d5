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

int TreeWalk::push(int fd, const char* name, dev_t dev, ino_t ino, Pair pair) {
  DIR* d = fdopendir(fd);
  if (!d) {
    int err = errno;
    ::close(fd);
    if (pair.fd >= 0) ::close(pair.fd);
    return err;
  }
  try {
    stack_.push_back(Frame{d, 0, name, dev, ino, pair});
  } catch (...) {
    closedir(d);
    if (pair.fd >= 0) ::close(pair.fd);
    throw;
  }
  if (stack_.size() > maxOpen_) {
    Frame& old = stack_[stack_.size() - maxOpen_ - 1];
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

int TreeWalk::climb(const char** syscall, bool* pairSide) {
  size_t n = stack_.size();
  if (n < 2 || stack_[n - 2].dir) return 0;
  return reopen(stack_[n - 2], stack_[n - 1], syscall, pairSide);
}

int TreeWalk::pop(Left* left, const char** syscall) {
  // The parent is reopened while the child is still open: its ".." is the way back.
  int err = climb(syscall);
  Frame& done = stack_.back();
  closedir(done.dir);
  if (done.pair.fd >= 0) ::close(done.pair.fd);
  left->name = std::move(done.name);
  left->dev = done.dev;
  left->ino = done.ino;
  stack_.pop_back();
  return err;
}

// The ".." of `childFd` when it is the directory of device `dev` and inode `ino`: an fd, or -1 and errno (ESTALE:
// another directory is there now).
int TreeWalk::openParent(int childFd, dev_t dev, ino_t ino) {
  int fd = openDir(childFd, "..");
  if (fd < 0) return -1;
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_dev != dev || st.st_ino != ino) {
    ::close(fd);
    errno = ESTALE;
    return -1;
  }
  return fd;
}

int TreeWalk::reopen(Frame& parent, const Frame& child, const char** syscall, bool* pairSide) {
  *syscall = "openat";
  if (pairSide) *pairSide = false;
  UniqueFd fd(openParent(dirfd(child.dir), parent.dev, parent.ino));
  if (!fd) return errno;
  UniqueFd pair;
  if (child.pair.fd >= 0) {
    pair.reset(openParent(child.pair.fd, parent.pair.dev, parent.pair.ino));
    if (!pair) {
      if (pairSide) *pairSide = true;
      return errno;
    }
  }
  DIR* d = fdopendir(fd.get());
  if (!d) {
    *syscall = "fdopendir";
    return errno;
  }
  fd.release();
  if (resume_ == Resume::AtPosition) seekdir(d, parent.pos);
  parent.dir = d;
  parent.pair.fd = pair.release();
  return 0;
}

void TreeWalk::abandon() {
  for (Frame& f : stack_) {
    if (f.dir) closedir(f.dir);
    if (f.pair.fd >= 0) ::close(f.pair.fd);
  }
  stack_.clear();
}

// Only the maxOpen_ + 1 deepest frames can be open (push closes the one above them); the top one stays.
bool TreeWalk::closeShallowest() {
  size_t n = stack_.size();
  for (size_t i = n > maxOpen_ + 1 ? n - maxOpen_ - 1 : 0; i + 1 < n; i++) {
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
  if (f.pair.fd >= 0) ::close(f.pair.fd);
  f.pair.fd = -1;
}

std::string TreeWalk::path(size_t depth, const char* leaf) const {
  std::string p = rootPath_;
  for (size_t i = 1; i <= depth && i < stack_.size(); i++) p += "/" + stack_[i].name;
  if (leaf) p += std::string("/") + leaf;
  return p;
}

}  // namespace vmspace

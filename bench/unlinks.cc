// The floor of removing a tree: readdir + unlinkat of every entry and rmdir of every directory, recursive over
// directory fds in one thread, without vmspace's checks (mount, identity, modes, bounded fds). bench/run.mjs
// compares Workspace.dispose and fs.promises.rm against it.
// Usage: unlinks DIR   (removes DIR; prints "<elapsed ms> <cpu ms>")
#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

static void emptyDir(int fd) {
  DIR* d = fdopendir(fd);
  if (!d) abort();
  while (struct dirent* e = readdir(d)) {
    const char* n = e->d_name;
    if (n[0] == '.' && (n[1] == 0 || (n[1] == '.' && n[2] == 0))) continue;
    if (e->d_type == DT_DIR) {
      int sub = openat(dirfd(d), n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub < 0) abort();
      emptyDir(sub);
      if (unlinkat(dirfd(d), n, AT_REMOVEDIR) != 0) abort();
    } else if (unlinkat(dirfd(d), n, 0) != 0) {
      abort();
    }
  }
  closedir(d);
}

static double ms(clockid_t c) {
  timespec t;
  clock_gettime(c, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::string path = argv[1];
  double t0 = ms(CLOCK_MONOTONIC), c0 = ms(CLOCK_PROCESS_CPUTIME_ID);
  int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return 1;
  emptyDir(fd);
  if (rmdir(path.c_str()) != 0) return 1;
  printf("%.3f %.3f\n", ms(CLOCK_MONOTONIC) - t0, ms(CLOCK_PROCESS_CPUTIME_ID) - c0);
  return 0;
}

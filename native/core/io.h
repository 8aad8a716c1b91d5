// Whole-file reads and writes over fds, returning an errno (0 on success) so that callers decide whether a
// failure is an error (throw) or a finding (report per entry).
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace vmspace {

// Reads the regular file `name` below `at` (an absolute path with AT_FDCWD) into `out`. Opened O_NONBLOCK, so a
// fifo in its place never parks the thread in open(2); a directory is EISDIR, any other non-regular file EINVAL,
// more than `limit` bytes EFBIG. st_size is only a hint (files under /proc report 0). `extraFlags` is or-ed into
// the open flags (O_NOFOLLOW). `*syscall` names the step that failed.
int readRegularFileAt(int at, const char* name, int extraFlags, size_t limit, std::string* out,
                      const char** syscall = nullptr);

// write(2) until all of `data` is written (EINTR retried).
int writeAll(int fd, const std::string& data);

// The names and d_type of every entry of the directory `dirFd` (without "." and ".."), read through a fresh open
// of "." so the caller's fd keeps its position. Throws the errno of open/opendir/readdir, naming `shown`.
std::vector<std::pair<std::string, unsigned char>> readNames(int dirFd, const std::string& shown);

}  // namespace vmspace

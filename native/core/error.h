// Errors of the core: an errno with the syscall and paths it concerns, or one of vmspace's own conditions
// (a stable ERR_... code, with the errno that caused it where there is one). No N-API types here.
#pragma once

// Every part of vmspace is Linux system calls (renameat2, FICLONE, statx, openat2, flock on fds).
#if !defined(__linux__)
#error "vmspace is a Linux addon (renameat2, statx, FICLONE, flock on fds): it builds on Linux only; see README, Portability"
#endif

#include <string.h>

#include "compat.h"

#include <cerrno>
#include <exception>
#include <string>
#include <utility>

namespace vmspace {

struct Error : std::exception {
  int err = 0;           // positive errno; 0 for a condition without one
  std::string code;      // empty: the errno's name (EEXIST, ...); else a vmspace code (ERR_...)
  std::string syscall;   // the syscall that failed, as Node names it (mkdirat, renameat2, ioctl(FICLONE), ...)
  std::string path;
  std::string dest;
  std::string detail;    // extra words for the message (vmspace conditions)

  const char* what() const noexcept override { return detail.empty() ? "vmspace error" : detail.c_str(); }
};

// strerror_r(3) is the XSI form (int) on musl and the GNU form (char*) on glibc with _GNU_SOURCE; these two
// overloads take either. The errno's name (EEXIST, ...) is not made here: strerrorname_np is glibc 2.32+ only,
// so lib/errors.ts names errnos from os.constants.errno.
inline const char* strerrorResult(int rc, const char* buf) { return rc == 0 ? buf : nullptr; }
inline const char* strerrorResult(const char* msg, const char*) { return msg; }

// The errno's description ("No such file or directory"), thread-safe (pool threads build errors too).
inline std::string errnoDescription(int err) {
  char buf[128] = "";
  const char* msg = strerrorResult(strerror_r(err, buf, sizeof buf), buf);
  return msg && *msg ? msg : "unknown error";
}

// Throws the errno of a failed syscall with the paths it concerns.
[[noreturn]] inline void throwErrno(int err, const char* syscall, std::string path = {}, std::string dest = {}) {
  Error e;
  e.err = err;
  e.syscall = syscall;
  e.path = std::move(path);
  e.dest = std::move(dest);
  throw e;
}

// Throws one of vmspace's own conditions; `cause` is the errno behind it, or 0.
[[noreturn]] inline void throwCode(const char* code, std::string detail, int cause = 0, const char* syscall = "",
                                   std::string path = {}, std::string dest = {}) {
  Error e;
  e.err = cause;
  e.code = code;
  e.syscall = syscall;
  e.detail = std::move(detail);
  e.path = std::move(path);
  e.dest = std::move(dest);
  throw e;
}

}  // namespace vmspace

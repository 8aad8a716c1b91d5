// Errors of the core: an errno with the syscall and paths it concerns, or one of vmspace's own conditions
// (a stable ERR_... code, with the errno that caused it where there is one). No N-API types here.
#pragma once

// Every part of vmspace is Linux system calls (renameat2, FICLONE, statx, flock on fds).
#if !defined(__linux__)
#error \
    "vmspace is a Linux addon (renameat2, statx, FICLONE, flock on fds): it builds on Linux only; see docs/install.md"
#endif

#include <string.h>

#include "compat.h"

#include <cerrno>
#include <exception>
#include <new>
#include <string>
#include <system_error>
#include <utility>

namespace vmspace {

struct Error : std::exception {
  int err = 0;          // positive errno; 0 for a condition without one
  std::string code;     // empty: the errno's name (EEXIST, ...); else a vmspace code (ERR_...)
  std::string syscall;  // the syscall that failed, as Node names it (mkdirat, renameat2, ioctl(FICLONE), ...)
  std::string path;
  std::string dest;
  std::string detail;  // extra words for the message (vmspace conditions)
  // ERR_POOL_UNSAFE: owner, group and mode (st_mode & 07777) of the entry at `path`; -1 where not set.
  long long uid = -1, gid = -1;
  int mode = -1;

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

// The most of a text (a condition's detail, which may name a path) an error's message carries, in bytes.
constexpr size_t kMessageTextMax = 4096;

// `text` as a message carries it: whole up to kMessageTextMax bytes, else its head and tail around "…", cut on
// UTF-8 character boundaries. A walk's path has no bound (20,000 directories of 255-byte names are 5 MB) and a
// message is copied into every log line; the error's path and dest fields keep the whole path (lib/errors.ts
// bounds the message it builds from them alike).
inline std::string boundedText(std::string text) {
  if (text.size() <= kMessageTextMax) return text;
  size_t head = kMessageTextMax / 2, tail = text.size() - kMessageTextMax / 2;
  auto continuation = [&](size_t i) { return (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80; };
  while (head > 0 && continuation(head)) head--;
  while (tail < text.size() && continuation(tail)) tail++;
  return text.substr(0, head) + "\xE2\x80\xA6" + text.substr(tail);  // U+2026 "…"
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
  e.detail = boundedText(std::move(detail));
  e.path = std::move(path);
  e.dest = std::move(dest);
  throw e;
}

// std::bad_alloc as an Error: ENOMEM, syscall "malloc"; the one place that says so (currentError uses it, and so
// can the binding for the allocations it makes on the JS thread).
inline Error outOfMemoryError() {
  Error e;
  e.err = ENOMEM;
  e.syscall = "malloc";
  return e;
}

// The Error for the exception being handled (call it inside a catch block only): the one policy for turning a C++
// exception into an error, for a worker's whole call and a sweep's entry alike. A core Error as it is;
// std::bad_alloc as ENOMEM; std::system_error with an errno (a thread or mutex the C++ library could not get:
// pthread_create fails with EAGAIN at RLIMIT_NPROC) as that errno; anything else, which no code means to throw,
// as ERR_INTERNAL naming it. So no exception a worker meets leaves its promise unsettled.
inline Error currentError() {
  Error r;
  r.code = "ERR_INTERNAL";
  try {
    throw;
  } catch (const Error& e) {
    return e;
  } catch (const std::bad_alloc&) {
    return outOfMemoryError();
  } catch (const std::system_error& e) {
    const std::error_category& cat = e.code().category();
    if ((cat == std::generic_category() || cat == std::system_category()) && e.code().value() > 0) {
      r.code.clear();
      r.err = e.code().value();
      if (r.err == EAGAIN) r.syscall = "pthread_create";  // the one system_error the walks can meet
      r.detail = boundedText(e.what());
    } else {
      r.detail = boundedText(std::string("unexpected C++ exception: ") + e.what());
    }
  } catch (const std::exception& e) {
    r.detail = boundedText(std::string("unexpected C++ exception: ") + e.what());
  } catch (...) {
    r.detail = "unexpected C++ exception";
  }
  return r;
}

// currentError for one entry of a sweep (`shown`, its path): the entry named where the error names no path.
inline Error currentErrorAt(const std::string& shown) {
  Error e = currentError();
  if (e.path.empty()) e.path = shown;
  return e;
}

}  // namespace vmspace

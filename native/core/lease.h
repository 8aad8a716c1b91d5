// A workspace's lease (DESIGN.md, "Leases"): a regular file of the pool's own, .vmspace/leases/<x>/<name>, made
// already locked (O_TMPFILE, then linked), holding the workspace's record in an xattr. A workspace is live while
// any open file description of its lease file holds an OFD lock on it (fcntl(2) F_OFD_SETLK: the owner's on byte 0,
// a handed-over description's on byte 1). The kernel drops them when the last fd of a description closes, SIGKILL
// included, and fork/exec keeps them with the fd. Probing takes no lock (F_OFD_GETLK), so a listing never
// disturbs an adopt or a sweep; whoever reclaims or adopts first takes flock(LOCK_EX|LOCK_NB) on the file (a lock
// of another kind, which OFD locks never conflict with) so that two of them never both act on one free lease.
//
// What a holder of a handed-over fd can do with it: lock or unlock bytes of this one file (its own lease only),
// read the record. Not a directory: no openat, fchdir or /proc/self/fd/N/.. walks from it. Not writable: opened
// O_RDONLY, mode without write bits and, when root made it, owned by kLeaseUid, so that a holder running as root
// without CAP_DAC_OVERRIDE/CAP_FOWNER can neither reopen it for writing nor chmod it (chmod(2) needs ownership).
#pragma once

#include <sys/types.h>

#include <string>

#include "fd.h"

namespace vmspace {

constexpr int kLeaseShards = 16;  // leases/0 ... leases/f, by the id's first hex digit (layout::leaseShardOf)
// The owner root gives lease files: (uid_t)-2, an id no account uses ((uid_t)-1 is no id at all, chown(2)).
constexpr uid_t kLeaseUid = static_cast<uid_t>(-2);

enum class LeaseByte : off_t { Owner = 0, Handover = 1 };

// F_OFD_SETLK F_RDLCK on `byte` of the lease `fd`: 0, or the errno.
int holdLease(int fd, LeaseByte byte);

// Whether an open file description other than `fd`'s holds a lock on the lease file (F_OFD_GETLK over the whole
// file): 0 free, 1 held, or -errno when the kernel cannot tell.
int leaseHeldByOther(int fd);

// Makes the lease file `name` below `dirFd` (a path relative to it: "<shard>/<name>"), holding the owner's lock and
// carrying `record` (may be empty: set later with writeRecord, metadata.h) from the moment its name exists. Returns its
// fd (O_RDWR, close-on-exec) or -1 with errno and *step the call that failed (EEXIST: the name is taken). `gid` >= 0:
// the pool's shared group (mode 0440 / 0640 then).
int makeLeaseFile(int dirFd, const std::string& name, const std::string& record, long long gid, const char** step);

// Links the lease `fd` (unnamed or not) as `name` in `dirFd`, never replacing: 0 or the errno (EEXIST: taken).
int linkLeaseFile(int fd, int dirFd, const std::string& name);

// Opens the lease file `name` below `dirFd` read-only (O_NOFOLLOW, close-on-exec, non-blocking); -1 with errno.
int openLeaseFile(int dirFd, const std::string& name);

// flock(LOCK_EX|LOCK_NB) on the lease `fd`, then whether it is free: true when this caller may reclaim or adopt it
// (the flock stays held until `fd` is closed or unlocked), false when another taker has it or a holder holds the
// lease (errno EWOULDBLOCK), or on another error (errno set). When false, *step is the call that said so: "flock"
// or "fcntl(F_OFD_GETLK)".
bool takeFreeLease(int fd, const char** step);

}  // namespace vmspace

// Facts about the calling process that the core needs, from /proc/self/status (proc(5)).
#pragma once

#include <sys/types.h>

namespace vmspace {

// The process umask, read without changing it (umask(2) can only be read by setting it, which races with other
// threads): the Umask: line of /proc/self/status, Linux 4.7. 077, the strictest, where it cannot be read.
mode_t currentUmask();

// Whether the process has CAP_SYS_ADMIN in its effective set (the CapEff: line), which qgroup limits and project
// quota limits need (btrfs ioctl.c, fs/quota/quota.c). False where it cannot be read.
bool hasCapSysAdmin();

}  // namespace vmspace

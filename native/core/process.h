// Facts about the calling process that the core needs.
#pragma once

#include <sys/types.h>

namespace vmspace {

// The process umask, read without changing it (umask(2) can only be read by setting it, which races with other
// threads): the Umask: line of /proc/self/status, Linux 4.7. 022 where it cannot be read.
mode_t currentUmask();

}  // namespace vmspace

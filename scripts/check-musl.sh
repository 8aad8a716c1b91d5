#!/usr/bin/env bash
# Compiles (syntax only) the addon's sources against musl's C headers (Debian's musl-dev: musl 1.2.3, which has no
# statx or renameat2 wrapper) with g++'s libstdc++ headers: catches glibc-only calls and declarations before an
# Alpine user does. Not a musl build: Debian has no musl libstdc++ to link with (docs/install.md).
# Usage: scripts/check-musl.sh   (needs g++ and musl-dev)
set -euo pipefail
cd "$(dirname "$0")/.."
musl=/usr/include/$(uname -m)-linux-musl
[ -d "$musl" ] || { echo "check-musl: no $musl (apt-get install musl-dev)"; exit 1; }
gxx=$(g++ -dumpversion | cut -d. -f1)
triple=$(g++ -dumpmachine)
kernel=$(mktemp -d /tmp/vmspace-musl-XXXXXX)
trap 'rm -rf "$kernel"' EXIT
# musl-dev ships no kernel headers; Debian's linux-libc-dev ones serve (as Alpine's linux-headers do).
ln -s /usr/include/linux "$kernel/linux"
ln -s "/usr/include/$triple/asm" "$kernel/asm"
ln -s /usr/include/asm-generic "$kernel/asm-generic"
nodeinc=$(dirname "$(dirname "$(command -v node)")")/include/node
# libstdc++'s headers are configured for glibc: they ask __GLIBC_PREREQ, name __locale_t and call glibc 2.30's
# clock-taking pthread functions. Stand-ins so that they parse; vmspace's own code gets none of them.
cat >"$kernel/libstdcxx-on-musl.h" <<'STUB'
#include <pthread.h>
#include <time.h>
extern "C" int pthread_cond_clockwait(pthread_cond_t*, pthread_mutex_t*, clockid_t, const struct timespec*);
extern "C" int pthread_mutex_clocklock(pthread_mutex_t*, clockid_t, const struct timespec*);
extern "C" int pthread_rwlock_clockrdlock(pthread_rwlock_t*, clockid_t, const struct timespec*);
extern "C" int pthread_rwlock_clockwrlock(pthread_rwlock_t*, clockid_t, const struct timespec*);
STUB
g++ -std=c++17 -fsyntax-only -Wall -Wextra -Wno-unused-parameter -Werror \
  -D_GNU_SOURCE -DNAPI_VERSION=8 -DNAPI_CPP_EXCEPTIONS -DNODE_API_SWALLOW_UNTHROWABLE_EXCEPTIONS '-D__GLIBC_PREREQ(a,b)=0' -D__locale_t=locale_t \
  -nostdinc -isystem "/usr/include/c++/$gxx" -isystem "/usr/include/$triple/c++/$gxx" \
  -isystem "/usr/lib/gcc/$triple/$gxx/include" -isystem "$musl" -isystem "$kernel" \
  -include "$kernel/libstdcxx-on-musl.h" -I "$nodeinc" -I "$(node -p "require('node-addon-api').include_dir")" \
  native/binding/*.cc native/core/*.cc
echo "check-musl: native/ compiles against musl $(dpkg-query -W -f '${Version}' musl-dev 2>/dev/null) headers"

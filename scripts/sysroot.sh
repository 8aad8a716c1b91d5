#!/usr/bin/env bash
# Makes (once) the Debian 11 "bullseye" root the prebuilds are compiled in: its glibc is 2.31 and its g++ is 10, so
# a binary linked there (libstdc++ and libgcc static) needs no glibc symbol newer than GLIBC_2.31 and runs on
# Ubuntu 20.04, Debian 11 and newer. Debian 12's own toolchain pulls in 2.34 symbols (pthread_create) and
# libstdc++'s __libc_single_threaded (2.32). Debian 10 is no longer on the mirror, so 2.28 is out of reach here.
# Usage: scripts/sysroot.sh   (root; prints the root's path; cached, a second run does nothing)
set -euo pipefail
root=${VMSPACE_SYSROOT:-/var/cache/vmspace-sysroot/bullseye}
mirror=${VMSPACE_MIRROR:-http://deb.debian.org/debian}
if [ -f "$root/.complete" ]; then echo "$root"; exit 0; fi
[ "$(id -u)" = 0 ] || { echo "sysroot: debootstrap and chroot need root" >&2; exit 1; }
export PATH="$PATH:/usr/sbin:/sbin"
if ! command -v debootstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
# Built beside the cache and renamed when complete, so an interrupted run never leaves a half root in use.
tmp="$root.tmp"
rm -rf "$tmp"
mkdir -p "$(dirname "$root")"
debootstrap --variant=minbase \
  --include=g++,make,binutils,g++-aarch64-linux-gnu,binutils-aarch64-linux-gnu,libc6-dev-arm64-cross \
  bullseye "$tmp" "$mirror" >&2
rm -rf "$tmp/var/cache/apt/archives/"*.deb
touch "$tmp/.complete"
rm -rf "$root"
mv "$tmp" "$root"
echo "$root"

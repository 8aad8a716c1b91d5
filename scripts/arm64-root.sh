#!/usr/bin/env bash
# Makes (once) an arm64 Debian 12 root holding Debian's nodejs (18.x, Node-API 9), to run the arm64 prebuild under
# qemu-user: `qemu-aarch64-static -L <root> <root>/usr/bin/node ...`. Only debootstrap's download and unpack are
# used (--foreign); the packages are unpacked with dpkg-deb -x, so no arm64 code runs as part of making it and no
# binfmt_misc registration is needed. Usage: scripts/arm64-root.sh   (root; prints the root's path)
set -euo pipefail
root=${VMSPACE_ARM64_ROOT:-/var/cache/vmspace-sysroot/bookworm-arm64}
mirror=${VMSPACE_MIRROR:-http://deb.debian.org/debian}
if [ -f "$root/.complete" ]; then echo "$root"; exit 0; fi
[ "$(id -u)" = 0 ] || { echo "arm64-root: debootstrap needs root" >&2; exit 1; }
export PATH="$PATH:/usr/sbin:/sbin"
need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
tmp="$root.tmp"
rm -rf "$tmp"
mkdir -p "$(dirname "$root")"
debootstrap --foreign --arch=arm64 --variant=minbase --include=nodejs bookworm "$tmp" "$mirror" >&2
for deb in "$tmp"/var/cache/apt/archives/*.deb; do dpkg-deb -x "$deb" "$tmp"; done
rm -rf "$tmp/var/cache/apt/archives/"*.deb
touch "$tmp/.complete"
rm -rf "$root"
mv "$tmp" "$root"
echo "$root"

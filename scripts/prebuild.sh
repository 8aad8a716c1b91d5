#!/usr/bin/env bash
# Builds the prebuilt binaries the package ships: prebuilds/linux-x64/vmspace.napi.glibc.node and
# prebuilds/linux-arm64/vmspace.napi.glibc.node, with `prebuildify --napi --strip --tag-libc` driving node-gyp.
# The compiler is Debian 11's g++ 10 (and its aarch64 cross compiler) run in the bullseye root that
# scripts/sysroot.sh makes and caches: glibc 2.31 there, and libstdc++/libgcc linked statically, so the binaries
# need no symbol newer than GLIBC_2.31 (scripts/check-glibc.sh checks). The libc tag keeps node-gyp-build from
# loading them on musl, where the install script builds from source instead.
# Usage: npm run prebuild   (root: chroot and bind mounts)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
root=$(scripts/sysroot.sh)

# Node's headers: npm's nodedir if set, else the ones installed beside node (Debian/NodeSource: /usr/include/node).
nodedir=${npm_config_nodedir:-$(dirname "$(dirname "$(command -v node)")")}
[ -f "$nodedir/include/node/node_api.h" ] || { echo "prebuild: no Node headers in $nodedir/include/node" >&2; exit 1; }
export npm_config_nodedir=$nodedir
# npm's own node-gyp (npm run puts it in npm_config_node_gyp); prebuildify would otherwise want a local one.
export PREBUILD_NODE_GYP=${npm_config_node_gyp:-$(dirname "$(command -v npm)")/../lib/node_modules/npm/node_modules/node-gyp/bin/node-gyp.js}

# The build runs in a staging copy of the sources, so the checkout's build/ (the tests' addon) is left alone. The
# compiler sees the same paths as node-gyp on the host: the staging copy and the headers are bind-mounted into the
# root at the paths they have here.
stage=$(mktemp -d /tmp/vmspace-prebuild-XXXXXX)
tools=$stage/tools
mounts=()
cleanup() {
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[i]}" || true; done
  for m in "${mounts[@]}"; do rmdir "$m" 2>/dev/null || true; done
  rm -rf "$stage"
}
trap cleanup EXIT
bind() {
  mkdir -p "$root$1"
  mount --bind "$1" "$root$1"
  mounts+=("$root$1")
}
mkdir -p "$tools" "$stage/pkg/node_modules"
cp -r package.json binding.gyp native "$stage/pkg/"
cp -r node_modules/node-addon-api "$stage/pkg/node_modules/"
bind "$stage"
bind "$nodedir/include/node"

# One wrapper per tool: run it in the root, in the directory make runs it from.
wrap() {
  cat >"$tools/$1" <<WRAP
#!/bin/sh
exec chroot "$root" /bin/sh -c 'cd "\$0" && exec "\$@"' "\$PWD" $2 "\$@"
WRAP
  chmod +x "$tools/$1"
}
wrap cxx-x64 g++
wrap cc-x64 gcc
wrap strip-x64 strip
wrap cxx-arm64 aarch64-linux-gnu-g++
wrap cc-arm64 aarch64-linux-gnu-gcc
wrap strip-arm64 aarch64-linux-gnu-strip

prebuildify=$repo/node_modules/.bin/prebuildify
for arch in x64 arm64; do
  echo "prebuild: linux-$arch"
  (cd "$stage/pkg" && CXX="$tools/cxx-$arch" CC="$tools/cc-$arch" LINK="$tools/cxx-$arch" \
    LDFLAGS="-static-libstdc++ -static-libgcc" PREBUILD_STRIP_BIN="$tools/strip-$arch" \
    "$prebuildify" --napi --strip --tag-libc --arch "$arch")
done
rm -rf prebuilds
cp -r "$stage/pkg/prebuilds" prebuilds
ls -l prebuilds/*/

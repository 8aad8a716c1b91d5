#!/usr/bin/env bash
# The package as a sidecar installs it: `npm pack`, then the tarball installed into fresh projects with no compiler
# on PATH — by npm (install script runs), by npm --ignore-scripts, and by pnpm 10 (whose default skips dependencies'
# build scripts) — and in each, allocate/clone/dispose through require, import and a worker thread, each of which
# must have loaded the prebuild (never a source build). Then the tarball without prebuilds: the install and the
# require fail with vmspace's messages. Needs prebuilds/ (npm run build:prebuilds; npm pack refuses without them).
# As root, the npm project then runs on glibc 2.31 (x64, the Debian 11 root of scripts/sysroot.sh) and on arm64
# (qemu-user with Debian's arm64 nodejs, scripts/arm64-root.sh).
# Usage: scripts/smoke.sh   (prints "smoke: N passed, N failed")
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
pnpm_version=10.12.1
work=$(mktemp -d /tmp/vmspace-smoke-XXXXXX)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
ok() { echo "smoke: ok: $1"; passed=$((passed + 1)); }
bad() { echo "smoke: FAILED: $1"; failed=$((failed + 1)); }

# The tarball, holding both prebuilds.
tgz=$(npm pack --pack-destination "$work" --silent 2>/dev/null | tail -1)
tgz=$work/$tgz
if [ -f "$tgz" ]; then ok "npm pack: $(basename "$tgz")"; else bad "npm pack"; echo "smoke: 0 passed, 1 failed"; exit 1; fi
listing=$(tar -tzf "$tgz")
for f in prebuilds/linux-x64/vmspace.glibc.node prebuilds/linux-arm64/vmspace.glibc.node; do
  if grep -qx "package/$f" <<<"$listing"; then ok "tarball holds $f"; else bad "tarball lacks $f"; fi
done

# A PATH with node, npm, npx and sh (npm runs install scripts with it) only: no cc, c++, make or python3 for a
# source build to find, as in a node:*-slim image.
mkdir -p "$work/bin"
for t in node npm npx sh; do ln -s "$(command -v $t)" "$work/bin/$t"; done
nocc=$work/bin
if PATH=$nocc command -v cc c++ gcc g++ make >/dev/null 2>&1; then bad "PATH without a compiler"; else ok "PATH without a compiler"; fi
# pnpm fetched once (with the full PATH), then run from its own install.
npm install --prefix "$work/pnpm" --no-audit --no-fund --silent "pnpm@$pnpm_version" >/dev/null 2>&1 ||
  bad "npm install pnpm@$pnpm_version"
ln -s "$work/pnpm/node_modules/pnpm/bin/pnpm.cjs" "$work/bin/pnpm"

# $1: label; the rest: the install command, run in a fresh project with the compiler-less PATH.
consumer() {
  local label=$1 dir=$work/$1
  shift
  mkdir -p "$dir"
  (cd "$dir" && echo '{"name":"consumer","version":"1.0.0","private":true}' >package.json)
  if ! (cd "$dir" && PATH=$nocc HOME=$work/home "$@") >"$dir.log" 2>&1; then
    bad "$label: install"; tail -20 "$dir.log"; return
  fi
  ok "$label: install"
  # pnpm 10 must have skipped vmspace's install script (the case this run is for), not run it.
  if [ "$label" = pnpm ]; then
    if grep -q "Ignored build scripts: vmspace" "$dir.log"; then ok "pnpm: skipped the install script"; else
      bad "pnpm: did not report skipping vmspace's install script"; fi
  fi
  local pkg
  pkg=$(cd "$dir" && PATH=$nocc node -p "require('path').dirname(require.resolve('vmspace/package.json'))")
  if [ -e "$pkg/build" ]; then bad "$label: a source build was made ($pkg/build)"; fi
  cp scripts/smoke/consumer.cjs scripts/smoke/consumer.mjs scripts/smoke/worker.cjs "$dir/"
  local how out
  for how in consumer.cjs consumer.mjs worker.cjs; do
    if out=$(cd "$dir" && PATH=$nocc node "$how" 2>&1) && [[ "$out" == "ok "*" prebuilds/linux-$(node -p process.arch)/vmspace.glibc.node" ]]; then
      ok "$label: $out"
    else
      bad "$label: $how: $out"
    fi
  done
}
consumer npm npm install --no-audit --no-fund "$tgz"
consumer npm-ignore-scripts npm install --no-audit --no-fund --ignore-scripts "$tgz"
consumer pnpm pnpm add "$tgz"

# The same tarball without its prebuilds (as on a platform none fits), no compiler: npm's install fails with
# vmspace's own message (what to install, `npm rebuild vmspace`), and after --ignore-scripts the first require does.
mkdir -p "$work/bare"
tar -xzf "$tgz" -C "$work/bare" && rm -rf "$work/bare/package/prebuilds" && tar -czf "$work/bare.tgz" -C "$work/bare" package
bare_consumer() {  # $1: label; the rest: npm install arguments
  local label=$1 dir=$work/$1
  shift
  mkdir -p "$dir"
  (cd "$dir" && echo '{"name":"consumer","version":"1.0.0","private":true}' >package.json)
  (cd "$dir" && PATH=$nocc HOME=$work/home npm install --no-audit --no-fund "$@" "$work/bare.tgz") >"$dir.log" 2>&1
}
if bare_consumer bare-npm; then bad "no prebuild, no compiler: npm install succeeded"
elif grep -q 'vmspace: no prebuilt binary fits this machine' "$work/bare-npm.log" && grep -q 'npm rebuild vmspace' "$work/bare-npm.log"; then
  ok "no prebuild, no compiler: npm install fails with vmspace's message"
else bad "no prebuild, no compiler: npm install's output lacks vmspace's message"; tail -20 "$work/bare-npm.log"; fi
if ! bare_consumer bare-ignore-scripts --ignore-scripts; then bad "no prebuild: npm install --ignore-scripts"; tail -20 "$work/bare-ignore-scripts.log"
elif out=$(cd "$work/bare-ignore-scripts" && PATH=$nocc node -e "require('vmspace')" 2>&1); then bad "no prebuild: require succeeded"
elif grep -q 'vmspace: no native binary could be loaded' <<<"$out" && grep -q 'npm rebuild vmspace' <<<"$out"; then
  ok "no prebuild: require fails with vmspace's message"
else bad "no prebuild: require's error lacks vmspace's message: $out"; fi

# The npm project on other hosts (root: chroot, bind mounts). Each runs the same three consumers.
# $1: label; the rest: the command prefix that runs node there.
elsewhere() {
  local label=$1 how out
  shift
  for how in consumer.cjs consumer.mjs worker.cjs; do
    if out=$("$@" "$how" 2>&1) && [[ "$out" == "ok "*" prebuilds/linux-$arch/vmspace.glibc.node" ]]; then
      ok "$label: $out"
    else
      bad "$label: $how: $out"
    fi
  done
}
# The same project under each other Node binary given in VMSPACE_SMOKE_NODES (paths, space-separated: CI passes
# Node 22, 24 and 26): the prebuilt binary loads on every version users run.
if [ -d "$work/npm/node_modules/vmspace" ]; then
  arch=$(node -p process.arch)
  for bin in ${VMSPACE_SMOKE_NODES:-}; do
    elsewhere "node $("$bin" -v)" env -C "$work/npm" "$bin"
  done
fi
if [ "$(id -u)" != 0 ]; then
  echo "smoke: skipped (not root): the glibc 2.31 and arm64 runs"
elif [ -d "$work/npm/node_modules/vmspace" ]; then
  # x64 on glibc 2.31: this node (NodeSource's needs glibc 2.28) in the Debian 11 root the prebuilds are built in.
  root=$(scripts/sysroot.sh)
  proj=$work/npm
  mounted=()
  mkdir -p "$root$proj" "$root/proc"
  touch "$root/usr/local/bin/node"
  mount --bind "$(readlink -f "$(command -v node)")" "$root/usr/local/bin/node" && mounted+=("$root/usr/local/bin/node")
  mount --bind "$proj" "$root$proj" && mounted+=("$root$proj")
  mount -t proc proc "$root/proc" && mounted+=("$root/proc")
  arch=x64
  elsewhere "x64 on glibc $(chroot "$root" ldd --version | head -1 | awk '{print $NF}')" \
    env -u NODE_EXTRA_CA_CERTS chroot "$root" /bin/sh -c 'cd "$0" && exec /usr/local/bin/node "$1"' "$proj"
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[i]}"; done
  rmdir "$root$proj" 2>/dev/null; rm -f "$root/usr/local/bin/node"
  # arm64: Debian 12's arm64 nodejs (18.x) under qemu-user, loading the cross-built prebuild.
  if arm=$(scripts/arm64-root.sh); then
    arch=arm64
    # qemu-user's -L maps an absolute path to the arm64 root's copy wherever one exists, and "/" always does:
    # openPool walks its root's path from "/" (checking each directory), so it would land inside the arm64 root
    # while node's own mkdtemp uses the host's /tmp. A temp dir bind-mounted at the same path in both is one dir.
    armtmp=$(mktemp -d /tmp/vmspace-smoke-arm-XXXXXX)
    mkdir -p "$arm$armtmp" && mount --bind "$armtmp" "$arm$armtmp"
    elsewhere "arm64 (qemu, node $(qemu-aarch64-static -L "$arm" "$arm/usr/bin/node" -v))" \
      env -u NODE_EXTRA_CA_CERTS -C "$proj" TMPDIR="$armtmp" qemu-aarch64-static -L "$arm" "$arm/usr/bin/node"
    umount "$arm$armtmp"; rmdir "$arm$armtmp"; rm -rf "$armtmp"
  else
    bad "arm64 root (scripts/arm64-root.sh)"
  fi
fi

echo "smoke: $passed passed, $failed failed"
[ "$failed" = 0 ]

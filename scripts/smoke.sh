#!/usr/bin/env bash
# The package as a sidecar installs it: `npm pack`, then the tarball installed into fresh projects with no compiler
# on PATH — by npm (install script runs), by npm --ignore-scripts, and by pnpm 10 (whose default skips dependencies'
# build scripts) — and in each, allocate/clone/dispose through require, import and a worker thread, each of which
# must have loaded the prebuild (never a source build). Needs prebuilds/ (npm run prebuild).
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
for f in prebuilds/linux-x64/vmspace.glibc.node prebuilds/linux-arm64/vmspace.glibc.node; do
  if tar -tzf "$tgz" | grep -qx "package/$f"; then ok "tarball holds $f"; else bad "tarball lacks $f"; fi
done

# A PATH with node, npm and npx only: no cc, c++, make or python3 for a source build to find.
mkdir -p "$work/bin"
for t in node npm npx; do ln -s "$(command -v $t)" "$work/bin/$t"; done
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

# Keep the npm project for scripts/arm64-proof.sh, when asked.
if [ -n "${VMSPACE_SMOKE_KEEP:-}" ]; then rm -rf "$VMSPACE_SMOKE_KEEP"; cp -a "$work/npm" "$VMSPACE_SMOKE_KEEP"; fi
echo "smoke: $passed passed, $failed failed"
[ "$failed" = 0 ]

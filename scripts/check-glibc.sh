#!/usr/bin/env bash
# Checks that every prebuilt binary loads on old hosts: no versioned glibc symbol newer than $1 (default 2.28,
# RHEL 8; 2.31 is Ubuntu 20.04 / Debian 11), and no libstdc++/libgcc_s to find at run time (linked statically).
# Usage: scripts/check-glibc.sh [max-glibc]
set -euo pipefail
cd "$(dirname "$0")/.."
max=${1:-2.28}
shopt -s nullglob
files=(prebuilds/linux-*/*.node)
[ ${#files[@]} -gt 0 ] || { echo "check-glibc: no prebuilds (npm run prebuild)"; exit 1; }
bad=0
for f in "${files[@]}"; do
  # objdump -T reads any ELF target Debian's binutils knows (x86-64 and aarch64 both).
  syms=$(objdump -T "$f") || { echo "check-glibc: objdump failed on $f"; bad=1; continue; }
  newest=$(grep -o 'GLIBC_[0-9][0-9.]*' <<<"$syms" | sed 's/GLIBC_//' | sort -uV | tail -1)
  if [ "$(printf '%s\n%s\n' "$newest" "$max" | sort -V | tail -1)" != "$max" ]; then
    echo "check-glibc: $f needs GLIBC_$newest (> $max):"
    grep -E "GLIBC_[0-9.]+" <<<"$syms" | sort -V -k5 | tail -5
    bad=1
  fi
  if grep -qE 'GLIBCXX_|CXXABI_|GCC_[0-9]' <<<"$syms"; then
    echo "check-glibc: $f imports libstdc++/libgcc symbols (not linked statically)"; bad=1
  fi
  needed=$(objdump -p "$f" | awk '/NEEDED/ {print $2}' | tr '\n' ' ')
  case "$needed" in *libstdc++*|*libgcc_s*) echo "check-glibc: $f needs $needed"; bad=1 ;; esac
  echo "check-glibc: $f: newest GLIBC_$newest, needs $needed"
done
exit $bad

#!/usr/bin/env node
// The install script's last word when node-gyp-build found no prebuilt binary for this machine and the source
// build failed: node-gyp's own output ends in generic errors that name neither vmspace nor what to install.
// package.json: "install": "node-gyp-build || node scripts/install-failed.cjs". Exits 1, so the install still fails.
'use strict'
const glibc = process.report?.getReport()?.header?.glibcVersionRuntime
const platform = `${process.platform}-${process.arch}, ${glibc ? `glibc ${glibc}` : 'musl (or another non-glibc libc)'}`
console.error(
  [
    '',
    `vmspace: no prebuilt binary fits this machine (${platform}) and the build from source failed (node-gyp's output above says why).`,
    'Two ways out:',
    '  - install a C++17 compiler, make and python3, then run `npm rebuild vmspace`:',
    '      Debian/Ubuntu:  apt-get install g++ make python3',
    '      Alpine:         apk add build-base python3 linux-headers',
    '      Fedora/RHEL:    dnf install gcc-c++ make python3',
    '  - or install on linux-x64 or linux-arm64 with glibc >= 2.28, where a prebuilt binary ships (no compiler needed).',
    '',
  ].join('\n'),
)
process.exit(1)

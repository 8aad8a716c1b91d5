#!/usr/bin/env node
// `npm pack` and `npm publish` run this first (package.json "prepack"): a tarball without both prebuilt binaries
// installs on linux-x64/arm64 only where a compiler is present, and fails everywhere else, so it is refused.
// VMSPACE_PACK_WITHOUT_PREBUILDS=1 packs anyway, for a local tarball (the lint of the packed types, a git
// dependency) that is not published.
'use strict'
const fs = require('node:fs')
const path = require('node:path')

const platforms = ['linux-x64', 'linux-arm64']
const root = path.join(__dirname, '..')
const missing = platforms.filter((p) => {
  try {
    return !fs.readdirSync(path.join(root, 'prebuilds', p)).some((f) => f.endsWith('.node'))
  } catch {
    return true
  }
})
if (missing.length > 0 && process.env.VMSPACE_PACK_WITHOUT_PREBUILDS !== '1') {
  console.error(
    [
      `vmspace: refusing to pack without the prebuilt binaries for ${missing.join(' and ')} (no prebuilds/${missing[0]}/*.node).`,
      '  Build them first: npm run build:prebuilds (as root; see CONTRIBUTING.md, "Prebuilds").',
      '  For a local tarball that is not published: VMSPACE_PACK_WITHOUT_PREBUILDS=1 npm pack',
    ].join('\n'),
  )
  process.exit(1)
}

// The consumer's job, as an installed package's user runs it: allocate a workspace from a template, clone one
// more file into it, dispose it. Prints "ok <how> <binary>" or throws. Usage: node consumer.cjs [label]
'use strict'
const assert = require('node:assert/strict')
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')

async function job(vmspace, how) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-smoke-'))
  try {
    const base = path.join(dir, 'base.img')
    fs.writeFileSync(base, 'base bytes')
    const pool = await vmspace.openPool(path.join(dir, 'pool'))
    const ws = await pool.allocate({ template: { 'rootfs.img': base }, meta: { how } })
    await ws.clone(base, 'copy.img')
    assert.equal(fs.readFileSync(path.join(ws.path, 'rootfs.img'), 'utf8'), 'base bytes')
    assert.equal(fs.readFileSync(path.join(ws.path, 'copy.img'), 'utf8'), 'base bytes')
    const wsPath = ws.path
    await ws.dispose()
    assert.equal(fs.existsSync(wsPath), false)
    assert.equal(ws.status, 'disposed')
    // A system error comes back with its errno name (named on the JS side: no glibc-only calls in the addon).
    const err = await vmspace.removeTree(path.join(dir, 'missing')).catch((e) => e)
    assert.equal(err.code, 'ENOENT')
    assert.equal(err.errno, -2)
    await pool.close()
  } finally {
    fs.rmSync(dir, { recursive: true, force: true })
  }
  // Which binary node-gyp-build chose, relative to the package (a prebuild unless a source build was made).
  const pkg = path.dirname(require.resolve('vmspace/package.json'))
  // node-gyp-build as vmspace resolves it: pnpm does not hoist it into the consumer's node_modules.
  const gypBuild = require('node:module').createRequire(path.join(pkg, 'package.json'))('node-gyp-build')
  return path.relative(pkg, gypBuild.path(pkg))
}

module.exports = { job }

if (require.main === module) {
  job(require('vmspace'), process.argv[2] || 'require').then(
    (binary) => console.log(`ok ${process.argv[2] || 'require'} ${binary}`),
    (e) => {
      console.error(e)
      process.exit(1)
    },
  )
}

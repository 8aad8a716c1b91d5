// The old-kernel paths (native/core/fallback.h), taken on this kernel through the test-only hook
// VMSPACE_TEST_FALLBACK: "mntid" (Linux < 5.8: no STATX_MNT_ID, the mount id
// comes from name_to_handle_at), "fhandle" (no file handles either: device numbers). The hook is read once when
// the addon loads, so each case runs in a child process, under strace to show which path it took.
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { freshDir, mounts, needs, outsideTree, repoRoot, runCommand, snapshotTree } from './helpers.js'

const hasStrace = spawnSync('sh', ['-c', 'command -v strace'], { stdio: 'ignore' }).status === 0

// The child: one clone or removeTree through the built package; prints its error's fields, or "ok".
const script = `
  const v = require(${JSON.stringify(path.join(repoRoot, 'dist', 'index.js'))})
  const [op, a, b] = process.argv.slice(1)
  const p = op === 'clone' ? v.clone(a, b, { reflink: 'auto' }) : v.removeTree(a)
  p.then(() => console.log('ok'), (e) => console.log(JSON.stringify({ code: e.code, errno: e.errno, path: e.path })))
`

/** Runs `op` in a child with VMSPACE_TEST_FALLBACK=`fallback` ('' for none); its output and traced calls. */
function child(fallback: string, op: 'clone' | 'remove', ...args: string[]) {
  const env = { ...process.env, VMSPACE_TEST_FALLBACK: fallback }
  const r = spawnSync(
    'strace',
    ['-f', '-qq', '-e', 'trace=openat2,name_to_handle_at', process.execPath, '-e', script, op, ...args],
    { encoding: 'utf8', env },
  )
  expect(r.status, r.stderr).toBe(0)
  const calls = (name: string) => r.stderr.split('\n').filter((l) => l.includes(`${name}(`)).length
  return { out: r.stdout.trim(), openat2: calls('openat2'), nameToHandle: calls('name_to_handle_at') }
}

/** Every path below `dir` with its kind and content (inodes left out: a clone has its own). */
function content(dir: string): Record<string, string> {
  const snap = snapshotTree(dir)
  return Object.fromEntries(Object.entries(snap).map(([k, v]) => [k, v.replace(/ ino=\d+/, '')]))
}

function sourceTree(dir: string): string {
  const src = path.join(dir, 'src')
  fs.mkdirSync(path.join(src, 'a', 'b', 'c'), { recursive: true })
  fs.mkdirSync(path.join(src, 'x'))
  fs.writeFileSync(path.join(src, 'a', 'b', 'c', 'deep.txt'), 'deep')
  fs.writeFileSync(path.join(src, 'a', 'one.txt'), 'one')
  fs.writeFileSync(path.join(src, 'x', 'two.txt'), 'two')
  fs.symlinkSync('../a/one.txt', path.join(src, 'x', 'link'))
  return src
}

describe.skipIf(!hasStrace)(`kernel fallbacks (VMSPACE_TEST_FALLBACK) ${needs('strace', !hasStrace && 'missing')}`, () => {
  test('no openat2 at all: a tree clone opens directories by O_NOFOLLOW openat from their parent, on any kernel', () => {
    const dir = freshDir()
    const src = sourceTree(dir)
    const plain = child('', 'clone', src, path.join(dir, 'plain'))
    expect(plain).toMatchObject({ out: 'ok', openat2: 0 })
    expect(content(path.join(dir, 'plain'))).toEqual(content(src))
  })

  // A bind mount of the same file system inside the tree: only a mount id tells it apart from a directory.
  test.skipIf(!mounts.root)(
    `mntid: removal takes mount ids from name_to_handle_at and still stops at a bind mount inside (EBUSY) ${needs('root for mount --bind', !mounts.root && 'not root')}`,
    () => {
      const dir = freshDir()
      const outside = outsideTree(dir)
      const before = snapshotTree(outside)
      const tree = path.join(dir, 'tree')
      const mnt = path.join(tree, 'a', 'mnt')
      fs.mkdirSync(mnt, { recursive: true })
      fs.writeFileSync(path.join(tree, 'a', 'sibling.txt'), 'x')
      expect(runCommand('mount', ['--bind', outside, mnt]).status).toBe(0)
      try {
        const r = child('mntid', 'remove', tree)
        expect(JSON.parse(r.out)).toEqual({ code: 'EBUSY', errno: -16, path: mnt })
        expect(r.nameToHandle).toBeGreaterThan(0)
        expect(snapshotTree(outside)).toEqual(before)
        expect(fs.readdirSync(path.join(tree, 'a'))).toEqual(['mnt'])
      } finally {
        runCommand('umount', [mnt])
      }
      expect(snapshotTree(outside)).toEqual(before)
      // Without the hook statx reports the mount id itself (Linux >= 5.8).
      fs.rmSync(path.join(tree, 'a', 'mnt'), { recursive: true })
      fs.writeFileSync(path.join(tree, 'a', 'again.txt'), 'x')
      const plain = child('', 'remove', tree)
      expect(plain).toEqual({ out: 'ok', openat2: 0, nameToHandle: 0 })
      expect(fs.existsSync(tree)).toBe(false)
    },
  )

  test.skipIf(!mounts.root)(
    `fhandle: with device numbers only, removal still stops at a mount of another file system (EBUSY) ${needs('root for mount', !mounts.root && 'not root')}`,
    () => {
      const dir = freshDir()
      const tree = path.join(dir, 'tree')
      const mnt = path.join(tree, 'a', 'mnt')
      fs.mkdirSync(mnt, { recursive: true })
      fs.writeFileSync(path.join(tree, 'top.txt'), 'x')
      expect(runCommand('mount', ['-t', 'tmpfs', '-o', 'size=1m', 'vmspace-fallback', mnt]).status).toBe(0)
      try {
        fs.writeFileSync(path.join(mnt, 'keep.txt'), 'keep me')
        const r = child('fhandle', 'remove', tree)
        expect(JSON.parse(r.out)).toEqual({ code: 'EBUSY', errno: -16, path: mnt })
        expect(r.nameToHandle).toBe(0)
        expect(fs.readFileSync(path.join(mnt, 'keep.txt'), 'utf8')).toBe('keep me')
        expect(fs.readdirSync(tree)).toEqual(['a'])
        expect(fs.readdirSync(path.join(tree, 'a'))).toEqual(['mnt'])
      } finally {
        runCommand('umount', [mnt])
      }
    },
  )
})

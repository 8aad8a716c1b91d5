/**
 * Shared files, checkpoints and rollback against a hostile guest's tree and a careless caller (docs/checkpoints.md,
 * docs/templates.md "Shared files"): quota workspaces, a guest's read-only subvolume, modes a guest took away, and
 * what root does to a shared inode, each pinned as the behaviour the docs promise.
 */
import './native-hooks.js'
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { afterAll, describe, expect, test } from 'vitest'
import { openPool, type Pool } from '../lib/index.js'
import { freshDir, MiB, mounts, needs, poolState, repoRoot, unprivilegedChildren } from './helpers.js'
import { rejection } from './layout-helpers.js'
import { removeScratch } from './setup/mounts.js'

const base = mounts.root ? fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-cp-hostile-')) : null
afterAll(() => {
  if (base) removeScratch(base)
})

/** A loop-mounted btrfs with quotas enabled, or why there is none. */
function btrfsWithQuotas(): { dir: string | null; why?: string } {
  if (!base) return { dir: null, why: 'not root' }
  const image = path.join(base, 'btrfs.img')
  const dir = path.join(base, 'btrfs')
  fs.closeSync(fs.openSync(image, 'wx'))
  fs.truncateSync(image, 1536 * MiB)
  fs.mkdirSync(dir)
  for (const [cmd, ...args] of [['mkfs.btrfs', '-q', '-f', image], ['mount', '-o', 'loop', image, dir], ['btrfs', 'quota', 'enable', dir]]) {
    const r = spawnSync(cmd, args, { encoding: 'utf8' })
    if (r.status !== 0) return { dir: null, why: `${cmd} failed: ${(r.stderr || r.error?.message || '').trim().split('\n')[0]}` }
  }
  return { dir }
}
const btrfsQ = btrfsWithQuotas()

describe.skipIf(!btrfsQ.dir)(`a quota workspace on btrfs ${needs('root, mkfs.btrfs, btrfs qgroups', btrfsQ.why)}`, () => {
  test('checkpoint({ share }) of a quota workspace is ERR_SHARE_UNSUPPORTED, nothing made: no rollback could ever link the file', async () => {
    await using pool = await openPool(path.join(btrfsQ.dir!, 'pool-share'))
    const ws = await pool.allocate({ quota: { bytes: 64 * MiB } })
    fs.writeFileSync(path.join(ws.path, 'mem'), 'memory')
    const before = poolState(pool.root)
    for (const made of [() => ws.checkpoint({ share: ['mem'] }), () => pool.checkpoint(ws.id, { share: ['mem'] })]) {
      const e = await rejection(made())
      expect(e).toMatchObject({ code: 'ERR_SHARE_UNSUPPORTED', path: 'mem', cause: { code: 'EXDEV' } })
      expect(poolState(pool.root)).toEqual(before)
      expect(await ws.checkpoints()).toEqual([])
    }
    // Without share it works, and the rollback keeps the quota.
    const cp = await ws.checkpoint()
    fs.writeFileSync(path.join(ws.path, 'mem'), 'changed')
    expect(await ws.rollback(cp)).toEqual({ checkpoint: cp.id, removed: true })
    expect(fs.readFileSync(path.join(ws.path, 'mem'), 'utf8')).toBe('memory')
    expect((await ws.usage()).quota?.limitBytes).toBe(64 * MiB)
    await ws.dispose()
  })
})

const uidNobody = 65534
/** `script` run by sh as uid 65534 with no capabilities, in `cwd` (entered as root first). */
const asNobody = (cwd: string, script: string) =>
  spawnSync('setpriv', [`--reuid=${uidNobody}`, `--regid=${uidNobody}`, '--clear-groups', '--inh-caps=-all', 'sh', '-c', script], { cwd, encoding: 'utf8' })

/** A workspace holding `mem`, a template of it sharing `mem`, and two children of that template. */
async function twoChildren(pool: Pool) {
  const ws = await pool.allocate()
  fs.writeFileSync(path.join(ws.path, 'mem'), 'memory')
  const t = await pool.commit(ws, { share: ['mem'] })
  return { ws, t, a: await pool.allocate({ from: t.id }), b: await pool.allocate({ from: t.id }) }
}

describe.skipIf(!mounts.root || mounts.xfs === null)(`what root does to a shared file reaches every holder ${needs('root and loop XFS', !mounts.root && 'not root')}`, () => {
  test("a chown -R of one child's tree hands the one shared inode to that uid, which can then write every child's and the template's file", async () => {
    await using pool = await openPool(path.join(fs.mkdtempSync(path.join(mounts.xfs!, 'review-')), 'pool'))
    const { ws, t, a, b } = await twoChildren(pool)
    const shared = path.join(t.path, '..', 'shared', '0')
    expect(fs.statSync(shared)).toMatchObject({ uid: 4294967294, mode: 0o100444, nlink: 3 })
    // Without the chown the guest can neither write, chmod nor chown it.
    fs.chownSync(a.path, uidNobody, uidNobody)
    for (const op of ['echo x >> mem', 'chmod 666 mem', `chown ${uidNobody} mem`]) expect(asNobody(a.path, op).status).not.toBe(0)
    // The host's usual step to give a sandbox its tree (docs/templates.md, "Writes"): it changes the inode itself.
    expect(spawnSync('chown', ['-R', `${uidNobody}:${uidNobody}`, a.path]).status).toBe(0)
    expect(fs.statSync(shared).uid).toBe(uidNobody)
    expect(asNobody(a.path, 'chmod 644 mem && echo hostile > mem').status).toBe(0)
    for (const file of [path.join(b.path, 'mem'), shared]) expect(fs.readFileSync(file, 'utf8')).toBe('hostile\n')
    for (const w of [a, b, ws]) await w.dispose()
  })

  test("root's chattr +i on one child's shared file makes every other holder's removal fail (EPERM) until it is cleared; a sweep then removes them", async () => {
    await using pool = await openPool(path.join(fs.mkdtempSync(path.join(mounts.xfs!, 'review-')), 'pool'))
    const { ws, t, a, b } = await twoChildren(pool)
    expect(spawnSync('chattr', ['+i', path.join(a.path, 'mem')]).status).toBe(0)
    expect(await rejection(b.dispose())).toMatchObject({ code: 'EPERM', syscall: 'unlinkat' })
    expect(await rejection(pool.removeTemplate(t.id))).toMatchObject({ code: 'EPERM', syscall: 'unlinkat' })
    expect(spawnSync('chattr', ['-i', path.join(a.path, 'mem')]).status).toBe(0)
    await a.dispose()
    await ws.dispose()
    const s = await pool.sweep({ graceMs: 0 })
    expect(s.failed).toEqual([])
    expect(poolState(pool.root)).toEqual({ visible: [], staging: [], trash: [], leases: [] })
  })
})

describe.skipIf(!mounts.root || mounts.btrfs === null)(`a guest's read-only subvolume ${needs('root and loop btrfs', mounts.btrfs === null && mounts.missing.btrfs)}`, () => {
  test("a read-only subvolume a guest made (no privilege) in its tree does not keep a rollback's old tree, a dispose or a sweep from removing it", async () => {
    await using pool = await openPool(path.join(fs.mkdtempSync(path.join(mounts.btrfs!, 'review-')), 'pool'))
    const ws = await pool.allocate()
    const cp = await ws.checkpoint()
    fs.chownSync(ws.path, uidNobody, uidNobody)
    const plant = 'btrfs -q subvolume create sv && echo x > sv/f && btrfs property set -t subvol sv ro true && ! touch sv/g 2>/dev/null'
    const r = asNobody(ws.path, plant)
    expect(r.stderr).toBe('')
    expect(r.status).toBe(0)
    expect(await ws.rollback(cp)).toEqual({ checkpoint: cp.id, removed: true })
    expect(fs.readdirSync(ws.path)).toEqual([])
    fs.chownSync(ws.path, uidNobody, uidNobody)
    expect(asNobody(ws.path, plant).status).toBe(0)
    await ws.dispose()
    expect((await pool.sweep({ graceMs: 0 })).failed).toEqual([])
    expect(poolState(pool.root)).toEqual({ visible: [], staging: [], trash: [], leases: [] })
  })
})

/** An empty directory for a pool of uid 65534 (its parent reachable by it). */
function unprivilegedPool(): string {
  const dir = freshDir()
  fs.chmodSync(dir, 0o755)
  const root = path.join(dir, 'pool')
  fs.mkdirSync(root)
  fs.chownSync(root, uidNobody, uidNobody)
  return root
}

/** What `script` (CommonJS, `vmspace` and `root` in scope) printed as JSON, run by node as uid 65534. */
function nodeAsNobody(root: string, script: string): unknown {
  const prelude = `const vmspace = require(${JSON.stringify(path.join(repoRoot, 'dist', 'index.js'))}); const root = ${JSON.stringify(root)}; const fs = require('fs'), path = require('path');`
  const r = spawnSync('setpriv', [`--reuid=${uidNobody}`, `--regid=${uidNobody}`, '--clear-groups', process.execPath, '-e', `${prelude}(async () => { ${script} })().then((o) => console.log(JSON.stringify(o)), (e) => { console.error(e); process.exit(1) })`], { encoding: 'utf8' })
  expect(r.status, r.stderr).toBe(0)
  return JSON.parse(r.stdout)
}

describe.skipIf(!unprivilegedChildren)(`shared files in a pool of an unprivileged user ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`, () => {
  test("a shared file in a directory without its owner's write bit (0555, as a rootfs has them) is linked into every child and back by a rollback, the mode kept", async () => {
    const root = unprivilegedPool()
    const out = nodeAsNobody(
      root,
      `const pool = await vmspace.openPool(root)
      const ws = await pool.allocate()
      fs.mkdirSync(path.join(ws.path, 'boot'))
      fs.writeFileSync(path.join(ws.path, 'boot', 'vmlinux'), 'kernel')
      fs.chmodSync(path.join(ws.path, 'boot'), 0o555)
      const t = await pool.commit(ws, { share: ['boot/vmlinux'] })
      const child = await pool.allocate({ from: t.id }).catch((e) => e)
      const cp = await ws.checkpoint({ share: ['boot/vmlinux'] })
      fs.writeFileSync(path.join(ws.path, 'later'), 'x')
      const rolled = await ws.rollback(cp).catch((e) => e)
      const out = {
        child: child.code ?? fs.readFileSync(path.join(child.path, 'boot', 'vmlinux'), 'utf8'),
        childMode: !child.code ? (fs.statSync(path.join(child.path, 'boot')).mode & 0o7777).toString(8) : null,
        rollback: rolled.code ?? rolled.removed,
        tree: fs.readdirSync(ws.path),
        mode: (fs.statSync(path.join(ws.path, 'boot')).mode & 0o7777).toString(8),
      }
      if (!child.code) await child.dispose()
      await ws.dispose()
      await pool.removeTemplate(t.id)
      await pool.close()
      return out`,
    )
    expect(out).toEqual({ child: 'kernel', childMode: '555', rollback: true, tree: ['boot'], mode: '555' })
    expect(poolState(root)).toEqual({ visible: [], staging: [], trash: [], leases: [] })
  })
})

describe.skipIf(!unprivilegedChildren)(`rollback in a pool of an unprivileged user ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`, () => {
  // The build copied the workspace directory's mode (0500: no clone into it), and the exchange moves the old
  // directory to another parent, which needs write permission on it: its owner's rwx go back first, as dispose's.
  test('a guest that took the write bit off its workspace directory (same uid as the pool) cannot keep the owner from rolling it back', async () => {
    const root = unprivilegedPool()
    const out = nodeAsNobody(
      root,
      `const pool = await vmspace.openPool(root)
      const ws = await pool.allocate()
      fs.writeFileSync(path.join(ws.path, 'a'), 'one')
      const cp = await ws.checkpoint()
      fs.writeFileSync(path.join(ws.path, 'a'), 'two')
      const out = []
      for (const mode of [0o500, 0o000]) {
        fs.chmodSync(ws.path, mode)
        const r = await ws.rollback(cp).catch((e) => e)
        fs.chmodSync(ws.path, 0o700)
        out.push([r.code ?? r.removed, fs.readFileSync(path.join(ws.path, 'a'), 'utf8')])
        fs.writeFileSync(path.join(ws.path, 'a'), 'two')
      }
      await ws.dispose()
      await pool.close()
      return out`,
    )
    expect(out).toEqual([[true, 'one'], [true, 'one']])
    expect(poolState(root)).toEqual({ visible: [], staging: [], trash: [], leases: [] })
  })
})

/**
 * Checkpoints and rollback (docs/checkpoints.md) on the scratch ext4, a loop XFS and a loop btrfs: the exact tree
 * back under the same id, path and lease; retention on checkpoint and by sweep; exclusive bytes; the lease rule;
 * rollback by id; bad arguments; and SIGKILL at the native pause points (test builds: VMSPACE_TEST_HOOKS).
 */
import './native-hooks.js'
import { spawn } from 'node:child_process'
import { createHash, randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, onTestFinished, test } from 'vitest'
import { openPool, type Pool, type Workspace } from '../lib/index.js'
import { bindInto, Child, eventually, fixtures, freshDir, MiB, mounts, needs, poolState, requireMount, runCommand, snapshotTree, workspaceChild, writeRandomFile } from './helpers.js'
import { exactSnapshot, rejection, treeListing } from './layout-helpers.js'

const fileSystems = [
  { label: `ext4 scratch (${mounts.scratchFsType})`, base: mounts.scratch as string | null, missing: undefined as string | undefined },
  { label: 'loop XFS', base: mounts.xfs, missing: mounts.missing.xfs },
  { label: 'loop btrfs', base: mounts.btrfs, missing: mounts.missing.btrfs },
]

/** treeListing of `dir` with each regular file's sha256: the exact tree, bytes included. */
function treeState(dir: string): string[] {
  return treeListing(dir).map((line) => {
    const [rel, type] = line.split(' ')
    return type === 'f' ? `${line} ${createHash('sha256').update(fs.readFileSync(path.join(dir, rel))).digest('hex')}` : line
  })
}

/** A workspace holding a.txt, dir/b.bin (256 KiB), run.sh (0755) and link -> a.txt. */
async function filled(pool: Pool): Promise<Workspace> {
  const ws = await pool.allocate()
  fs.writeFileSync(path.join(ws.path, 'a.txt'), 'first')
  fs.mkdirSync(path.join(ws.path, 'dir'))
  writeRandomFile(path.join(ws.path, 'dir', 'b.bin'), 256 * 1024)
  fs.writeFileSync(path.join(ws.path, 'run.sh'), '#!/bin/sh\n', { mode: 0o755 })
  fs.chmodSync(path.join(ws.path, 'run.sh'), 0o755)
  fs.symlinkSync('a.txt', path.join(ws.path, 'link'))
  return ws
}

/** Writes, deletes, adds and chmods in `ws`: a tree other than the one it had. */
function change(ws: Workspace): void {
  fs.writeFileSync(path.join(ws.path, 'a.txt'), 'second, and longer')
  fs.rmSync(path.join(ws.path, 'dir', 'b.bin'))
  fs.writeFileSync(path.join(ws.path, 'dir', 'new.txt'), 'new')
  fs.chmodSync(path.join(ws.path, 'run.sh'), 0o600)
}

/** The pool's templates/ entries other than its own directories: the templates, by id. */
function templateIds(root: string): string[] {
  const dir = path.join(root, '.vmspace', 'templates')
  return fs.existsSync(dir) ? fs.readdirSync(dir).filter((n) => /^[0-9a-f]{32}$/.test(n)).sort() : []
}

/** `sleep` holding the workspace's lease through fd 3, as a VMM given ws.leaseFd does. */
function leaseChild(ws: Workspace) {
  const child = spawn('sleep', ['600'], { stdio: ['ignore', 'ignore', 'ignore', ws.leaseFd] })
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  return { child, exited }
}

for (const { label, base, missing } of fileSystems) {
  if (base !== mounts.scratch) requireMount(label, base, missing)

  describe.skipIf(base === null)(`on ${label} ${needs(label, base === null && (missing ?? 'not made'))}`, () => {
    test('rollback puts back the exact tree of the checkpoint (written, deleted, added, chmod) under the same id, path and lease; the checkpoint is unchanged', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await filled(pool)
      const before = treeState(ws.path)
      const cp = await ws.checkpoint({ meta: { step: 1 } })
      expect(cp.checkpoint).toEqual({ workspace: ws.id })
      expect(cp.meta).toEqual({ step: 1 })
      expect(cp.name).toBeNull()
      const cpTree = treeState(cp.path)
      change(ws)
      expect(treeState(ws.path)).not.toEqual(before)
      const fd = ws.leaseFd
      const { id, path: wsPath } = ws
      expect(await ws.rollback(cp)).toEqual({ checkpoint: cp.id, removed: true })
      expect(treeState(ws.path)).toEqual(before)
      expect([ws.id, ws.path, ws.status]).toEqual([id, wsPath, 'ready'])
      expect(treeState(cp.path)).toEqual(cpTree)
      // The owner's hold never dropped: no adopt takes it; the handover fd was closed and a new one works.
      expect((await rejection(pool.adopt(ws.id))).code).toBe('ERR_LEASE_HELD')
      expect(() => fs.fstatSync(fd)).toThrow()
      expect(fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)).toBe(path.join(pool.root, '.vmspace', 'leases', ws.id[0], ws.name))
      // Nothing left of the build or the old tree.
      expect(poolState(pool.root)).toEqual({ visible: [ws.name], staging: [], trash: [], leases: [`${ws.id[0]}/${ws.name}`] })
      // Rolled back again after more changes, by id this time.
      change(ws)
      expect(await ws.rollback(cp.id)).toEqual({ checkpoint: cp.id, removed: true })
      expect(treeState(ws.path)).toEqual(before)
      expect((await ws.checkpoints()).map((c) => c.id)).toEqual([cp.id])
      await ws.dispose()
    })

    test('the workspace directory keeps its mode across a rollback', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await pool.allocate({ mode: 0o750 })
      fs.writeFileSync(path.join(ws.path, 'f'), 'x')
      const cp = await ws.checkpoint()
      fs.chmodSync(ws.path, 0o711)
      await ws.rollback(cp)
      expect(fs.statSync(ws.path).mode & 0o7777).toBe(0o711)
      expect(treeState(ws.path)).toEqual(['f f 0644 ' + createHash('sha256').update('x').digest('hex')])
      await ws.dispose()
    })

    test.skipIf(!mounts.root)('a mount inside the replaced tree: the swap happens, the old tree stays in trash (removed: false) with the mount untouched, and a sweep reports it until it is unmounted', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await filled(pool)
      const before = treeState(ws.path)
      const cp = await ws.checkpoint()
      const { outside, before: outsideBefore } = bindInto(freshDir(base!), ws.path)
      expect(await ws.rollback(cp)).toEqual({ checkpoint: cp.id, removed: false })
      expect(treeState(ws.path)).toEqual(before)
      const state = poolState(pool.root)
      expect(state.trash).toHaveLength(1)
      const left = state.trash[0]
      expect(state).toEqual({ visible: [ws.name], staging: [], trash: [left], leases: [`${ws.id[0]}/${ws.name}`, `${left.charAt(left.length - 32)}/${left}`].sort() })
      expect(snapshotTree(outside)).toEqual(outsideBefore)
      const r = await pool.sweep({ graceMs: 0 })
      expect(r.failed.map((e) => [e.name, e.from, e.code])).toEqual([[left, 'trash', 'EBUSY']])
      expect(snapshotTree(outside)).toEqual(outsideBefore)
      const umount = runCommand('umount', [path.join(pool.root, '.vmspace', 'trash', left, 'mnt')])
      expect(umount.status, umount.stderr).toBe(0)
      const again = await pool.sweep({ graceMs: 0 })
      expect(again.reclaimed.map((e) => [e.name, e.from])).toEqual([[left, 'trash']])
      expect(poolState(pool.root)).toEqual({ visible: [ws.name], staging: [], trash: [], leases: [`${ws.id[0]}/${ws.name}`] })
      expect(snapshotTree(outside)).toEqual(outsideBefore)
      await ws.dispose()
    })

    test('retention on checkpoint: keepNewest keeps the newest N (the new one counts), maxAgeMs removes the older ones, never the new one', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await filled(pool)
      const other = await filled(pool)
      const theirs = await other.checkpoint()
      const c1 = await ws.checkpoint()
      const c2 = await ws.checkpoint()
      const c3 = await ws.checkpoint({ keepNewest: 2 })
      expect(c3.checkpoint).toEqual({ workspace: ws.id, keepNewest: 2 })
      expect((await ws.checkpoints()).map((c) => c.id)).toEqual([c3.id, c2.id])
      expect(templateIds(pool.root)).toEqual([theirs.id, c2.id, c3.id].sort())
      expect(templateIds(pool.root)).not.toContain(c1.id)
      await new Promise((r) => setTimeout(r, 30))
      const c4 = await ws.checkpoint({ maxAgeMs: 10 })
      expect((await ws.checkpoints()).map((c) => c.id)).toEqual([c4.id])
      // Another workspace's checkpoints are never its retention's.
      expect((await other.checkpoints()).map((c) => c.id)).toEqual([theirs.id])
      await ws.dispose()
      await other.dispose()
    })

    test('retention leaves a checkpoint being read (its template held LOCK_SH) for later; the next sweep removes it', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await filled(pool)
      const c1 = await ws.checkpoint()
      const dir = path.join(pool.root, '.vmspace', 'templates', c1.id)
      // A reader as allocate({ from }) is one: flock(LOCK_SH) on the template's directory.
      const hold = 'import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_SH)\nsys.stdin.read()'
      const reader = spawn('python3', ['-c', hold, dir], { stdio: ['pipe', 'ignore', 'inherit'] })
      const exited = new Promise<void>((resolve) => reader.once('exit', () => resolve()))
      onTestFinished(() => void reader.kill('SIGKILL'))
      await eventually(() => runCommand('flock', ['-n', '-x', dir, 'true']).status !== 0)
      const c2 = await ws.checkpoint({ keepNewest: 1 })
      expect(templateIds(pool.root)).toEqual([c1.id, c2.id].sort())
      reader.kill('SIGKILL')
      await exited
      const r = await pool.sweep()
      expect(r.reclaimed.map((e) => [e.name, e.from])).toEqual([[`template-${c1.id}`, 'template']])
      expect((await ws.checkpoints()).map((c) => c.id)).toEqual([c2.id])
      await ws.dispose()
    })

    test("sweep applies the newest checkpoint's retention, and removes every checkpoint of a disposed workspace", async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await filled(pool)
      const gone = await filled(pool)
      const c1 = await ws.checkpoint()
      const c2 = await ws.checkpoint({ maxAgeMs: 20 })
      expect((await ws.checkpoints()).map((c) => c.id)).toEqual([c2.id, c1.id])
      const g1 = await gone.checkpoint()
      const g2 = await gone.checkpoint()
      await gone.dispose()
      await new Promise((r) => setTimeout(r, 40))
      const dry = await pool.sweep({ dryRun: true })
      expect(dry.reclaimed.map((e) => e.name).sort()).toEqual([c1.id, g1.id, g2.id].map((id) => `template-${id}`).sort())
      expect(templateIds(pool.root)).toEqual([c1.id, c2.id, g1.id, g2.id].sort())
      const r = await pool.sweep()
      expect(r.failed).toEqual([])
      expect(r.reclaimed.map((e) => [e.name, e.from]).sort()).toEqual([c1.id, g1.id, g2.id].map((id) => [`template-${id}`, 'template']).sort())
      expect(templateIds(pool.root)).toEqual([c2.id])
      expect((await ws.checkpoints()).map((c) => c.id)).toEqual([c2.id])
      await ws.dispose()
    })

    test('rollback while a live child holds the lease: ERR_LEASE_HELD, nothing changed; after it exits the rollback works', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await filled(pool)
      const before = treeState(ws.path)
      const cp = await ws.checkpoint()
      change(ws)
      const { child, exited } = leaseChild(ws)
      const pool0 = exactSnapshot(pool.root)
      const e = await rejection(ws.rollback(cp))
      expect(e.code).toBe('ERR_LEASE_HELD')
      expect(exactSnapshot(pool.root)).toEqual(pool0)
      expect((await rejection(pool.rollback(ws.id, cp.id))).code).toBe('ERR_LEASE_HELD')
      expect(exactSnapshot(pool.root)).toEqual(pool0)
      child.kill('SIGKILL')
      await exited
      expect(await ws.rollback(cp)).toEqual({ checkpoint: cp.id, removed: true })
      expect(treeState(ws.path)).toEqual(before)
      await ws.dispose()
    })

    test('pool.rollback by id of a workspace whose owner died: the lease taken for the call and free after it', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const child = workspaceChild(pool.root)
      await child.expect('ready')
      child.send('allocate')
      const made = await child.expect('allocated')
      const id = made.id as string
      const cp = await pool.checkpoint(id)
      expect(cp.checkpoint).toEqual({ workspace: id })
      // The owner is alive: its lease is held.
      expect((await rejection(pool.rollback(id, cp))).code).toBe('ERR_LEASE_HELD')
      child.send('exit')
      await child.exited
      const own = path.join(made.path as string, 'own.txt')
      fs.writeFileSync(own, 'changed')
      fs.writeFileSync(path.join(made.path as string, 'more.txt'), 'more')
      expect(await pool.rollback(id, cp.id)).toEqual({ checkpoint: cp.id, removed: true })
      expect(fs.readdirSync(made.path as string)).toEqual(['own.txt'])
      expect(fs.readFileSync(own, 'utf8')).toBe(made.content)
      const ws = await pool.adopt(id) // free again
      expect((await pool.checkpoints(id)).map((c) => c.id)).toEqual([cp.id])
      await ws.dispose()
    })

    test('bad arguments change nothing: strict options, another workspace\'s checkpoint, a template that is not a checkpoint, an unknown id', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await filled(pool)
      const other = await filled(pool)
      const cp = await ws.checkpoint()
      const theirs = await other.checkpoint()
      const plain = await pool.commit(ws)
      change(ws)
      const fd = ws.leaseFd
      const pool0 = exactSnapshot(pool.root)
      const cases: [() => Promise<unknown>, string][] = [
        [() => ws.rollback(cp, { force: true } as never), 'ERR_INVALID_ARG_VALUE'],
        [() => ws.rollback(theirs), 'ERR_INVALID_ARG_VALUE'],
        [() => ws.rollback(plain.id), 'ERR_INVALID_ARG_VALUE'],
        [() => ws.rollback('0'.repeat(32)), 'ERR_TEMPLATE_NOT_FOUND'],
        [() => ws.rollback('not an id'), 'ERR_INVALID_ARG_VALUE'],
        [() => ws.rollback(42 as never), 'ERR_INVALID_ARG_TYPE'],
        [() => pool.rollback(other.id, cp), 'ERR_INVALID_ARG_VALUE'],
        [() => pool.rollback('f'.repeat(32), cp), 'ERR_INVALID_ARG_VALUE'],
        [() => ws.checkpoint({ name: 'x' } as never), 'ERR_INVALID_ARG_VALUE'],
        [() => ws.checkpoint({ keepNewest: 0 }), 'ERR_INVALID_ARG_VALUE'],
        [() => ws.checkpoint({ maxAgeMs: 1.5 }), 'ERR_INVALID_ARG_VALUE'],
        [() => ws.checkpoint({ keepNewest: '2' as never }), 'ERR_INVALID_ARG_TYPE'],
        [() => pool.checkpoint('nope'), 'ERR_INVALID_ARG_VALUE'],
      ]
      for (const [p, code] of cases) await expect(p()).rejects.toMatchObject({ code })
      expect(exactSnapshot(pool.root)).toEqual(pool0)
      expect(ws.leaseFd).toBe(fd)
      await ws.dispose()
      await other.dispose()
    })

    test('an aborted signal rejects with an AbortError before anything is built; the tree is unchanged', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await filled(pool)
      const cp = await ws.checkpoint()
      change(ws)
      const before = exactSnapshot(pool.root)
      await expect(ws.rollback(cp, { signal: AbortSignal.abort() })).rejects.toMatchObject({ name: 'AbortError' })
      await expect(pool.rollback(ws.id, cp, { signal: AbortSignal.abort() })).rejects.toMatchObject({ name: 'AbortError' })
      expect(exactSnapshot(pool.root)).toEqual(before)
      await ws.dispose()
    })

    test('a checkpoint is a template: allocate({ from }) clones it, removeTemplate removes it', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await filled(pool)
      const before = treeState(ws.path)
      const cp = await ws.checkpoint()
      const child = await pool.allocate({ from: cp.id })
      expect(treeState(child.path)).toEqual(before)
      expect((await pool.templates()).find((t) => t.id === cp.id)?.checkpoint).toEqual({ workspace: ws.id })
      await pool.removeTemplate(cp.id)
      expect(await ws.checkpoints()).toEqual([])
      expect((await rejection(ws.rollback(cp))).code).toBe('ERR_TEMPLATE_NOT_FOUND')
      await child.dispose()
      await ws.dispose()
    })

    for (const { phase, holds } of [
      { phase: 'rollback:before-exchange', holds: 'old' },
      { phase: 'rollback:after-exchange', holds: 'new' },
      { phase: 'remove:after-unlink', holds: 'new' },
    ])
      test(`SIGKILL during rollback at ${phase}: the name holds the ${holds} tree whole, and one sweep leaves nothing else`, async () => {
        const pool = await openPool(path.join(freshDir(base!), 'pool'))
        const made = await killedAt(pool.root, 'rollback', phase)
        const oldTree = ['a.txt f 0644', 'dir d 0755', 'keep.txt f 0600', 'new.txt f 0644']
        const newTree = ['a.txt f 0644', 'dir d 0755', 'dir/b.bin f 0644', 'keep.txt f 0644']
        expect(treeListing(made.path)).toEqual(holds === 'old' ? oldTree : newTree)
        expect(fs.readFileSync(path.join(made.path, 'a.txt'), 'utf8')).toBe(holds === 'old' ? 'second, longer' : 'first')
        const ws = await pool.adopt(made.id)
        const r = await pool.sweep({ graceMs: 0 })
        expect(r.failed).toEqual([])
        expect(poolState(pool.root)).toEqual({ visible: [made.name], staging: [], trash: [], leases: [`${made.id[0]}/${made.name}`] })
        expect(fs.readdirSync(path.join(pool.root, '.vmspace', 'templates', 'staging'))).toEqual([])
        expect(templateIds(pool.root)).toEqual([made.checkpoint])
        expect(treeListing(made.path)).toEqual(holds === 'old' ? oldTree : newTree)
        await ws.dispose()
        await pool.close()
      })

    test('SIGKILL during checkpoint before its publish: the workspace is untouched, no checkpoint is listed, one sweep leaves nothing else', async () => {
      const pool = await openPool(path.join(freshDir(base!), 'pool'))
      const made = await killedAt(pool.root, 'checkpoint', 'commit:before-publish')
      expect(treeListing(made.path)).toEqual(['a.txt f 0644', 'dir d 0755', 'dir/b.bin f 0644', 'keep.txt f 0644'])
      const ws = await pool.adopt(made.id)
      expect(await ws.checkpoints()).toEqual([])
      expect(fs.readdirSync(path.join(pool.root, '.vmspace', 'templates', 'staging'))).toHaveLength(1)
      const r = await pool.sweep({ graceMs: 0 })
      expect(r.failed).toEqual([])
      expect(r.reclaimed.map((e) => e.from)).toEqual(['template-staging'])
      expect(poolState(pool.root)).toEqual({ visible: [made.name], staging: [], trash: [], leases: [`${made.id[0]}/${made.name}`] })
      expect(fs.readdirSync(path.join(pool.root, '.vmspace', 'templates', 'staging'))).toEqual([])
      expect(templateIds(pool.root)).toEqual([])
      await ws.dispose()
      await pool.close()
    })
  })
}

/** Runs test/fixtures/checkpoint-child.cjs to the pause point `phase` of `op`, SIGKILLs it there; what it made. */
async function killedAt(root: string, op: string, phase: string): Promise<{ id: string; name: string; path: string; checkpoint: string | null }> {
  const child = new Child(path.join(fixtures, 'checkpoint-child.cjs'), [root, op, phase])
  const made = (await child.expect('ready')) as unknown as { id: string; name: string; path: string; checkpoint: string | null }
  while (!child.stderr.includes(`vmspace-test-pause ${phase}\n`)) {
    if (child.proc.exitCode !== null) throw new Error(`child exited before ${phase}: ${child.stderr}`)
    await new Promise((r) => setTimeout(r, 10))
  }
  child.proc.kill('SIGKILL')
  await child.exited
  return made
}

for (const { label, base, missing } of fileSystems.slice(1))
  describe.skipIf(base === null)(`exclusive bytes on ${label} ${needs(label, base === null && missing)}`, () => {
    test('a checkpoint shares every extent with the workspace (0 exclusive bytes); a 1 MiB file rewritten after it makes its 1 MiB exclusive', async () => {
      await using pool = await openPool(path.join(freshDir(base!), 'pool'))
      const ws = await pool.allocate()
      writeRandomFile(path.join(ws.path, 'disk.img'), MiB)
      const cp = await ws.checkpoint()
      expect(cp.exclusiveBytes).toBe(0)
      const fd = fs.openSync(path.join(ws.path, 'disk.img'), 'w')
      fs.writeSync(fd, randomBytes(MiB))
      fs.fsyncSync(fd) // btrfs: the old extents' references are dropped by the time FIEMAP asks
      fs.closeSync(fd)
      expect((await ws.checkpoints()).map((c) => [c.id, c.exclusiveBytes])).toEqual([[cp.id, MiB]])
      await ws.dispose()
    })
  })

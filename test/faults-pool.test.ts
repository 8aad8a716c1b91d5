/**
 * Faults of the pool: openPool refuses a pool that another user could write (ERR_POOL_UNSAFE,
 * nothing made) unless a shared group is named, and makes its directories with exact modes whatever the umask;
 * a sweep reports each entry's failure in that entry and goes on, and reports only real failures (an entry a
 * concurrent dispose or allocate finished is none).
 */
// First: the test build of the addon, with its seams, for this whole process.
import { testHooks as native } from './native-hooks.js'
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterEach, describe, expect, test } from 'vitest'
import { openPool, VmspaceError, type Pool, type Workspace } from '../lib/index.js'
import {
  bindInto,
  Child,
  emptyPoolState,
  fixtures,
  freshDir,
  leasePath,
  loopChild,
  mounts,
  needs,
  orphan,
  poolState,
  repoRoot,
  snapshotTree,
  stressRounds,
  tryLease,
  unprivilegedChildren,
} from './helpers.js'

const NOBODY = 65534

const stagingShards = Array.from({ length: 8 }, (_, i) => `.vmspace/staging/s${i}`)
const leaseShards = Array.from({ length: 16 }, (_, i) => `.vmspace/leases/${i.toString(16)}`)
/** The pool's own directories, relative to its root ('' is the root). */
const poolDirs = ['', '.vmspace', '.vmspace/staging', ...stagingShards, '.vmspace/trash', '.vmspace/leases', ...leaseShards, '.vmspace/cache']

/** The lease file of workspace `name` as poolState() lists it ("<shard>/<name>"). */
function leaseEntry(root: string, name: string): string {
  return path.relative(path.join(root, '.vmspace', 'leases'), leasePath(root, name))
}

/**
 * An orphan (orphan() in helpers.ts) whose directory a killed process left in `where` with its lease file, free:
 * in trash (a dispose or sweep that died after moving it there) or in a staging shard (a build that died before
 * it published).
 */
async function interrupted(pool: Pool, where: 'trash' | `staging/s${number}`): Promise<Workspace> {
  const ws = await orphan(pool)
  fs.renameSync(ws.path, path.join(pool.root, '.vmspace', where, ws.name))
  return ws
}

/** A made pool at `<fresh>/pool`, closed again. */
async function madePool(): Promise<string> {
  const pool = await openPool(path.join(freshDir(), 'pool'))
  await pool.close()
  return pool.root
}

/** openPool's rejection, asserted to be ERR_POOL_UNSAFE naming `entry` with its owner and mode. */
async function expectUnsafe(root: string, entry: string, options?: object) {
  const st = fs.lstatSync(entry)
  const err = await openPool(root, options).catch((e: unknown) => e)
  expect(err).toBeInstanceOf(VmspaceError)
  expect(err).toMatchObject({ code: 'ERR_POOL_UNSAFE', path: entry, uid: st.uid, gid: st.gid, mode: st.mode & 0o7777 })
  const message = (err as Error).message
  expect(message).toContain(`'${entry}'`)
  expect(message).toContain(`uid ${st.uid}`)
  expect(message).toContain(`mode 0${(st.mode & 0o7777).toString(8)}`)
  return err as VmspaceError
}

describe.skipIf(!mounts.root)(`openPool refuses a pool another user could write ${needs('root for chown', !mounts.root && 'not root')}`, () => {
  test('a root owned by uid 65534 with mode 0777: ERR_POOL_UNSAFE naming it, nothing made inside', async () => {
    const root = path.join(freshDir(), 'pool')
    fs.mkdirSync(root)
    fs.chownSync(root, NOBODY, NOBODY)
    fs.chmodSync(root, 0o777)
    await expectUnsafe(root, root)
    expect(fs.readdirSync(root)).toEqual([])
  })

  test('a root owned by uid 65534 with mode 0755 (only its owner writes it, and that is another user): refused', async () => {
    const root = path.join(freshDir(), 'pool')
    fs.mkdirSync(root, { mode: 0o755 })
    fs.chownSync(root, NOBODY, NOBODY)
    const err = await expectUnsafe(root, root)
    expect(err.message).toContain('owned by another user')
    expect(fs.readdirSync(root)).toEqual([])
  })

  // Every directory of the pool's own, each shard included: the open checks each before using it.
  for (const sub of poolDirs.slice(1)) {
    for (const how of ['mode 0777', 'owned by uid 65534'] as const) {
      test(`${sub} ${how}: ERR_POOL_UNSAFE naming it, the pool left unchanged`, async () => {
        const root = await madePool()
        const entry = path.join(root, sub)
        if (how === 'mode 0777') fs.chmodSync(entry, 0o777)
        else fs.chownSync(entry, NOBODY, NOBODY)
        const before = snapshotTree(root)
        await expectUnsafe(root, entry)
        expect(snapshotTree(root)).toEqual(before)
      })
    }
  }

  test('a missing subdirectory is not made when an existing one is unsafe (nor once it is safe: ERR_POOL_FORMAT)', async () => {
    const root = await madePool()
    fs.rmSync(path.join(root, '.vmspace', 'leases'), { recursive: true })
    fs.chmodSync(path.join(root, '.vmspace', 'trash'), 0o777)
    await expectUnsafe(root, path.join(root, '.vmspace', 'trash'))
    expect(fs.readdirSync(path.join(root, '.vmspace')).sort()).toEqual(['cache', 'staging', 'trash', 'version'])
    // A pool that lost a directory of its own is never initialised again.
    fs.chmodSync(path.join(root, '.vmspace', 'trash'), 0o700)
    await expect(openPool(root)).rejects.toMatchObject({ code: 'ERR_POOL_FORMAT', path: path.join(root, '.vmspace', 'leases') })
    expect(fs.readdirSync(path.join(root, '.vmspace')).sort()).toEqual(['cache', 'staging', 'trash', 'version'])
  })

  test('a directory above the root writable by others (not sticky): refused, the missing root is not made', async () => {
    const above = path.join(freshDir(), 'open')
    fs.mkdirSync(above)
    fs.chmodSync(above, 0o777)
    const root = path.join(above, 'a', 'pool')
    await expectUnsafe(root, above)
    expect(fs.readdirSync(above)).toEqual([])
  })

  test('a sticky directory above the root writable by all (as /tmp) is accepted', async () => {
    const above = path.join(freshDir(), 'sticky')
    fs.mkdirSync(above)
    fs.chmodSync(above, 0o1777)
    const pool = await openPool(path.join(above, 'pool'))
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test('the root itself sticky and writable by all is refused: a pool directory has no sticky exception', async () => {
    const root = path.join(freshDir(), 'pool')
    fs.mkdirSync(root)
    fs.chmodSync(root, 0o1777)
    await expectUnsafe(root, root)
  })

  test('a directory above the root owned by another user: refused (that user could swap what lies below)', async () => {
    const above = path.join(freshDir(), 'home')
    fs.mkdirSync(above, { mode: 0o755 })
    const root = await openPool(path.join(above, 'pool')).then(async (p) => (await p.close(), p.root))
    fs.chownSync(above, NOBODY, NOBODY)
    await expectUnsafe(root, above)
  })

  test('a root reached through a symlink owned by another user is refused; the same symlink owned by root opens the pool', async () => {
    const dir = freshDir()
    const real = await madePool()
    const link = path.join(dir, 'link')
    fs.symlinkSync(real, link)
    fs.lchownSync(link, NOBODY, NOBODY)
    const err = await expectUnsafe(link, link)
    expect(err.message).toContain('a symlink owned by another user')
    fs.lchownSync(link, 0, 0)
    const pool = await openPool(link, { create: false })
    const ws = await pool.allocate()
    expect(fs.existsSync(path.join(real, ws.name))).toBe(true)
    await ws.dispose()
    await pool.close()
  })

  test('a symlink owned by another user in the middle of the path is refused; nothing is made at its target', async () => {
    const dir = freshDir()
    const target = path.join(dir, 'target')
    fs.mkdirSync(target, { mode: 0o755 })
    const link = path.join(dir, 'via')
    fs.symlinkSync(target, link)
    fs.lchownSync(link, NOBODY, NOBODY)
    await expectUnsafe(path.join(link, 'pool'), link)
    expect(fs.readdirSync(target)).toEqual([])
  })

  test('a root that is a dangling symlink is ENOENT and its target is not made (as mkdir -p); through a symlink to an existing directory, the missing pool directory is made', async () => {
    const dir = freshDir()
    const link = path.join(dir, 'root')
    fs.symlinkSync(path.join(dir, 'target'), link)
    await expect(openPool(link)).rejects.toMatchObject({ code: 'ENOENT', syscall: 'open', path: link })
    await expect(openPool(path.join(link, 'pool'))).rejects.toMatchObject({ code: 'ENOENT' })
    expect(fs.readdirSync(dir)).toEqual(['root'])
    fs.mkdirSync(path.join(dir, 'target'), { mode: 0o755 })
    const pool = await openPool(path.join(link, 'pool'))
    expect(fs.readdirSync(path.join(dir, 'target', 'pool')).sort()).toEqual(['.vmspace'])
    await pool.close()
  })

  describe('sharedGroup', () => {
    test('a group-writable root is refused without it, accepted with its gid, refused with another gid', async () => {
      const root = await madePool()
      fs.chownSync(root, 0, 1234)
      fs.chmodSync(root, 0o770)
      await expectUnsafe(root, root)
      await expectUnsafe(root, root, { sharedGroup: 4321 })
      const pool = await openPool(root, { sharedGroup: 1234 })
      const ws = await pool.allocate()
      await ws.dispose()
      await pool.close()
    })

    test('a pool owned by another user of the shared group, group-writable, is accepted', async () => {
      const root = await madePool()
      for (const d of poolDirs) {
        fs.chownSync(path.join(root, d), NOBODY, 1234)
        fs.chmodSync(path.join(root, d), 0o2770)
      }
      await expectUnsafe(root, root)
      const pool = await openPool(root, { sharedGroup: 1234 })
      const ws = await pool.allocate()
      await ws.dispose()
      await pool.close()
      expect(poolState(root)).toEqual(emptyPoolState)
    })

    test('writable by others stays refused with it', async () => {
      const root = await madePool()
      fs.chownSync(root, 0, 1234)
      fs.chmodSync(root, 0o777)
      await expectUnsafe(root, root, { sharedGroup: 1234 })
    })

    test('the directories it makes get the group and mode 02770', async () => {
      const root = path.join(freshDir(), 'pool')
      const pool = await openPool(root, { sharedGroup: 1234 })
      for (const d of poolDirs) expect(fs.statSync(path.join(root, d)), d).toMatchObject({ gid: 1234, mode: 0o42770 })
      await pool.close()
    })
  })
})

describe('openPool options', () => {
  test('sharedGroup must be a gid: a string is ERR_INVALID_ARG_TYPE, -1 or 1.5 ERR_INVALID_ARG_VALUE, nothing made', async () => {
    const root = path.join(freshDir(), 'pool')
    await expect(openPool(root, { sharedGroup: '1234' as unknown as number })).rejects.toMatchObject({
      name: 'TypeError',
      code: 'ERR_INVALID_ARG_TYPE',
    })
    for (const bad of [-1, 1.5, 2 ** 32])
      await expect(openPool(root, { sharedGroup: bad })).rejects.toMatchObject({ name: 'RangeError', code: 'ERR_INVALID_ARG_VALUE' })
    expect(fs.existsSync(root)).toBe(false)
  })
})

describe('openPool makes its directories with exact modes, whatever the umask', () => {
  /** Opens a pool at `root` in a child process with umask `umask`, then allocates and disposes a workspace. */
  function openInChild(root: string, umask: number) {
    const script = `
      process.umask(${umask})
      const v = require(${JSON.stringify(path.join(repoRoot, 'dist', 'index.js'))})
      v.openPool(${JSON.stringify(root)}).then(async (p) => { const w = await p.allocate(); await w.dispose(); await p.close() })
        .catch((e) => { console.error(e.code, e.message); process.exit(1) })`
    const r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8' })
    expect(r.stderr).toBe('')
    expect(r.status).toBe(0)
  }

  for (const umask of [0o777, 0o000]) {
    test(`umask 0${umask.toString(8)}: parents and root 0755, .vmspace/ 0755, staging/trash/leases and their shards 0700, version 0644; the pool opens again`, async () => {
      const base = freshDir()
      const root = path.join(base, 'a', 'b', 'pool')
      openInChild(root, umask)
      const dirs = ['a', 'a/b', ...poolDirs.map((d) => path.join('a/b/pool', d))]
      const modes = Object.fromEntries(dirs.map((d) => [d, (fs.statSync(path.join(base, d)).mode & 0o7777).toString(8)]))
      expect(modes).toEqual({
        a: '755',
        'a/b': '755',
        'a/b/pool': '755',
        'a/b/pool/.vmspace': '755',
        ...Object.fromEntries(poolDirs.slice(2).map((d) => [`a/b/pool/${d}`, '700'])),
      })
      // The version file too: under umask 0777 it would otherwise be mode 000.
      expect((fs.statSync(path.join(root, '.vmspace', 'version')).mode & 0o7777).toString(8)).toBe('644')
      const pool = await openPool(root, { create: false })
      expect(poolState(pool.root)).toEqual(emptyPoolState)
      await pool.close()
    })
  }
})

describe('sweep reports real failures only, each in its entry', () => {
  const iterations = stressRounds(3000, 100)
  test(`sweeps racing allocate/dispose in two other processes (${iterations} iterations each): failed stays empty`, async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const churners = [0, 1].map(() => new Child(path.join(fixtures, 'churn-child.cjs'), [pool.root, String(iterations)]))
    for (const c of churners) await c.expect('ready')
    const sweeper = loopChild(pool.root, 'sweep') // another process, default grace period
    await sweeper.expect('ready')
    let done = 0
    const finished = Promise.all(churners.map((c) => c.expect('done').finally(() => done++)))
    const failed: unknown[] = []
    const reclaimed = new Set<string>()
    while (done < churners.length) {
      // The default grace period: with graceMs 0 a sweep may take a build's staging entry before its lease, and
      // an allocate that loses 16 of them fails (documented in SweepOptions.graceMs).
      const r = await pool.sweep()
      failed.push(...r.failed.map((e) => ({ name: e.name, from: e.from, code: e.code, message: e.error.message })))
      for (const e of r.reclaimed) reclaimed.add(e.name)
    }
    const results = await finished
    sweeper.send('stop')
    const stopped = await sweeper.expect('stopped')
    expect(results).toEqual([
      { event: 'done', allocated: iterations, released: Math.floor(iterations / 8) },
      { event: 'done', allocated: iterations, released: Math.floor(iterations / 8) },
    ])
    expect(failed).toEqual([])
    expect(stopped.failed).toEqual([])
    // What is left is reclaimed by one more sweep, without failures; then the pool is empty.
    const last = await pool.sweep({ graceMs: 0 })
    expect(last.failed).toEqual([])
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    await pool.close()
  }, 600_000)  // a hang guard only: 6000 allocates (in full) on a loaded 2-core machine can pass the default 60 s

  describe.skipIf(!mounts.root)(`one entry's failure ${needs('root for mount --bind', !mounts.root && 'not root')}`, () => {
    test('an orphan whose removal fails (EBUSY, a bind mount inside) is in failed; the other orphans are reclaimed by the same sweep', async () => {
      const dir = freshDir()
      const pool = await openPool(path.join(dir, 'pool'))
      const before = await Promise.all([1, 2].map(() => orphan(pool)))
      const stuck = await orphan(pool)
      const after = await Promise.all([3, 4].map(() => orphan(pool)))
      const { outside, before: outsideBefore } = bindInto(dir, stuck.path)
      // A dead build in staging and a leftover in trash, each with its lease file: the passes after the failing one
      // still run.
      const dead = await interrupted(pool, 'staging/s5')
      const left = await interrupted(pool, 'trash')
      fs.mkdirSync(path.join(pool.root, '.vmspace', 'trash', left.name, 'x'))

      const report = await pool.sweep({ graceMs: 0 })
      expect(report.failed.map((e) => `${e.name} ${e.from} ${e.code} ${e.error.syscall}`)).toEqual([
        `${stuck.name} published EBUSY rmdir`,
      ])
      expect(report.failed[0].error).toBeInstanceOf(VmspaceError)
      expect(report.reclaimed.map((e) => `${e.from} ${e.name}`).sort()).toEqual(
        [
          ...[...before, ...after].map((w) => `published ${w.name}`),
          `staging ${dead.name}`,
          `trash ${left.name}`,
        ].sort(),
      )
      expect(report).toMatchObject({ live: 0, leasesRemoved: 0, foreign: [] })
      // The stuck one stays in trash with its lease file, for a later sweep.
      expect(poolState(pool.root)).toEqual({ ...emptyPoolState, trash: [stuck.name], leases: [leaseEntry(pool.root, stuck.name)] })
      expect(snapshotTree(outside)).toEqual(outsideBefore)
    })
  })
})

// Faults no real file system gives on demand come from the native test seam setSweepFaultsForTest: the next sweep
// entry of a name fails as if handling it threw std::bad_alloc, or as if its lease probe failed with an errno at one
// of its two calls (flock, or fcntl F_OFD_GETLK: the default).
describe('sweep: one entry fault stays in that entry', () => {
  afterEach(() => native.setSweepFaultsForTest([]))
  const ENOLCK = 37

  test('std::bad_alloc while handling one orphan: that entry is failed with ENOMEM, untouched; the others are reclaimed; the next sweep reclaims it', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const [a, b, c] = [await orphan(pool), await orphan(pool), await orphan(pool)]
    native.setSweepFaultsForTest([[b.name, 0]])
    const report = await pool.sweep()
    expect(report.failed.map((e) => `${e.name} ${e.from} ${e.code} ${e.error.syscall} ${e.error.errno}`)).toEqual([
      `${b.name} published ENOMEM malloc -12`,
    ])
    expect(report.failed[0].error).toMatchObject({ path: b.path })
    expect(report.reclaimed.map((e) => e.name).sort()).toEqual([a.name, c.name].sort())
    expect(fs.readFileSync(path.join(b.path, 'own.txt'), 'utf8')).toBe(b.id)
    const again = await pool.sweep()
    expect(again).toMatchObject({ failed: [], reclaimed: [expect.objectContaining({ name: b.name, from: 'published' })] })
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })

  test('std::bad_alloc while handling a trash entry: failed with ENOMEM from trash, untouched; the other trash entry reclaimed; the next sweep reclaims it', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const trash = path.join(pool.root, '.vmspace', 'trash')
    // Two workspaces whose dispose died after moving them into trash (their lease files left, free).
    const [x, y] = [await interrupted(pool, 'trash'), await interrupted(pool, 'trash')]
    for (const w of [x, y]) fs.mkdirSync(path.join(trash, w.name, 'sub'))
    native.setSweepFaultsForTest([[x.name, 0]])
    const report = await pool.sweep()
    expect(report.failed.map((e) => `${e.name} ${e.from} ${e.code} ${e.error.syscall} ${e.error.errno}`)).toEqual([
      `${x.name} trash ENOMEM malloc -12`,
    ])
    expect(report.failed[0].error).toMatchObject({ path: path.join(trash, x.name) })
    expect(report.reclaimed.map((e) => `${e.name} ${e.from}`)).toEqual([`${y.name} trash`])
    expect(report).toMatchObject({ live: 0, leasesRemoved: 0, foreign: [] })
    expect(poolState(pool.root)).toEqual({ ...emptyPoolState, trash: [x.name], leases: [leaseEntry(pool.root, x.name)] })
    expect(fs.readFileSync(path.join(trash, x.name, 'own.txt'), 'utf8')).toBe(x.id)
    const again = await pool.sweep()
    expect(again).toMatchObject({ failed: [], leasesRemoved: 0, reclaimed: [expect.objectContaining({ name: x.name, from: 'trash' })] })
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test('list(): a lease probe that cannot decide (ENOLCK) is that entry\'s error, counted live; the other entries are listed as ever', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const dead = await orphan(pool)
    const held = await pool.allocate({ meta: { k: 1 } })
    native.setSweepFaultsForTest([[dead.name, ENOLCK]])
    const infos = await pool.list()
    const byName = new Map(infos.map((i) => [i.name, i]))
    expect(infos).toHaveLength(2)
    expect(byName.get(dead.name)).toMatchObject({
      live: true,
      error: { code: 'ENOLCK', syscall: 'fcntl(F_OFD_GETLK)', path: leasePath(pool.root, dead.name) },
    })
    expect(byName.get(held.name)).toMatchObject({ live: true, meta: { k: 1 } })
    expect(byName.get(held.name)?.error).toBeUndefined()
    // The fault applied once: the next listing sees the orphan as free again.
    expect((await pool.list()).find((i) => i.name === dead.name)).toMatchObject({ live: false })
    await held.dispose()
    await pool.close()
  })

  test('a lease probe that cannot decide (F_OFD_GETLK fails with ENOLCK) is reported failed with syscall fcntl(F_OFD_GETLK), neither live nor touched', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const dead = await orphan(pool)
    const other = await orphan(pool)
    const held = await pool.allocate()
    native.setSweepFaultsForTest([
      [dead.name, ENOLCK],
      [held.name, ENOLCK],
    ])
    const report = await pool.sweep()
    expect(report.failed.map((e) => `${e.name} ${e.from} ${e.code} ${e.error.syscall}`).sort()).toEqual(
      [`${dead.name} published ENOLCK fcntl(F_OFD_GETLK)`, `${held.name} published ENOLCK fcntl(F_OFD_GETLK)`].sort(),
    )
    for (const e of report.failed) expect(e.error).toMatchObject({ path: leasePath(pool.root, e.name) })
    expect(report.live).toBe(0)
    expect(report.reclaimed.map((e) => e.name)).toEqual([other.name])
    expect(fs.readFileSync(path.join(dead.path, 'own.txt'), 'utf8')).toBe(dead.id)
    expect(tryLease(pool.root, dead.name)).toBe(0) // left free, not taken
    expect(tryLease(pool.root, held.name)).toBe(99) // the lease is still its owner's
    expect(await pool.sweep()).toMatchObject({ failed: [], live: 1, reclaimed: [expect.objectContaining({ name: dead.name })] })
    await held.dispose()
  })
})

describe('sweep: each workspace is reported once, at the call that failed', () => {
  afterEach(() => native.setSweepFaultsForTest([]))
  const ENOLCK = 37

  test('a lease probe that fails in every pass that meets it is one entry of failed (from published), not one per pass', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const dead = await orphan(pool)
    // As a file system whose locks keep failing: the published pass's probe, and the lease pass's after it.
    native.setSweepFaultsForTest([
      [dead.name, ENOLCK],
      [dead.name, ENOLCK],
    ])
    const report = await pool.sweep()
    expect(report.failed.map((e) => `${e.name} ${e.from} ${e.code} ${e.error.syscall}`)).toEqual([
      `${dead.name} published ENOLCK fcntl(F_OFD_GETLK)`,
    ])
    expect(report).toMatchObject({ reclaimed: [], live: 0, leasesRemoved: 0, foreign: [] })
    expect(fs.readFileSync(path.join(dead.path, 'own.txt'), 'utf8')).toBe(dead.id)
  })

  test('a flock that fails in the sweep\'s probe is reported with syscall flock, the lease left untaken', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const dead = await orphan(pool)
    native.setSweepFaultsForTest([[dead.name, ENOLCK, 'flock']])
    const report = await pool.sweep()
    expect(report.failed.map((e) => `${e.name} ${e.from} ${e.code} ${e.error.syscall}`)).toEqual([`${dead.name} published ENOLCK flock`])
    expect(report.failed[0].error).toMatchObject({ errno: -ENOLCK, path: leasePath(pool.root, dead.name) })
    expect(tryLease(pool.root, dead.name)).toBe(0)
    expect(await pool.sweep()).toMatchObject({ failed: [], reclaimed: [expect.objectContaining({ name: dead.name })] })
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })
})

describe.skipIf(!unprivilegedChildren)(`list() never hides a workspace whose lease it cannot open ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`, () => {
  test('a workspace whose lease file the caller cannot open (EACCES) is listed with that error and counted live; the others as ever', async () => {
    const dir = freshDir()
    fs.chmodSync(dir, 0o755)
    const pool = await openPool(path.join(dir, 'pool'))
    const hidden = await orphan(pool, { k: 'hidden' })
    const shown = await orphan(pool, { k: 'shown' })
    await pool.close()
    // Every directory of the pool readable by nobody; the lease files as root makes them (0400, uid 4294967294),
    // but the one of `shown`, made readable: only the open of the lease file of `hidden` fails. (The workspace
    // directories stay 0700, root's: list() does not open them.)
    for (const d of poolDirs) fs.chmodSync(path.join(pool.root, d), 0o755)
    expect(fs.statSync(leasePath(pool.root, hidden.name))).toMatchObject({ uid: 4294967294, mode: 0o100400 })
    fs.chmodSync(leasePath(pool.root, shown.name), 0o444)
    const script = `
      const { vmspace, say } = require(${JSON.stringify(path.join(fixtures, 'unprivileged.cjs'))})
      vmspace.openPool(process.argv[1], { create: false }).then(async (p) => {
        const list = await p.list()
        say(list.map((i) => ({ name: i.name, live: i.live, meta: i.meta, code: i.error?.code, syscall: i.error?.syscall, path: i.error?.path }))
          .sort((a, b) => (a.name < b.name ? -1 : 1)))
        await p.close()
      }, (e) => say({ error: e.code }))
    `
    const r = spawnSync(process.execPath, ['-e', script, pool.root], { encoding: 'utf8' })
    expect(r.status, r.stderr).toBe(0)
    expect(JSON.parse(r.stdout)).toEqual(
      [
        { name: hidden.name, live: true, code: 'EACCES', syscall: 'open', path: leasePath(pool.root, hidden.name) },
        { name: shown.name, live: false, meta: { k: 'shown' } },
      ].sort((a, b) => (a.name < b.name ? -1 : 1)),
    )
  })
})

describe.skipIf(!unprivilegedChildren)(`a workspace whose owner write bit a guest cleared ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`, () => {
  test('as uid 65534: dispose and sweep give the bit back and remove it; allocate({ mode: 0o555 }) is ERR_INVALID_ARG_VALUE', async () => {
    const dir = freshDir()
    fs.chmodSync(dir, 0o755)
    fs.chownSync(dir, NOBODY, NOBODY)
    const root = path.join(dir, 'pool')
    const script = `
      const fs = require('node:fs')
      const { vmspace, say } = require(${JSON.stringify(path.join(fixtures, 'unprivileged.cjs'))})
      ;(async () => {
        const p = await vmspace.openPool(process.argv[1])
        const a = await p.allocate()
        fs.writeFileSync(a.path + '/x', 'x')
        fs.chmodSync(a.path, 0o500)
        await a.dispose()
        const b = await p.allocate()
        fs.writeFileSync(b.path + '/x', 'x')
        fs.chmodSync(b.path, 0o500)
        await b.release({ force: true })
        const swept = await p.sweep()
        const mode = await p.allocate({ mode: 0o555 }).then(() => 'allocated', (e) => e.code)
        await p.close() // its spare lease files go
        // The root, then the entries of staging/s0..s7, trash/ and leases/0..f.
        const shards = (d) => fs.readdirSync(d).flatMap((s) => fs.readdirSync(d + '/' + s).map((n) => s + '/' + n))
        const state = p.root + '/.vmspace/'
        const left = [fs.readdirSync(p.root), shards(state + 'staging'), fs.readdirSync(state + 'trash'), shards(state + 'leases')]
        say({
          status: a.status,
          reclaimed: swept.reclaimed.map((r) => r.id === b.id),
          failed: swept.failed.map((e) => ({ name: e.name, from: e.from, code: e.code, message: e.error.message })),
          live: swept.live,
          leasesRemoved: swept.leasesRemoved,
          foreign: swept.foreign,
          mode,
          left,
        })
      })().catch((e) => say({ error: e.code, message: e.message }))
    `
    const r = spawnSync(process.execPath, ['-e', script, root], { encoding: 'utf8' })
    expect(r.status, r.stderr).toBe(0)
    expect(JSON.parse(r.stdout)).toEqual({
      status: 'disposed',
      reclaimed: [true],
      failed: [],
      live: 0,
      leasesRemoved: 0,
      foreign: [],
      mode: 'ERR_INVALID_ARG_VALUE',
      left: [['.vmspace'], [], [], []],
    })
  })
})

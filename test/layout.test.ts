/**
 * The pool on disk (DESIGN.md, "The pool on disk"; native/core/pool.h): one layout, `vmspace-pool 1`.
 *
 *   <root>/.vmspace/{version, staging/s0..s7/, trash/, leases/0..f/, cache/}   and   <root>/<prefix>-<32 hex> per workspace
 *
 * A new pool is exactly that tree (built under `.vmspace.init-<hex>` and renamed into place, so concurrent first
 * opens make one pool), made only in an empty or missing directory unless `nonEmpty`. Anything else under
 * `.vmspace/` (an old format's version, a missing version file or directory) is refused with `ERR_POOL_FORMAT` and
 * left byte for byte as it was. Entries named like workspaces without a lease file are not vmspace's: list() and
 * adopt() do not see them and a sweep leaves them, reporting their paths in `foreign`.
 *
 * Every behaviour runs on the scratch ext4 and on the loop-mounted XFS (reflink) of the global setup.
 */
import { spawn, spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, onTestFinished, test } from 'vitest'
import { openPool } from '../lib/index.js'
import { freshDir, mounts, needs, randomId, repoRoot } from './helpers.js'
import { exactSnapshot, fileSystems, leaseFilePath, newPoolListing, rejection, stagingShards, treeListing } from './layout-helpers.js'

/** Sets the process umask for the rest of the current test. */
function umaskForTest(mask: number): void {
  const before = process.umask(mask)
  onTestFinished(() => void process.umask(before))
}

describe.each(fileSystems)('on $label', ({ label, base, missing }) => {
  describe.skipIf(base === null)(`a new pool ${needs(label, base === null && (missing ?? 'not made'))}`, () => {
    test('is exactly .vmspace/{version "vmspace-pool 1\\n" 0644, staging/s0..s7, trash, leases/0..f, cache}: .vmspace 0755, the rest 0700, the root 0755, nothing else', async () => {
      umaskForTest(0o022)
      const root = path.join(freshDir(base!), 'a', 'pool')
      const pool = await openPool(root)
      expect(treeListing(root)).toEqual(newPoolListing)
      expect(fs.readFileSync(path.join(root, '.vmspace', 'version'))).toEqual(Buffer.from('vmspace-pool 1\n'))
      expect(fs.statSync(root).mode & 0o7777).toBe(0o755)
      expect(fs.statSync(path.dirname(root)).mode & 0o7777).toBe(0o755)
      await pool.close()
      // Closing and opening again adds nothing (no temp or probe file stays).
      await (await openPool(root)).close()
      expect(treeListing(root)).toEqual(newPoolListing)
    })

    test('gets the same exact modes under umask 0o077 and 0o000: no .vmspace.init-* is left either way', async () => {
      umaskForTest(0o022)
      for (const mask of [0o077, 0o000]) {
        process.umask(mask) // umaskForTest restores the process's own when the test finishes
        const root = path.join(freshDir(base!), 'pool')
        await (await openPool(root)).close()
        expect(treeListing(root)).toEqual(newPoolListing)
        expect(fs.statSync(root).mode & 0o7777).toBe(0o755)
      }
    })

    test('its first workspace adds exactly <root>/vm-<id> 0700 and its lease file .vmspace/leases/<first hex digit>/vm-<id>; dispose takes both away', async () => {
      umaskForTest(0o022)
      const root = path.join(freshDir(base!), 'pool')
      const pool = await openPool(root)
      const ws = await pool.allocate()
      const leaseFile = path.relative(root, leaseFilePath(root, ws.name))
      const leaseMode = mounts.root ? '0400' : '0600'
      expect(treeListing(root)).toEqual([...newPoolListing, `${ws.name} d 0700`, `${leaseFile} f ${leaseMode}`].sort())
      await ws.dispose()
      // The open pool keeps the lease file as a spare (never handed over): its close() removes it.
      await pool.close()
      expect(treeListing(root)).toEqual(newPoolListing)
    })
  })

  describe.skipIf(base === null)(`Pool.leasePath ${needs(label, base === null && (missing ?? 'not made'))}`, () => {
    test('names the lease file ws.leaseFd is open on, and where any prefix\'s would be; no syscall, so also once closed', async () => {
      const root = path.join(freshDir(base!), 'pool')
      const pool = await openPool(root)
      const ws = await pool.allocate()
      expect(pool.leasePath(ws.name)).toBe(leaseFilePath(root, ws.name))
      expect(fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)).toBe(fs.realpathSync(leaseFilePath(root, ws.name)))
      expect(pool.leasePath(`other_Prefix-${ws.id}`)).toBe(leaseFilePath(root, `other_Prefix-${ws.id}`))
      await ws.dispose()
      await pool.close()
      expect(pool.leasePath(ws.name)).toBe(leaseFilePath(root, ws.name))
    })

    test('refuses what is not a workspace name: ERR_INVALID_ARG_TYPE for a non-string, ERR_INVALID_ARG_VALUE naming the value otherwise', async () => {
      const root = path.join(freshDir(base!), 'pool')
      const pool = await openPool(root)
      onTestFinished(() => pool.close())
      const id = randomId()
      expect(() => pool.leasePath(7 as never)).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARG_TYPE' }))
      for (const bad of ['', id, `vm-${id.toUpperCase()}`, `../vm-${id}`, `vm-${id}/x`, `.vm-${id}`])
        expect(() => pool.leasePath(bad)).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARG_VALUE', message: expect.stringContaining(JSON.stringify(bad)) }))
    })
  })

  describe.skipIf(base === null)(`a .vmspace/ that is not this layout is refused with ERR_POOL_FORMAT, untouched ${needs(label, base === null && (missing ?? 'not made'))}`, () => {
    /** A pool of this layout with one released workspace and a file in it, closed: the tree the cases below break. */
    async function populatedPool(): Promise<{ root: string; name: string }> {
      const root = path.join(freshDir(base!), 'pool')
      const pool = await openPool(root)
      const ws = await pool.allocate({ meta: { keep: true } })
      fs.writeFileSync(path.join(ws.path, 'data.txt'), 'guest data')
      await ws.release({ force: true })
      await pool.close()
      return { root, name: ws.name }
    }

    /**
     * An old format's pool as vmspace made it before this layout: .vmspace/{version, staging/ (format 3:
     * staging/s0..s7), trash/, meta/<name>.json} and a workspace, with no lease files.
     */
    function oldFormatPool(format: 1 | 2 | 3): string {
      const root = path.join(freshDir(base!), 'pool')
      const state = path.join(root, '.vmspace')
      fs.mkdirSync(path.join(state, 'staging'), { recursive: true, mode: 0o700 })
      if (format === 3) for (const s of stagingShards) fs.mkdirSync(path.join(state, 'staging', s), { mode: 0o700 })
      fs.mkdirSync(path.join(state, 'trash'), { mode: 0o700 })
      fs.mkdirSync(path.join(state, 'meta'), { mode: 0o700 })
      fs.writeFileSync(path.join(state, 'version'), `${format}\n`)
      const name = `vm-${randomId()}`
      fs.mkdirSync(path.join(root, name), { mode: 0o700 })
      fs.writeFileSync(path.join(root, name, 'data.txt'), 'old guest data')
      fs.writeFileSync(path.join(state, 'meta', `${name}.json`), JSON.stringify({ name, meta: { old: format } }) + '\n')
      return root
    }

    test.each([1, 2, 3] as const)('an old format-%i pool (its version file, meta/, a workspace, no lease files): nothing in it changes', async (format) => {
      const root = oldFormatPool(format)
      const before = exactSnapshot(root)
      const err = await rejection(openPool(root))
      expect(err).toMatchObject({ code: 'ERR_POOL_FORMAT', path: path.join(root, '.vmspace', 'version') })
      expect(exactSnapshot(root)).toEqual(before)
    })

    test.each([
      ['"1\\n"', '1\n'],
      ['"2\\n"', '2\n'],
      ['"3\\n"', '3\n'],
      ['garbage', 'not a pool\x00\xff\n'],
      ['"vmspace-pool 2\\n"', 'vmspace-pool 2\n'],
      ['empty', ''],
    ])('this layout\'s tree with version %s: the tree is byte-for-byte unchanged', async (_, version) => {
      const { root } = await populatedPool()
      fs.writeFileSync(path.join(root, '.vmspace', 'version'), version)
      const before = exactSnapshot(root)
      const err = await rejection(openPool(root))
      expect(err).toMatchObject({ code: 'ERR_POOL_FORMAT', path: path.join(root, '.vmspace', 'version') })
      expect(exactSnapshot(root)).toEqual(before)
      // create: false refuses it the same way.
      expect(await rejection(openPool(root, { create: false }))).toMatchObject({ code: 'ERR_POOL_FORMAT' })
      expect(exactSnapshot(root)).toEqual(before)
    })

    // `entry` gives the path under .vmspace/ to remove, from the workspace's name (its lease shard is its id's first
    // hex digit).
    const otherShard = (name: string) => (name.charAt(name.length - 32) === '0' ? '1' : '0')
    test.each([
      ['the version file', () => 'version'],
      ['leases/', () => 'leases'],
      ['a lease shard other than the workspace\'s', (name: string) => `leases/${otherShard(name)}`],
      ['the workspace\'s lease shard (its lease file with it)', (name: string) => `leases/${name.charAt(name.length - 32)}`],
      ['staging/', () => 'staging'],
      ['the staging shard staging/s0', () => 'staging/s0'],
      ['the staging shard staging/s7', () => 'staging/s7'],
      ['trash/', () => 'trash'],
      ['cache/', () => 'cache'],
    ])('without %s: never made again, the tree is byte-for-byte unchanged', async (_, entry) => {
      const { root, name } = await populatedPool()
      const removed = path.join(root, '.vmspace', entry(name))
      fs.rmSync(removed, { recursive: true })
      const before = exactSnapshot(root)
      const err = await rejection(openPool(root))
      expect(err).toMatchObject({ code: 'ERR_POOL_FORMAT', path: removed })
      expect(exactSnapshot(root)).toEqual(before)
    })
  })

  describe.skipIf(base === null)(`where a pool is made ${needs(label, base === null && (missing ?? 'not made'))}`, () => {
    test.each([
      ['a regular file', (at: string) => fs.writeFileSync(at, 'x')],
      ['a symlink to another pool\'s .vmspace/', (at: string, other: string) => fs.symlinkSync(path.join(other, '.vmspace'), at)],
      ['a dangling symlink', (at: string) => fs.symlinkSync('/nonexistent-vmspace', at)],
    ])('a .vmspace that is %s is refused with ENOTDIR, with or without nonEmpty; it is never followed, nothing changes', async (_, plant) => {
      const dir = freshDir(base!)
      const other = path.join(dir, 'other')
      await (await openPool(other)).close()
      const root = path.join(dir, 'pool')
      fs.mkdirSync(root)
      plant(path.join(root, '.vmspace'), other)
      const before = exactSnapshot(dir)
      for (const options of [{}, { nonEmpty: true }]) {
        const err = await rejection(openPool(root, options))
        expect(err).toMatchObject({ code: 'ENOTDIR', errno: -20, syscall: 'open', path: path.join(root, '.vmspace') })
      }
      expect(exactSnapshot(dir)).toEqual(before)
    })

    test('a directory holding other entries is refused with ERR_POOL_NOT_EMPTY (errno ENOTEMPTY); nothing is made in it', async () => {
      const root = path.join(freshDir(base!), 'docs')
      fs.mkdirSync(path.join(root, 'sub'), { recursive: true })
      fs.writeFileSync(path.join(root, 'notes.txt'), 'mine')
      fs.writeFileSync(path.join(root, 'sub', 'deep.txt'), 'mine too')
      const before = exactSnapshot(root)
      const err = await rejection(openPool(root))
      expect(err).toMatchObject({ code: 'ERR_POOL_NOT_EMPTY', errno: -39, syscall: 'mkdir', path: path.join(root, '.vmspace') })
      expect(err.cause).toMatchObject({ code: 'ENOTEMPTY', errno: -39 })
      expect(exactSnapshot(root)).toEqual(before)
    })

    test('a directory holding only a dot file or only a workspace-named directory is not empty either', async () => {
      for (const entry of ['.hidden', `vm-${randomId()}`]) {
        const root = path.join(freshDir(base!), 'pool')
        fs.mkdirSync(path.join(root, entry), { recursive: true })
        const before = exactSnapshot(root)
        expect(await rejection(openPool(root))).toMatchObject({ code: 'ERR_POOL_NOT_EMPTY' })
        expect(exactSnapshot(root)).toEqual(before)
      }
    })

    test('{ nonEmpty: true } makes the pool there and leaves every other entry as it was', async () => {
      umaskForTest(0o022)
      const root = path.join(freshDir(base!), 'docs')
      fs.mkdirSync(path.join(root, 'sub'), { recursive: true })
      fs.writeFileSync(path.join(root, 'notes.txt'), 'mine')
      fs.writeFileSync(path.join(root, 'sub', 'deep.txt'), 'mine too')
      const others = exactSnapshot(root)
      delete others['.']
      const pool = await openPool(root, { nonEmpty: true })
      const after = exactSnapshot(root)
      for (const [rel, desc] of Object.entries(others)) expect(after[rel], rel).toBe(desc)
      expect(treeListing(root).filter((e) => e.startsWith('.vmspace'))).toEqual(newPoolListing)
      expect(fs.readdirSync(root).sort()).toEqual(['.vmspace', 'notes.txt', 'sub'])
      // Its workspaces work as in any pool; the other entries stay.
      const ws = await pool.allocate()
      await ws.dispose()
      expect(fs.readdirSync(root).sort()).toEqual(['.vmspace', 'notes.txt', 'sub'])
      await pool.close()
    })

    test('an existing empty directory needs no option: the pool is made in it', async () => {
      umaskForTest(0o022)
      const root = path.join(freshDir(base!), 'pool')
      fs.mkdirSync(root, { mode: 0o755 })
      await (await openPool(root)).close()
      expect(treeListing(root)).toEqual(newPoolListing)
    })

    test('an existing pool whose root holds workspaces and other entries opens without nonEmpty', async () => {
      const root = path.join(freshDir(base!), 'pool')
      const pool = await openPool(root)
      const ws = await pool.allocate()
      fs.writeFileSync(path.join(root, 'README'), 'other')
      const again = await openPool(root)
      expect((await again.list()).map((i) => i.name)).toEqual([ws.name])
      await again.close()
      await ws.dispose()
      await pool.close()
    })

    test('options are strict: { format: 3 } (gone with the old formats) is ERR_INVALID_ARG_VALUE, nothing made', async () => {
      const dir = freshDir(base!)
      const root = path.join(dir, 'pool')
      const err = await openPool(root, { format: 3 } as never).catch((e: unknown) => e)
      expect(err).toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
      expect((err as Error).message).toContain('options.format')
      expect(fs.readdirSync(dir)).toEqual([])
    })
  })

  describe.skipIf(base === null)(`concurrent first opens of one missing root ${needs(label, base === null && (missing ?? 'not made'))}`, () => {
    test('6 processes released together, 5 rounds: every open succeeds, one .vmspace, no .vmspace.init-* left', async () => {
      const dir = freshDir(base!)
      for (let round = 0; round < 5; round++) {
        const root = path.join(dir, `pool-${round}`)
        const script = `
          const { openPool } = require(${JSON.stringify(path.join(repoRoot, 'dist', 'index.js'))})
          process.stdout.write('ready\\n')
          process.stdin.once('data', () => openPool(process.argv[1]).then(
            (p) => p.close().then(() => process.stdout.write('ok\\n')),
            (e) => process.stdout.write(String(e.code) + ' ' + e.message + '\\n'),
          ))
        `
        const children = Array.from({ length: 6 }, () => {
          const c = spawn(process.execPath, ['-e', script, root], { stdio: ['pipe', 'pipe', 'inherit'] })
          let out = ''
          c.stdout!.setEncoding('utf8').on('data', (s: string) => (out += s))
          const ready = new Promise<void>((resolve) => c.stdout!.once('data', () => resolve()))
          const done = new Promise<string>((resolve) => c.on('exit', () => resolve(out)))
          onTestFinished(() => void c.kill('SIGKILL'))
          return { c, ready, done }
        })
        await Promise.all(children.map((x) => x.ready))
        for (const x of children) x.c.stdin!.end('go\n')
        const outputs = await Promise.all(children.map((x) => x.done))
        expect(outputs).toEqual(Array(6).fill('ready\nok\n'))
        expect(fs.readdirSync(root)).toEqual(['.vmspace'])
        expect(treeListing(root)).toEqual(newPoolListing)
      }
    })

    test('8 openPool calls at once in one process (8 threads of its libuv pool), 300 roots: every open succeeds, one .vmspace each, no .vmspace.init-* left', () => {
      const dir = freshDir(base!)
      // In a process of its own, so that its libuv pool has 8 threads (UV_THREADPOOL_SIZE, read once per process).
      const script = `
        const fs = require('node:fs')
        const { openPool } = require(${JSON.stringify(path.join(repoRoot, 'dist', 'index.js'))})
        ;(async () => {
          const failures = [], roots = {}
          for (let round = 0; round < 300; round++) {
            const root = process.argv[1] + '/pool-' + round
            const results = await Promise.all(Array.from({ length: 8 }, () =>
              openPool(root).then((p) => p.close().then(() => 'ok'), (e) => e.code + ': ' + e.message)))
            for (const r of results) if (r !== 'ok') failures.push('round ' + round + ': ' + r)
            const entries = fs.readdirSync(root).sort().join(',')
            roots[entries] = (roots[entries] || 0) + 1
          }
          process.stdout.write(JSON.stringify({ failures, roots }))
        })()
      `
      const r = spawnSync(process.execPath, ['-e', script, dir], { encoding: 'utf8', env: { ...process.env, UV_THREADPOOL_SIZE: '8' } })
      expect(r.status, r.stderr).toBe(0)
      const { failures, roots } = JSON.parse(r.stdout) as { failures: string[]; roots: Record<string, number> }
      expect({ failed: failures.length, firstFailures: failures.slice(0, 3), roots }).toEqual({ failed: 0, firstFailures: [], roots: { '.vmspace': 300 } })
    })
  })

  describe.skipIf(base === null)(`an entry named like a workspace without a lease file is foreign ${needs(label, base === null && (missing ?? 'not made'))}`, () => {
    /** A `vm-<32 hex>` directory with a file and a subdirectory made by hand at `dir`/name. */
    function plantForeign(dir: string): { name: string; id: string; at: string } {
      const id = randomId()
      const name = `vm-${id}`
      const at = path.join(dir, name)
      fs.mkdirSync(path.join(at, 'sub'), { recursive: true })
      fs.writeFileSync(path.join(at, 'own.txt'), 'not vmspace’s')
      fs.writeFileSync(path.join(at, 'sub', 'deep.txt'), 'nor this')
      return { name, id, at }
    }

    test.each([
      ['the root', ''],
      ['.vmspace/staging/s0/', '.vmspace/staging/s0'],
      ['.vmspace/trash/', '.vmspace/trash'],
    ])('in %s: list() does not show it, adopt(id) is ENOENT, sweep({ graceMs: 0 }) leaves it with its files and reports its path in foreign', async (_, where) => {
      const pool = await openPool(path.join(freshDir(base!), 'pool'))
      const mine = await pool.allocate()
      const planted = plantForeign(path.join(pool.root, where))
      const before = exactSnapshot(pool.root)
      const beforePlanted = exactSnapshot(planted.at)

      expect((await pool.list()).map((i) => i.name)).toEqual([mine.name])
      const err = await rejection(pool.adopt(planted.id))
      expect(err).toMatchObject({ code: 'ENOENT', path: path.join(pool.root, planted.name) })
      for (const options of [{ dryRun: true }, {}, { graceMs: 0 }]) {
        const report = await pool.sweep(options)
        expect(report).toEqual({ reclaimed: [], live: 1, failed: [], leasesRemoved: 0, foreign: [planted.at] })
      }
      expect(exactSnapshot(planted.at)).toEqual(beforePlanted)
      expect(exactSnapshot(pool.root)).toEqual(before)
      await mine.dispose()
      await pool.close()
    })

    test('one in each of the root, a staging shard and trash at once: each path reported once, all three left', async () => {
      const pool = await openPool(path.join(freshDir(base!), 'pool'))
      const planted = ['', '.vmspace/staging/s5', '.vmspace/trash'].map((w) => plantForeign(path.join(pool.root, w)))
      const before = exactSnapshot(pool.root)
      const report = await pool.sweep({ graceMs: 0 })
      expect(report).toMatchObject({ reclaimed: [], live: 0, failed: [], leasesRemoved: 0 })
      expect([...report.foreign].sort()).toEqual(planted.map((p) => p.at).sort())
      expect(exactSnapshot(pool.root)).toEqual(before)
      await pool.close()
    })

    test.each([
      ['a symlink to a regular file', (at: string, target: string) => fs.symlinkSync(target, at)],
      ['a directory', (at: string) => fs.mkdirSync(at)],
    ])('a workspace-named directory whose lease path is %s is foreign too: not listed, adopt ENOENT, left by sweep', async (_, plantLease) => {
      const dir = freshDir(base!)
      const pool = await openPool(path.join(dir, 'pool'))
      const planted = plantForeign(pool.root)
      const target = path.join(dir, 'target')
      fs.writeFileSync(target, '')
      plantLease(leaseFilePath(pool.root, planted.name), target)
      const before = exactSnapshot(dir)
      expect(await rejection(pool.adopt(planted.id))).toMatchObject({ code: 'ENOENT', path: planted.at })
      expect(await pool.sweep({ graceMs: 0 })).toEqual({ reclaimed: [], live: 0, failed: [], leasesRemoved: 0, foreign: [planted.at] })
      expect(exactSnapshot(dir)).toEqual(before)
      // list() agrees with adopt() and sweep(): not a workspace of this pool.
      expect(await pool.list()).toEqual([])
      await pool.close()
    })
  })

  describe.skipIf(base === null)(`what a killed first opener leaves ${needs(label, base === null && (missing ?? 'not made'))}`, () => {
    /** A half-built `.vmspace.init-<hex>` as an opener killed before its rename leaves it (version and staging only). */
    function plantInit(root: string): string {
      const init = path.join(root, '.vmspace.init-0123abcd')
      fs.mkdirSync(path.join(init, 'staging', 's0'), { recursive: true })
      fs.writeFileSync(path.join(init, 'version'), 'vmspace-pool 1\n')
      return init
    }

    test('a directory holding only a .vmspace.init-* counts as empty: the pool is made there, the leftover stays', async () => {
      const root = path.join(freshDir(base!), 'pool')
      const init = plantInit(root)
      const leftover = exactSnapshot(init)
      await (await openPool(root)).close()
      expect(fs.readdirSync(root).sort()).toEqual(['.vmspace', '.vmspace.init-0123abcd'])
      expect(treeListing(root).filter((e) => e.startsWith('.vmspace/') || e.startsWith('.vmspace '))).toEqual(newPoolListing)
      expect(exactSnapshot(init)).toEqual(leftover)
    })

    test('sweep() leaves a .vmspace.init-* younger than graceMs; sweep({ graceMs: 0 }) removes it, in no list of its report', async () => {
      const root = path.join(freshDir(base!), 'pool')
      const pool = await openPool(root)
      plantInit(root)
      const empty = { reclaimed: [], live: 0, failed: [], leasesRemoved: 0, foreign: [] }
      expect(await pool.sweep()).toEqual(empty)
      expect(fs.readdirSync(root).sort()).toEqual(['.vmspace', '.vmspace.init-0123abcd'])
      expect(await pool.sweep({ graceMs: 0 })).toEqual(empty)
      expect(treeListing(root)).toEqual(newPoolListing)
      await pool.close()
    })
  })
})

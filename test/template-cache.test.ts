/**
 * The template cache: a single-file template source on another file system than the pool (the host's ext4, the
 * scratch directory) is copied once into `.vmspace/cache/` under the key of its version, and every later allocate
 * reflinks from that copy. On the loop-mounted XFS and btrfs as pools; extents checked with FIEMAP (filefrag),
 * bytes with sha256, leftovers by listing the pool.
 */
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { lockFile, openPool, type Pool, type Workspace } from '../lib/index.js'
import { Child, emptyPoolState, extentsUnshared, fixtures, freshDir, MiB, mounts, needs, poolState, sharedExtents, writeRandomFile } from './helpers.js'

const sha = (file: string) => createHash('sha256').update(fs.readFileSync(file)).digest('hex')

/** The cache key of the file at `p` as the native side makes it: dev-ino-size-mtime.ns-ctime.ns (decimal). */
function keyOf(p: string): string {
  const st = fs.statSync(p, { bigint: true })
  const ts = (ns: bigint) => `${ns / 1_000_000_000n}.${(ns % 1_000_000_000n).toString().padStart(9, '0')}`
  return `${st.dev}-${st.ino}-${st.size}-${ts(st.mtimeNs)}-${ts(st.ctimeNs)}`
}

/** The entries of `.vmspace/cache/`, sorted. */
function cacheEntries(root: string): string[] {
  return fs.readdirSync(path.join(root, '.vmspace', 'cache')).sort()
}

/** What a case may leave: the published copies and their lock files, nothing else (no temp, no build). */
function expectOnlyEntries(pool: Pool, keys: string[]): void {
  expect(cacheEntries(pool.root)).toEqual(keys.flatMap((k) => [k, `.lock-${k}`]).sort())
  expect(poolState(pool.root)).toEqual(emptyPoolState)
}

const pools = [
  { label: 'loop XFS (reflink=1)', base: mounts.xfs, missing: mounts.missing.xfs },
  { label: 'loop btrfs', base: mounts.btrfs, missing: mounts.missing.btrfs },
]

describe.each(pools)('a pool on $label, sources on the host ext4', ({ label, base, missing }) => {
  const skip = base === null
  const poolDir = () => path.join(freshDir(base!), 'pool')
  const sourceOf = (size = 8 * MiB) => {
    const p = path.join(freshDir(mounts.scratch), 'rootfs.ext4')
    writeRandomFile(p, size)
    return p
  }
  const allocate = (pool: Pool, src: string) => pool.allocate({ template: { 'rootfs.ext4': src } })

  test.skipIf(skip)(`the first allocate copies (miss), every next one reflinks the cached copy (hit): extents shared, 16 children isolated, the base unchanged ${needs(label, skip && missing)}`, async () => {
    const src = sourceOf()
    const before = sha(src)
    const pool = await openPool(poolDir())
    const first = await allocate(pool, src)
    expect(first.template[0]).toMatchObject({ method: 'reflink', cache: 'miss', bytes: 8 * MiB, reflinked: 1, copied: 0 })
    const children: Workspace[] = []
    for (let i = 0; i < 16; i++) children.push(await allocate(pool, src))
    for (const ws of children) expect(ws.template[0]).toMatchObject({ method: 'reflink', cache: 'hit', bytes: 8 * MiB })
    const key = keyOf(src)
    expect(cacheEntries(pool.root)).toEqual([key, `.lock-${key}`].sort())
    // The child's data is the cached copy's extents, shared.
    const e = sharedExtents(path.join(children[0].path, 'rootfs.ext4'))
    expect(e.extents).toBeGreaterThan(0)
    expect(e.shared).toBe(e.extents)
    // Isolation: each child writes its own bytes; no other child, the cached copy or the base sees them.
    children.forEach((ws, i) => {
      const fd = fs.openSync(path.join(ws.path, 'rootfs.ext4'), 'r+')
      fs.writeSync(fd, Buffer.alloc(4096, i + 1), 0, 4096, i * 4096)
      fs.closeSync(fd)
    })
    children.forEach((ws, i) => {
      const fd = fs.openSync(path.join(ws.path, 'rootfs.ext4'), 'r')
      for (let j = 0; j < 16; j++) {
        const b = Buffer.alloc(4096)
        fs.readSync(fd, b, 0, 4096, j * 4096)
        if (j === i) expect(b.equals(Buffer.alloc(4096, i + 1))).toBe(true)
        else expect(b.equals(Buffer.alloc(4096, j + 1))).toBe(false)
      }
      fs.closeSync(fd)
    })
    expect(sha(path.join(pool.root, '.vmspace', 'cache', key))).toBe(before)
    expect(sha(path.join(first.path, 'rootfs.ext4'))).toBe(before)
    expect(sha(src)).toBe(before)
    for (const ws of [first, ...children]) await ws.dispose()
    expectOnlyEntries(pool, [key])
    await pool.close()
  })

  test.skipIf(skip)('a changed base is copied again, never served stale: a write with a new mtime, then a same-size write in place with the mtime put back (ctime differs)', async () => {
    const src = sourceOf(2 * MiB)
    const pool = await openPool(poolDir())
    const keys = [keyOf(src)]
    expect((await allocate(pool, src)).template[0].cache).toBe('miss')
    expect((await allocate(pool, src)).template[0].cache).toBe('hit')

    fs.appendFileSync(src, 'more')
    keys.push(keyOf(src))
    const grown = await allocate(pool, src)
    expect(grown.template[0]).toMatchObject({ method: 'reflink', cache: 'miss', bytes: 2 * MiB + 4 })
    expect(sha(path.join(grown.path, 'rootfs.ext4'))).toBe(sha(src))

    // A whole-second mtime, so that utimes can put it back exactly (it takes no nanoseconds from a Date).
    fs.utimesSync(src, 1_700_000_000, 1_700_000_000)
    const set = fs.statSync(src, { bigint: true })
    expect((await allocate(pool, src)).template[0].cache).toBe('miss')
    keys.push(keyOf(src))
    const fd = fs.openSync(src, 'r+')
    fs.writeSync(fd, Buffer.from('same size, other bytes'), 0, 22, 1000)
    fs.closeSync(fd)
    fs.utimesSync(src, 1_700_000_000, 1_700_000_000)
    const now = fs.statSync(src, { bigint: true })
    expect([now.size, now.mtimeNs, now.ino]).toEqual([set.size, set.mtimeNs, set.ino])
    expect(now.ctimeNs).not.toBe(set.ctimeNs)
    keys.push(keyOf(src))
    expect(new Set(keys).size).toBe(4)
    const rewritten = await allocate(pool, src)
    expect(rewritten.template[0].cache).toBe('miss')
    expect(sha(path.join(rewritten.path, 'rootfs.ext4'))).toBe(sha(src))
    expect((await allocate(pool, src)).template[0].cache).toBe('hit')
    for (const ws of await pool.list()) await (await pool.adopt(ws.id).catch(() => null))?.dispose()
    await pool.close()
  })

  test.skipIf(skip)('a source modified during the first copy never publishes a torn entry: ERR_SOURCE_CHANGED, nothing in the cache or the workspace', async () => {
    const pool = await openPool(poolDir())
    const ws = await pool.allocate()
    // A copy long enough to be seen in progress (1 MiB chunks, a report at most every 100 ms); larger where it ended first.
    for (const size of [256 * MiB, 1024 * MiB]) {
      const src = sourceOf(size)
      const before = { key: keyOf(src), sha: sha(src) }
      let changed = false
      const r = await ws
        .clone(src, 'rootfs.ext4', {
          onProgress: () => {
            if (changed) return
            changed = true
            fs.truncateSync(src, MiB)
          },
        })
        .catch((e: unknown) => e)
      if (!changed) {
        // Finished before any report: remove and try a larger file.
        fs.rmSync(path.join(ws.path, 'rootfs.ext4'))
        fs.rmSync(src)
        continue
      }
      expect(r).toMatchObject({ code: 'ERR_SOURCE_CHANGED', path: src })
      expect(fs.readdirSync(ws.path)).toEqual([])
      // Changed during the copy: nothing published. Changed after the copy's check (its fsync, the reflink from the
      // entry): the entry is the whole version it is named for, and the clone of it is still refused.
      const published = cacheEntries(pool.root).filter((n) => !n.startsWith('.'))
      expect(published.filter((k) => k !== before.key)).toEqual([])
      for (const k of published) expect(sha(path.join(pool.root, '.vmspace', 'cache', k))).toBe(before.sha)
      expect(cacheEntries(pool.root).filter((n) => n.startsWith('.tmp-'))).toEqual([])
      // The source as it is now is copied and served whole.
      const again = await ws.clone(src, 'rootfs.ext4')
      expect(again).toMatchObject({ method: 'reflink', cache: 'miss', bytes: MiB })
      expect(sha(path.join(ws.path, 'rootfs.ext4'))).toBe(sha(src))
      await ws.dispose()
      expectOnlyEntries(pool, [...published, keyOf(src)])
      await pool.close()
      return
    }
    expect.fail('every copy finished before its first progress report')
  })

  test.skipIf(skip)('two processes racing the first allocate of one source: one copy (miss), the other reflinks it (hit), one entry', async () => {
    const src = sourceOf(64 * MiB)
    const root = poolDir()
    const pool = await openPool(root)
    const children = [0, 1].map(() => new Child(path.join(fixtures, 'template-cache-child.cjs'), [root, src]))
    await Promise.all(children.map((c) => c.expect('ready')))
    for (const c of children) c.send('allocate')
    const results = await Promise.all(children.map((c) => c.expect('allocated')))
    expect(results.map((r) => r.method)).toEqual(['reflink', 'reflink'])
    expect(results.map((r) => r.cache).sort()).toEqual(['hit', 'miss'])
    for (const c of children) c.proc.stdin!.end()
    await Promise.all(children.map((c) => c.exited))
    expectOnlyEntries(pool, [keyOf(src)])
    expect(sha(path.join(root, '.vmspace', 'cache', keyOf(src)))).toBe(sha(src))
    await pool.close()
  })

  test.skipIf(skip)('sweep reclaims entries whose source changed, and the least recently used beyond the budget, never one in use', async () => {
    const a = sourceOf(MiB)
    const b = sourceOf(2 * MiB)
    const root = poolDir()
    let pool = await openPool(root)
    const keyA = keyOf(a), keyB = keyOf(b)
    for (const src of [a, b]) await (await allocate(pool, src)).dispose()
    // Within the default budget, both sources current: nothing to reclaim.
    expect((await pool.sweep()).reclaimed).toEqual([])
    // a changes: its old copy can never be asked for again.
    fs.appendFileSync(a, 'x')
    // The workspace's copy was removed: what the sweep gets back is the cached copy's blocks once the file system
    // has freed the workspace's (XFS does it in the background).
    await extentsUnshared(path.join(root, '.vmspace', 'cache', keyA))
    const obsolete = await pool.sweep()
    expect(obsolete.reclaimed).toEqual([{ id: keyA, name: keyA, from: 'template-cache', bytes: MiB }])
    expectOnlyEntries(pool, [keyB])
    await pool.close()

    // A budget of 0: every entry goes, except one a clone holds (flock LOCK_SH, as a clone from it does).
    pool = await openPool(root, { templateCache: { maxBytes: 0 } })
    await (await allocate(pool, a)).dispose()
    const keyA2 = keyOf(a)
    const held = await lockFile(path.join(root, '.vmspace', 'cache', keyB), { shared: true })
    await extentsUnshared(path.join(root, '.vmspace', 'cache', keyA2))
    const dry = await pool.sweep({ dryRun: true })
    expect(dry.reclaimed).toEqual([{ id: keyA2, name: keyA2, from: 'template-cache', bytes: 0 }])
    const r = await pool.sweep()
    expect(r.reclaimed).toEqual([{ id: keyA2, name: keyA2, from: 'template-cache', bytes: MiB + 4096 }])
    expectOnlyEntries(pool, [keyB])
    await held.release()
    // Shared with a live workspace: what the file system gets back is the cached copy's own blocks only (none).
    const live = await allocate(pool, b)
    expect(live.template[0].cache).toBe('hit')
    expect((await pool.sweep()).reclaimed).toEqual([{ id: keyB, name: keyB, from: 'template-cache', bytes: 0 }])
    expect(cacheEntries(pool.root)).toEqual([])
    expect(sha(path.join(live.path, 'rootfs.ext4'))).toBe(sha(b))
    await live.dispose()
    await pool.close()
  })

  test.skipIf(skip)('a tree source, reflink "never" and templateCache: false clone as before: a copy, no cache field, nothing cached', async () => {
    const src = sourceOf(MiB)
    const tree = path.dirname(src)
    let pool = await openPool(poolDir(), { templateCache: false })
    const off = await allocate(pool, src)
    expect(off.template[0]).toMatchObject({ method: 'copy', copied: 1 })
    expect(off.template[0].cache).toBeUndefined()
    await off.dispose()
    expect(cacheEntries(pool.root)).toEqual([])
    await pool.close()

    pool = await openPool(poolDir())
    const fromTree = await pool.allocate({ template: tree })
    expect(fromTree.template[0]).toMatchObject({ kind: 'tree', method: 'copy', copied: 1 })
    expect(fromTree.template[0].cache).toBeUndefined()
    const never = await fromTree.clone(src, 'copy.img', { reflink: 'never' })
    expect(never).toMatchObject({ method: 'copy' })
    expect(never.cache).toBeUndefined()
    expect(cacheEntries(pool.root)).toEqual([])
    await fromTree.dispose()
    await pool.close()
  })
})

describe('where the pool cannot reflink (ext4)', () => {
  const skip = mounts.xfs === null
  test.skipIf(skip)(`a source on another file system is copied per allocate, as before: no cache entry ${needs('loop XFS', skip && mounts.missing.xfs)}`, async () => {
    const src = path.join(freshDir(mounts.xfs!), 'rootfs.ext4')
    writeRandomFile(src, MiB)
    const pool = await openPool(path.join(freshDir(mounts.scratch), 'pool'))
    for (let i = 0; i < 2; i++) {
      const ws = await pool.allocate({ template: { 'rootfs.ext4': src } })
      expect(ws.template[0]).toMatchObject({ method: 'copy', copied: 1 })
      expect(ws.template[0].cache).toBeUndefined()
      await ws.dispose()
    }
    expect(cacheEntries(pool.root)).toEqual([])
    await pool.close()
  })
})

describe('options', () => {
  test('templateCache is strict: an unknown key, a wrong type, a negative budget', async () => {
    const root = path.join(freshDir(mounts.scratch), 'pool')
    await expect(openPool(root, { templateCache: { maxBytez: 1 } as never })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE', message: expect.stringContaining('options.templateCache.maxBytez') })
    await expect(openPool(root, { templateCache: true as never })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_TYPE', message: expect.stringContaining('options.templateCache') })
    await expect(openPool(root, { templateCache: { maxBytes: -1 } })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE', message: expect.stringContaining('options.templateCache.maxBytes') })
    expect(fs.existsSync(root)).toBe(false)
  })
})

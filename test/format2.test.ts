/**
 * Pool formats 2 and 3 (issue 12): each workspace's metadata is the xattr user.vmspace.meta of its directory, set
 * before the workspace is published, gone with the directory; the file .vmspace/meta/<name>.json where the file
 * system refuses the xattr. Format 3 builds in staging shards (.vmspace/staging/s0 … s7). And dispose of an empty
 * workspace by rmdir at its name, for every format.
 */
import { execFileSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { openPool } from '../lib/index.js'
import { emptyPoolState, eventually, freshDir, metaPath, mounts, poolState, snapshotTree, stagingEntries, workspaceChild } from './helpers.js'

const XATTR = 'user.vmspace.meta'

/** The xattr's value as text, or null when the directory has none. */
function xattrOf(dir: string): string | null {
  try {
    return execFileSync('getfattr', ['--only-values', '-n', XATTR, dir], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] })
  } catch {
    return null
  }
}

function setXattr(dir: string, value: string): void {
  execFileSync('setfattr', ['-n', XATTR, '-v', value, dir])
}

const fileSystems = [
  ['scratch', () => mounts.scratch] as const,
  ['xfs', () => mounts.xfs] as const,
].filter(([, dir]) => dir() !== null)
const cases = fileSystems.flatMap(([label, base]) => ([2, 3] as const).map((format) => [format, label, base] as const))

describe.each(cases)('format %i on %s', (format, _label, base) => {
  const freshRoot = () => path.join(freshDir(base()!), 'pool')

  test('a new pool says its format in .vmspace/version; metadata is the xattr, nothing in .vmspace/meta/', async () => {
    const root = freshRoot()
    const pool = await openPool(root, { format })
    expect(pool.format).toBe(format)
    expect(fs.readFileSync(path.join(root, '.vmspace', 'version'), 'utf8')).toBe(`${format}\n`)
    const ws = await pool.allocate({ meta: { vm: 'a' } })
    expect(poolState(root)).toEqual({ ...emptyPoolState, visible: [ws.name] })
    const text = xattrOf(ws.path)
    expect(JSON.parse(text!)).toMatchObject({ meta: { vm: 'a' }, name: ws.name, pid: process.pid, template: [] })
    const [info] = await pool.list()
    expect(info).toMatchObject({ id: ws.id, name: ws.name, live: true, meta: { vm: 'a' }, pid: process.pid })
    expect(info.error).toBeUndefined()
    await ws.dispose()
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test("metadata outlives its owner: after the owner's process dies, list() and adopt() read it", async () => {
    const root = freshRoot()
    const pool = await openPool(root, { format })
    const child = workspaceChild(root) // opens the existing pool: its format whatever it asks
    await child.expect('ready')
    child.send('allocate')
    const a = (await child.expect('allocated')) as unknown as { id: string; name: string }
    child.send('exit')
    await child.exited
    const [info] = await pool.list()
    expect(info).toMatchObject({ id: a.id, live: false, meta: { owner: child.proc.pid } })
    const ws = await pool.adopt(a.id)
    expect(ws.info).toMatchObject({ id: a.id, meta: { owner: child.proc.pid } })
    await ws.dispose()
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test('metadata larger than an xattr can be (64 KiB) goes to .vmspace/meta/<name>.json, and list() reads it there', async () => {
    const root = freshRoot()
    const pool = await openPool(root, { format })
    const big = 'x'.repeat(64 * 1024 - 8) // {"s":"…"} is exactly 64 KiB: allowed as meta, too big with the rest
    const ws = await pool.allocate({ meta: { s: big } })
    expect(xattrOf(ws.path)).toBeNull()
    expect(poolState(root)).toEqual({ ...emptyPoolState, visible: [ws.name], meta: [`${ws.name}.json`] })
    const [info] = await pool.list()
    expect(info.meta).toEqual({ s: big })
    await ws.dispose()
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test('dispose of a workspace whose metadata is the xattr does not look in .vmspace/meta/: a file put there by hand is left to sweep, which removes it', async () => {
    const root = freshRoot()
    const pool = await openPool(root, { format })
    const ws = await pool.allocate()
    const planted = path.join(root, '.vmspace', 'meta', `${ws.name}.json`)
    fs.writeFileSync(planted, '{}\n')
    await ws.dispose()
    expect(poolState(root)).toEqual({ ...emptyPoolState, meta: [`${ws.name}.json`] })
    const report = await pool.sweep({ graceMs: 0 })
    expect(report.metadataRemoved).toBe(1)
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test('an xattr that does not parse is ERR_CORRUPT_METADATA naming the workspace directory, never read as empty', async () => {
    const root = freshRoot()
    const pool = await openPool(root, { format })
    const ws = await pool.allocate({ meta: { vm: 'a' } })
    setXattr(ws.path, '{ not json')
    const [info] = await pool.list()
    expect(info.meta).toBeUndefined()
    expect(info.error).toMatchObject({ code: 'ERR_CORRUPT_METADATA', path: ws.path })
    expect(xattrOf(ws.path)).toBe('{ not json')
    await ws.dispose()
    await pool.close()
  })

  test("a template directory's own user.vmspace.meta never becomes the workspace's metadata", async () => {
    const template = freshDir(base()!)
    fs.writeFileSync(path.join(template, 'f'), 'data')
    setXattr(template, '{"meta":{"forged":true}}')
    for (const f of [1, format] as const) {
      const pool = await openPool(freshRoot(), { format: f })
      const ws = await pool.allocate({ template, meta: { own: true } })
      const [info] = await pool.list()
      expect(info.meta).toEqual({ own: true })
      await ws.dispose()
      await pool.close()
    }
  })
})

describe('pool formats', () => {
  test('an existing format-1 pool stays format 1 whatever options.format asks: its metadata stays in files', async () => {
    const root = path.join(freshDir(), 'pool')
    await (await openPool(root)).close()
    const pool = await openPool(root, { format: 3 })
    expect(pool.format).toBe(1)
    const ws = await pool.allocate({ meta: { vm: 'a' } })
    expect(poolState(root)).toEqual({ ...emptyPoolState, visible: [ws.name], meta: [`${ws.name}.json`] })
    expect(JSON.parse(fs.readFileSync(metaPath(root, ws.name), 'utf8'))).toMatchObject({ meta: { vm: 'a' } })
    await ws.dispose()
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test.each([[4, 'ERR_INVALID_ARG_VALUE'], [0, 'ERR_INVALID_ARG_VALUE'], [2.5, 'ERR_INVALID_ARG_VALUE'], ['2', 'ERR_INVALID_ARG_TYPE']])(
    'options.format %j is refused (%s) before anything is made',
    async (format, code) => {
      const root = path.join(freshDir(), 'pool')
      const err = await openPool(root, { format: format as 2 }).catch((e: unknown) => e)
      expect(err).toMatchObject({ code })
      expect(fs.existsSync(root)).toBe(false)
    },
  )
})

describe.each([1, 2, 3] as const)('dispose of an empty workspace (format %i)', (format) => {
  test('removes it and its metadata, leaving nothing in trash', async () => {
    const root = path.join(freshDir(), 'pool')
    const pool = await openPool(root, { format })
    const ws = await pool.allocate({ meta: { vm: 'a' } })
    await ws.dispose()
    expect(ws.status).toBe('disposed')
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test('never removes an empty directory put at its name in its place: ESTALE, that directory left as it was', async () => {
    const root = path.join(freshDir(), 'pool')
    const pool = await openPool(root, { format })
    const ws = await pool.allocate()
    fs.renameSync(ws.path, path.join(root, '.vmspace', 'moved')) // the workspace itself, out of the way
    fs.mkdirSync(ws.path)
    const before = snapshotTree(root)
    const err = await ws.dispose().catch((e: unknown) => e)
    expect(err).toMatchObject({ code: 'ESTALE' })
    expect(ws.status).toBe('unrecoverable')
    expect(fs.statSync(ws.path).isDirectory()).toBe(true)
    expect(snapshotTree(root)).toEqual(before)
    await pool.close()
  })
})

describe('format 3: staging shards', () => {
  const shards = ['s0', 's1', 's2', 's3', 's4', 's5', 's6', 's7']
  const stagingDir = (root: string) => path.join(root, '.vmspace', 'staging')

  test('a new pool has eight shards in .vmspace/staging/, mode 0700; builds leave none of their entries there', async () => {
    const root = path.join(freshDir(), 'pool')
    const pool = await openPool(root, { format: 3 })
    expect(fs.readdirSync(stagingDir(root)).sort()).toEqual(shards)
    for (const s of shards) expect(fs.statSync(path.join(stagingDir(root), s)).mode & 0o7777).toBe(0o700)
    const all = await Promise.all(Array.from({ length: 32 }, (_, i) => pool.allocate({ meta: { i } })))
    expect(new Set(all.map((ws) => ws.name)).size).toBe(32)
    expect((await pool.list()).length).toBe(32)
    await Promise.all(all.map((ws) => ws.dispose()))
    expect(poolState(root)).toEqual(emptyPoolState)
    expect(fs.readdirSync(stagingDir(root)).sort()).toEqual(shards)
    await pool.close()
  })

  test('a warm entry is built in a shard; allocate publishes it from there', async () => {
    const root = path.join(freshDir(), 'pool')
    const template = freshDir()
    fs.writeFileSync(path.join(template, 'f'), 'data')
    const pool = await openPool(root, { format: 3, warm: { template, count: 1 } })
    await eventually(() => pool.warmStats()!.ready >= 1)
    const [entry] = stagingEntries(root)
    expect(entry).toMatch(/^s[0-7]\/vm-[0-9a-f]{32}$/)
    const ws = await pool.allocate({ template })
    expect(fs.readFileSync(path.join(ws.path, 'f'), 'utf8')).toBe('data')
    await ws.dispose()
    await pool.close()
    expect(poolState(root)).toEqual(emptyPoolState)
  })

  test("sweep reclaims a dead build in a shard and one in staging/ itself, and never a shard", async () => {
    const root = path.join(freshDir(), 'pool')
    const pool = await openPool(root, { format: 3 })
    const inShard = `vm-${'a'.repeat(32)}`
    const inStaging = `vm-${'b'.repeat(32)}`
    fs.mkdirSync(path.join(stagingDir(root), 's5', inShard))
    fs.writeFileSync(path.join(stagingDir(root), 's5', inShard, 'f'), 'x')
    fs.mkdirSync(path.join(stagingDir(root), inStaging))
    const young = await pool.sweep()
    expect(young.reclaimed).toEqual([])
    const report = await pool.sweep({ graceMs: 0 })
    expect(report.reclaimed.map((e) => [e.name, e.from]).sort()).toEqual([[inShard, 'staging'], [inStaging, 'staging']])
    expect(report.failed).toEqual([])
    expect(poolState(root)).toEqual(emptyPoolState)
    expect(fs.readdirSync(stagingDir(root)).sort()).toEqual(shards)
    await pool.close()
  })

  test('metadata in a file (too big for the xattr) of a build in a shard is not removed by sweep as an orphan', async () => {
    const root = path.join(freshDir(), 'pool')
    const pool = await openPool(root, { format: 3 })
    const name = `vm-${'c'.repeat(32)}`
    fs.mkdirSync(path.join(stagingDir(root), 's2', name))
    fs.writeFileSync(metaPath(root, name), '{}\n')
    // A sweep with no grace: the build itself is reclaimed (its lease is free), its metadata after it.
    const dry = await pool.sweep({ graceMs: 0, dryRun: true })
    expect(dry.metadataRemoved).toBe(0)
    expect(fs.existsSync(metaPath(root, name))).toBe(true)
    await pool.close()
  })

  test('a shard that is missing is made again when the pool is opened; one another user could write is refused, nothing made or changed', async () => {
    const root = path.join(freshDir(), 'pool')
    await (await openPool(root, { format: 3 })).close()
    fs.rmdirSync(path.join(stagingDir(root), 's3'))
    const pool = await openPool(root)
    expect(pool.format).toBe(3)
    expect(fs.readdirSync(stagingDir(root)).sort()).toEqual(shards)
    await pool.close()
    fs.chmodSync(path.join(stagingDir(root), 's6'), 0o777)
    // Missing pieces are not made when the pool is refused (cold review: s1 and meta/ were made first).
    fs.rmdirSync(path.join(stagingDir(root), 's1'))
    fs.rmdirSync(path.join(root, '.vmspace', 'meta'))
    const before = snapshotTree(root)
    const err = await openPool(root).catch((e: unknown) => e)
    expect(err).toMatchObject({ code: 'ERR_POOL_UNSAFE', path: path.join(stagingDir(root), 's6') })
    expect(snapshotTree(root)).toEqual(before)
  })

  test('an existing format-2 pool stays format 2 when format 3 is asked: no shards are made', async () => {
    const root = path.join(freshDir(), 'pool')
    await (await openPool(root, { format: 2 })).close()
    const pool = await openPool(root, { format: 3 })
    expect(pool.format).toBe(2)
    expect(fs.readdirSync(stagingDir(root))).toEqual([])
    const ws = await pool.allocate()
    await ws.dispose()
    await pool.close()
  })
})

/**
 * The warm reserve (docs/warm.md) and the copy path's writeback option, on the scratch file system (ext4
 * on the dev machines: the copy fallback, whose clones the reserve writes back before handing them out).
 */
import { spawn } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { clone, openPool, VmspaceError, type Pool } from '../lib/index.js'
import { emptyPoolState, eventually, freshDir, getRecord, MiB, poolState, repoRoot, sameContent, writeRandomFile } from './helpers.js'

async function ready(pool: Pool, n: number): Promise<void> {
  await eventually(() => pool.warmStats()!.ready >= n)
}

/**
 * Applies a change to `file` until its ctime shows it: a change within the same timestamp tick as the one before
 * (and of the same size, on the same inode) is one the reserve cannot see (docs/warm.md), and no test relies on timing.
 */
function change(file: string, apply: () => void): void {
  const before = fs.statSync(file, { bigint: true }).ctimeNs
  do apply()
  while (fs.statSync(file, { bigint: true }).ctimeNs === before)
}

/** The record of workspace `name` (its lease file's xattr), parsed. */
function recordOf(root: string, name: string): Record<string, unknown> {
  const record = getRecord(root, name)
  if (record === null) throw new Error(`workspace ${name} has no record`)
  return JSON.parse(record.toString('utf8')) as Record<string, unknown>
}

/** The names of the builds in staging (poolState gives them as "s<i>/<name>"). */
function stagedNames(root: string): string[] {
  return poolState(root).staging.map((e) => e.slice(e.indexOf('/') + 1))
}

describe('warm reserve', () => {
  test('a warm template in the pool\'s workspaces is ERR_INVALID_ARG_VALUE, as allocate\'s; the handle opened for it is closed', async () => {
    const root = path.join(freshDir(), 'pool')
    const pool = await openPool(root)
    const ws = await pool.allocate()
    fs.mkdirSync(path.join(ws.path, 'tree'))
    await expect(openPool(root, { warm: { template: path.join(ws.path, 'tree'), count: 1 } })).rejects.toMatchObject({
      code: 'ERR_INVALID_ARG_VALUE',
      message: expect.stringContaining('options.warm.template'),
    })
    expect(poolState(root).staging).toEqual([])
    await ws.dispose()
    await pool.close()
  })

  test('allocate of the warm template is served from the reserve: the template bytes, own metadata, published name', async () => {
    const dir = freshDir()
    const image = path.join(dir, 'base.img')
    writeRandomFile(image, 3 * MiB + 123)
    const root = path.join(dir, 'pool')
    const pool = await openPool(root, { warm: { template: { 'rootfs.img': image }, count: 2 } })
    await ready(pool, 2)
    // Entries wait in staging, leased, and nothing of them is visible.
    expect(poolState(root)).toMatchObject({ visible: [], trash: [] })
    expect(poolState(root).staging).toHaveLength(2)
    const staged = new Set(stagedNames(root))
    const ws = await pool.allocate({ template: { 'rootfs.img': image }, meta: { vm: 1 } })
    expect(staged.has(ws.name)).toBe(true) // the staging entry itself was published, under its own name
    expect(sameContent(image, path.join(ws.path, 'rootfs.img'))).toBe(true)
    expect(ws.template).toHaveLength(1)
    expect(ws.template[0]).toMatchObject({ path: path.join(ws.path, 'rootfs.img'), bytes: 3 * MiB + 123 })
    const meta = recordOf(root, ws.name)
    expect(meta).toMatchObject({ name: ws.name, meta: { vm: 1 }, pid: process.pid })
    const st = fs.statSync(image)
    expect(meta.template).toEqual([
      expect.objectContaining({ dest: 'rootfs.img', source: image, ino: String(st.ino), size: st.size }),
    ])
    expect(pool.warmStats()).toMatchObject({ count: 2, hits: 1, misses: 0, stale: 0 })
    const [info] = await pool.list()
    expect(info).toMatchObject({ name: ws.name, live: true, meta: { vm: 1 } })
    // Another template, or the same with another mode, is built as without a reserve.
    const other = await pool.allocate({ template: { 'rootfs.img': image }, mode: 0o750 })
    expect(sameContent(image, path.join(other.path, 'rootfs.img'))).toBe(true)
    expect(pool.warmStats()).toMatchObject({ hits: 1, misses: 0 })
    await ws.dispose()
    await other.dispose()
    await pool.close()
    expect(poolState(root)).toEqual(emptyPoolState)
  })

  test('a directory template is served too, and an empty reserve builds fresh (a miss)', async () => {
    const dir = freshDir()
    const tpl = path.join(dir, 'tpl')
    fs.mkdirSync(path.join(tpl, 'sub'), { recursive: true })
    writeRandomFile(path.join(tpl, 'sub', 'a.bin'), 70_000)
    fs.writeFileSync(path.join(tpl, 'b.txt'), 'b')
    const root = path.join(dir, 'pool')
    const pool = await openPool(root, { warm: { template: tpl, count: 1 } })
    await ready(pool, 1)
    const a = await pool.allocate({ template: tpl })
    const b = await pool.allocate({ template: tpl }) // the refill has had no time to finish: built fresh, or served
    for (const ws of [a, b]) {
      expect(sameContent(path.join(tpl, 'sub', 'a.bin'), path.join(ws.path, 'sub', 'a.bin'))).toBe(true)
      expect(fs.readFileSync(path.join(ws.path, 'b.txt'), 'utf8')).toBe('b')
    }
    const s = pool.warmStats()!
    expect(s.hits + s.misses).toBe(2)
    expect(s.hits).toBeGreaterThanOrEqual(1)
    await a.dispose()
    await b.dispose()
    await pool.close()
    expect(poolState(root)).toEqual(emptyPoolState)
  })

  test('a template source changed after the build is never handed out: the stale entry is removed, a fresh one built', async () => {
    const dir = freshDir()
    const image = path.join(dir, 'base.img')
    writeRandomFile(image, 1 * MiB)
    const root = path.join(dir, 'pool')
    const pool = await openPool(root, { warm: { template: { 'rootfs.img': image }, count: 2 } })
    await ready(pool, 2)
    // Rewritten in place, same size: the inode stays, its data (mtime, ctime) changes.
    const fresh = writeRandomFile(path.join(dir, 'new.img'), 1 * MiB)
    change(image, () => fs.writeFileSync(image, fresh))
    const ws = await pool.allocate({ template: { 'rootfs.img': image } })
    expect(fs.readFileSync(path.join(ws.path, 'rootfs.img')).equals(fresh)).toBe(true)
    expect(pool.warmStats()!.stale).toBeGreaterThanOrEqual(1)
    // Replaced by rename (a new inode): the entries built from the rewritten file are stale in turn.
    await ready(pool, 1)
    const third = writeRandomFile(path.join(dir, 'third.img'), 1 * MiB)
    fs.renameSync(path.join(dir, 'third.img'), image)
    const ws2 = await pool.allocate({ template: { 'rootfs.img': image } })
    expect(fs.readFileSync(path.join(ws2.path, 'rootfs.img')).equals(third)).toBe(true)
    // Touched back to its old mtime: the ctime still tells.
    await ready(pool, 1)
    const st = fs.statSync(image)
    const fourth = writeRandomFile(path.join(dir, 'fourth.img'), 1 * MiB)
    change(image, () => {
      fs.writeFileSync(image, fourth)
      fs.utimesSync(image, st.atime, st.mtime)
    })
    const ws3 = await pool.allocate({ template: { 'rootfs.img': image } })
    expect(fs.readFileSync(path.join(ws3.path, 'rootfs.img')).equals(fourth)).toBe(true)
    for (const w of [ws, ws2, ws3]) await w.dispose()
    await pool.close()
    expect(poolState(root)).toEqual(emptyPoolState)
  })

  test('a file changed below a directory template makes its entries stale', async () => {
    const dir = freshDir()
    const tpl = path.join(dir, 'tpl')
    fs.mkdirSync(path.join(tpl, 'deep', 'er'), { recursive: true })
    fs.writeFileSync(path.join(tpl, 'deep', 'er', 'x'), 'old')
    const root = path.join(dir, 'pool')
    const pool = await openPool(root, { warm: { template: tpl, count: 1 } })
    await ready(pool, 1)
    change(path.join(tpl, 'deep', 'er', 'x'), () => fs.writeFileSync(path.join(tpl, 'deep', 'er', 'x'), 'new'))
    const ws = await pool.allocate({ template: tpl })
    expect(fs.readFileSync(path.join(ws.path, 'deep', 'er', 'x'), 'utf8')).toBe('new')
    expect(pool.warmStats()).toMatchObject({ stale: 1, hits: 0, misses: 1 })
    await ws.dispose()
    await pool.close()
    expect(poolState(root)).toEqual(emptyPoolState)
  })

  test('close() stops the refill and leaves nothing; allocate afterwards is ERR_POOL_CLOSED', async () => {
    const dir = freshDir()
    const image = path.join(dir, 'base.img')
    writeRandomFile(image, 2 * MiB)
    const root = path.join(dir, 'pool')
    const pool = await openPool(root, { warm: { template: { 'rootfs.img': image }, count: 3 } })
    await ready(pool, 1) // closed while the others are built or waiting
    const ws = await pool.allocate({ template: { 'rootfs.img': image } })
    await pool.close()
    await pool.close()
    expect(poolState(root)).toEqual({ visible: [ws.name], staging: [], trash: [], leases: [`${ws.id.charAt(0)}/${ws.name}`] })
    await expect(pool.allocate({ template: { 'rootfs.img': image } })).rejects.toMatchObject({ code: 'ERR_POOL_CLOSED' })
    await ws.dispose() // the pool's fds outlive close() for it
    expect(poolState(root)).toEqual(emptyPoolState)
    // Closed at once, before the first entry is ready: nothing either.
    const pool2 = await openPool(root, { warm: { template: { 'rootfs.img': image }, count: 2 } })
    await pool2.close()
    expect(poolState(root)).toEqual(emptyPoolState)
  })

  test('a removed template fails the refill, never allocate of other templates; allocate of it reports ENOENT; back once restored', async () => {
    const dir = freshDir()
    const image = path.join(dir, 'base.img')
    const bytes = writeRandomFile(image, 1 * MiB)
    const root = path.join(dir, 'pool')
    const pool = await openPool(root, { warm: { template: { 'rootfs.img': image }, count: 1 } })
    await ready(pool, 1)
    fs.rmSync(image)
    const err = await pool.allocate({ template: { 'rootfs.img': image } }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ENOENT', path: image })
    await eventually(() => pool.warmStats()!.buildFailures >= 1)
    expect(pool.warmStats()!.lastError).toMatchObject({ code: 'ENOENT' })
    const plain = await pool.allocate({ meta: { x: 1 } })
    expect(fs.readdirSync(plain.path)).toEqual([])
    fs.writeFileSync(image, bytes)
    await ready(pool, 1) // the back-off retries
    const ws = await pool.allocate({ template: { 'rootfs.img': image } })
    expect(fs.readFileSync(path.join(ws.path, 'rootfs.img')).equals(bytes)).toBe(true)
    expect(pool.warmStats()!.lastError).toBeUndefined()
    await plain.dispose()
    await ws.dispose()
    await pool.close()
    expect(poolState(root)).toEqual(emptyPoolState)
  })

  test("a SIGKILLed process's reserve entries stay while it lives and are reclaimed by the next sweep once it is dead, whatever graceMs", async () => {
    const dir = freshDir()
    const image = path.join(dir, 'base.img')
    writeRandomFile(image, 1 * MiB)
    const root = path.join(dir, 'pool')
    const dist = path.join(repoRoot, 'dist', 'index.js')
    const child = spawn(process.execPath, ['--expose-gc', '-e', `
      const v = require(${JSON.stringify(dist)})
      setInterval(() => { globalThis.gc() }, 5) // keeps the process alive, and collects what nothing references
      v.openPool(${JSON.stringify(root)}, { warm: { template: { 'rootfs.img': ${JSON.stringify(image)} }, count: 2 } }).then(async (p) => {
        while (p.warmStats().ready < 2) await new Promise((r) => setTimeout(r, 10))
        console.log('ready') // and p is referenced no more: the reserve keeps it (and its leases) all the same
      })`], { stdio: ['ignore', 'pipe', 'inherit'] })
    const exited = new Promise((r) => child.on('exit', r))
    try {
      await new Promise((r) => child.stdout!.once('data', r))
      const pool = await openPool(root)
      expect(poolState(root).staging).toHaveLength(2)
      const staged = stagedNames(root)
      // Leased: even graceMs 0 leaves them alone. Leased builds are neither reclaimed nor counted live (live counts published workspaces).
      expect(await pool.sweep({ graceMs: 0 })).toEqual({ reclaimed: [], live: 0, failed: [], leasesRemoved: 0, foreign: [] })
      expect(poolState(root).staging).toHaveLength(2)
      child.kill('SIGKILL')
      await exited
      // The lease is the only judge: a build whose lease is free is its dead process's, taken however young (graceMs
      // is for what has no lease).
      const r = await pool.sweep({ graceMs: 3_600_000 })
      expect(r.reclaimed.map((e) => `${e.from}/${e.name}`).sort()).toEqual(staged.map((n) => `staging/${n}`).sort())
      expect(r).toMatchObject({ live: 0, failed: [], leasesRemoved: 0, foreign: [] })
      expect(poolState(root)).toEqual(emptyPoolState)
      await pool.close()
    } finally {
      child.kill('SIGKILL')
    }
  })

  test('options are strict: unknown keys and bad values are ERR_INVALID_ARG_VALUE / ERR_INVALID_ARG_TYPE, nothing made', async () => {
    const dir = freshDir()
    const root = path.join(dir, 'pool')
    const image = path.join(dir, 'base.img')
    writeRandomFile(image, 4096)
    const bad: [unknown, string][] = [
      [{ template: image, count: 1, extra: 1 }, 'ERR_INVALID_ARG_VALUE'],
      [{ template: image }, 'ERR_INVALID_ARG_TYPE'],
      [{ count: 1 }, 'ERR_INVALID_ARG_TYPE'],
      [{ template: image, count: 0 }, 'ERR_INVALID_ARG_VALUE'],
      [{ template: image, count: 65 }, 'ERR_INVALID_ARG_VALUE'],
      [{ template: image, count: 1.5 }, 'ERR_INVALID_ARG_VALUE'],
      [{ template: {}, count: 1 }, 'ERR_INVALID_ARG_VALUE'],
      [{ template: 7, count: 1 }, 'ERR_INVALID_ARG_TYPE'],
      [{ template: image, count: 1, mode: 0o10000 }, 'ERR_INVALID_ARG_VALUE'],
      ['yes', 'ERR_INVALID_ARG_TYPE'],
    ]
    for (const [warm, code] of bad) {
      const err = await openPool(root, { warm } as never).catch((e: unknown) => e)
      expect(err, JSON.stringify(warm)).toMatchObject({ code })
    }
    expect(fs.existsSync(root)).toBe(false)
    const pool = await openPool(root)
    await expect(pool.allocate({ writeback: 'later' } as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
    await expect(pool.allocate({ writebak: 'start' } as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
    await expect(clone(image, path.join(dir, 'c'), { writeback: 1 } as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_TYPE' })
    expect(fs.existsSync(path.join(dir, 'c'))).toBe(false)
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })
})

describe('writeback of copied clones', () => {
  test("writeback 'start' and 'wait' give the same bytes as none, for clone(), allocate and Workspace.clone", async () => {
    const dir = freshDir()
    const image = path.join(dir, 'base.img')
    writeRandomFile(image, 2 * MiB + 5)
    for (const writeback of ['none', 'start', 'wait'] as const) {
      const r = await clone(image, path.join(dir, `c-${writeback}`), { reflink: 'never', writeback })
      expect(r.method).toBe('copy')
      expect(sameContent(image, path.join(dir, `c-${writeback}`))).toBe(true)
    }
    const tree = path.join(dir, 'tree')
    fs.mkdirSync(tree)
    writeRandomFile(path.join(tree, 'f'), 100_000)
    const r = await clone(tree, path.join(dir, 'tree-copy'), { reflink: 'never', writeback: 'wait' })
    expect(r.copied).toBe(1)
    expect(sameContent(path.join(tree, 'f'), path.join(dir, 'tree-copy', 'f'))).toBe(true)
    const pool = await openPool(path.join(dir, 'pool'), { reflink: 'never' })
    const ws = await pool.allocate({ template: { 'rootfs.img': image }, writeback: 'start' })
    expect(sameContent(image, path.join(ws.path, 'rootfs.img'))).toBe(true)
    await ws.clone(image, 'again.img', { reflink: 'never', writeback: 'wait' })
    expect(sameContent(image, path.join(ws.path, 'again.img'))).toBe(true)
    await ws.dispose()
    await pool.close()
  })
})

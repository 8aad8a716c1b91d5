/**
 * Pool format 2 (issue 12): each workspace's metadata is the xattr user.vmspace.meta of its directory, set before
 * the workspace is published, gone with the directory; the file .vmspace/meta/<name>.json where the file system
 * refuses the xattr. And dispose of an empty workspace by rmdir at its name, for either format.
 */
import { execFileSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { openPool } from '../lib/index.js'
import { emptyPoolState, freshDir, metaPath, mounts, poolState, snapshotTree, workspaceChild } from './helpers.js'

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

describe.each(fileSystems)('format 2 on %s', (_label, base) => {
  const freshRoot = () => path.join(freshDir(base()!), 'pool')

  test('a new format-2 pool says 2 in .vmspace/version; metadata is the xattr, nothing in .vmspace/meta/', async () => {
    const root = freshRoot()
    const pool = await openPool(root, { format: 2 })
    expect(pool.format).toBe(2)
    expect(fs.readFileSync(path.join(root, '.vmspace', 'version'), 'utf8')).toBe('2\n')
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
    const pool = await openPool(root, { format: 2 })
    const child = workspaceChild(root) // opens the existing pool: format 2 whatever it asks
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
    const pool = await openPool(root, { format: 2 })
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
    const pool = await openPool(root, { format: 2 })
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
    const pool = await openPool(root, { format: 2 })
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
    for (const format of [1, 2] as const) {
      const pool = await openPool(freshRoot(), { format })
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
    const pool = await openPool(root, { format: 2 })
    expect(pool.format).toBe(1)
    const ws = await pool.allocate({ meta: { vm: 'a' } })
    expect(poolState(root)).toEqual({ ...emptyPoolState, visible: [ws.name], meta: [`${ws.name}.json`] })
    expect(JSON.parse(fs.readFileSync(metaPath(root, ws.name), 'utf8'))).toMatchObject({ meta: { vm: 'a' } })
    await ws.dispose()
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test.each([[3, 'ERR_INVALID_ARG_VALUE'], [0, 'ERR_INVALID_ARG_VALUE'], ['2', 'ERR_INVALID_ARG_TYPE']])(
    'options.format %j is refused (%s) before anything is made',
    async (format, code) => {
      const root = path.join(freshDir(), 'pool')
      const err = await openPool(root, { format: format as 2 }).catch((e: unknown) => e)
      expect(err).toMatchObject({ code })
      expect(fs.existsSync(root)).toBe(false)
    },
  )
})

describe.each([1, 2] as const)('dispose of an empty workspace (format %i)', (format) => {
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

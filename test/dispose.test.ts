/**
 * Workspace.dispose (DESIGN.md, "The pool on disk" and "Safe removal"): the name disappears into trash, the tree
 * is removed without following a symlink or crossing a mount, metadata and lease go; nothing is left. Idempotent.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { openPool, VmspaceError } from '../lib/index.js'
import {
  bindInto,
  Child,
  emptyPoolState,
  fixtures,
  freshDir,
  mounts,
  mountsBeneath,
  needs,
  outsideTree,
  poolState,
  runCommand,
  snapshotTree,
  unprivilegedChildren,
  writeRandomFile,
} from './helpers.js'

async function setup() {
  const dir = freshDir()
  const pool = await openPool(path.join(dir, 'pool'))
  return { dir, pool }
}

describe('dispose', () => {
  test('leaves nothing: no workspace, no trash entry, no metadata, no staging entry', async () => {
    const { dir, pool } = await setup()
    const base = path.join(dir, 'base.img')
    writeRandomFile(base, 64 * 1024)
    const ws = await pool.allocate({ template: { 'images/rootfs.img': base }, meta: { a: 1 } })
    fs.mkdirSync(path.join(ws.path, 'a', 'b', 'c'), { recursive: true })
    fs.writeFileSync(path.join(ws.path, 'a', 'b', 'c', 'f.txt'), 'x')
    fs.symlinkSync('a/b', path.join(ws.path, 'rel-link'))
    await ws.dispose()
    expect(ws.status).toBe('disposed')
    expect(fs.existsSync(ws.path)).toBe(false)
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    expect(pool.stats()).toMatchObject({ allocated: 1, disposed: 1 })
  })

  test('is idempotent: a second dispose resolves and the status stays disposed', async () => {
    const { pool } = await setup()
    const ws = await pool.allocate()
    await ws.dispose()
    await expect(ws.dispose()).resolves.toBeUndefined()
    expect(ws.status).toBe('disposed')
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    expect(pool.stats().disposed).toBe(1)
  })

  test('two concurrent disposes both resolve and remove it once', async () => {
    const { pool } = await setup()
    const ws = await pool.allocate()
    await Promise.all([ws.dispose(), ws.dispose()])
    expect(ws.status).toBe('disposed')
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })

  test('never follows a planted symlink: the outside directories and files it points to survive', async () => {
    const { dir, pool } = await setup()
    const outside = outsideTree(dir)
    const before = snapshotTree(outside)
    const ws = await pool.allocate()
    fs.symlinkSync(outside, path.join(ws.path, 'to-dir'))
    fs.symlinkSync(path.join(outside, 'keep.txt'), path.join(ws.path, 'to-file'))
    fs.mkdirSync(path.join(ws.path, 'nested'))
    fs.symlinkSync(path.join(outside, 'sub'), path.join(ws.path, 'nested', 'to-sub'))
    await ws.dispose()
    expect(snapshotTree(outside)).toEqual(before)
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })

  test('never follows a symlink put in place of the workspace directory itself: the outside directory survives', async () => {
    const { dir, pool } = await setup()
    const outside = outsideTree(dir)
    const before = snapshotTree(outside)
    const ws = await pool.allocate()
    fs.rmdirSync(ws.path)
    fs.symlinkSync(outside, ws.path)
    await expect(ws.dispose()).rejects.toBeInstanceOf(VmspaceError)
    expect(snapshotTree(outside)).toEqual(before)
    expect(fs.readlinkSync(ws.path)).toBe(outside)
  })

  describe.skipIf(!mounts.root)(`with a bind mount inside ${needs('root for mount --bind', !mounts.root && 'not root')}`, () => {
    test('rejects with EBUSY, never crosses the mount, and leaves the workspace unrecoverable in trash', async () => {
      const { dir, pool } = await setup()
      const ws = await pool.allocate()
      const { outside, before } = bindInto(dir, ws.path)
      const trashed = path.join(pool.root, '.vmspace', 'trash', ws.name)
      try {
        const err = await ws.dispose().catch((e: unknown) => e)
        expect(err).toBeInstanceOf(VmspaceError)
        expect(err).toMatchObject({ code: 'EBUSY', errno: -16 })
        expect(ws.status).toBe('unrecoverable')
        expect(ws.cause).toBe(err)
        expect(snapshotTree(outside)).toEqual(before)
        expect(fs.existsSync(ws.path)).toBe(false)
        expect(poolState(pool.root)).toMatchObject({ visible: [], staging: [], trash: [ws.name] })
        // Removal went on around the mount: only the mount point is left in the trashed tree.
        expect(mountsBeneath(trashed)).toEqual([path.join(trashed, 'mnt')])
        expect(fs.readdirSync(trashed)).toEqual(['mnt'])
        await expect(ws.dispose()).rejects.toBe(err)
      } finally {
        runCommand('umount', [path.join(trashed, 'mnt')])
      }
      expect(snapshotTree(outside)).toEqual(before)
    })
  })
})

describe.skipIf(!unprivilegedChildren)(
  `a guest that took every permission off its workspace (chmod 000 on it and below), in a pool of an unprivileged user ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`,
  () => {
    async function run(root: string, mode: string): Promise<unknown> {
      const child = new Child(path.join(fixtures, 'guest-mode-child.cjs'), [root, mode])
      child.proc.stdin!.end()
      const out = await child.next()
      expect(out, child.stderr).toMatchObject({ event: 'done' })
      return out
    }
    function unprivilegedPool(): string {
      const dir = freshDir()
      fs.chmodSync(dir, 0o755)
      const root = path.join(dir, 'pool')
      fs.mkdirSync(root)
      fs.chownSync(root, 65534, 65534)
      return root
    }

    test('is disposed whole: nothing left', async () => {
      const root = unprivilegedPool()
      await run(root, 'dispose')
      expect(poolState(root)).toEqual(emptyPoolState)
    })

    test('an unreadable directory of another place bind-mounted into it (by root) keeps its mode: dispose is EBUSY, and a sweep after the umount leaves nothing', async () => {
      const root = unprivilegedPool()
      // Outside the pool, the unprivileged user's own, mode 000: removal may give rwx back to such a directory of
      // the workspace, never to one mounted there.
      const outside = path.join(path.dirname(root), 'secret')
      fs.mkdirSync(outside)
      fs.writeFileSync(path.join(outside, 'keep'), 'k')
      fs.chownSync(outside, 65534, 65534)
      fs.chmodSync(outside, 0)
      const child = new Child(path.join(fixtures, 'guest-mode-child.cjs'), [root, 'bound'])
      const { path: wsPath } = (await child.expect('allocated')) as unknown as { path: string }
      const bm = path.join(wsPath, 'bm')
      expect(runCommand('mount', ['--bind', outside, bm]).status).toBe(0)
      try {
        child.proc.stdin!.write('go\n')
        expect(await child.next(), child.stderr).toEqual({ event: 'done', code: 'EBUSY' })
        expect(fs.statSync(outside).mode & 0o7777).toBe(0)
      } finally {
        for (const m of mountsBeneath(root)) runCommand('umount', ['-l', m])
      }
      expect(fs.readFileSync(path.join(outside, 'keep'), 'utf8')).toBe('k')
      expect(await run(root, 'sweep')).toEqual({ event: 'done', reclaimed: 1, failed: [] })
      expect(poolState(root)).toEqual(emptyPoolState)
    })

    test('is reclaimed by a sweep once its owner died: nothing left', async () => {
      const root = unprivilegedPool()
      const { name } = (await run(root, 'leave')) as { name: string }
      expect(poolState(root).visible).toEqual([name])
      expect(await run(root, 'sweep')).toEqual({ event: 'done', reclaimed: 1, failed: [] })
      expect(poolState(root)).toEqual(emptyPoolState)
    })
  },
)

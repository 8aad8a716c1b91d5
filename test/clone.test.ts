/**
 * The clone engine for files (DESIGN.md, "Clone engine"): reflink where the file system shares extents (XFS,
 * btrfs), a hole-keeping copy where it does not ('auto'), ERR_REFLINK_UNSUPPORTED leaving nothing ('always'),
 * never a shared extent ('never'). Checked on real file systems: extents by FIEMAP (filefrag), bytes by sha256.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { clone, openPool, VmspaceError } from '../lib/index.js'
import {
  allocatedBytes,
  emptyPoolState,
  freshDir,
  openFdsUnder,
  GiB,
  makeSparseFile,
  MiB,
  mounts,
  poolState,
  readRange,
  needs,
  requireMount,
  sameContent,
  sha256File,
  sharedExtents,
  writeRandomFile,
} from './helpers.js'

/** A directory on ext4 (no reflink): os.tmpdir()'s file system when it is ext4, else the small ext4 loop mount. */
const ext4 = mounts.scratchFsType === 'ext4' ? mounts.scratch : mounts.small
const ext4Missing = `os.tmpdir() is on ${mounts.scratchFsType} and the ext4 loop mount could not be made: ${mounts.missing.small}`

/** Every extent of `file` is shared (and it has some). */
function expectAllShared(file: string): void {
  const e = sharedExtents(file)
  expect(e.extents).toBeGreaterThan(0)
  expect(e.shared).toBe(e.extents)
}

function expectNoneShared(file: string): void {
  const e = sharedExtents(file)
  expect(e.extents).toBeGreaterThan(0)
  expect(e.shared).toBe(0)
}

/** Overwrites `length` bytes of `file` at `offset` in place. */
function scribble(file: string, offset: number, length: number): void {
  const fd = fs.openSync(file, 'r+')
  try {
    fs.writeSync(fd, Buffer.alloc(length, 0xee), 0, length, offset)
    fs.fsyncSync(fd)
  } finally {
    fs.closeSync(fd)
  }
}

const reflinkFileSystems = [
  { label: 'XFS', dir: mounts.xfs, why: mounts.missing.xfs },
  { label: 'btrfs', dir: mounts.btrfs, why: mounts.missing.btrfs },
]

for (const { label, dir, why } of reflinkFileSystems) {
  requireMount(label, dir, why)

  describe.skipIf(!dir)(`on ${label} ${needs(`a loop-mounted ${label}`, !dir && why)}`, () => {
    test('clone() reflinks a file: method reflink, every extent of the clone shared, same bytes', async () => {
      const d = freshDir(dir!)
      const src = path.join(d, 'base.img')
      const dst = path.join(d, 'clone.img')
      writeRandomFile(src, 4 * MiB)
      const r = await clone(src, dst)
      expect(r).toMatchObject({ kind: 'file', method: 'reflink', path: dst, files: 1, bytes: 4 * MiB })
      expectAllShared(dst)
      expect(await sha256File(dst)).toBe(await sha256File(src))
    })

    test('writing a reflinked clone leaves its source byte-identical', async () => {
      const d = freshDir(dir!)
      const src = path.join(d, 'base.img')
      const dst = path.join(d, 'clone.img')
      writeRandomFile(src, 4 * MiB)
      const before = await sha256File(src)
      await clone(src, dst, { reflink: 'always' })
      scribble(dst, 0, 4096)
      scribble(dst, 2 * MiB + 100, 70_000)
      expect(await sha256File(src)).toBe(before)
      expect(await sha256File(dst)).not.toBe(before)
    })

    test('Workspace.clone reflinks into the workspace', async () => {
      const d = freshDir(dir!)
      const src = path.join(d, 'base.img')
      writeRandomFile(src, 2 * MiB)
      const pool = await openPool(path.join(d, 'pool'))
      const ws = await pool.allocate()
      const r = await ws.clone(src, 'disk.img', { reflink: 'always' })
      expect(r).toMatchObject({ kind: 'file', method: 'reflink', path: path.join(ws.path, 'disk.img'), files: 1, bytes: 2 * MiB })
      expectAllShared(path.join(ws.path, 'disk.img'))
      await ws.dispose()
    })

    test('a template is reflinked (reported and recorded as reflink) and writing it leaves the base byte-identical', async () => {
      const d = freshDir(dir!)
      const base = path.join(d, 'base.img')
      writeRandomFile(base, 4 * MiB)
      const before = await sha256File(base)
      const pool = await openPool(path.join(d, 'pool'), { reflink: 'always' })
      const ws = await pool.allocate({ template: { 'rootfs.img': base } })
      const rootfs = path.join(ws.path, 'rootfs.img')
      expect(ws.template).toEqual([expect.objectContaining({ kind: 'file', method: 'reflink', path: rootfs, bytes: 4 * MiB })])
      expect((await pool.list())[0].template).toEqual([expect.objectContaining({ dest: 'rootfs.img', method: 'reflink' })])
      expectAllShared(rootfs)
      scribble(rootfs, MiB, 8192)
      expect(await sha256File(base)).toBe(before)
      await ws.dispose()
    })

    test("reflink: 'never' copies: method copy, no extent shared, same bytes", async () => {
      const d = freshDir(dir!)
      const src = path.join(d, 'base.img')
      const dst = path.join(d, 'copy.img')
      writeRandomFile(src, 2 * MiB)
      const r = await clone(src, dst, { reflink: 'never' })
      expect(r).toMatchObject({ kind: 'file', method: 'copy', path: dst, files: 1, bytes: 2 * MiB })
      expectNoneShared(dst)
      expect(await sha256File(dst)).toBe(await sha256File(src))
    })
  })
}

describe.skipIf(!ext4)(`on ext4 ${needs('os.tmpdir() on ext4 or a loop-mounted ext4', !ext4 && ext4Missing)}`, () => {
  test("'auto' copies a sparse 1 GiB file keeping its holes: method copy, about 1 MiB allocated, same content", async () => {
    const d = freshDir(ext4!)
    const src = path.join(d, 'sparse.img')
    const dst = path.join(d, 'clone.img')
    const data = makeSparseFile(src, GiB, 512 * MiB + 4096, MiB)
    const r = await clone(src, dst)
    expect(r).toMatchObject({ kind: 'file', method: 'copy', path: dst, files: 1, bytes: GiB })
    expect(fs.statSync(dst).size).toBe(GiB)
    expect(allocatedBytes(dst)).toBeGreaterThanOrEqual(MiB)
    expect(allocatedBytes(dst)).toBeLessThanOrEqual(2 * MiB)
    expect(readRange(dst, 512 * MiB + 4096, MiB).equals(data)).toBe(true)
    expect(sameContent(dst, src)).toBe(true)
  })

  test('a clone keeps the mode of its source', async () => {
    const d = freshDir(ext4!)
    const src = path.join(d, 'base.img')
    writeRandomFile(src, 4096, 0o640)
    await clone(src, path.join(d, 'clone.img'))
    expect(fs.statSync(path.join(d, 'clone.img')).mode & 0o7777).toBe(0o640)
  })

  test("'always' rejects with ERR_REFLINK_UNSUPPORTED (the errno as cause) and leaves no destination and no temp file", async () => {
    const d = freshDir(ext4!)
    const src = path.join(d, 'base.img')
    const dst = path.join(d, 'clone.img')
    writeRandomFile(src, 64 * 1024)
    const err = await clone(src, dst, { reflink: 'always' }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ERR_REFLINK_UNSUPPORTED', path: src, dest: dst })
    const cause = (err as Error).cause
    expect(cause).toBeInstanceOf(VmspaceError)
    expect(cause).toMatchObject({ code: 'EOPNOTSUPP', errno: -95 })
    expect(fs.readdirSync(d)).toEqual(['base.img'])
  })

  test("Workspace.clone with 'always' rejects the same way and leaves the workspace empty", async () => {
    const d = freshDir(ext4!)
    const src = path.join(d, 'base.img')
    writeRandomFile(src, 64 * 1024)
    const pool = await openPool(path.join(d, 'pool'))
    const ws = await pool.allocate()
    await expect(ws.clone(src, 'disk.img', { reflink: 'always' })).rejects.toMatchObject({ code: 'ERR_REFLINK_UNSUPPORTED' })
    expect(fs.readdirSync(ws.path)).toEqual([])
    await ws.dispose()
  })

  test("a pool with reflink: 'always' fails allocate with ERR_REFLINK_UNSUPPORTED and leaves nothing", async () => {
    const d = freshDir(ext4!)
    const base = path.join(d, 'base.img')
    writeRandomFile(base, 64 * 1024)
    const pool = await openPool(path.join(d, 'pool'), { reflink: 'always' })
    await expect(pool.allocate({ template: { 'rootfs.img': base } })).rejects.toMatchObject({ code: 'ERR_REFLINK_UNSUPPORTED' })
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })

  test("a template on ext4 is copied under the default 'auto'", async () => {
    const d = freshDir(ext4!)
    const base = path.join(d, 'base.img')
    const data = writeRandomFile(base, 64 * 1024)
    const pool = await openPool(path.join(d, 'pool'))
    const ws = await pool.allocate({ template: { 'rootfs.img': base } })
    expect(ws.template).toEqual([expect.objectContaining({ method: 'copy', bytes: data.length })])
    expect(fs.readFileSync(path.join(ws.path, 'rootfs.img')).equals(data)).toBe(true)
    await ws.dispose()
  })
})

const crossings = [
  { label: 'ext4 -> XFS', from: ext4, to: mounts.xfs, why: ext4 ? mounts.missing.xfs : ext4Missing },
  {
    label: 'XFS -> btrfs',
    from: mounts.xfs,
    to: mounts.btrfs,
    why: [mounts.missing.xfs, mounts.missing.btrfs].filter(Boolean).join('; '),
  },
]

for (const { label, from, to, why } of crossings) {
  describe.skipIf(!from || !to)(`across file systems, ${label} ${needs('both file systems', (!from || !to) && why)}`, () => {
    test("'auto' copies: method copy, same bytes", async () => {
      const src = path.join(freshDir(from!), 'base.img')
      const dst = path.join(freshDir(to!), 'clone.img')
      writeRandomFile(src, 2 * MiB)
      const r = await clone(src, dst)
      expect(r).toMatchObject({ kind: 'file', method: 'copy', path: dst, bytes: 2 * MiB })
      expect(await sha256File(dst)).toBe(await sha256File(src))
    })

    test("'always' rejects with ERR_REFLINK_UNSUPPORTED (cause EXDEV) and leaves nothing in the destination directory", async () => {
      const src = path.join(freshDir(from!), 'base.img')
      const dstDir = freshDir(to!)
      const dst = path.join(dstDir, 'clone.img')
      writeRandomFile(src, 2 * MiB)
      const err = await clone(src, dst, { reflink: 'always' }).catch((e: unknown) => e)
      expect(err).toBeInstanceOf(VmspaceError)
      expect(err).toMatchObject({ code: 'ERR_REFLINK_UNSUPPORTED', path: src, dest: dst })
      expect((err as Error).cause).toMatchObject({ code: 'EXDEV', errno: -18 })
      expect(fs.readdirSync(dstDir)).toEqual([])
    })

    test("Workspace.clone with 'always' from the other file system leaves the workspace empty", async () => {
      const src = path.join(freshDir(from!), 'base.img')
      writeRandomFile(src, 2 * MiB)
      const pool = await openPool(path.join(freshDir(to!), 'pool'))
      const ws = await pool.allocate()
      const err = await ws.clone(src, 'disk.img', { reflink: 'always' }).catch((e: unknown) => e)
      expect(err).toMatchObject({ code: 'ERR_REFLINK_UNSUPPORTED' })
      expect((err as Error).cause).toMatchObject({ code: 'EXDEV' })
      expect(fs.readdirSync(ws.path)).toEqual([])
      await ws.dispose()
    })
  })
}

describe('the source: opened once, file or tree chosen from what was opened', () => {
  test("a missing source is ENOENT from 'open' (path and dest named) and leaves nothing", async () => {
    const dir = freshDir()
    const src = path.join(dir, 'missing.img')
    const dst = path.join(dir, 'out.img')
    const err = await clone(src, dst).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ENOENT', errno: -2, syscall: 'open', path: src, dest: dst })
    expect(fs.readdirSync(dir)).toEqual([])
  })

  test('a symlink given as the source is followed to its file (as cp does): the clone is a regular file with its bytes', async () => {
    const dir = freshDir()
    const target = path.join(dir, 'base.img')
    const link = path.join(dir, 'link.img')
    const dst = path.join(dir, 'out.img')
    writeRandomFile(target, 256 * 1024)
    fs.symlinkSync(target, link)
    const r = await clone(link, dst)
    expect(r).toMatchObject({ kind: 'file', path: dst, bytes: 256 * 1024 })
    expect(fs.lstatSync(dst).isFile()).toBe(true)
    expect(await sha256File(dst)).toBe(await sha256File(target))
  })

  test('Workspace.clone into the workspace itself and below it leaves no fd open and the workspace fd usable', async () => {
    const dir = freshDir()
    const src = path.join(dir, 'base.img')
    writeRandomFile(src, 64 * 1024)
    const pool = await openPool(path.join(dir, 'pool'))
    const ws = await pool.allocate()
    fs.mkdirSync(path.join(ws.path, 'sub'))
    await ws.clone(src, 'first.img') // whatever the first call opens for good (the thread pool) is opened by now
    // The fds of this test's files only: other fds of the process come and go (a child's pipes, vitest's own).
    const fdsBelowDir = () => openFdsUnder(dir + '/').sort()
    const fds = fdsBelowDir()
    // One component: the clone works in the workspace's own fd, which must be neither closed nor leaked.
    for (let i = 0; i < 20; i++) await ws.clone(src, `top-${i}.img`)
    for (let i = 0; i < 5; i++) await ws.clone(src, `sub/nested-${i}.img`)
    expect(fdsBelowDir()).toEqual(fds)
    expect(fs.readdirSync(ws.path).length).toBe(22)
    expect(fs.readdirSync(path.join(ws.path, 'sub')).length).toBe(5)
    expect(await sha256File(path.join(ws.path, 'top-19.img'))).toBe(await sha256File(src))
    await ws.dispose()
    expect(fs.existsSync(ws.path)).toBe(false)
    await pool.close()
  })
})

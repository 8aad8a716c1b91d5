/**
 * Tree clones (DESIGN.md, "Clone engine", Tree): Workspace.clone/clone() of a directory, and Pool.allocate with a
 * directory template (or a map whose values are directories). Checked with independent tools on real file systems:
 * `find -printf` for type/mode/owner/size/nlink/mtime(ns)/link target, `getfattr` for xattrs, sha256 for bytes,
 * `filefrag` (FIEMAP) for shared extents, st_blocks for holes; rollback by what is left on disk.
 *
 * Root-only parts (other owners, security.capability, a char device, the unprivileged child of uid 65534) say so
 * in their names; CI runs as root, so they run there.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterAll, describe, expect, test } from 'vitest'
import { AbortError, clone, openPool, VmspaceError, type CloneResult, type Pool, type Workspace } from '../lib/index.js'
import {
  allocatedBytes,
  Child,
  emptyPoolState,
  fixtures,
  ls,
  MiB,
  mounts,
  needs,
  poolState,
  requireMount,
  runCommand,
  snapshotTree,
  spinCpus,
  stagingEntries,
  tempLeftovers,
  unprivilegedChildren,
  writeRandomFile,
} from './helpers.js'
import { removeScratch } from './setup/mounts.js'
import {
  allPaths,
  contentHashes,
  expectExtentsShared,
  expectSameTree,
  freshTreeDir,
  fullSnapshot,
  KiB,
  makeEveryKindTree,
  makeSocket,
  manyFiles,
  metadataListing,
  must,
  sharedExtentsOf,
  stampTimes,
  type EveryKindTree,
  type TreeCounts,
} from './tree-helpers.js'

/** A directory on ext4 (no reflink): os.tmpdir()'s file system when it is ext4, else the small ext4 loop mount. */
const ext4 = mounts.scratchFsType === 'ext4' ? mounts.scratch : mounts.small
const ext4Missing = `os.tmpdir() is on ${mounts.scratchFsType} and the ext4 loop mount could not be made: ${mounts.missing.small}`

/** The CloneResult a tree clone of `counts` must report. */
function treeResult(counts: TreeCounts, dest: string, method: 'reflink' | 'copy'): CloneResult {
  return {
    kind: 'tree',
    method,
    path: dest,
    files: counts.files,
    bytes: counts.bytes,
    reflinked: method === 'reflink' ? counts.files : 0,
    copied: method === 'copy' ? counts.files : 0,
    dirs: counts.dirs,
    symlinks: counts.symlinks,
    hardlinks: counts.hardlinks,
    fifos: counts.fifos,
    devices: counts.devices,
    skipped: { sockets: counts.sockets, devices: 0 },
  }
}

/** Data is shared with the source on reflink file systems; on ext4 it was copied and the sparse file kept its holes. */
function expectDataArrived(t: EveryKindTree, dst: string, reflink: boolean): void {
  if (reflink) {
    expectExtentsShared(dst, t.dataFiles)
  } else {
    const sparse = path.join(dst, t.sparse.rel)
    expect(fs.statSync(sparse).size).toBe(t.sparse.size)
    expect(allocatedBytes(sparse)).toBeGreaterThanOrEqual(t.sparse.data)
    expect(allocatedBytes(sparse)).toBeLessThanOrEqual(t.sparse.data + 64 * KiB)
  }
}

const privileged = mounts.root

/**
 * One every-kind tree per file system, made on first use and shared by the tests that only read it (making one
 * costs about a second): the test 'writing into the clone ... never changes the source' checks that no clone
 * disturbs it. Removed after the file's tests.
 */
const sharedTrees = new Map<string, EveryKindTree>()
const sharedDirs: string[] = []
afterAll(() => {
  for (const dir of sharedDirs.splice(0)) {
    runCommand('chmod', ['-R', 'u+rwX', dir])
    removeScratch(dir)
  }
})
async function sharedTree(base: string): Promise<EveryKindTree> {
  let t = sharedTrees.get(base)
  if (!t) {
    const dir = fs.mkdtempSync(path.join(base, 'vmspace-shared-tree-'))
    sharedDirs.push(dir)
    fs.chmodSync(dir, 0o755)
    t = await makeEveryKindTree(dir, { privileged })
    sharedTrees.set(base, t)
  }
  return t
}
const privilegedNote = privileged
  ? '(as root: with other owners, security.capability, a char device)'
  : '(not root: without other owners, security.capability, char device)'

const fileSystems = [
  { label: 'XFS', dir: mounts.xfs, why: mounts.missing.xfs, reflink: true },
  { label: 'btrfs', dir: mounts.btrfs, why: mounts.missing.btrfs, reflink: true },
  { label: 'ext4', dir: ext4, why: ext4 ? undefined : ext4Missing, reflink: false },
]

for (const { label, dir, why, reflink } of fileSystems) {
  if (label !== 'ext4') requireMount(label, dir, why)
  const method = reflink ? 'reflink' : 'copy'

  describe.skipIf(!dir)(`a tree with every kind of entry on ${label} ${needs(label, !dir && why)}`, () => {
    test(`clone() recreates it exactly: metadata, xattrs, bytes, hard links; counts exact; method ${method} ${privilegedNote}`, async () => {
      const d = freshTreeDir(dir!)
      const t = await sharedTree(dir!)
      const dst = path.join(d, 'copy')
      const r = await clone(t.root, dst)
      expect(r).toEqual(treeResult(t.expected, dst, method))
      expectSameTree(t.root, dst)
      expectDataArrived(t, dst, reflink)
      expect(tempLeftovers(d)).toEqual([])
      expect(fs.existsSync(path.join(dst, 'sock'))).toBe(false)
    })

    test(`Workspace.clone(dir) (dest: the basename) recreates it exactly, kind 'tree' ${privilegedNote}`, async () => {
      const d = freshTreeDir(dir!)
      const t = await sharedTree(dir!)
      const pool = await openPool(path.join(d, 'pool'))
      const ws = await pool.allocate()
      const r = await ws.clone(t.root)
      const dst = path.join(ws.path, 'tree')
      expect(r).toEqual(treeResult(t.expected, dst, method))
      expectSameTree(t.root, dst)
      expectDataArrived(t, dst, reflink)
      expect(ls(ws.path)).toEqual(['tree'])
      expect(pool.stats().clones).toEqual(reflink ? { reflink: t.expected.files, copy: 0 } : { reflink: 0, copy: t.expected.files })
      await ws.dispose()
    })

    test(`allocate({ template: dir }): its contents become the workspace's, reported and recorded as kind 'tree' ${privilegedNote}`, async () => {
      const d = freshTreeDir(dir!)
      const t = await sharedTree(dir!)
      const pool = await openPool(path.join(d, 'pool'))
      const ws = await pool.allocate({ template: t.root })
      expect(ws.template).toEqual([treeResult(t.expected, ws.path, method)])
      expectSameTree(t.root, ws.path, { root: false })
      expectDataArrived(t, ws.path, reflink)
      // The workspace directory keeps its own metadata (mode 0700), not the template root's.
      expect(fs.statSync(ws.path).mode & 0o7777).toBe(0o700)
      const [info] = await pool.list()
      expect(info.template).toEqual([expect.objectContaining({ dest: '', source: t.root, kind: 'tree', method })])
      expect(poolState(pool.root).staging).toEqual([])
      await ws.dispose()
    })

    test(`allocate({ template: { 'images/base': dir, 'disk.img': file } }): a map whose values are a directory and a file ${privilegedNote}`, async () => {
      const d = freshTreeDir(dir!)
      const t = await sharedTree(dir!)
      const disk = path.join(d, 'disk.img')
      writeRandomFile(disk, 256 * KiB)
      const pool = await openPool(path.join(d, 'pool'))
      const ws = await pool.allocate({ template: { 'images/base': t.root, 'disk.img': disk } })
      const base = path.join(ws.path, 'images', 'base')
      expect(ws.template).toEqual([
        treeResult(t.expected, base, method),
        expect.objectContaining({ kind: 'file', method, path: path.join(ws.path, 'disk.img'), files: 1, bytes: 256 * KiB }),
      ])
      expectSameTree(t.root, base) // the tree's own root metadata too
      expectDataArrived(t, base, reflink)
      expect(ls(ws.path)).toEqual(['disk.img', 'images'])
      expect(ls(path.join(ws.path, 'images'))).toEqual(['base'])
      const [info] = await pool.list()
      expect(info.template).toEqual([
        expect.objectContaining({ dest: 'images/base', source: t.root, kind: 'tree', method }),
        expect.objectContaining({ dest: 'disk.img', source: disk, kind: 'file', method }),
      ])
      await ws.dispose()
    })

    test('writing into the clone (data, hard link, modes, xattrs, new and removed entries) never changes the source', async () => {
      const d = freshTreeDir(dir!)
      const t = await sharedTree(dir!)
      const before = fullSnapshot(t.root)
      const dst = path.join(d, 'copy')
      await clone(t.root, dst)
      const at = (rel: string) => path.join(dst, rel)
      fs.appendFileSync(at('data/a.bin'), 'appended')
      const fd = fs.openSync(at(t.sparse.rel), 'r+')
      fs.writeSync(fd, Buffer.alloc(8192, 0xee), 0, 8192, 8 * MiB + 100) // inside the shared data
      fs.writeSync(fd, Buffer.alloc(4096, 0xdd), 0, 4096, MiB) // into the hole
      fs.closeSync(fd)
      fs.writeFileSync(at('nested/two'), 'through the second link')
      fs.truncateSync(at('data/deep/deeper/c.bin'), 10)
      fs.chmodSync(at('bin/suid'), 0o700)
      fs.chmodSync(at('ro'), 0o755)
      fs.writeFileSync(at('ro/f'), 'written')
      fs.writeFileSync(at('ro/new'), 'new')
      fs.unlinkSync(at('empty'))
      fs.mkdirSync(at('data/newdir'))
      fs.symlinkSync('x', at('data/newlink'))
      fs.utimesSync(at('data'), 1, 1)
      must('setfattr', ['-n', 'user.note', '-v', 'changed', at('data/a.bin')])
      must('setfattr', ['-x', 'user.rootdir', dst])
      if (privileged) {
        fs.chownSync(at('owned/f'), 0, 0)
        must('setcap', ['-r', at('bin/cap')])
      }
      expect(fullSnapshot(t.root)).toEqual(before)
      // The clone did change (a sanity check of the writes above).
      expect(fs.readFileSync(at('links/one'), 'utf8')).toBe('through the second link')
    })
  })
}

describe.skipIf(!privileged)(`as root, kept: other owners, security.capability, the char device ${needs('root', !privileged && 'not root')}`, () => {
  test('getcap, stat and the listing show them on the clone', async () => {
    const t = await sharedTree(mounts.xfs ?? mounts.scratch)
    const dst = path.join(freshTreeDir(mounts.xfs ?? mounts.scratch), 'copy')
    const r = await clone(t.root, dst)
    expect(r).toMatchObject({ devices: 1, skipped: { sockets: 1, devices: 0 } })
    expect.soft(must('getcap', [path.join(dst, 'bin/cap')])).toMatch(/cap_net_raw[=+]ep/)
    const nul = fs.lstatSync(path.join(dst, 'null'))
    expect.soft(nul.isCharacterDevice()).toBe(true)
    expect.soft(nul.rdev).toBe(fs.lstatSync('/dev/null').rdev)
    expect.soft(fs.lstatSync(path.join(dst, 'owned/f'))).toMatchObject({ uid: 1234, gid: 5678 })
    expect.soft(fs.lstatSync(path.join(dst, 'owned/link'))).toMatchObject({ uid: 1234, gid: 5678 })
    expect.soft(fs.lstatSync(path.join(dst, 'owned/empty-dir'))).toMatchObject({ uid: 4321, gid: 8765 })
    // chown clears setuid; it is set again after the owner.
    expect.soft(fs.lstatSync(path.join(dst, 'bin/suid'))).toMatchObject({ uid: 1234, gid: 5678, mode: 0o104755 })
    expect.soft(must('getfattr', ['-n', 'trusted.t', '--only-values', path.join(dst, 'data/b.bin')])).toBe('root only')
  })
})

// The walk raises its thread limit above the CPU count when its threads wait on run queues as long as they run
// (native/core/tree.cc, CpuWait): one spinning process per CPU makes that likely. Whether it rose is not asserted
// (that is timing); what is: the same tree, exact counts, nothing left over.
describe.skipIf(!mounts.xfs)(`tree clone while other processes keep every CPU busy ${needs('XFS', !mounts.xfs && mounts.missing.xfs)}`, () => {
  test('3,000 files in 60 directories: the same tree, counts exact, no temp left; the same again into a workspace', async () => {
    const d = freshTreeDir(mounts.xfs!)
    const src = path.join(d, 'src')
    manyFiles(src, 3000, 3000, 50)
    const spinners = spinCpus()
    try {
      const dst = path.join(d, 'copy')
      const r = await clone(src, dst, { reflink: 'always' })
      expect(r).toMatchObject({ kind: 'tree', method: 'reflink', files: 3000, bytes: 3000 * 3000, reflinked: 3000, copied: 0, dirs: 60 })
      expect(metadataListing(dst)).toEqual(metadataListing(src))
      expect(contentHashes(dst)).toEqual(contentHashes(src))
      const pool = await openPool(path.join(d, 'pool'))
      const ws = await pool.allocate({ template: src })
      expect(ws.template?.[0]).toMatchObject({ files: 3000, dirs: 60, reflinked: 3000 })
      expect(metadataListing(ws.path, { root: false })).toEqual(metadataListing(src, { root: false }))
      expect(contentHashes(ws.path)).toEqual(contentHashes(src))
      await ws.dispose()
      await pool.close()
      expect(tempLeftovers(d)).toEqual([])
    } finally {
      for (const p of spinners) p.kill('SIGKILL')
    }
  }, 120_000)
})

describe('symlinks are copied as links and never followed', () => {
  test('links to a directory (absolute, relative) and a file outside: the result has the links, nothing from outside, nothing outside read', async () => {
    const d = freshTreeDir(mounts.scratch)
    const outside = path.join(d, 'outside')
    fs.mkdirSync(path.join(outside, 'private'), { recursive: true })
    writeRandomFile(path.join(outside, 'private', 'secret'), 8 * KiB)
    fs.chmodSync(path.join(outside, 'private'), 0o000)
    // A huge (sparse) file and many entries: following the link would show in the result's counts and time.
    const huge = fs.openSync(path.join(outside, 'huge.img'), 'w')
    fs.ftruncateSync(huge, 64 * 1024 * MiB)
    fs.closeSync(huge)
    manyFiles(path.join(outside, 'many'), 300, 10)
    // Old atimes: under relatime, any read or directory listing of them would move the atime forward. They are
    // set after the listing of the paths, and read back by stat alone (no readdir).
    const outsidePaths = [outside, ...allPaths(outside).map((rel) => path.join(outside, rel))]
    runCommand('touch', ['-a', '-h', '-d', '2000-01-01 00:00:00', '--', ...outsidePaths])
    const atimes = () => outsidePaths.map((p) => `${fs.lstatSync(p, { bigint: true }).atimeNs} ${p}`)
    const atimesBefore = atimes()
    expect(atimesBefore[0]).toMatch(/^946684800000000000 /)

    const src = path.join(d, 'src')
    fs.mkdirSync(path.join(src, 'sub'), { recursive: true })
    fs.writeFileSync(path.join(src, 'real.txt'), 'real')
    fs.symlinkSync(outside, path.join(src, 'abs-dir'))
    fs.symlinkSync('../../outside', path.join(src, 'sub', 'rel-dir'))
    fs.symlinkSync(path.join(outside, 'huge.img'), path.join(src, 'huge-link'))
    fs.symlinkSync('.', path.join(src, 'self'))
    fs.symlinkSync('loop-b', path.join(src, 'loop-a'))
    fs.symlinkSync('loop-a', path.join(src, 'loop-b'))

    const dst = path.join(d, 'dst')
    const r = await clone(src, dst)
    expect(r).toMatchObject({ kind: 'tree', files: 1, bytes: 4, dirs: 1, symlinks: 6, hardlinks: 0 })
    expect(allPaths(dst)).toEqual(['abs-dir', 'huge-link', 'loop-a', 'loop-b', 'real.txt', 'self', 'sub', 'sub/rel-dir'])
    for (const [rel, target] of [
      ['abs-dir', outside],
      ['sub/rel-dir', '../../outside'],
      ['huge-link', path.join(outside, 'huge.img')],
      ['self', '.'],
      ['loop-a', 'loop-b'],
    ]) {
      expect(fs.lstatSync(path.join(dst, rel)).isSymbolicLink()).toBe(true)
      expect(fs.readlinkSync(path.join(dst, rel))).toBe(target)
    }
    expect(atimes()).toEqual(atimesBefore)
  })

  test('a source given as a symlink to a directory is followed (as cp does); the links inside are not', async () => {
    const d = freshTreeDir(mounts.scratch)
    const real = path.join(d, 'real')
    fs.mkdirSync(real)
    fs.writeFileSync(path.join(real, 'f'), 'f')
    fs.symlinkSync(d, path.join(real, 'up'))
    fs.symlinkSync(real, path.join(d, 'link'))
    const r = await clone(path.join(d, 'link'), path.join(d, 'dst'))
    expect(r).toMatchObject({ kind: 'tree', files: 1, symlinks: 1, dirs: 0 })
    expect(allPaths(path.join(d, 'dst'))).toEqual(['f', 'up'])
  })
})

describe('hard links', () => {
  test('a pair inside becomes a pair; a file linked only from outside becomes a plain file; a triple with two inside becomes a pair', async () => {
    const d = freshTreeDir(mounts.scratch)
    const src = path.join(d, 'src')
    for (const sub of ['a', 'b', 'c', 'e']) fs.mkdirSync(path.join(src, sub), { recursive: true })
    writeRandomFile(path.join(src, 'a', 'one'), 10 * KiB)
    fs.linkSync(path.join(src, 'a', 'one'), path.join(src, 'b', 'two'))
    writeRandomFile(path.join(src, 'c', 'loner'), 3 * KiB)
    fs.linkSync(path.join(src, 'c', 'loner'), path.join(d, 'outside-link'))
    writeRandomFile(path.join(src, 'e', 'x'), 5 * KiB)
    fs.linkSync(path.join(src, 'e', 'x'), path.join(src, 'y'))
    fs.linkSync(path.join(src, 'e', 'x'), path.join(d, 'outside-x'))
    const dst = path.join(d, 'dst')
    const r = await clone(src, dst)
    expect(r).toMatchObject({ kind: 'tree', files: 3, bytes: 18 * KiB, hardlinks: 2, dirs: 4, symlinks: 0 })
    const st = (rel: string) => fs.lstatSync(path.join(dst, rel))
    expect(st('b/two').ino).toBe(st('a/one').ino)
    expect(st('a/one').nlink).toBe(2)
    expect(st('a/one').ino).not.toBe(fs.lstatSync(path.join(src, 'a', 'one')).ino)
    expect(st('c/loner').nlink).toBe(1)
    expect(st('y').ino).toBe(st('e/x').ino)
    expect(st('e/x').nlink).toBe(2)
    expect(contentHashes(dst)).toEqual(contentHashes(src))
    // The source's links are as they were.
    expect(fs.lstatSync(path.join(src, 'c', 'loner')).nlink).toBe(2)
    expect(fs.lstatSync(path.join(src, 'y')).nlink).toBe(3)
  })

  test('a hard-link pair in a directory template is a pair in the workspace', async () => {
    const d = freshTreeDir(mounts.scratch)
    const src = path.join(d, 'src')
    fs.mkdirSync(path.join(src, 'x'), { recursive: true })
    writeRandomFile(path.join(src, 'one'), 4 * KiB)
    fs.linkSync(path.join(src, 'one'), path.join(src, 'x', 'two'))
    const pool = await openPool(path.join(d, 'pool'))
    const ws = await pool.allocate({ template: src })
    expect(ws.template[0]).toMatchObject({ files: 1, hardlinks: 1, bytes: 4 * KiB })
    expect(fs.lstatSync(path.join(ws.path, 'x', 'two')).ino).toBe(fs.lstatSync(path.join(ws.path, 'one')).ino)
    await ws.dispose()
  })
})

describe('overwrite', () => {
  function oldTree(dst: string): void {
    fs.mkdirSync(path.join(dst, 'old-dir'), { recursive: true })
    fs.writeFileSync(path.join(dst, 'old-dir', 'old.txt'), 'old')
    fs.writeFileSync(path.join(dst, 'same-name'), 'old contents')
    fs.chmodSync(path.join(dst, 'old-dir'), 0o555)
  }
  function newTree(src: string): void {
    fs.mkdirSync(path.join(src, 'new-dir'), { recursive: true })
    fs.writeFileSync(path.join(src, 'new-dir', 'new.txt'), 'new')
    fs.writeFileSync(path.join(src, 'same-name'), 'new contents')
  }

  test('overwrite: true replaces an existing tree: old contents gone, no temp left', async () => {
    const d = freshTreeDir(mounts.scratch)
    const [src, dst] = [path.join(d, 'src'), path.join(d, 'dst')]
    newTree(src)
    oldTree(dst)
    const r = await clone(src, dst, { overwrite: true })
    expect(r).toMatchObject({ kind: 'tree', path: dst, files: 2, dirs: 1 })
    expect(allPaths(dst)).toEqual(['new-dir', 'new-dir/new.txt', 'same-name'])
    expect(fs.readFileSync(path.join(dst, 'same-name'), 'utf8')).toBe('new contents')
    expect(metadataListing(dst)).toEqual(metadataListing(src))
    expect(ls(d)).toEqual(['dst', 'src'])
  })

  test('without overwrite: EEXIST, the existing tree untouched, no temp left', async () => {
    const d = freshTreeDir(mounts.scratch)
    const [src, dst] = [path.join(d, 'src'), path.join(d, 'dst')]
    newTree(src)
    oldTree(dst)
    const before = snapshotTree(dst)
    const listingBefore = metadataListing(dst)
    const err = await clone(src, dst).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'EEXIST', errno: -17, path: src, dest: dst })
    expect(snapshotTree(dst)).toEqual(before)
    expect(metadataListing(dst)).toEqual(listingBefore)
    expect(ls(d)).toEqual(['dst', 'src'])
  })

  test('Workspace.clone: overwrite replaces a tree in the workspace; without it EEXIST leaves it', async () => {
    const d = freshTreeDir(mounts.scratch)
    const src = path.join(d, 'src')
    newTree(src)
    const pool = await openPool(path.join(d, 'pool'))
    const ws = await pool.allocate()
    const dst = path.join(ws.path, 'app')
    oldTree(dst)
    const before = snapshotTree(dst)
    await expect(ws.clone(src, 'app')).rejects.toMatchObject({ code: 'EEXIST' })
    expect(snapshotTree(dst)).toEqual(before)
    await ws.clone(src, 'app', { overwrite: true })
    expect(allPaths(dst)).toEqual(['new-dir', 'new-dir/new.txt', 'same-name'])
    expect(ls(ws.path)).toEqual(['app'])
    await ws.dispose()
  })

  test('overwrite of a symlink to an outside directory replaces the link; the outside directory is untouched', async () => {
    const d = freshTreeDir(mounts.scratch)
    const [src, dst, outside] = [path.join(d, 'src'), path.join(d, 'dst'), path.join(d, 'outside')]
    newTree(src)
    oldTree(outside)
    const before = snapshotTree(outside)
    fs.symlinkSync(outside, dst)
    await clone(src, dst, { overwrite: true })
    expect(fs.lstatSync(dst).isDirectory()).toBe(true)
    expect(allPaths(dst)).toEqual(['new-dir', 'new-dir/new.txt', 'same-name'])
    expect(snapshotTree(outside)).toEqual(before)
    expect(ls(d)).toEqual(['dst', 'outside', 'src'])
  })
})

describe('onProgress', () => {
  test('running totals { files, bytes } never decrease and never exceed the result', async () => {
    const d = freshTreeDir(mounts.scratch)
    const src = path.join(d, 'src')
    // Grown until the clone lasts long enough for the 100 ms progress timer to report at least twice (no timing
    // is asserted: a faster machine only means a bigger tree).
    let events: { files: number; bytes: number }[] = []
    let r: CloneResult | undefined
    let total = 0
    for (let attempt = 0, add = 4000; attempt < 5 && events.length < 2; attempt++, add *= 2) {
      manyFiles(src, add, 1024, 200, total)
      total += add
      const dst = path.join(d, `dst${attempt}`)
      events = []
      r = await clone(src, dst, { reflink: 'never', onProgress: (p) => events.push(p) })
      fs.rmSync(dst, { recursive: true })
    }
    expect(events.length).toBeGreaterThanOrEqual(2)
    expect(r).toMatchObject({ files: total, bytes: total * 1024 })
    for (const [i, e] of events.entries()) {
      expect(Object.keys(e).sort()).toEqual(['bytes', 'files'])
      expect(e.files).toBeLessThanOrEqual(r!.files)
      expect(e.bytes).toBeLessThanOrEqual(r!.bytes)
      if (i > 0) {
        expect(e.files).toBeGreaterThanOrEqual(events[i - 1].files)
        expect(e.bytes).toBeGreaterThanOrEqual(events[i - 1].bytes)
      }
    }
  })
})

// ---- failures leave nothing ----

/** Nothing of a failed clone into `parent`: only the names that were there before, no `.vmspace-tmp-*`. */
function expectNothingLeft(parent: string, before: string[]): void {
  expect(tempLeftovers(parent)).toEqual([])
  expect(ls(parent)).toEqual(before)
}

/** Nothing of a failed allocate: no staging entry, no lease file (temp ones included), no visible workspace, nothing in trash. */
function expectPoolEmpty(pool: Pool): void {
  expect(poolState(pool.root)).toEqual(emptyPoolState)
}

describe('AbortSignal', () => {
  /**
   * Runs `start(signal, onProgress)` on a tree of thousands of small files, aborting from the first progress
   * report (or, for allocate, which has no onProgress, once its staging entry has contents). The tree grows and
   * the attempt is repeated while the clone finishes before the first report (a fast machine), so nothing depends
   * on timing. Returns the rejection and what was seen when aborting.
   */
  async function abortMidWalk(
    src: string,
    start: (signal: AbortSignal, onProgress: (p: { files: number; bytes: number }) => void) => Promise<unknown>,
    opts: { cleanup: (value: unknown) => void | Promise<void>; stagingOf?: string /* a pool's root */ },
  ): Promise<{ err: unknown; seen: { files: number; bytes: number }; total: number }> {
    let total = 0
    for (let attempt = 0, add = 3000; attempt < 5; attempt++, add *= 2) {
      manyFiles(src, add, 100, 100, total)
      total += add
      const ac = new AbortController()
      let seen: { files: number; bytes: number } | undefined
      const onProgress = (p: { files: number; bytes: number }) => {
        if (!seen) {
          seen = p
          ac.abort()
        }
      }
      let settled = false
      const p = start(ac.signal, onProgress).then(
        (value: unknown) => ({ ok: true, value, err: undefined as unknown }),
        (err: unknown) => ({ ok: false, value: undefined as unknown, err }),
      )
      void p.finally(() => (settled = true)) // p never rejects: both outcomes are mapped above
      if (opts.stagingOf) {
        // Poll the staging shards for the workspace being built; abort once something is in it.
        const staging = path.join(opts.stagingOf, '.vmspace', 'staging')
        while (!settled && !seen) {
          const names = stagingEntries(opts.stagingOf) // "s<i>/<name>"
          if (names.length === 1) {
            const inside = ls(path.join(staging, names[0]))
            if (inside.length > 0) onProgress({ files: -1, bytes: inside.length })
          }
          if (!seen) await new Promise((res) => setTimeout(res, 2))
        }
      }
      const outcome = await p
      if (outcome.ok) {
        await opts.cleanup(outcome.value) // finished before the first report: a bigger tree
        continue
      }
      return { err: outcome.err, seen: seen!, total }
    }
    throw new Error('the clone always finished before it could be aborted')
  }

  test('clone(): an abort from the first onProgress call rejects with AbortError mid-walk and leaves nothing', async () => {
    const d = freshTreeDir(mounts.scratch)
    const src = path.join(d, 'src')
    const dst = path.join(d, 'dst')
    const { err, seen, total } = await abortMidWalk(src, (signal, onProgress) => clone(src, dst, { signal, onProgress }), {
      cleanup: () => fs.rmSync(dst, { recursive: true }),
    })
    expect(err).toBeInstanceOf(AbortError)
    expect(err).toMatchObject({ name: 'AbortError', code: 'ABORT_ERR' })
    expect(seen.files).toBeGreaterThan(0)
    expect(seen.files).toBeLessThan(total)
    expectNothingLeft(d, ['src'])
  })

  for (const kind of ['a throw from', 'a rejection of an async'] as const) {
    test(`clone(): ${kind} onProgress cancels the clone like an abort: it rejects with that exception and leaves nothing`, async () => {
      const d = freshTreeDir(mounts.scratch)
      const src = path.join(d, 'src')
      const dst = path.join(d, 'dst')
      const boom = new Error('progress bar broke')
      const { err } = await abortMidWalk(
        src,
        (_signal, onProgress) =>
          clone(src, dst, {
            onProgress:
              // eslint-disable-next-line @typescript-eslint/no-misused-promises -- the async callback's rejection is tested
              kind === 'a throw from'
                ? (p) => {
                    onProgress(p)
                    throw boom
                  }
                : async (p) => {
                    onProgress(p)
                    await Promise.resolve()
                    throw boom
                  },
          }),
        { cleanup: () => fs.rmSync(dst, { recursive: true }) },
      )
      expect(err).toBe(boom)
      expectNothingLeft(d, ['src'])
    })
  }

  test('Workspace.clone: the same abort leaves the workspace empty', async () => {
    const d = freshTreeDir(mounts.scratch)
    const src = path.join(d, 'src')
    const pool = await openPool(path.join(d, 'pool'))
    const ws = await pool.allocate()
    const { err } = await abortMidWalk(src, (signal, onProgress) => ws.clone(src, 'app', { signal, onProgress }), {
      cleanup: () => fs.rmSync(path.join(ws.path, 'app'), { recursive: true }),
    })
    expect(err).toMatchObject({ name: 'AbortError' })
    expect(ls(ws.path)).toEqual([])
    await ws.dispose()
  })

  for (const form of ['dir', 'map'] as const) {
    test(`allocate({ template: ${form === 'dir' ? 'dir' : "{ 'app': dir }"} }): an abort while the template is being cloned leaves no staging entry, no lease file, no workspace`, async () => {
      const d = freshTreeDir(mounts.scratch)
      const src = path.join(d, 'src')
      const pool = await openPool(path.join(d, 'pool'))
      const { err, seen } = await abortMidWalk(
        src,
        (signal) => pool.allocate({ template: form === 'dir' ? src : { app: src }, signal }),
        {
          stagingOf: pool.root,
          cleanup: (ws) => (ws as Workspace).dispose(),
        },
      )
      expect(err).toBeInstanceOf(AbortError)
      expect(seen.bytes).toBeGreaterThan(0) // the staging entry had contents when the abort came
      expectPoolEmpty(pool)
    })
  }
})

describe.skipIf(!mounts.small)(`ENOSPC on a small ext4 ${needs('a small loop-mounted ext4', mounts.missing.small)}`, () => {
  /** A tree of 80 MiB of data (more than the 64 MiB file system holds) on the scratch file system. */
  function bigTree(d: string): string {
    const src = path.join(d, 'src')
    fs.mkdirSync(path.join(src, 'small'), { recursive: true })
    for (let i = 0; i < 20; i++) fs.writeFileSync(path.join(src, 'small', `s${i}`), `small ${i}`)
    fs.mkdirSync(path.join(src, 'big', 'deeper'), { recursive: true })
    for (let i = 0; i < 10; i++) fs.writeFileSync(path.join(src, 'big', i % 2 ? 'deeper' : '', `b${i}`), Buffer.alloc(8 * MiB, i + 1))
    return src
  }

  test('clone(): ENOSPC; no temp tree, no destination', async () => {
    const src = bigTree(freshTreeDir(mounts.scratch))
    const parent = freshTreeDir(mounts.small!)
    const err = await clone(src, path.join(parent, 'dst')).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ENOSPC', errno: -28 })
    expectNothingLeft(parent, [])
  })

  test('clone(): the ENOSPC error names the failing source entry (path) and its destination (dest), as fs.ts documents', async () => {
    const src = bigTree(freshTreeDir(mounts.scratch))
    const dst = path.join(freshTreeDir(mounts.small!), 'dst')
    const e = (await clone(src, dst).catch((e: unknown) => e)) as VmspaceError
    expect(e).toMatchObject({ code: 'ENOSPC' })
    // lib/clone.ts, clone(): "or the errno of the entry that failed (`path`: that source entry, `dest`: its
    // destination)"; the EACCES tests below see exactly that.
    expect(e.path, e.message).toMatch(new RegExp(`^${src}/big/`))
    expect(e.dest, e.message).toBe(path.join(dst, path.relative(src, e.path!)))
  })

  test('Workspace.clone: ENOSPC leaves the workspace empty', async () => {
    const src = bigTree(freshTreeDir(mounts.scratch))
    const pool = await openPool(path.join(freshTreeDir(mounts.small!), 'pool'))
    const ws = await pool.allocate()
    await expect(ws.clone(src, 'app')).rejects.toMatchObject({ code: 'ENOSPC' })
    expect(ls(ws.path)).toEqual([])
    await ws.dispose()
  })

  for (const form of ['dir', 'map'] as const) {
    test(`allocate({ template: ${form === 'dir' ? 'dir' : "{ 'a/b': dir }"} }): ENOSPC leaves no staging entry, no lease file, no workspace`, async () => {
      const src = bigTree(freshTreeDir(mounts.scratch))
      const pool = await openPool(path.join(freshTreeDir(mounts.small!), 'pool'))
      const err = await pool.allocate({ template: form === 'dir' ? src : { 'a/b': src } }).catch((e: unknown) => e)
      expect(err).toBeInstanceOf(VmspaceError)
      expect(err).toMatchObject({ code: 'ENOSPC', errno: -28 })
      expectPoolEmpty(pool)
      expect(pool.stats()).toMatchObject({ allocated: 0, failed: 1 })
    })
  }
})

const crossOk = ext4 && mounts.xfs
const crossWhy = [ext4 ? undefined : ext4Missing, mounts.missing.xfs].filter(Boolean).join('; ')
describe.skipIf(!crossOk)(`a tree from ext4 to XFS ${needs('ext4 and a loop-mounted XFS', !crossOk && crossWhy)}`, () => {
  test("'always' rejects with ERR_REFLINK_UNSUPPORTED (cause EXDEV) before writing anything", async () => {
    const t = await sharedTree(ext4!)
    const parent = freshTreeDir(mounts.xfs!)
    const dst = path.join(parent, 'dst')
    const err = await clone(t.root, dst, { reflink: 'always' }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ERR_REFLINK_UNSUPPORTED', path: t.root, dest: dst })
    expect((err as Error).cause).toMatchObject({ code: 'EXDEV', errno: -18 })
    expectNothingLeft(parent, [])
  })

  test("'auto' copies it: method copy, every file copied, same tree", async () => {
    const t = await sharedTree(ext4!)
    const dst = path.join(freshTreeDir(mounts.xfs!), 'dst')
    const r = await clone(t.root, dst)
    expect(r).toEqual(treeResult(t.expected, dst, 'copy'))
    expectSameTree(t.root, dst)
    expectDataArrived(t, dst, false)
  })

  test("Workspace.clone with 'always' leaves the workspace empty", async () => {
    const t = await sharedTree(ext4!)
    const pool = await openPool(path.join(freshTreeDir(mounts.xfs!), 'pool'))
    const ws = await pool.allocate()
    await expect(ws.clone(t.root, 'app', { reflink: 'always' })).rejects.toMatchObject({ code: 'ERR_REFLINK_UNSUPPORTED' })
    expect(ls(ws.path)).toEqual([])
    await ws.dispose()
  })

  for (const form of ['dir', 'map'] as const) {
    test(`a pool with reflink 'always': allocate({ template: ${form} }) rejects and leaves no staging entry, lease file or workspace; 'auto' copies`, async () => {
      const t = await sharedTree(ext4!)
      const root = path.join(freshTreeDir(mounts.xfs!), 'pool')
      const template = form === 'dir' ? t.root : { app: t.root }
      const strict = await openPool(root, { reflink: 'always' })
      const err = await strict.allocate({ template }).catch((e: unknown) => e)
      expect(err).toMatchObject({ code: 'ERR_REFLINK_UNSUPPORTED' })
      expect((err as Error).cause).toMatchObject({ code: 'EXDEV' })
      expectPoolEmpty(strict)
      const pool = await openPool(root)
      const ws = await pool.allocate({ template })
      expect(ws.template).toEqual([expect.objectContaining({ kind: 'tree', method: 'copy', copied: t.expected.files, reflinked: 0 })])
      await ws.dispose()
    })
  }
})

describe.skipIf(!mounts.xfs)(`reflink: 'never' on XFS ${needs('a loop-mounted XFS', mounts.missing.xfs)}`, () => {
  test('copies every file of the tree: method copy, no extent shared, same tree', async () => {
    const t = await sharedTree(mounts.xfs!)
    const dst = path.join(freshTreeDir(mounts.xfs!), 'dst')
    const r = await clone(t.root, dst, { reflink: 'never' })
    expect(r).toEqual(treeResult(t.expected, dst, 'copy'))
    expectSameTree(t.root, dst)
    for (const rel of t.dataFiles) expect(sharedExtentsOf(path.join(dst, rel)), rel).toBe(0)
  })
})

describe.skipIf(!mounts.root)(`a mount inside the source ${needs('root, to mount a tmpfs', !mounts.root && 'not root')}`, () => {
  /** `<d>/src` with a file, and a directory `mnt` on which a tmpfs holding `secret` is mounted (unmounted by `done`). */
  function srcWithMount(d: string): { src: string; mnt: string } {
    const src = path.join(d, 'src')
    fs.mkdirSync(path.join(src, 'mnt'), { recursive: true })
    fs.writeFileSync(path.join(src, 'f'), 'f')
    const mnt = path.join(src, 'mnt')
    expect(runCommand('mount', ['-t', 'tmpfs', '-o', 'size=1m,mode=0750', 'vmspace-test', mnt]).status).toBe(0)
    fs.writeFileSync(path.join(mnt, 'secret'), 'secret')
    fs.mkdirSync(path.join(mnt, 'deeper'))
    return { src, mnt }
  }

  test('clone() never enters it: the mount point becomes an empty directory with the mode seen at it', async () => {
    const d = freshTreeDir(mounts.scratch)
    const { src, mnt } = srcWithMount(d)
    try {
      const dst = path.join(d, 'dst')
      const r = await clone(src, dst)
      expect(r).toMatchObject({ kind: 'tree', files: 1, dirs: 1 })
      expect(allPaths(dst)).toEqual(['f', 'mnt'])
      expect(fs.statSync(path.join(dst, 'mnt')).mode & 0o7777).toBe(0o750)
      expect(tempLeftovers(d)).toEqual([])
    } finally {
      runCommand('umount', [mnt])
    }
  })

  test('allocate({ template: dir }) never copies what is mounted inside the template', async () => {
    const d = freshTreeDir(mounts.scratch)
    const { src, mnt } = srcWithMount(d)
    try {
      const pool = await openPool(path.join(d, 'pool'))
      const ws = await pool.allocate({ template: src })
      expect(allPaths(ws.path)).toEqual(['f', 'mnt'])
      await ws.dispose()
      await pool.close()
    } finally {
      runCommand('umount', [mnt])
    }
  })
})

describe('a tree without regular files', () => {
  const where = [
    { label: 'ext4', dir: ext4, why: ext4Missing },
    { label: 'XFS', dir: mounts.xfs, why: mounts.missing.xfs },
  ]
  for (const { label, dir, why } of where) {
    test.skipIf(!dir)(`reports method 'copy' on ${label}, whatever reflink asked for: no extent was shared ${needs(label, !dir && why)}`, async () => {
      const d = freshTreeDir(dir!)
      const src = path.join(d, 'src')
      fs.mkdirSync(path.join(src, 'a', 'b'), { recursive: true })
      fs.symlinkSync('a/b', path.join(src, 'link'))
      for (const reflink of ['auto', 'always', 'never'] as const) {
        const dst = path.join(d, `dst-${reflink}`)
        const r = await clone(src, dst, { reflink })
        expect(r).toMatchObject({ kind: 'tree', method: 'copy', files: 0, reflinked: 0, copied: 0, dirs: 2, symlinks: 1 })
      }
    })
  }
})

describe('clones into awkward destinations', () => {
  /** `<d>/src`: a file f and a directory sub with a file g. */
  function smallSrc(d: string): string {
    const src = path.join(d, 'src')
    fs.mkdirSync(path.join(src, 'sub'), { recursive: true })
    fs.writeFileSync(path.join(src, 'f'), 'f')
    fs.writeFileSync(path.join(src, 'sub', 'g'), 'g')
    return src
  }

  /** Makes `p` a setgid directory (2775) owned by root and group 5678. */
  function setgidDir(p: string): void {
    fs.mkdirSync(p)
    fs.chownSync(p, 0, 5678)
    fs.chmodSync(p, 0o2775)
  }

  test('into a directory inside the source: the tree being built is not walked into', async () => {
    const d = freshTreeDir(mounts.scratch)
    const src = smallSrc(d)
    const r = await clone(src, path.join(src, 'sub', 'copy'))
    expect(r).toMatchObject({ files: 2, dirs: 1 })
    expect(allPaths(path.join(src, 'sub', 'copy'))).toEqual(['f', 'sub', 'sub/g'])
    expect(tempLeftovers(path.join(src, 'sub'))).toEqual([])
  })

  test.skipIf(!privileged)(
    `into a setgid directory of another group, as root: every entry keeps its source group ${needs('root', !privileged && 'not root')}`,
    async () => {
      const d = freshTreeDir(mounts.scratch)
      const src = smallSrc(d)
      fs.chownSync(path.join(src, 'sub', 'g'), 0, 4242)
      stampTimes(src)
      const parent = path.join(d, 'shared')
      setgidDir(parent)
      const dst = path.join(parent, 'dst')
      await clone(src, dst)
      expect(metadataListing(dst)).toEqual(metadataListing(src))
    },
  )

  test.skipIf(!privileged)(
    `allocate in a pool whose root is a setgid directory of another group, as root: template entries keep their groups ${needs('root', !privileged && 'not root')}`,
    async () => {
      const d = freshTreeDir(mounts.scratch)
      const src = smallSrc(d)
      stampTimes(src)
      const root = path.join(d, 'pool')
      setgidDir(root)
      const pool = await openPool(root, { sharedGroup: 5678 }) // group-writable: a pool that group shares
      const ws = await pool.allocate({ template: src })
      expect(metadataListing(ws.path, { root: false })).toEqual(metadataListing(src, { root: false }))
      await ws.dispose()
    },
  )
})

// ---- as an unprivileged user ----

describe.skipIf(!unprivilegedChildren)(
  `as uid 65534 (a child process dropping root) ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`,
  () => {
    async function runChild(req: object): Promise<Record<string, unknown>> {
      const child = new Child(path.join(fixtures, 'clone-tree-child.cjs'), [JSON.stringify(req)])
      child.proc.stdin!.end()
      const m = await child.next()
      await child.exited
      return m
    }

    /** A tree readable by others, with `bad` (relative) made mode 000 and plenty of entries around it. */
    function treeWithUnreadable(d: string, bad: string, kind: 'file' | 'dir'): string {
      const src = path.join(d, 'src')
      manyFiles(path.join(src, 'many'), 200, 100, 50)
      fs.mkdirSync(path.join(src, 'a', 'b'), { recursive: true })
      fs.writeFileSync(path.join(src, 'a', 'ok.txt'), 'ok')
      if (kind === 'file') writeRandomFile(path.join(src, bad), 8 * KiB, 0o000)
      else {
        fs.mkdirSync(path.join(src, bad))
        fs.writeFileSync(path.join(src, bad, 'inside'), 'inside')
        fs.chmodSync(path.join(src, bad), 0o000)
      }
      return src
    }

    /** A directory uid 65534 may write in. */
    function writableDir(base: string): string {
      const dir = freshTreeDir(base)
      fs.chownSync(dir, 65534, 65534)
      return dir
    }

    for (const kind of ['file', 'dir'] as const) {
      test(`clone(): a mode-000 ${kind} gives EACCES naming that source entry; no temp tree, no destination`, async () => {
        const d = freshTreeDir(mounts.scratch)
        const src = treeWithUnreadable(d, 'a/b/unreadable', kind)
        const parent = writableDir(mounts.scratch)
        const dst = path.join(parent, 'dst')
        const m = await runChild({ op: 'clone', source: src, dest: dst })
        expect(m).toMatchObject({
          event: 'error',
          code: 'EACCES',
          errno: -13,
          path: path.join(src, 'a/b/unreadable'),
          dest: path.join(dst, 'a/b/unreadable'),
        })
        expectNothingLeft(parent, [])
      })
    }

    for (const form of ['dir', 'map'] as const) {
      test(`allocate({ template: ${form} }) with a mode-000 file inside: EACCES; no staging entry, no lease file, no workspace`, async () => {
        const d = freshTreeDir(mounts.scratch)
        const src = treeWithUnreadable(d, 'a/b/unreadable', 'file')
        const root = path.join(writableDir(mounts.scratch), 'pool')
        const m = await runChild({ op: 'allocate', root, template: form === 'dir' ? src : { 'x/app': src } })
        expect(m).toMatchObject({ event: 'error', code: 'EACCES', path: path.join(src, 'a/b/unreadable') })
        expect(poolState(root)).toEqual(emptyPoolState)
      })
    }

    test('a device node is skipped (counted), a socket skipped, a link to an unreadable outside directory copied as a link', async () => {
      const d = freshTreeDir(mounts.scratch)
      const outside = path.join(d, 'outside')
      fs.mkdirSync(path.join(outside, 'x'), { recursive: true })
      fs.chmodSync(outside, 0o000)
      const src = path.join(d, 'src')
      fs.mkdirSync(src)
      fs.writeFileSync(path.join(src, 'f'), 'f')
      must('mknod', ['-m', '0666', path.join(src, 'null'), 'c', '1', '3'])
      must('mkfifo', [path.join(src, 'fifo')])
      fs.symlinkSync(outside, path.join(src, 'out'))
      await makeSocket(path.join(src, 'sock'))
      const parent = writableDir(mounts.scratch)
      const dst = path.join(parent, 'dst')
      const m = await runChild({ op: 'clone', source: src, dest: dst })
      expect(m).toMatchObject({
        event: 'done',
        result: {
          kind: 'tree',
          files: 1,
          symlinks: 1,
          fifos: 1,
          devices: 0,
          skipped: { sockets: 1, devices: 1 },
        },
      })
      expect(allPaths(dst)).toEqual(['f', 'fifo', 'out'])
      expect(fs.readlinkSync(path.join(dst, 'out'))).toBe(outside)
      // Made by uid 65534 (owners are kept only where permitted).
      expect(fs.lstatSync(path.join(dst, 'f')).uid).toBe(65534)
    })
  },
)

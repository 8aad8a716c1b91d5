/**
 * The standalone primitives (removeTree, renameNoReplace, exchange) and the shape of errors: Node's fs error
 * fields (`code`, negative `errno`, `syscall`, `path`, `dest`) on a VmspaceError (DESIGN.md, "Errors").
 */
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { clone, exchange, openPool, removeTree, renameNoReplace, VmspaceError } from '../lib/index.js'
import {
  Child,
  fixtures,
  freshDir,
  mounts,
  mountsBeneath,
  needs,
  outsideTree,
  runCommand,
  snapshotTree,
  unprivilegedChildren,
} from './helpers.js'

/** A tree with read-only directories and files, and symlinks to an outside directory and file. */
function awkwardTree(dir: string, outside: string): string {
  const tree = path.join(dir, 'tree')
  fs.mkdirSync(path.join(tree, 'ro', 'deeper'), { recursive: true })
  fs.writeFileSync(path.join(tree, 'ro', 'deeper', 'f.txt'), 'x')
  fs.writeFileSync(path.join(tree, 'ro', 'g.txt'), 'y')
  fs.chmodSync(path.join(tree, 'ro', 'deeper', 'f.txt'), 0o444)
  fs.chmodSync(path.join(tree, 'ro', 'deeper'), 0o555)
  fs.chmodSync(path.join(tree, 'ro'), 0o500)
  fs.mkdirSync(path.join(tree, 'nox'))
  fs.writeFileSync(path.join(tree, 'nox', 'h.txt'), 'z')
  fs.chmodSync(path.join(tree, 'nox'), 0o000)
  fs.symlinkSync(outside, path.join(tree, 'to-dir'))
  fs.symlinkSync(path.join(outside, 'keep.txt'), path.join(tree, 'to-file'))
  return tree
}

describe('removeTree', () => {
  test('removes a tree with read-only and inaccessible directories; symlinked outside targets survive', async () => {
    const dir = freshDir()
    const outside = outsideTree(dir)
    const before = snapshotTree(outside)
    const tree = awkwardTree(dir, outside)
    await removeTree(tree)
    expect(fs.existsSync(tree)).toBe(false)
    expect(snapshotTree(outside)).toEqual(before)
  })

  test.skipIf(!unprivilegedChildren)(
    `as an unprivileged user, makes read-only directories writable to empty them ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`,
    async () => {
      const dir = freshDir()
      fs.chmodSync(dir, 0o755)
      const outside = outsideTree(dir)
      const before = snapshotTree(outside)
      const tree = awkwardTree(dir, outside)
      runCommand('chown', ['-R', '-h', '65534:65534', tree])
      fs.chownSync(dir, 65534, 65534) // the tree's own entry is removed from here
      const child = new Child(path.join(fixtures, 'remove-tree-child.cjs'), [tree])
      child.proc.stdin!.end()
      const result = await child.next()
      expect(result, child.stderr).toEqual({ event: 'removed' })
      expect(fs.existsSync(tree)).toBe(false)
      expect(snapshotTree(outside)).toEqual(before)
    },
  )

  test('of a symlink removes the link, never its target', async () => {
    const dir = freshDir()
    const outside = outsideTree(dir)
    const before = snapshotTree(outside)
    fs.symlinkSync(outside, path.join(dir, 'link'))
    await removeTree(path.join(dir, 'link'))
    expect(fs.readdirSync(dir)).toEqual(['outside'])
    expect(snapshotTree(outside)).toEqual(before)
  })

  test("refuses the working directory and what is above it ('.', '..', '../..', '/', process.cwd()) with ERR_INVALID_ARG_VALUE, removing nothing", async () => {
    const dir = freshDir()
    const cwd = path.join(dir, 'a', 'b')
    fs.mkdirSync(cwd, { recursive: true })
    fs.writeFileSync(path.join(cwd, 'keep.txt'), 'keep')
    const before = snapshotTree(dir)
    const was = process.cwd()
    process.chdir(cwd)
    try {
      for (const p of ['.', './', '..', '../..', 'x/..', '/', cwd, path.join(dir, 'a'), `${cwd}/../b`]) {
        const err = await removeTree(p).catch((e: unknown) => e)
        expect(err, p).toBeInstanceOf(TypeError)
        expect(err, p).toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
      }
      expect(snapshotTree(dir)).toEqual(before)
      // Below the working directory is fine.
      fs.mkdirSync('sub')
      await removeTree('sub')
      expect(fs.existsSync(path.join(cwd, 'sub'))).toBe(false)
    } finally {
      process.chdir(was)
    }
  })

  test('of a missing path rejects with ENOENT', async () => {
    const missing = path.join(freshDir(), 'missing')
    await expect(removeTree(missing)).rejects.toMatchObject({ code: 'ENOENT', errno: -2 })
  })

  test.skipIf(!mounts.root)(
    `rejects with EBUSY at a bind mount inside, never entering it; its siblings are removed ${needs('root for mount --bind', !mounts.root && 'not root')}`,
    async () => {
      const dir = freshDir()
      const outside = outsideTree(dir)
      const before = snapshotTree(outside)
      const tree = path.join(dir, 'tree')
      fs.mkdirSync(path.join(tree, 'a', 'mnt'), { recursive: true })
      fs.writeFileSync(path.join(tree, 'a', 'sibling.txt'), 'x')
      fs.writeFileSync(path.join(tree, 'top.txt'), 'x')
      const mnt = path.join(tree, 'a', 'mnt')
      expect(runCommand('mount', ['--bind', outside, mnt]).status).toBe(0)
      try {
        const err = await removeTree(tree).catch((e: unknown) => e)
        expect(err).toBeInstanceOf(VmspaceError)
        expect(err).toMatchObject({ code: 'EBUSY', errno: -16, path: mnt })
        expect(snapshotTree(outside)).toEqual(before)
        expect(mountsBeneath(tree)).toEqual([mnt])
        expect(fs.readdirSync(tree)).toEqual(['a'])
        expect(fs.readdirSync(path.join(tree, 'a'))).toEqual(['mnt'])
      } finally {
        runCommand('umount', [mnt])
      }
      expect(snapshotTree(outside)).toEqual(before)
    },
  )
})

describe('renameNoReplace', () => {
  test('moves an entry to a free name', async () => {
    const dir = freshDir()
    fs.writeFileSync(path.join(dir, 'a'), 'A')
    await renameNoReplace(path.join(dir, 'a'), path.join(dir, 'b'))
    expect(fs.readdirSync(dir)).toEqual(['b'])
    expect(fs.readFileSync(path.join(dir, 'b'), 'utf8')).toBe('A')
  })

  test('onto an existing entry rejects with EEXIST and leaves both as they were', async () => {
    const dir = freshDir()
    const [a, b] = [path.join(dir, 'a'), path.join(dir, 'b')]
    fs.writeFileSync(a, 'A')
    fs.mkdirSync(b)
    fs.writeFileSync(path.join(b, 'inside'), 'B')
    const before = snapshotTree(dir)
    await expect(renameNoReplace(a, b)).rejects.toMatchObject({ code: 'EEXIST' })
    expect(snapshotTree(dir)).toEqual(before)
  })
})

describe('exchange', () => {
  test('swaps two files atomically', async () => {
    const dir = freshDir()
    const [a, b] = [path.join(dir, 'a'), path.join(dir, 'b')]
    fs.writeFileSync(a, 'A')
    fs.writeFileSync(b, 'B')
    await exchange(a, b)
    expect(fs.readFileSync(a, 'utf8')).toBe('B')
    expect(fs.readFileSync(b, 'utf8')).toBe('A')
  })

  test('swaps two directories with their contents, and a directory with a file', async () => {
    const dir = freshDir()
    const [a, b, c] = [path.join(dir, 'a'), path.join(dir, 'b'), path.join(dir, 'c')]
    fs.mkdirSync(a)
    fs.writeFileSync(path.join(a, 'in-a'), 'A')
    fs.mkdirSync(b)
    fs.writeFileSync(path.join(b, 'in-b'), 'B')
    fs.writeFileSync(c, 'C')
    await exchange(a, b)
    expect(fs.readdirSync(a)).toEqual(['in-b'])
    expect(fs.readdirSync(b)).toEqual(['in-a'])
    await exchange(a, c)
    expect(fs.readFileSync(a, 'utf8')).toBe('C')
    expect(fs.readdirSync(c)).toEqual(['in-b'])
  })

  test('with a missing side rejects with ENOENT and changes nothing', async () => {
    const dir = freshDir()
    fs.writeFileSync(path.join(dir, 'a'), 'A')
    const before = snapshotTree(dir)
    await expect(exchange(path.join(dir, 'a'), path.join(dir, 'missing'))).rejects.toMatchObject({ code: 'ENOENT' })
    expect(snapshotTree(dir)).toEqual(before)
  })
})

describe("errors have the shape of Node's fs errors", () => {
  test('a failed rename: VmspaceError with code, negative errno, syscall, path and dest, as fs.renameSync has them', async () => {
    const dir = freshDir()
    const [a, b] = [path.join(dir, 'a'), path.join(dir, 'b')]
    fs.writeFileSync(a, 'A')
    fs.writeFileSync(b, 'B')
    const err = await renameNoReplace(a, b).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toBeInstanceOf(Error)
    expect(err).toMatchObject({ name: 'VmspaceError', code: 'EEXIST', errno: -os.constants.errno.EEXIST, syscall: 'renameat2', path: a, dest: b })
    expect((err as Error).message).toMatch(/^EEXIST: /)
    expect((err as Error).message).toContain(a)
    expect((err as Error).message).toContain(b)
    // Node's own error for a failing rename has the same fields, with the same meaning.
    let nodeErr: NodeJS.ErrnoException | undefined
    try {
      fs.renameSync(path.join(dir, 'missing'), b)
    } catch (e) {
      nodeErr = e as NodeJS.ErrnoException
    }
    expect(Object.keys(nodeErr!).sort()).toEqual(['code', 'dest', 'errno', 'path', 'syscall'])
    for (const key of ['code', 'dest', 'errno', 'path', 'syscall']) expect(err).toHaveProperty(key)
  })

  test('a failed clone of a missing source names the source as path and the destination as dest', async () => {
    const dir = freshDir()
    const [src, dst] = [path.join(dir, 'missing'), path.join(dir, 'dst')]
    const err = await clone(src, dst).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ENOENT', errno: -os.constants.errno.ENOENT, path: src })
    expect(typeof (err as VmspaceError).syscall).toBe('string')
  })

  test('a vmspace condition carries a stable ERR_ code on a VmspaceError', async () => {
    const root = path.join(freshDir(), 'pool')
    fs.mkdirSync(path.join(root, '.vmspace'), { recursive: true })
    fs.writeFileSync(path.join(root, '.vmspace', 'version'), '999\n')
    const err = await openPool(root).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ name: 'VmspaceError', code: 'ERR_POOL_FORMAT' })
    expect((err as Error).message).toMatch(/^ERR_POOL_FORMAT: /)
  })
})

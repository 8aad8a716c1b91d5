/**
 * Helpers for the tree-clone suite (test/tree.test.ts): a source tree with every kind of entry, and views that
 * compare two trees by what independent tools report (find -printf for metadata, getfattr for xattrs, sha256 for
 * contents, filefrag for shared extents).
 */
import { spawnSync } from 'node:child_process'
import { createHash, randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as net from 'node:net'
import * as path from 'node:path'
import { expect, onTestFinished } from 'vitest'
import { removeScratch } from './setup/mounts.js'
import { makeSparseFile, MiB, sharedExtents } from './helpers.js'

export const KiB = 1024

/** Runs a command that must succeed; its stdout. */
export function must(cmd: string, args: string[]): string {
  const r = spawnSync(cmd, args, { encoding: 'utf8', maxBuffer: 256 * MiB })
  if (r.error) throw new Error(`${cmd}: ${r.error.message}`)
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')} exited ${r.status}: ${r.stderr}`)
  return r.stdout
}

/**
 * A fresh directory below `base`, removed when the test finishes; read-only and inaccessible directories left
 * in it (by the test or by an unprivileged child) are made accessible first, so that removal works as non-root.
 */
export function freshTreeDir(base: string, label = 'tree'): string {
  const dir = fs.mkdtempSync(path.join(base, `vmspace-${label}-`))
  fs.chmodSync(dir, 0o755)
  onTestFinished(() => {
    spawnSync('chmod', ['-R', 'u+rwX', dir], { stdio: 'ignore' })
    removeScratch(dir)
  })
  return dir
}

/** Expected CloneResult counts for a tree (see CloneResult). */
export interface TreeCounts {
  files: number
  bytes: number
  dirs: number
  symlinks: number
  hardlinks: number
  fifos: number
  devices: number
  sockets: number
}

export const zeroCounts = (): TreeCounts => ({
  files: 0,
  bytes: 0,
  dirs: 0,
  symlinks: 0,
  hardlinks: 0,
  fifos: 0,
  devices: 0,
  sockets: 0,
})

/**
 * Makes a unix socket file at `file`: a server listens at a temp name next to it, the socket file is hard-linked
 * to `file`, and the server closes (Node removes the name it listened at, not the link).
 */
export async function makeSocket(file: string): Promise<void> {
  const tmp = `${file}.listen`
  const server = net.createServer()
  await new Promise<void>((resolve, reject) => server.once('error', reject).listen(tmp, resolve))
  try {
    fs.linkSync(tmp, file)
  } finally {
    await new Promise((resolve) => server.close(resolve))
  }
  fs.rmSync(tmp, { force: true })
  expect(fs.lstatSync(file).isSocket()).toBe(true)
}

/** Epoch seconds of 2001-02-03 04:05:06 UTC; entry i gets this plus i seconds and 123456789 - i ns. */
const T0 = 981173106

/**
 * Sets distinct mtimes/atimes with nanoseconds on every entry below and at `dir` (`touch -h -d @S.N`, which
 * never follows a symlink), post-order so that setting a child's times cannot disturb its directory's.
 */
export function stampTimes(dir: string, exclude: (rel: string) => boolean = () => false): void {
  const entries: string[] = []
  const walk = (rel: string) => {
    const abs = rel ? path.join(dir, rel) : dir
    const st = fs.lstatSync(abs)
    if (st.isDirectory()) for (const name of fs.readdirSync(abs).sort()) walk(rel ? `${rel}/${name}` : name)
    if (!exclude(rel)) entries.push(rel)
  }
  walk('')
  const script = entries
    .map((rel, i) => {
      const ns = String(123456789 - i).padStart(9, '0')
      return `touch -h -d @${T0 + i * 86400 + i}.${ns} -- ${q(rel ? path.join(dir, rel) : dir)}`
    })
    .join('\n')
  must('sh', ['-ec', script])
}

export interface EveryKindTree {
  /** The tree's root. */
  root: string
  /** A directory next to it that symlinks inside point at. */
  outside: string
  expected: TreeCounts
  /** Non-empty regular files (relative), one per inode. */
  dataFiles: string[]
  /** The sparse file (relative), its logical size and the bytes of data in it. */
  sparse: { rel: string; size: number; data: number }
  /** Whether root-only entries (owners, security.capability, a char device) are in it. */
  privileged: boolean
}

/** A file of `size` random bytes with `mode` (not fsynced: FICLONE and FIEMAP flush what they need). */
function randomFile(file: string, size: number, mode: number): void {
  fs.writeFileSync(file, randomBytes(size), { flag: 'wx' })
  fs.chmodSync(file, mode)
}

/** Shell-quotes `s`. */
export function q(s: string): string {
  return `'${s.replace(/'/g, `'\\''`)}'`
}

/**
 * Makes `<dir>/tree`, a tree with every kind of entry, and `<dir>/outside`, which symlinks in the tree point at:
 * a 0-byte file, a sparse file, files of several modes (some the umask would mask), a hard-link pair across
 * directories, a dangling symlink, absolute symlinks to a file and a directory outside the tree, a relative
 * symlink to a directory inside, setuid and setgid files, a setgid and a sticky directory, user.* xattrs (text
 * and binary) on files and directories, a fifo, a unix socket, read-only (0555) directories with files,
 * distinct nanosecond mtimes on every entry; as root also other owners (files, a directory, a symlink, a fifo,
 * the setuid file), a file with security.capability (setcap cap_net_raw+ep), a trusted.* xattr on a file whose
 * mode the umask would mask, and a char device (mknod c 1 3).
 * Every non-empty file is at least 8 KiB (btrfs keeps smaller files inline in metadata, where no extent can be
 * shared).
 */
export async function makeEveryKindTree(dir: string, opts: { privileged: boolean }): Promise<EveryKindTree> {
  const root = path.join(dir, 'tree')
  const outside = path.join(dir, 'outside')
  const c = zeroCounts()
  const dataFiles: string[] = []
  const script: string[] = [] // mkfifo, mknod, setfattr, setcap: one shell for all of them
  const at = (rel: string) => path.join(root, rel)
  const mkdir = (rel: string) => {
    fs.mkdirSync(at(rel))
    c.dirs++
  }
  const file = (rel: string, size: number, mode: number) => {
    randomFile(at(rel), size, mode)
    c.files++
    c.bytes += size
    if (size > 0) dataFiles.push(rel)
  }
  const symlink = (target: string, rel: string) => {
    fs.symlinkSync(target, at(rel))
    c.symlinks++
  }
  const xattr = (rel: string, name: string, value: string) =>
    script.push(`setfattr -h -n ${name} -v ${q(value)} -- ${q(rel ? at(rel) : root)}`)

  fs.mkdirSync(outside)
  randomFile(path.join(outside, 'secret.bin'), 16 * KiB, 0o644)
  fs.mkdirSync(path.join(outside, 'sub'))
  randomFile(path.join(outside, 'sub', 'deep.bin'), 16 * KiB, 0o644)

  fs.mkdirSync(root)
  file('empty', 0, 0o644)
  const sparse = { rel: 'sparse.img', size: 16 * MiB, data: 64 * KiB }
  makeSparseFile(at(sparse.rel), sparse.size, 8 * MiB, sparse.data)
  fs.chmodSync(at(sparse.rel), 0o640)
  c.files++
  c.bytes += sparse.size
  dataFiles.push(sparse.rel)

  mkdir('data')
  file('data/a.bin', 64 * KiB, 0o644)
  file('data/b.bin', 12 * KiB, 0o666) // the umask (022) would mask it: the clone must chmod
  file('data/x.sh', 9 * KiB, 0o777)
  mkdir('data/deep')
  mkdir('data/deep/deeper')
  file('data/deep/deeper/c.bin', 20 * KiB, 0o600)
  file('data/deep/deeper/d.bin', 8 * KiB, 0o400)

  // A hard-link pair across two directories (possibly cloned by two threads).
  mkdir('links')
  mkdir('nested')
  file('links/one', 32 * KiB, 0o644)
  fs.linkSync(at('links/one'), at('nested/two'))
  c.hardlinks++

  symlink('does/not/exist', 'dangling')
  symlink(path.join(outside, 'secret.bin'), 'abs-outside')
  symlink('data', 'to-data')
  symlink(outside, 'to-outside-dir')
  symlink('../data/a.bin', 'nested/up-link')

  mkdir('bin')
  file('bin/suid', 16 * KiB, 0o755)
  file('bin/sgid', 16 * KiB, 0o755)
  mkdir('shared')
  file('shared/f', 8 * KiB, 0o664)
  mkdir('sticky')
  file('sticky/f', 8 * KiB, 0o644)

  script.push(`mkfifo -m 0640 -- ${q(at('fifo'))}`)
  c.fifos++
  await makeSocket(at('sock'))
  c.sockets++

  mkdir('ro')
  file('ro/f', 8 * KiB, 0o444)
  mkdir('ro/sub')
  file('ro/sub/g', 8 * KiB, 0o444)

  xattr('data/a.bin', 'user.note', 'hello tree')
  xattr('data/a.bin', 'user.bin', '0x00ff10ee00')
  xattr('data/deep', 'user.dir', 'a directory')
  xattr('', 'user.rootdir', 'the root')
  xattr('links/one', 'user.big', '0s' + Buffer.alloc(3000, 7).toString('base64'))
  xattr('ro/f', 'user.ro', 'in a read-only dir')
  xattr('bin/suid', 'user.suid', 'on a setuid file')

  if (opts.privileged) {
    file('bin/cap', 16 * KiB, 0o755)
    script.push(`mknod -m 0666 -- ${q(at('null'))} c 1 3`)
    c.devices++
    mkdir('owned')
    file('owned/f', 8 * KiB, 0o640)
    symlink('f', 'owned/link')
    mkdir('owned/empty-dir')
    fs.chownSync(at('owned/f'), 1234, 5678)
    fs.lchownSync(at('owned/link'), 1234, 5678)
    fs.chownSync(at('owned/empty-dir'), 4321, 8765)
    fs.chownSync(at('owned'), 65534, 65534)
    fs.chownSync(at('bin/suid'), 1234, 5678) // owner changes clear setuid: chown first, chmod after
    fs.chmodSync(at('owned'), 0o750)
    // After the chowns (chown clears security.capability).
    script.push(`setcap cap_net_raw+ep ${q(at('bin/cap'))}`)
    xattr('owned/f', 'user.owned', 'x')
    xattr('data/b.bin', 'trusted.t', 'root only')
  }
  fs.chmodSync(at('bin/suid'), 0o4755)
  fs.chmodSync(at('bin/sgid'), 0o2755)
  fs.chmodSync(at('shared'), 0o2775)
  fs.chmodSync(at('sticky'), 0o1777)
  must('sh', ['-ec', script.join('\n')])
  if (opts.privileged) fs.lchownSync(at('fifo'), 65534, 65534)

  fs.chmodSync(at('ro/sub'), 0o555)
  fs.chmodSync(at('ro'), 0o555)
  stampTimes(root)
  return { root, outside, expected: c, dataFiles, sparse, privileged: opts.privileged }
}

/**
 * One line per entry below and at `dir`, sorted, from `find -printf`: type, mode (with setuid/setgid/sticky),
 * owner, group, size, link count, mtime with nanoseconds, symlink target, relative path. Directory sizes and link
 * counts depend on the file system (btrfs keeps a directory's nlink at 1), so they are left out for directories.
 * `root: false` leaves out the line of `dir` itself; `skipTypes` leaves out entries of those find types (e.g.
 * 's' for sockets, which a clone does not recreate).
 */
export function metadataListing(dir: string, opts: { root?: boolean; skipTypes?: string } = {}): string[] {
  const out = must('find', [dir, '-printf', '%y\\t%m\\t%U\\t%G\\t%s\\t%n\\t%T@\\t%l\\t%P\\n'])
  return out
    .split('\n')
    .filter(Boolean)
    .map((line) => line.split('\t'))
    .filter((f) => (opts.root ?? true) || f[8] !== '')
    .filter((f) => !(opts.skipTypes ?? '').includes(f[0]))
    .map((f) => (f[0] === 'd' ? [f[0], f[1], f[2], f[3], '-', '-', ...f.slice(6)] : f).join(' '))
    .sort()
}

/**
 * Every xattr (all namespaces, values in hex) of every entry below and at `dir`, by relative path, from
 * `getfattr -R -P -h -d -m - -e hex` (never following a symlink). Entries without xattrs are absent.
 */
export function xattrListing(dir: string, opts: { root?: boolean } = {}): Record<string, string[]> {
  const out = must('getfattr', ['-R', '-P', '-h', '-d', '-m', '-', '-e', 'hex', '--absolute-names', dir])
  const result: Record<string, string[]> = {}
  let current: string | undefined
  for (const line of out.split('\n')) {
    const m = /^# file: (.*)$/.exec(line)
    if (m) {
      const abs = m[1]
      current = abs === dir ? '.' : path.relative(dir, abs)
      result[current] = []
    } else if (line && current !== undefined) {
      result[current].push(line)
    }
  }
  for (const k of Object.keys(result)) result[k].sort()
  if (!(opts.root ?? true)) delete result['.']
  return result
}

/** sha256 of every regular file below `dir`, by relative path (symlinks are not followed). */
export function contentHashes(dir: string): Record<string, string> {
  const out: Record<string, string> = {}
  const walk = (rel: string) => {
    const abs = rel ? path.join(dir, rel) : dir
    const st = fs.lstatSync(abs)
    if (st.isFile()) out[rel] = createHash('sha256').update(fs.readFileSync(abs)).digest('hex')
    else if (st.isDirectory()) for (const name of fs.readdirSync(abs).sort()) walk(rel ? `${rel}/${name}` : name)
  }
  walk('')
  return out
}

/** Everything the comparisons look at, for a before/after check of a source. */
export function fullSnapshot(dir: string) {
  return { listing: metadataListing(dir), xattrs: xattrListing(dir), hashes: contentHashes(dir) }
}

/**
 * Expects `dst` to reproduce `src`: same metadata listing (sockets left out: they are not recreated), same
 * xattrs, same bytes, device numbers kept, and the hard-link pair one inode. `root: false` for a workspace made
 * from a directory template, whose own directory keeps the workspace's metadata.
 */
export function expectSameTree(src: string, dst: string, opts: { root?: boolean } = {}): void {
  const root = opts.root ?? true
  // Soft: a difference in one view does not hide those in the others.
  expect.soft(metadataListing(dst, { root }), 'find -printf listing').toEqual(metadataListing(src, { root, skipTypes: 's' }))
  expect.soft(xattrListing(dst, { root }), 'getfattr dump').toEqual(xattrListing(src, { root }))
  expect.soft(contentHashes(dst), 'sha256 of every file').toEqual(contentHashes(src))
  for (const dev of ['null']) {
    const s = fs.lstatSync(path.join(src, dev), { throwIfNoEntry: false })
    if (s) expect(fs.lstatSync(path.join(dst, dev)).rdev).toBe(s.rdev)
  }
  const [one, two] = [fs.lstatSync(path.join(dst, 'links/one')), fs.lstatSync(path.join(dst, 'nested/two'))]
  expect(two.ino).toBe(one.ino)
  expect(one.nlink).toBe(2)
}

/** Every extent of every listed (non-empty) file below `dir` is shared, as filefrag (FIEMAP) reports it. */
export function expectExtentsShared(dir: string, files: string[]): void {
  const notShared: Record<string, { extents: number; shared: number }> = {}
  for (const rel of files) {
    const e = sharedExtents(path.join(dir, rel))
    if (e.extents === 0 || e.shared !== e.extents) notShared[rel] = e
  }
  expect(notShared).toEqual({})
}

/** How many extents of `file` are shared (FIEMAP). */
export function sharedExtentsOf(file: string): number {
  return sharedExtents(file).shared
}

/** Makes `count` files of `size` bytes in `perDir`-sized directories below `dir` (names d<i>/f<j>). */
export function manyFiles(dir: string, count: number, size = 0, perDir = 200, start = 0): void {
  const data = Buffer.alloc(size, 0x61)
  for (let i = start; i < start + count; i++) {
    const d = path.join(dir, `d${Math.floor(i / perDir)}`)
    if (i % perDir === 0 || i === start) fs.mkdirSync(d, { recursive: true })
    fs.writeFileSync(path.join(d, `f${i}`), data)
  }
}

/** Names (relative) of everything below `dir`, not following symlinks. */
export function allPaths(dir: string): string[] {
  const out: string[] = []
  const walk = (rel: string) => {
    for (const name of fs.readdirSync(rel ? path.join(dir, rel) : dir).sort()) {
      const r = rel ? `${rel}/${name}` : name
      out.push(r)
      if (fs.lstatSync(path.join(dir, r)).isDirectory()) walk(r)
    }
  }
  walk('')
  return out
}

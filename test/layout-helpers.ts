/**
 * Views of the pool layout `vmspace-pool 1` shared by layout.test.ts and lease-file.test.ts: the exact listing of a
 * tree, the listing of a new pool, where a workspace's lease file is, and the file systems the suites run on.
 */
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { expect } from 'vitest'
import { VmspaceError } from '../lib/index.js'
import { mounts } from './helpers.js'

/** The scratch ext4 and the loop XFS (reflink) of the global setup; `base` null where it could not be made. */
export const fileSystems = [
  { label: `ext4 scratch (${mounts.scratchFsType})`, base: mounts.scratch as string | null, missing: undefined as string | undefined },
  { label: 'loop XFS (reflink=1)', base: mounts.xfs, missing: mounts.missing.xfs },
]

export const stagingShards = ['s0', 's1', 's2', 's3', 's4', 's5', 's6', 's7']
export const leaseShards = [...'0123456789abcdef']

/**
 * Every entry below `dir` (not `dir` itself) as "<relative path> <type> <permission bits in octal>", sorted: `d`
 * directory, `f` regular file, `l` symlink. The exact shape of a tree, without inode numbers or times.
 */
export function treeListing(dir: string): string[] {
  const out: string[] = []
  const walk = (rel: string) => {
    for (const name of fs.readdirSync(path.join(dir, rel)).sort()) {
      const r = rel ? `${rel}/${name}` : name
      const st = fs.lstatSync(path.join(dir, r))
      const type = st.isDirectory() ? 'd' : st.isFile() ? 'f' : st.isSymbolicLink() ? 'l' : '?'
      out.push(`${r} ${type} ${(st.mode & 0o7777).toString(8).padStart(4, '0')}`)
      if (st.isDirectory()) walk(r)
    }
  }
  walk('')
  return out.sort()
}

/** The listing (treeListing) of a new, empty pool's root: `.vmspace/` and nothing else. */
export const newPoolListing = [
  '.vmspace d 0755',
  '.vmspace/cache d 0700',
  '.vmspace/leases d 0700',
  ...leaseShards.map((s) => `.vmspace/leases/${s} d 0700`),
  '.vmspace/staging d 0700',
  ...stagingShards.map((s) => `.vmspace/staging/${s} d 0700`),
  '.vmspace/trash d 0700',
  '.vmspace/version f 0644',
].sort()

/** `.vmspace/leases/<the id's first hex digit>/<name>` of workspace `name` in the pool at `root`. */
export function leaseFilePath(root: string, name: string): string {
  return path.join(root, '.vmspace', 'leases', name.charAt(name.length - 32), name)
}

/** The VmspaceError `p` rejects with (fails when it resolves or rejects with anything else). */
export async function rejection(p: Promise<unknown>): Promise<VmspaceError> {
  const e = await p.then(
    () => expect.fail('expected a rejection'),
    (e: unknown) => e,
  )
  expect(e).toBeInstanceOf(VmspaceError)
  return e as VmspaceError
}

/**
 * Every entry of the tree at `dir` (itself included, as '.') with its type and mode, inode, size, link count, owner,
 * modification and status-change times in ns, and a regular file's bytes (sha256) or a symlink's target: equal
 * snapshots mean nothing was made, removed, renamed, written or chmod'ed there, even a temp entry made and removed
 * again (its directory's mtime moves).
 */
export function exactSnapshot(dir: string): Record<string, string> {
  const out: Record<string, string> = {}
  const walk = (rel: string) => {
    const abs = path.join(dir, rel)
    const st = fs.lstatSync(abs, { bigint: true })
    let desc = `${st.mode.toString(8)} ino=${st.ino} size=${st.size} nlink=${st.nlink} uid=${st.uid} gid=${st.gid} mtime=${st.mtimeNs} ctime=${st.ctimeNs}`
    if (st.isFile()) desc += ' sha256=' + createHash('sha256').update(fs.readFileSync(abs)).digest('hex')
    if (st.isSymbolicLink()) desc += ' -> ' + fs.readlinkSync(abs)
    out[rel || '.'] = desc
    if (st.isDirectory()) for (const name of fs.readdirSync(abs).sort()) walk(path.join(rel, name))
  }
  walk('')
  return out
}

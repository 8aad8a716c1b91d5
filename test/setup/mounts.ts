/**
 * What the global setup provides to the tests (vitest `provide`/`inject`), and mount-table helpers shared by the
 * setup and the tests. No vitest runtime import here: the global setup runs in vitest's main process.
 */
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'

export interface Mounts {
  /** A fresh directory on the file system of os.tmpdir() (the machine's own ext4 on the dev machines). */
  scratch: string
  /** File system type of `scratch` as the mount table names it ('ext4', 'tmpfs', ...). */
  scratchFsType: string
  /** Mount point of a loop-mounted XFS made with `-m reflink=1`, or null (see `missing.xfs`). */
  xfs: string | null
  /** Mount point of a loop-mounted btrfs, or null (see `missing.btrfs`). */
  btrfs: string | null
  /** Mount point of a small (64 MiB) loop-mounted ext4 for ENOSPC, or null (see `missing.small`). */
  small: string | null
  /** Why a file system above could not be made. */
  missing: { xfs?: string; btrfs?: string; small?: string }
  /** Whether the tests run as root (mount, bind mounts, other uids). */
  root: boolean
}

declare module 'vitest' {
  export interface ProvidedContext {
    /** One set per worker: the file of worker N (VITEST_POOL_ID) uses set N − 1. */
    mounts: Mounts[]
  }
}

/** Decodes the octal escapes (`\040` for a space, ...) of /proc/self/mountinfo fields. */
function unescapeMountField(s: string): string {
  return s.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)))
}

interface MountEntry {
  mountPoint: string
  fsType: string
}

export function mountTable(): MountEntry[] {
  const text = fs.readFileSync('/proc/self/mountinfo', 'utf8')
  const out: MountEntry[] = []
  for (const line of text.split('\n')) {
    if (!line) continue
    const [left, right] = line.split(' - ')
    const fields = left.split(' ')
    out.push({ mountPoint: unescapeMountField(fields[4]), fsType: right?.split(' ')[0] ?? '' })
  }
  return out
}

/** Mount points strictly below `dir`, or at it, deepest first. */
export function mountsBeneath(dir: string): string[] {
  const d = path.resolve(dir)
  return mountTable()
    .map((m) => m.mountPoint)
    .filter((m) => m === d || m.startsWith(d + '/'))
    .sort((a, b) => b.length - a.length)
}

/** The type of the file system holding `p` (the longest mount point that is a prefix of its real path). */
export function fsTypeOf(p: string): string {
  const real = fs.realpathSync(p)
  let best: MountEntry | undefined
  for (const m of mountTable()) {
    const inside = m.mountPoint === '/' || real === m.mountPoint || real.startsWith(m.mountPoint + '/')
    if (inside && (!best || m.mountPoint.length >= best.mountPoint.length)) best = m
  }
  return best?.fsType ?? 'unknown'
}

/** Unmounts every mount at or below `dir` (lazily where a plain umount fails); true when none is left. */
export function unmountBeneath(dir: string): boolean {
  for (const m of mountsBeneath(dir)) {
    if (spawnSync('umount', [m], { stdio: 'ignore' }).status !== 0) spawnSync('umount', ['-l', m], { stdio: 'ignore' })
  }
  return mountsBeneath(dir).length === 0
}

/**
 * Removes a test's scratch directory: first every mount below it (a bind mount left by a failed test must not
 * let the recursive removal reach the files it shows), then the tree. Leaves the tree when a mount remains.
 */
export function removeScratch(dir: string): void {
  if (!fs.existsSync(dir)) return
  if (!unmountBeneath(dir)) {
    process.emitWarning(`vmspace tests: a mount below ${dir} could not be removed; leaving the directory`)
    return
  }
  try {
    fs.rmSync(dir, { recursive: true, force: true })
  } catch (e) {
    // A template left published on btrfs is a read-only subvolume: made writable, then removed. (Node 24's rmSync
    // reports that EROFS without a `code`, so any failure with such a subvolume below is taken as it.)
    const readOnly = readOnlySubvolumesBelow(dir)
    if (readOnly.length === 0) throw e
    for (const sub of readOnly) spawnSync('btrfs', ['property', 'set', '-ts', sub, 'ro', 'false'])
    fs.rmSync(dir, { recursive: true, force: true })
  }
}

/** The read-only btrfs subvolume roots below `dir` (inode 256 with `btrfs property get ro` true). */
function readOnlySubvolumesBelow(dir: string): string[] {
  const out: string[] = []
  const walk = (d: string) => {
    for (const e of fs.readdirSync(d, { withFileTypes: true })) {
      if (!e.isDirectory()) continue
      const p = path.join(d, e.name)
      if (fs.statSync(p).ino === 256 && spawnSync('btrfs', ['property', 'get', '-ts', p, 'ro'], { encoding: 'utf8' }).stdout.trim() === 'ro=true')
        out.push(p)
      else walk(p)
    }
  }
  walk(dir)
  return out
}

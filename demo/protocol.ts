/**
 * What the demo's parent and its workers share: constants, the messages they exchange (JSON over the fork IPC
 * channel), and the marker each workspace gets.
 */
import type { PoolStats } from 'vmspace'

/** The marker sits in the first 1024 bytes of the image: ext4 leaves them unused (boot sector), before the superblock. */
export const MARKER_OFFSET = 512
export const MARKER_LEN = 64
export const MARKER_FILE = 'marker.txt'
/** With --template-dir: the marker file each workspace gets (the template must not have one). */
export const TREE_MARKER = 'vmspace-demo-marker.txt'
export const ROOTFS = 'rootfs.ext4'
export const ROLE_ENV = 'VMSPACE_DEMO_ROLE'
export const CRASH_ENV = 'VMSPACE_DEMO_CRASH_AFTER'
/** The run fails when no worker has reported anything for this long. */
export const STALL_MS = 120_000

export interface WorkerConfig {
  index: number
  root: string
  /** The base image cloned as ROOTFS ('' with a template tree). */
  base: string
  baseSize: number
  /** With --template-dir: the tree every workspace starts from, instead of the base image. */
  tree?: TreeSpec
  count: number
  live: number
  /** Test hook: SIGKILL this worker right after its n-th allocate (0: never). */
  crashAfter: number
  /** --quota: quota.bytes of every workspace (0: none). */
  quota: number
  /** --quota: this worker's first workspace runs a runaway writer until the kernel refuses it. */
  runaway: boolean
}

/** A template tree as the workers check their clones of it. */
export interface TreeSpec {
  /** The directory cloned (the template itself, or its copy in the pool's file system; --image: the template's tree). */
  dir: string
  /** --image: the id of the image template every workspace is allocated from (allocate({ from })). */
  from?: string
  /** treeManifest(dir, { contents: false }).digest: paths, types, modes, sizes, symlink targets. */
  shape: string
  entries: number
  files: number
  bytes: number
  /** Relative path of a template file (the largest writable one) each worker writes its marker into. */
  probe?: string
}

export type ToWorker = { t: 'start'; config: WorkerConfig } | { t: 'go' } | { t: 'stop' }

export type FromWorker =
  | { t: 'ready' }
  | { t: 'allocated'; id: string; name: string; path: string; ms: number; method: string; bytes: number; files: number }
  | { t: 'disposing'; id: string }
  | { t: 'runaway'; id: string; code: string | null; bytes: number }
  | { t: 'checked'; id: string; marker: boolean; markerFile: boolean; contents: boolean; disposed: boolean; problems: string[] }
  | { t: 'failed'; stage: string; error: string }
  | { t: 'finished'; stats: PoolStats }
  | { t: 'fatal'; error: string }

export function describe(e: unknown): string {
  if (e instanceof Error) return e.message
  return String(e)
}

/** describe() with the stack, for errors nobody expected. */
export function describeWithStack(e: unknown): string {
  return e instanceof Error ? (e.stack ?? e.message) : String(e)
}

export function markerFor(id: string): Buffer {
  const b = Buffer.alloc(MARKER_LEN, 0)
  b.write(`vmspace-demo ${id}\n`, 'latin1')
  return b
}

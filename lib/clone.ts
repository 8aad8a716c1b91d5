/** Clone options and results, shared by the standalone clone() and Workspace.clone(). */
import { ReflinkCode, type NativeCloneResult } from './binding.js'
import { boolean, func, oneOf, optionsObject } from './args.js'

export type Reflink = 'always' | 'auto' | 'never'

export interface CloneOptions {
  /**
   * `'auto'` (default): reflink (ioctl(FICLONE), ioctl_ficlone(2)) where the file system shares extents, otherwise a
   * copy that keeps holes. `'always'`: reflink or fail with `ERR_REFLINK_UNSUPPORTED`, leaving nothing behind.
   * `'never'`: always copy (read/write, so that no extent is shared even on XFS/btrfs).
   */
  reflink?: Reflink
  /** Replace an existing destination atomically (rename(2)) instead of failing with `EEXIST`. Default false. */
  overwrite?: boolean
  /** fsync the new file before it is published and its directory after. Default false. */
  durable?: boolean
  /** Called with the running totals: files done and their logical bytes. */
  onProgress?: (p: { files: number; bytes: number }) => void
}

export interface CloneResult {
  kind: 'file' | 'tree'
  /** How the data arrived: shared extents, a copy, or (trees) both. */
  method: 'reflink' | 'copy' | 'mixed'
  /** Absolute path of the destination. */
  path: string
  files: number
  /** Logical size in bytes (holes included). */
  bytes: number
}

export const reflinkValues = ['always', 'auto', 'never'] as const

export function reflinkCode(r: Reflink): ReflinkCode {
  return r === 'always' ? ReflinkCode.Always : r === 'never' ? ReflinkCode.Never : ReflinkCode.Auto
}

export interface CheckedCloneOptions {
  reflink: ReflinkCode
  overwrite: boolean
  durable: boolean
  onProgress?: (p: { files: number; bytes: number }) => void
}

export function cloneOptions(value: unknown, defaultReflink: Reflink = 'auto'): CheckedCloneOptions {
  const o = optionsObject<CloneOptions>('options', value)
  return {
    reflink: reflinkCode(oneOf('options.reflink', o.reflink, reflinkValues, defaultReflink)),
    overwrite: boolean('options.overwrite', o.overwrite, false),
    durable: boolean('options.durable', o.durable, false),
    onProgress: func('options.onProgress', o.onProgress),
  }
}

export function fileResult(r: NativeCloneResult, dest: string, opts: CheckedCloneOptions): CloneResult {
  opts.onProgress?.({ files: 1, bytes: r.bytes })
  return { kind: 'file', method: r.method, path: dest, files: 1, bytes: r.bytes }
}

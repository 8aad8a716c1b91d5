/** The standalone clone(), and the clone options and results it shares with Workspace.clone() and templates. */
import { native, type NativeCloneArray, type NativeCloneResult, type ProgressHandle } from './binding.js'
import { abortSignal, absolutePath, boolean, func, oneOf, optionsObject } from './args.js'
import { AbortError, fromNative } from './errors.js'
import { cloneChannel, cloneResult, traced } from './trace.js'
import type { CloneOptions, CloneProgressEvent, CloneResult, Reflink, TemplateCacheUse, Writeback } from './types.js'

export const reflinkValues = ['always', 'auto', 'never'] as const
export const writebackValues = ['none', 'start', 'wait'] as const

export interface CheckedCloneOptions {
  reflink: Reflink
  overwrite: boolean
  durable: boolean
  writeback: Writeback
  onProgress?: (p: CloneProgressEvent) => void
  signal?: AbortSignal
}

export function cloneOptions(value: unknown, defaultReflink: Reflink = 'auto'): CheckedCloneOptions {
  const o = optionsObject<CloneOptions>('options', value, {
    reflink: true, overwrite: true, durable: true, writeback: true, onProgress: true, signal: true,
  })
  return {
    reflink: oneOf('options.reflink', o.reflink, reflinkValues, defaultReflink),
    overwrite: boolean('options.overwrite', o.overwrite, false),
    durable: boolean('options.durable', o.durable, false),
    writeback: oneOf('options.writeback', o.writeback, writebackValues, 'none'),
    onProgress: func('options.onProgress', o.onProgress),
    signal: abortSignal('options.signal', o.signal),
  }
}

/** clonePathBeneath's array as the CloneResult of destination `dest` (the members in toResult's order). */
export function cloneResultOf(a: NativeCloneArray, dest: string): CloneResult {
  const n = a as unknown as number[]
  const r: CloneResult =
    a[0] === 'tree'
      ? { kind: a[0], method: a[1], files: n[2], bytes: n[3], reflinked: n[4], copied: n[5], dirs: n[6], symlinks: n[7], hardlinks: n[8], fifos: n[9], devices: n[10], skipped: { sockets: n[11], devices: n[12] }, path: dest }
      : { kind: a[0], method: a[1], files: n[2], bytes: n[3], reflinked: n[4], copied: n[5], path: dest }
  if (a.length === 7) r.cache = a[6] as TemplateCacheUse
  return r
}

export function toResult(r: NativeCloneResult & { dest?: string }, dest: string): CloneResult {
  // Object.assign, not rest/spread syntax: ~10x cheaper on the binding's objects, on
  // the path of every clone.
  const result = Object.assign({}, r) as CloneResult & { dest?: string }
  if (result.dest !== undefined) delete result.dest
  result.path = dest
  return result
}

const PROGRESS_MS = 100

// What call() does to a rejection, as a plain handler (names the errno: the binding reports its number only).
const rethrowNative = (e: unknown): never => {
  throw fromNative(e)
}

/**
 * Runs one native clone with a progress/cancel handle when the caller asked for progress or gave a signal: a
 * 100 ms timer on the JS thread reads the running totals (two atomic loads); an abort sets the cancel flag the
 * walk checks between entries. An ECANCELED rejection after an abort becomes an AbortError.
 */
export function withProgress<T>(
  opts: { onProgress?: (p: CloneProgressEvent) => void; signal?: AbortSignal },
  run: (handle: ProgressHandle | undefined) => Promise<T>,
): Promise<T> {
  // Neither: no handle, no timer, and no async frame (call()'s included: one promise and frame fewer per clone).
  if (!opts.onProgress && !opts.signal) return run(undefined).then(undefined, rethrowNative)
  return withProgressHandle(opts, run)
}

async function withProgressHandle<T>(
  opts: { onProgress?: (p: CloneProgressEvent) => void; signal?: AbortSignal },
  run: (handle: ProgressHandle | undefined) => Promise<T>,
): Promise<T> {
  const { onProgress, signal } = opts
  if (signal?.aborted) throw new AbortError(signal.reason)
  const handle = native.newProgress()
  let last = { files: 0, bytes: 0 }
  // What onProgress threw: it runs on a timer, where a throw would be an uncaught exception; it cancels instead.
  let thrown: { error: unknown } | undefined
  const tick = () => {
    const [files, bytes] = native.readProgress(handle)
    if (files === last.files && bytes === last.bytes) return
    last = { files, bytes }
    try {
      const r = onProgress!({ files, bytes }) as unknown
      // An async callback's rejection counts as a throw (unhandled, it would end the process).
      if (typeof (r as PromiseLike<void> | undefined)?.then === 'function') (r as PromiseLike<void>).then(undefined, fail)
    } catch (error) {
      fail(error)
    }
  }
  const fail = (error: unknown) => {
    if (thrown) return
    thrown = { error }
    clearInterval(timer)
    native.cancelProgress(handle)
  }
  const timer = onProgress ? setInterval(tick, PROGRESS_MS) : undefined
  const onAbort = () => native.cancelProgress(handle)
  signal?.addEventListener('abort', onAbort, { once: true })
  try {
    const result = await run(handle)
    if (thrown) throw thrown.error
    return result
  } catch (e) {
    if (thrown) throw thrown.error
    const err = fromNative(e)  // names the errno: the binding reports its number only
    if (signal?.aborted && (err as { code?: string })?.code === 'ECANCELED') throw new AbortError(signal.reason)
    throw err
  } finally {
    if (timer) clearInterval(timer)
    signal?.removeEventListener('abort', onAbort)
  }
}

/**
 * Clones `source`, a regular file or a directory tree, to `dest` (see {@link CloneOptions}). `source` is followed
 * through any symlink on its path, as cp follows it: a path inside a workspace can lead anywhere the guest points
 * it, so copy out of a workspace with `ws.copyOut()`, which resolves beneath it. The destination
 * appears complete or not at all (built under a temp name, published with renameat2(RENAME_NOREPLACE), or for a
 * file link + unlink where the file system lacks that flag); the source is only read. Files keep their mode, less
 * set-user-ID (set-group-ID) unless the caller is the source's owner (its group is the clone's); trees keep mode,
 * owner (where permitted), times and xattrs, set-id bits and security.capability only where the owner is kept, and
 * recreate symlinks, hard links, fifos and device nodes (where permitted) without following any symlink, and never
 * enter another mount: a mount point in the source becomes an empty directory (as `cp -x` makes it). A copy reads to
 * end of file (procfs, sysfs files) and its `bytes` are exactly those read.
 * Throws `ERR_SOURCE_CHANGED` (no errno; `path`: the source file, `dest`: its destination) when a file changed while
 * it was cloned: its size, mtime, ctime or inode after the data arrived (a copy, or a reflink) differ from before
 * (for a tree, from the walk's stat of its name); nothing is published. `ERR_SOURCE_TYPE` (no errno) when `source`
 * is neither a regular file nor a directory (a fifo, socket or device node; the message names which).
 * Throws `EEXIST` when `dest` exists (unless `overwrite`), `ENOENT` when its directory does not,
 * `ERR_REFLINK_UNSUPPORTED` under `reflink: 'always'` where extents cannot be shared (cause `EAGAIN` when the file
 * system kept answering "not now"), `ERR_RENAME_NOREPLACE_UNSUPPORTED` for a tree on a file system without
 * RENAME_NOREPLACE, an AbortError on `signal`, or the errno of the entry that failed (`path`: that source entry,
 * `dest`: its destination).
 */
export function clone(source: string, dest: string, options?: CloneOptions): Promise<CloneResult> {
  return traced(cloneChannel, () => ({ source, dest }), () => cloneUntraced(source, dest, options), cloneResult)
}

async function cloneUntraced(source: string, dest: string, options: CloneOptions | undefined): Promise<CloneResult> {
  const src = absolutePath('source', source)
  const dst = absolutePath('dest', dest)
  const opts = cloneOptions(options)
  const r = await withProgress(opts, (p) => native.clonePath({ src, dst, reflink: opts.reflink, overwrite: opts.overwrite, durable: opts.durable, writeback: opts.writeback, progress: p }))
  return toResult(r, dst)
}

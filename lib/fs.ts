/** The primitives on their own, outside any pool: clone, safe removal, renames that never replace. */
import { native } from './binding.js'
import { absolutePath, boolean, invalidValue, optionsObject } from './args.js'
import { call, VmspaceError } from './errors.js'
import { cloneOptions, toResult, withProgress, type CloneOptions, type CloneResult } from './clone.js'
import { cloneChannel, cloneResult, traced } from './trace.js'

/**
 * Clones `source`, a regular file or a directory tree, to `dest` (see {@link CloneOptions}). The destination
 * appears complete or not at all (built under a temp name, published with renameat2(RENAME_NOREPLACE), or for a
 * file link + unlink where the file system lacks that flag); the source is only read. Files keep their mode, less
 * set-user-ID (set-group-ID) unless the caller is the source's owner (its group is the clone's); trees keep mode,
 * owner (where permitted), times and xattrs, set-id bits and security.capability only where the owner is kept, and
 * recreate symlinks, hard links, fifos and device nodes (where permitted) without following any symlink. A copy
 * reads to end of file (procfs, sysfs files) and its `bytes` are exactly those read.
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

/** Options of removeTree(). */
export interface RemoveTreeOptions {
  /**
   * Resolve instead of failing with `ENOENT` when `path` itself does not exist (a missing parent included), as
   * `fs.rm`'s `force` does. Any other error, and `ENOENT` of an entry below `path`, still rejects. Default false.
   */
  force?: boolean
}

/**
 * Removes `path` and everything below it without following a symlink (a symlink is removed, never its target)
 * and without entering another mount: a mount point below gives `EBUSY` and is left as it is, with the
 * directories above it. `ENOENT` when `path` does not exist (unless `force`). Refuses the root directory.
 */
export async function removeTree(path: string, options?: RemoveTreeOptions): Promise<void> {
  const p = absolutePath('path', path)
  if (p === '/') throw invalidValue('path', 'a path other than the root directory', path)
  const force = boolean('options.force', optionsObject<RemoveTreeOptions>('options', options, { force: true }).force, false)
  try {
    await call(native.removeTree(p))
  } catch (e) {
    // Only the path itself missing is forgiven; the binding names the path its errno is about.
    if (force && e instanceof VmspaceError && e.code === 'ENOENT' && e.path === p) return
    throw e
  }
}

/**
 * Renames `from` to `to` atomically, failing with `EEXIST` if `to` exists (renameat2(2), RENAME_NOREPLACE). On a
 * file system that refuses the flag (FUSE without rename2, some network file systems: `EINVAL`), a file or symlink
 * moves by link(2) + unlink(2), which never replaces either (`EEXIST`, syscall `'link'`); a directory rejects with
 * renameat2's `EINVAL`.
 */
export async function renameNoReplace(from: string, to: string): Promise<void> {
  await call(native.renameNoReplace(absolutePath('from', from), absolutePath('to', to)))
}

/** Swaps two existing paths atomically (renameat2(2), RENAME_EXCHANGE); `ENOENT` if either is missing. */
export async function exchange(a: string, b: string): Promise<void> {
  await call(native.exchange(absolutePath('a', a), absolutePath('b', b)))
}

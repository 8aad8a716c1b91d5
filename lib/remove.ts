/** Safe removal of a tree on its own, outside any pool. */
import { native } from './binding.js'
import * as nodePath from 'node:path'
import { absolutePath, boolean, invalidValue, optionsObject } from './args.js'
import { call, VmspaceError } from './errors.js'

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
 * directories above it. `ENOENT` when `path` does not exist (unless `force`); the errno of the entry that failed
 * otherwise (`path`: that entry). Refuses with `ERR_INVALID_ARG_VALUE`, before touching anything: a path that
 * resolves (relative to `process.cwd()`, `.` and `..` applied as `path.resolve` does) to the current working
 * directory or one of its ancestors (`'.'`, `'..'`, `'/'`, `process.cwd()` itself), as rm(1) refuses `.` and `..`;
 * an empty path or one with a NUL byte; unknown option keys. A non-string `path` is `ERR_INVALID_ARG_TYPE`. The
 * check is of the path as spelt: another spelling of the working directory through a symlink is not recognised.
 * Unlike a workspace's dispose or sweep, it does not stop at a pool's root (`ERR_POOL_NESTED` there): it is how
 * an operator removes what such a removal left and reported (docs/pool-on-disk.md, "A pool inside a pool").
 */
export async function removeTree(path: string, options?: RemoveTreeOptions): Promise<void> {
  const p = absolutePath('path', path)
  if (containsCwd(p)) throw invalidValue('path', 'a path that is neither the working directory nor above it', path)
  const force = boolean('options.force', optionsObject<RemoveTreeOptions>('options', options, { force: true }).force, false)
  try {
    await call(native.removeTree(p))
  } catch (e) {
    // Only the path itself missing is forgiven; the binding names the path its errno is about.
    if (force && e instanceof VmspaceError && e.code === 'ENOENT' && e.path === p) return
    throw e
  }
}

// Whether the absolute, normal path `p` is the working directory or one of its ancestors ('/' always is): removing
// it would pull the ground from under the process (and from under a relative path it was given).
function containsCwd(p: string): boolean {
  if (p === '/') return true
  const rel = nodePath.relative(p, process.cwd())
  return rel === '' || (rel !== '..' && !rel.startsWith('../') && !nodePath.isAbsolute(rel))
}

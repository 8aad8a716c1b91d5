/** Safe removal of a tree on its own, outside any pool. */
import { native } from './binding.js'
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
 * otherwise (`path`: that entry). Refuses the root directory, an empty path or one with a NUL byte, and unknown
 * option keys with `ERR_INVALID_ARG_VALUE` (a non-string `path` is `ERR_INVALID_ARG_TYPE`), before touching anything.
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

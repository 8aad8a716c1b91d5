/** Renames that never replace, and atomic swaps, on their own, outside any pool (publish). */
import { native } from './binding.js'
import { absolutePath } from './args.js'
import { call } from './errors.js'

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

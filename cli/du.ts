/**
 * Space a tree takes on disk: allocated blocks (st_blocks × 512, as du(1) counts them), hard links once, never
 * following a symlink and never entering another mount (as du -x). Node has no openat(2): each directory is
 * opened O_NOFOLLOW and read through its fd (/proc/self/fd/N), and the path the kernel gives for that fd must be
 * beneath the root, so a directory swapped for a symlink mid-walk (a guest can do that) never leads outside.
 * Memory grows with the number of directories waiting and of hard-linked files, never with file sizes.
 */
import * as fs from 'node:fs'
import * as fsp from 'node:fs/promises'
import * as path from 'node:path'

export interface TreeUsage {
  /** Allocated bytes (st_blocks × 512), the directories' own blocks included. */
  allocatedBytes: number
  /** Logical bytes of the regular files (holes included), hard links once. */
  logicalBytes: number
  files: number
  dirs: number
  /** Other entries: symlinks, fifos, sockets, device nodes. */
  others: number
  /** Directories not entered: mount points, and any that moved outside the root during the walk. */
  skipped: number
}

/** Entries that vanish during the walk (a workspace in use changes under it) are left out, not errors. */
function gone(e: unknown): boolean {
  const code = (e as NodeJS.ErrnoException).code
  return code === 'ENOENT' || code === 'ENOTDIR' || code === 'ELOOP'
}

export async function treeUsage(rootArg: string): Promise<TreeUsage> {
  const root = fs.realpathSync(rootArg)
  const u: TreeUsage = { allocatedBytes: 0, logicalBytes: 0, files: 0, dirs: 0, others: 0, skipped: 0 }
  const linked = new Set<string>() // dev:ino of files with more than one link, counted once
  let rootDev: bigint | undefined
  const stack = [root]
  while (stack.length) {
    const dir = stack.pop()!
    let fh: fsp.FileHandle
    try {
      fh = await fsp.open(dir, fs.constants.O_RDONLY | fs.constants.O_DIRECTORY | fs.constants.O_NOFOLLOW)
    } catch (e) {
      if (gone(e) && dir !== root) continue
      throw e
    }
    try {
      const st = await fh.stat({ bigint: true })
      rootDev ??= st.dev
      const real = await fsp.readlink(`/proc/self/fd/${fh.fd}`)
      if (st.dev !== rootDev || (real !== root && !real.startsWith(root + '/'))) {
        u.skipped++
        continue
      }
      u.allocatedBytes += Number(st.blocks) * 512
      u.dirs++
      for await (const entry of await fsp.opendir(`/proc/self/fd/${fh.fd}`, { bufferSize: 256 })) {
        const p = path.join(real, entry.name)
        if (entry.isDirectory()) {
          stack.push(p)
          continue
        }
        let est
        try {
          est = await fsp.lstat(p, { bigint: true })
        } catch (e) {
          if (gone(e)) continue
          throw e
        }
        if (est.isDirectory()) {
          stack.push(p) // d_type unknown (DT_UNKNOWN) on some file systems
          continue
        }
        if (est.nlink > 1n) {
          const key = `${est.dev}:${est.ino}`
          if (linked.has(key)) continue
          linked.add(key)
        }
        u.allocatedBytes += Number(est.blocks) * 512
        if (est.isFile()) {
          u.files++
          u.logicalBytes += Number(est.size)
        } else u.others++
      }
    } finally {
      await fh.close()
    }
  }
  return u
}

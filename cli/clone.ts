/**
 * `vmspace clone SRC DST [--reflink always|auto|never] [--overwrite]`: clone() with progress, a bar (cli-progress)
 * on a terminal and plain lines (one per tenth of the bytes) otherwise, on stderr; the result on stdout.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { clone as cloneTree, type Reflink } from 'vmspace'
import { EXIT_OK, errorText, humanBytes, interruptible, printJson, UsageError } from './common.js'
import { treeUsage } from './du.js'
import { ByteProgress } from './progress.js'

export interface CloneCliOptions {
  reflink?: Reflink
  overwrite?: boolean
  json?: boolean
}

export async function clone(srcArg: string, dstArg: string, opts: CloneCliOptions): Promise<number> {
  const src = path.resolve(srcArg)
  const dst = path.resolve(dstArg)
  let st: fs.Stats
  try {
    st = fs.lstatSync(src)
  } catch (e) {
    throw new UsageError(`SRC ${src}: ${(e as NodeJS.ErrnoException).code === 'ENOENT' ? 'no such file or directory' : errorText(e)}`)
  }
  if (!st.isFile() && !st.isDirectory()) throw new UsageError(`SRC ${src} is neither a regular file nor a directory`)
  if (!fs.statSync(path.dirname(dst), { throwIfNoEntry: false })?.isDirectory())
    throw new UsageError(`DST ${dst}: its parent directory does not exist`)
  if (fs.lstatSync(dst, { throwIfNoEntry: false }) && !opts.overwrite) throw new UsageError(`DST ${dst} exists (--overwrite replaces it)`)

  // The total, for the bar: logical bytes of the source's files (a metadata walk, no data read).
  const total = st.isFile() ? st.size : (await treeUsage(src)).logicalBytes
  const progress = new ByteProgress('clone')
  const result = await interruptible(
    async (signal) => {
      const r = await cloneTree(src, dst, { reflink: opts.reflink, overwrite: opts.overwrite, signal, onProgress: (p) => progress.update(p.bytes, total, `${p.files} files`) })
      progress.update(r.bytes, total, `${r.files} files`)
      return r
    },
    // An interrupt removed whatever was built; the status says which signal.
    (sig) => {
      progress.stop()
      process.stderr.write(`vmspace clone: ${sig}: stopped, nothing left at ${dst}\n`)
    },
  ).finally(() => progress.stop())
  if (typeof result === 'number') return result
  const r = result
  const skipped = (r.skipped?.sockets ?? 0) + (r.skipped?.devices ?? 0)
  if (opts.json) printJson({ source: src, ...r })
  else
    process.stdout.write(
      `cloned ${src} -> ${r.path}: ${r.kind}, ${r.method}, ${r.files} file(s), ${humanBytes(r.bytes)} ` +
        `(${r.reflinked} reflinked, ${r.copied} copied)${skipped ? `, ${skipped} skipped` : ''}\n`,
    )
  return EXIT_OK
}

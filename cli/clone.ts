/**
 * `vmspace clone SRC DST [--reflink always|auto|never] [--overwrite]`: clone() with progress, a bar (cli-progress)
 * on a terminal and plain lines (one per tenth of the bytes) otherwise, on stderr; the result on stdout.
 */
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { Presets, SingleBar } from 'cli-progress'
import { clone as cloneTree, type CloneProgressEvent, type CloneResult, type Reflink } from 'vmspace'
import { EXIT_OK, errorText, humanBytes, printJson, UsageError } from './common.js'
import { treeUsage } from './du.js'

export interface CloneCliOptions {
  reflink?: Reflink
  overwrite?: boolean
  json?: boolean
}

/** Shows progress towards `total` logical bytes. */
class CloneProgress {
  #bar: SingleBar | undefined
  #lastTenth = 0
  #stopped = false
  constructor(readonly total: number) {
    if (process.stderr.isTTY && total > 0) {
      this.#bar = new SingleBar(
        {
          format: 'clone {bar} {percentage}% | {done} of {all} | {files} files | {duration_formatted}',
          barsize: 30,
          hideCursor: true,
          stream: process.stderr,
          fps: 10,
        },
        Presets.shades_classic,
      )
      this.#bar.start(total, 0, { done: humanBytes(0), all: humanBytes(total), files: 0 })
    }
  }
  update(p: CloneProgressEvent): void {
    if (this.#stopped) return
    if (this.#bar) {
      this.#bar.update(Math.min(p.bytes, this.total), { done: humanBytes(p.bytes), all: humanBytes(this.total), files: p.files })
      return
    }
    const tenth = this.total > 0 ? Math.min(10, Math.floor((p.bytes * 10) / this.total)) : 0
    if (tenth > this.#lastTenth) {
      this.#lastTenth = tenth
      process.stderr.write(`vmspace clone: ${tenth * 10}% ${humanBytes(p.bytes)} of ${humanBytes(this.total)}, ${p.files} files\n`)
    }
  }
  stop(): void {
    this.#stopped = true
    this.#bar?.stop()
    this.#bar = undefined
  }
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
  const progress = new CloneProgress(total)
  const abort = new AbortController()
  let interrupted: NodeJS.Signals | undefined
  const onSignal = (sig: NodeJS.Signals) => {
    interrupted ??= sig
    abort.abort()
  }
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.on(sig, onSignal)
  let r: CloneResult
  try {
    r = await cloneTree(src, dst, { reflink: opts.reflink, overwrite: opts.overwrite, signal: abort.signal, onProgress: (p) => progress.update(p) })
    progress.update({ files: r.files, bytes: r.bytes })
  } catch (e) {
    // An interrupt removed whatever was built; the status says which signal.
    if (interrupted) {
      progress.stop()
      process.stderr.write(`vmspace clone: ${interrupted}: stopped, nothing left at ${dst}\n`)
      return 128 + (os.constants.signals[interrupted] ?? 0)
    }
    throw e
  } finally {
    progress.stop()
    for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.off(sig, onSignal)
  }
  const skipped = (r.skipped?.sockets ?? 0) + (r.skipped?.devices ?? 0)
  if (opts.json) printJson({ source: src, ...r })
  else
    process.stdout.write(
      `cloned ${src} -> ${r.path}: ${r.kind}, ${r.method}, ${r.files} file(s), ${humanBytes(r.bytes)} ` +
        `(${r.reflinked} reflinked, ${r.copied} copied)${skipped ? `, ${skipped} skipped` : ''}\n`,
    )
  return EXIT_OK
}

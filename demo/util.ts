/** Small helpers of the demo: formatting, hashing, tree manifests, file I/O at offsets, running commands, clean-up. */
import { spawn } from 'node:child_process'
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as fsp from 'node:fs/promises'
import * as path from 'node:path'
import { removeTree } from 'vmspace'
import { fsTypeName } from '../shared/fsinfo.js'
import { POOL_DIRS, SPARE_PREFIX } from '../shared/pool-dirs.js'
import { describe, MARKER_LEN } from './protocol.js'

export function statOrUndefined(p: string): fs.Stats | undefined {
  try {
    return fs.statSync(p)
  } catch {
    return undefined
  }
}

export { humanBytes } from '../shared/format.js'

export function percentile(sorted: number[], p: number): number {
  if (sorted.length === 0) return NaN
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))]
}

/** "1 entry", "2 entries". */
export function entriesText(n: number): string {
  return `${n} entr${n === 1 ? 'y' : 'ies'}`
}

export function ms(n: number): string {
  if (!Number.isFinite(n)) return '-'
  return n < 1 ? n.toFixed(3) : n < 100 ? n.toFixed(2) : n.toFixed(0)
}

export async function sha256(file: string): Promise<string> {
  const hash = createHash('sha256')
  for await (const chunk of fs.createReadStream(file, { highWaterMark: 1 << 20 })) hash.update(chunk as Buffer)
  return hash.digest('hex')
}

export interface Manifest {
  /** sha256 over one line per entry below the directory (sorted): path, type, mode, size, symlink target, and with
   * `contents` also mtime, ctime and the file's sha256. */
  digest: string
  entries: number
  files: number
  bytes: number
  /** The largest regular file with its owner-write bit and at least MARKER_LEN bytes (relative), if any. */
  probe?: string
}

/**
 * Walks `dir` without following symlinks. Sockets are left out (a tree clone skips them); `skip` is a name left out
 * at the top. Used by the workers (shape only: their clones have other times and one file with their marker) and by
 * the parent, before and after the run, on the template itself (with contents).
 */
export async function treeManifest(dir: string, options: { contents: boolean; skip?: string }): Promise<Manifest> {
  const hash = createHash('sha256')
  const m: Manifest = { digest: '', entries: 0, files: 0, bytes: 0 }
  let probeSize = -1
  const walk = async (rel: string) => {
    const names = (await fsp.readdir(path.join(dir, rel))).sort()
    for (const name of names) {
      if (rel === '' && name === options.skip) continue
      const r = rel === '' ? name : `${rel}/${name}`
      const abs = path.join(dir, r)
      const st = await fsp.lstat(abs, { bigint: true })
      if (st.isSocket()) continue
      const type = st.isFile() ? 'f' : st.isDirectory() ? 'd' : st.isSymbolicLink() ? 'l' : st.isFIFO() ? 'p' : st.isCharacterDevice() ? 'c' : 'b'
      let line = `${JSON.stringify(r)} ${type} ${(st.mode & 0o7777n).toString(8)}`
      if (type === 'f') line += ` ${st.size}`
      if (type === 'l') line += ` -> ${JSON.stringify(await fsp.readlink(abs))}`
      if (type === 'c' || type === 'b') line += ` rdev ${st.rdev}`
      if (options.contents) {
        line += ` mtime ${st.mtimeNs} ctime ${st.ctimeNs}`
        if (type === 'f') line += ` sha256 ${await sha256(abs)}`
      }
      hash.update(line + '\n')
      m.entries++
      if (type === 'f') {
        m.files++
        m.bytes += Number(st.size)
        if ((st.mode & 0o200n) !== 0n && st.size >= BigInt(MARKER_LEN) && st.size > probeSize) {
          probeSize = Number(st.size)
          m.probe = r
        }
      }
      if (type === 'd') await walk(r)
    }
  }
  await walk('')
  m.digest = hash.digest('hex')
  return m
}

export async function fsType(p: string): Promise<string> {
  try {
    return fsTypeName((await fsp.statfs(p)).type)
  } catch {
    return 'unknown fs'
  }
}

export function status(line: string): void {
  process.stderr.write(`demo: ${line}\n`)
}

/** Writes `buf` into the existing `file` at `offset`. */
export async function writeAt(file: string, buf: Buffer, offset: number): Promise<void> {
  const fh = await fsp.open(file, 'r+')
  try {
    await fh.write(buf, 0, buf.length, offset)
  } finally {
    await fh.close()
  }
}

/** `length` bytes of `file` from `offset` (zeros past its end). */
export async function readAt(file: string, length: number, offset: number): Promise<Buffer> {
  const buf = Buffer.alloc(length)
  const fh = await fsp.open(file, 'r')
  try {
    await fh.read(buf, 0, length, offset)
  } finally {
    await fh.close()
  }
  return buf
}

export async function fsyncPath(p: string, flags = 'r'): Promise<void> {
  const fh = await fsp.open(p, flags)
  try {
    await fh.sync()
  } finally {
    await fh.close()
  }
}

/** The first executable file of `names` (in that order of preference) on PATH or in `extraDirs`, or undefined. */
export function which(names: string[], extraDirs: string[]): string | undefined {
  const dirs = [...(process.env.PATH ?? '').split(path.delimiter).filter(Boolean), ...extraDirs]
  for (const name of names)
    for (const dir of dirs) {
      const p = path.join(dir, name)
      try {
        fs.accessSync(p, fs.constants.X_OK)
        if (fs.statSync(p).isFile()) return p
      } catch {
        // not here
      }
    }
  return undefined
}

/** A command's exit and its output (run, runOk). */
export interface CommandResult {
  code: number | null
  signal: NodeJS.Signals | null
  stdout: string
  stderr: string
}

/** Runs a command to completion (no shell), optionally feeding `input`; never rejects for a non-zero exit. */
export function run(cmd: string, args: string[], input?: string | Buffer, cwd?: string): Promise<CommandResult> {
  return new Promise((resolve, reject) => {
    const child = spawn(cmd, args, { stdio: ['pipe', 'pipe', 'pipe'], cwd })
    const out: Buffer[] = []
    const err: Buffer[] = []
    child.stdout.on('data', (b: Buffer) => out.push(b))
    child.stderr.on('data', (b: Buffer) => err.push(b))
    child.on('error', reject)
    child.on('close', (code, signal) =>
      resolve({ code, signal, stdout: Buffer.concat(out).toString(), stderr: Buffer.concat(err).toString() }),
    )
    // EPIPE when the command exits without reading all input: its exit status tells what went wrong.
    child.stdin.on('error', () => {})
    child.stdin.end(input)
  })
}

/** Like run(), but rejects with the command's stderr unless it exits 0. */
export async function runOk(cmd: string, args: string[], input?: string | Buffer, cwd?: string): Promise<string> {
  const r = await run(cmd, args, input, cwd)
  if (r.code !== 0)
    throw new Error(`${path.basename(cmd)} ${args.join(' ')} failed (${r.signal ?? `exit ${r.code}`}): ${r.stderr.trim()}`)
  return r.stdout
}

/** Things to remove when the run ends, however it ends. */
export class Cleanup {
  #steps: (() => Promise<void>)[] = []
  add(step: () => Promise<void>): () => void {
    this.#steps.push(step)
    return () => {
      const i = this.#steps.indexOf(step)
      if (i >= 0) this.#steps.splice(i, 1)
    }
  }
  async run(): Promise<string[]> {
    const errors: string[] = []
    while (this.#steps.length) {
      const step = this.#steps.pop()!
      try {
        await step()
      } catch (e) {
        errors.push(describe(e))
      }
    }
    return errors
  }
}

export async function removeIfThere(p: string): Promise<void> {
  try {
    await removeTree(p)
  } catch (e) {
    if ((e as { code?: string }).code !== 'ENOENT') throw e
  }
}

// The pool's entries, to show that dispose left nothing behind

// The staging shards (.vmspace/staging/s0 ... s7) and lease shards (.vmspace/leases/0 ... f) are not entries: what
// is in them is.
export async function poolEntries(root: string): Promise<string[]> {
  const out: string[] = []
  const read = async (rel: string, skip?: string) => {
    try {
      for (const name of await fsp.readdir(path.join(root, rel))) {
        if (name === skip) continue
        const shard = (rel === POOL_DIRS.staging && /^s[0-7]$/.test(name)) || (rel === POOL_DIRS.leases && /^[0-9a-f]$/.test(name))
        if (shard && (await fsp.lstat(path.join(root, rel, name))).isDirectory()) await read(path.join(rel, name))
        else if (!name.startsWith(SPARE_PREFIX)) out.push(path.join(rel, name)) // a pool's own, removed by its close()
      }
    } catch (e) {
      if ((e as { code?: string }).code !== 'ENOENT') throw e
    }
  }
  await read('.', POOL_DIRS.state)
  for (const dir of [POOL_DIRS.staging, POOL_DIRS.trash, POOL_DIRS.leases]) await read(dir)
  return out
}

/** What the commands share: exit codes, usage errors, pool roots, output formatting. */
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { POOL_DIRS } from '../shared/pool-dirs.js'

/** Exit codes (documented in docs/cli.md). `run` exits with its command's status instead, or EXIT_RUN_FAILED. */
export const EXIT_OK = 0
/** The command ran, and some entries (or the whole operation) failed. */
export const EXIT_FAILED = 1
/** Bad arguments: nothing was touched. */
export const EXIT_USAGE = 2
/**
 * `run`: vmspace itself failed (bad arguments, the allocation, the dispose after a CMD that exited 0), a status
 * apart from CMD's own, as env(1) and timeout(1) use it (126: CMD not executable, 127: not found).
 */
export const EXIT_RUN_FAILED = 125

/** A bad argument, found before anything is touched: one line on stderr, exit 2 (`run`: 125). */
export class UsageError extends Error {}

/** One line for an error: its message (VmspaceErrors carry code, syscall and path in it). */
export function errorText(e: unknown): string {
  if (e instanceof Error) return e.message.split('\n')[0]
  return String(e)
}

// errno number -> name, for Node's own fs errors: libuv has no UV_EDQUOT, so Node reports a quota hit as code
// 'UNKNOWN' with errno -122; the number is what counts (vmspace's errors are named this way already).
const errnoNames = new Map(Object.entries(os.constants.errno).map(([name, n]) => [n, name]))

/**
 * The error fields --json output gives for a failed entry: stable keys, null where unknown. A Node error with code
 * 'UNKNOWN' and an errno Node's table names (EDQUOT) gets that name, in `code` and at the start of `message`.
 */
export function errorJson(e: unknown): { code: string | null; message: string } {
  const { code, errno } = (e ?? {}) as { code?: unknown; errno?: unknown }
  const named = code === 'UNKNOWN' && typeof errno === 'number' ? errnoNames.get(-errno) : undefined
  if (named) return { code: named, message: errorText(e).replace(/^UNKNOWN\b/, named) }
  return { code: typeof code === 'string' ? code : null, message: errorText(e) }
}

/**
 * `arg` as an existing directory (resolved against the cwd); a usage error otherwise, so that a typo never makes
 * or touches anything.
 */
export function existingDir(what: string, arg: string): string {
  const dir = path.resolve(arg)
  let st: fs.Stats
  try {
    st = fs.statSync(dir)
  } catch (e) {
    throw new UsageError(`${what} ${dir}: ${(e as NodeJS.ErrnoException).code === 'ENOENT' ? 'no such directory' : errorText(e)}`)
  }
  if (!st.isDirectory()) throw new UsageError(`${what} ${dir} is not a directory`)
  return dir
}

/** A workspace's, template's or checkpoint's id: 32 lowercase hex digits (128 random bits; docs/pool-on-disk.md). */
export const ID = /^[0-9a-f]{32}$/
/** A workspace's name: `<prefix>-<id>` (a prefix of 1–64 letters, digits, `_` and `-`, starting with a letter or digit). */
export const WORKSPACE_NAME = /^[A-Za-z0-9][A-Za-z0-9_-]{0,63}-[0-9a-f]{32}$/

/** `arg` as the root of an existing pool (it has `.vmspace/version`, see docs/pool-on-disk.md). */
export function poolRoot(arg: string): string {
  const root = existingDir('ROOT', arg)
  if (!fs.existsSync(path.join(root, POOL_DIRS.version))) throw new UsageError(`ROOT ${root} is not a vmspace pool (no ${POOL_DIRS.version})`)
  return root
}

/**
 * `arg` as the root of a pool that is made when missing: a pool, an empty directory or a new one whose parent
 * exists. A directory holding other entries is not made a pool (openPool's rule; ls and sweep refuse it too).
 */
export function poolRootOrNew(what: string, arg: string): string {
  const root = path.resolve(arg)
  let st: fs.Stats | undefined
  try {
    st = fs.statSync(root)
  } catch {
    if (!fs.statSync(path.dirname(root), { throwIfNoEntry: false })?.isDirectory()) throw new UsageError(`${what} ${root}: its parent directory does not exist`)
  }
  if (st && !st.isDirectory()) throw new UsageError(`${what} ${root} is not a directory`)
  if (st && !fs.existsSync(path.join(root, POOL_DIRS.state)) && fs.readdirSync(root).length > 0)
    throw new UsageError(`${what} ${root} is not a vmspace pool and holds other entries (a pool is made in an empty or missing directory)`)
  return root
}

/** Parses a non-negative integer option value (commander calls it; a throw is reported as a usage error). */
export function nonNegativeInt(name: string, max: number, min = 0) {
  return (value: string): number => {
    if (!/^\d+$/.test(value.trim()) || Number(value) > max || Number(value) < min)
      throw new UsageError(`${name} must be an integer from ${min} to ${max}, got ${JSON.stringify(value)}`)
    return Number(value)
  }
}

/** A duration in ms, or with a unit: `500ms`, `45s`, `90m`, `12h`, `7d`. */
export function parseDuration(name: string) {
  const units: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000 }
  return (value: string): number => {
    const m = /^\s*(\d+)\s*(ms|s|m|h|d)?\s*$/.exec(value)
    const n = m ? Number(m[1]) * units[m[2] ?? 'ms'] : NaN
    if (!m || !Number.isSafeInteger(n)) throw new UsageError(`${name} must be a duration in ms, or with a unit (ms, s, m, h, d), got ${JSON.stringify(value)}`)
    return n
  }
}

/** A size with an optional binary suffix (K, M, G, T): `4G`, `512M`, `1073741824`. */
export function parseSize(name: string) {
  return (value: string): number => {
    const m = /^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$/i.exec(value)
    const n = m ? Number(m[1]) * 1024 ** 'BKMGT'.indexOf((m[2] || 'B').toUpperCase()) : NaN
    if (!m || !Number.isSafeInteger(n)) throw new UsageError(`${name} must be a size in bytes, with an optional K, M, G or T suffix (binary units), got ${JSON.stringify(value)}`)
    return n
  }
}

export { humanBytes } from '../shared/format.js'

/** "45s", "12m", "3h12m", "4d2h". */
export function humanAge(ms: number): string {
  const s = Math.max(0, Math.floor(ms / 1000))
  if (s < 60) return `${s}s`
  const m = Math.floor(s / 60)
  if (m < 60) return `${m}m`
  const h = Math.floor(m / 60)
  if (h < 24) return `${h}h${m % 60 ? `${m % 60}m` : ''}`
  const d = Math.floor(h / 24)
  return `${d}d${h % 24 ? `${h % 24}h` : ''}`
}

/** Rows as columns padded to their widest cell (the last column unpadded). */
export function table(header: string[], rows: string[][]): string {
  const all = [header, ...rows]
  const widths = header.map((_, i) => Math.max(...all.map((r) => r[i].length)))
  return all.map((r) => r.map((cell, i) => (i === r.length - 1 ? cell : cell.padEnd(widths[i]))).join('  ')).join('\n') + '\n'
}

/** --json output: one JSON document on stdout, pretty-printed, newline-terminated. */
export function printJson(value: unknown): void {
  process.stdout.write(JSON.stringify(value, null, 2) + '\n')
}

const INTERRUPTS = ['SIGINT', 'SIGTERM', 'SIGHUP'] as const

/**
 * An AbortSignal that the first of SIGINT, SIGTERM or SIGHUP aborts, for as long as `fn` runs; `fn`'s result, or,
 * when an interrupt stopped it (whatever it threw), the status a shell gives for that signal (128 + N) after
 * `onInterrupt` has said what was left.
 */
export async function interruptible<T>(fn: (signal: AbortSignal) => Promise<T>, onInterrupt: (sig: NodeJS.Signals) => void): Promise<T | number> {
  const abort = new AbortController()
  let interrupted: NodeJS.Signals | undefined
  const onSignal = (sig: NodeJS.Signals) => {
    interrupted ??= sig
    abort.abort()
  }
  for (const sig of INTERRUPTS) process.on(sig, onSignal)
  try {
    return await fn(abort.signal)
  } catch (e) {
    if (!interrupted) throw e
    onInterrupt(interrupted)
    return 128 + (os.constants.signals[interrupted] ?? 0)
  } finally {
    for (const sig of INTERRUPTS) process.off(sig, onSignal)
  }
}

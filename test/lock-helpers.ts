/**
 * Helpers for the lock and index suites: who is blocked in flock(2) on a file (from /proc/locks, the kernel's own
 * view, so a test knows a waiter is really waiting instead of guessing with a sleep), and the index child process.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { Child, eventually, fixtures } from './helpers.js'

export interface FlockEntry {
  /** True for a request that waits (the kernel prints it as `->`), false for a granted lock. */
  blocked: boolean
  shared: boolean
  pid: number
}

/** The flock(2) locks and waiting requests on the inode `file` names now (a missing file has none). */
export function flocksOn(file: string): FlockEntry[] {
  let st: fs.BigIntStats
  try {
    st = fs.statSync(file, { bigint: true })
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return []
    throw e
  }
  // The device as /proc/locks prints it, "major:minor" in hex (glibc's gnu_dev_major/gnu_dev_minor split).
  const major = ((st.dev >> 8n) & 0xfffn) | ((st.dev >> 32n) & ~0xfffn)
  const minor = (st.dev & 0xffn) | ((st.dev >> 12n) & ~0xffn)
  const read = () => {
    const out: FlockEntry[] = []
    // "12: FLOCK  ADVISORY  WRITE 1234 fe:00:2146723 0 EOF" and, for a waiter, "12: -> FLOCK  ADVISORY  WRITE …"
    for (const line of fs.readFileSync('/proc/locks', 'utf8').split('\n')) {
      const m = /^\d+:\s+(->\s+)?FLOCK\s+\S+\s+(READ|WRITE)\s+(\d+)\s+([0-9a-f]+):([0-9a-f]+):(\d+)\s/.exec(line)
      if (m && BigInt(m[6]!) === st.ino && BigInt(`0x${m[4]}`) === major && BigInt(`0x${m[5]}`) === minor)
        out.push({ blocked: m[1] !== undefined, shared: m[2] === 'READ', pid: Number(m[3]) })
    }
    return out
  }
  // /proc/locks is a seq_file: a long table comes in several read(2)s, each a fresh walk of the kernel's list, so
  // locks taken or dropped elsewhere between them (other suites, other processes) can repeat or skip entries.
  // Two reads in a row that agree on this inode are a consistent view of it.
  let last = read()
  for (let i = 0; i < 20; i++) {
    const next = read()
    if (JSON.stringify(next) === JSON.stringify(last)) return next
    last = next
  }
  return last
}

/** How many flock requests wait on `file` (of process `pid` only, when given). */
export function flockWaiters(file: string, pid?: number): number {
  return flocksOn(file).filter((e) => e.blocked && (pid === undefined || e.pid === pid)).length
}

/** Resolves once at least `n` flock requests (of `pid`, when given) wait on `file`. */
export function waitersOn(file: string, n: number, pid?: number): Promise<void> {
  return eventually(() => flockWaiters(file, pid) >= n)
}

/** test/fixtures/json-file-child.cjs: a process doing lockFile/updateJsonFile on command (see that file). */
export class IndexChild extends Child {
  constructor() {
    super(path.join(fixtures, 'json-file-child.cjs'))
  }

  command(cmd: Record<string, unknown>): void {
    this.send(JSON.stringify(cmd))
  }
}

/** Names in `dir` that look like updateJsonFile's temp files (`.<name>.tmp-<hex>`). */
export function indexTemps(dir: string): string[] {
  return fs.readdirSync(dir).filter((n) => /^\..+\.tmp-/.test(n))
}

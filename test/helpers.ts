/**
 * Shared test helpers: per-test temp dirs on a chosen file system, FIEMAP shared-extent checks, sparse files,
 * hashes, a barrier, a line-protocol child-process runner, and views of a pool's on-disk state.
 * Everything runs against real file systems (see setup/global-setup.ts).
 */
import { spawn, spawnSync, type ChildProcess, type SpawnOptions } from 'node:child_process'
import { createHash, randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import * as readline from 'node:readline'
import { expect, inject, onTestFinished, test } from 'vitest'
import type { Pool, Workspace } from '../lib/index.js'
import { leasePath } from '../lib/layout.js'
import { removeScratch, type Mounts } from './setup/mounts.js'

export { mountsBeneath } from './setup/mounts.js'

/** The package root of this checkout (CI runs from another clone path). */
export const repoRoot = path.resolve(__dirname, '..')
export const fixtures = path.join(repoRoot, 'test', 'fixtures')

// The file systems of this file's worker: no other file running at the same time uses them (global-setup.ts).
export const mounts: Mounts = inject('mounts')[Number(process.env.VITEST_POOL_ID ?? 1) - 1] ?? inject('mounts')[0]
export const requireReflink = process.env.VMSPACE_REQUIRE_REFLINK === '1'

/** Whether `p` and every directory above it lets others in (so a process of another uid can reach it). */
export function reachableByOthers(p: string): boolean {
  for (let d = p; ; d = path.dirname(d)) {
    if ((fs.statSync(d).mode & 0o005) !== 0o005) return false
    if (d === '/') return true
  }
}

/** Whether tests can run a child as uid 65534: root, and the checkout and the scratch dir reachable by others. */
export const unprivilegedChildren = mounts.root && reachableByOthers(repoRoot) && reachableByOthers(mounts.scratch)

/**
 * The share of their rounds that the stress tests (many processes or many random rounds looking for races) run:
 * VMSPACE_STRESS, a number in (0, 1], default 1. CI runs the suite in full once and with 0.25 on the other Node
 * versions and under the sanitizers, where the races they look for do not change. Every test still runs.
 */
const STRESS = (() => {
  const v = Number(process.env.VMSPACE_STRESS ?? 1)
  if (!(v > 0 && v <= 1)) throw new Error(`VMSPACE_STRESS must be a number in (0, 1], not ${process.env.VMSPACE_STRESS}`)
  return v
})()

/** `n` rounds scaled by VMSPACE_STRESS (at least `min`). */
export function stressRounds(n: number, min = 1): number {
  return Math.max(min, Math.round(n * STRESS))
}

export const MiB = 1024 * 1024
export const GiB = 1024 * MiB

/** The targets of this process's open fds that lie under `dir` (an fd closed while read is left out). */
export function openFdsUnder(dir: string): string[] {
  return fs
    .readdirSync('/proc/self/fd')
    .map((fd) => {
      try {
        return fs.readlinkSync(`/proc/self/fd/${fd}`)
      } catch {
        return ''
      }
    })
    .filter((target) => target.startsWith(dir))
}

/**
 * A fresh, empty directory below `base` (a mount point from `mounts`), removed when the current test finishes
 * (mounts below it are unmounted first). Call inside a test.
 */
export function freshDir(base: string = mounts.scratch, label = 't'): string {
  const dir = fs.mkdtempSync(path.join(base, `vmspace-${label}-`))
  onTestFinished(() => removeScratch(dir))
  return dir
}

/** A suite-name suffix stating what the suite needs and, when it is missing, why it is skipped. */
export function needs(what: string, missing: string | false | null | undefined): string {
  return missing ? `(needs ${what}; skipped: ${missing})` : `(needs ${what})`
}

/**
 * For a suite that needs a loop-mounted file system: when it is missing and VMSPACE_REQUIRE_REFLINK=1, a test that
 * fails saying why (the suite itself is skipped with describe.skipIf).
 */
export function requireMount(label: string, mountPoint: string | null, why: string | undefined): void {
  if (mountPoint === null && requireReflink)
    test(`${label} is available (required by VMSPACE_REQUIRE_REFLINK=1)`, () => {
      expect.fail(`${label} could not be made: ${why ?? 'unknown reason'}`)
    })
}

// ---- files ----

/** A regular file of `size` random bytes (fsynced); returns its bytes. */
export function writeRandomFile(file: string, size: number, mode = 0o644): Buffer {
  const data = randomBytes(size)
  const fd = fs.openSync(file, 'wx', mode)
  try {
    fs.writeSync(fd, data)
    fs.fsyncSync(fd)
  } finally {
    fs.closeSync(fd)
  }
  fs.chmodSync(file, mode)
  return data
}

/** A sparse file of logical `size` with random data only at [dataOffset, dataOffset + dataLength). */
export function makeSparseFile(file: string, size: number, dataOffset: number, dataLength: number): Buffer {
  const data = randomBytes(dataLength)
  const fd = fs.openSync(file, 'wx', 0o644)
  try {
    fs.writeSync(fd, data, 0, data.length, dataOffset)
    fs.ftruncateSync(fd, size)
    fs.fsyncSync(fd)
  } finally {
    fs.closeSync(fd)
  }
  return data
}

/** Bytes the file system allocated for `file` (st_blocks * 512). */
export function allocatedBytes(file: string): number {
  return fs.statSync(file).blocks * 512
}

export async function sha256File(file: string): Promise<string> {
  const hash = createHash('sha256')
  for await (const chunk of fs.createReadStream(file, { highWaterMark: 8 * MiB })) hash.update(chunk as Buffer)
  return hash.digest('hex')
}

/** Whether two files have the same size and bytes (chunked compare: much faster than hashing 1 GiB). */
export function sameContent(a: string, b: string): boolean {
  if (fs.statSync(a).size !== fs.statSync(b).size) return false
  const [fa, fb] = [fs.openSync(a, 'r'), fs.openSync(b, 'r')]
  const [ba, bb] = [Buffer.alloc(16 * MiB), Buffer.alloc(16 * MiB)]
  try {
    for (let pos = 0; ; ) {
      const na = fs.readSync(fa, ba, 0, ba.length, pos)
      const nb = fs.readSync(fb, bb, 0, bb.length, pos)
      if (na !== nb || !ba.subarray(0, na).equals(bb.subarray(0, nb))) return false
      if (na === 0) return true
      pos += na
    }
  } finally {
    fs.closeSync(fa)
    fs.closeSync(fb)
  }
}

export function readRange(file: string, offset: number, length: number): Buffer {
  const buf = Buffer.alloc(length)
  const fd = fs.openSync(file, 'r')
  try {
    const n = fs.readSync(fd, buf, 0, length, offset)
    return buf.subarray(0, n)
  } finally {
    fs.closeSync(fd)
  }
}

/** Sorted names in `dir`, or [] when it does not exist. */
export function ls(dir: string): string[] {
  try {
    return fs.readdirSync(dir).sort()
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return []
    throw e
  }
}

/** Every path below `dir` (relative, sorted) with its kind, mode, inode and, for files, content hash. */
export function snapshotTree(dir: string): Record<string, string> {
  const out: Record<string, string> = {}
  const walk = (rel: string) => {
    const abs = path.join(dir, rel)
    const st = fs.lstatSync(abs)
    let desc = `${st.mode.toString(8)} ino=${st.ino} size=${st.size}`
    if (st.isFile()) desc += ' sha256=' + createHash('sha256').update(fs.readFileSync(abs)).digest('hex')
    if (st.isSymbolicLink()) desc += ' -> ' + fs.readlinkSync(abs)
    out[rel || '.'] = desc
    if (st.isDirectory()) for (const name of fs.readdirSync(abs).sort()) walk(path.join(rel, name))
  }
  walk('')
  return out
}

/** An outside directory with a file and a subdirectory, as something a removal must never touch. */
export function outsideTree(dir: string): string {
  const outside = path.join(dir, 'outside')
  fs.mkdirSync(path.join(outside, 'sub'), { recursive: true })
  fs.writeFileSync(path.join(outside, 'keep.txt'), 'keep me')
  fs.writeFileSync(path.join(outside, 'sub', 'deep.txt'), 'keep me too')
  return outside
}

/** Temp names of the clone engine (`.vmspace-tmp-*`) or metadata writer (`.*.tmp-*`) left in `dir`. */
export function tempLeftovers(dir: string): string[] {
  return ls(dir).filter((n) => n.startsWith('.vmspace-tmp-') || /^\..*\.tmp-/.test(n))
}

// ---- pools ----

export interface PoolState {
  /** Entries of the root other than `.vmspace`. */
  visible: string[]
  /** Builds, as "s<i>/<name>". */
  staging: string[]
  trash: string[]
  /** Lease files, as "<shard>/<name>". */
  leases: string[]
}

export function poolState(root: string): PoolState {
  return {
    visible: ls(root).filter((n) => n !== '.vmspace'),
    staging: stagingEntries(root),
    trash: ls(path.join(root, '.vmspace', 'trash')),
    leases: shardEntries(path.join(root, '.vmspace', 'leases')),
  }
}

/**
 * Entries of the shards of `dir` (staging/s0..s7, leases/0..f) as "<shard>/<name>" (not the shards). Spare lease
 * files (`.spare-<hex>`: kept, locked, by a process that has the pool open, and removed by its close()) are not
 * entries.
 */
function shardEntries(dir: string): string[] {
  return ls(dir).flatMap((n) =>
    fs.lstatSync(path.join(dir, n)).isDirectory() ? ls(path.join(dir, n)).filter((e) => !e.startsWith('.spare-')).map((e) => `${n}/${e}`) : [n],
  )
}

/** Builds in .vmspace/staging/: the shards' entries as "s<i>/<name>" (not the shards). */
export function stagingEntries(root: string): string[] {
  return shardEntries(path.join(root, '.vmspace', 'staging'))
}

export const emptyPoolState: PoolState = { visible: [], staging: [], trash: [], leases: [] }

/** The lease file of workspace `name`, which holds its record (xattr user.vmspace.record): lib's, from the core. */
export { leasePath } from '../lib/layout.js'

/** Replaces the record of workspace `name` (as root: its lease file has no write bit), e.g. with text that does not parse. */
export function setRecord(root: string, name: string, text: string): void {
  // Hex: setfattr(1) would read a value in double quotes as a quoted string.
  const value = text === '' ? '' : '0x' + Buffer.from(text).toString('hex')
  const r = spawnSync('setfattr', ['-n', 'user.vmspace.record', '-v', value, leasePath(root, name)], { encoding: 'utf8' })
  if (r.status !== 0) throw new Error(`setfattr: ${r.stderr}`)
}

/** A workspace whose lease is free: allocated here with `meta`, own.txt written (its id), then released without a handoff. */
export async function orphan(pool: Pool, meta = {}): Promise<Workspace> {
  const ws = await pool.allocate({ meta })
  fs.writeFileSync(path.join(ws.path, 'own.txt'), ws.id)
  await ws.release({ force: true })
  return ws
}

/**
 * `outsideTree(dir)` bind-mounted at `<wsPath>/mnt` (as root), with a sibling file next to the mount point; the
 * outside directory and its snapshot before anything happens to the workspace.
 */
export function bindInto(dir: string, wsPath: string): { outside: string; before: Record<string, string> } {
  const outside = outsideTree(dir)
  fs.mkdirSync(path.join(wsPath, 'mnt'))
  fs.writeFileSync(path.join(wsPath, 'sibling.txt'), 'x')
  const bind = runCommand('mount', ['--bind', outside, path.join(wsPath, 'mnt')])
  expect(bind.status, bind.stderr).toBe(0)
  return { outside, before: snapshotTree(outside) }
}

/** A fresh 32-lowercase-hex workspace id. */
export function randomId(): string {
  return randomBytes(16).toString('hex')
}

// ---- FIEMAP ----

export interface Extent {
  logical: number
  physical: number
  length: number
  flags: string[]
}

/** The extents of `file` as `filefrag -v` (FIEMAP) reports them, in file-system blocks. */
export function extents(file: string): Extent[] {
  const r = spawnSync('filefrag', ['-v', '-s', file], { encoding: 'utf8' })
  if (r.status !== 0) throw new Error(`filefrag -v ${file} failed: ${r.stderr}`)
  const out: Extent[] = []
  for (const line of r.stdout.split('\n')) {
    // "   0:        0..     255:         24..       279:    256:             last,shared,eof"
    const m = /^\s*\d+:\s*(\d+)\.\.\s*\d+:\s*(\d+)\.\.\s*\d+:\s*(\d+):(?:\s*\d+:)?\s*([\w,]*)\s*$/.exec(line)
    if (m) out.push({ logical: +m[1], physical: +m[2], length: +m[3], flags: m[4] ? m[4].split(',') : [] })
  }
  return out
}

/** Counts of the extents of `file` and of those flagged shared. */
export function sharedExtents(file: string): { extents: number; shared: number } {
  const e = extents(file)
  return { extents: e.length, shared: e.filter((x) => x.flags.includes('shared')).length }
}

/**
 * Waits until no extent of `file` is flagged shared, for at most `limitMs`, then fails naming the file. XFS frees a
 * removed file's extents in the background (deferred inode inactivation, "inodegc"), and syncfs(2) only starts that
 * work (xfs_inodegc_push in current kernels) without waiting for it: a file whose reflinked sibling was just removed
 * can report shared extents for a while after `sync -f`.
 */
export async function extentsUnshared(file: string, limitMs = 30_000): Promise<void> {
  for (const start = Date.now(); sharedExtents(file).shared > 0; ) {
    if (Date.now() - start > limitMs) throw new Error(`${file}: extents still shared after ${limitMs} ms`)
    await new Promise((resolve) => setTimeout(resolve, 20))
  }
}

// ---- concurrency ----

/** Resolves every wait() once `parties` callers are waiting. */
export class Barrier {
  #waiting = 0
  #release!: () => void
  readonly #released = new Promise<void>((resolve) => (this.#release = resolve))
  constructor(readonly parties: number) {}
  wait(): Promise<void> {
    if (++this.#waiting === this.parties) this.#release()
    return this.#released
  }
}

// ---- child processes ----

/**
 * One process per CPU, each spinning until it is killed or this process is gone (its parent changes), so that a
 * test worker killed mid-test leaves none behind to slow whatever runs next.
 */
export function spinCpus(): ChildProcess[] {
  const spin = `for (let i = 1; ; i++) if (i % 0x100000 === 0 && process.ppid !== ${process.pid}) process.exit()`
  return os.cpus().map(() => spawn(process.execPath, ['-e', spin], { stdio: 'ignore' }))
}

/** Runs a command to completion; its exit status and output. */
export function runCommand(cmd: string, args: string[], options: SpawnOptions = {}) {
  const r = spawnSync(cmd, args, { encoding: 'utf8', ...options })
  if (r.error) throw r.error
  return { status: r.status, signal: r.signal, stdout: r.stdout as string, stderr: r.stderr as string }
}

/** `flock -n -E 99 <target> true` in another process: 99 when the lock is held elsewhere, 0 when it was free. */
export function tryFlockPath(target: string): number | null {
  return runCommand('flock', ['-n', '-E', '99', target, 'true']).status
}

// F_OFD_GETLK of a write lock over the whole file: any lock another description holds on it (python3's fcntl, which
// knows the OFD commands; Node has no fcntl).
const LEASE_PROBE = `
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NOFOLLOW)
lk = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack('hhqqi', fcntl.F_WRLCK, 0, 0, 0, 0))
sys.exit(0 if struct.unpack('hhqqi', lk)[0] == fcntl.F_UNLCK else 99)
`

/**
 * Probes the lease of workspace `name` of the pool at `root` from another process: 99 when a process holds it, 0 when
 * it is free, another status when the lease file cannot be opened (2: gone).
 */
export function tryLease(root: string, name: string): number | null {
  return runCommand('python3', ['-c', LEASE_PROBE, leasePath(root, name)]).status
}

/** The record of workspace `name` (its lease file's xattr user.vmspace.record) as bytes, or null without one. */
export function getRecord(root: string, name: string): Buffer | null {
  const r = spawnSync('getfattr', ['--only-values', '-n', 'user.vmspace.record', leasePath(root, name)])
  return r.status === 0 ? (r.stdout as Buffer) : null
}

/**
 * A process holding the lease of workspace `name` as a build does (an OFD read lock on byte 0 of its lease file,
 * made here when missing) until its stdin ends; resolves once the lock is held.
 */
export async function leaseHolder(root: string, name: string): Promise<ChildProcess> {
  const script = `
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o400)
fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack('hhqqi', fcntl.F_RDLCK, 0, 0, 1, 0))
print('held', flush=True)
sys.stdin.read()
`
  const child = spawn('python3', ['-c', script, leasePath(root, name)], { stdio: ['pipe', 'pipe', 'inherit'] })
  onTestFinished(() => void child.kill('SIGKILL'))
  await new Promise<void>((resolve, reject) => {
    child.stdout!.once('data', () => resolve())
    child.once('exit', (code) => reject(new Error(`lease holder exited with ${code}`)))
  })
  return child
}

/** `flock -n -E 99 3` on an fd this process has open, given to the child as its fd 3. */
export function tryFlockFd(fd: number): number | null {
  return runCommand('flock', ['-n', '-E', '99', '3'], { stdio: ['ignore', 'pipe', 'pipe', fd] }).status
}

/** Targets of the open fds of process `pid` (readlink of /proc/<pid>/fd/*). */
export function openFdTargets(pid: number): Map<number, string> {
  const out = new Map<number, string>()
  for (const fd of fs.readdirSync(`/proc/${pid}/fd`)) {
    try {
      out.set(Number(fd), fs.readlinkSync(`/proc/${pid}/fd/${fd}`))
    } catch {
      // closed meanwhile
    }
  }
  return out
}

export type Message = { event: string; [key: string]: unknown }

/** The start time of process `pid` (field 22 of /proc/<pid>/stat, clock ticks since boot), or null once it is gone. */
function startTime(pid: number): string | null {
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8')
    return stat.slice(stat.lastIndexOf(')') + 2).split(' ')[19] ?? null
  } catch {
    return null
  }
}

/**
 * SIGKILLs process `pid` (not a child of ours: reaped by init) when the test finishes, if it still runs. Its start
 * time is compared first, so a pid reused by another process after it exited is never killed.
 */
export function killOnFinish(pid: number): void {
  const started = startTime(pid)
  onTestFinished(() => {
    if (started === null || startTime(pid) !== started) return
    try {
      process.kill(pid, 'SIGKILL')
    } catch {
      // gone meanwhile
    }
  })
}

/**
 * A child process speaking JSON lines: it writes one JSON object per stdout line, reads commands as stdin lines.
 * Killed when the current test finishes, if still running.
 */
export class Child {
  readonly proc: ChildProcess
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>
  stderr = ''
  #messages: Message[] = []
  #waiters: { resolve: (m: Message) => void; reject: (e: Error) => void }[] = []
  #done = false

  constructor(script: string, args: string[] = []) {
    this.proc = spawn(process.execPath, [script, ...args], { stdio: ['pipe', 'pipe', 'pipe'] })
    this.proc.stderr!.setEncoding('utf8').on('data', (s: string) => (this.stderr += s))
    readline.createInterface({ input: this.proc.stdout! }).on('line', (line) => {
      let m: Message
      try {
        m = JSON.parse(line) as Message
      } catch {
        m = { event: 'garbage', line }
      }
      const w = this.#waiters.shift()
      if (w) w.resolve(m)
      else this.#messages.push(m)
    })
    // 'exit' can come before the last lines the child wrote are read from the pipe: its answers are awaited to the
    // pipe's end (bounded: a process the child started may hold the pipe open) before a waiter is told it exited.
    const stdoutClosed = new Promise<void>((resolve) => this.proc.stdout!.once('close', () => resolve()))
    this.exited = new Promise((resolve) => {
      this.proc.on('exit', (code, signal) => {
        void Promise.race([stdoutClosed, new Promise((r) => setTimeout(r, 2000).unref())]).then(() => {
          this.#done = true
          for (const w of this.#waiters.splice(0))
            w.reject(new Error(`child exited (${code ?? signal}) before answering; stderr: ${this.stderr}`))
          resolve({ code, signal })
        })
      })
    })
    // A failed spawn (EAGAIN under load) or a write after the child died: a failed wait, not an uncaught error.
    this.proc.on('error', (e) => {
      this.stderr += `\n[${e.message}]`
      for (const w of this.#waiters.splice(0)) w.reject(e)
    })
    this.proc.stdin!.on('error', () => {})
    onTestFinished(async () => {
      if (this.#done || this.proc.exitCode !== null || this.proc.signalCode !== null) return
      this.proc.kill('SIGKILL')
      // Reaped before the directories it may write into are removed (bounded: a child stuck in the kernel).
      await Promise.race([this.exited, new Promise((r) => setTimeout(r, 5000).unref())])
    })
  }

  get pid(): number {
    return this.proc.pid!
  }

  /** The next message; rejects when the child exits first. */
  next(): Promise<Message> {
    const m = this.#messages.shift()
    if (m) return Promise.resolve(m)
    if (this.#done) return Promise.reject(new Error(`child exited; stderr: ${this.stderr}`))
    return new Promise((resolve, reject) => this.#waiters.push({ resolve, reject }))
  }

  /** The next message, which must be `event` (an 'error' message fails with the child's error). */
  async expect(event: string): Promise<Message> {
    const m = await this.next()
    if (m.event !== event) throw new Error(`expected '${event}' from child ${this.pid}, got ${JSON.stringify(m)}; stderr: ${this.stderr}`)
    return m
  }

  send(line: string): void {
    this.proc.stdin!.write(line + '\n')
  }
}

/**
 * One op of test/fixtures/faults-child.cjs (tree operations under resource limits) in a child of its own, so that
 * the limits, the RSS and the uid are its own: its one JSON message, after it exited 0.
 */
export async function faultsChild(req: object): Promise<Record<string, unknown>> {
  const child = new Child(path.join(fixtures, 'faults-child.cjs'), [JSON.stringify(req)])
  child.proc.stdin!.end()
  const m = await child.next()
  const exit = await child.exited
  expect(m.event, `${JSON.stringify(m)}; stderr: ${child.stderr}`).not.toBe('error')
  expect(exit.code, child.stderr).toBe(0)
  return m
}

/** Starts test/fixtures/workspace-child.cjs on the pool at `root` (see that file for its commands). */
export function workspaceChild(root: string): Child {
  return new Child(path.join(fixtures, 'workspace-child.cjs'), [root])
}

/** What a workspace child reports for 'allocate': its workspace, and the content it wrote to own.txt. */
export interface Allocated {
  id: string
  name: string
  path: string
  content: string
}

/**
 * Waits until every workspace child is ready (each has opened the pool and blocks reading stdin: a barrier), then
 * releases them together with one 'allocate' each; what each allocated, in the order of `children`.
 */
export async function allocateIn(children: Child[]): Promise<Allocated[]> {
  await Promise.all(children.map((c) => c.expect('ready')))
  for (const c of children) c.send('allocate')
  return (await Promise.all(children.map((c) => c.expect('allocated')))) as unknown as Allocated[]
}

/** Starts test/fixtures/pool-loop-child.cjs: `op` ('sweep' or 'list') on the pool at `root` in a loop. */
export function loopChild(root: string, op: 'sweep' | 'list'): Child {
  return new Child(path.join(fixtures, 'pool-loop-child.cjs'), [root, op])
}

/** Polls `check` until it returns true (bounded only by the test timeout; no timing is asserted). */
export async function eventually(check: () => boolean | Promise<boolean>): Promise<void> {
  while (!(await check())) await new Promise((r) => setTimeout(r, 10))
}

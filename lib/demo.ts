/**
 * `npm run demo`: what vmspace is for, on real input.
 *
 * Worker processes (child_process.fork of this file) share one pool and together make --vms workspaces, each
 * with a private clone of a real base image as `rootfs.ext4`. Every worker writes its workspace's id into its own
 * clones, reads it back before dispose, and reports latency, clone method and check results over IPC. The parent
 * then checks that the base is unchanged (sha256), that no two workspaces shared a path, and that disposing left
 * nothing in the pool, and prints a summary. Exit status: 0 when every check passed, 1 when any failed, 2 for
 * bad arguments, 128+signal when interrupted.
 *
 * Uses only vmspace's public API, Node built-ins and cli-progress.
 */
import { execFile, fork, type ChildProcess } from 'node:child_process'
import { createHash, randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as fsp from 'node:fs/promises'
import * as os from 'node:os'
import * as path from 'node:path'
import { performance } from 'node:perf_hooks'
import { setTimeout as sleep } from 'node:timers/promises'
import { parseArgs } from 'node:util'
import { Presets, SingleBar } from 'cli-progress'
import { openPool, removeTree, renameNoReplace, type PoolStats, type Workspace } from './index.js'

const IMAGE_SIZE = 256 * 1024 * 1024
/** At most this much file data goes into the image (the rest of it is file-system metadata and free space). */
const MAX_IMAGE_DATA = 160 * 1024 * 1024
/** The marker sits in the first 1024 bytes of the image: ext4 leaves them unused (boot sector), before the superblock. */
const MARKER_OFFSET = 512
const MARKER_LEN = 64
const MARKER_FILE = 'marker.txt'
const ROOTFS = 'rootfs.ext4'
const ROLE_ENV = 'VMSPACE_DEMO_ROLE'
const CRASH_ENV = 'VMSPACE_DEMO_CRASH_AFTER'
/** The run fails when no worker has reported anything for this long. */
const STALL_MS = 120_000

// ---------------------------------------------------------------------------------------------------------------
// Messages between the parent and its workers (JSON over the fork IPC channel)

interface WorkerConfig {
  index: number
  root: string
  base: string
  baseSize: number
  count: number
  live: number
  /** Test hook: SIGKILL this worker right after its n-th allocate (0: never). */
  crashAfter: number
}

type ToWorker = { t: 'start'; config: WorkerConfig } | { t: 'go' } | { t: 'stop' }

type FromWorker =
  | { t: 'ready' }
  | { t: 'allocated'; id: string; name: string; path: string; ms: number; method: string; bytes: number }
  | { t: 'checked'; id: string; marker: boolean; markerFile: boolean; contents: boolean; disposed: boolean; problems: string[] }
  | { t: 'failed'; stage: string; error: string }
  | { t: 'finished'; stats: PoolStats }
  | { t: 'fatal'; error: string }

function describe(e: unknown): string {
  if (e instanceof Error) return e.message
  return String(e)
}

function markerFor(id: string): Buffer {
  const b = Buffer.alloc(MARKER_LEN, 0)
  b.write(`vmspace-demo ${id}\n`, 'latin1')
  return b
}

// ---------------------------------------------------------------------------------------------------------------
// Worker

async function workerMain(): Promise<void> {
  const send = (m: FromWorker) =>
    new Promise<void>((resolve, reject) => process.send!(m, undefined, undefined, (e) => (e ? reject(e) : resolve())))
  const fatal = (e: unknown) => {
    const text = e instanceof Error ? (e.stack ?? e.message) : String(e)
    const die = () => process.exit(1)
    try {
      if (process.connected) process.send!({ t: 'fatal', error: text } satisfies FromWorker, undefined, undefined, die)
      else die()
    } catch {
      die()
    }
    setTimeout(die, 1000).unref()
  }
  process.on('uncaughtException', fatal)
  process.on('unhandledRejection', fatal)

  let stopping = false
  const stop = () => {
    stopping = true
  }
  // Ctrl-C reaches the whole process group: finish the workspaces in hand, dispose them, and leave.
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.on(sig, stop)
  // The parent is gone: nobody to report to; dispose what is live and leave.
  process.on('disconnect', stop)

  let goResolve!: () => void
  const go = new Promise<void>((r) => (goResolve = r))
  const config = await new Promise<WorkerConfig>((resolve) => {
    process.on('message', (m: ToWorker) => {
      if (m.t === 'start') resolve(m.config)
      else if (m.t === 'go') goResolve()
      else if (m.t === 'stop') {
        stop()
        goResolve()
      }
    })
  })

  const pool = await openPool(config.root, { create: false })
  await send({ t: 'ready' })
  await go

  let next = 0
  const report = async (m: FromWorker) => {
    if (process.connected) await send(m).catch(stop)
  }
  const lane = async () => {
    while (!stopping && next < config.count) {
      const seq = next++
      let ws: Workspace
      const t0 = performance.now()
      try {
        ws = await pool.allocate({
          template: { [ROOTFS]: config.base },
          meta: { demo: 'vmspace', worker: config.index, seq, pid: process.pid },
        })
      } catch (e) {
        await report({ t: 'failed', stage: 'allocate', error: describe(e) })
        continue
      }
      const ms = performance.now() - t0
      const c = ws.template[0]
      await report({ t: 'allocated', id: ws.id, name: ws.name, path: ws.path, ms, method: c?.method ?? 'none', bytes: c?.bytes ?? 0 })
      if (config.crashAfter > 0 && seq + 1 === config.crashAfter) process.kill(process.pid, 'SIGKILL')
      await report(await useAndDispose(ws, config))
    }
  }
  await Promise.all(Array.from({ length: Math.min(config.live, config.count) }, lane))
  await pool.close()
  await report({ t: 'finished', stats: pool.stats() })
  if (process.connected) process.disconnect()
}

/** What a VM would do with its workspace, reduced to the checks: write our marker, read it back, dispose. */
async function useAndDispose(ws: Workspace, config: WorkerConfig): Promise<FromWorker> {
  const problems: string[] = []
  let marker = false
  let markerFile = false
  let contents = false
  const image = path.join(ws.path, ROOTFS)
  const expected = markerFor(ws.id)
  try {
    const fh = await fsp.open(image, 'r+')
    try {
      await fh.write(expected, 0, MARKER_LEN, MARKER_OFFSET)
    } finally {
      await fh.close()
    }
    await fsp.writeFile(path.join(ws.path, MARKER_FILE), `${ws.id}\n`, { flag: 'wx' })
    // Yield, so that the other workspaces this worker holds get on with their own writes before ours is read back.
    await new Promise((r) => setImmediate(r))

    const got = Buffer.alloc(MARKER_LEN)
    const rh = await fsp.open(image, 'r')
    try {
      await rh.read(got, 0, MARKER_LEN, MARKER_OFFSET)
    } finally {
      await rh.close()
    }
    marker = got.equals(expected)
    if (!marker) problems.push(`marker at offset ${MARKER_OFFSET} of ${image} is ${JSON.stringify(got.toString('latin1').replace(/\0+$/, ''))}`)
    const text = await fsp.readFile(path.join(ws.path, MARKER_FILE), 'utf8')
    markerFile = text === `${ws.id}\n`
    if (!markerFile) problems.push(`${MARKER_FILE} holds ${JSON.stringify(text)}`)
    const entries = (await fsp.readdir(ws.path)).sort()
    const size = (await fsp.stat(image)).size
    contents = entries.join('/') === `${MARKER_FILE}/${ROOTFS}` && size === config.baseSize
    if (!contents) problems.push(`workspace holds [${entries.join(', ')}], ${ROOTFS} of ${size} bytes (base: ${config.baseSize})`)
  } catch (e) {
    problems.push(describe(e))
  }
  let disposed = false
  try {
    await ws.dispose()
    disposed = ws.status === 'disposed' && !fs.existsSync(ws.path)
    if (!disposed) problems.push(`after dispose: status ${ws.status}, path ${fs.existsSync(ws.path) ? 'still exists' : 'gone'}`)
  } catch (e) {
    problems.push(`dispose: ${describe(e)}`)
  }
  return { t: 'checked', id: ws.id, marker, markerFile, contents, disposed, problems }
}

// ---------------------------------------------------------------------------------------------------------------
// Arguments

const HELP = `Usage: npm run demo -- [options]      (node dist/demo.js [options])

Shows what vmspace is for: worker processes share one pool and together make many
workspaces at once, each with a private copy-on-write clone of a real base image as
${ROOTFS}; each workspace gets its own marker, which is read back before dispose.
The run then checks that the base is unchanged (sha256), that no two workspaces
shared a path, and that nothing is left in the pool, and prints a summary.

Options:
  --vms N          workspaces to make in all (default 200)
  --workers N      worker processes (default 2 x CPUs = ${2 * os.availableParallelism()})
  --live N         workspaces each worker holds live at once (default 4)
  --root DIR       pool directory (default: a new directory under ${os.tmpdir()},
                   removed at the end). Put it on XFS (mkfs.xfs -m reflink=1) or
                   btrfs to see reflink clones; a DIR you name is kept.
  --base FILE      base image to clone (default: an ext4 image of Node's own npm
                   package and headers, built once with mke2fs and cached in
                   ${os.tmpdir()}; the node executable where mke2fs is missing)
  -h, --help       show this help

Exit status: 0 all checks passed, 1 a check failed, 2 bad arguments,
128+signal when interrupted (130 for Ctrl-C).
Environment: ${CRASH_ENV}=N makes worker 0 kill itself (SIGKILL)
right after its N-th allocate, to show that a crashed worker fails the run.
`

interface Options {
  vms: number
  workers: number
  live: number
  root?: string
  base?: string
}

class UsageError extends Error {}

function positiveInt(name: string, value: string | undefined, fallback: number, max: number): number {
  if (value === undefined) return fallback
  if (!/^\s*\d+\s*$/.test(value)) throw new UsageError(`--${name} must be a positive integer, got ${JSON.stringify(value)}`)
  const n = Number(value)
  if (n < 1) throw new UsageError(`--${name} must be at least 1, got ${value.trim()}`)
  if (n > max) throw new UsageError(`--${name} must be at most ${max}, got ${value.trim()}`)
  return n
}

function parseOptions(argv: string[]): Options | 'help' {
  let parsed
  try {
    parsed = parseArgs({
      args: argv,
      options: {
        vms: { type: 'string' },
        workers: { type: 'string' },
        live: { type: 'string' },
        root: { type: 'string' },
        base: { type: 'string' },
        help: { type: 'boolean', short: 'h' },
      },
      strict: true,
      allowPositionals: false,
    })
  } catch (e) {
    throw new UsageError(describe(e))
  }
  const v = parsed.values
  if (v.help) return 'help'
  const opts: Options = {
    vms: positiveInt('vms', v.vms, 200, 100_000),
    workers: positiveInt('workers', v.workers, 2 * os.availableParallelism(), 256),
    live: positiveInt('live', v.live, 4, 256),
  }
  if (v.root !== undefined) {
    if (v.root.trim() === '') throw new UsageError('--root must name a directory')
    opts.root = path.resolve(v.root)
    const st = statOrUndefined(opts.root)
    if (st && !st.isDirectory()) throw new UsageError(`--root ${opts.root} exists and is not a directory`)
    if (!st && !statOrUndefined(path.dirname(opts.root))?.isDirectory())
      throw new UsageError(`--root ${opts.root}: its parent directory does not exist`)
  }
  if (v.base !== undefined) {
    if (v.base.trim() === '') throw new UsageError('--base must name a file')
    opts.base = path.resolve(v.base)
    const st = statOrUndefined(opts.base)
    if (!st) throw new UsageError(`--base ${opts.base} does not exist`)
    if (!st.isFile()) throw new UsageError(`--base ${opts.base} is not a regular file`)
    if (st.size < MARKER_OFFSET + MARKER_LEN)
      throw new UsageError(`--base ${opts.base} is too small (${st.size} bytes; at least ${MARKER_OFFSET + MARKER_LEN})`)
    try {
      fs.accessSync(opts.base, fs.constants.R_OK)
    } catch {
      throw new UsageError(`--base ${opts.base} is not readable`)
    }
  }
  if (opts.workers > opts.vms) opts.workers = opts.vms
  return opts
}

function statOrUndefined(p: string): fs.Stats | undefined {
  try {
    return fs.statSync(p)
  } catch {
    return undefined
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Small helpers

function humanBytes(n: number): string {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB']
  let i = 0
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024
    i++
  }
  return i === 0 ? `${n} B` : `${n.toFixed(n < 10 ? 2 : 1).replace(/\.0+$/, '')} ${units[i]}`
}

function percentile(sorted: number[], p: number): number {
  if (sorted.length === 0) return NaN
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))]
}

function ms(n: number): string {
  if (!Number.isFinite(n)) return '-'
  return n < 1 ? n.toFixed(3) : n < 100 ? n.toFixed(2) : n.toFixed(0)
}

async function sha256(file: string): Promise<string> {
  const hash = createHash('sha256')
  for await (const chunk of fs.createReadStream(file, { highWaterMark: 1 << 20 })) hash.update(chunk as Buffer)
  return hash.digest('hex')
}

const FS_TYPES: Record<number, string> = {
  0xef53: 'ext4',
  0x58465342: 'xfs',
  0x9123683e: 'btrfs',
  0xca451a4e: 'bcachefs',
  0x7461636f: 'ocfs2',
  0x01021994: 'tmpfs',
  0x794c7630: 'overlayfs',
  0x2fc12fc1: 'zfs',
  0x6969: 'nfs',
  0xf15f: 'ecryptfs',
}

async function fsType(p: string): Promise<string> {
  try {
    const s = await fsp.statfs(p)
    return FS_TYPES[s.type] ?? `fs type 0x${s.type.toString(16)}`
  } catch {
    return 'unknown fs'
  }
}

function status(line: string): void {
  process.stderr.write(`demo: ${line}\n`)
}

async function fsyncPath(p: string, flags = 'r'): Promise<void> {
  const fh = await fsp.open(p, flags)
  try {
    await fh.sync()
  } finally {
    await fh.close()
  }
}

function which(names: string[], extraDirs: string[]): string | undefined {
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

function run(cmd: string, args: string[]): Promise<void> {
  return new Promise((resolve, reject) =>
    execFile(cmd, args, { maxBuffer: 16 << 20 }, (err, _stdout, stderr) => {
      if (err) reject(new Error(`${path.basename(cmd)} failed (${err.code ?? err.signal}): ${String(stderr).trim() || err.message}`))
      else resolve()
    }),
  )
}

/** Things to remove when the run ends, however it ends. */
class Cleanup {
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

async function removeIfThere(p: string): Promise<void> {
  try {
    await removeTree(p)
  } catch (e) {
    if ((e as { code?: string }).code !== 'ENOENT') throw e
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The base image

/** Bytes of the regular files below `dir` (not following symlinks). */
async function treeBytes(dir: string): Promise<number> {
  let total = 0
  for (const e of await fsp.readdir(dir, { recursive: true, withFileTypes: true })) {
    if (!e.isFile()) continue
    try {
      total += (await fsp.lstat(path.join(e.path, e.name))).size
    } catch {
      // gone meanwhile
    }
  }
  return total
}

interface Base {
  path: string
  size: number
  /** Bytes of data actually stored (the rest are holes). */
  allocated: number
  what: string
}

async function baseInfo(file: string, what: string): Promise<Base> {
  const st = await fsp.stat(file)
  return { path: file, size: st.size, allocated: Math.min(st.size, st.blocks * 512), what }
}

/** --base, else the cached ext4 image (built now if missing), else the node executable. */
async function prepareBase(opts: Options, cleanup: Cleanup): Promise<Base> {
  if (opts.base) return baseInfo(opts.base, 'given with --base')
  const nodeExe = fs.realpathSync(process.execPath)
  const what = "ext4 image of Node's npm package and headers"
  const cached = path.join(os.tmpdir(), `vmspace-demo-base-node-${process.version}-${process.arch}.ext4`)
  const st = statOrUndefined(cached)
  if (st?.isFile() && st.size === IMAGE_SIZE) return baseInfo(cached, `${what} (cached)`)
  const mke2fs = which(['mke2fs', 'mkfs.ext4'], ['/usr/sbin', '/sbin', '/usr/local/sbin'])
  if (!mke2fs) {
    status('mke2fs not found (PATH, /usr/sbin, /sbin): using the node executable as the base')
    return baseInfo(nodeExe, 'the node executable (mke2fs not found)')
  }
  const prefix = path.resolve(path.dirname(nodeExe), '..')
  const trees = [
    { src: path.join(prefix, 'lib', 'node_modules'), dest: path.join('lib', 'node_modules') },
    { src: path.join(prefix, 'include', 'node'), dest: path.join('include', 'node') },
  ].filter((t) => statOrUndefined(t.src)?.isDirectory())
  // Tens of MB of real files; a tree that would overfill the image (a node with many global packages) is left out.
  let budget = MAX_IMAGE_DATA
  for (let i = 0; i < trees.length; i++) {
    const size = await treeBytes(trees[i].src)
    if (size > budget) {
      status(`leaving ${trees[i].src} out of the base image: ${humanBytes(size)} of files is more than fits`)
      trees.splice(i--, 1)
    } else budget -= size
  }
  if (trees.length === 0) {
    status(`no ${path.join(prefix, 'lib', 'node_modules')} or ${path.join(prefix, 'include', 'node')}: using the node executable as the base`)
    return baseInfo(nodeExe, 'the node executable (no npm package or headers to build an image from)')
  }

  const t0 = performance.now()
  status(`building the base image once: ${trees.map((t) => t.src).join(' + ')} -> ${cached}`)
  const stage = await fsp.mkdtemp(path.join(os.tmpdir(), 'vmspace-demo-src-'))
  const dropStage = cleanup.add(() => removeIfThere(stage))
  const tmp = `${cached}.tmp-${process.pid}-${randomBytes(4).toString('hex')}`
  const dropTmp = cleanup.add(() => fsp.rm(tmp, { force: true }))
  try {
    for (const t of trees) {
      await fsp.mkdir(path.dirname(path.join(stage, t.dest)), { recursive: true })
      await fsp.cp(t.src, path.join(stage, t.dest), { recursive: true, verbatimSymlinks: true, preserveTimestamps: true })
    }
    await run(mke2fs, ['-q', '-F', '-t', 'ext4', '-L', 'vmspace-base', '-d', stage, tmp, `${IMAGE_SIZE / 1024}k`])
    // Bases are fsynced once, when they are made, so that no clone pays for their writeback.
    await fsyncPath(tmp, 'r+')
    try {
      await renameNoReplace(tmp, cached)
    } catch (e) {
      if ((e as { code?: string }).code !== 'EEXIST') throw e
      status(`another run built ${cached} meanwhile: using that one`)
    }
    await fsyncPath(os.tmpdir())
  } catch (e) {
    status(`could not build the image (${describe(e)}): using the node executable as the base`)
    return baseInfo(nodeExe, 'the node executable (building an ext4 image failed)')
  } finally {
    await fsp.rm(tmp, { force: true })
    dropTmp()
    await removeIfThere(stage)
    dropStage()
  }
  status(`base image built in ${((performance.now() - t0) / 1000).toFixed(1)} s`)
  return baseInfo(cached, `${what} (built now)`)
}

// ---------------------------------------------------------------------------------------------------------------
// The pool's entries, to show that dispose left nothing behind

async function poolEntries(root: string): Promise<string[]> {
  const out: string[] = []
  const read = async (rel: string, skip?: string) => {
    try {
      for (const name of await fsp.readdir(path.join(root, rel))) if (name !== skip) out.push(path.join(rel, name))
    } catch (e) {
      if ((e as { code?: string }).code !== 'ENOENT') throw e
    }
  }
  await read('.', '.vmspace')
  for (const sub of ['staging', 'trash', 'meta']) await read(path.join('.vmspace', sub))
  return out
}

// ---------------------------------------------------------------------------------------------------------------
// Progress

class Progress {
  #bar: SingleBar | undefined
  #total: number
  #lastPlain = -1
  #lastDraw = 0
  #start = performance.now()
  /** `details` is called only when a line is drawn: at most 10 times a second, or once a tenth without a TTY. */
  constructor(
    total: number,
    readonly details: () => { p50: number; methods: string },
  ) {
    this.#total = total
    if (process.stderr.isTTY) {
      this.#bar = new SingleBar(
        {
          format: 'demo {bar} {value}/{total} | {rate}/s | allocate p50 {p50} ms | {methods} | {duration_formatted}',
          barsize: 24,
          hideCursor: true,
          stream: process.stderr,
          fps: 10,
        },
        Presets.shades_classic,
      )
      this.#bar.start(total, 0, { rate: '0.0', p50: '-', methods: '' })
    }
  }
  update(done: number) {
    const now = performance.now()
    const rate = () => (now > this.#start ? ((done * 1000) / (now - this.#start)).toFixed(1) : '0.0')
    if (this.#bar) {
      if (now - this.#lastDraw < 100 && done < this.#total) {
        this.#bar.update(done)
        return
      }
      this.#lastDraw = now
      const d = this.details()
      this.#bar.update(done, { rate: rate(), p50: ms(d.p50), methods: d.methods })
      return
    }
    // Plain lines when stderr is not a terminal: one per tenth, and the last.
    const step = Math.max(1, Math.ceil(this.#total / 10))
    const bucket = done >= this.#total ? Infinity : Math.floor(done / step)
    if (bucket > this.#lastPlain && (done > 0 || this.#total === 0)) {
      this.#lastPlain = bucket
      const d = this.details()
      status(`${done}/${this.#total} workspaces, ${rate()}/s, allocate p50 ${ms(d.p50)} ms, ${d.methods}`)
    }
  }
  stop() {
    this.#bar?.stop()
    this.#bar = undefined
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Parent

interface WorkerState {
  index: number
  child: ChildProcess
  count: number
  ready: boolean
  finished: boolean
  exited: boolean
  exitText?: string
  stats?: PoolStats
  fatal?: string
  stderr: string
  live: Set<string>
}

interface Made {
  id: string
  name: string
  path: string
  ms: number
  method: string
  bytes: number
  worker: number
  checked?: Extract<FromWorker, { t: 'checked' }>
}


async function main(): Promise<number> {
  let opts: Options | 'help'
  try {
    opts = parseOptions(process.argv.slice(2))
  } catch (e) {
    if (!(e instanceof UsageError)) throw e
    process.stderr.write(`vmspace demo: ${e.message}\nRun with --help for usage.\n`)
    return 2
  }
  if (opts === 'help') {
    process.stdout.write(HELP)
    return 0
  }
  const o = opts
  const cleanup = new Cleanup()
  const failures: string[] = []
  const notes: string[] = []

  // Interrupts: before the workers run, clean up and leave; while they run, stop them gracefully (they dispose
  // what they hold) and report; a second interrupt kills them.
  let phase: 'setup' | 'run' | 'report' = 'setup'
  let interrupted = false
  let interruptCode = 130
  let workers: WorkerState[] = []
  let progress: Progress | undefined
  const onSignal = (sig: NodeJS.Signals) => {
    const code = 128 + (os.constants.signals[sig] ?? 2)
    if (phase === 'run' && !interrupted) {
      interrupted = true
      interruptCode = code
      progress?.stop()
      status(`${sig}: stopping the workers (they dispose what they hold); again to kill them`)
      for (const w of workers) if (!w.exited && w.child.connected) w.child.send({ t: 'stop' } satisfies ToWorker, () => {})
      return
    }
    if (phase === 'report' && !interrupted) {
      interrupted = true
      interruptCode = code
      return
    }
    progress?.stop()
    for (const w of workers) if (!w.exited) w.child.kill('SIGKILL')
    status(`${sig}: cleaning up`)
    void cleanup.run().finally(() => process.exit(code))
  }
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.on(sig, onSignal)

  try {
    // ---- setup: base image, pool
    const base0 = await prepareBase(o, cleanup)
    let root: string
    let ownRoot = false
    if (o.root) root = o.root
    else {
      root = await fsp.mkdtemp(path.join(os.tmpdir(), 'vmspace-demo-'))
      ownRoot = true
    }
    if (ownRoot) cleanup.add(() => removeIfThere(root))
    // durable: the one workspace this process allocates holds a base, fsynced once when it is made.
    const pool = await openPool(root, { durable: true })
    cleanup.add(() => pool.close())
    const before = new Set(await poolEntries(root))
    const rootFs = await fsType(root)

    // Reflink shares extents within one file system only: a base on another file system than the pool is first
    // cloned into the pool (a workspace of its own, live for the whole run), and the workers clone that.
    let base = base0
    let baseWs: Workspace | undefined
    if (fs.statSync(base0.path).dev !== fs.statSync(root).dev) {
      const t0 = performance.now()
      status(`the base is on another file system than the pool: cloning it into the pool once (${rootFs})`)
      baseWs = await pool.allocate({ template: { 'base.img': base0.path }, meta: { demo: 'vmspace', role: 'base', source: base0.path } })
      const ws = baseWs
      cleanup.add(() => ws.dispose())
      // Data is counted on the original: XFS keeps speculative preallocation (unwritten extents) in st_blocks.
      base = { ...(await baseInfo(path.join(baseWs.path, 'base.img'), base0.what)), allocated: base0.allocated }
      notes.push(
        `the base (${base0.path}) is on another file system than the pool, so it was copied once into the pool's ` +
          `${rootFs} (workspace ${baseWs.name}, ${((performance.now() - t0) / 1000).toFixed(1)} s, fsynced) and the ` +
          `workspaces were cloned from that copy.`,
      )
    }
    status(`hashing the base (${humanBytes(base.size)})`)
    const hashBefore = await sha256(base.path)

    // ---- run
    const total = o.vms
    const nWorkers = o.workers
    const crashAfter = Number(process.env[CRASH_ENV] ?? 0) || 0
    const records: Made[] = []
    const byKey = new Map<string, Made>() // worker:id -> its record
    const latencies: number[] = []
    const failed: { worker: number; stage: string; error: string }[] = []
    const methodCount: Record<string, number> = { reflink: 0, copy: 0 }
    let bytes = 0
    let done = 0
    let lastHeard = performance.now()
    let wakeUp: () => void = () => {}
    const changed = () => wakeUp()
    const methodsText = () =>
      Object.entries(methodCount)
        .map(([k, v]) => `${k} ${v}`)
        .join(' / ')
    const sortedLatencies = () => [...latencies].sort((a, b) => a - b)

    status(`starting ${nWorkers} workers for ${total} workspaces (at most ${o.live} live per worker) in ${root} (${rootFs})`)
    workers = Array.from({ length: nWorkers }, (_, index) => {
      const count = Math.floor(total / nWorkers) + (index < total % nWorkers ? 1 : 0)
      const child = fork(__filename, [], {
        env: { ...process.env, [ROLE_ENV]: 'worker' },
        stdio: ['ignore', 'pipe', 'pipe', 'ipc'],
        serialization: 'json',
      })
      const w: WorkerState = { index, child, count, ready: false, finished: false, exited: false, stderr: '', live: new Set() }
      const keepTail = (chunk: Buffer) => {
        w.stderr = (w.stderr + chunk.toString()).slice(-4000)
      }
      child.stdout!.on('data', keepTail)
      child.stderr!.on('data', keepTail)
      child.on('error', (e) => {
        w.fatal ??= `could not run: ${describe(e)}`
      })
      child.on('message', (m: FromWorker) => {
        lastHeard = performance.now()
        switch (m.t) {
          case 'ready':
            w.ready = true
            break
          case 'allocated': {
            const r: Made = { id: m.id, name: m.name, path: m.path, ms: m.ms, method: m.method, bytes: m.bytes, worker: index }
            records.push(r)
            byKey.set(`${index}:${m.id}`, r)
            w.live.add(m.id)
            latencies.push(m.ms)
            methodCount[m.method] = (methodCount[m.method] ?? 0) + 1
            bytes += m.bytes
            break
          }
          case 'checked': {
            w.live.delete(m.id)
            const r = byKey.get(`${index}:${m.id}`)
            if (r) r.checked = m
            done++
            progress?.update(done)
            break
          }
          case 'failed':
            failed.push({ worker: index, stage: m.stage, error: m.error })
            done++
            progress?.update(done)
            break
          case 'finished':
            w.finished = true
            w.stats = m.stats
            break
          case 'fatal':
            w.fatal = m.error
            break
        }
        changed()
      })
      // 'close', not 'exit': it comes after the IPC channel has delivered everything the worker sent.
      child.on('close', (code, signal) => {
        w.exited = true
        if (signal) w.exitText = `killed by ${signal}`
        else if (code !== 0) w.exitText = `exited with code ${code}`
        changed()
      })
      child.send({ t: 'start', config: { index, root, base: base.path, baseSize: base.size, count, live: o.live, crashAfter: index === 0 ? crashAfter : 0 } } satisfies ToWorker, () => {})
      return w
    })
    phase = 'run'

    // Waits until `cond` holds; fails the run when a worker dies early or nothing is heard for STALL_MS.
    const broken = () => workers.find((w) => (w.exited && (!w.finished || w.exitText)) || w.fatal)
    const stopAll = () => {
      for (const w of workers) if (!w.exited && w.child.connected) w.child.send({ t: 'stop' } satisfies ToWorker, () => {})
    }
    let crashSeen = false
    const waitFor = async (cond: () => boolean) => {
      for (;;) {
        if (!crashSeen && broken()) {
          crashSeen = true
          stopAll() // the others dispose what they hold and stop
        }
        if (cond()) return
        if (performance.now() - lastHeard > STALL_MS) {
          failures.push(`no worker reported anything for ${STALL_MS / 1000} s: killed them`)
          crashSeen = true
          for (const w of workers) if (!w.exited) w.child.kill('SIGKILL')
          await waitForExit()
          return
        }
        await new Promise<void>((r) => {
          wakeUp = r
          setTimeout(r, 1000).unref()
        })
      }
    }
    const waitForExit = async () => {
      const deadline = Date.now() + 10_000
      while (workers.some((w) => !w.exited) && Date.now() < deadline) await sleep(50)
      for (const w of workers) if (!w.exited) w.child.kill('SIGKILL')
      while (workers.some((w) => !w.exited)) await sleep(50)
    }

    await waitFor(() => workers.every((w) => w.ready || w.exited))
    if (interrupted) stopAll()
    progress = new Progress(total, () => ({ p50: percentile(sortedLatencies(), 50), methods: methodsText() }))
    const t0 = performance.now()
    lastHeard = t0
    for (const w of workers) if (!w.exited && w.child.connected) w.child.send({ t: 'go' } satisfies ToWorker, () => {})
    await waitFor(() => workers.every((w) => w.exited))
    const wall = (performance.now() - t0) / 1000
    progress.update(done)
    progress.stop()
    phase = 'report'

    for (const w of workers) {
      if (w.exited && (!w.finished || w.exitText || w.fatal)) {
        let text = `worker ${w.index} (pid ${w.child.pid}) ${w.exitText ?? 'exited'} before finishing`
        if (w.finished && w.exitText) text = `worker ${w.index} (pid ${w.child.pid}) ${w.exitText}`
        if (!w.finished)
          text +=
            `, holding ${w.live.size} workspace(s) it had reported and any it was still allocating: they stay in the ` +
            `pool with their leases free, for a sweep to reclaim`
        if (w.fatal) text += `:\n    ${w.fatal.split('\n').join('\n    ')}`
        else if (w.stderr.trim()) text += `; its last output:\n    ${w.stderr.trim().split('\n').slice(-10).join('\n    ')}`
        failures.push(text)
      }
    }
    if (interrupted) failures.push('interrupted')

    // ---- checks
    const all = records
    const checked = all.filter((r) => r.checked)
    const isolated = checked.filter((r) => r.checked!.marker && r.checked!.markerFile && r.checked!.contents)
    const disposed = checked.filter((r) => r.checked!.disposed)
    const distinctPaths = new Set(all.map((r) => r.path)).size
    const distinctIds = new Set(all.map((r) => r.id)).size
    if (failed.length) {
      const shown = [...new Set(failed.map((f) => `${f.stage}: ${f.error}`))].slice(0, 3)
      failures.push(`${failed.length} allocate(s) failed, e.g.:\n    ${shown.join('\n    ')}`)
    }
    if (all.length < total)
      failures.push(`only ${all.length} of ${total} workspaces were made${crashSeen || interrupted ? ' (the workers were stopped early)' : ''}`)
    if (isolated.length < all.length) {
      const bad = checked.filter((r) => !isolated.includes(r)).slice(0, 3)
      failures.push(
        `${all.length - isolated.length} workspace(s) failed the isolation checks or were never checked` +
          (bad.length ? `, e.g.:\n    ${bad.map((r) => `${r.name}: ${r.checked!.problems.join('; ')}`).join('\n    ')}` : ''),
      )
    }
    if (disposed.length < all.length) failures.push(`${all.length - disposed.length} workspace(s) were not disposed cleanly`)
    if (distinctPaths < all.length || distinctIds < all.length)
      failures.push(`workspaces shared paths or ids: ${distinctPaths} distinct paths, ${distinctIds} distinct ids for ${all.length} workspaces`)

    status('hashing the base again')
    const hashAfter = await sha256(base.path)
    if (hashAfter !== hashBefore) failures.push(`the base changed: sha256 ${hashBefore} before, ${hashAfter} after`)

    const leftovers = (await pool.list()).filter((ws) => ws.name !== baseWs?.name)
    if (baseWs) await baseWs.dispose()
    const left = (await poolEntries(root)).filter((e) => !before.has(e))
    if (left.length) {
      let text =
        `${left.length} entr${left.length === 1 ? 'y' : 'ies'} left in the pool after dispose: ` +
        `${left.slice(0, 5).join(', ')}${left.length > 5 ? ', ...' : ''}` +
        (leftovers.length ? ` (${leftovers.filter((l) => !l.live).length} workspace(s) without a live lease)` : '')
      // What a dead process left has its leases free: a sweep reclaims it (and never touches a live one). In a
      // pool of our own nobody else can be building, so staging entries need no grace period.
      try {
        const r = await pool.sweep(ownRoot ? { graceMs: 0 } : {})
        const after = (await poolEntries(root)).filter((e) => !before.has(e)).length
        const from = (k: string) => r.reclaimed.filter((e) => e.from === k).length
        text +=
          `; pool.sweep() then reclaimed ${r.reclaimed.length} (published ${from('published')}, staging ` +
          `${from('staging')}, trash ${from('trash')}; ${r.metadataRemoved} metadata file(s)), ${after} entries left`
      } catch (e) {
        text += `; pool.sweep() failed: ${describe(e)}`
      }
      failures.push(text)
    }
    await pool.close()
    if (before.size) notes.push(`${before.size} entr${before.size === 1 ? 'y' : 'ies'} that were in ${root} before the run are not counted.`)

    // ---- notes
    const reflinks = methodCount.reflink ?? 0
    const copies = methodCount.copy ?? 0
    if (copies > 0 && reflinks === 0)
      notes.push(
        `${root} is on ${rootFs}, which cannot share extents (reflink): every clone fell back to a copy of the ` +
          `base's data (holes kept). On XFS (mkfs.xfs -m reflink=1) or btrfs each clone is a reflink: try --root there.`,
      )
    else if (copies > 0) notes.push(`${copies} clone(s) fell back to a copy although ${reflinks} were reflinks.`)

    // ---- summary
    const lat = sortedLatencies()
    const rows: [string, string][] = [
      ['workspaces', `${all.length} of ${total} (${nWorkers} workers, at most ${o.live} live each)`],
      ['workspaces/s', wall > 0 ? (all.length / wall).toFixed(1) : '-'],
      ['allocate p50 (ms)', ms(percentile(lat, 50))],
      ['allocate p99 (ms)', ms(percentile(lat, 99))],
      ['clone methods', methodsText()],
      ['bytes cloned', `${humanBytes(bytes)} (${humanBytes(base.size)} each, ${humanBytes(base.allocated)} of it data)`],
      ['isolation checks passed', `${isolated.length}/${all.length} (own marker only, at offset ${MARKER_OFFSET} and in ${MARKER_FILE})`],
      ['distinct paths / ids', `${distinctPaths}/${all.length} / ${distinctIds}/${all.length}`],
      ['base sha256 unchanged', `${hashAfter === hashBefore ? 'yes' : 'NO'} (${hashAfter.slice(0, 16)}...)`],
      ['disposed', `${disposed.length}/${all.length}`],
      ['entries left in pool', `${left.length}`],
      ['result', failures.length ? `FAILED (${failures.length} problem${failures.length === 1 ? '' : 's'})` : 'all checks passed'],
    ]
    const out: string[] = []
    out.push('')
    out.push(`vmspace demo: ${all.length < total ? `${all.length} of ${total}` : total} workspaces in ${wall.toFixed(1)} s`)
    out.push(`  pool  ${root} (${rootFs}${ownRoot ? ', removed at the end' : ''})`)
    out.push(`  base  ${base0.path}: ${base.what}, ${humanBytes(base.size)}, ${humanBytes(base.allocated)} data`)
    const w1 = Math.max(...rows.map((r) => r[0].length))
    const w2 = Math.max(...rows.map((r) => r[1].length))
    const line = `+-${'-'.repeat(w1)}-+-${'-'.repeat(w2)}-+`
    out.push(line)
    for (const [k, v] of rows) out.push(`| ${k.padEnd(w1)} | ${v.padEnd(w2)} |`)
    out.push(line)
    for (const n of notes) out.push(`note: ${n}`)
    for (const f of failures) out.push(`FAILED: ${f}`)
    process.stdout.write(out.join('\n') + '\n')

    // ---- cleanup
    const errors = await cleanup.run()
    for (const e of errors) process.stderr.write(`vmspace demo: cleanup: ${e}\n`)
    if (ownRoot && fs.existsSync(root)) {
      process.stderr.write(`vmspace demo: could not remove ${root}\n`)
      return 1
    }
    if (interrupted) return interruptCode
    return failures.length || errors.length ? 1 : 0
  } catch (e) {
    progress?.stop()
    for (const w of workers) if (!w.exited) w.child.kill('SIGKILL')
    const errors = await cleanup.run()
    if (interrupted) return interruptCode
    process.stderr.write(`vmspace demo: ${e instanceof Error ? (e.stack ?? e.message) : String(e)}\n`)
    for (const c of errors) process.stderr.write(`vmspace demo: cleanup: ${c}\n`)
    return 1
  }
}

if (process.env[ROLE_ENV] === 'worker' && process.send) {
  void workerMain()
} else {
  // A closed pipe (npm run demo | head) must not stop the run before it has cleaned up.
  for (const stream of [process.stdout, process.stderr]) stream.on('error', () => {})
  main().then(
    (code) => {
      process.exitCode = code
    },
    (e) => {
      process.stderr.write(`vmspace demo: ${e instanceof Error ? (e.stack ?? e.message) : String(e)}\n`)
      process.exitCode = 1
    },
  )
}

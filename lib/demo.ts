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
 * --template-dir DIR starts every workspace from a directory tree instead (`allocate({ template: DIR })`): each
 * worker writes its id into its clone of one template file and into a marker file, checks that its tree is the
 * template's, and the parent checks that the template (listing, modes, sizes, times, contents) is unchanged.
 *
 * --chaos SIGKILLs some workers mid-run (each after some allocations); replacement workers make the rest of their
 * share. The parent knows what the dead left from their reports (allocations not reported disposed), the pids in
 * the metadata of what they published but could not report, and the staging entries of builds they were in; one
 * `pool.sweep({ graceMs: 0 })` must reclaim exactly that set.
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
import { setImmediate as immediate, setTimeout as sleep } from 'node:timers/promises'
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
/** With --template-dir: the marker file each workspace gets (the template must not have one). */
const TREE_MARKER = 'vmspace-demo-marker.txt'
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
  /** The base image cloned as ROOTFS ('' with a template tree). */
  base: string
  baseSize: number
  /** With --template-dir: the tree every workspace starts from, instead of the base image. */
  tree?: TreeSpec
  count: number
  live: number
  /** Test hook: SIGKILL this worker right after its n-th allocate (0: never). */
  crashAfter: number
}

/** A template tree as the workers check their clones of it. */
interface TreeSpec {
  /** The directory cloned (the template itself, or its copy in the pool's file system). */
  dir: string
  /** treeManifest(dir, { contents: false }).digest: paths, types, modes, sizes, symlink targets. */
  shape: string
  entries: number
  files: number
  bytes: number
  /** Relative path of a template file (the largest writable one) each worker writes its marker into. */
  probe?: string
}

type ToWorker = { t: 'start'; config: WorkerConfig } | { t: 'go' } | { t: 'stop' }

type FromWorker =
  | { t: 'ready' }
  | { t: 'allocated'; id: string; name: string; path: string; ms: number; method: string; bytes: number; files: number }
  | { t: 'disposing'; id: string }
  | { t: 'checked'; id: string; marker: boolean; markerFile: boolean; contents: boolean; disposed: boolean; problems: string[] }
  | { t: 'failed'; stage: string; error: string }
  | { t: 'finished'; stats: PoolStats }
  | { t: 'fatal'; error: string }

function describe(e: unknown): string {
  if (e instanceof Error) return e.message
  return String(e)
}

/** describe() with the stack, for errors nobody expected. */
function describeWithStack(e: unknown): string {
  return e instanceof Error ? (e.stack ?? e.message) : String(e)
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
    const text = describeWithStack(e)
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
          template: config.tree ? config.tree.dir : { [ROOTFS]: config.base },
          meta: { demo: 'vmspace', worker: config.index, seq, pid: process.pid },
        })
      } catch (e) {
        await report({ t: 'failed', stage: 'allocate', error: describe(e) })
        continue
      }
      const ms = performance.now() - t0
      const c = ws.template[0]
      await report({
        t: 'allocated',
        id: ws.id,
        name: ws.name,
        path: ws.path,
        ms,
        method: c?.method ?? 'none',
        bytes: c?.bytes ?? 0,
        files: c?.files ?? 0,
      })
      if (config.crashAfter > 0 && seq + 1 === config.crashAfter) process.kill(process.pid, 'SIGKILL')
      const checks = config.tree ? await useTree(ws, config.tree) : await useImage(ws, config)
      // Reported (and handed to the kernel) before dispose starts, so that the parent can tell what a worker killed
      // meanwhile may have half-disposed.
      await report({ t: 'disposing', id: ws.id })
      await report(await dispose(ws, checks))
    }
  }
  await Promise.all(Array.from({ length: Math.min(config.live, config.count) }, lane))
  await pool.close()
  await report({ t: 'finished', stats: pool.stats() })
  if (process.connected) process.disconnect()
}

interface Checks {
  marker: boolean
  markerFile: boolean
  contents: boolean
  problems: string[]
}

/**
 * What a VM would do with its workspace, reduced to the checks: our marker into `target` (at its offset) and our id
 * into the marker file `markerName`, both read back; then `checkContents`, which returns a problem or undefined.
 */
async function useWorkspace(
  ws: Workspace,
  target: { file: string; offset: number; where: string } | undefined,
  markerName: string,
  checkContents: () => Promise<string | undefined>,
): Promise<Checks> {
  const checks: Checks = { marker: target === undefined, markerFile: false, contents: false, problems: [] }
  const expected = markerFor(ws.id)
  try {
    if (target) await writeAt(target.file, expected, target.offset)
    await fsp.writeFile(path.join(ws.path, markerName), `${ws.id}\n`, { flag: 'wx' })
    // Yield, so that the other workspaces this worker holds get on with their own writes before ours is read back.
    await immediate()

    if (target) {
      const got = await readAt(target.file, MARKER_LEN, target.offset)
      checks.marker = got.equals(expected)
      if (!checks.marker) checks.problems.push(`marker ${target.where} is ${JSON.stringify(got.toString('latin1').replace(/\0+$/, ''))}`)
    }
    const text = await fsp.readFile(path.join(ws.path, markerName), 'utf8')
    checks.markerFile = text === `${ws.id}\n`
    if (!checks.markerFile) checks.problems.push(`${markerName} holds ${JSON.stringify(text)}`)
    const problem = await checkContents()
    checks.contents = problem === undefined
    if (problem !== undefined) checks.problems.push(problem)
  } catch (e) {
    checks.problems.push(describe(e))
  }
  return checks
}

/** A workspace made from the base image: our marker at MARKER_OFFSET of its ROOTFS; it holds that and MARKER_FILE. */
async function useImage(ws: Workspace, config: WorkerConfig): Promise<Checks> {
  const image = path.join(ws.path, ROOTFS)
  const target = { file: image, offset: MARKER_OFFSET, where: `at offset ${MARKER_OFFSET} of ${image}` }
  return useWorkspace(ws, target, MARKER_FILE, async () => {
    const entries = (await fsp.readdir(ws.path)).sort()
    const size = (await fsp.stat(image)).size
    if (entries.join('/') === `${MARKER_FILE}/${ROOTFS}` && size === config.baseSize) return undefined
    return `workspace holds [${entries.join(', ')}], ${ROOTFS} of ${size} bytes (base: ${config.baseSize})`
  })
}

/**
 * A workspace made from a template tree: our id into our clone of the probe file (copy-on-write must keep the
 * template's file as it was) and into TREE_MARKER; the tree must be the template's.
 */
async function useTree(ws: Workspace, tree: TreeSpec): Promise<Checks> {
  const probe = tree.probe === undefined ? undefined : path.join(ws.path, tree.probe)
  const target = probe === undefined ? undefined : { file: probe, offset: 0, where: `at the start of ${probe}` }
  return useWorkspace(ws, target, TREE_MARKER, async () => {
    const m = await treeManifest(ws.path, { contents: false, skip: TREE_MARKER })
    if (m.digest === tree.shape) return undefined
    return (
      `the workspace holds ${m.entries} entries (${m.files} files, ${m.bytes} bytes) that differ from the template's ` +
      `${tree.entries} (${tree.files} files, ${tree.bytes} bytes)`
    )
  })
}

async function dispose(ws: Workspace, checks: Checks): Promise<FromWorker> {
  const problems = [...checks.problems]
  let disposed = false
  try {
    await ws.dispose()
    disposed = ws.status === 'disposed' && !fs.existsSync(ws.path)
    if (!disposed) problems.push(`after dispose: status ${ws.status}, path ${fs.existsSync(ws.path) ? 'still exists' : 'gone'}`)
  } catch (e) {
    problems.push(`dispose: ${describe(e)}`)
  }
  const { marker, markerFile, contents } = checks
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
  --template-dir DIR
                   start every workspace from the directory tree DIR instead of
                   the base image (allocate({ template: DIR }): its contents
                   become the workspace's contents). Each workspace gets its own
                   marker file and its id written into its clone of one template
                   file; the tree must be the template's, and the template (its
                   listing, modes, sizes, times and file contents) must be
                   unchanged at the end. On another file system than the pool, DIR
                   is copied into the pool once and the workspaces clone the copy.
  --chaos [N|P%]   SIGKILL N workers, or P% of them (default 25%, at least 1),
                   each after it has allocated some of its workspaces. For each
                   one killed, a replacement worker makes the rest of its share,
                   so --vms workspaces still complete. Then one
                   pool.sweep({ graceMs: 0 }) must reclaim exactly what the killed
                   workers left: the workspaces they reported and did not report
                   disposed, those they published but could not report (known by
                   the pid in their metadata), and the staging entries of builds
                   they were in. Use it only on a pool nobody else is using.
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
  templateDir?: string
  /** --chaos: how many workers to kill, as a count or a percentage of --workers. */
  chaos?: { count: number } | { percent: number }
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

/** `--chaos` takes an optional value: `--chaos 3`, `--chaos 25%`, `--chaos=3`, or `--chaos` alone. */
function chaosArgs(argv: string[]): string[] {
  const out: string[] = []
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--') {
      out.push(...argv.slice(i))
      break
    }
    if (argv[i] !== '--chaos') out.push(argv[i])
    else if (i + 1 < argv.length && /^\s*\d+\s*%?\s*$/.test(argv[i + 1])) out.push(`--chaos=${argv[++i]}`)
    else out.push('--chaos=')
  }
  return out
}

function parseOptions(argv: string[]): Options | 'help' {
  let parsed
  try {
    parsed = parseArgs({
      args: chaosArgs(argv),
      options: {
        vms: { type: 'string' },
        workers: { type: 'string' },
        live: { type: 'string' },
        root: { type: 'string' },
        base: { type: 'string' },
        'template-dir': { type: 'string' },
        chaos: { type: 'string' },
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
  const templateDir = v['template-dir']
  if (templateDir !== undefined) {
    if (templateDir.trim() === '') throw new UsageError('--template-dir must name a directory')
    if (opts.base) throw new UsageError('--template-dir and --base exclude each other: a workspace starts from one of them')
    opts.templateDir = path.resolve(templateDir)
    const st = statOrUndefined(opts.templateDir)
    if (!st) throw new UsageError(`--template-dir ${opts.templateDir} does not exist`)
    if (!st.isDirectory()) throw new UsageError(`--template-dir ${opts.templateDir} is not a directory`)
    try {
      fs.accessSync(opts.templateDir, fs.constants.R_OK | fs.constants.X_OK)
    } catch {
      throw new UsageError(`--template-dir ${opts.templateDir} is not readable`)
    }
    if (statOrUndefined(path.join(opts.templateDir, TREE_MARKER)))
      throw new UsageError(`--template-dir ${opts.templateDir} holds ${TREE_MARKER}, the name of the demo's marker file`)
  }
  if (v.chaos !== undefined) {
    const c = v.chaos.trim()
    if (c === '') opts.chaos = { percent: 25 }
    else if (c.endsWith('%')) {
      const n = positiveInt('chaos', c.slice(0, -1), 25, 100)
      opts.chaos = { percent: n }
    } else opts.chaos = { count: positiveInt('chaos', c, 1, 256) }
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

/** "1 entry", "2 entries". */
function entriesText(n: number): string {
  return `${n} entr${n === 1 ? 'y' : 'ies'}`
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

interface Manifest {
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
async function treeManifest(dir: string, options: { contents: boolean; skip?: string }): Promise<Manifest> {
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

/** Writes `buf` into the existing `file` at `offset`. */
async function writeAt(file: string, buf: Buffer, offset: number): Promise<void> {
  const fh = await fsp.open(file, 'r+')
  try {
    await fh.write(buf, 0, buf.length, offset)
  } finally {
    await fh.close()
  }
}

/** `length` bytes of `file` from `offset` (zeros past its end). */
async function readAt(file: string, length: number, offset: number): Promise<Buffer> {
  const buf = Buffer.alloc(length)
  const fh = await fsp.open(file, 'r')
  try {
    await fh.read(buf, 0, length, offset)
  } finally {
    await fh.close()
  }
  return buf
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
  /** Allocations it reported. */
  allocated: number
  /** Workspaces it finished: checked (disposed) or failed to allocate. */
  completed: number
  /** --chaos: SIGKILL it when it reports this many allocations. */
  killAt?: number
  /** --chaos: killed on purpose (its exit is no failure; a replacement makes the rest of its share). */
  chaosKilled?: boolean
  /** The worker this one replaces (--chaos). */
  replaces?: number
}

interface Made {
  id: string
  name: string
  path: string
  ms: number
  method: string
  bytes: number
  files: number
  worker: number
  /** It reported that it started to dispose this one. */
  disposing?: boolean
  checked?: Extract<FromWorker, { t: 'checked' }>
}

/** Names of the published, trash and staging entries the pool holds beyond what was there before the run. */
async function leftBehind(root: string, before: Set<string>) {
  const entries = (await poolEntries(root)).filter((e) => !before.has(e))
  const names = (dir: string) => entries.filter((e) => path.dirname(e) === dir).map((e) => path.basename(e))
  return {
    published: names('.'),
    trash: names(path.join('.vmspace', 'trash')),
    staging: names(path.join('.vmspace', 'staging')),
  }
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
  const sendAll = (m: ToWorker) => {
    for (const w of workers) if (!w.exited && w.child.connected) w.child.send(m, () => {})
  }
  const killAll = () => {
    for (const w of workers) if (!w.exited) w.child.kill('SIGKILL')
  }
  let progress: Progress | undefined
  const onSignal = (sig: NodeJS.Signals) => {
    const code = 128 + (os.constants.signals[sig] ?? 2)
    if (phase === 'run' && !interrupted) {
      interrupted = true
      interruptCode = code
      progress?.stop()
      status(`${sig}: stopping the workers (they dispose what they hold); again to kill them`)
      sendAll({ t: 'stop' })
      return
    }
    if (phase === 'report' && !interrupted) {
      interrupted = true
      interruptCode = code
      return
    }
    progress?.stop()
    killAll()
    status(`${sig}: cleaning up`)
    void cleanup.run().finally(() => process.exit(code))
  }
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.on(sig, onSignal)

  try {
    // ---- setup: base image or template tree, pool
    const base0 = o.templateDir ? undefined : await prepareBase(o, cleanup)
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

    // Reflink shares extents within one file system only: a base (or template tree) on another file system than
    // the pool is first cloned into the pool (a workspace of its own, live for the whole run), and the workers
    // clone that. `details` adds to the note what was copied and how long it took.
    const copyIntoPool = async (
      role: 'base' | 'template',
      source: string,
      entry: string,
      details: (ws: Workspace, seconds: string) => string,
    ) => {
      const t0 = performance.now()
      status(`the ${role} is on another file system than the pool: cloning it into the pool once (${rootFs})`)
      const ws = await pool.allocate({ template: { [entry]: source }, meta: { demo: 'vmspace', role, source } })
      cleanup.add(() => ws.dispose())
      notes.push(
        `the ${role} (${source}) is on another file system than the pool, so it was copied once into the pool's ` +
          `${rootFs} (workspace ${ws.name}${details(ws, ((performance.now() - t0) / 1000).toFixed(1))}) and the ` +
          `workspaces were cloned from that copy.`,
      )
      return ws
    }
    let base = base0
    let baseWs: Workspace | undefined
    if (base0 && fs.statSync(base0.path).dev !== fs.statSync(root).dev) {
      baseWs = await copyIntoPool('base', base0.path, 'base.img', (_, seconds) => `, ${seconds} s, fsynced`)
      // Data is counted on the original: XFS keeps speculative preallocation (unwritten extents) in st_blocks.
      base = { ...(await baseInfo(path.join(baseWs.path, 'base.img'), base0.what)), allocated: base0.allocated }
    }
    let hashBefore = ''
    if (base) {
      status(`hashing the base (${humanBytes(base.size)})`)
      hashBefore = await sha256(base.path)
    }

    // The template tree: its full manifest (contents, times) before the run, and its shape for the workers.
    let tree: { spec: TreeSpec; original: string; before: Manifest; originalBefore?: Manifest } | undefined
    if (o.templateDir) {
      let dir = o.templateDir
      if (fs.statSync(dir).dev !== fs.statSync(root).dev) {
        baseWs = await copyIntoPool('template', dir, 'template', (ws, seconds) => {
          const c = ws.template[0]
          return `: ${c.files} files, ${humanBytes(c.bytes)}, ${seconds} s`
        })
        dir = path.join(baseWs.path, 'template')
      }
      status(`hashing the template tree ${dir} (listing, modes, sizes, times, contents)`)
      const full = await treeManifest(dir, { contents: true })
      const shape = await treeManifest(dir, { contents: false })
      tree = {
        original: o.templateDir,
        before: full,
        originalBefore: dir === o.templateDir ? undefined : await treeManifest(o.templateDir, { contents: true }),
        spec: { dir, shape: shape.digest, entries: shape.entries, files: shape.files, bytes: shape.bytes, probe: full.probe },
      }
    }

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

    // --chaos: the victims among the first workers, each killed once it has reported between a quarter and a half
    // of its share of allocations (at least one), with the rest of its workspaces in whatever state they are.
    const victims = new Set<number>()
    if (o.chaos) {
      const n = 'count' in o.chaos ? Math.min(o.chaos.count, nWorkers) : Math.max(1, Math.round((nWorkers * o.chaos.percent) / 100))
      const order = Array.from({ length: nWorkers }, (_, i) => i).sort(() => Math.random() - 0.5)
      for (const i of order.slice(0, Math.min(n, nWorkers))) victims.add(i)
    }
    let started = false

    const startWorker = (count: number, replaces?: number): WorkerState => {
      const index = workers.length
      const child = fork(__filename, [], {
        env: { ...process.env, [ROLE_ENV]: 'worker' },
        stdio: ['ignore', 'pipe', 'pipe', 'ipc'],
        serialization: 'json',
      })
      const w: WorkerState = {
        index,
        child,
        count,
        ready: false,
        finished: false,
        exited: false,
        stderr: '',
        live: new Set(),
        allocated: 0,
        completed: 0,
        replaces,
      }
      if (replaces === undefined && victims.has(index)) {
        const lo = Math.max(1, Math.ceil(count / 4))
        const hi = Math.max(lo, Math.ceil(count / 2))
        w.killAt = lo + Math.floor(Math.random() * (hi - lo + 1))
      }
      workers.push(w)
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
            // A replacement starts as soon as it is ready; the first workers wait for the common start.
            if (started && child.connected) child.send({ t: stopping || interrupted ? 'stop' : 'go' } satisfies ToWorker, () => {})
            break
          case 'allocated': {
            const r: Made = {
              id: m.id,
              name: m.name,
              path: m.path,
              ms: m.ms,
              method: m.method,
              bytes: m.bytes,
              files: m.files,
              worker: index,
            }
            records.push(r)
            byKey.set(`${index}:${m.id}`, r)
            w.live.add(m.id)
            w.allocated++
            latencies.push(m.ms)
            methodCount[m.method] = (methodCount[m.method] ?? 0) + 1
            bytes += m.bytes
            if (w.killAt !== undefined && w.allocated === w.killAt && !w.exited && !w.finished && !stopping && !interrupted) {
              w.chaosKilled = true
              child.kill('SIGKILL')
            }
            break
          }
          case 'disposing': {
            const r = byKey.get(`${index}:${m.id}`)
            if (r) r.disposing = true
            break
          }
          case 'checked': {
            w.live.delete(m.id)
            w.completed++
            const r = byKey.get(`${index}:${m.id}`)
            if (r) r.checked = m
            done++
            progress?.update(done)
            break
          }
          case 'failed':
            failed.push({ worker: index, stage: m.stage, error: m.error })
            w.completed++
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
        // A worker killed by --chaos: a fresh one makes the rest of its share (the workspaces it did not finish).
        if (w.chaosKilled && signal === 'SIGKILL' && !stopping && !interrupted && w.count - w.completed > 0)
          startWorker(w.count - w.completed, w.index)
        changed()
      })
      child.send(
        {
          t: 'start',
          config: {
            index,
            root,
            base: base?.path ?? '',
            baseSize: base?.size ?? 0,
            tree: tree?.spec,
            count,
            live: o.live,
            crashAfter: index === 0 ? crashAfter : 0,
          },
        } satisfies ToWorker,
        () => {},
      )
      return w
    }

    const chaosText = victims.size ? `, SIGKILL for ${victims.size} of them mid-run` : ''
    status(`starting ${nWorkers} workers for ${total} workspaces (at most ${o.live} live per worker${chaosText}) in ${root} (${rootFs})`)
    let stopping = false
    for (let i = 0; i < nWorkers; i++) startWorker(Math.floor(total / nWorkers) + (i < total % nWorkers ? 1 : 0))
    phase = 'run'

    // Waits until `cond` holds; fails the run when a worker dies early or nothing is heard for STALL_MS.
    const broken = () => workers.find((w) => (!w.chaosKilled && w.exited && (!w.finished || w.exitText)) || w.fatal)
    const stopAll = () => {
      stopping = true
      sendAll({ t: 'stop' })
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
          stopping = true
          killAll()
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
      killAll()
      while (workers.some((w) => !w.exited)) await sleep(50)
    }

    await waitFor(() => workers.every((w) => w.ready || w.exited))
    if (interrupted) stopAll()
    progress = new Progress(total, () => ({ p50: percentile(sortedLatencies(), 50), methods: methodsText() }))
    const t0 = performance.now()
    lastHeard = t0
    started = true
    sendAll({ t: 'go' })
    await waitFor(() => workers.every((w) => w.exited))
    const wall = (performance.now() - t0) / 1000
    progress.update(done)
    progress.stop()
    phase = 'report'

    const killed = workers.filter((w) => w.chaosKilled)
    for (const w of workers) {
      if (w.chaosKilled && !w.fatal) continue // reported in the chaos rows
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
    // What the killed workers never finished is theirs to leave behind: it is checked by the sweep, below.
    const killedIndexes = new Set(killed.map((w) => w.index))
    const orphaned = records.filter((r) => killedIndexes.has(r.worker) && !r.checked)
    const lived = records.filter((r) => !orphaned.includes(r))
    const checked = lived.filter((r) => r.checked)
    const isolated = checked.filter((r) => r.checked!.marker && r.checked!.markerFile && r.checked!.contents)
    const disposed = checked.filter((r) => r.checked!.disposed)
    const distinctPaths = new Set(records.map((r) => r.path)).size
    const distinctIds = new Set(records.map((r) => r.id)).size
    if (failed.length) {
      const shown = [...new Set(failed.map((f) => `${f.stage}: ${f.error}`))].slice(0, 3)
      failures.push(`${failed.length} allocate(s) failed, e.g.:\n    ${shown.join('\n    ')}`)
    }
    if (lived.length < total)
      failures.push(`only ${lived.length} of ${total} workspaces were made${crashSeen || interrupted ? ' (the workers were stopped early)' : ''}`)
    if (isolated.length < lived.length) {
      const bad = checked.filter((r) => !isolated.includes(r)).slice(0, 3)
      failures.push(
        `${lived.length - isolated.length} workspace(s) failed the isolation checks or were never checked` +
          (bad.length ? `, e.g.:\n    ${bad.map((r) => `${r.name}: ${r.checked!.problems.join('; ')}`).join('\n    ')}` : ''),
      )
    }
    if (disposed.length < lived.length) failures.push(`${lived.length - disposed.length} workspace(s) were not disposed cleanly`)
    if (distinctPaths < records.length || distinctIds < records.length)
      failures.push(`workspaces shared paths or ids: ${distinctPaths} distinct paths, ${distinctIds} distinct ids for ${records.length} workspaces`)

    let hashAfter = ''
    if (base) {
      status('hashing the base again')
      hashAfter = await sha256(base.path)
      if (hashAfter !== hashBefore) failures.push(`the base changed: sha256 ${hashBefore} before, ${hashAfter} after`)
    }
    let treeAfter: Manifest | undefined
    let originalSame = true
    if (tree) {
      status('hashing the template tree again')
      treeAfter = await treeManifest(tree.spec.dir, { contents: true })
      if (treeAfter.digest !== tree.before.digest)
        failures.push(
          `the template ${tree.spec.dir} changed: ${tree.before.entries} entries (${tree.before.digest.slice(0, 16)}...) before, ` +
            `${treeAfter.entries} (${treeAfter.digest.slice(0, 16)}...) after`,
        )
      if (tree.originalBefore) {
        const originalAfter = await treeManifest(tree.original, { contents: true })
        originalSame = originalAfter.digest === tree.originalBefore.digest
        if (!originalSame) failures.push(`the template ${tree.original} changed during the run`)
      }
    }

    // ---- chaos: what the killed workers left, and what one sweep reclaims
    const chaosRows: [string, string][] = []
    if (o.chaos) {
      const killedPids = new Set(killed.map((w) => w.child.pid))
      const orphanNames = new Map(orphaned.map((r) => [r.name, r]))
      const left = await leftBehind(root, before)
      const infos = new Map((await pool.list()).map((i) => [i.name, i]))
      // name -> why it is an orphan
      const expected = new Map<string, string>()
      const problems: string[] = []
      for (const name of left.published) {
        if (name === baseWs?.name) continue
        const info = infos.get(name)
        const r = orphanNames.get(name)
        if (info?.live) problems.push(`${name} is live after every worker exited`)
        if (r) expected.set(name, r.disposing ? 'mid-dispose' : 'reported')
        else if (info?.pid !== undefined && killedPids.has(info.pid)) expected.set(name, 'unreported')
        else problems.push(`${name} is in the pool but no killed worker made it (pid ${info?.pid ?? 'unknown'})`)
      }
      for (const name of left.trash) {
        if (orphanNames.get(name)?.disposing) expected.set(name, 'mid-dispose')
        else problems.push(`${name} is in trash but no killed worker was disposing it`)
      }
      // Every worker is dead: a staging entry is a build a killed worker was in (a live one rolls back on failure).
      for (const name of left.staging) expected.set(name, 'staging')
      // A workspace a killed worker reported and never started to dispose must still be there: its owner is dead.
      for (const r of orphaned) if (!r.disposing && !left.published.includes(r.name)) problems.push(`${r.name} was lost: reported held, not in the pool`)

      status(`sweeping what the ${killed.length} killed worker(s) left: pool.sweep({ graceMs: 0 })`)
      const report = await pool.sweep({ graceMs: 0 })
      const reclaimed = new Set(report.reclaimed.map((e) => e.name))
      const preexisting = [...reclaimed].filter((n) => [n, `.vmspace/trash/${n}`, `.vmspace/staging/${n}`].some((e) => before.has(e)))
      for (const n of preexisting) reclaimed.delete(n)
      const missing = [...expected.keys()].filter((n) => !reclaimed.has(n))
      const extra = [...reclaimed].filter((n) => !expected.has(n))
      const exact = missing.length === 0 && extra.length === 0
      if (!exact)
        failures.push(
          `the sweep did not reclaim exactly the orphans: ${missing.length} not reclaimed (${missing.slice(0, 3).join(', ')}), ` +
            `${extra.length} reclaimed that were no orphans (${extra.slice(0, 3).join(', ')})`,
        )
      for (const f of report.failed) failures.push(`sweep could not remove ${f.name} (${f.from}): ${f.code}`)
      if (report.live !== (baseWs ? 1 : 0) && ownRoot) problems.push(`sweep counted ${report.live} live workspace(s)`)
      for (const p of problems) failures.push(`chaos: ${p}`)
      if (preexisting.length) notes.push(`the sweep also reclaimed ${entriesText(preexisting.length)} from before the run.`)

      const kinds = (k: string) => [...expected.values()].filter((v) => v === k).length
      const from = (k: string) => report.reclaimed.filter((e) => e.from === k && reclaimed.has(e.name)).length
      const replacements = workers.filter((w) => w.replaces !== undefined)
      chaosRows.push(
        [
          'chaos',
          `SIGKILLed ${killed.length} of ${nWorkers} workers (after ${killed.map((w) => w.allocated).join(', ')} ` +
            `allocations); ${replacements.length} replacement(s) made their remaining ` +
            `${replacements.reduce((n, w) => n + w.count, 0)} workspaces`,
        ],
        [
          'orphans / reclaimed by sweep',
          `${expected.size} / ${reclaimed.size} (${exact ? 'exact match' : `MISMATCH: ${missing.length} missing, ${extra.length} extra`})`,
        ],
        [
          'orphans by kind',
          `${kinds('reported')} reported held, ${kinds('unreported')} published unreported, ${kinds('mid-dispose')} ` +
            `mid-dispose, ${kinds('staging')} half-built (staging)`,
        ],
        [
          'sweep reclaimed from',
          `published ${from('published')}, trash ${from('trash')}, staging ${from('staging')}; ` +
            `${report.metadataRemoved} metadata file(s); ${report.live} live left alone`,
        ],
      )
    }

    const leftovers = (await pool.list()).filter((ws) => ws.name !== baseWs?.name)
    if (baseWs) await baseWs.dispose()
    const left = (await poolEntries(root)).filter((e) => !before.has(e))
    if (left.length) {
      let text =
        `${entriesText(left.length)} left in the pool after dispose: ` +
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
    if (before.size) notes.push(`${entriesText(before.size)} that were in ${root} before the run are not counted.`)

    // ---- notes
    const reflinks = methodCount.reflink ?? 0
    const copies = methodCount.copy ?? 0
    const what = tree ? "the template's files" : "the base's data (holes kept)"
    if (copies > 0 && reflinks === 0)
      notes.push(
        `${root} is on ${rootFs}, which cannot share extents (reflink): every clone fell back to a copy of ` +
          `${what}. On XFS (mkfs.xfs -m reflink=1) or btrfs each clone is a reflink: try --root there.`,
      )
    else if (copies > 0) notes.push(`${copies} clone(s) fell back to a copy although ${reflinks} were reflinks.`)

    // ---- summary
    const lat = sortedLatencies()
    const spread = (values: number[], show: (n: number) => string) => {
      if (values.length === 0) return '-'
      const lo = Math.min(...values)
      const hi = Math.max(...values)
      return lo === hi ? show(lo) : `${show(lo)} to ${show(hi)}`
    }
    const fileClones = workers.reduce(
      (acc, w) => ({ reflink: acc.reflink + (w.stats?.clones.reflink ?? 0), copy: acc.copy + (w.stats?.clones.copy ?? 0) }),
      { reflink: 0, copy: 0 },
    )
    const made = `${lived.length} of ${total}${orphaned.length ? ` (+ ${orphaned.length} unfinished by killed workers)` : ''}`
    const rows: [string, string][] = [
      ['workspaces', `${made} (${workers.length} workers, at most ${o.live} live each)`],
      ['workspaces/s', wall > 0 ? (lived.length / wall).toFixed(1) : '-'],
      ['allocate p50 (ms)', ms(percentile(lat, 50))],
      ['allocate p99 (ms)', ms(percentile(lat, 99))],
      [tree ? 'clone methods (per workspace)' : 'clone methods', methodsText()],
    ]
    if (tree) {
      rows.push(
        ['files / bytes per workspace', `${spread(records.map((r) => r.files), String)} files / ${spread(records.map((r) => r.bytes), humanBytes)}`],
        [
          'file clones (reflink / copy)',
          `${fileClones.reflink} / ${fileClones.copy} (the workers' pool.stats()${killed.length ? `, the ${killed.length} killed not counted` : ''})`,
        ],
        ['bytes cloned', `${humanBytes(bytes)} in ${records.reduce((n, r) => n + r.files, 0)} files`],
        [
          'isolation checks passed',
          `${isolated.length}/${lived.length} (own ${TREE_MARKER} only${tree.spec.probe ? `, own marker in its clone of ${tree.spec.probe}` : ''}, tree = template)`,
        ],
      )
    } else {
      rows.push(
        ['bytes cloned', `${humanBytes(bytes)} (${humanBytes(base!.size)} each, ${humanBytes(base!.allocated)} of it data)`],
        ['isolation checks passed', `${isolated.length}/${lived.length} (own marker only, at offset ${MARKER_OFFSET} and in ${MARKER_FILE})`],
      )
    }
    rows.push(['distinct paths / ids', `${distinctPaths}/${records.length} / ${distinctIds}/${records.length}`])
    if (tree)
      rows.push([
        'template unchanged',
        `${treeAfter?.digest === tree.before.digest && originalSame ? 'yes' : 'NO'} (listing, modes, sizes, times, contents: ` +
          `${tree.before.digest.slice(0, 16)}...${tree.originalBefore ? `; the original ${tree.original} too` : ''})`,
      ])
    else rows.push(['base sha256 unchanged', `${hashAfter === hashBefore ? 'yes' : 'NO'} (${hashAfter.slice(0, 16)}...)`])
    rows.push(['disposed', `${disposed.length}/${lived.length}`], ...chaosRows, ['entries left in pool', `${left.length}`])
    rows.push(['result', failures.length ? `FAILED (${failures.length} problem${failures.length === 1 ? '' : 's'})` : 'all checks passed'])
    const out: string[] = []
    out.push('')
    out.push(`vmspace demo: ${lived.length < total ? `${lived.length} of ${total}` : total} workspaces in ${wall.toFixed(1)} s`)
    out.push(`  pool      ${root} (${rootFs}${ownRoot ? ', removed at the end' : ''})`)
    if (tree)
      out.push(
        `  template  ${tree.original}: ${tree.spec.entries} entries, ${tree.spec.files} files, ${humanBytes(tree.spec.bytes)}`,
      )
    else out.push(`  base      ${base0!.path}: ${base!.what}, ${humanBytes(base!.size)}, ${humanBytes(base!.allocated)} data`)
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
    killAll()
    const errors = await cleanup.run()
    if (interrupted) return interruptCode
    process.stderr.write(`vmspace demo: ${describeWithStack(e)}\n`)
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
      process.stderr.write(`vmspace demo: ${describeWithStack(e)}\n`)
      process.exitCode = 1
    },
  )
}

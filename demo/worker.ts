/**
 * The demo's worker process (forked by the run phase, see run.ts): allocates its share of workspaces from the
 * shared pool, uses each as a VM would (markers written and read back), disposes it, and reports over IPC.
 */
import * as fs from 'node:fs'
import * as fsp from 'node:fs/promises'
import * as os from 'node:os'
import * as path from 'node:path'
import { performance } from 'node:perf_hooks'
import { setImmediate as immediate } from 'node:timers/promises'
import { openPool, type Pool, type Workspace } from 'vmspace'
import {
  describe,
  describeWithStack,
  markerFor,
  MARKER_FILE,
  MARKER_LEN,
  MARKER_OFFSET,
  ROLE_ENV,
  ROOTFS,
  TREE_MARKER,
  type FromWorker,
  type ToWorker,
  type TreeSpec,
  type WorkerConfig,
} from './protocol.js'
import { readAt, treeManifest, writeAt } from './util.js'

/** An error nothing caught: reported to the parent as `fatal` (when it is still there), then exit 1. */
function fatal(e: unknown): void {
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

export async function workerMain(): Promise<void> {
  const send = (m: FromWorker) =>
    new Promise<void>((resolve, reject) => process.send!(m, undefined, undefined, (e) => (e ? reject(e) : resolve())))
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
    while (!stopping && next < config.count) await useOne(pool, config, next++, report)
  }
  await Promise.all(Array.from({ length: Math.min(config.live, config.count) }, lane))
  await pool.close()
  await report({ t: 'finished', stats: pool.stats() })
  if (process.connected) process.disconnect()
}

/** One workspace of the run: allocated, reported, used as a VM would (markers), then disposed and reported. */
async function useOne(pool: Pool, config: WorkerConfig, seq: number, report: (m: FromWorker) => Promise<void>): Promise<void> {
  let ws: Workspace
  const t0 = performance.now()
  try {
    ws = await pool.allocate({
      ...(config.tree?.from ? { from: config.tree.from } : { template: config.tree ? config.tree.dir : { [ROOTFS]: config.base } }),
      meta: { demo: 'vmspace', worker: config.index, seq, pid: process.pid },
      ...(config.quota ? { quota: { bytes: config.quota } } : {}),
    })
  } catch (e) {
    await report({ t: 'failed', stage: 'allocate', error: describe(e) })
    return
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
  if (config.runaway && seq === 0) await report({ t: 'runaway', id: ws.id, ...(await runaway(ws)) })
  const checks = config.tree ? await useTree(ws, config.tree) : await useImage(ws, config)
  // Reported (and handed to the kernel) before dispose starts, so that the parent can tell what a worker killed
  // meanwhile may have half-disposed.
  await report({ t: 'disposing', id: ws.id })
  await report(await dispose(ws, checks))
}

/**
 * --quota: a guest gone wild, writing 1 MiB at a time into its workspace until the kernel refuses (EDQUOT where the
 * quota holds; without one, ENOSPC at the file system's end); the file is removed again, so the workspace passes
 * its checks as any other.
 */
async function runaway(ws: Workspace): Promise<{ code: string | null; bytes: number }> {
  const file = path.join(ws.path, 'runaway.bin')
  const chunk = Buffer.alloc(1 << 20, 0x5a)
  const names = new Map(Object.entries(os.constants.errno).map(([name, n]) => [n, name]))
  let bytes = 0
  let code: string | null = null
  const fh = await fsp.open(file, 'wx')
  try {
    for (;;) bytes += (await fh.write(chunk)).bytesWritten
  } catch (e) {
    // libuv names EDQUOT 'UNKNOWN' on some versions: the errno number is what counts.
    const errno = (e as NodeJS.ErrnoException).errno
    code = typeof errno === 'number' ? (names.get(-errno) ?? String((e as NodeJS.ErrnoException).code)) : describe(e)
  } finally {
    await fh.close()
    await fsp.unlink(file)
  }
  return { code, bytes }
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

if (require.main === module && process.env[ROLE_ENV] === 'worker' && process.send) void workerMain()

/**
 * The boot demo: N real guests, each on its own workspace, at most P at a time.
 *
 * Per VM: allocate a workspace with the base image cloned as rootfs.ext4, start QEMU on that clone with the
 * workspace's lease fd inherited, release() the demo's own copy of the lease (from then on QEMU alone keeps the
 * workspace live), wait for the guest to power off, check the clone (e2fsck, its own token and no other, the
 * base unchanged), quit QEMU and let a sweep reclaim the workspace: there is no dispose call, the lease died with
 * QEMU. `chaos` SIGKILLs some QEMU processes mid-boot; sweeps must reclaim exactly the workspaces whose QEMU is
 * gone and never one whose QEMU still runs.
 */
import { randomBytes, randomInt } from 'node:crypto'
import * as fs from 'node:fs'
import * as fsp from 'node:fs/promises'
import * as os from 'node:os'
import * as path from 'node:path'
import { clone, openPool, poolGauges, type CloneMethod, type Pool, type Workspace } from 'vmspace'
import { fsTypeName } from '../../shared/fsinfo.js'
import { extentBytes, fsckClean, readGuestRecord, tokensInImage } from './checks.js'
import { guestImages, IMAGE_INIT_ARG, sha256File, TOKEN_MARKER, type GuestImages } from './image.js'
import { chooseAccel, GuestVm, type Accel } from './qemu.js'
import { findBootTools, type BootTools } from './tools.js'

export interface BootDemoOptions {
  /** Number of VMs to boot (>= 1). */
  boot: number
  /** At most this many VMs at once. Default min(boot, os.availableParallelism()). */
  parallel?: number
  /** The run's directory (pool, base copy, console logs) is made under this one, itself made (0755) when missing. Default os.tmpdir(). */
  root?: string
  /** SIGKILL a share of the QEMU processes mid-boot. Default false. */
  chaos?: boolean
  /** 'auto' (default): KVM when a short probe boots a guest under it, else TCG. */
  accel?: Accel | 'auto'
  /** Per-VM limit from QEMU's start to the guest's power-off (ms). Default 300000. */
  timeoutMs?: number
  /** Keep the run's directory even when every check passed. Default false (kept on any failure). */
  keep?: boolean
  /** Nice value (0..19) of the QEMU processes, e.g. to keep a test suite's other processes running. Default 0. */
  nice?: number
  /** Where the guest images are cached. Default os.tmpdir(). */
  cacheDir?: string
  /** Progress lines. Default console.log. */
  log?: (line: string) => void
  /**
   * An OCI image (a layout directory, an oci-archive or a docker-archive; as pool.importImage takes it) imported into
   * the pool as rootfs.ext4: every VM boots its workspace's clone of it (allocate({ from })) instead of the demo's
   * base. The initramfs puts its busybox and the guest's init into the clone (the image need not have either).
   */
  image?: string
}

export interface Check {
  name: string
  ok: boolean
  detail?: string
}

export interface VmResult {
  name: string
  /** The workspace's id. */
  id: string
  outcome: 'booted' | 'killed' | 'failed'
  /** QEMU start to guest power-off (ms); absent when the guest did not power off. */
  bootMs?: number
  allocateMs: number
  method: CloneMethod
  /** Allocated bytes of the clone after boot that it still shares with the base / has to itself. */
  sharedBytes?: number
  ownBytes?: number
  checks: Check[]
  consoleLog: string
}

export interface BootReport {
  accel: Accel
  /** Why that accelerator (the KVM probe's outcome). */
  accelWhy: string
  fileSystem: string
  vms: VmResult[]
  /** Checks of the whole run (sweeps reclaiming exactly the right workspaces, nothing left). */
  runChecks: Check[]
  checksPassed: number
  checksTotal: number
  /** The sweeps after each VM's exit and the final one. */
  sweeps: SweepStats
  /** Workspaces (published, staging, trash) left in the pool after the run. */
  left: number
  /** Every check passed and nothing was left. */
  ok: boolean
  runDir: string
  /** Whether runDir was kept (on failure, or with `keep`). */
  kept: boolean
  /** The summary table, as printed. */
  table: string
}

export interface SweepStats {
  sweeps: number
  reclaimed: number
  liveSkipped: number
}

type State = 'running' | 'stopping' | 'exited' | 'reclaimed'

/** Runs the boot demo; throws BootUnavailableError (with the packages to install) when guests cannot boot here. */
export async function runBootDemo(options: BootDemoOptions): Promise<BootReport> {
  const log = options.log ?? ((line: string) => console.log(line))
  const known = ['boot', 'parallel', 'root', 'chaos', 'accel', 'timeoutMs', 'keep', 'nice', 'cacheDir', 'log', 'image']
  for (const key of Object.keys(options))
    if (!known.includes(key))
      throw Object.assign(new TypeError(`runBootDemo: unknown option ${JSON.stringify(key)} (known: ${known.join(', ')})`), { code: 'ERR_INVALID_ARG_VALUE' })
  if (options.accel !== undefined && !['auto', 'kvm', 'tcg'].includes(options.accel))
    throw Object.assign(new RangeError(`runBootDemo: accel must be 'auto', 'kvm' or 'tcg', got ${JSON.stringify(options.accel)}`), { code: 'ERR_INVALID_ARG_VALUE' })
  const n = options.boot
  if (!Number.isInteger(n) || n < 1) throw new RangeError(`boot must be an integer >= 1, got ${n}`)
  const parallel = options.parallel ?? Math.min(n, os.availableParallelism())
  if (!Number.isInteger(parallel) || parallel < 1) throw new RangeError(`parallel must be an integer >= 1, got ${parallel}`)
  const timeoutMs = options.timeoutMs ?? 300_000
  const nice = options.nice ?? 0
  if (!Number.isInteger(nice) || nice < 0 || nice > 19) throw new RangeError(`nice must be an integer 0..19, got ${nice}`)

  const tools = findBootTools()
  const images = await guestImages(tools, options.cacheDir ?? os.tmpdir(), log)
  const { runDir, consoleDir } = await makeRunDir(path.resolve(options.root ?? os.tmpdir()))
  const pool = await openPool(path.join(runDir, 'pool'))
  const { base, from } = await bootBase(pool, runDir, images, options.image, log)
  const baseHash = await sha256File(base)
  const fileSystem = fsTypeName(fs.statfsSync(runDir).type)

  const choice = options.accel === undefined || options.accel === 'auto'
    ? await chooseAccel(tools, images, runDir)
    : { accel: options.accel, why: `${options.accel.toUpperCase()}: chosen with --accel` }
  log(`${choice.why}; pool on ${fileSystem} under ${runDir}`)

  const victims = new Set<number>()
  if (options.chaos) {
    const count = Math.max(1, Math.round(n / 3))
    while (victims.size < count) victims.add(randomInt(n))
  }
  const tokens = Array.from({ length: n }, () => randomBytes(16).toString('hex'))
  const ctx: RunContext = {
    tools, images, pool, base, from, baseHash, consoleDir, accel: choice.accel, timeoutMs, nice, tokens, log,
    states: new Map(), names: new Map(), sweepChecks: [], sweepStats: { sweeps: 0, reclaimed: 0, liveSkipped: 0 }, sweeping: Promise.resolve(),
  }

  const vms: VmResult[] = new Array(n)
  let next = 0
  await Promise.all(
    Array.from({ length: Math.min(parallel, n) }, async () => {
      for (let i = next++; i < n; i = next++)
        vms[i] = await bootOne(ctx, i, victims.has(i)).catch((e: unknown): VmResult => {
          const name = `vm-${i + 1}`
          log(`${name}: failed: ${String(e)}`)
          return { name, id: '', outcome: 'failed', allocateMs: 0, method: 'copy', consoleLog: '', checks: [{ name: 'the VM ran', ok: false, detail: String(e) }] }
        })
    }),
  )

  const runChecks = [...ctx.sweepChecks, ...(await finalChecks(ctx, vms))]
  ctx.sweepStats.sweeps++ // the final one, which must reclaim nothing
  const left = await leftovers(pool)
  await pool.close()
  const all = [...vms.flatMap((v) => v.checks), ...runChecks]
  const checksPassed = all.filter((c) => c.ok).length
  const ok = checksPassed === all.length && left === 0 && vms.every((v) => v.outcome !== 'failed')
  const kept = !ok || options.keep === true
  if (!kept) await fsp.rm(runDir, { recursive: true, force: true })
  const report: BootReport = {
    accel: choice.accel, accelWhy: choice.why, fileSystem, vms, runChecks, checksPassed, checksTotal: all.length,
    sweeps: ctx.sweepStats, left, ok, runDir, kept, table: '',
  }
  report.table = formatTable(report)
  return report
}

/**
 * What the VMs clone: the demo's base, cloned onto the pool's file system (a reflink cannot cross file systems), or
 * `image` imported into the pool as rootfs.ext4 (its template id returned as `from`).
 */
async function bootBase(pool: Pool, runDir: string, images: GuestImages, image: string | undefined, log: (line: string) => void): Promise<{ base: string; from?: string }> {
  if (image === undefined) {
    const base = path.join(runDir, 'base.ext4')
    await clone(images.rootfs, base)
    await fsp.chmod(base, 0o444)
    return { base }
  }
  const t0 = performance.now()
  const t = await pool.importImage(image, { format: 'ext4' })
  const reused = t.image.layers.filter((l) => l.reused).length
  log(`imported ${image} as rootfs.ext4 (template ${t.name ?? t.id}, ${t.image.layers.length} layer(s), ${reused} reused) in ${((performance.now() - t0) / 1000).toFixed(1)} s`)
  return { base: path.join(t.path, 'rootfs.ext4'), from: t.id }
}

/**
 * Makes the run's directory (`vmspace-boot-<random>`, 0700) and its `console/` under `root`. A missing `root` is made
 * first (one level, 0755 whatever the umask), as the other demo's `--root` is: there `openPool` makes it, here the
 * pool lives one level further down, so `mkdtemp` alone would fail with ENOENT.
 */
export async function makeRunDir(root: string): Promise<{ runDir: string; consoleDir: string }> {
  try {
    await fsp.mkdir(root, { mode: 0o700 })
    await fsp.chmod(root, 0o755)
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'EEXIST') throw e
  }
  const runDir = await fsp.mkdtemp(path.join(root, 'vmspace-boot-'))
  const consoleDir = path.join(runDir, 'console')
  await fsp.mkdir(consoleDir)
  return { runDir, consoleDir }
}

interface RunContext {
  tools: BootTools
  images: GuestImages
  pool: Pool
  /** The disk image every VM clones: the demo's base, or the imported image's rootfs.ext4. */
  base: string
  /** The imported image's template id (allocate({ from })), when there is one. */
  from?: string
  baseHash: string
  consoleDir: string
  accel: Accel
  timeoutMs: number
  nice: number
  tokens: string[]
  log: (line: string) => void
  /** Workspace id -> where its QEMU is: sweeps are judged against this. */
  states: Map<string, State>
  /** Workspace id -> VM name, for messages. */
  names: Map<string, string>
  sweepChecks: Check[]
  /** Sweeps run, workspaces they reclaimed, and live workspaces they left alone (summed over sweeps). */
  sweepStats: SweepStats
  /** Sweeps run one at a time, so that each one's result can be judged against the states. */
  sweeping: Promise<unknown>
}

async function bootOne(ctx: RunContext, i: number, victim: boolean): Promise<VmResult> {
  const name = `vm-${i + 1}`
  const token = ctx.tokens[i]!
  const t0 = performance.now()
  const meta = { demo: 'boot', vm: name }
  const ws = await ctx.pool.allocate(ctx.from ? { from: ctx.from, meta } : { template: { 'rootfs.ext4': ctx.base }, meta })
  const allocateMs = performance.now() - t0
  const disk = path.join(ws.path, 'rootfs.ext4')
  const consoleLog = path.join(ctx.consoleDir, `${name}.log`)
  const result: VmResult = { name, id: ws.id, outcome: 'failed', allocateMs, method: ws.template[0]!.method, checks: [], consoleLog }

  ctx.states.set(ws.id, 'running')
  ctx.names.set(ws.id, name)
  const vm = new GuestVm({
    tools: ctx.tools, images: ctx.images, disk, accel: ctx.accel, consoleLog, leaseFd: ws.leaseFd, nice: ctx.nice,
    cmdline: `vmspace.id=${name} vmspace.token=${token}${ctx.from ? ` ${IMAGE_INIT_ARG}` : ''}`,
  })
  try {
    return await driveVm(ctx, vm, ws, result, victim, token)
  } catch (e) {
    // Whatever went wrong on the host side, no QEMU outlives the run.
    vm.kill()
    await vm.exited
    throw e
  }
}

/** From QEMU's start to the sweep that reclaims the workspace; fills in `result`. */
async function driveVm(ctx: RunContext, vm: GuestVm, ws: Workspace, result: VmResult, victim: boolean, token: string): Promise<VmResult> {
  const { name, consoleLog } = result
  const disk = path.join(ws.path, 'rootfs.ext4')
  const check = (checkName: string, ok: boolean, detail?: string) => result.checks.push({ name: checkName, ok, detail })
  const tStart = performance.now()
  // QEMU has its copy of the lease (fd 3) from here on; the demo lets go of its own.
  await ws.release()
  const live = (await ctx.pool.list()).find((w) => w.id === ws.id)?.live === true
  // The lease QEMU holds is the workspace's lease file (.vmspace/leases/<x>/<name>, never the directory), as its fd 3.
  const fd3 = await fsp.readlink(`/proc/${vm.pid}/fd/3`).catch((e: NodeJS.ErrnoException) => `(${e.code})`)
  const leaseFile = path.join(await fsp.realpath(ctx.pool.root), path.relative(ctx.pool.root, ctx.pool.leasePath(ws.name)))
  check('lease held by QEMU alone after release()', live && fd3 === leaseFile,
    !live ? 'list() shows the workspace free while QEMU runs' : fd3 !== leaseFile ? `QEMU's fd 3 is ${fd3}, not ${leaseFile}` : undefined)

  let killed = false
  let killTimer: NodeJS.Timeout | undefined
  if (victim) {
    // Mid-boot: under TCG the kernel is still starting; the kill is skipped if the guest is already done.
    killTimer = setTimeout(() => {
      killed = true
      ctx.states.set(ws.id, 'stopping')
      vm.kill()
    }, randomInt(500, 2500))
  }
  const off = await vm.waitPowerOff(ctx.timeoutMs)
  clearTimeout(killTimer)
  if (off.kind === 'poweroff') result.bootMs = performance.now() - tStart

  if (killed) {
    result.outcome = 'killed'
    await vm.exited
  } else if (off.kind === 'poweroff') {
    await checkClone(ctx, result, disk, token)
    result.outcome = result.checks.every((c) => c.ok) ? 'booted' : 'failed'
    ctx.states.set(ws.id, 'stopping')
    await vm.quit()
  } else {
    const why = off.kind === 'timeout' ? `no power-off within ${ctx.timeoutMs / 1000} s`
      : off.kind === 'shutdown' ? `QEMU reported SHUTDOWN (${off.reason})`
      : `QEMU exited (${off.signal ?? `code ${off.code}`}): ${vm.stderr.trim().split('\n').slice(-2).join(' ')}`
    check('guest powered off', false, `${why}; console: ${consoleLog}`)
    ctx.states.set(ws.id, 'stopping')
    vm.kill()
    await vm.exited
  }
  if (ctx.states.get(ws.id) !== 'reclaimed') ctx.states.set(ws.id, 'exited')

  await sweepAfterExit(ctx, result)
  const boot = result.bootMs === undefined ? '' : ` in ${(result.bootMs / 1000).toFixed(1)} s`
  const passed = result.checks.filter((c) => c.ok).length
  ctx.log(`${name}: ${result.outcome}${boot}; checks ${passed}/${result.checks.length}` +
    result.checks.filter((c) => !c.ok).map((c) => `\n  FAILED ${c.name}: ${c.detail ?? ''}`).join(''))
  return result
}

/** The checks on a powered-off guest's clone, while QEMU (paused) still holds the lease. */
async function checkClone(ctx: RunContext, result: VmResult, disk: string, token: string): Promise<void> {
  const check = (name: string, ok: boolean, detail?: string) => result.checks.push({ name, ok, detail })
  const fsck = await fsckClean(ctx.tools, disk)
  check('e2fsck -fn clean', fsck.clean, fsck.detail)
  const record = await readGuestRecord(ctx.tools, disk)
  const expected = `${TOKEN_MARKER}${token} id=${result.name}\n`
  check('the guest wrote its own token', record === expected, record === undefined ? 'no token file' : `found ${JSON.stringify(record)}`)
  const found = await tokensInImage(disk)
  const others = [...found].filter((t) => t !== token)
  const strangers = others.map((t) => ctx.tokens.indexOf(t)).map((j) => (j >= 0 ? `vm-${j + 1}` : 'unknown'))
  check('no other VM\'s token in the clone', others.length === 0 && found.has(token),
    others.length ? `holds tokens of ${strangers.join(', ')}` : found.has(token) ? undefined : 'own token not found in the bytes')
  const hash = await sha256File(ctx.base)
  check('base byte-identical (sha256)', hash === ctx.baseHash, hash === ctx.baseHash ? undefined : `sha256 ${hash} != ${ctx.baseHash}`)
  const extents = await extentBytes(ctx.tools, disk)
  result.sharedBytes = extents.shared
  result.ownBytes = extents.own
}

/**
 * After a VM's QEMU exited: a sweep (one at a time) must reclaim this workspace (unless an earlier sweep already
 * did), every other workspace whose QEMU has exited, and nothing whose QEMU has not been stopped.
 */
async function sweepAfterExit(ctx: RunContext, result: VmResult): Promise<void> {
  const done = ctx.sweeping.then(async () => {
    // Only QEMUs that had exited before the sweep started must be reclaimed by it; one exiting meanwhile may be.
    const exitedBefore = [...ctx.states].filter(([, s]) => s === 'exited').map(([id]) => id)
    const report = await ctx.pool.sweep()
    ctx.sweepStats.sweeps++
    ctx.sweepStats.reclaimed += report.reclaimed.length
    ctx.sweepStats.liveSkipped += report.live
    const wrong: string[] = []
    for (const e of report.reclaimed) {
      const state = ctx.states.get(e.id)
      if (e.from !== 'published' || (state !== 'stopping' && state !== 'exited'))
        wrong.push(`${ctx.names.get(e.id) ?? e.name} (${e.from}, ${state ?? 'not a VM of this run'})`)
      ctx.states.set(e.id, 'reclaimed')
    }
    const missed = exitedBefore.filter((id) => ctx.states.get(id) !== 'reclaimed')
    ctx.sweepChecks.push({
      name: `sweep after ${result.name} exited reclaims exactly the workspaces whose QEMU is gone`,
      ok: wrong.length === 0 && missed.length === 0 && report.failed.length === 0,
      detail: [
        wrong.length ? `reclaimed ${wrong.join(', ')}` : '',
        missed.length ? `left ${missed.map((id) => ctx.names.get(id)).join(', ')} whose QEMU had exited` : '',
        report.failed.length ? `failed ${report.failed.map((f) => `${f.name}: ${f.code}`).join(', ')}` : '',
      ].filter(Boolean).join('; ') || undefined,
    })
  })
  ctx.sweeping = done.catch(() => {})
  await done
  const reclaimed = ctx.states.get(result.id) === 'reclaimed'
  result.checks.push({ name: 'workspace reclaimed by sweep() alone (no dispose)', ok: reclaimed, detail: reclaimed ? undefined : 'still there after the sweep' })
}

async function finalChecks(ctx: RunContext, vms: VmResult[]): Promise<Check[]> {
  const last = await ctx.pool.sweep()
  const hash = await sha256File(ctx.base)
  return [
    {
      name: 'a final sweep finds nothing more',
      ok: last.reclaimed.length === 0 && last.live === 0 && last.failed.length === 0,
      detail: last.reclaimed.length || last.live ? `reclaimed ${last.reclaimed.length}, live ${last.live}` : undefined,
    },
    { name: 'base byte-identical at the end', ok: hash === ctx.baseHash },
    { name: 'every VM accounted for', ok: vms.every((v) => v !== undefined) },
  ]
}

/** Published workspaces plus entries in staging (its shards) and trash, as the pool's gauges count them. */
async function leftovers(pool: Pool): Promise<number> {
  const { workspaces } = await poolGauges(pool)
  return workspaces.live + workspaces.free + workspaces.staging + workspaces.trash
}

/** Nearest-rank percentile of `values` (p in 0..100). */
export function percentile(values: number[], p: number): number | undefined {
  if (values.length === 0) return undefined
  const sorted = [...values].sort((a, b) => a - b)
  return sorted[Math.max(0, Math.ceil((p / 100) * sorted.length) - 1)]
}

function mib(bytes: number): string {
  return `${(bytes / (1024 * 1024)).toFixed(1)} MiB`
}

export function formatTable(r: BootReport): string {
  const booted = r.vms.filter((v) => v.outcome === 'booted')
  const killed = r.vms.filter((v) => v.outcome === 'killed')
  const failed = r.vms.filter((v) => v.outcome === 'failed')
  const boots = r.vms.flatMap((v) => (v.bootMs === undefined || v.outcome === 'killed' ? [] : [v.bootMs]))
  const allocs = r.vms.map((v) => v.allocateMs)
  const sec = (ms: number | undefined) => (ms === undefined ? '-' : `${(ms / 1000).toFixed(1)} s`)
  const msf = (ms: number | undefined) => (ms === undefined ? '-' : `${ms.toFixed(1)} ms`)
  const methods = [...new Set(r.vms.map((v) => v.method))].join(', ')
  const shared = booted.reduce((s, v) => s + (v.sharedBytes ?? 0), 0)
  const own = booted.reduce((s, v) => s + (v.ownBytes ?? 0), 0)
  const rows: [string, string][] = [
    ['VMs booted', `${booted.length} of ${r.vms.length}` + (killed.length ? ` (${killed.length} SIGKILLed mid-boot by --chaos)` : '') + (failed.length ? `, ${failed.length} FAILED` : '')],
    ['accelerator', r.accelWhy],
    ['boot time p50 / p99', `${sec(percentile(boots, 50))} / ${sec(percentile(boots, 99))}  (QEMU start to guest power-off)`],
    ['allocate p50 / p99', `${msf(percentile(allocs, 50))} / ${msf(percentile(allocs, 99))}`],
    ['clone method', `${methods} (pool on ${r.fileSystem})`],
    ['bytes shared / own', `${mib(shared)} / ${mib(own)}  (booted clones' allocated extents after boot: shared with the base / copied or written)`],
    ['reclaimed by sweep()', `${r.sweeps.reclaimed} of ${r.vms.length} workspaces` + (killed.length ? ` (${killed.length} after SIGKILL)` : '') +
      `, 0 dispose calls; ${r.sweeps.sweeps} sweeps left ${r.sweeps.liveSkipped} live workspaces alone in all`],
    ['checks passed', `${r.checksPassed} / ${r.checksTotal}`],
    ['workspaces left', String(r.left)],
  ]
  const w = Math.max(...rows.map(([k]) => k.length))
  const lines = rows.map(([k, v]) => `  ${k.padEnd(w)}  ${v}`)
  const bad = [...r.vms.flatMap((v) => v.checks.filter((c) => !c.ok).map((c) => `${v.name}: ${c.name}: ${c.detail ?? ''}`)),
    ...r.runChecks.filter((c) => !c.ok).map((c) => `${c.name}: ${c.detail ?? ''}`)]
  if (bad.length) lines.push('', '  failed checks:', ...bad.map((b) => `    ${b}`))
  if (r.kept) lines.push('', `  run directory kept: ${r.runDir} (console logs in console/)`)
  return lines.join('\n')
}

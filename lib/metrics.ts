/**
 * Figures for a sidecar's monitoring (docs/metrics.md): counters and histograms fed from the tracing channels of
 * lib/trace.ts, and gauges read from a pool when asked. Nothing here runs until a caller starts it: the channels
 * get their subscribers from startMetrics() and lose them at close(), so a program that never asks pays nothing
 * (the hot path checks `hasSubscribers` as before). Two faces: plain values (snapshot(), poolGauges(), an
 * onOperation callback) that an OpenTelemetry meter can observe, and registerPrometheus(), which adds the same
 * figures to a prom-client registry; metricsText() writes the Prometheus text format without prom-client.
 */
import * as dc from 'node:diagnostics_channel'
import * as fsp from 'node:fs/promises'
import * as path from 'node:path'
import { performance } from 'node:perf_hooks'
import { func, invalidType, optionsObject } from './args.js'
import type { Pool } from './pool.js'
import type { AllocateTrace, CloneTrace, SweepTrace } from './trace.js'
import type { CloneMethod, WarmStats } from './types.js'

/** The traced operations: allocate(), clone() and Workspace.clone(), dispose(), sweep(), lockFile(). */
export type MetricsOperation = 'allocate' | 'clone' | 'dispose' | 'sweep' | 'lock'

const OPERATIONS: readonly MetricsOperation[] = ['allocate', 'clone', 'dispose', 'sweep', 'lock']
const METHODS: readonly CloneMethod[] = ['reflink', 'copy', 'mixed', 'snapshot']

/**
 * Upper bounds (seconds) of the duration histograms' buckets: an empty allocate takes well under a millisecond,
 * a copy of a guest image can take a minute.
 */
export const durationBuckets: readonly number[] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]

/** One finished operation, as {@link MetricsOptions.onOperation} gets it. */
export interface OperationRecord {
  /** The operation that finished. */
  operation: MetricsOperation
  /** Seconds from the call to its settling (a lock: to the grant). */
  seconds: number
  /** The error's `code` when the call failed (`'UNKNOWN'` for an error without one); absent when it succeeded. */
  code?: string
  /** allocate() with a template, clone(): how the data arrived. */
  method?: CloneMethod
  /** allocate() with a template, clone(): regular files cloned. */
  files?: number
  /** allocate() with a template, clone(): their logical bytes; sweep(): the bytes it freed. */
  bytes?: number
  /** sweep(): entries reclaimed. */
  reclaimed?: number
  /** sweep(): entries whose removal failed. */
  failed?: number
}

/** Counts and durations of one operation since startMetrics(). */
export interface OperationFigures {
  /** Calls finished, failed ones included. */
  count: number
  /** Failed calls by error `code`. */
  errors: Record<string, number>
  /** Their durations added up, in seconds. */
  seconds: number
  /** Calls per bucket of {@link durationBuckets} (not cumulative; the last entry counts those over the last bound). */
  buckets: number[]
}

/** What {@link Metrics.snapshot} returns: plain numbers, a copy. */
export interface MetricsSnapshot {
  /** Calls, failures by code and durations, per operation. */
  operations: Record<MetricsOperation, OperationFigures>
  /** Files and logical bytes cloned, by the operation that cloned them and by how their data arrived. */
  cloned: Record<
    'allocate' | 'clone',
    Record<
      CloneMethod,
      {
        /** Regular files cloned. */
        files: number
        /** Their logical bytes. */
        bytes: number
      }
    >
  >
  /** What successful sweeps did: entries reclaimed, the bytes that freed, entries that failed. */
  sweep: {
    /** Entries reclaimed. */
    reclaimed: number
    /** The bytes those reclaims freed. */
    reclaimedBytes: number
    /** Entries that failed (SweepReport.failed). */
    failed: number
  }
}

/** Options of {@link startMetrics}. */
export interface MetricsOptions {
  /** Called once per finished operation, after the counters are updated (e.g. to feed an OpenTelemetry histogram). */
  onOperation?: (record: OperationRecord) => void
}

/** The counters of {@link startMetrics}: subscribed to vmspace's tracing channels until close(). */
export interface Metrics {
  /** The figures so far, as plain values. */
  snapshot(): MetricsSnapshot
  /** Unsubscribes (the channels are back to costing one check per call when nothing else listens). Idempotent. */
  close(): void
  /** Whether close() was called. */
  readonly closed: boolean
}

function emptySnapshot(): MetricsSnapshot {
  const op = (): OperationFigures => ({ count: 0, errors: {}, seconds: 0, buckets: new Array<number>(durationBuckets.length + 1).fill(0) })
  const byMethod = () => Object.fromEntries(METHODS.map((m) => [m, { files: 0, bytes: 0 }])) as Record<CloneMethod, { files: number; bytes: number }>
  return {
    operations: Object.fromEntries(OPERATIONS.map((o) => [o, op()])) as Record<MetricsOperation, OperationFigures>,
    cloned: { allocate: byMethod(), clone: byMethod() },
    sweep: { reclaimed: 0, reclaimedBytes: 0, failed: 0 },
  }
}

/** The record of a finished call from its trace context. */
function recordOf(operation: MetricsOperation, context: Record<string, unknown>, seconds: number): OperationRecord {
  const r: OperationRecord = { operation, seconds }
  if ('error' in context) {
    const code = (context.error as { code?: unknown } | null)?.code
    r.code = typeof code === 'string' && code ? code : 'UNKNOWN'
    return r
  }
  if (operation === 'allocate' || operation === 'clone') {
    const t = context as unknown as AllocateTrace | CloneTrace
    if (t.method !== undefined) Object.assign(r, { method: t.method, files: t.files ?? 0, bytes: t.bytes ?? 0 })
  } else if (operation === 'sweep') {
    const t = context as unknown as SweepTrace
    Object.assign(r, { reclaimed: t.reclaimed ?? 0, bytes: t.bytes ?? 0, failed: t.failed ?? 0 })
  }
  return r
}

function add(s: MetricsSnapshot, r: OperationRecord): void {
  const f = s.operations[r.operation]
  f.count++
  f.seconds += r.seconds
  let i = 0
  while (i < durationBuckets.length && r.seconds > durationBuckets[i]) i++
  f.buckets[i]++
  if (r.code !== undefined) f.errors[r.code] = (f.errors[r.code] ?? 0) + 1
  if (r.method !== undefined && (r.operation === 'allocate' || r.operation === 'clone')) {
    const c = s.cloned[r.operation][r.method]
    c.files += r.files ?? 0
    c.bytes += r.bytes ?? 0
  }
  if (r.operation === 'sweep' && r.code === undefined) {
    s.sweep.reclaimed += r.reclaimed ?? 0
    s.sweep.reclaimedBytes += r.bytes ?? 0
    s.sweep.failed += r.failed ?? 0
  }
}

class ChannelMetrics implements Metrics {
  readonly #figures = emptySnapshot()
  // Start times by trace context: a context is one call, and a call started before subscribe() is not counted.
  readonly #starts = new WeakMap<object, number>()
  readonly #onOperation: ((r: OperationRecord) => void) | undefined
  readonly #subscriptions: [string, (message: unknown) => void][] = []
  #closed = false

  constructor(onOperation: ((r: OperationRecord) => void) | undefined) {
    this.#onOperation = onOperation
    for (const op of OPERATIONS) {
      const finish = (context: unknown) => this.#finish(op, context as Record<string, unknown>)
      const handlers: Record<string, (message: unknown) => void> = {
        start: (context) => this.#starts.set(context as object, performance.now()),
        // tracePromise publishes `end` when the call returns its promise; `error` is set by then only when the
        // call threw synchronously, and no asyncEnd follows.
        end: (context) => {
          if ('error' in (context as object)) finish(context)
        },
        asyncEnd: finish,
      }
      for (const [event, fn] of Object.entries(handlers)) {
        const name = `tracing:vmspace:${op}:${event}`
        dc.subscribe(name, fn)
        this.#subscriptions.push([name, fn])
      }
    }
  }

  #finish(op: MetricsOperation, context: Record<string, unknown>): void {
    const t0 = this.#starts.get(context)
    if (t0 === undefined) return
    this.#starts.delete(context)
    const r = recordOf(op, context, (performance.now() - t0) / 1000)
    add(this.#figures, r)
    this.#onOperation?.(r)
  }

  get closed(): boolean {
    return this.#closed
  }

  snapshot(): MetricsSnapshot {
    return structuredClone(this.#figures)
  }

  close(): void {
    if (this.#closed) return
    this.#closed = true
    for (const [name, fn] of this.#subscriptions.splice(0)) dc.unsubscribe(name, fn)
  }
}

/**
 * Subscribes to vmspace's tracing channels (`vmspace:allocate`, `:clone`, `:dispose`, `:sweep`, `:lock`) and
 * counts every call that starts from now on, until close(): calls, failures by `code`, durations, bytes and files
 * cloned by method, what sweeps reclaimed. Each instance counts on its own. Throws `ERR_INVALID_ARG_TYPE` /
 * `ERR_INVALID_ARG_VALUE` for a bad options object.
 */
export function startMetrics(options?: MetricsOptions): Metrics {
  const o = optionsObject<MetricsOptions>('options', options, { onOperation: true })
  return new ChannelMetrics(func<(r: OperationRecord) => void>('options.onOperation', o.onOperation))
}

/** A pool's figures at one moment ({@link poolGauges}). Counts; bytes. */
export interface PoolGauges {
  /** The pool's root directory. */
  root: string
  /**
   * Workspaces by state: published with a held lease (`live`) or without (`free`: reclaimable by a sweep),
   * entries being built in the staging shards (warm reserve entries included) and entries in the trash.
   */
  workspaces: {
    /** Published, lease held by a process. */
    live: number
    /** Published, lease held by no process: a sweep reclaims it. */
    free: number
    /** Being built in the staging shards (warm reserve entries included). */
    staging: number
    /** In the trash, being removed. */
    trash: number
  }
  /** Published workspaces whose record could not be read (their `error` in Pool.list()). */
  unreadable: number
  /** Published workspaces allocated with a `quota`. */
  quota: number
  /** The pool file system's space (statfs(2)): free (f_bfree), available to unprivileged users (f_bavail), size. */
  fs: {
    /** Free bytes (f_bfree × f_bsize). */
    freeBytes: number
    /** Bytes available to unprivileged users (f_bavail × f_bsize). */
    availableBytes: number
    /** The file system's size in bytes (f_blocks × f_bsize). */
    sizeBytes: number
  }
  /** This process's warm reserve of that pool (Pool.warmStats()), or undefined without one. */
  warm?: Pick<WarmStats, 'ready' | 'hits' | 'misses' | 'stale' | 'built' | 'buildFailures'> & {
    /** The reserve's size (WarmStats.count). */
    size: number
  }
}

async function entriesIn(dir: string): Promise<number> {
  try {
    return (await fsp.readdir(dir)).length
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return 0
    throw e
  }
}

/**
 * Reads a pool's gauges: one Pool.list() (each workspace's record and a lease probe; no tree is walked, whatever the
 * pool holds), a readdir of each staging shard and of the trash, one statfs(2). Throws as Pool.list()
 * (`ERR_POOL_CLOSED` once the pool is closed) and the errno of the readdir or statfs.
 */
export async function poolGauges(pool: Pool): Promise<PoolGauges> {
  if (!pool || typeof (pool as Partial<Pool>).list !== 'function') throw invalidType('pool', 'a Pool', pool)
  const list = await pool.list()
  const internal = path.join(pool.root, '.vmspace')
  const shards = (await fsp.readdir(path.join(internal, 'staging'))).filter((n) => /^s\d+$/.test(n))
  const staging = (await Promise.all(shards.map((s) => entriesIn(path.join(internal, 'staging', s))))).reduce((a, b) => a + b, 0)
  const trash = await entriesIn(path.join(internal, 'trash'))
  const sfs = await fsp.statfs(pool.root)
  const live = list.filter((w) => w.live).length
  const g: PoolGauges = {
    root: pool.root,
    workspaces: { live, free: list.length - live, staging, trash },
    unreadable: list.filter((w) => w.error !== undefined).length,
    quota: list.filter((w) => w.quota !== undefined).length,
    fs: { freeBytes: sfs.bfree * sfs.bsize, availableBytes: sfs.bavail * sfs.bsize, sizeBytes: sfs.blocks * sfs.bsize },
  }
  const w = pool.warmStats()
  if (w) g.warm = { size: w.count, ready: w.ready, hits: w.hits, misses: w.misses, stale: w.stale, built: w.built, buildFailures: w.buildFailures }
  return g
}

// ---- The Prometheus names (docs/metrics.md has the same table) ----

type MetricType = 'counter' | 'gauge' | 'histogram'
interface Family {
  name: string
  help: string
  type: MetricType
  labels: readonly string[]
}
interface Sample {
  /** The family's name, or for a histogram its `_bucket`/`_sum`/`_count` series. */
  name: string
  labels: Record<string, string>
  value: number
}

/** @internal The families fed by startMetrics(), in output order. */
export const operationFamilies: readonly Family[] = [
  { name: 'vmspace_operations_total', help: 'vmspace calls finished (failed ones included), by operation.', type: 'counter', labels: ['operation'] },
  { name: 'vmspace_operation_errors_total', help: 'vmspace calls that failed, by operation and error code.', type: 'counter', labels: ['operation', 'code'] },
  { name: 'vmspace_operation_duration_seconds', help: 'Duration of vmspace calls (lock: the wait for the grant), by operation.', type: 'histogram', labels: ['operation'] },
  { name: 'vmspace_cloned_files_total', help: 'Regular files cloned, by operation (allocate: its template) and method (copy: the fallback where no reflink was possible).', type: 'counter', labels: ['operation', 'method'] },
  { name: 'vmspace_cloned_bytes_total', help: 'Logical bytes of the files cloned, by operation and method.', type: 'counter', labels: ['operation', 'method'] },
  { name: 'vmspace_sweep_reclaimed_total', help: 'Entries that sweeps reclaimed.', type: 'counter', labels: [] },
  { name: 'vmspace_sweep_freed_bytes_total', help: 'Bytes that sweeps freed.', type: 'counter', labels: [] },
  { name: 'vmspace_sweep_failures_total', help: 'Entries whose handling failed in a sweep.', type: 'counter', labels: [] },
]

/** @internal The families read from pools by poolGauges(), in output order. */
export const poolFamilies: readonly Family[] = [
  { name: 'vmspace_pool_up', help: 'Whether the pool could be read at this scrape (1) or not (0).', type: 'gauge', labels: ['root'] },
  { name: 'vmspace_pool_workspaces', help: 'Workspaces by state: live (lease held), free (reclaimable), staging (being built, warm entries included), trash.', type: 'gauge', labels: ['root', 'state'] },
  { name: 'vmspace_pool_workspaces_unreadable', help: 'Published workspaces whose record could not be read.', type: 'gauge', labels: ['root'] },
  { name: 'vmspace_pool_workspaces_quota', help: 'Published workspaces allocated with a quota.', type: 'gauge', labels: ['root'] },
  { name: 'vmspace_pool_fs_free_bytes', help: "Free bytes of the pool's file system (statfs f_bfree).", type: 'gauge', labels: ['root'] },
  { name: 'vmspace_pool_fs_avail_bytes', help: "Bytes of the pool's file system available to unprivileged users (statfs f_bavail).", type: 'gauge', labels: ['root'] },
  { name: 'vmspace_pool_fs_size_bytes', help: "Size of the pool's file system in bytes.", type: 'gauge', labels: ['root'] },
  { name: 'vmspace_warm_size', help: "The warm reserve's size (count) in this process.", type: 'gauge', labels: ['root'] },
  { name: 'vmspace_warm_ready', help: 'Warm reserve entries built and waiting to be handed out.', type: 'gauge', labels: ['root'] },
  { name: 'vmspace_warm_hits_total', help: 'allocate() calls the warm reserve served.', type: 'counter', labels: ['root'] },
  { name: 'vmspace_warm_misses_total', help: "allocate() calls of the reserve's template that found it empty.", type: 'counter', labels: ['root'] },
  { name: 'vmspace_warm_stale_total', help: 'Warm entries found stale at hand-out and removed.', type: 'counter', labels: ['root'] },
  { name: 'vmspace_warm_builds_total', help: 'Warm entries built.', type: 'counter', labels: ['root'] },
  { name: 'vmspace_warm_build_failures_total', help: 'Warm entry builds that failed.', type: 'counter', labels: ['root'] },
]

/** @internal The samples of a snapshot (histograms as their `_bucket`, `_sum` and `_count` series). */
export function operationSamples(s: MetricsSnapshot): Sample[] {
  const out: Sample[] = []
  for (const op of OPERATIONS) out.push({ name: 'vmspace_operations_total', labels: { operation: op }, value: s.operations[op].count })
  for (const op of OPERATIONS) {
    for (const [code, n] of Object.entries(s.operations[op].errors)) out.push({ name: 'vmspace_operation_errors_total', labels: { operation: op, code }, value: n })
  }
  for (const op of OPERATIONS) {
    const f = s.operations[op]
    let cumulative = 0
    durationBuckets.forEach((le, i) => {
      cumulative += f.buckets[i]
      out.push({ name: 'vmspace_operation_duration_seconds_bucket', labels: { operation: op, le: String(le) }, value: cumulative })
    })
    out.push({ name: 'vmspace_operation_duration_seconds_bucket', labels: { operation: op, le: '+Inf' }, value: f.count })
    out.push({ name: 'vmspace_operation_duration_seconds_sum', labels: { operation: op }, value: f.seconds })
    out.push({ name: 'vmspace_operation_duration_seconds_count', labels: { operation: op }, value: f.count })
  }
  for (const [what, key] of [['files', 'vmspace_cloned_files_total'], ['bytes', 'vmspace_cloned_bytes_total']] as const) {
    for (const op of ['allocate', 'clone'] as const) {
      for (const m of METHODS) out.push({ name: key, labels: { operation: op, method: m }, value: s.cloned[op][m][what] })
    }
  }
  out.push({ name: 'vmspace_sweep_reclaimed_total', labels: {}, value: s.sweep.reclaimed })
  out.push({ name: 'vmspace_sweep_freed_bytes_total', labels: {}, value: s.sweep.reclaimedBytes })
  out.push({ name: 'vmspace_sweep_failures_total', labels: {}, value: s.sweep.failed })
  return out
}

/** @internal The samples of one pool's gauges; `undefined`: the pool could not be read (only `vmspace_pool_up` 0). */
export function poolSamples(root: string, g: PoolGauges | undefined): Sample[] {
  if (!g) return [{ name: 'vmspace_pool_up', labels: { root }, value: 0 }]
  const out: Sample[] = [{ name: 'vmspace_pool_up', labels: { root }, value: 1 }]
  for (const [state, n] of Object.entries(g.workspaces)) out.push({ name: 'vmspace_pool_workspaces', labels: { root, state }, value: n })
  const one = (name: string, value: number) => out.push({ name, labels: { root }, value })
  one('vmspace_pool_workspaces_unreadable', g.unreadable)
  one('vmspace_pool_workspaces_quota', g.quota)
  one('vmspace_pool_fs_free_bytes', g.fs.freeBytes)
  one('vmspace_pool_fs_avail_bytes', g.fs.availableBytes)
  one('vmspace_pool_fs_size_bytes', g.fs.sizeBytes)
  if (g.warm) {
    one('vmspace_warm_size', g.warm.size)
    one('vmspace_warm_ready', g.warm.ready)
    one('vmspace_warm_hits_total', g.warm.hits)
    one('vmspace_warm_misses_total', g.warm.misses)
    one('vmspace_warm_stale_total', g.warm.stale)
    one('vmspace_warm_builds_total', g.warm.built)
    one('vmspace_warm_build_failures_total', g.warm.buildFailures)
  }
  return out
}

/** @internal Gauges of every pool, a pool that cannot be read (closed, its directory gone) as `undefined`. */
export async function readPools(pools: Iterable<Pool>): Promise<[string, PoolGauges | undefined][]> {
  return Promise.all(
    [...pools].map(async (p): Promise<[string, PoolGauges | undefined]> => {
      try {
        return [p.root, await poolGauges(p)]
      } catch {
        return [p.root, undefined]
      }
    }),
  )
}

// The exposition format's escapes (prometheus.io/docs/instrumenting/exposition_formats): `\`, `"` and newline in
// label values; `\` and newline in HELP text.
const escapeLabel = (v: string) => v.replace(/\\/g, '\\\\').replace(/"/g, '\\"').replace(/\n/g, '\\n')
const escapeHelp = (v: string) => v.replace(/\\/g, '\\\\').replace(/\n/g, '\\n')

function formatValue(v: number): string {
  if (Number.isNaN(v)) return 'NaN'
  if (v === Infinity) return '+Inf'
  if (v === -Infinity) return '-Inf'
  return String(v)
}

function render(families: readonly Family[], samples: Sample[]): string {
  const lines: string[] = []
  for (const f of families) {
    const mine = samples.filter((s) => s.name === f.name || (f.type === 'histogram' && s.name.startsWith(f.name + '_')))
    if (!mine.length) continue
    lines.push(`# HELP ${f.name} ${escapeHelp(f.help)}`, `# TYPE ${f.name} ${f.type}`)
    for (const s of mine) {
      const labels = Object.entries(s.labels).map(([k, v]) => `${k}="${escapeLabel(v)}"`)
      lines.push(`${s.name}${labels.length ? `{${labels.join(',')}}` : ''} ${formatValue(s.value)}`)
    }
  }
  return lines.length ? lines.join('\n') + '\n' : ''
}

/** Options of {@link metricsText}. */
export interface MetricsTextOptions {
  /** Counters to include (from startMetrics()). */
  metrics?: Metrics
  /** Pools whose gauges to include (read now, as poolGauges(); one that cannot be read shows `vmspace_pool_up` 0). */
  pools?: Iterable<Pool>
  /** Gauges already read (poolGauges()) to include as they are. */
  gauges?: Iterable<PoolGauges>
}

/**
 * The figures in the Prometheus text exposition format (version 0.0.4, what `promtool check metrics` checks),
 * for a sidecar without prom-client or a textfile collector. Label `root` tells pools apart. Throws
 * `ERR_INVALID_ARG_TYPE`/`ERR_INVALID_ARG_VALUE` for a bad options object; a pool that cannot be read is not an
 * error (see `pools`).
 */
export async function metricsText(options?: MetricsTextOptions): Promise<string> {
  const o = optionsObject<MetricsTextOptions>('options', options, { metrics: true, pools: true, gauges: true })
  if (o.metrics !== undefined && typeof (o.metrics as Partial<Metrics>).snapshot !== 'function') throw invalidType('options.metrics', 'a Metrics object', o.metrics)
  for (const key of ['pools', 'gauges'] as const) {
    if (o[key] !== undefined && typeof (o[key] as Partial<Iterable<unknown>>)[Symbol.iterator] !== 'function') throw invalidType(`options.${key}`, 'an iterable', o[key])
  }
  const ops = o.metrics ? render(operationFamilies, operationSamples(o.metrics.snapshot())) : ''
  const read: [string, PoolGauges | undefined][] = [...(o.gauges ?? [])].map((g) => [g.root, g])
  if (o.pools) read.push(...(await readPools(o.pools)))
  return ops + render(poolFamilies, read.flatMap(([root, g]) => poolSamples(root, g)))
}

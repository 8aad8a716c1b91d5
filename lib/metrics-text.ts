/**
 * The Prometheus face of the figures (docs/metrics.md has the same table): the metric names, the samples of the
 * counters (lib/metrics.ts) and of a pool's gauges (lib/metrics-pool.ts), and metricsText(), which writes them in the
 * text exposition format without prom-client (lib/metrics-prom.ts registers the same names into prom-client).
 */
import { invalidType, optionsObject } from './args.js'
import { durationBuckets, METHODS, OPERATIONS, type Metrics, type MetricsSnapshot } from './metrics.js'
import { readPools, type PoolGauges } from './metrics-pool.js'
import type { Pool } from './pool.js'

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

/**
 * Counters for a sidecar's monitoring (docs/metrics.md): calls, failures, durations and what they cloned or
 * reclaimed, fed from the tracing channels of lib/trace.ts. Nothing here runs until a caller starts it: the channels
 * get their subscribers from startMetrics() and lose them at close(), so a program that never asks pays nothing
 * (the hot path checks `hasSubscribers`). The other faces of the same figures: a pool's gauges
 * (lib/metrics-pool.ts), the Prometheus text format (lib/metrics-text.ts) and prom-client (lib/metrics-prom.ts).
 */
import * as dc from 'node:diagnostics_channel'
import { performance } from 'node:perf_hooks'
import { func, optionsObject } from './args.js'
import type { AllocateTrace, CloneTrace, SweepTrace } from './trace.js'
import type { CloneMethod } from './types.js'

/** The traced operations: allocate(), clone() and Workspace.clone(), dispose(), sweep(), lockFile(). */
export type MetricsOperation = 'allocate' | 'clone' | 'dispose' | 'sweep' | 'lock'

/** @internal Every traced operation, in the order the Prometheus samples list them. */
export const OPERATIONS: readonly MetricsOperation[] = ['allocate', 'clone', 'dispose', 'sweep', 'lock']
/** @internal Every clone method counted. */
export const METHODS: readonly CloneMethod[] = ['reflink', 'copy', 'mixed', 'snapshot']

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

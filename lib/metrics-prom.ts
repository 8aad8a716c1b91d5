/**
 * The prom-client face of lib/metrics.ts: the same names, registered into the caller's registry. prom-client is an
 * optional peer dependency, loaded on the first registerPrometheus() call only (or passed in as `client`), so the
 * package works without it; the types below are the few members used, so the published types need no prom-client.
 */
import { func, invalidType, optionsObject } from './args.js'
import { startMetrics, type Metrics, type MetricsSnapshot, type OperationRecord } from './metrics.js'
import { readPools, type PoolGauges } from './metrics-pool.js'
import { operationFamilies, operationSamples, poolFamilies, poolSamples } from './metrics-text.js'
import type { Pool } from './pool.js'

/** The members of a prom-client `Registry` that registerPrometheus() uses. */
export interface PromRegistry {
  /** Adds a metric object (prom-client's Registry.registerMetric). */
  registerMetric(metric: object): void
  /** The metric of that name, or undefined. */
  getSingleMetric(name: string): unknown
  /** Removes the metric of that name. */
  removeSingleMetric(name: string): void
}

/** What registerPrometheus() uses of a prom-client metric. */
export interface PromMetric {
  /** Sets every series back to zero. */
  reset(): void
}
/** What registerPrometheus() uses of a prom-client Counter. */
export interface PromCounter extends PromMetric {
  /** Adds `value` (default 1) to the series of `labels`. */
  inc(labels: Record<string, string>, value?: number): void
}
/** What registerPrometheus() uses of a prom-client Gauge. */
export interface PromGauge extends PromMetric {
  /** Sets the series of `labels`. */
  set(labels: Record<string, string>, value: number): void
}
/** The configuration registerPrometheus() gives a prom-client Counter or Gauge. */
export interface PromMetricConfig {
  /** The metric's name (`vmspace_…`). */
  name: string
  /** Its HELP text. */
  help: string
  /** Its label names. */
  labelNames: readonly string[]
  /** The registry it is registered in. */
  registers: PromRegistry[]
  /** Called at each scrape, to set the values. */
  collect?: () => void | Promise<void>
}

/** prom-client's Counter class, as registerPrometheus() constructs it. */
export interface PromCounterClass {
  /** A counter with that configuration, registered in its `registers`. */
  new (config: PromMetricConfig): PromCounter
}
/** prom-client's Gauge class, as registerPrometheus() constructs it. */
export interface PromGaugeClass {
  /** A gauge with that configuration, registered in its `registers`. */
  new (config: PromMetricConfig): PromGauge
}

/** The members of the prom-client module that registerPrometheus() uses (prom-client 14 and 15). */
export interface PromClient {
  /** prom-client's Counter class. */
  Counter: PromCounterClass
  /** prom-client's Gauge class. */
  Gauge: PromGaugeClass
}

/** Options of {@link registerPrometheus}. */
export interface PrometheusOptions {
  /**
   * Pools whose gauges each scrape reads (poolGauges(): no tree is walked). An iterable read at every scrape, so a
   * Set the sidecar adds to and deletes from is followed. A pool that cannot be read shows `vmspace_pool_up` 0.
   */
  pools?: Iterable<Pool>
  /** The prom-client module to use (default: `require('prom-client')`); pass yours where two copies are installed. */
  client?: PromClient
  /** Also called once per finished operation, as {@link MetricsOptions.onOperation}. */
  onOperation?: (record: OperationRecord) => void
}

/** What registerPrometheus() registered. */
export interface PrometheusMetrics {
  /** The counters behind it, as plain values too. */
  readonly metrics: Metrics
  /** Unsubscribes from the tracing channels and removes every metric it registered from the registry. Idempotent. */
  close(): void
}

function loadClient(): PromClient {
  try {
    // A lazy require: prom-client is an optional peer dependency, loaded only by a caller who asks for it.
    // eslint-disable-next-line @typescript-eslint/no-require-imports
    return require('prom-client') as PromClient
  } catch (e) {
    const err = new Error('registerPrometheus needs prom-client (npm install prom-client), or pass it as `options.client`', { cause: e })
    throw Object.assign(err, { code: 'MODULE_NOT_FOUND' })
  }
}

function checkOptions(registry: unknown, options: unknown): PrometheusOptions {
  if (typeof registry !== 'object' || registry === null || typeof (registry as Partial<PromRegistry>).removeSingleMetric !== 'function')
    throw invalidType('registry', 'a prom-client Registry', registry)
  const o = optionsObject<PrometheusOptions>('options', options, { pools: true, client: true, onOperation: true })
  if (o.pools !== undefined && typeof (o.pools as Partial<Iterable<Pool>>)?.[Symbol.iterator] !== 'function') throw invalidType('options.pools', 'an iterable of Pool', o.pools)
  if (o.client !== undefined && typeof (o.client as Partial<PromClient>)?.Counter !== 'function') throw invalidType('options.client', 'the prom-client module', o.client)
  func('options.onOperation', o.onOperation)
  return o
}

/**
 * Registers vmspace's figures into a prom-client `registry` (names and labels: docs/metrics.md): counters and
 * duration histograms of every traced call from now on (startMetrics()), and, when `pools` is given, their gauges,
 * read at each scrape. Throws `ERR_INVALID_ARG_TYPE`/`ERR_INVALID_ARG_VALUE` for bad arguments, `MODULE_NOT_FOUND`
 * when prom-client is not installed, and prom-client's own error when a name is already registered (nothing is
 * then left registered or subscribed).
 */
export function registerPrometheus(registry: PromRegistry, options?: PrometheusOptions): PrometheusMetrics {
  const o = checkOptions(registry, options)
  const client = o.client ?? loadClient()
  const names: string[] = []
  const config = (f: (typeof operationFamilies)[number], extra: Partial<PromMetricConfig> = {}): PromMetricConfig => {
    names.push(f.name)
    return { name: f.name, help: f.help, labelNames: f.labels, registers: [registry], ...extra }
  }
  const unregister = () => {
    for (const n of names.splice(0)) if (registry.getSingleMetric(n)) registry.removeSingleMetric(n)
  }
  let metrics: Metrics | undefined
  try {
    operationInstruments(client, registry, config, () => metrics?.snapshot())
    if (o.pools) poolInstruments(client, config, o.pools)
    metrics = startMetrics({ onOperation: o.onOperation })
  } catch (e) {
    unregister()
    throw e
  }
  const m = metrics
  return {
    metrics: m,
    close() {
      m.close()
      unregister()
    },
  }
}

type Configure = (f: (typeof operationFamilies)[number], extra?: Partial<PromMetricConfig>) => PromMetricConfig

/**
 * The operation families, read at collect time from the snapshot of `metrics`: nothing runs per call beyond
 * startMetrics()'s own counting. Counters are prom-client Counters set in collect(); the duration histogram,
 * whose buckets prom-client's Histogram cannot be given, is registered as a metric object of the shape prom-client's
 * own Histogram.get() returns (registry.registerMetric: name, help, type, aggregator, get(), reset()).
 */
function operationInstruments(client: PromClient, registry: PromRegistry, config: Configure, snapshot: () => MetricsSnapshot | undefined): void {
  const samples = (name: string) => {
    const s = snapshot()
    return s ? operationSamples(s).filter((x) => x.name === name || x.name.startsWith(name + '_')) : []
  }
  for (const f of operationFamilies) {
    if (f.type === 'histogram') {
      config(f) // for unregister()
      const metric = {
        name: f.name,
        help: f.help,
        type: f.type,
        aggregator: 'sum',
        get: async () => ({
          name: metric.name,
          help: f.help,
          type: f.type,
          aggregator: 'sum',
          values: samples(f.name).map((x) => ({ labels: x.labels, value: x.value, metricName: x.name })),
        }),
        reset() {},
      }
      if (registry.getSingleMetric(f.name)) throw new Error(`A metric with the name ${f.name} has already been registered.`)
      registry.registerMetric(metric)
      continue
    }
    const counter: PromCounter = new client.Counter(
      config(f, {
        collect() {
          counter.reset()
          for (const x of samples(f.name)) counter.inc(x.labels, x.value)
        },
      }),
    )
  }
}

/**
 * One gauge (or counter) per pool family, each set at collect time from one read of the pools shared by the whole
 * scrape: prom-client's registry.metrics() calls every collect() before awaiting any, so one read serves them all.
 */
function poolInstruments(client: PromClient, config: Configure, pools: Iterable<Pool>): void {
  let reading: Promise<[string, PoolGauges | undefined][]> | undefined
  const read = () => {
    reading ??= readPools(pools).finally(() => {
      reading = undefined
    })
    return reading
  }
  for (const f of poolFamilies) {
    const Kind = f.type === 'counter' ? client.Counter : client.Gauge
    const metric: PromGauge | PromCounter = new Kind(
      config(f, {
        async collect() {
          const samples = (await read()).flatMap(([root, g]) => poolSamples(root, g)).filter((s) => s.name === f.name)
          metric.reset()
          for (const s of samples) {
            if ('set' in metric) metric.set(s.labels, s.value)
            else metric.inc(s.labels, s.value)
          }
        },
      }),
    )
  }
}

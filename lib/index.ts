/**
 * vmspace: private per-VM workspace directories for sandbox sidecars (Linux). See README.md.
 */
export { openPool, Pool } from './pool.js'
export { Workspace } from './workspace.js'
export type {
  PoolOptions,
  SweepSource,
  AllocateOptions,
  WorkspaceInfo,
  PoolStats,
  WarmOptions,
  WarmStats,
  SweepOptions,
  SweepReport,
  SweepEntry,
  SweepFailure,
  TemplateSource,
  TemplateCacheOptions,
  JsonObject,
  JsonValue,
  ListOptions,
  PoolUsage,
} from './types.js'
export { unmountImage } from './image.js'
export type { ImageOptions } from './types.js'
export { probeQuota } from './quota.js'
export type { QuotaOptions, QuotaSupport, WorkspaceUsage } from './types.js'
export { clone } from './clone.js'
export { removeTree } from './remove.js'
export { renameNoReplace, exchange } from './rename.js'
export type { RemoveTreeOptions } from './remove.js'
export type { CloneOptions, CloneResult, CloneProgressEvent, Reflink, TemplateCacheUse, Writeback } from './types.js'
export { VmspaceError, AbortError } from './errors.js'
export type { VmspaceErrorCode, SystemErrorCode } from './errors.js'
export { lockFile, FileLock } from './lock.js'
export type { LockOptions } from './lock.js'
export { updateJsonFile } from './json-file.js'
export type { UpdateJsonOptions } from './json-file.js'
export type { Template, TemplateUsage, CommitOptions, CommitResult, ForkOptions, PruneOptions, SharedFile } from './types.js'
export type { Checkpoint, CheckpointOptions, CheckpointRecord, RollbackResult } from './types.js'
export type { ImageTemplate, ImageTemplateImage, ImageRecord, ImageRecordLayer, ImageLayer, LayerRecord, ImportImageOptions, RemovedImage } from './types.js'
export { startMetrics, durationBuckets } from './metrics.js'
export { poolGauges } from './metrics-pool.js'
export { metricsText } from './metrics-text.js'
export type { Metrics, MetricsOptions, MetricsSnapshot, MetricsOperation, OperationFigures, OperationRecord } from './metrics.js'
export type { PoolGauges } from './metrics-pool.js'
export type { MetricsTextOptions } from './metrics-text.js'
export type { CloneKind, CloneMethod } from './types.js'
export { registerPrometheus } from './metrics-prom.js'
export type { PrometheusOptions, PrometheusMetrics, PromClient, PromRegistry, PromMetric, PromCounter, PromGauge, PromMetricConfig, PromCounterClass, PromGaugeClass } from './metrics-prom.js'
export type { TraceContext, AllocateTrace, CloneTrace, DisposeTrace, SweepTrace, LockTrace } from './trace.js'

// The module's own namespace (its exports object, complete by the time the line below runs): the default object is
// its values, so that the list of the API's values stays the export lines above.
import * as self from './index.js'

/**
 * The whole API as one object, for `import vmspace from 'vmspace'`: the same functions and classes as the named
 * exports, from ES modules and from TypeScript's CommonJS output (`require('vmspace').default`) alike.
 */
const vmspace: Omit<typeof self, 'default'> = (({ default: _, ...values }) => values)(self)
export default vmspace

/**
 * vmspace: private per-VM workspace directories for sandbox sidecars (Linux). See README.md.
 */
export { openPool, Pool, Workspace } from './pool.js'
export type {
  PoolOptions,
  AllocateOptions,
  WorkspaceInfo,
  PoolStats,
  SweepOptions,
  SweepReport,
  SweepEntry,
  TemplateSource,
  JsonObject,
  JsonValue,
} from './pool.js'
export { clone, removeTree, renameNoReplace, exchange } from './fs.js'
export type { CloneOptions, CloneResult, CloneProgressEvent, Reflink } from './clone.js'
export { VmspaceError, AbortError } from './errors.js'
export type { VmspaceErrorCode } from './errors.js'
export { lockFile, updateJsonFile, FileLock } from './lock.js'
export type { LockOptions, UpdateJsonOptions } from './lock.js'
export type { Template, TemplateUsage, CommitResult, PruneOptions } from './template.js'

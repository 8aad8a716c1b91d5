/**
 * vmspace: private per-VM workspace directories for sandbox sidecars (Linux). See README.md.
 */
export { openPool, Pool, Workspace } from './pool.js'
export type {
  PoolOptions,
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
  JsonObject,
  JsonValue,
  ListOptions,
  PoolUsage,
} from './pool.js'
export { probeQuota } from './quota.js'
export type { QuotaOptions, QuotaSupport, WorkspaceUsage } from './quota.js'
export { clone } from './clone.js'
export { removeTree } from './remove.js'
export { renameNoReplace, exchange } from './rename.js'
export type { RemoveTreeOptions } from './remove.js'
export type { CloneOptions, CloneResult, CloneProgressEvent, Reflink, Writeback } from './clone.js'
export { VmspaceError, AbortError } from './errors.js'
export type { VmspaceErrorCode, SystemErrorCode } from './errors.js'
export { lockFile, FileLock } from './lock.js'
export type { LockOptions } from './lock.js'
export { updateJsonFile } from './json-file.js'
export type { UpdateJsonOptions } from './json-file.js'
export type { Template, TemplateUsage, CommitResult, PruneOptions } from './template.js'
export type { TraceContext, AllocateTrace, CloneTrace, DisposeTrace, SweepTrace, LockTrace } from './trace.js'

import { AbortError, VmspaceError } from './errors.js'
import { clone } from './clone.js'
import { removeTree } from './remove.js'
import { exchange, renameNoReplace } from './rename.js'
import { FileLock, lockFile } from './lock.js'
import { updateJsonFile } from './json-file.js'
import { openPool, Pool, Workspace } from './pool.js'
import { probeQuota } from './quota.js'

/**
 * The whole API as one object, for `import vmspace from 'vmspace'`: the same functions and classes as the named
 * exports, from ES modules and from TypeScript's CommonJS output (`require('vmspace').default`) alike.
 */
const vmspace = {
  /** {@link openPool} */
  openPool,
  /** {@link Pool} */
  Pool,
  /** {@link Workspace} */
  Workspace,
  /** {@link clone} */
  clone,
  /** {@link removeTree} */
  removeTree,
  /** {@link renameNoReplace} */
  renameNoReplace,
  /** {@link exchange} */
  exchange,
  /** {@link VmspaceError} */
  VmspaceError,
  /** {@link AbortError} */
  AbortError,
  /** {@link lockFile} */
  lockFile,
  /** {@link updateJsonFile} */
  updateJsonFile,
  /** {@link FileLock} */
  FileLock,
  /** {@link probeQuota} */
  probeQuota,
}
export default vmspace

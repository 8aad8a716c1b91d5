/**
 * The ES module entry. It re-exports the CommonJS build, so `import` and `require` share one module instance (one
 * addon load, one set of classes for instanceof). The names are listed, not `export *`, so that the namespace
 * holds the API only (no `__esModule`); test/package.test.ts checks that this list and the CommonJS exports agree.
 * @module
 */
import cjs from './index.js'

export {
  openPool,
  Pool,
  Workspace,
  clone,
  removeTree,
  renameNoReplace,
  exchange,
  VmspaceError,
  AbortError,
  lockFile,
  updateJsonFile,
  FileLock,
  probeQuota,
  startMetrics,
  poolGauges,
  metricsText,
  durationBuckets,
  registerPrometheus,
  unmountImage,
} from './index.js'
export type * from './index.js'

// Node gives an ES module the CommonJS module.exports as its default import; the API object is its `default`.
export default cjs.default

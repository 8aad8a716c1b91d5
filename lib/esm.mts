/**
 * The ES module entry. It re-exports the CommonJS build, so `import` and `require` share one module instance (one
 * addon load, one set of classes for instanceof). The names are listed, not `export *`, so that the namespace
 * holds the API only (no `__esModule`); the default export is the same API as one object (`import vm from 'vmspace'`).
 * test/package.test.ts checks that this list and the CommonJS exports agree.
 * @module
 */
import vmspace from './index.js'

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
} from './index.js'
export type * from './index.js'

const api = {
  openPool: vmspace.openPool,
  Pool: vmspace.Pool,
  Workspace: vmspace.Workspace,
  clone: vmspace.clone,
  removeTree: vmspace.removeTree,
  renameNoReplace: vmspace.renameNoReplace,
  exchange: vmspace.exchange,
  VmspaceError: vmspace.VmspaceError,
  AbortError: vmspace.AbortError,
  lockFile: vmspace.lockFile,
  updateJsonFile: vmspace.updateJsonFile,
  FileLock: vmspace.FileLock,
}
export default api

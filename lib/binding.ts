/** The native addon (native/binding/, one file per capability), loaded once per thread; its functions take checked arguments only. */
import * as path from 'node:path'
import type { CloneResult } from './clone.js'

/** reflink option as the binding takes it. */
export const enum ReflinkCode {
  Always = 0,
  Auto = 1,
  Never = 2,
}

/** A clone's result as the binding returns it: the public CloneResult without `path`, which lib/ adds. */
export type NativeCloneResult = Omit<CloneResult, 'path'>

export type ProgressHandle = { readonly __brand: 'ProgressHandle' }

/** writeback option as the binding takes it. */
export const enum WritebackCode {
  None = 0,
  Start = 1,
  Wait = 2,
}

export type WarmHandle = { readonly __brand: 'WarmHandle' }

export interface NativeListEntry {
  name: string
  live: boolean
  metaText?: string
  metaError?: unknown
  /** The metadata (or its error) is the workspace directory's xattr (format 2), not its file. */
  metaXattr?: boolean
  /** The lease probe's flock failed with an unexpected errno (liveness undecided). */
  probeError?: unknown
}

export interface NativeAllocateResult {
  id: string
  name: string
  leaseFd: number
  retries: number
  clones: (NativeCloneResult & { dest: string })[]
  /** Issue 14: the template cloned (allocate `from`) and its template.json text. */
  templateId?: string
  templateMeta?: string
}

export interface NativeSweepEntry {
  name: string
  from: 'published' | 'staging' | 'trash' | 'template' | 'template-staging'
  bytes: number
  error?: unknown
}

export interface NativeSweepReport {
  reclaimed: NativeSweepEntry[]
  failed: NativeSweepEntry[]
  live: number
  metaRemoved: number
}

export interface NativeQuotaSupport {
  supported: boolean
  backend: 'btrfs-qgroup' | 'project' | 'none'
  inodes: boolean
  detail: string
  /** The errno (positive) behind a refusal. */
  errno?: number
}

export interface NativeUsage {
  allocatedBytes: number
  exclusiveBytes: number
  sharedBytes: number
  logicalBytes: number
  files: number
  dirs: number
  others: number
  quota?: { limitBytes: number; usedBytes: number; limitInodes: number; usedInodes: number }
}

export type WaitHandle = { readonly __brand: 'WaitHandle' }

export type PoolHandle = { readonly __brand: 'PoolHandle' }

export interface Native {
  openPool(
    root: string,
    create: boolean,
    sharedGid: number,
    format: 1 | 2,
    minFreeBytes: number,
    projectIdFirst: number,
    projectIdLast: number,
  ): Promise<{ handle: PoolHandle; bootId: string; format: 1 | 2 }>
  closePool(handle: PoolHandle): Promise<void>
  allocate(
    handle: PoolHandle,
    prefix: string,
    mode: number,
    templateDir: string,
    entries: [dest: string, source: string][],
    infoJson: string,
    reflink: ReflinkCode,
    overwrite: boolean,
    durable: boolean,
    progress: ProgressHandle | undefined,
    writeback?: WritebackCode,
    quotaBytes?: number,
    quotaInodes?: number,
    fromTemplate?: string,
  ): Promise<NativeAllocateResult>
  /** A staged, leased workspace built from allocate's arguments (infoJson unused), its copies written back. */
  warmBuild(
    handle: PoolHandle,
    prefix: string,
    mode: number,
    templateDir: string,
    entries: [dest: string, source: string][],
    infoJson: string,
    reflink: ReflinkCode,
    overwrite: boolean,
    durable: boolean,
    progress: ProgressHandle | undefined,
  ): Promise<WarmHandle>
  /** Publishes a warm entry; null when its template changed since it was built (the entry is then removed). */
  warmTake(handle: PoolHandle, entry: WarmHandle, infoJson: string): Promise<NativeAllocateResult | null>
  warmDiscard(handle: PoolHandle, entry: WarmHandle): Promise<void>
  // Issue 14 (native/core/template.h)
  commitTemplate(
    handle: PoolHandle,
    sourcePath: string,
    name: string,
    infoJson: string,
    replace: boolean,
    reflink: ReflinkCode,
    durable: boolean,
    progress: ProgressHandle | undefined,
  ): Promise<{ id: string; metaText: string; clone: NativeCloneResult; allocatedBytes: number; replacedId?: string; replacedRemoved?: boolean }>
  listTemplates(handle: PoolHandle): Promise<import('./template.js').NativeTemplateListing[]>
  removeTemplate(handle: PoolHandle, idOrName: string): Promise<{ id: string; removed: boolean }>
  dispose(handle: PoolHandle, name: string, leaseFd: number): Promise<void>
  list(handle: PoolHandle): Promise<NativeListEntry[]>
  adopt(handle: PoolHandle, name: string): Promise<{ leaseFd: number; metaText?: string; metaError?: unknown; metaXattr?: boolean }>
  sweep(handle: PoolHandle, dryRun: boolean, graceMs: number): Promise<NativeSweepReport>
  clonePath(
    src: string,
    dst: string,
    reflink: ReflinkCode,
    overwrite: boolean,
    durable: boolean,
    progress: ProgressHandle | undefined,
    writeback?: WritebackCode,
  ): Promise<NativeCloneResult>
  clonePathBeneath(
    baseFd: number,
    basePath: string,
    src: string,
    rel: string,
    reflink: ReflinkCode,
    overwrite: boolean,
    durable: boolean,
    progress: ProgressHandle | undefined,
    writeback?: WritebackCode,
  ): Promise<NativeCloneResult>
  probeQuota(path: string): Promise<NativeQuotaSupport>
  poolSpace(handle: PoolHandle): Promise<{ availableBytes: number; freeBytes: number; totalBytes: number; quota: NativeQuotaSupport }>
  usage(handle: PoolHandle, name: string, progress: ProgressHandle | undefined): Promise<NativeUsage>
  newProgress(): ProgressHandle
  readProgress(p: ProgressHandle): [files: number, bytes: number]
  cancelProgress(p: ProgressHandle): void
  removeTree(path: string): Promise<void>
  renameNoReplace(from: string, to: string): Promise<void>
  exchange(a: string, b: string): Promise<void>
  releaseLease(fd: number): Promise<void>
  lockOpen(path: string, shared: boolean): Promise<{ fd: number; acquired: boolean }>
  /** done gets the fd the wait ends with (a new one when the file at `path` was replaced meanwhile): the caller's to release. */
  lockWait(fd: number, path: string, shared: boolean, done: (errno: number, fd: number, syscall: string) => void): WaitHandle
  lockCancel(handle: WaitHandle): void
  lockRelease(fd: number): Promise<void>
  readIndex(path: string): Promise<Buffer | undefined>
  writeIndex(path: string, text: string, durable: boolean): Promise<void>
  setTestIds(ids: string[]): void
  /** Test seam: the next sweep entry of each name fails with std::bad_alloc (0) or its flock probe with that errno. */
  setSweepFaultsForTest(faults: [name: string, flockErrno: number][]): void
}

// lib/ and dist/ are both one level below the package root, where binding.gyp and build/ live.
// node-gyp-build picks build/Release (or a prebuild) for this platform and Node-API version.
export const native: Native = (require('node-gyp-build') as (dir: string) => Native)(path.join(__dirname, '..'))

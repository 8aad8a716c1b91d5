/** The native addon (native/binding/, one file per capability), loaded once per thread; its functions take checked arguments only. */
import * as path from 'node:path'
import type { CloneResult, Reflink, SweepSource, TemplateCacheUse, Writeback, WorkspaceUsage } from './types.js'

/** A clone's result as the binding returns it: the public CloneResult without `path`, which lib/ adds. */
export type NativeCloneResult = Omit<CloneResult, 'path'>

/**
 * A clone's summary as clonePathBeneath resolves it: kind, method, files, bytes, reflinked, copied (and for a file
 * the template cache served, its `cache`), and for a tree dirs, symlinks, hardlinks, fifos, devices, skipped
 * sockets, skipped devices (native/binding/clone.cc summaryArray).
 */
export type NativeCloneArray = [kind: CloneResult['kind'], method: CloneResult['method'], ...rest: (number | TemplateCacheUse)[]]

export type ProgressHandle = { readonly __brand: 'ProgressHandle' }

export type WarmHandle = { readonly __brand: 'WarmHandle' }

export interface NativeListEntry {
  name: string
  live: boolean
  record?: string
  recordError?: unknown
  /** The lease probe failed (liveness undecided). */
  probeError?: unknown
}

/** allocatePlain's result: the workspace's name, its lease fd, the names redrawn. */
export type PlainAllocateResult = [name: string, leaseFd: number, retries: number]

export interface NativeAllocateResult {
  id: string
  name: string
  leaseFd: number
  retries: number
  clones: (NativeCloneResult & { dest: string })[]
  /** The template cloned (allocate `from`) and its template.json text. */
  templateId?: string
  templateRecord?: string
}

/** One template of native listTemplates(): its directory's state and its template.json text (or why not). */
export interface NativeTemplateListing {
  id: string
  currentName: string
  lastUsedMs: number
  retired: boolean
  recordPath: string
  record?: string
  recordError?: unknown
}

export interface NativeSweepEntry {
  name: string
  from: SweepSource
  bytes: number
  error?: unknown
}

export interface NativeSweepReport {
  reclaimed: NativeSweepEntry[]
  failed: NativeSweepEntry[]
  live: number
  leasesRemoved: number
  /** Paths of entries named like workspaces that have no lease file: not vmspace's, left alone. */
  foreign: string[]
}

export interface NativeQuotaSupport {
  supported: boolean
  backend: 'btrfs-qgroup' | 'project' | 'none'
  inodes: boolean
  detail: string
  /** The errno (positive) behind a refusal. */
  errno?: number
}

/** A workspace's usage as the binding returns it: the public WorkspaceUsage, field for field. */
export type NativeUsage = WorkspaceUsage

export type WaitHandle = { readonly __brand: 'WaitHandle' }

export type PoolHandle = { readonly __brand: 'PoolHandle' }

/**
 * A metadata record's members in order as JSON text, `"key":value,...` without the braces (each key and value
 * serialised by JSON.stringify): one string for the binding to read, to which the core appends the members only it
 * knows before it writes the object once (native/core/json_members.h).
 */
export type JsonMembers = string

/** `record`'s members (JSON.stringify of each value; undefined values left out), then `extra` (JSON text) as given. */
export function jsonMembers(record: Record<string, unknown>, ...extra: [key: string, json: string][]): JsonMembers {
  let text = ''
  for (const key in record) {
    const value = record[key]
    if (value !== undefined) text += (text ? ',' : '') + JSON.stringify(key) + ':' + JSON.stringify(value)
  }
  for (const [key, json] of extra) text += (text ? ',' : '') + JSON.stringify(key) + ':' + json
  return text
}

// Every native call that takes more than a handle and one value takes one options object, read by name in C++
// (native/binding/common.h, Options): a wrong type is a TypeError naming the key. Enums travel as their names.

/** A clone's options, as clonePath, clonePathBeneath, allocate, warmBuild and commitTemplate read them. */
export interface NativeCloneOptions {
  /** Default 'auto'. */
  reflink?: Reflink
  /** Replace an existing destination (clonePath, clonePathBeneath, cloneOutBeneath only). Default false. */
  overwrite?: boolean
  /** fsync the copies and their directories before resolving. Default false. */
  durable?: boolean
  /** Default 'none'. */
  writeback?: Writeback
  /** A tree's device nodes are made (allocate, commitTemplate). Default true. */
  keepDevices?: boolean
  /** A tree's set-id bits (not a directory's) and security.capability are kept (allocate, commitTemplate). Default true. */
  keepSetId?: boolean
  /** Progress counters and cancel flag (newProgress). */
  progress?: ProgressHandle
}

export interface OpenPoolOptions {
  root: string
  create: boolean
  /** The group of a shared pool; -1 or absent: none. */
  sharedGid?: number
  /** Make a pool in a directory that holds other entries (else ERR_POOL_NOT_EMPTY). */
  nonEmpty: boolean
  minFreeBytes?: number
  projectIdFirst: number
  projectIdLast: number
  /** Clone single-file sources of another file system through .vmspace/cache/ (default true). */
  templateCache?: boolean
  /** What a sweep keeps of the cache, in allocated bytes. */
  templateCacheBytes?: number
}

/** A workspace's shape: what a warm entry is built from and allocate matches it against. */
export interface WorkspaceShape extends Pick<NativeCloneOptions, 'reflink' | 'durable'> {
  prefix: string
  mode: number
  /** The template directory ('' for none) and its [dest, source] entries. */
  templateDir: string
  entries: [dest: string, source: string][]
}

export interface AllocateNativeOptions extends WorkspaceShape, Pick<NativeCloneOptions, 'writeback' | 'progress' | 'keepDevices' | 'keepSetId'> {
  /** The caller's members of the metadata record; the core adds its own (name, template) and serialises it. */
  info: JsonMembers
  /** 0 or absent: none. */
  quotaBytes?: number
  quotaInodes?: number
  /** The template (id or name) to clone the workspace from. */
  fromTemplate?: string
}

export interface CommitTemplateOptions extends Pick<NativeCloneOptions, 'reflink' | 'durable' | 'progress' | 'keepDevices' | 'keepSetId'> {
  sourcePath: string
  name: string
  /** The caller's members of template.json; the core adds id, name, method and usage. */
  info: JsonMembers
  replace: boolean
  /** The paths of the shared files (native/core/share.h), checked by lib/; none when absent. */
  share?: string[]
  /** The workspace's template id, or '': the shared files it still holds of it stay shared. */
  parent?: string
}

/** An opaque handle of a template being built in .vmspace/templates/staging/<id>/ (its staging entry leased). */
export type BuildHandle = { readonly __brand: 'BuildHandle' }

export interface TemplateBuildStartOptions extends Pick<NativeCloneOptions, 'reflink' | 'durable' | 'progress'> {
  /** The id or name of the template whose tree is cloned first (its write bits given back), or '' for an empty tree. */
  parent: string
}

export interface TemplateBuildPublishOptions {
  /** The caller's members of template.json; the core adds id, name, method and usage. */
  info: JsonMembers
  /** A layer's chain key, `<algo>-<hex>` ('sha256-abc…'): layers/<layerKey> is claimed. Not with `name`. */
  layerKey?: string
  name?: string
  replace?: boolean
}

export interface LayerApplyResult {
  /** Tar entries applied, whiteouts included (PAX and GNU long-name headers not). */
  entries: number
  /** Bytes of the tar stream read. */
  bytes: number
  /** `.wh.` entries and opaque markers applied. */
  whiteouts: number
}

export interface ClonePathOptions extends NativeCloneOptions {
  src: string
  dst: string
}

/** The core's names of the pool's entries that lib/ builds paths from (native/binding/layout.cc, native/core/layout.h). */
export interface NativeLayout {
  stateDir: string
  staging: string
  trash: string
  templates: string
  names: string
  tree: string
  templateMeta: string
}

export interface Native {
  openPool(options: OpenPoolOptions): Promise<{ handle: PoolHandle; bootId: string }>
  closePool(handle: PoolHandle): Promise<void>
  allocate(handle: PoolHandle, options: AllocateNativeOptions): Promise<NativeAllocateResult>
  /**
   * allocate() of an empty workspace (no template, quota, progress or writeback), positional both ways: no options
   * object to read and no result object to fill, the largest share of the binding's time per call.
   */
  allocatePlain(handle: PoolHandle, prefix: string, mode: number, info: JsonMembers, durable: boolean): Promise<PlainAllocateResult>
  /** A staged, leased workspace of that shape, its copies written back. */
  warmBuild(handle: PoolHandle, shape: WorkspaceShape): Promise<WarmHandle>
  /** Publishes a warm entry; null when its template changed since it was built (the entry is then removed). */
  warmTake(handle: PoolHandle, entry: WarmHandle, info: JsonMembers): Promise<NativeAllocateResult | null>
  warmDiscard(handle: PoolHandle, entry: WarmHandle): Promise<void>
  // Templates (native/core/template.h)
  commitTemplate(
    handle: PoolHandle,
    options: CommitTemplateOptions,
  ): Promise<{ id: string; record: string; clone: NativeCloneResult; allocatedBytes: number; replacedId?: string; replacedRemoved?: boolean }>
  // Template builds and image layers (native/core/template_build.h, native/core/layer_apply.h)
  /**
   * Starts a build: staging/<id>/tree/ is a clone of template `parent`'s tree (its write bits given back), or an
   * empty directory when parent is ''. The parent is held for reading while it is cloned. Rejects with
   * ERR_TEMPLATE_NOT_FOUND (nothing made) or the first errno. The handle's finalizer abandons a build left open.
   */
  templateBuildStart(handle: PoolHandle, options: TemplateBuildStartOptions): Promise<{ build: BuildHandle; id: string; treePath: string }>
  /**
   * Applies one uncompressed tar stream read from `fd` (to its EOF; the call closes `fd`, success or not) to the
   * build's tree per the OCI image spec's layer rules. Rejects with ERR_LAYER_UNSAFE / ERR_LAYER_INVALID /
   * ERR_OCI_NOT_PERMITTED (the message names the entry, `path` is the entry's name), ECANCELED (the progress
   * handle cancelled), EBUSY (another call uses the build), EBADF (published or abandoned), or a system error; the
   * build is then left to templateBuildAbandon. It reads the pipe on a libuv pool thread: write the other end
   * through a stream that does not need one (net.Socket), not fs.write.
   */
  layerApply(build: BuildHandle, fd: number, options: { progress?: ProgressHandle; durable?: boolean }): Promise<LayerApplyResult>
  /**
   * Removes write bits (as commit), writes template.json (`info` + id, name, method, usage) and publishes. With
   * `layerKey`, when another build's live template holds layers/<layerKey>, this build is removed and that id is
   * returned with `existing: true`. `name`/`replace` as commitTemplate. Any failure removes the build.
   */
  templateBuildPublish(
    build: BuildHandle,
    options: TemplateBuildPublishOptions,
  ): Promise<{ id: string; existing: boolean; record: string; allocatedBytes: number; replacedId?: string; replacedRemoved?: boolean }>
  /** Removes the build's staging entry (idempotent, never rejects); waits for a layerApply on it to end. */
  templateBuildAbandon(build: BuildHandle): Promise<void>
  /** The live layer template of chain key `layerKey` (`<algo>-<hex>`), or null. */
  findLayer(handle: PoolHandle, layerKey: string): Promise<string | null>
  /** pipe2(O_CLOEXEC): [readFd, writeFd] (synchronous; throws the errno). */
  pipe(): [readFd: number, writeFd: number]
  listTemplates(handle: PoolHandle): Promise<NativeTemplateListing[]>
  /** The id the link templates/names/<name> holds now; null when there is none (or the pool has no templates yet). */
  templateNameTarget(handle: PoolHandle, name: string): Promise<string | null>
  /** The names of the pool's on-disk entries (native/core/layout.h); lib/layout.ts builds paths from them. */
  readonly layout: NativeLayout
  /** The lease file of workspace `name` of the pool at `root` (synchronous, no syscall). */
  leasePath(root: string, name: string): string
  /** The lease shard directory holding the lease file of `name` (an id or a workspace name; synchronous). */
  leaseShardPath(root: string, name: string): string
  removeTemplate(handle: PoolHandle, idOrName: string, unlessCurrent?: boolean): Promise<{ id: string; removed: boolean; kept: boolean; bytes: number }>
  /**
   * Closes `handoverFd` (-1: none), then removes the workspace unless another description holds its lease
   * (ERR_LEASE_HELD, nothing removed); closes `leaseFd` either way. `claim` (DisposeHints in native/core/pool.h; true
   * = unknown): false when it was made without a quota (.vmspace/projects/ is not probed).
   */
  dispose(handle: PoolHandle, name: string, leaseFd: number, handoverFd: number, claim: boolean): Promise<void>
  /** A new read-only fd of the workspace's lease file, holding the handover byte (synchronous). */
  openHandover(handle: PoolHandle, name: string, leaseFd: number): number
  /** Whether another open file description holds the lease `leaseFd` holds (synchronous: one F_OFD_GETLK). */
  leaseHandedOver(handle: PoolHandle, name: string, leaseFd: number): boolean
  list(handle: PoolHandle): Promise<NativeListEntry[]>
  adopt(handle: PoolHandle, name: string): Promise<{ leaseFd: number; record?: string; recordError?: unknown }>
  sweep(handle: PoolHandle, options: { dryRun: boolean; graceMs: number }): Promise<NativeSweepReport>
  clonePath(options: ClonePathOptions): Promise<NativeCloneResult>
  /**
   * Positional: `rel` is resolved beneath the published workspace `name` of the pool (its directory opened by the
   * call), path `basePath`; `reflink` and `writeback` are their index in reflinkValues and writebackValues.
   */
  clonePathBeneath(
    handle: PoolHandle,
    name: string,
    basePath: string,
    src: string,
    rel: string,
    reflink: number,
    overwrite: boolean,
    durable: boolean,
    writeback: number,
    progress: ProgressHandle | undefined,
  ): Promise<NativeCloneArray>
  /** `rel` resolved beneath the published workspace `name` (path `basePath`), cloned out to the absolute `dst`. */
  cloneOutBeneath(handle: PoolHandle, options: NativeCloneOptions & { name: string; basePath: string; rel: string; dst: string }): Promise<NativeCloneResult>
  probeQuota(path: string): Promise<NativeQuotaSupport>
  /** 0 or the errno of BTRFS_IOC_QUOTA_CTL (simple quotas when `simple`); rejects with the errno of open. */
  enableBtrfsQuota(path: string, simple: boolean): Promise<number>
  poolSpace(handle: PoolHandle): Promise<{ availableBytes: number; freeBytes: number; totalBytes: number; quota: NativeQuotaSupport }>
  usage(handle: PoolHandle, name: string, progress: ProgressHandle | undefined): Promise<NativeUsage>
  newProgress(): ProgressHandle
  readProgress(p: ProgressHandle): [files: number, bytes: number]
  cancelProgress(p: ProgressHandle): void
  removeTree(path: string): Promise<void>
  renameNoReplace(from: string, to: string): Promise<void>
  exchange(a: string, b: string): Promise<void>
  releaseLease(fd: number): Promise<void>
  // Checkpoints (native/core/rollback.h)
  /**
   * Puts workspace `name`'s tree back to template `checkpoint`'s (built as allocate({ from }), swapped in by
   * RENAME_EXCHANGE); `leaseFd` is the caller's hold of its lease, kept. ERR_LEASE_HELD (nothing changed) while
   * another description holds the lease. `removed` false: the old tree was left in trash for a sweep.
   */
  rollback(handle: PoolHandle, options: { name: string; leaseFd: number; checkpoint: string; durable: boolean; progress?: ProgressHandle }): Promise<{ removed: boolean; bytes: number }>
  /** The bytes of each template's tree no other file shares (FIEMAP); -1 for one that no longer exists. */
  templateExclusiveBytes(handle: PoolHandle, ids: string[], progress?: ProgressHandle): Promise<number[]>
  /** Drops the batched allocate/dispose calls not run yet; the pool threads stop after their current call. */
  stopBatch(): void
  /** `create`: make a missing file (else ENOENT); `owner`: the requesting thread, threadId + 1 (native/core/lock.h, lockClaim). */
  lockOpen(options: { path: string; shared: boolean; create: boolean; owner: number }): Promise<{ fd: number; acquired: boolean }>
  /** done gets the fd the wait ends with (a new one when the file at `path` was replaced meanwhile): the caller's to release. */
  lockWait(options: { fd: number; path: string; shared: boolean }, done: (errno: number, fd: number, syscall: string) => void): WaitHandle
  lockCancel(handle: WaitHandle): void
  lockRelease(fd: number): Promise<void>
  /** The bytes of the data file locked on `fd` (`path` names it in errors). */
  readLockedJsonFile(fd: number, path: string): Promise<Buffer>
  /** Replaces the file at `path`, locked on `fd`, by one holding `text`: false when `path` names another file now (nothing written). */
  replaceJsonFile(options: { path: string; fd: number; text: string; durable: boolean }): Promise<boolean>
  /** Publishes `text` at `path`, where no file is: false when one appeared meanwhile (nothing written). */
  createJsonFile(options: { path: string; text: string; durable: boolean }): Promise<boolean>
}

/** Test seams, in test builds only (VMSPACE_TEST_HOOKS; test/native-hooks.ts loads them). */
export interface NativeTestHooks {
  setTestIds(ids: string[]): void
  /** The next sweep entry of each name fails with std::bad_alloc (0) or its flock probe with that errno. */
  setSweepFaultsForTest(faults: ([name: string, probeErrno: number] | [name: string, probeErrno: number, probeStep: 'flock' | 'fcntl(F_OFD_GETLK)'])[]): void
}

/** The C library this process runs on, as node-gyp-build tells prebuilds apart: `glibc 2.36`, or `musl`. */
function libcName(): string {
  const report = process.report?.getReport() as { header?: { glibcVersionRuntime?: string } } | undefined
  const glibc = report?.header?.glibcVersionRuntime
  return glibc ? `glibc ${glibc}` : 'musl (or another non-glibc libc)'
}

/**
 * The error for a process where no addon loads: node-gyp-build's own ("No native build was found for …") names
 * neither the package nor a way out, and a prebuild that fails to load (a glibc older than its floor) says even less.
 */
export function noBinaryError(cause: unknown): Error {
  const reason = cause instanceof Error ? cause.message.split('\n')[0] : String(cause)
  const platform = `${process.platform}-${process.arch}, ${libcName()}, Node ${process.versions.node}`
  const error = new Error(
    `vmspace: no native binary could be loaded on this machine (${platform}).\n` +
      `  Reason: ${reason}\n` +
      '  Two ways out:\n' +
      '  - build it from source: install a C++17 compiler, make and python3 (Debian/Ubuntu: apt-get install g++ make\n' +
      '    python3; Alpine: apk add build-base python3 linux-headers), then run `npm rebuild vmspace`;\n' +
      '  - or run where a prebuilt binary ships: linux-x64 or linux-arm64 with glibc >= 2.28.',
    { cause },
  )
  return Object.assign(error, { code: 'ERR_VMSPACE_NO_BINARY' })
}

function loadNative(): Native {
  try {
    // lib/ and dist/ are both one level below the package root, where binding.gyp and build/ live.
    // node-gyp-build picks build/Release (or a prebuild) for this platform and Node-API version.
    return (require('node-gyp-build') as (dir: string) => Native)(path.join(__dirname, '..'))
  } catch (cause) {
    throw noBinaryError(cause)
  }
}

export const native: Native = loadNative()

// On process.exit() (or a worker thread's), allocate/dispose calls still queued would otherwise be run to the end
// before the exit completes (libuv drains its requests): they are dropped instead, and what a call cut short leaves
// is an orphan for a sweep, as after a crash.
process.once('exit', () => native.stopBatch())

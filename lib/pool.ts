/**
 * Pools (DESIGN.md, "The pool on disk"): openPool and its options, and the Pool class: allocate, list, adopt,
 * sweep, usage, stats, close, and the pool's side of templates (their logic is in lib/template.ts) and of the warm
 * reserve (lib/warm.ts). One native call per operation: an allocate's whole sequence (lease file, mkdir, clones,
 * record, publish) runs in one hop on the libuv pool. Elsewhere: the Workspace class (lib/workspace.ts), the
 * workspace's metadata record (lib/metadata.ts), the public data shapes (lib/types.ts).
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { native, type JsonMembers, type PoolHandle } from './binding.js'
import {
  abortSignal,
  absolutePath,
  boolean,
  ID,
  integerIn,
  invalidType,
  invalidValue,
  oneOf,
  optionsObject,
  relativePath,
} from './args.js'
import { AbortError, call, errnoError, fromNative, renamedPaths, vmspaceError, type VmspaceError } from './errors.js'
import { reflinkValues, toResult, withProgress, writebackValues } from './clone.js'
import type { NativeAllocateResult, NativeCloneResult } from './binding.js'
import { projectIdRange, quotaLimits, toQuotaSupport, toUsage } from './quota.js'
import { WarmReserve } from './warm.js'
import {
  checkpointOptions,
  checkpointRecord,
  checkpointsOf,
  retentionVictims,
  rollbackTarget,
  sweptCheckpoints,
  withExclusiveBytes,
  workspaceIdArg,
} from './checkpoint.js'
import { constructing, InFlight, unknownHints, type DisposeHints } from './internal.js'
import { newWorkspace, rollbackSignal, workspaceMode, Workspace } from './workspace.js'
import { metaText, ownerMembers, readRecord, recordMembers, workspaceId } from './metadata.js'
import { imageOptions, markedImage, withImage } from './image.js'
import { leasePath, STAGING_SHARD, stagingPath, STATE_DIR, templateMetaPath } from './layout.js'
import { importImage, importOptions, listImages, removeImage, type ImportHost } from './image-import.js'
import {
  commitOptions,
  commitResult,
  findTemplate,
  forkFrom,
  listTemplates,
  parseTemplateMeta,
  pruneTemplates,
  readySource,
  templateRecordMembers,
  templateRef,
} from './template.js'
import type {
  AllocateOptions,
  Checkpoint,
  CommitOptions,
  ForkOptions,
  CheckpointOptions,
  CheckpointRecord,
  CommitResult,
  RollbackResult,
  ImageTemplate,
  RemovedImage,
  ImportImageOptions,
  ListOptions,
  PoolOptions,
  PoolStats,
  PoolUsage,
  PruneOptions,
  Reflink,
  SweepEntry,
  SweepFailure,
  SweepOptions,
  SweepReport,
  Template,
  TemplateCacheOptions,
  WarmOptions,
  WarmStats,
  WorkspaceInfo,
  WorkspaceUsage,
  Writeback,
} from './types.js'
import { allocateChannel, allocateResult, sweepChannel, sweepResult, traced, type AllocateTrace } from './trace.js'

const PREFIX = /^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$/
// The constructor of Pool, which its type declares private.
const newPool = (...args: PoolArgs) => new (Pool as unknown as new (...a: PoolArgs) => Pool)(...args)
type PoolArgs = [token: symbol, handle: PoolHandle, root: string, prefix: string, reflink: Reflink, durable: boolean, bootId: string]

/**
 * Opens the pool at `root` (resolved against the cwd), making it when `create` is true (the default): missing
 * directories are made with exact modes whatever the umask, 0o755 for the root, `.vmspace/` and missing parents,
 * 0o700 for `.vmspace/{staging,trash,leases}`, the staging shards `.vmspace/staging/s0` … `s7` and the lease shards
 * `.vmspace/leases/0` … `f` (0o2770 with group `sharedGroup` for the root and `.vmspace/...`).
 * Throws the errno of the failing call (`ENOENT` for a missing pool with `create: false`), `ERR_POOL_UNSAFE`
 * (nothing made; `path`, `uid`, `gid`, `mode` name the entry) when another user could write a directory of the
 * pool or above it or owns a symlink on the way (see {@link PoolOptions.sharedGroup}), `ERR_POOL_NOT_EMPTY` (see
 * {@link PoolOptions.nonEmpty}), `ERR_POOL_FORMAT` when `.vmspace/` is not this layout (another version, or its
 * version file or one of its directories missing: such a pool is refused untouched, never made again),
 * `EXDEV` when `.vmspace/` is on another file system than the root, `ERR_POOL_NESTED` (nothing made) when `root`
 * lies inside another pool (its workspace, `.vmspace/` or trash), `ERR_IMAGE_NOT_MOUNTED` (nothing made) when
 * `root` is the mount point of an image-backed pool whose image is not mounted and `image` is not given.
 * On a file system without renameat2(RENAME_NOREPLACE) (FUSE, some network file systems; asked once, here) the
 * pool opens, and its allocate() fails with `ERR_RENAME_NOREPLACE_UNSUPPORTED`.
 */
export async function openPool(root: string, options?: PoolOptions): Promise<Pool> {
  const dir = absolutePath('root', root)
  const o = optionsObject<PoolOptions>('options', options, {
    create: true, nonEmpty: true, prefix: true, reflink: true, durable: true, sharedGroup: true, warm: true,
    minFreeBytes: true, projectIds: true, image: true, templateCache: true,
  })
  const create = boolean('options.create', o.create, true)
  const nonEmpty = boolean('options.nonEmpty', o.nonEmpty, false)
  const prefix = o.prefix === undefined ? 'vm' : o.prefix
  if (typeof prefix !== 'string') throw invalidType('options.prefix', 'a string', prefix)
  if (!PREFIX.test(prefix)) throw invalidValue('options.prefix', '1-64 characters of [A-Za-z0-9_-]', prefix)
  const reflink = oneOf('options.reflink', o.reflink, reflinkValues, 'auto')
  const durable = boolean('options.durable', o.durable, false)
  const sharedGroup = integerIn('options.sharedGroup', o.sharedGroup, 0, 2 ** 32 - 2, -1)
  const warm = warmOptions(o.warm)
  const minFreeBytes = integerIn('options.minFreeBytes', o.minFreeBytes, 0, Number.MAX_SAFE_INTEGER, 0)
  const [projectFirst, projectLast] = projectIdRange(o.projectIds)
  const image = imageOptions(o.image)
  const cache = templateCacheOptions(o.templateCache)
  const open = async () => {
    const r = await call(native.openPool({ root: dir, create, nonEmpty, sharedGid: sharedGroup, minFreeBytes, projectIdFirst: projectFirst, projectIdLast: projectLast, ...cache }))
    const pool = newPool(constructing, r.handle, dir, prefix, reflink, durable, r.bootId)
    if (warm) {
      try {
        pool._startWarm(warm.dir, warm.entries, warm.mode, warm.count)
      } catch (e) {
        await pool.close()
        throw e
      }
    }
    return pool
  }
  if (image) return withImage(dir, image, create, open)
  refuseUnmountedImage(dir)
  return open()
}

/**
 * An image-backed pool's mount point while its image is not mounted holds only the marker the mount hides: a pool
 * opened there, or in a directory below it, without `image` would be made on the host's file system (and the next
 * mount refused). `dir` and each of its existing parents are looked at (a mounted image hides its marker).
 */
function refuseUnmountedImage(dir: string): void {
  for (let d = dir; ; d = path.dirname(d)) {
    const image = markedImage(d)
    if (image !== undefined)
      throw vmspaceError('ERR_IMAGE_NOT_MOUNTED', `${d} is the mount point of the image ${image}, which is not mounted: open the pool with { image } or run vmspace mount`, { path: dir })
    if (d === path.dirname(d)) return
  }
}

/** The default size budget of a pool's template cache: 8 GiB (native/core/template_cache.h, kDefaultCacheBytes). */
const TEMPLATE_CACHE_BYTES = 8 * 2 ** 30

function templateCacheOptions(value: unknown): { templateCache: boolean; templateCacheBytes: number } {
  if (value === false) return { templateCache: false, templateCacheBytes: TEMPLATE_CACHE_BYTES }
  if (value !== undefined && (typeof value !== 'object' || value === null)) throw invalidType('options.templateCache', 'false or an object', value)
  const c = optionsObject<TemplateCacheOptions>('options.templateCache', value, { maxBytes: true })
  const maxBytes = integerIn('options.templateCache.maxBytes', c.maxBytes, 0, Number.MAX_SAFE_INTEGER, TEMPLATE_CACHE_BYTES)
  return { templateCache: true, templateCacheBytes: maxBytes }
}

function warmOptions(value: unknown) {
  if (value === undefined) return undefined
  const w = optionsObject<WarmOptions>('options.warm', value, { template: true, count: true, mode: true })
  if (w.template === undefined) throw invalidType('options.warm.template', 'a directory path or a plain object mapping workspace paths to sources', undefined)
  if (w.count === undefined) throw invalidType('options.warm.count', 'an integer', undefined)
  const { dir, entries } = templateEntries(w.template, 'options.warm.template')
  if (!dir && entries.length === 0) throw invalidValue('options.warm.template', 'at least one template entry', w.template)
  const count = integerIn('options.warm.count', w.count, 1, 64, 1)
  const mode = workspaceMode('options.warm.mode', w.mode)
  return { dir, entries, count, mode }
}

/** Whether `p` (symlinks resolved already) is a regular file now. */
function isRegularFile(p: string): boolean {
  try {
    return fs.lstatSync(p).isFile()
  } catch {
    return false
  }
}

// A workspace's name in a pool root, of any prefix (PREFIX, then a 128-bit id in hex).
const WORKSPACE_NAME = /^[A-Za-z0-9_-]{1,64}-[0-9a-f]{32}$/

// Any name Pool.list() can report (the core's isWorkspaceName): an entry of the root, not hidden, ending in
// -<32 hex>, whatever its prefix (a foreign or hand-made entry with a lease file is listed too).
const LISTED_NAME = /^[^./\0][^/\0]*-[0-9a-f]{32}$/
const NAME_MAX = 255

/** An open pool: a root directory of workspaces with `.vmspace/` beside them. Made by {@link openPool}. */
export class Pool implements AsyncDisposable {
  /** Absolute path of the pool's root directory. */
  readonly root: string
  /** Workspace names are `${prefix}-${id}` ({@link PoolOptions.prefix}). */
  readonly prefix: string
  readonly #handle: PoolHandle
  readonly #reflink: Reflink
  readonly #durable: boolean
  readonly #bootId: string
  readonly #rootSlash: string
  #realRoot: string | undefined
  #owner: string | undefined

  /** The metadata record's pid, hostname and bootId members as JSON text (each read once per process). */
  #ownerMembers(): string {
    this.#owner ??= ownerMembers(this.#bootId)
    return this.#owner
  }
  readonly #inFlight = new InFlight()
  #warm: WarmReserve | undefined
  #closed = false
  #handleClosed = false
  #open = 0 // workspaces of this pool not yet disposed
  readonly #stats: PoolStats = { allocated: 0, disposed: 0, failed: 0, nameRetries: 0, clones: { reflink: 0, copy: 0 }, bytesCloned: 0 }

  // Private in the published types (pools come from openPool()); lib/ makes pools through newPool.
  private constructor(...[token, handle, root, prefix, reflink, durable, bootId]: PoolArgs) {
    if (token !== constructing) throw new TypeError('Use openPool() to open a pool')
    this.#handle = handle
    this.root = root
    this.#rootSlash = root.endsWith('/') ? root : root + '/' // path.resolve's output: '/' is the only one with it
    this.prefix = prefix
    this.#reflink = reflink
    this.#durable = durable
    this.#bootId = bootId
  }

  /**
   * Makes a new workspace `<root>/<prefix>-<id>` (`id`: 128 random bits, 32 hex digits). First its lease file,
   * the exclusive claim on the name: made unnamed, locked, given the record (`meta` and vmspace's own members),
   * then linked under the name in the pool's lease directory (a name already taken: another is drawn). Then the
   * directory: for an empty workspace (no `template`, `from` or `quota`) one exclusive mkdir in the root, and done;
   * otherwise it is built in a staging directory (mkdir or a btrfs subvolume or snapshot, quota, clones) and
   * published into the root with renameat2(RENAME_NOREPLACE). Nothing is visible in the root until all of it is
   * done; any failure removes all of it, the lease file last (DESIGN.md, "Leases").
   * Throws the errno of the failing call (e.g. `ENOENT` for a missing template source, `ENOSPC`),
   * `ERR_REFLINK_UNSUPPORTED`, `ERR_NAME_EXHAUSTED`, `ERR_POOL_CLOSED`, `ERR_RENAME_NOREPLACE_UNSUPPORTED` (the pool's
   * file system refuses renameat2(RENAME_NOREPLACE), as openPool found; nothing made), or an AbortError.
   */
  allocate(options?: AllocateOptions): Promise<Workspace> {
    return traced(allocateChannel, () => ({ root: this.root, prefix: this.prefix }), (t) => this.#allocate(options, t))
  }

  async #allocate(options: AllocateOptions | undefined, t: AllocateTrace | undefined): Promise<Workspace> {
    const req = this.#allocateRequest(options)
    this.#assertOpen()
    // Counted as open from the start, so that a close() meanwhile keeps the pool's fds for it.
    this.#open++
    let r: NativeAllocateResult
    try {
      r = await this.#build(req)
    } catch (e) {
      this.#stats.failed++
      await this._forget()
      throw this.#allocateError(e, req.dir)
    }
    return this.#published(r, req.signal, t, req.quotaBytes > 0 || req.quotaInodes > 0)
  }

  /**
   * A failed build as the caller reads it: a directory template (a string) that is not a directory is a bad
   * argument, not ENOTDIR; a path in the staging entry the workspace was built in is named at the workspace's path
   * (`<root>/<name>`), where its files were going: the staging entry is internal, and gone already.
   */
  #allocateError(e: unknown, dir: string): unknown {
    const { code, syscall, path: p, dest } = e as { code?: string; syscall?: string; path?: string; dest?: string }
    if (dir && code === 'ENOTDIR' && syscall === 'open' && p === dir) {
      const err = invalidValue('options.template', "a directory, whose contents become the workspace's (a file goes in a map: { 'name': path })", dir)
      return Object.assign(err, { cause: e })
    }
    const staging = stagingPath(this.root) + '/'
    for (const at of [p, dest]) {
      const [shard, name] = at?.startsWith(staging) ? at.slice(staging.length).split('/') : []
      const entry = shard !== undefined && name && STAGING_SHARD.test(shard) ? `${shard}/${name}` : undefined
      if (entry) return renamedPaths(e, staging + entry, path.join(this.root, path.basename(entry)))
    }
    return e
  }

  /** allocate()'s options, checked, and the metadata record's members (nothing is touched yet). */
  #allocateRequest(options: AllocateOptions | undefined): CheckedAllocate {
    const o = optionsObject<AllocateOptions>('options', options, {
      template: true, meta: true, mode: true, signal: true, writeback: true, quota: true, from: true,
    })
    const [quotaBytes, quotaInodes] = quotaLimits(o.quota)
    const { dir, entries } = templateEntries(o.template)
    if (dir) this.#outsideWorkspaces('options.template', dir)
    for (const [dest, source] of entries) this.#outsideWorkspaces(`options.template[${JSON.stringify(dest)}]`, source, true)
    const from = templateRef('options.from', o.from)
    const mode = workspaceMode('options.mode', o.mode)
    const signal = abortSignal('options.signal', o.signal)
    const writeback = oneOf('options.writeback', o.writeback, writebackValues, 'none')
    const info = recordMembers(this.#ownerMembers(), quotaBytes, quotaInodes, metaText(o.meta))
    return { quotaBytes, quotaInodes, dir, entries, from, mode, signal, writeback, info }
  }

  /**
   * Refuses a template source in a workspace of this pool, in its `.vmspace/`, or the pool's root itself, as written
   * or as its symlinks resolve: what a workspace holds is a guest's tree, whose symlinks the clone of a host path
   * would follow out of the workspace and whose device nodes and set-id files it would carry. A workspace becomes a
   * template through commit() or fork(). With `file` (a map entry), one regular file reached without a symlink is
   * let through: the base an image-backed pool keeps in a holder workspace that no guest writes (docs/image-pool.md).
   */
  #outsideWorkspaces(name: string, source: string, file = false): void {
    this.#realRoot ??= fs.realpathSync(this.root)
    let real = source
    try {
      real = fs.realpathSync(source)
    } catch {
      // the clone reports why it cannot open it
    }
    const guests = (p: string, root: string) => {
      if (p === root) return true
      if (!p.startsWith(root + '/')) return false
      const first = p.slice(root.length + 1).split('/')[0]
      return first === STATE_DIR || WORKSPACE_NAME.test(first)
    }
    if (!guests(source, this.root) && !guests(source, this.#realRoot) && !guests(real, this.#realRoot)) return
    const plainFile = file && real.slice(this.#realRoot.length) === source.slice(this.root.length) && isRegularFile(real)
    if (!plainFile)
      throw invalidValue(name, "a path outside the pool's workspaces (a workspace becomes a template by commit() or fork())", source)
  }

  /**
   * Builds and publishes the workspace: from the warm reserve when it can serve the request, else in the core.
   * Not an async function (a promise step fewer per allocate); a throw is caught by #allocate's try.
   */
  #build(req: CheckedAllocate): Promise<NativeAllocateResult> {
    const { quotaBytes, quotaInodes, dir, entries, from, signal } = req
    if (signal?.aborted) throw new AbortError(signal.reason)
    // Served from the warm reserve when it is of this template: only the metadata write and the publish remain.
    // Never for a quota: a warm entry is a plain directory (quota'd workspaces are built whole, as a subvolume
    // or with their project id before anything is cloned in).
    if ((dir || entries.length) && !quotaBytes && !quotaInodes && from === undefined) {
      const warm = this.#warm
      if (warm?.matches(WarmReserve.key(dir, entries, req.mode))) return this.#buildWarm(warm, req)
    }
    return this.#buildInCore(req)
  }

  async #buildWarm(warm: WarmReserve, req: CheckedAllocate): Promise<NativeAllocateResult> {
    const r = await warm.take(req.info)
    return r ?? this.#buildInCore(req)
  }

  #buildInCore(req: CheckedAllocate): Promise<NativeAllocateResult> {
    const { quotaBytes, quotaInodes, dir, entries, from, mode, signal, writeback, info } = req
    if (!dir && !entries.length && from === undefined && !quotaBytes && !quotaInodes) return this.#buildPlain(req)
    return this.#inFlight.track(
      withProgress({ signal }, (p) =>
        native.allocate(this.#handle, {
          prefix: this.prefix, mode, templateDir: dir, entries, reflink: this.#reflink, durable: this.#durable,
          info, progress: p, writeback, quotaBytes, quotaInodes, fromTemplate: from,
        }),
      ),
    )
  }

  /**
   * An empty workspace (no template, quota or clone to watch): the binding's positional call, and one promise
   * reaction for the in-flight count and the errno's name together.
   */
  #buildPlain(req: CheckedAllocate): Promise<NativeAllocateResult> {
    const prefixLength = this.prefix.length + 1
    return this.#inFlight.mapNative(
      native.allocatePlain(this.#handle, this.prefix, req.mode, req.info, this.#durable),
      ([name, leaseFd, retries]) => ({ id: name.slice(prefixLength), name, leaseFd, retries, clones: [] }),
    )
  }

  /**
   * The Workspace of a published build: its clones counted, its template's metadata checked, an abort honoured.
   * The workspace itself, not a promise, when there is nothing to wait for (#allocate then resolves
   * without adopting a promise).
   */
  #published(r: NativeAllocateResult, signal: AbortSignal | undefined, t: AllocateTrace | undefined, claim: boolean): Workspace | Promise<Workspace> {
    this.#stats.allocated++
    this.#stats.nameRetries += r.retries
    const hints = { claim }
    const ws = newWorkspace(constructing, this, r.id, r.name, this.#rootSlash + r.name, r.leaseFd, hints)
    if (r.clones.length)
      ws.template = r.clones.map((c) => {
        this._countClone(c)
        return toResult(c, c.dest ? path.join(ws.path, c.dest) : ws.path)
      })
    if (r.templateId === undefined && !signal?.aborted) {
      if (t) allocateResult(t, ws, r.retries)
      return ws
    }
    return this.#publishedChecked(ws, r, signal, t)
  }

  async #publishedChecked(ws: Workspace, r: NativeAllocateResult, signal: AbortSignal | undefined, t: AllocateTrace | undefined): Promise<Workspace> {
    if (r.templateId !== undefined) {
      ws.templateId = r.templateId
      // Read under the template's lock by the same call: a template.json that does not parse refuses it.
      const metaPath = templateMetaPath(this.root, r.templateId)
      const parsed = parseTemplateMeta(r.templateRecord ?? '', metaPath)
      if (!parsed.ok) {
        await ws.dispose()
        throw parsed.error
      }
    }
    if (t) allocateResult(t, ws, r.retries)
    if (signal?.aborted) {
      await ws.dispose()
      throw new AbortError(signal.reason)
    }
    return ws
  }

  /**
   * The path of the lease file of workspace `name` (`<prefix>-<32 hex>`, any prefix, as list() reports names, so
   * also one openPool's prefix rule would refuse, such as `x.y-<id>`): `<root>/.vmspace/leases/<the
   * id's first hex digit>/<name>` (docs/pool-on-disk.md), the file `ws.leaseFd` and a handed-over fd are open on,
   * whose xattr `user.vmspace.record` holds the workspace's record. For tools that look at a pool from outside
   * (matching a lease in /proc/locks, reading the record); no syscall: a name with no workspace gives where its
   * lease file would be. Throws `ERR_INVALID_ARG_TYPE` for a non-string, `ERR_INVALID_ARG_VALUE` for another shape.
   */
  leasePath(name: string): string {
    if (typeof name !== 'string') throw invalidType('name', 'a workspace name string', name)
    if (!LISTED_NAME.test(name) || Buffer.byteLength(name) > NAME_MAX)
      throw invalidValue('name', 'a workspace name (<prefix>-<32 lowercase hex>)', name)
    return leasePath(this.root, name)
  }

  /**
   * The published workspaces of this pool's root (any prefix), with liveness and their records. A record that
   * cannot be read or does not parse is reported in that entry's `error`, never read as empty.
   */
  async list(options?: ListOptions): Promise<WorkspaceInfo[]> {
    const o = optionsObject<ListOptions>('options', options, { usage: true, signal: true })
    const withUsage = boolean('options.usage', o.usage, false)
    const signal = abortSignal('options.signal', o.signal)
    this.#assertOpen()
    const entries = await call(this.#inFlight.track(native.list(this.#handle)))
    const infos = entries.map((e) => {
      const info = readRecord(this.root, e.name, e.live, e.record, e.recordError)
      // A lease probe that could not decide: `live` stays true (never reclaimable on its word), and it is the
      // entry's error, before any metadata problem.
      if (e.probeError !== undefined) info.error = fromNative(e.probeError) as VmspaceError
      return info
    })
    if (withUsage) {
      for (const info of infos) {
        try {
          info.usage = await this._usage(info.name, signal)
        } catch (e) {
          // Disposed meanwhile: no usage. One guest's tree that cannot be walked is that entry's error, not the list's.
          const code = (e as { code?: string }).code
          if (code === 'ABORT_ERR' || code === 'ERR_POOL_CLOSED') throw e
          if (code !== 'ENOENT') info.error ??= e as VmspaceError
        }
      }
    }
    return infos
  }

  /**
   * The pool's totals: the sum of every published workspace's usage (one walk per workspace, as
   * list({ usage: true })) and the file system's space. `signal` stops the walks (AbortError).
   */
  async usage(options?: { signal?: AbortSignal }): Promise<PoolUsage> {
    const o = optionsObject<{ signal?: AbortSignal }>('options', options, { signal: true })
    const signal = abortSignal('options.signal', o.signal)
    const list = await this.list({ usage: true, signal })
    this.#assertOpen()
    const space = await call(this.#inFlight.track(native.poolSpace(this.#handle)))
    const total: PoolUsage = {
      workspaces: list.length,
      allocatedBytes: 0,
      exclusiveBytes: 0,
      sharedBytes: 0,
      files: 0,
      dirs: 0,
      availableBytes: space.availableBytes,
      freeBytes: space.freeBytes,
      totalBytes: space.totalBytes,
      quota: toQuotaSupport(space.quota),
    }
    for (const { usage: u } of list) {
      if (!u) continue
      total.allocatedBytes += u.allocatedBytes
      total.exclusiveBytes += u.exclusiveBytes
      total.sharedBytes += u.sharedBytes
      total.files += u.files
      total.dirs += u.dirs
    }
    return total
  }

  /**
   * @internal Space accounting of the published workspace `name`. Not refused after close(): a workspace still
   * open keeps the pool's handle (close()'s promise), and list() checks for itself.
   */
  async _usage(name: string, signal: AbortSignal | undefined): Promise<WorkspaceUsage> {
    return toUsage(await this.#inFlight.track(withProgress({ signal }, (p) => native.usage(this.#handle, name, p))))
  }


  /**
   * Takes over the workspace `id` (of this pool's prefix) whose lease is free, e.g. after its sidecar
   * restarted and its VM exited. Throws `ERR_LEASE_HELD` while any process holds the lease (its owner, or a child
   * it was handed to) or another adopt or sweep is taking it, `ENOENT` for an unknown id (or an entry vmspace did
   * not make: no lease file). A list() never gets in the way (its probe takes no lock). The returned workspace's
   * `info` has its record (with `error` where it does not parse).
   */
  async adopt(id: string): Promise<Workspace> {
    if (typeof id !== 'string') throw invalidType('id', 'a workspace id string', id)
    if (!ID.test(id)) throw invalidValue('id', '32 lowercase hex characters', id)
    this.#assertOpen()
    const name = `${this.prefix}-${id}`
    this.#open++
    let r
    try {
      r = await call(this.#inFlight.track(native.adopt(this.#handle, name)))
    } catch (e) {
      await this._forget()
      throw e
    }
    const ws = newWorkspace(constructing, this, id, name, path.join(this.root, name), r.leaseFd, unknownHints)
    ws.info = readRecord(this.root, name, true, r.record, r.recordError)
    ws.templateId = ws.info.templateId
    return ws
  }

  /**
   * Reclaims what no live process holds (DESIGN.md, "sweep"): every workspace whose lease is free, published
   * (moved to trash, removed), in staging (a build whose process died) or in trash (a dispose that died), and
   * lease files whose workspace is gone. A held lease is never taken: liveness is the lease alone, never age or
   * pid. Only what vmspace made (a workspace with its lease file) is removed; anything else named like one is
   * reported in `foreign` and left.
   */
  sweep(options?: SweepOptions): Promise<SweepReport> {
    return traced(sweepChannel, () => ({ root: this.root, options }), () => this.#sweep(options), sweepResult)
  }

  async #sweep(options: SweepOptions | undefined): Promise<SweepReport> {
    const o = optionsObject<SweepOptions>('options', options, { dryRun: true, graceMs: true })
    const dryRun = boolean('options.dryRun', o.dryRun, false)
    const graceMs = integerIn('options.graceMs', o.graceMs, 0, 2 ** 31 - 1, 60_000)
    this.#assertOpen()
    const r = await call(this.#inFlight.track(native.sweep(this.#handle, { dryRun, graceMs })))
    const entry = (e: { name: string; from: SweepEntry['from']; bytes: number }): SweepEntry => ({
      id: workspaceId(e.name),
      name: e.name,
      from: e.from,
      bytes: e.bytes,
    })
    // Checkpoints after the workspaces: a workspace the pass above reclaimed has no lease file any more.
    const checkpoints = await this.#sweepCheckpoints(dryRun)
    return {
      reclaimed: [...r.reclaimed.map(entry), ...checkpoints.reclaimed],
      live: r.live,
      failed: [
        ...r.failed.map((e) => {
          const error = fromNative(e.error) as VmspaceError
          return { ...entry(e), code: error.code, error }
        }),
        ...checkpoints.failed,
      ],
      leasesRemoved: r.leasesRemoved,
      foreign: r.foreign,
    }
  }

  // ---- templates (their logic: lib/template.ts; on disk: native/core/template.h) ----

  /**
   * Commits the current contents of `ws` as a template: a tree clone (reflink where possible, else a copy;
   * `clone.method` says which) built in `.vmspace/templates/staging/`, its write bits removed (recorded, and
   * given back to every workspace allocated from it), published under `.vmspace/templates/<id>/` only complete.
   * On btrfs the tree is a read-only subvolume instead (modes kept; `subvolume: true`): a snapshot of a workspace
   * that is a subvolume (`clone.method` 'snapshot'), else a walk into a new subvolume; docs/templates.md.
   * Pause whatever writes in `ws` first: the walk takes each entry as it finds it, so a tree changing under it is
   * no one instant's version; a file written while it is cloned, or replaced by another file or a device, is
   * `ERR_SOURCE_CHANGED` (as far as the file system's timestamps tell: docs/DESIGN.md, "Clone engine"), and so is
   * an entry removed or replaced (by a symlink, say) after the walk saw it.
   * `name`: 1–128 of `[A-Za-z0-9._-]` (not 32 hex); an existing name is `EEXIST` (nothing built or changed),
   * unless `replace: true`, which swaps the name to the new template atomically (renameat2 RENAME_EXCHANGE) and
   * removes the old one once no allocate reads it (`replaced.removed` false: the last reader, or a sweep, does).
   * A guest's tree is hostile: its device nodes are not made (counted in `clone.skipped.devices`) and set-id bits
   * (of anything but directories) and security.capability are dropped, unless `keepDevices`/`keepSetId`
   * (docs/templates.md, "What a guest's tree may carry").
   * `share`: files every workspace made from the template holds as a hard link of one read-only inode (0444, owned
   * by the pool's owner, or by uid 4294967294 when root commits), kept outside the template's tree as
   * `shared/<n>`; a path missing is `ENOENT`, not a regular file or reached through a symlink
   * `ERR_INVALID_ARG_VALUE` naming it (docs/templates.md, "Shared files").
   * `signal`/`onProgress` as in clone(). Throws the errno of the failing call, `ERR_SOURCE_CHANGED`, `ERR_DISPOSED`,
   * `ERR_POOL_CLOSED`, `ERR_REFLINK_UNSUPPORTED` (reflink 'always' pools), or an AbortError; nothing is left on
   * failure.
   */
  async commit(
    ws: Workspace | string,
    options?: CommitOptions,
  ): Promise<CommitResult> {
    return this.#commit(ws, commitOptions(ws, options))
  }

  /** commit() of checked options; `checkpoint`: the record that makes the template a checkpoint. */
  async #commit(ws: Workspace | string, o: ReturnType<typeof commitOptions>, checkpoint?: CheckpointRecord): Promise<CommitResult> {
    this.#assertOpen()
    const source = typeof ws === 'string' ? await this.#publishedSource(ws) : readySource(ws)
    const r = await this.#inFlight.track(
      withProgress({ signal: o.signal, onProgress: o.onProgress }, (p) =>
        native.commitTemplate(this.#handle, {
          sourcePath: source.path, name: o.name, info: templateRecordMembers(source.templateId, o.meta, checkpoint), replace: o.replace,
          reflink: this.#reflink, durable: this.#durable, keepDevices: o.keepDevices, keepSetId: o.keepSetId, progress: p,
          share: o.share, parent: source.templateId ?? '',
        }),
      ),
    )
    this._countClone(r.clone)
    const result = commitResult(this.root, r, o.name)
    if (o.signal?.aborted) {
      await this.removeTemplate(r.id).catch(() => {})
      throw new AbortError(o.signal.reason)
    }
    return result
  }

  /** The published workspace `id` of this pool, live or not, as commit() reads it (the CLI, another process's). */
  async #publishedSource(id: string): Promise<{ path: string; templateId?: string }> {
    const name = `${this.prefix}-${id}`
    const found = (await this.list()).find((w) => w.name === name)
    if (!found) throw errnoError(2, 'open', path.join(this.root, name))
    return { path: found.path, templateId: found.templateId }
  }

  /**
   * `count` new workspaces from the current state of `ws`: one commit (an unnamed template), then `count`
   * allocates from it at once, then the template is removed. All or nothing: on any failure (or abort) every
   * workspace made is disposed and the first error is thrown. `onProgress({ done, count })` after each child.
   * `meta`/`mode` apply to every child; `keepDevices`/`keepSetId` to the commit. Throws as commit() and allocate() do.
   */
  async fork(
    ws: Workspace | string,
    count: number,
    options?: ForkOptions,
  ): Promise<Workspace[]> {
    return forkFrom(this, ws, count, options)
  }

  /** The pool's templates, oldest first. A template.json that cannot be read or parsed is in `error`, with its path. */
  async templates(): Promise<Template[]> {
    this.#assertOpen()
    return this.#inFlight.track(listTemplates(this.#handle, this.root))
  }

  /** One template by id or current name; `ERR_TEMPLATE_NOT_FOUND` when there is none. */
  async template(idOrName: string): Promise<Template> {
    return findTemplate(this.root, idOrName, () => this.templates(), (name) => this.#inFlight.track(native.templateNameTarget(this.#handle, name)))
  }

  /**
   * Removes a template (by id or name): its name goes at once, its tree once no allocate reads it (`removed`
   * false: the last reader, or a sweep, removes it). Workspaces allocated from it are not affected.
   * `ERR_TEMPLATE_NOT_FOUND` when there is none.
   */
  async removeTemplate(idOrName: string): Promise<{
    /** The template's id. */
    id: string
    /** Whether it is gone already (false: an allocate is reading it; its last reader or a sweep removes it). */
    removed: boolean
  }> {
    const ref = templateRef('idOrName', idOrName)!
    this.#assertOpen()
    const { id, removed } = await call(this.#inFlight.track(native.removeTemplate(this.#handle, ref)))
    return { id, removed }
  }

  /**
   * Removes stale templates in one call: those outside the newest `keepNewest` of their name, and/or those not
   * used (allocated from or committed) for `unusedForMs`. At least one of the two. Layer templates (importImage)
   * follow the images: one that an image kept lists is never removed, one that no image kept lists always is.
   * Returns what it removed (with `dryRun`, what it would).
   */
  async pruneTemplates(options: PruneOptions): Promise<{
    /** Templates removed. */
    removed: Template[]
    /** Templates retired but still being read (removed by their last reader, or a sweep). */
    deferred: Template[]
  }> {
    return pruneTemplates(options, () => this.templates(), (id, unlessCurrent) => {
      this.#assertOpen()
      return call(this.#inFlight.track(native.removeTemplate(this.#handle, id, unlessCurrent)))
    })
  }

  // ---- checkpoints (lib/checkpoint.ts; native/core/rollback.h; docs/checkpoints.md) ----

  /**
   * A checkpoint of `ws` (a Workspace, or a published workspace's id): commit() of its current tree as an unnamed
   * template whose record names the workspace (`checkpoint`), which keeps running. Then its retention: with
   * `keepNewest` its checkpoints outside the newest N (this one counts) are removed, with `maxAgeMs` those older
   * than that (never this one); one an allocate or rollback is reading is left for later (a sweep applies the
   * newest checkpoint's retention again). Pause what writes in the workspace first, as for commit(). Returns the
   * checkpoint with its `exclusiveBytes` (FIEMAP, now). Throws as commit() does (`name` and `replace` are not
   * options here: `ERR_INVALID_ARG_VALUE`), and `ERR_SHARE_UNSUPPORTED` for `share` on a workspace with a quota.
   */
  async checkpoint(ws: Workspace | string, options?: CheckpointOptions): Promise<Checkpoint> {
    // A Workspace's own call runs in turn with its rollbacks (Workspace.checkpoint), and comes back to #checkpoint.
    if (ws instanceof Workspace) return ws.checkpoint(options)
    return this.#checkpoint(ws, options)
  }

  async #checkpoint(ws: Workspace | string, options: CheckpointOptions | undefined): Promise<Checkpoint> {
    const { keepNewest, maxAgeMs, commit } = checkpointOptions(options)
    const id = workspaceIdArg(ws)
    const record = checkpointRecord(id, keepNewest, maxAgeMs)
    const o = commitOptions(ws, commit)
    // A rollback rebuilds the workspace with its quota (a subvolume, or a project id of its own), where no hard
    // link of a shared file can reach: such a checkpoint could never be rolled back to.
    if (o.share.length > 0 && (await this.list()).find((w) => w.id === id)?.quota)
      throw vmspaceError('ERR_SHARE_UNSUPPORTED', `workspace ${id} has a quota: a rollback could not link the shared file '${o.share[0]}'`, {
        path: o.share[0], syscall: 'linkat', cause: errnoError(18, 'linkat', o.share[0]),
      })
    const r = await this.#commit(ws, o, record)
    await this.#retain(id, record, r.id)
    const { clone: _clone, replaced: _replaced, ...made } = r
    const [cp] = await this.#inFlight.track(withExclusiveBytes(this.#handle, [{ ...made, checkpoint: record }]))
    if (!cp) throw vmspaceError('ERR_TEMPLATE_NOT_FOUND', `checkpoint ${r.id} was removed meanwhile`, { path: r.path })
    return cp
  }

  /** The checkpoints of `ws` (a Workspace or a workspace id), newest first, each with its `exclusiveBytes` now. */
  async checkpoints(ws: Workspace | string): Promise<Checkpoint[]> {
    const id = workspaceIdArg(ws)
    const all = await this.templates()
    return this.#inFlight.track(withExclusiveBytes(this.#handle, checkpointsOf(all, id)))
  }

  /**
   * Puts the tree of `ws` back to `checkpoint` (a Checkpoint or its id), under the same id, path and lease: the
   * checkpoint's tree is built beside it and swapped in atomically (renameat2 RENAME_EXCHANGE); the old tree goes
   * to trash and is removed as dispose removes (`removed` false: left there, a mount inside say, for a sweep).
   * The lease rule: nobody but the caller may hold the workspace's lease. A Workspace of this process closes its
   * own handover fd first (a later `ws.leaseFd` opens a new one); an id takes the free lease (as adopt) for the
   * call. Stop the VMM or container first: a process keeps the files and directories it has open (the old ones;
   * docs/checkpoints.md). Throws `ERR_LEASE_HELD` (nothing changed), `ERR_TEMPLATE_NOT_FOUND` (no template has
   * that id), `ERR_INVALID_ARG_VALUE` (another workspace's checkpoint, or not a checkpoint), `ENOENT` (no such
   * workspace), the errno of the build (nothing changed), `ERR_POOL_CLOSED`, or an AbortError (before the swap).
   */
  async rollback(ws: Workspace | string, checkpoint: Checkpoint | string, options?: { signal?: AbortSignal }): Promise<RollbackResult> {
    if (ws instanceof Workspace) return ws.rollback(checkpoint, options)
    const id = workspaceIdArg(ws)
    const signal = rollbackSignal(options)
    this.#assertOpen()
    const target = await this._rollbackTarget(id, checkpoint)
    if (signal?.aborted) throw new AbortError(signal.reason) // before the lease is taken
    const { leaseFd } = await call(this.#inFlight.track(native.adopt(this.#handle, `${this.prefix}-${id}`)))
    try {
      return await this._rollback(`${this.prefix}-${id}`, leaseFd, target, signal)
    } finally {
      await call(native.releaseLease(leaseFd))
    }
  }

  /** @internal The id of rollback()'s `checkpoint` once checked to be one of workspace `id`'s (nothing touched). */
  async _rollbackTarget(id: string, checkpoint: unknown): Promise<string> {
    return rollbackTarget(await this.templates(), id, checkpoint, this.root)
  }

  /** @internal The native rollback of workspace `name`, whose lease `leaseFd` holds (kept open). */
  async _rollback(name: string, leaseFd: number, checkpoint: string, signal: AbortSignal | undefined): Promise<RollbackResult> {
    this.#assertOpen()
    const r = await this.#inFlight.track(
      withProgress({ signal }, (p) => native.rollback(this.#handle, { name, leaseFd, checkpoint, durable: this.#durable, progress: p })),
    )
    return { checkpoint, removed: r.removed }
  }

  /** @internal Workspace.checkpoint and Workspace.checkpoints. */
  _checkpoint(ws: Workspace, options: CheckpointOptions | undefined): Promise<Checkpoint> {
    return this.#checkpoint(ws, options)
  }

  /** @internal */
  _checkpoints(ws: Workspace): Promise<Checkpoint[]> {
    return this.checkpoints(ws)
  }

  /** A checkpoint's retention (`policy`) over workspace `id`'s checkpoints, `made` (the new one) kept. */
  async #retain(id: string, policy: CheckpointRecord, made: string): Promise<void> {
    if (policy.keepNewest === undefined && policy.maxAgeMs === undefined) return
    const list = checkpointsOf(await this.templates(), id)
    const newest = [...list.filter((t) => t.id === made), ...list.filter((t) => t.id !== made)]
    for (const t of retentionVictims(newest, policy, Date.now())) await this.#removeCheckpoint(t.id)
  }

  /** Removes checkpoint `id` unless something reads it (left for later); false when not removed now. */
  async #removeCheckpoint(id: string): Promise<{ removed: boolean; bytes: number }> {
    try {
      const r = await call(this.#inFlight.track(native.removeTemplate(this.#handle, id, true)))
      return { removed: r.removed && !r.kept, bytes: r.bytes }
    } catch (e) {
      if ((e as VmspaceError).code === 'ERR_TEMPLATE_NOT_FOUND') return { removed: false, bytes: 0 } // removed meanwhile
      throw e
    }
  }

  /** sweep()'s checkpoint pass (lib/checkpoint.ts, sweptCheckpoints): reclaimed and failed entries, `from: 'template'`. */
  async #sweepCheckpoints(dryRun: boolean): Promise<{ reclaimed: SweepEntry[]; failed: SweepFailure[] }> {
    const out: { reclaimed: SweepEntry[]; failed: SweepFailure[] } = { reclaimed: [], failed: [] }
    const all = await this.#inFlight.track(listTemplates(this.#handle, this.root))
    for (const t of await sweptCheckpoints(this.root, all, Date.now())) {
      const entry: SweepEntry = { id: t.id, name: `template-${t.id}`, from: 'template', bytes: 0 }
      if (dryRun) {
        out.reclaimed.push(entry)
        continue
      }
      try {
        const r = await this.#removeCheckpoint(t.id)
        if (r.removed) out.reclaimed.push({ ...entry, bytes: r.bytes })
      } catch (e) {
        const error = fromNative(e) as VmspaceError
        out.failed.push({ ...entry, code: error.code, error })
      }
    }
    return out
  }

  // ---- images (lib/image-import.ts; docs/images.md) ----

  /**
   * Imports an OCI image into the pool: one layer template per layer (keyed by chainID, shared by every image
   * that has the same layers below it; those the pool has are reused, nothing of their blobs read), then the
   * image template named `name` (default: the ref), usable as `allocate({ from })`. `source`: an OCI image layout
   * directory, an oci-archive or a docker-archive file (sniffed), or skopeo's `oci:DIR[:REF]`,
   * `oci-archive:FILE[:REF]`, `docker-archive:FILE[:REF]`. Each blob's size and digest and each layer's diffID are
   * checked as it streams; nothing is published on any failure. Importing the same image under the same name and
   * format again returns the existing template (every layer `reused`). Needs root (owners, devices, capabilities).
   * Throws `ERR_OCI_NOT_PERMITTED` (not root; nothing made), `ERR_OCI_INVALID`, `ERR_OCI_REF`, `ERR_OCI_PLATFORM`,
   * `ERR_OCI_BLOB_MISSING`, `ERR_OCI_DIGEST_MISMATCH`, `ERR_OCI_MEDIA_TYPE`, `ERR_LAYER_UNSAFE`,
   * `ERR_LAYER_INVALID`, `EEXIST` (the name holds another image or template, without `replace`), `ENOSPC` (format
   * 'ext4': the file system has less free than the image's size; nothing written), `ERR_IMAGE_TOOL_MISSING`
   * (mke2fs), `ERR_POOL_CLOSED`, or an AbortError (what it was building removed at once).
   */
  async importImage(source: string, options?: ImportImageOptions): Promise<ImageTemplate> {
    importOptions(source, options)
    this.#assertOpen()
    // Tracked whole: close() waits for an import's every step, not only the native call under way.
    return this.#inFlight.track(importImage(this.#imageHost(), source, options))
  }

  /** The pool's image templates (current names only), oldest first; each layer as a re-import reports it (`reused`). */
  async images(): Promise<ImageTemplate[]> {
    this.#assertOpen()
    return listImages(this.#imageHost())
  }

  /**
   * Removes the image template `nameOrId` (as removeTemplate), then every layer template that no remaining image
   * lists. Returns the ids removed, the image's first. `ERR_TEMPLATE_NOT_FOUND` when no image template has that
   * name or id.
   */
  async removeImage(nameOrId: string): Promise<RemovedImage> {
    const ref = templateRef('nameOrId', nameOrId)!
    this.#assertOpen()
    return this.#inFlight.track(removeImage(this.#imageHost(), ref, (id) => call(this.#inFlight.track(native.removeTemplate(this.#handle, id)))))
  }

  #imageHost(): ImportHost {
    return {
      handle: this.#handle, root: this.root, reflink: this.#reflink, durable: this.#durable,
      // Not this.templates(): an import or removal under way finishes after close() began (close waits for it).
      templates: () => this.#inFlight.track(listTemplates(this.#handle, this.root)), track: (p) => this.#inFlight.track(p),
    }
  }

  /** The warm reserve's counters since the pool was opened (a copy); undefined without `warm`. */
  warmStats(): WarmStats | undefined {
    return this.#warm?.stats()
  }

  /** @internal Starts the warm reserve (openPool's `warm`); it counts as an open workspace until close(). */
  _startWarm(dir: string, entries: [string, string][], mode: number, count: number): void {
    if (dir) this.#outsideWorkspaces('options.warm.template', dir)
    for (const [dest, source] of entries) this.#outsideWorkspaces(`options.warm.template[${JSON.stringify(dest)}]`, source, true)
    this.#open++
    const shape = { prefix: this.prefix, mode, templateDir: dir, entries, reflink: this.#reflink, durable: this.#durable }
    this.#warm = new WarmReserve(
      {
        build: () =>
          call(this.#inFlight.track(native.warmBuild(this.#handle, shape))),
        take: (entry, info) => call(this.#inFlight.track(native.warmTake(this.#handle, entry, info))),
        discard: (entry) => call(this.#inFlight.track(native.warmDiscard(this.#handle, entry))),
      },
      WarmReserve.key(dir, entries, mode),
      count,
    )
    this.#warm.refill()
  }

  /** Counters since the pool was opened in this process (a copy). */
  stats(): PoolStats {
    return { ...this.#stats, clones: { ...this.#stats.clones } }
  }

  /**
   * Stops new allocate()/list() calls (`ERR_POOL_CLOSED`) and waits for running ones; stops the warm reserve's
   * refill and removes its entries. Workspaces still open keep working; the pool's directory fds are released
   * once the last of them is disposed. Idempotent.
   */
  async close(): Promise<void> {
    this.#closed = true
    const warm = this.#warm
    if (warm) {
      this.#warm = undefined
      await warm.close()
      await this._forget()
    }
    await this.#inFlight.idle()
    await this.#releaseIfIdle()
  }

  /** close(), for `await using pool = await openPool(…)`. */
  [Symbol.asyncDispose](): Promise<void> {
    return this.close()
  }

  /**
   * @internal Not an async function: one promise reaction after the native call (as Workspace.clone).
   * The workspace is forgotten on every path; the pool's own release error, if any, wins over the dispose's.
   */
  _dispose(ws: Workspace, leaseFd: number, handoverFd: number, hints: DisposeHints): Promise<void> {
    let run: Promise<void>
    try {
      run = native.dispose(this.#handle, ws.name, leaseFd, handoverFd, hints.claim)
    } catch (e) {
      return this.#forgetAndReject(e)
    }
    return run.then(
      () => {
        this.#stats.disposed++
        return this._forget()
      },
      (e: unknown) => this.#forgetAndReject(fromNative(e)),
    )
  }

  /** _forget, then a rejection with `error` (after the pool's release, whose own error wins). */
  #forgetAndReject(error: unknown): Promise<never> {
    const released = this._forget()
    return released ? released.then(() => Promise.reject(error)) : Promise.reject(error)
  }

  /**
   * @internal A workspace of this pool is gone from it (disposed, released, or never made). A promise only when
   * this was the last one of a closed pool (its release); else nothing to wait for.
   */
  _forget(): Promise<void> | undefined {
    this.#open--
    return this.#closed ? this.#releaseIfIdle() : undefined
  }

  /** @internal The native pool, for a workspace's own calls. */
  get _handle(): PoolHandle {
    return this.#handle
  }

  /** @internal A new handover fd of workspace `name`'s lease, which `leaseFd` holds (synchronous). */
  _openHandover(name: string, leaseFd: number): number {
    try {
      return native.openHandover(this.#handle, name, leaseFd)
    } catch (e) {
      throw fromNative(e)
    }
  }

  /** @internal Whether another open file description holds workspace `name`'s lease, which `leaseFd` holds (synchronous). */
  _leaseHandedOver(name: string, leaseFd: number): boolean {
    try {
      return native.leaseHandedOver(this.#handle, name, leaseFd)
    } catch (e) {
      throw fromNative(e)
    }
  }

  /** @internal */
  _countClone(r: NativeCloneResult): void {
    this.#stats.clones.reflink += r.reflinked
    this.#stats.clones.copy += r.copied
    this.#stats.bytesCloned += r.bytes
  }

  async #releaseIfIdle() {
    if (!this.#closed || this.#open !== 0 || this.#handleClosed) return
    await this.#inFlight.idle() // a list() or sweep() still running uses the fds
    if (this.#open === 0 && !this.#handleClosed) {
      this.#handleClosed = true
      await call(native.closePool(this.#handle))
    }
  }

  #assertOpen() {
    if (this.#closed) throw vmspaceError('ERR_POOL_CLOSED', 'the pool was closed', { path: this.root })
  }
}

/** allocate()'s options as checked, with the metadata record's members. */
interface CheckedAllocate {
  quotaBytes: number
  quotaInodes: number
  dir: string
  entries: [string, string][]
  from: string | undefined
  mode: number
  signal: AbortSignal | undefined
  writeback: Writeback
  info: JsonMembers
}

function templateEntries(template: unknown, name = 'options.template'): { dir: string; entries: [string, string][] } {
  if (template === undefined) return { dir: '', entries: [] }
  if (typeof template === 'string') return { dir: absolutePath(name, template), entries: [] }
  const proto = typeof template === 'object' && template !== null ? Object.getPrototypeOf(template) : undefined
  if (proto !== Object.prototype && proto !== null)
    throw invalidType(name, 'a directory path or a plain object mapping workspace paths to sources', template)
  const seen = new Set<string>()
  const entries = Object.entries(template as Record<string, unknown>).map(([dest, source]): [string, string] => {
    const rel = relativePath(`${name}[${JSON.stringify(dest)}]`, dest)
    if (seen.has(rel)) throw invalidValue(name, 'each destination once', dest)
    seen.add(rel)
    return [rel, absolutePath(`${name}[${JSON.stringify(dest)}]`, source)]
  })
  return { dir: '', entries }
}

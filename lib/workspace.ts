/**
 * Workspaces: the Workspace class (a workspace this process holds the lease of: its clone, dispose, release and
 * usage calls), and the check of a workspace directory's mode. Made by Pool.allocate and Pool.adopt (lib/pool.ts) through newWorkspace; what it needs of its pool
 * is WorkspaceHost (lib/internal.ts).
 */
import * as path from 'node:path'
import { native, type NativeCloneArray, type ProgressHandle } from './binding.js'
import { abortSignal, absolutePath, boolean, integerIn, invalidValue, optionsObject, relativePath } from './args.js'
import { call, vmspaceError } from './errors.js'
import { cloneOptions, cloneResultOf, reflinkValues, toResult, withProgress, writebackValues } from './clone.js'
import { cloneChannel, cloneResult, disposeChannel, traced } from './trace.js'
import { constructing, InFlight, type DisposeHints, type WorkspaceHost } from './internal.js'
import type { Checkpoint, CheckpointOptions, CloneOptions, CloneResult, RollbackResult, WorkspaceInfo, WorkspaceUsage } from './types.js'

// hints: what this process knows of the workspace for its dispose (binding.ts, dispose).
type WorkspaceArgs = [token: symbol, pool: WorkspaceHost, id: string, name: string, wsPath: string, leaseFd: number, hints: DisposeHints]

/** @internal The constructor of Workspace, which its type declares private: lib/ makes workspaces through this. */
export const newWorkspace = (...args: WorkspaceArgs) => new (Workspace as unknown as new (...a: WorkspaceArgs) => Workspace)(...args)

/** A workspace this process holds the lease of. Made by {@link Pool.allocate} and {@link Pool.adopt}. */
export class Workspace implements AsyncDisposable {
  /** 32 lowercase hex characters: 128 bits from getrandom(2). */
  readonly id: string
  /** `${prefix}-${id}`, the directory's name in the pool root. */
  readonly name: string
  /** Absolute path of the workspace directory. */
  readonly path: string
  /**
   * The lease to hand to the sandbox's process (spawn's `stdio`, `crun run --preserve-fds`, a VMM's inherited
   * fd): the workspace stays live, and no dispose or sweep removes it, while any process holds it (DESIGN.md,
   * "Leases"). An fd of the workspace's lease file, opened on first access (close-on-exec in this process):
   * a read-only regular file in the pool's `.vmspace/leases/`, not the workspace directory, so a holder can open
   * nothing through it (no `openat`, `fchdir` or `/proc/self/fd/N/..`), cannot write it, and cannot chmod it
   * when root made the pool (it belongs to uid 4294967294 then). After the hand-over, release() this process's
   * hold (it checks that another process holds the lease), or dispose() once the child exited (dispose() rejects
   * with `ERR_LEASE_HELD` while it runs). Throws `ERR_DISPOSED` once release() or dispose() has begun: the number
   * this process had may be reused by the next fd it opens, so a read after release() (a spawn in the wrong
   * order) fails instead of handing the child nothing (spawn takes -1 without a word) or another file. Throws
   * the errno of the open (`EMFILE`, ...).
   */
  get leaseFd(): number {
    if (this.#leaseFd < 0 || this.#disposing) throw this.#gone()
    if (this.#handoverFd < 0) this.#handoverFd = this.#pool._openHandover(this.name, this.#leaseFd)
    return this.#handoverFd
  }
  // The owner's hold of the lease (never handed out) and the description handed over (-1 until asked for).
  #leaseFd: number
  #handoverFd = -1
  /** What the template cloned into the workspace (allocate only). */
  template: CloneResult[] = []
  /** The id of the template it was allocated from (`allocate({ from })`), the parent of its commits. */
  templateId?: string
  /** Metadata as recorded on disk (adopt only). */
  info?: WorkspaceInfo
  #status: 'ready' | 'disposed' | 'unrecoverable' | 'released' = 'ready'
  #cause: unknown
  #disposing: Promise<void> | undefined
  readonly #pool: WorkspaceHost
  readonly #inFlight = new InFlight()
  readonly #hints: DisposeHints

  // Private in the published types (workspaces come from Pool.allocate()); lib/ makes them through newWorkspace.
  private constructor(...[token, pool, id, name, wsPath, leaseFd, hints]: WorkspaceArgs) {
    if (token !== constructing) throw new TypeError('Use Pool.allocate() to make a workspace')
    this.#pool = pool
    this.id = id
    this.name = name
    this.path = wsPath
    this.#leaseFd = leaseFd
    this.#hints = hints
  }

  /**
   * `'unrecoverable'` when dispose failed partway (see `cause`); what is left sits in the pool's trash and a
   * sweep finishes it. `'released'` after release().
   */
  get status(): 'ready' | 'disposed' | 'unrecoverable' | 'released' {
    return this.#status
  }

  /** Why dispose failed, for status `'unrecoverable'`. */
  get cause(): unknown {
    return this.#cause
  }

  /**
   * Clones `source` (a file or a directory tree) into the workspace at `dest` (workspace-relative, default: the
   * source's basename).
   * The destination is resolved beneath the workspace without following any symlink, so nothing planted inside
   * can redirect the write outside it; its parent directory must exist. `source` is the caller's own path and
   * follows symlinks as cp does: to copy out of a workspace use {@link Workspace.copyOut}, which resolves beneath it.
   * See {@link CloneOptions}; throws as clone() does, and `ERR_DISPOSED` after dispose().
   */
  clone(source: string, dest?: string, options?: CloneOptions): Promise<CloneResult> {
    const make = () => ({ root: this.#pool.root, id: this.id, source, dest })
    return traced(cloneChannel, make, () => this.#clone(source, dest, options), cloneResult)
  }

  // Not an async function, and one promise reaction between the native call and the caller when there is neither
  // progress nor a signal: the in-flight count, the clone counters, the result and the error conversion are all
  // done in it (against copyFile, each promise step more shows in `npm run bench -- --only clone`). A throw before
  // the native call (bad arguments, ERR_DISPOSED) still rejects, as an async function's would.
  #clone(source: string, dest: string | undefined, options: CloneOptions | undefined): Promise<CloneResult> {
    let run: Promise<NativeCloneArray>
    let destPath: string
    try {
      const src = absolutePath('source', source)
      const rel = relativePath('dest', dest ?? path.basename(src))
      const opts = cloneOptions(options)
      if (this.#status !== 'ready' || this.#disposing) throw this.#gone()
      // `rel` is normalised (no "." or ".." component, no slash at either end) and this.path absolute: the same
      // string path.join would give, without its normalising pass.
      destPath = this.path + '/' + rel
      const start = (p: ProgressHandle | undefined) =>
        native.clonePathBeneath(
          this.#pool._handle, this.name, this.path, src, rel, reflinkValues.indexOf(opts.reflink), opts.overwrite, opts.durable,
          writebackValues.indexOf(opts.writeback), p,
        )
      run = opts.onProgress || opts.signal ? withProgress(opts, start) : start(undefined)
    } catch (e) {
      return Promise.reject(e)
    }
    return this.#inFlight.mapNative(run, (a) => {
      const r = cloneResultOf(a, destPath)
      this.#pool._countClone(r)
      return r
    })
  }

  /**
   * Copies `source` (workspace-relative: a regular file or a directory tree the guest made) out of the workspace to
   * `dest` (absolute; its parent must exist), the way to take a guest's output: `source` is resolved beneath the
   * workspace and never out of it. No symlink on its path is followed: one in the middle is `ENOTDIR`, one at the
   * end `ELOOP` (a guest's link to `/etc/shadow` copies nothing); a device node, fifo or socket is
   * `ERR_SOURCE_TYPE`, never opened. Inside a tree, device nodes are not made (counted in `skipped.devices`), and
   * no set-id bit or file capability is kept, here as in a template (docs/templates.md). A tree is copied as clone() copies one (its symlinks recreated, never
   * followed; no other mount entered). Nothing is written at `dest` on any failure. clone()'s and ws.clone()'s
   * source follows symlinks (it is the caller's own path): never give either a path inside a workspace.
   * Options as {@link CloneOptions}; throws as clone() does, `ERR_INVALID_ARG_VALUE` for a `source` that is not
   * normalised and relative, and `ERR_DISPOSED` after dispose().
   */
  copyOut(source: string, dest: string, options?: CloneOptions): Promise<CloneResult> {
    const make = () => ({ root: this.#pool.root, id: this.id, source, dest })
    return traced(cloneChannel, make, () => this.#copyOut(source, dest, options), cloneResult)
  }

  async #copyOut(source: string, dest: string, options: CloneOptions | undefined): Promise<CloneResult> {
    const rel = relativePath('source', source)
    const dst = absolutePath('dest', dest)
    const opts = cloneOptions(options)
    if (this.#status !== 'ready' || this.#disposing) throw this.#gone()
    const { reflink, overwrite, durable, writeback } = opts
    const run = withProgress(opts, (progress) =>
      native.cloneOutBeneath(this.#pool._handle, { name: this.name, basePath: this.path, rel, dst, reflink, overwrite, durable, writeback, progress }),
    )
    return toResult(await this.#inFlight.track(run), dst)
  }

  /**
   * Removes the workspace: removed at its name (or renamed into the pool's trash and removed there) without
   * following symlinks or entering mounts, then its lease file; the name is never reused. Waits for clones still
   * running. While another process holds the lease (a child given {@link Workspace.leaseFd} that still runs),
   * nothing is removed and it rejects with `ERR_LEASE_HELD`: this process's hold is released (status
   * `'released'`) and the workspace is left to its holder, for a sweep or an adopt once it is free.
   * Idempotent: later calls return the first call's promise; after release() it rejects with `ERR_DISPOSED` (the
   * lease is no longer this object's to remove). A mount inside gives `EBUSY`, a pool's root inside
   * `ERR_POOL_NESTED` (left whole: docs/pool-on-disk.md); the workspace is then
   * `'unrecoverable'` and what is left stays in trash for a sweep.
   */
  dispose(): Promise<void> {
    if (this.#disposing) return this.#disposing
    // Set before anything runs: a vmspace:dispose subscriber (its start event is published synchronously below)
    // that reaches this workspace must find it disposing (else a second dispose runs, and the pool's open
    // count goes negative).
    let resolve!: () => void
    let reject!: (e: unknown) => void
    this.#disposing = new Promise<void>((res, rej) => {
      resolve = res
      reject = rej
    })
    if (this.#inFlight.busy) void this.#inFlight.idle().then(() => this.#disposeNow(resolve, reject))
    else this.#disposeNow(resolve, reject)
    return this.#disposing
  }

  // Not an async function: one promise reaction between the native call's and the caller's.
  #disposeNow(resolve: () => void, reject: (e: unknown) => void): void {
    let run: Promise<void>
    try {
      const pool = this.#pool
      const fd = this.#leaseFd
      const handover = this.#handoverFd
      // The native dispose owns the fds from here on (closed whatever happens): their numbers are no longer ours.
      this.#leaseFd = this.#handoverFd = -1
      run = traced(disposeChannel, () => ({ root: pool.root, id: this.id, name: this.name }), () => pool._dispose(this, fd, handover, this.#hints))
    } catch (e) {
      run = Promise.reject(e)
    }
    run.then(
      () => {
        this.#status = 'disposed'
        resolve()
      },
      (e: unknown) => {
        // ERR_LEASE_HELD: nothing was removed and this process no longer holds it: released, not broken.
        this.#status = (e as { code?: string }).code === 'ERR_LEASE_HELD' ? 'released' : 'unrecoverable'
        this.#cause = e
        reject(e)
      },
    )
  }

  /**
   * Drops this process's hold of the lease (its fds closed) without removing the workspace, once another process
   * holds it: after handing {@link Workspace.leaseFd} to a child process, the workspace then lives exactly as long
   * as that child (and any other holder); once the lease is free, a sweep reclaims it or another process adopts
   * it. Later calls to dispose()/clone() throw `ERR_DISPOSED`.
   *
   * Rejects with `ERR_LEASE_NOT_HANDED_OVER`, keeping the lease (status stays `'ready'`: dispose() it, or hand it
   * over and call release() again), when no other process holds it: leaseFd never handed over, a child that
   * failed to start or already exited, or a launcher that closed the fds it inherited (see docs/lifecycle.md).
   * `spawn()` returns once the child has exec'd with the fd, so a release() right after it sees the child's hold.
   * `force: true` releases anyway, leaving a workspace no process holds to the next sweep or adopt. Throws
   * `ERR_DISPOSED` after dispose() or release(), and the errno of `fcntl(F_OFD_GETLK)` (lease kept).
   */
  async release(options?: { force?: boolean }): Promise<void> {
    const o = optionsObject<{ force?: boolean }>('options', options, { force: true })
    const force = boolean('options.force', o.force, false)
    if (this.#status !== 'ready' || this.#disposing) throw this.#gone()
    // Set before the first await: dispose(), clone() and leaseFd refuse while the release runs.
    this.#disposing = Promise.reject(this.#gone('released'))
    this.#disposing.catch(() => {})
    await this.#inFlight.idle()
    try {
      // This process's handover description goes first: what still holds the lease then is another process's.
      const handover = this.#handoverFd
      this.#handoverFd = -1 // close(2) frees the number even when it reports an error
      if (handover >= 0) await call(native.releaseLease(handover))
      if (!force && !this.#pool._leaseHandedOver(this.name, this.#leaseFd))
        throw vmspaceError(
          'ERR_LEASE_NOT_HANDED_OVER',
          `no other process holds the lease of workspace ${this.name}: hand ws.leaseFd to the sandbox's process ` +
            '(a launcher that closes inherited fds drops it), or release({ force: true }); the lease is kept',
          { path: this.path, syscall: 'fcntl(F_OFD_GETLK)' },
        )
    } catch (e) {
      this.#disposing = undefined
      throw e
    }
    const fd = this.#leaseFd
    this.#leaseFd = -1
    this.#status = 'released'
    try {
      await call(native.releaseLease(fd))
    } finally {
      await this.#pool._forget()
    }
  }

  /**
   * Space accounting of this workspace ({@link WorkspaceUsage}): allocated, exclusive and shared bytes (FIEMAP
   * per regular file), file and directory counts, and the quota's limits and use where one is set. Cost: a walk of
   * the whole tree, an fstatat per entry and a FIEMAP per regular file (130–180 ms per 10,000 small files, see
   * docs/filesystems.md); `signal` stops it (AbortError). Never follows symlinks or enters mounts. Throws `ERR_DISPOSED` after
   * dispose().
   */
  async usage(options?: { signal?: AbortSignal }): Promise<WorkspaceUsage> {
    const o = optionsObject<{ signal?: AbortSignal }>('options', options, { signal: true })
    const signal = abortSignal('options.signal', o.signal)
    if (this.#status !== 'ready' || this.#disposing) throw this.#gone()
    return this.#inFlight.track(this.#pool._usage(this.name, signal))
  }

  /**
   * A checkpoint of this workspace's current tree ({@link Pool.checkpoint}; docs/checkpoints.md): an unnamed template
   * that `rollback()` puts back, with retention (`keepNewest`, `maxAgeMs`). Throws as Pool.checkpoint does, and
   * `ERR_DISPOSED` after dispose() or release().
   */
  checkpoint(options?: CheckpointOptions): Promise<Checkpoint> {
    if (this.#status !== 'ready' || this.#disposing) return Promise.reject(this.#gone())
    return this.#inFlight.track(this.#pool._checkpoint(this, options))
  }

  /** This workspace's checkpoints, newest first, each with its `exclusiveBytes` now. `ERR_DISPOSED` after dispose(). */
  checkpoints(): Promise<Checkpoint[]> {
    if (this.#status !== 'ready' || this.#disposing) return Promise.reject(this.#gone())
    return this.#inFlight.track(this.#pool._checkpoints(this))
  }

  /**
   * Puts this workspace's tree back to `checkpoint` (a Checkpoint or its id) under the same id, path and lease
   * ({@link Pool.rollback}; docs/checkpoints.md): atomic at the workspace's name, the old tree removed through
   * trash. This process's handover fd is closed first (a later {@link Workspace.leaseFd} opens a new one); the
   * owner's hold of the lease is kept throughout. While another process holds the lease (a VMM or container given
   * leaseFd that still runs) it rejects with `ERR_LEASE_HELD` and changes nothing: stop it first. Throws as
   * Pool.rollback does, and `ERR_DISPOSED` after dispose() or release().
   */
  async rollback(checkpoint: Checkpoint | string, options?: { signal?: AbortSignal }): Promise<RollbackResult> {
    const signal = rollbackSignal(options)
    if (this.#status !== 'ready' || this.#disposing) throw this.#gone()
    return this.#inFlight.track(this.#rollback(checkpoint, signal))
  }

  async #rollback(checkpoint: Checkpoint | string, signal: AbortSignal | undefined): Promise<RollbackResult> {
    const target = await this.#pool._rollbackTarget(this.id, checkpoint)
    if (this.#status !== 'ready' || this.#disposing) throw this.#gone()
    // This process's handover description goes first: what still holds the lease then is another process's.
    const handover = this.#handoverFd
    this.#handoverFd = -1 // close(2) frees the number even when it reports an error
    if (handover >= 0) await call(native.releaseLease(handover))
    return this.#pool._rollback(this.name, this.#leaseFd, target, signal)
  }

  // ERR_DISPOSED, naming what ended this workspace's hold (release() in progress: 'released').
  #gone(how: 'released' | 'disposed' = this.#status === 'released' ? 'released' : 'disposed') {
    return vmspaceError('ERR_DISPOSED', `workspace ${this.name} was ${how}`, { path: this.path })
  }

  /** dispose(), for `await using ws = await pool.allocate()`. */
  [Symbol.asyncDispose](): Promise<void> {
    return this.dispose()
  }
}

/** rollback()'s options, checked: its signal. */
export function rollbackSignal(options: unknown): AbortSignal | undefined {
  const o = optionsObject<{ signal?: AbortSignal }>('options', options, { signal: true })
  return abortSignal('options.signal', o.signal)
}

/**
 * A workspace directory's mode (default 0o700). Without root, a mode lacking the owner write bit (0o200) is
 * ERR_INVALID_ARG_VALUE: publishing and disposing move the directory to another parent, which rewrites its ".."
 * and needs write permission on it (EACCES otherwise), so such a workspace could not be published.
 */
export function workspaceMode(name: string, value: unknown): number {
  const mode = integerIn(name, value, 0, 0o7777, 0o700)
  if ((mode & 0o200) === 0 && process.geteuid?.() !== 0)
    throw invalidValue(name, 'a mode with the owner write bit (0o200) when not root', value, true)
  return mode
}

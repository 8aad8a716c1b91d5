/**
 * What lib/pool.ts and lib/workspace.ts share and the API does not show: the token that lets only lib/ construct
 * a Pool or a Workspace (their constructors are private in the published types), what a Workspace needs of its
 * Pool (WorkspaceHost, so that workspace.ts does not import pool.ts), the dispose hints, and the count of calls in
 * flight.
 */
import { fromNative } from './errors.js'
import type { NativeCloneResult, PoolHandle } from './binding.js'
import type { Checkpoint, CheckpointOptions, RollbackResult, WorkspaceUsage } from './types.js'
import type { Workspace } from './workspace.js'

/** Passed to the Pool and Workspace constructors by lib/ only: a constructor called without it throws. */
export const constructing = Symbol('vmspace.internal')

/** What this process knows of a workspace for its dispose (binding.ts, dispose). */
export interface DisposeHints {
  /** It may hold a project id claim (false: made here without a quota). */
  claim: boolean
}
/** The hints of a workspace this process did not build (adopt). */
export const unknownHints: DisposeHints = { claim: true }

/** The Pool's members a Workspace calls (all `@internal` in Pool): the Pool is the only implementation. */
export interface WorkspaceHost {
  /** Absolute path of the pool's root directory. */
  readonly root: string
  /** The native pool. */
  readonly _handle: PoolHandle
  /** A new handover fd of workspace `name`'s lease, which `leaseFd` holds (synchronous). */
  _openHandover(name: string, leaseFd: number): number
  /** Whether another open file description holds workspace `name`'s lease, which `leaseFd` holds (synchronous). */
  _leaseHandedOver(name: string, leaseFd: number): boolean
  /** Counts a clone into the pool's stats. */
  _countClone(r: NativeCloneResult): void
  /** The native dispose of workspace `ws.name`; it owns both fds from the call on. */
  _dispose(ws: { readonly name: string }, leaseFd: number, handoverFd: number, hints: DisposeHints): Promise<void>
  /** Space accounting of the published workspace `name`. */
  _usage(name: string, signal: AbortSignal | undefined): Promise<WorkspaceUsage>
  /** A workspace of this pool is gone from it. */
  _forget(): Promise<void> | undefined
  /** Pool.checkpoint and Pool.checkpoints of this workspace. */
  _checkpoint(ws: Workspace, options: CheckpointOptions | undefined): Promise<Checkpoint>
  _checkpoints(ws: Workspace): Promise<Checkpoint[]>
  /** The id of rollback()'s `checkpoint`, checked to be one of workspace `id`'s. */
  _rollbackTarget(id: string, checkpoint: unknown): Promise<string>
  /** The native rollback of workspace `name`, whose lease `leaseFd` holds (kept open). */
  _rollback(name: string, leaseFd: number, checkpoint: string, signal: AbortSignal | undefined): Promise<RollbackResult>
}

/**
 * Calls still running, so that close()/dispose() wait for them before the fds they use are closed. A count, not a
 * set of promises: begin()/end() cost no promise reaction on the hot path (mapNative folds them into the call's
 * own reaction).
 */
export class InFlight {
  #count = 0
  #waiters: (() => void)[] = []
  get busy(): boolean {
    return this.#count > 0
  }
  begin(): void {
    this.#count++
  }
  end(): void {
    if (--this.#count > 0) return
    const waiters = this.#waiters
    this.#waiters = []
    for (const wake of waiters) wake()
  }
  track<T>(p: Promise<T>): Promise<T> {
    this.begin()
    const done = () => this.end()
    p.then(done, done)
    return p
  }
  /**
   * A native call's promise `p`, counted until it settles, its value mapped by `map` and its rejection named by
   * fromNative, all in one promise reaction (track() plus call() take two; this is the hot path of an
   * empty allocate and of Workspace.clone).
   */
  mapNative<T, R>(p: Promise<T>, map: (value: T) => R): Promise<R> {
    this.begin()
    return p.then(
      (value) => {
        this.end()
        return map(value)
      },
      (e: unknown) => {
        this.end()
        throw fromNative(e)
      },
    )
  }
  /** Resolves once no call is running (calls begun meanwhile included). */
  idle(): Promise<void> {
    return this.#count === 0 ? Promise.resolve() : new Promise((resolve) => this.#waiters.push(resolve))
  }
}

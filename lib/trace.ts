/**
 * What vmspace shows from outside: `diagnostics_channel` tracing channels (one per operation) and `NODE_DEBUG=vmspace`
 * lines through `util.debuglog`. Both cost one check per call when nobody listens: no context object, no timer,
 * no extra promise (see bench/run.mjs, section "trace").
 */
import * as dc from 'node:diagnostics_channel'
import { performance } from 'node:perf_hooks'
import { debuglog } from 'node:util'
import type { CloneKind, CloneMethod, CloneResult, SweepReport } from './types.js'

/**
 * Fields of every trace context. `tracePromise` adds `result` (the value the call resolved with) before
 * `asyncStart`/`asyncEnd`, or `error` (what it rejected with) before `error`.
 */
export interface TraceContext {
  /** The value the call resolved with (in `asyncStart`/`asyncEnd` of a call that succeeded). */
  result?: unknown
  /** What the call rejected with (from the `error` event on). */
  error?: unknown
}

/** `vmspace:allocate`: Pool.allocate(). `id`, `name`, `retries`, `files`, `bytes`, `method` are set once it succeeds. */
export interface AllocateTrace extends TraceContext {
  /** The pool's root directory. */
  root: string
  /** The pool's workspace name prefix. */
  prefix: string
  /** The new workspace's id (32 hex characters). */
  id?: string
  /** The new workspace's directory name, `${prefix}-${id}`. */
  name?: string
  /** Names drawn again because the one drawn existed (0 almost always). */
  retries?: number
  /** Regular files the template cloned. */
  files?: number
  /** Their logical bytes. */
  bytes?: number
  /** How the template's data arrived; absent without a template. */
  method?: CloneMethod
}

/** `vmspace:clone`: clone() and Workspace.clone(). `path`, `kind`, `method`, `files`, `bytes` are set once it succeeds. */
export interface CloneTrace extends TraceContext {
  /** The pool's root directory (Workspace.clone only). */
  root?: string
  /** The workspace's id (Workspace.clone only). */
  id?: string
  /** The `source` argument as passed. */
  source: unknown
  /** The `dest` argument as passed (workspace-relative for Workspace.clone; undefined: the source's basename). */
  dest: unknown
  /** Absolute path of the destination. */
  path?: string
  /** A regular file or a directory tree. */
  kind?: CloneKind
  /** How the data arrived. */
  method?: CloneMethod
  /** Regular files cloned. */
  files?: number
  /** Their logical bytes. */
  bytes?: number
}

/** `vmspace:dispose`: Workspace.dispose() (its first call; later calls return the first call's promise). */
export interface DisposeTrace extends TraceContext {
  /** The pool's root directory. */
  root: string
  /** The workspace's id. */
  id: string
  /** The workspace's directory name. */
  name: string
}

/** `vmspace:sweep`: Pool.sweep(). The counts are set once it succeeds. */
export interface SweepTrace extends TraceContext {
  /** The pool's root directory. */
  root: string
  /** The `options` argument as passed. */
  options: unknown
  /** Entries reclaimed. */
  reclaimed?: number
  /** Bytes they freed (0 in a dry run). */
  bytes?: number
  /** Published workspaces left alone because their lease is held. */
  live?: number
  /** Entries whose removal failed. */
  failed?: number
  /** Lease files removed whose workspace was gone. */
  leasesRemoved?: number
  /** Entries named like workspaces without a lease file, left alone. */
  foreign?: number
}

/** `vmspace:lock`: lockFile() (and so the lock of updateJsonFile()). `waited` and `waitMs` are set once it is granted. */
export interface LockTrace extends TraceContext {
  /** The `path` argument as passed. */
  path: unknown
  /** The `options` argument as passed. */
  options: unknown
  /** False when the lock was got at once: nothing of this thread ahead in line, and the first, non-blocking try got it. */
  waited?: boolean
  /** Milliseconds from the call to the grant (`performance.now()` clock). */
  waitMs?: number
}

type Channel<C extends object> = dc.TracingChannel<unknown, C> & {
  start: dc.Channel
  end: dc.Channel
  asyncStart: dc.Channel
  asyncEnd: dc.Channel
  error: dc.Channel
}

const debug = debuglog('vmspace')

function channel<C extends object>(name: string): { name: string; channel: Channel<C> } {
  return { name, channel: dc.tracingChannel(name) as Channel<C> }
}

export const allocateChannel = channel<AllocateTrace>('vmspace:allocate')
export const cloneChannel = channel<CloneTrace>('vmspace:clone')
export const disposeChannel = channel<DisposeTrace>('vmspace:dispose')
export const sweepChannel = channel<SweepTrace>('vmspace:sweep')
export const lockChannel = channel<LockTrace>('vmspace:lock')

// TracingChannel.hasSubscribers is Node 20.13+; its five channels answer on every Node 20.
function subscribed(c: Channel<object>): boolean {
  return (
    c.start.hasSubscribers || c.end.hasSubscribers || c.asyncStart.hasSubscribers || c.asyncEnd.hasSubscribers || c.error.hasSubscribers
  )
}

/**
 * Runs `run` as one traced operation. With no subscriber and NODE_DEBUG without `vmspace`, it is `run(undefined)`
 * and nothing more. Otherwise `make()` builds the context, `run` may add fields to it, and `finish` adds the
 * result's fields before the promise settles (so that `asyncStart`/`asyncEnd` see them).
 */
export function traced<C extends object, T>(
  op: { name: string; channel: Channel<C> },
  make: () => C,
  run: (context: C | undefined) => Promise<T>,
  finish?: (context: C, result: T) => void,
): Promise<T> {
  const listening = subscribed(op.channel as Channel<object>)
  if (!listening && !debug.enabled) return run(undefined)
  const context = make()
  const t0 = performance.now()
  const body = () =>
    run(context).then((result) => {
      finish?.(context, result)
      return result
    })
  const p = listening ? op.channel.tracePromise(body, context) : body()
  if (debug.enabled) {
    const fields = () => {
      const { result: _r, error: _e, ...rest } = context as TraceContext
      try {
        return JSON.stringify(rest)
      } catch {
        return '(fields not serialisable)' // a caller's options with a cycle or a BigInt: the line must not throw
      }
    }
    p.then(
      () => debug('%s %s %sms', op.name.slice('vmspace:'.length), fields(), (performance.now() - t0).toFixed(2)),
      (e: { code?: string; message?: string }) =>
        debug('%s %s failed %s after %sms', op.name.slice('vmspace:'.length), fields(), e?.code ?? e?.message ?? String(e), (performance.now() - t0).toFixed(2)),
    )
  }
  return p
}

/** Adds a successful allocate's fields (`ws`: the new Workspace, by the members read here). */
export function allocateResult(t: AllocateTrace, ws: { id: string; name: string; template: CloneResult[] }, retries: number): void {
  t.id = ws.id
  t.name = ws.name
  t.retries = retries
  t.files = ws.template.reduce((n, c) => n + c.files, 0)
  t.bytes = ws.template.reduce((n, c) => n + c.bytes, 0)
  const methods = new Set(ws.template.map((c) => c.method))
  if (methods.size) t.method = methods.size === 1 ? [...methods][0] : 'mixed'
}

/** Adds a successful clone's fields. */
export function cloneResult(t: CloneTrace, r: CloneResult): void {
  t.path = r.path
  t.kind = r.kind
  t.method = r.method
  t.files = r.files
  t.bytes = r.bytes
}

/** Adds a successful sweep's counts. */
export function sweepResult(t: SweepTrace, r: SweepReport): void {
  t.reclaimed = r.reclaimed.length
  t.bytes = r.reclaimed.reduce((n, e) => n + e.bytes, 0)
  t.live = r.live
  t.failed = r.failed.length
  t.leasesRemoved = r.leasesRemoved
  t.foreign = r.foreign.length
}

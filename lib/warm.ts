/**
 * The warm reserve (docs/warm.md): `count` workspaces built ahead of time from one template, each a
 * staging entry this process leases, so that an allocate() of that template only publishes one. The native side
 * (native/core/warm.cc) builds an entry, checks at hand-out that the template's sources are as they were before it
 * was built, and publishes or removes it; this class keeps the entries and decides when to build.
 */
import type { JsonMembers, NativeAllocateResult, WarmHandle } from './binding.js'
import { fromNative } from './errors.js'
import type { VmspaceError } from './errors.js'
import type { WarmStats } from './types.js'

export interface WarmOps {
  build(): Promise<WarmHandle>
  /** The published workspace, or null when the entry was stale (it is then left for discard). */
  take(entry: WarmHandle, info: JsonMembers): Promise<NativeAllocateResult | null>
  discard(entry: WarmHandle): Promise<void>
}

// After a failed build the next one waits, doubling from 100 ms to 30 s, so that a template that is gone does not
// keep a thread and the disk busy; allocate() of it meanwhile builds fresh and reports the error itself.
const FIRST_BACKOFF_MS = 100
const MAX_BACKOFF_MS = 30_000

// Every reserve not yet closed, and through its ops its pool: a pool the program no longer references keeps its
// reserve's leases (and the entries stay staging entries of a live process) until close() or the process ends,
// instead of dropping them whenever the garbage collector runs.
const open = new Set<WarmReserve>()

export class WarmReserve {
  readonly #ops: WarmOps
  readonly #key: string
  readonly #ready: WarmHandle[] = []
  #building: Promise<void> | undefined
  #timer: NodeJS.Timeout | undefined
  #backoffMs = 0
  #closed = false
  readonly #discards = new Set<Promise<void>>()
  readonly #stats: WarmStats

  /** `key` identifies the allocate() calls this reserve serves (see matches()). */
  constructor(ops: WarmOps, key: string, count: number) {
    this.#ops = ops
    this.#key = key
    this.#stats = { count, ready: 0, hits: 0, misses: 0, stale: 0, built: 0, buildFailures: 0, buildMs: 0 }
    open.add(this)
  }

  /** The key of an allocate() call: template directory, map entries (in any order) and mode. */
  static key(dir: string, entries: [string, string][], mode: number): string {
    return JSON.stringify([dir, [...entries].sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0)), mode])
  }

  matches(key: string): boolean {
    return !this.#closed && key === this.#key
  }

  stats(): WarmStats {
    const s = { ...this.#stats, ready: this.#ready.length }
    if (!s.lastError) delete s.lastError
    return s
  }

  /**
   * A published workspace from the reserve, or undefined when it has none that is fresh (the caller then builds
   * one). A stale entry is removed in the background, off the caller's path. Errors: as publishing (the entry is
   * then removed).
   */
  async take(info: JsonMembers): Promise<NativeAllocateResult | undefined> {
    try {
      while (this.#ready.length) {
        const entry = this.#ready.shift()!
        const r = await this.#ops.take(entry, info)
        if (r) {
          this.#stats.hits++
          return r
        }
        this.#stats.stale++
        this.#discard(entry)
      }
      this.#stats.misses++
      return undefined
    } finally {
      // Only once the caller has its workspace: a build started alongside would compete with the hand-out (the
      // disk, the journal, 2 cores). Called here, its copy began before this promise reached the caller, and ran
      // inside allocate() in its slowest calls (perf); setImmediate runs after the caller's own continuation.
      setImmediate(() => this.refill())
    }
  }

  /** Starts building, one entry at a time, until `count` are ready (nothing while a build or back-off runs). */
  refill(): void {
    if (this.#closed || this.#building || this.#timer || this.#ready.length >= this.#stats.count) return
    this.#building = this.#fill().finally(() => {
      this.#building = undefined
    })
  }

  async #fill(): Promise<void> {
    while (!this.#closed && this.#ready.length < this.#stats.count) {
      const t0 = performance.now()
      let entry: WarmHandle
      try {
        entry = await this.#ops.build()
      } catch (e) {
        this.#stats.buildFailures++
        this.#stats.lastError = fromNative(e) as VmspaceError
        this.#backoffMs = Math.min(MAX_BACKOFF_MS, Math.max(FIRST_BACKOFF_MS, this.#backoffMs * 2))
        if (!this.#closed) {
          // unref: a reserve waiting to retry keeps no process alive.
          this.#timer = setTimeout(() => {
            this.#timer = undefined
            this.refill()
          }, this.#backoffMs).unref()
        }
        return
      }
      if (this.#closed) {
        await this.#ops.discard(entry).catch(() => {})  // a failed removal leaves an unleased entry: a sweep's
        return
      }
      this.#stats.built++
      this.#stats.buildMs += performance.now() - t0
      this.#stats.lastError = undefined
      this.#backoffMs = 0
      this.#ready.push(entry)
    }
  }

  #discard(entry: WarmHandle): void {
    // A removal that fails leaves the entry with its lease dropped (the handle closes it): a sweep reclaims it.
    const p: Promise<void> = this.#ops.discard(entry).catch(() => {}).finally(() => this.#discards.delete(p))
    this.#discards.add(p)
  }

  /** Stops refilling, waits for a running build, and removes every entry. Idempotent. */
  async close(): Promise<void> {
    this.#closed = true
    if (this.#timer) clearTimeout(this.#timer)
    this.#timer = undefined
    await this.#building
    for (const entry of this.#ready.splice(0)) this.#discard(entry)
    while (this.#discards.size) await Promise.allSettled([...this.#discards])
    open.delete(this)
  }
}

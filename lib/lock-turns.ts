/**
 * This thread's lock requests (lockFile and updateJsonFile): a queue of turns per path, so that requests of one
 * thread wait for each other here (one native open and wait in flight per path, the rest on a promise: no fd, no
 * thread each), and the async context of each request, so that a request made inside the critical section of a
 * lock it would wait for is refused instead (docs/locks.md, "Waiting in one process").
 */
import { AsyncLocalStorage } from 'node:async_hooks'
import { performance } from 'node:perf_hooks'
import { AbortError, vmspaceError } from './errors.js'

type TurnState = 'queued' | 'inside' | 'held' | 'leaving' | 'left'

// The requests on one path of this thread: those inside (admitted to lock natively, all shared or one exclusive),
// how many of those are not granted yet, and those queued behind them in call order.
interface PathTurns {
  inside: number
  shared: boolean
  ungranted: number
  queue: Turn[]
}

const paths = new Map<string, PathTurns>()

/**
 * One request's place among this thread's requests on its path. queued → inside (its turn: it may lock natively)
 * → held (granted: a critical section runs) → leaving (released; the native close is under way) → left.
 */
export class Turn {
  readonly path: string
  readonly shared: boolean
  #state: TurnState = 'queued'
  #enter!: () => void
  /** Resolves when the turn comes (never rejects; see waitTurn for the timeout and the signal). */
  readonly entered = new Promise<void>((resolve) => (this.#enter = resolve))

  constructor(path: string, shared: boolean) {
    this.path = path
    this.shared = shared
  }

  /** Whether a critical section of this request runs: a request that would wait for it, made there, waits on itself. */
  get held(): boolean {
    return this.#state === 'held'
  }

  /** Whether its lock was released (or it left the queue without one). */
  get released(): boolean {
    return this.#state === 'leaving' || this.#state === 'left'
  }

  /** Whether it is (or was) this request's turn. */
  get inside(): boolean {
    return this.#state !== 'queued'
  }

  /** queued → inside: its turn has come (admit). */
  enter(): void {
    const t = paths.get(this.path)!
    this.#state = 'inside'
    t.inside++
    t.ungranted++
    t.shared = this.shared
    this.#enter()
  }

  /** The lock is granted: shared requests queued behind a shared one may come in beside it. */
  hold(): void {
    if (this.#state !== 'inside') return
    this.#state = 'held'
    const t = paths.get(this.path)!
    t.ungranted--
    admit(t)
  }

  /** The release has begun: this context may ask for the lock again (it queues behind the release). */
  leaving(): void {
    if (this.#state === 'held') this.#state = 'leaving'
  }

  /** Leaves the queue or the turn (once the lock's fd is closed); admits who comes next. Idempotent. */
  leave(): void {
    const was = this.#state
    if (was === 'left') return
    this.#state = 'left'
    const t = paths.get(this.path)!
    if (was === 'queued') t.queue.splice(t.queue.indexOf(this), 1)
    else {
      t.inside--
      if (was === 'inside') t.ungranted--
    }
    admit(t)
    if (t.inside === 0 && t.queue.length === 0) paths.delete(this.path)
  }
}

// Lets in whoever may come in now: the first in line when nobody is inside; and, while only granted shared locks
// are inside, every queued shared request, even past a queued exclusive one, as flock(2) grants them (so a shared
// request inside a shared critical section never waits for an exclusive one that waits for that section).
function admit(t: PathTurns): void {
  if (t.inside === 0 && t.queue.length > 0) t.queue.shift()!.enter()
  if (t.inside > 0 && t.shared && t.ungranted === 0) {
    const shared = t.queue.filter((w) => w.shared)
    t.queue = t.queue.filter((w) => !w.shared)
    for (const w of shared) w.enter()
  }
}

/** A new request on `path` (absolute), in line behind this thread's earlier ones, or inside at once when it may be. */
export function queueTurn(path: string, shared: boolean): Turn {
  let t = paths.get(path)
  if (!t) paths.set(path, (t = { inside: 0, shared, ungranted: 0, queue: [] }))
  const turn = new Turn(path, shared)
  t.queue.push(turn)
  admit(t)
  return turn
}

/**
 * Waits for `turn` to come, or rejects with `ERR_LOCK_TIMEOUT` (after `timeoutMs`) or an AbortError (`signal`),
 * leaving the queue. Resolves with the ms left of `timeoutMs` (undefined: no limit).
 */
export async function waitTurn(turn: Turn, timeoutMs: number | undefined, signal: AbortSignal | undefined): Promise<number | undefined> {
  if (turn.inside) return timeoutMs
  const t0 = performance.now()
  let timer: NodeJS.Timeout | undefined
  let onAbort: (() => void) | undefined
  try {
    await Promise.race([
      turn.entered,
      new Promise<never>((_, reject) => {
        if (timeoutMs !== undefined)
          timer = setTimeout(() => reject(timeoutError(turn.path, timeoutMs)), timeoutMs)
        onAbort = () => reject(new AbortError(signal!.reason))
        signal?.addEventListener('abort', onAbort, { once: true })
      }),
    ])
  } catch (e) {
    turn.leave() // a turn that came as the timer fired is given back, to the next in line
    throw e
  } finally {
    clearTimeout(timer)
    if (onAbort) signal?.removeEventListener('abort', onAbort)
  }
  return timeoutMs === undefined ? undefined : Math.max(0, Math.ceil(timeoutMs - (performance.now() - t0)))
}

/** `ERR_LOCK_TIMEOUT` for `path` after `timeoutMs`. */
export function timeoutError(path: string, timeoutMs: number): Error {
  return vmspaceError('ERR_LOCK_TIMEOUT', `the lock on ${path} was not granted within ${timeoutMs} ms`, { path, syscall: 'flock' })
}

// The requests the current async context made (lockFile) or runs inside (updateJsonFile's mutate).
const requests = new AsyncLocalStorage<readonly Turn[]>()

/**
 * Whether a request on `path` (`shared` or not) made here would wait on itself: the current async context runs
 * inside a critical section of a lock on that path that it excludes (anything beside an exclusive lock, an
 * exclusive request beside a shared one).
 */
export function waitsOnItself(path: string, shared: boolean): boolean {
  return requests.getStore()?.some((r) => r.path === path && r.held && !(r.shared && shared)) ?? false
}

// The current context's requests not released yet (a context that locks in a loop keeps no list of old ones), and `turn`.
const withTurn = (turn: Turn) => [...(requests.getStore() ?? []).filter((r) => !r.released), turn]

/**
 * Marks the caller's async context, and so the continuation of its `await lockFile(…)`, as the one that made `turn`.
 * Called in the caller's synchronous frame: that frame's later code, and what it starts, is marked too (docs/locks.md).
 */
export function enterTurn(turn: Turn): void {
  requests.enterWith(withTurn(turn))
}

/** Runs `fn` in a context inside `turn`'s critical section (updateJsonFile's mutate), and only `fn`. */
export function runInTurn<T>(turn: Turn, fn: () => T): T {
  return requests.run(withTurn(turn), fn)
}

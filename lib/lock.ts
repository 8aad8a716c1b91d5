/**
 * Cross-process locks (flock(2)). The locked JSON index built on them is lib/json-file.ts.
 *
 * A lock wait never occupies the libuv thread pool: the first try is non-blocking, and a wait runs on a thread
 * of its own (native/binding/lock.cc, LockWait), so any number of waiters leave `fs` calls working.
 */
import { native, type WaitHandle } from './binding.js'
import * as os from 'node:os'
import { performance } from 'node:perf_hooks'
import { threadId } from 'node:worker_threads'
import { abortSignal, absolutePath, boolean, integerIn, optionsObject } from './args.js'
import { AbortError, call, errnoError, fromNative, vmspaceError } from './errors.js'
import { enterTurn, queueTurn, timeoutError, waitsOnItself, waitTurn, type Turn } from './lock-turns.js'
import { lockChannel, traced, type LockTrace } from './trace.js'

/** Options of {@link lockFile}. */
export interface LockOptions {
  /** A shared (read) lock: shared locks coexist; an exclusive one excludes all others. Default false. */
  shared?: boolean
  /** Wait for the lock (default true); with false, a held lock fails at once with `ERR_LOCK_HELD`. */
  wait?: boolean
  /** Give up after this many ms with `ERR_LOCK_TIMEOUT`. Default: wait as long as it takes. */
  timeoutMs?: number
  /** Abort the wait: rejects with an AbortError, and the lock is never left held. */
  signal?: AbortSignal
}

/** A held flock(2) lock. Released by release(), `await using`, or the kernel when the process dies. */
export class FileLock implements AsyncDisposable {
  /** Absolute path of the lock file. */
  readonly path: string
  /** Whether the lock is shared (else exclusive). */
  readonly shared: boolean
  #fd: number
  #turn: Turn | undefined
  #released: Promise<void> | undefined

  // Private in the published types (locks come from lockFile()); lib/ makes them through newFileLock.
  private constructor(path: string, shared: boolean, fd: number, turn: Turn | undefined) {
    this.path = path
    this.shared = shared
    this.#fd = fd
    this.#turn = turn
  }

  /** Releases the lock (closes its fd). Idempotent. */
  release(): Promise<void> {
    if (!this.#released) {
      const turn = this.#turn
      turn?.leaving()
      // The next request of this thread comes in once the fd is closed, so that the registry never sees both.
      this.#released = call(native.lockRelease(this.#fd)).finally(() => turn?.leave())
    }
    return this.#released
  }

  /** release(), for `await using lock = await lockFile(…)`. */
  [Symbol.asyncDispose](): Promise<void> {
    return this.release()
  }
}

// The fd of each lock, for updateJsonFile (which reads the file it locked through it); not on the public class.
const lockFds = new WeakMap<FileLock, number>()

// `turn`: lockFile's place in this thread's queue, left when the lock is released (updateJsonFile keeps its own).
const newFileLock = (path: string, shared: boolean, fd: number, turn?: Turn) => {
  const lock = new (FileLock as unknown as new (path: string, shared: boolean, fd: number, turn: Turn | undefined) => FileLock)(path, shared, fd, turn)
  lockFds.set(lock, fd)
  return lock
}

/** The fd a lock holds (lib/ only). */
export function lockFd(lock: FileLock): number {
  return lockFds.get(lock)!
}

const EDEADLK = os.constants.errno.EDEADLK

/** The lock registry's owner of this thread's requests (native/core/lock.h, lockClaim): two threads' requests wait in flock. */
export const lockOwner = threadId + 1

/**
 * `ERR_LOCK_REENTRANT` for `path`, shaped as the addon's (errno EDEADLK, syscall flock, cause the errno): `found`
 * by the async context (the call runs inside a critical section of a lock on `path` that it would wait for), or by
 * the addon's registry (this thread holds the file under another name).
 */
export function reentrantError(path: string, found: 'context' | 'registry' = 'context'): Error {
  return fromNative({
    code: 'ERR_LOCK_REENTRANT',
    errno: -EDEADLK,
    description: 'Resource deadlock avoided',
    syscall: 'flock',
    path,
    detail:
      found === 'context'
        ? `this call runs inside a critical section of a lock on ${path} that it would wait for: it would wait on itself`
        : REGISTRY_DETAIL(path),
  }) as Error
}

// As native/core/lock.cc words it (throwReentrant).
const REGISTRY_DETAIL = (path: string) =>
  `this thread already holds or waits for a lock on the file at ${path} (under this name or another); waiting for it here would wait on itself`

const CANCEL_REPEAT_MS = 10

/** `options.timeoutMs` (of lockFile and updateJsonFile): undefined (wait as long as it takes) or whole ms a timer can hold. */
export function timeoutOption(value: unknown): number | undefined {
  return value === undefined ? undefined : integerIn('options.timeoutMs', value, 0, 2 ** 31 - 1, 0)
}

/**
 * Takes a flock(2) lock on `path`, made if missing (mode 0600) and never deleted (a waiter may hold it open). A
 * symlink at `path` is refused with `ELOOP` (syscall `open`, nothing made): the file is opened with O_NOFOLLOW.
 * The kernel releases a lock when its holder exits or is killed. Locks of two processes exclude each other; the
 * lock is on the file at `path` when granted: a lock file deleted or replaced while this call waited is dropped and
 * the new file is locked (waiting again if need be), so a waiter never ends up holding a dead inode beside whoever
 * locked the new file. Deleting a lock file that is held still lets the next caller in beside its holder: keep tmp
 * cleaners away from lock files (updateJsonFile needs no lock file, see there).
 *
 * Within one process, requests wait for each other as those of two processes do. This thread's requests on one
 * path take turns in call order (FIFO): only the first has a file open and a wait in flight, the others wait on a
 * promise (no fd, no thread each); `timeoutMs` and `signal` apply in the queue too, and a request that gives up
 * leaves it. Those of two worker_threads wait in flock(2), each on an open file description of its own. A shared
 * request is granted beside shared ones at once, even past a waiting exclusive one, as flock(2) grants it.
 *
 * A request that would wait on itself rejects at once with `ERR_LOCK_REENTRANT` (cause `EDEADLK`) and changes
 * nothing: one made inside a critical section of a lock on the same path that it excludes (any request beside an
 * exclusive lock; an exclusive one beside a shared lock), that is, in the async context that holds it: the code
 * after `await lockFile(path)`, and what it starts, until release() is called; or inside an updateJsonFile's
 * `mutate`. How: an AsyncLocalStorage, which each call sets in the caller's async context (enterWith), so that the
 * `await` carries it into the continuation; it counts from the grant until release(). What it cannot see
 * (docs/locks.md, "Waiting in one process"): the setting is made in the caller's synchronous frame, so the rest of
 * that frame and what it starts later count as inside too (a loop that starts handlers without awaiting them, whose
 * handler calls lockFile before its first await, has a later handler refused while an earlier one holds the lock:
 * start each handler in a context of its own, `queueMicrotask(() => void handle(job))`); a holder that awaits
 * something only another task (thread, process) does after taking the same lock waits for ever; and the queue is
 * per path string: one thread locking one file under two names (a hard link, a symlinked directory) at once is
 * refused by the addon's registry (same device and inode, same thread), so lock a file by one path.
 *
 * Throws `ERR_LOCK_HELD` (wait: false), `ERR_LOCK_TIMEOUT`, `ERR_LOCK_REENTRANT`, an AbortError, the errno of
 * open/flock (`ESTALE` when the file was replaced 64 times in a row as it was locked), of fstat/stat, or `EAGAIN`
 * (syscall `pthread_create`) when no thread can be started for a wait (RLIMIT_NPROC). Unknown option keys are
 * `ERR_INVALID_ARG_VALUE`.
 *
 * The first lockFile call that has to wait installs a handler (empty, without `SA_RESTART`) for one real-time
 * signal, the first of `SIGRTMIN+4`…`SIGRTMAX` with no handler yet, process-wide and for the process's life:
 * cancelling a wait (abort, `timeoutMs`) sends it to the waiting thread so that its flock(2) returns `EINTR`.
 * To keep a real-time signal for yourself, install its handler before the first wait; with none free, waits
 * poll every 2 ms instead (docs/locks.md, "The lock-wait signal").
 */
export function lockFile(path: string, options?: LockOptions): Promise<FileLock> {
  let run: (t: LockTrace | undefined) => Promise<FileLock>
  try {
    run = startLockFile(path, options)
  } catch (e) {
    run = () => Promise.reject(e)
  }
  // The context is set above, in the caller's synchronous frame (the caller's `await` must see it), whatever the
  // trace runs the rest in (a subscriber's bound stores run it inside AsyncLocalStorage.run).
  return traced(lockChannel, () => ({ path, options }), run)
}

/**
 * lockFile's synchronous part, in the caller's frame: checks the arguments, refuses a request that would wait on
 * itself, queues it, and sets the caller's context. Returns the rest, to run traced.
 */
function startLockFile(path: string, options: LockOptions | undefined): (t: LockTrace | undefined) => Promise<FileLock> {
  const p = absolutePath('path', path)
  const o = optionsObject<LockOptions>('options', options, { shared: true, wait: true, timeoutMs: true, signal: true })
  const shared = boolean('options.shared', o.shared, false)
  const wait = boolean('options.wait', o.wait, true)
  const timeoutMs = timeoutOption(o.timeoutMs)
  const signal = abortSignal('options.signal', o.signal)
  if (signal?.aborted) throw new AbortError(signal.reason)
  if (waitsOnItself(p, shared)) throw reentrantError(p)
  const turn = queueTurn(p, shared)
  enterTurn(turn)
  return (t) => lockInTurn(p, { shared, wait, timeoutMs, signal, create: true, owner: lockOwner }, turn, t)
}

/** lockFile once queued: waits for this thread's earlier requests on `p`, then locks natively. */
async function lockInTurn(p: string, r: LockRequest, turn: Turn, t: LockTrace | undefined): Promise<FileLock> {
  const t0 = t && performance.now()
  const queued = !turn.inside
  try {
    // A request of this thread holds the lock (or is ahead): held, as another process's lock would be.
    if (queued && (!r.wait || r.timeoutMs === 0)) throw heldError(p, r.wait)
    const timeoutMs = await waitTurn(turn, r.timeoutMs, r.signal)
    const lock = await acquireLock(p, { ...r, timeoutMs }, t, turn)
    turn.hold()
    if (t && queued) Object.assign(t, { waited: true, waitMs: performance.now() - t0! })
    return lock
  } catch (e) {
    turn.leave()
    throw e
  }
}

/** `ERR_LOCK_HELD` (`wait` false) or `ERR_LOCK_TIMEOUT` (`timeoutMs` 0) for a lock on `p` that is held now. */
function heldError(p: string, wait: boolean): Error {
  return vmspaceError(!wait ? 'ERR_LOCK_HELD' : 'ERR_LOCK_TIMEOUT', `the lock on ${p} is held`, {
    path: p,
    syscall: 'flock',
    cause: errnoError(11 /* EWOULDBLOCK */, 'flock', p),
  })
}

/** What {@link acquireLock} takes: lockFile's options, checked, and the request's kind (native/core/lock.h). */
export interface LockRequest {
  shared: boolean
  wait: boolean
  timeoutMs: number | undefined
  signal: AbortSignal | undefined
  /** Make a missing file (lockFile); without, a missing file is ENOENT (syscall open). */
  create: boolean
  /** The registry's owner of the request: {@link lockOwner} (two threads' requests wait on each other in flock). */
  owner: number
}

/**
 * The native lock on the absolute path `p` with checked options, for a request whose turn has come (lib/ only:
 * lockFile, and updateJsonFile for its data file). `turn`: lockFile's, left when the lock is released.
 */
export async function acquireLock(p: string, r: LockRequest, t: LockTrace | undefined, turn?: Turn): Promise<FileLock> {
  const t0 = t && performance.now()
  // The lock, once granted (`waited`: after a wait), with the grant's fields for the trace.
  const grant = (fd: number, waited: boolean) => {
    if (t) Object.assign(t, { waited, waitMs: performance.now() - t0! })
    return newFileLock(p, shared, fd, turn)
  }
  const { shared, wait, timeoutMs, signal } = r
  if (signal?.aborted) throw new AbortError(signal.reason)

  const { fd, acquired } = await call(native.lockOpen({ path: p, shared, create: r.create, owner: r.owner }))
  if (acquired) {
    if (signal?.aborted) {
      await call(native.lockRelease(fd))
      throw new AbortError(signal.reason)
    }
    return grant(fd, false)
  }
  if (!wait || timeoutMs === 0) {
    await call(native.lockRelease(fd))
    throw heldError(p, wait)
  }
  return waitForLock(p, shared, fd, timeoutMs, signal, grant)
}

/**
 * The wait for a lock that lockOpen found held: a thread of its own blocks in flock(2) on `fd` (LockWait), the
 * timeout and the signal cancel it. `grant` makes the FileLock of the fd that got it.
 */
function waitForLock(
  p: string,
  shared: boolean,
  fd: number,
  timeoutMs: number | undefined,
  signal: AbortSignal | undefined,
  grant: (fd: number, waited: boolean) => FileLock,
): Promise<FileLock> {
  return new Promise<FileLock>((resolve, reject) => {
    let cancelledBy: 'timeout' | 'abort' | undefined
    let repeat: NodeJS.Timeout | undefined
    let timer: NodeJS.Timeout | undefined
    let handle: WaitHandle | undefined = undefined
    const cancel = (why: 'timeout' | 'abort') => {
      if (cancelledBy) return
      cancelledBy = why
      native.lockCancel(handle!)
      // The signal that interrupts the wait can arrive just before the thread blocks: repeat until it answers.
      repeat = setInterval(() => native.lockCancel(handle!), CANCEL_REPEAT_MS)
    }
    const onAbort = () => cancel('abort')
    // Closes the fd (which drops any lock it got), then rejects.
    const releaseAndReject = (fd: number, error: () => Error) => call(native.lockRelease(fd)).then(() => reject(error()), reject)
    // `held`: the wait's fd, a new one when the lock file was replaced while it waited.
    const onDone = (errno: number, held: number, syscall: string) => {
      clearTimeout(timer)
      clearInterval(repeat)
      signal?.removeEventListener('abort', onAbort)
      if (errno === 0 && !cancelledBy) return resolve(grant(held, true))
      // Granted just as it was cancelled, or failed.
      void releaseAndReject(held, () =>
        cancelledBy === 'abort'
          ? new AbortError(signal?.reason)
          : cancelledBy === 'timeout'
            ? timeoutError(p, timeoutMs!)
            : errno === EDEADLK
              ? reentrantError(p, 'registry') // the file was replaced by one this thread holds
              : errnoError(errno, syscall, p),
      )
    }
    try {
      handle = native.lockWait({ fd, path: p, shared }, onDone)
    } catch (e) {
      // No thread could be started for the wait (EAGAIN: RLIMIT_NPROC or the kernel's limit); nothing waits.
      void releaseAndReject(fd, () => errnoError((e as { errno?: number }).errno ?? 11 /* EAGAIN */, 'pthread_create', p))
      return
    }
    if (timeoutMs !== undefined) timer = setTimeout(() => cancel('timeout'), timeoutMs)
    signal?.addEventListener('abort', onAbort, { once: true })
    // An abort while the lock file was being opened fired before the listener existed.
    if (signal?.aborted) onAbort()
  })
}

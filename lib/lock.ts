/**
 * Cross-process locks (flock(2)). The locked JSON index built on them is lib/json-file.ts.
 *
 * A lock wait never occupies the libuv thread pool: the first try is non-blocking, and a wait runs on a thread
 * of its own (native/binding/lock.cc, LockWait), so any number of waiters leave `fs` calls working.
 */
import { native, type WaitHandle } from './binding.js'
import * as os from 'node:os'
import { performance } from 'node:perf_hooks'
import { abortSignal, absolutePath, boolean, integerIn, optionsObject } from './args.js'
import { AbortError, call, errnoError, fromNative, vmspaceError } from './errors.js'
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
  #released: Promise<void> | undefined

  // Private in the published types (locks come from lockFile()); lib/ makes them through newFileLock.
  private constructor(path: string, shared: boolean, fd: number) {
    this.path = path
    this.shared = shared
    this.#fd = fd
  }

  /** Releases the lock (closes its fd). Idempotent. */
  release(): Promise<void> {
    this.#released ??= call(native.lockRelease(this.#fd))
    return this.#released
  }

  /** release(), for `await using lock = await lockFile(…)`. */
  [Symbol.asyncDispose](): Promise<void> {
    return this.release()
  }
}

// The fd of each lock, for updateJsonFile (which reads the file it locked through it); not on the public class.
const lockFds = new WeakMap<FileLock, number>()

const newFileLock = (path: string, shared: boolean, fd: number) => {
  const lock = new (FileLock as unknown as new (path: string, shared: boolean, fd: number) => FileLock)(path, shared, fd)
  lockFds.set(lock, fd)
  return lock
}

/** The fd a lock holds (lib/ only). */
export function lockFd(lock: FileLock): number {
  return lockFds.get(lock)!
}

const EDEADLK = os.constants.errno.EDEADLK

/** `ERR_LOCK_REENTRANT` for `path`, shaped as the addon's (errno EDEADLK, syscall flock, cause the errno). */
export function reentrantError(path: string): Error {
  return fromNative({
    code: 'ERR_LOCK_REENTRANT',
    errno: -EDEADLK,
    description: 'Resource deadlock avoided',
    syscall: 'flock',
    path,
    detail: `this process already holds or waits for a lock on ${path}; waiting for it here would wait on itself`,
  }) as Error
}

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
 * Within one process a lock is the process's: a lockFile call on a file (the same device and inode, whatever the
 * name) that this process already holds or waits for, from this thread or another worker_thread, or that an
 * updateJsonFile of this process is updating, rejects at once with `ERR_LOCK_REENTRANT` (cause `EDEADLK`) and
 * changes nothing: such a wait could only end if this process let go first, and when the holder is what the
 * caller awaits it never would. The one exception: a shared lock beside shared ones of this process is granted
 * (Linux's flock grants a shared lock whenever only shared ones are held, even with an exclusive one queued, so
 * it never waits on them). Once the lock is released, the file can be locked again.
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
  return traced(lockChannel, () => ({ path, options }), (t) => lockFileUntraced(path, options, t))
}

async function lockFileUntraced(path: string, options: LockOptions | undefined, t: LockTrace | undefined): Promise<FileLock> {
  const p = absolutePath('path', path)
  const o = optionsObject<LockOptions>('options', options, { shared: true, wait: true, timeoutMs: true, signal: true })
  const shared = boolean('options.shared', o.shared, false)
  const wait = boolean('options.wait', o.wait, true)
  const timeoutMs = timeoutOption(o.timeoutMs)
  const signal = abortSignal('options.signal', o.signal)
  return acquireLock(p, { shared, wait, timeoutMs, signal, create: true, owner: 0 }, t)
}

/** What {@link acquireLock} takes: lockFile's options, checked, and the request's kind (native/core/lock.h). */
export interface LockRequest {
  shared: boolean
  wait: boolean
  timeoutMs: number | undefined
  signal: AbortSignal | undefined
  /** Make a missing file (lockFile); without, a missing file is ENOENT (syscall open). */
  create: boolean
  /** 0 for lockFile; the thread's number + 1 for updateJsonFile (two threads' updates wait on each other). */
  owner: number
}

/** lockFile on the absolute path `p` with checked options (lib/ only: updateJsonFile locks its data file with it). */
export async function acquireLock(p: string, r: LockRequest, t: LockTrace | undefined): Promise<FileLock> {
  const t0 = t && performance.now()
  // The grant's fields for the trace: whether it had to wait, and how long the call took to get it.
  const granted = (waited: boolean) => {
    if (t) Object.assign(t, { waited, waitMs: performance.now() - t0! })
  }
  const { shared, wait, timeoutMs, signal } = r
  if (signal?.aborted) throw new AbortError(signal.reason)

  const { fd, acquired } = await call(native.lockOpen({ path: p, shared, create: r.create, owner: r.owner }))
  if (acquired) {
    if (signal?.aborted) {
      await call(native.lockRelease(fd))
      throw new AbortError(signal.reason)
    }
    granted(false)
    return newFileLock(p, shared, fd)
  }
  if (!wait || timeoutMs === 0) {
    await call(native.lockRelease(fd))
    throw vmspaceError(!wait ? 'ERR_LOCK_HELD' : 'ERR_LOCK_TIMEOUT', `the lock on ${p} is held`, {
      path: p,
      syscall: 'flock',
      cause: errnoError(11 /* EWOULDBLOCK */, 'flock', p),
    })
  }
  return waitForLock(p, shared, fd, timeoutMs, signal, granted)
}

/**
 * The wait for a lock that lockOpen found held: a thread of its own blocks in flock(2) on `fd` (LockWait), the
 * timeout and the signal cancel it. `granted` records the grant in the trace.
 */
function waitForLock(
  p: string,
  shared: boolean,
  fd: number,
  timeoutMs: number | undefined,
  signal: AbortSignal | undefined,
  granted: (waited: boolean) => void,
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
      if (errno === 0 && !cancelledBy) {
        granted(true)
        return resolve(newFileLock(p, shared, held))
      }
      // Granted just as it was cancelled, or failed.
      void releaseAndReject(held, () =>
        cancelledBy === 'abort'
          ? new AbortError(signal?.reason)
          : cancelledBy === 'timeout'
            ? vmspaceError('ERR_LOCK_TIMEOUT', `the lock on ${p} was not granted within ${timeoutMs} ms`, { path: p, syscall: 'flock' })
            : errno === EDEADLK
              ? reentrantError(p) // the file was replaced by one this process holds
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

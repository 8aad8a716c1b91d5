/**
 * Cross-process locks (flock(2)) and the locked JSON index (DESIGN.md, "Locked JSON index").
 *
 * A lock wait never occupies the libuv thread pool: the first try is non-blocking, and a wait runs on a thread
 * of its own (native/binding/lock.cc, LockWait), so any number of waiters leave `fs` calls working.
 */
import { TextDecoder } from 'node:util'
import { native, type WaitHandle } from './binding.js'
import { performance } from 'node:perf_hooks'
import { abortSignal, absolutePath, boolean, func, integerIn, invalidType, isPlainObject, oneOf, optionsObject } from './args.js'
import { AbortError, call, errnoError, vmspaceError, VmspaceError } from './errors.js'
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

const newFileLock = (path: string, shared: boolean, fd: number) =>
  new (FileLock as unknown as new (path: string, shared: boolean, fd: number) => FileLock)(path, shared, fd)

const CANCEL_REPEAT_MS = 10

/** `options.timeoutMs`: undefined (wait as long as it takes) or whole ms a timer can hold. */
function timeoutOption(value: unknown): number | undefined {
  return value === undefined ? undefined : integerIn('options.timeoutMs', value, 0, 2 ** 31 - 1, 0)
}

/**
 * Takes a flock(2) lock on `path`, made if missing (mode 0600) and never deleted (a waiter may hold it open).
 * Locks are per open file description: two lockFile calls in one process exclude each other, and the kernel
 * releases a lock when its holder exits or is killed. The lock is on the file at `path` when granted: a lock file
 * deleted or replaced while this call waited is dropped and the new file is locked (waiting again if need be), so
 * a waiter never ends up holding a dead inode beside whoever locked the new file. Deleting a lock file that is
 * held still lets the next caller in beside its holder: keep tmp cleaners away from lock files.
 * Throws `ERR_LOCK_HELD` (wait: false), `ERR_LOCK_TIMEOUT`, an AbortError, the errno of open/flock (`ESTALE` when
 * the file was replaced 64 times in a row as it was locked), of fstat/stat, or `EAGAIN` (syscall
 * `pthread_create`) when no thread can be started for a wait (RLIMIT_NPROC). Unknown option keys are
 * `ERR_INVALID_ARG_VALUE`.
 *
 * The first lockFile call that has to wait installs a handler (empty, without `SA_RESTART`) for one real-time
 * signal, the first of `SIGRTMIN+4`…`SIGRTMAX` with no handler yet, process-wide and for the process's life:
 * cancelling a wait (abort, `timeoutMs`) sends it to the waiting thread so that its flock(2) returns `EINTR`.
 * To keep a real-time signal for yourself, install its handler before the first wait; with none free, waits
 * poll every 2 ms instead (README, "The lock-wait signal").
 */
export function lockFile(path: string, options?: LockOptions): Promise<FileLock> {
  return traced(lockChannel, () => ({ path, options }), (t) => lockFileUntraced(path, options, t))
}

async function lockFileUntraced(path: string, options: LockOptions | undefined, t: LockTrace | undefined): Promise<FileLock> {
  const t0 = t && performance.now()
  // The grant's fields for the trace: whether it had to wait, and how long the call took to get it.
  const granted = (waited: boolean) => {
    if (t) Object.assign(t, { waited, waitMs: performance.now() - t0! })
  }
  const p = absolutePath('path', path)
  const o = optionsObject<LockOptions>('options', options, { shared: true, wait: true, timeoutMs: true, signal: true })
  const shared = boolean('options.shared', o.shared, false)
  const wait = boolean('options.wait', o.wait, true)
  const timeoutMs = timeoutOption(o.timeoutMs)
  const signal = abortSignal('options.signal', o.signal)
  if (signal?.aborted) throw new AbortError(signal.reason)

  const { fd, acquired } = await call(native.lockOpen(p, shared))
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

/** Options of {@link updateJsonFile}. */
export interface UpdateJsonOptions {
  /** fsync the directory after the rename too (the file itself is always fsynced before it). Default false. */
  durable?: boolean
  /** Give up waiting for the lock after this many ms (`ERR_LOCK_TIMEOUT`). */
  timeoutMs?: number
  /**
   * The type the index holds: `'object'` (default) or `'array'`. A file of another JSON type is
   * `ERR_CORRUPT_INDEX`; a `mutate` result that serialises to another type is a TypeError
   * (`ERR_INVALID_RETURN_VALUE`). Nothing is written in either case.
   */
  create?: 'object' | 'array'
  /**
   * Aborts the update: while waiting for the lock (as lockFile's `signal`), or up to the moment the write starts
   * (an abort during `mutate` is seen when it returns); the call then rejects with an AbortError and the file is
   * as it was. Once the write has started it completes (temp file and rename: the index is never partial) and the
   * call resolves with what was written.
   */
  signal?: AbortSignal
}

const utf8 = new TextDecoder('utf-8', { fatal: true })

/**
 * Read-modify-write of a JSON file that never loses an update: exclusive lock on `path + '.lock'` (a stable
 * inode: never the data file, which the rename replaces under waiting writers) → read → parse → `mutate(current)`
 * (may be async; `current` is undefined when the file is missing) → temp file (O_EXCL, same directory) → fsync →
 * rename over → fsync of the directory when `durable` → release. Returns what was written; when `mutate` returns
 * undefined nothing is written and the current value is returned (undefined for a missing file).
 * The replacement keeps the old file's mode and owner (where permitted); a new file gets 0666 less the umask.
 * Each write first removes the temps (`.<name>.tmp-<12 hex>`, regular files) that writers killed before their
 * rename left next to `path`: temps are made only under the lock, so no live writer owns one.
 * `mutate` must not update the same index again (it would wait for its own lock). A symlink at `path` is
 * replaced by a file: give the real path.
 * A file that is empty, not UTF-8, not JSON, or not of the declared type gives `ERR_CORRUPT_INDEX` (with `path`
 * and, where known, the byte `offset`) and is left as it is. A throwing `mutate` writes nothing, and so does an
 * abort before the write starts (AbortError; see {@link UpdateJsonOptions.signal}). The lock is released on
 * every path. Unknown option keys are `ERR_INVALID_ARG_VALUE`.
 */
export async function updateJsonFile<T>(
  path: string,
  mutate: (current: T | undefined) => T | undefined | Promise<T | undefined>,
  options?: UpdateJsonOptions,
): Promise<T> {
  const p = absolutePath('path', path)
  const fn = func<(current: T | undefined) => T | Promise<T>>('mutate', mutate)
  if (!fn) throw invalidType('mutate', 'a function', mutate)
  const o = optionsObject<UpdateJsonOptions>('options', options, { durable: true, timeoutMs: true, create: true, signal: true })
  const durable = boolean('options.durable', o.durable, false)
  const timeoutMs = timeoutOption(o.timeoutMs)
  const kind = oneOf('options.create', o.create, ['object', 'array'] as const, 'object')
  const signal = abortSignal('options.signal', o.signal)

  const lock = await lockFile(p + '.lock', { timeoutMs, signal })
  try {
    let bytes: Buffer | undefined
    try {
      bytes = await call(native.readJsonFile(p))
    } catch (e) {
      if (e instanceof VmspaceError && e.code === 'EISDIR') throw corrupt(p, 'is a directory', undefined, e)
      if (e instanceof VmspaceError && e.code === 'EINVAL') throw corrupt(p, 'is not a regular file', undefined, e)
      throw e
    }
    const current = bytes === undefined ? undefined : parseIndex(bytes, p, kind)
    if (signal?.aborted) throw new AbortError(signal.reason)
    const next = await fn(current as T | undefined)
    // The last point where an abort leaves the file as it was; the write below is all or nothing.
    if (signal?.aborted) throw new AbortError(signal.reason)
    if (next === undefined) return current as T
    // Checked as the JSON that would be written (toJSON, Dates and the like change the type).
    let text: string | undefined
    let cause: unknown
    try {
      text = JSON.stringify(next)
    } catch (e) {
      cause = e // cycles, BigInt
    }
    if (typeof text !== 'string' || text[0] !== (kind === 'array' ? '[' : '{')) {
      const err = new TypeError(
        `Expected mutate to return a JSON ${kind} for ${p} but it returned ${next === null ? 'null' : typeof next}${cause ? ' that cannot be serialised' : ''}`,
        cause === undefined ? undefined : { cause },
      )
      throw Object.assign(err, { code: 'ERR_INVALID_RETURN_VALUE' })
    }
    await call(native.replaceJsonFile({ path: p, text: text + '\n', durable }))
    return next
  } finally {
    await lock.release()
  }
}

function isKind(v: unknown, kind: 'object' | 'array'): boolean {
  return kind === 'array' ? Array.isArray(v) : isPlainObject(v)
}

function corrupt(path: string, why: string, offset?: number, cause?: unknown): VmspaceError {
  const err = vmspaceError('ERR_CORRUPT_INDEX', `${path} ${why}${offset === undefined ? '' : ` (byte ${offset})`}; nothing was written`, {
    path,
    cause,
  })
  if (offset !== undefined) Object.defineProperty(err, 'offset', { value: offset, enumerable: true })
  return err
}

function parseIndex(bytes: Buffer, path: string, kind: 'object' | 'array'): unknown {
  if (bytes.length === 0) throw corrupt(path, 'is empty', 0)
  let text: string
  try {
    text = utf8.decode(bytes)
  } catch (e) {
    throw corrupt(path, 'is not valid UTF-8', undefined, e)
  }
  let value: unknown
  try {
    value = JSON.parse(text)
  } catch (e) {
    // V8 names the position for some syntax errors; a truncated file ends early.
    const m = /position (\d+)/.exec(String((e as Error).message))
    const offset = m
      ? Buffer.byteLength(text.slice(0, Number(m[1])))
      : /end of JSON input/.test(String((e as Error).message))
        ? bytes.length
        : undefined
    throw corrupt(path, 'is not valid JSON', offset, e)
  }
  if (!isKind(value, kind)) throw corrupt(path, `does not hold a JSON ${kind} (found ${value === null ? 'null' : Array.isArray(value) ? 'an array' : typeof value})`)
  return value
}

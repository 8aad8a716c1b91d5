/**
 * The locked JSON index: read-modify-write of a JSON file under a flock(2) lock on the file itself (DESIGN.md,
 * "Locked JSON index").
 */
import * as fsp from 'node:fs/promises'
import * as os from 'node:os'
import * as path from 'node:path'
import { TextDecoder } from 'node:util'
import { native } from './binding.js'
import { abortSignal, absolutePath, boolean, func, invalidType, isPlainObject, oneOf, optionsObject } from './args.js'
import { AbortError, call, vmspaceError, VmspaceError } from './errors.js'
import { acquireLock, lockFd, lockOwner, reentrantError, timeoutOption, type FileLock } from './lock.js'
import { queueTurn, runInTurn, waitsOnItself, waitTurn, type Turn } from './lock-turns.js'
import { lockChannel, traced } from './trace.js'

/** Options of {@link updateJsonFile}. */
export interface UpdateJsonOptions {
  /** fsync the directory after the rename too (the file itself is always fsynced before it). Default false. */
  durable?: boolean
  /** Give up waiting for the lock (this thread's earlier updates of the file included) after this many ms (`ERR_LOCK_TIMEOUT`). */
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
 * Read-modify-write of a JSON file that never loses an update: exclusive flock(2) on the data file itself (checked,
 * once granted, to be the file at `path`; there is no lock file) → read it → parse → `mutate(current)` (may be
 * async; `current` is undefined when the file is missing) → temp file (O_EXCL, same directory) → fsync → atomic
 * exchange with `path` → fsync of the directory when `durable` → release. Returns what was written; when `mutate`
 * returns undefined nothing is written and the current value is returned (undefined for a missing file).
 * A missing file has nothing to lock: its first write is published only where still no file is
 * (renameat2(RENAME_NOREPLACE)). The replacement keeps the old file's mode and owner (where permitted); a new file
 * gets 0666 less the umask.
 *
 * `mutate` can be called more than once: when the file was missing and another writer created it first, or when
 * the file was deleted or replaced (by someone who does not take the lock: an operator, a tmp cleaner) while this
 * update held it and another writer wrote the new file. Nothing was written then; the update starts over on the
 * file now at `path` (lock, read, `mutate` with that value), so neither writer's update is lost
 * (DESIGN.md, "Locked JSON index"). After 64 such starts in a row it fails with `ESTALE`.
 *
 * Within one process: this thread's updates and lockFile calls of one path take turns (in call order, under
 * `timeoutMs` and `signal`); those of two worker_threads wait for each other in flock, as two processes' do. An
 * update made inside a critical section on the same path rejects at once with `ERR_LOCK_REENTRANT` (cause
 * `EDEADLK`), changing nothing, as it would wait for itself: inside its own `mutate` (the nested call, sync or
 * async, and anything `mutate` starts: only that), or after `await lockFile(path)` until that lock's release()
 * (see lockFile for what the async context can and cannot tell). The turns are kept per path string: two updates
 * of one file under two names (a hard link) from one thread at once are refused the same way, so name an index by
 * one path.
 *
 * Each write first removes the temps (`.<name>.tmp-<12 hex>`, regular files) that writers killed before their
 * rename left next to `path`. A symlink at `path` is refused with `ELOOP` (syscall `'open'`, as open(2) with
 * O_NOFOLLOW; nothing made): the rename would replace the link by a file. Give the real path.
 * A file that is empty, not UTF-8, not JSON, or not of the declared type gives `ERR_CORRUPT_INDEX` (with `path`
 * and, where known, the byte `offset`) and is left as it is. A throwing `mutate` writes nothing, and so does an
 * abort before the write starts (AbortError; see {@link UpdateJsonOptions.signal}). The lock is released on
 * every path. Throws as well `ERR_LOCK_TIMEOUT` (`timeoutMs`), `ERR_INVALID_RETURN_VALUE` (TypeError, `mutate`'s
 * result), and the errno of the failed system call. Unknown option keys are `ERR_INVALID_ARG_VALUE`.
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
  if (waitsOnItself(p, false)) throw reentrantError(p)
  if (signal?.aborted) throw new AbortError(signal.reason)

  // The turn is taken before the first await, so that requests take turns in call order.
  const turn = queueTurn(p, false)
  try {
    await refuseSymlink(p)
    const left = await waitTurn(turn, timeoutMs, signal)
    turn.hold()
    return await updateLocked(p, fn, turn, { durable, timeoutMs: left, kind, signal })
  } finally {
    turn.leave()
  }
}

// How many times an update starts over (its file replaced or created by another writer as it wrote) before it
// gives up with ESTALE: each time needs another writer's commit or someone replacing the file, as in lock.cc.
const MAX_STARTS = 64

/** updateJsonFile once its `turn` has come (this thread's earlier requests on `p` are done): lock, read, mutate, write, release. */
async function updateLocked<T>(
  p: string,
  fn: (current: T | undefined) => T | Promise<T>,
  turn: Turn,
  o: { durable: boolean; timeoutMs: number | undefined; kind: 'object' | 'array'; signal: AbortSignal | undefined },
): Promise<T> {
  const { durable, timeoutMs, kind, signal } = o
  for (let start = 1; ; start++) {
    const lock = await lockDataFile(p, timeoutMs, signal)
    try {
      let current: unknown
      if (lock) current = parseIndex(await readLocked(lock, p), p, kind)
      if (signal?.aborted) throw new AbortError(signal.reason)
      const next = await runInTurn(turn, () => fn(current as T | undefined))
      // The last point where an abort leaves the file as it was; the write below is all or nothing.
      if (signal?.aborted) throw new AbortError(signal.reason)
      if (next === undefined) return current as T
      const text = serialise(next, p, kind) + '\n'
      const written = lock
        ? await call(native.replaceJsonFile({ path: p, fd: lockFd(lock), text, durable }))
        : await call(native.createJsonFile({ path: p, text, durable }))
      if (written) return next
    } finally {
      await lock?.release()
    }
    if (start === MAX_STARTS)
      throw new VmspaceError(`ESTALE: ${p} was replaced by other writers ${MAX_STARTS} times in a row as it was written; nothing was written`, {
        code: 'ESTALE',
        errno: -os.constants.errno.ESTALE,
        syscall: 'renameat2',
        path: p,
      })
  }
}

/** The exclusive lock on the data file `p` itself, or undefined when there is no file to lock (a first write). */
async function lockDataFile(p: string, timeoutMs: number | undefined, signal: AbortSignal | undefined): Promise<FileLock | undefined> {
  try {
    return await traced(
      lockChannel,
      () => ({ path: p, options: { timeoutMs, signal } }),
      (t) => acquireLock(p, { shared: false, wait: true, timeoutMs, signal, create: false, owner: lockOwner }, t),
    )
  } catch (e) {
    if (!(e instanceof VmspaceError && e.code === 'ENOENT' && e.syscall === 'open' && e.path === p)) throw e
    // A missing directory is no first write: fail before `mutate` runs, as the write would.
    try {
      await fsp.stat(path.dirname(p))
    } catch {
      throw e
    }
    return undefined
  }
}

/** The bytes of the locked data file; a directory or another kind of file in its place is ERR_CORRUPT_INDEX. */
async function readLocked(lock: FileLock, p: string): Promise<Buffer> {
  try {
    return await call(native.readLockedJsonFile(lockFd(lock), p))
  } catch (e) {
    if (e instanceof VmspaceError && e.code === 'EISDIR') throw corrupt(p, 'is a directory', undefined, e)
    if (e instanceof VmspaceError && e.code === 'EINVAL') throw corrupt(p, 'is not a regular file', undefined, e)
    throw e
  }
}

/** `next` as JSON text, checked as what would be written (toJSON, Dates and the like change the type). */
function serialise(next: unknown, p: string, kind: 'object' | 'array'): string {
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
  return text
}

/**
 * `ELOOP` when `path` is a symlink. Checked before the lock so that a refused call makes nothing; a link made there
 * later by someone who does not take the lock is outside what the lock can order anyway. Any other lstat failure
 * (ENOENT: a new index) is left to the read, which reports it under the lock.
 */
async function refuseSymlink(path: string): Promise<void> {
  let st
  try {
    st = await fsp.lstat(path)
  } catch {
    return
  }
  if (st.isSymbolicLink())
    throw new VmspaceError(`ELOOP: ${path} is a symbolic link; updateJsonFile replaces the file at its path, give the real path`, {
      code: 'ELOOP',
      errno: -os.constants.errno.ELOOP,
      syscall: 'open',
      path,
    })
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

/**
 * The locked JSON index: read-modify-write of a JSON file under a lockFile() lock (DESIGN.md, "Locked JSON index").
 */
import * as fsp from 'node:fs/promises'
import * as os from 'node:os'
import { TextDecoder } from 'node:util'
import { native } from './binding.js'
import { abortSignal, absolutePath, boolean, func, invalidType, isPlainObject, oneOf, optionsObject } from './args.js'
import { AbortError, call, vmspaceError, VmspaceError } from './errors.js'
import { lockFile, timeoutOption } from './lock.js'

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
 * `mutate` must not update the same index again (it would wait for its own lock). A symlink at `path` is refused
 * with `ELOOP` (syscall `'open'`, as open(2) with O_NOFOLLOW; nothing made, not even the lock file): the rename
 * would replace the link by a file, and a writer naming the target would lock another lock file. Give the real path.
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
  await refuseSymlink(p)

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

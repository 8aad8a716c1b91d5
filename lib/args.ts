/**
 * Argument checks, one helper per kind, each throwing before any system call with a message of one shape:
 * "Expected <what> for `<name>` but received <value>" (the convention of sharp's lib/is.js), and Node's codes.
 */
import * as path from 'node:path'

type Coded<E extends Error> = E & { code: string }

function describe(value: unknown): string {
  if (value === null) return 'null'
  if (typeof value === 'string') return `${JSON.stringify(value.length > 60 ? value.slice(0, 60) + '…' : value)} of type string`
  if (typeof value === 'object') return `an instance of ${value.constructor?.name ?? 'Object'}`
  if (typeof value === 'function') return 'a function'
  return `${Object.is(value, -0) ? '-0' : String(value)} of type ${typeof value}`
}

function coded<E extends Error>(err: E, code: string): Coded<E> {
  Object.defineProperty(err, 'code', { value: code, enumerable: true, writable: true, configurable: true })
  return err as Coded<E>
}

/** TypeError ERR_INVALID_ARG_TYPE: the value is not of the expected type. */
export function invalidType(name: string, expected: string, value: unknown) {
  return coded(new TypeError(`Expected ${expected} for \`${name}\` but received ${describe(value)}`), 'ERR_INVALID_ARG_TYPE')
}

/** TypeError (RangeError for numbers and sizes) ERR_INVALID_ARG_VALUE: right type, value not accepted. */
export function invalidValue(name: string, expected: string, value: unknown, range = false) {
  const message = `Expected ${expected} for \`${name}\` but received ${describe(value)}`
  return coded(range ? new RangeError(message) : new TypeError(message), 'ERR_INVALID_ARG_VALUE')
}

// A component that path normalisation would change: an empty one ("//", a trailing "/"), "." or "..".
const notNormalAbsolute = /\/\/|\/\.\.?(?:\/|$)|\/$/
const notNormalRelative = /^\/|\/\/|(?:^|\/)\.\.?(?:\/|$)|\/$/

/** A path string without NUL bytes (which the kernel would cut the path at), resolved against the cwd. */
export function absolutePath(name: string, value: unknown): string {
  if (typeof value !== 'string') throw invalidType(name, 'a path string', value)
  if (value.length === 0 || value.includes('\0')) throw invalidValue(name, 'a non-empty path without NUL bytes', value)
  // Already absolute and normal: path.resolve would return it unchanged, at ~4x the cost (on every clone call).
  if (value.charCodeAt(0) === 0x2f && !notNormalAbsolute.test(value)) return value
  return path.resolve(value)
}

/**
 * A path relative to a workspace, normalised ("a/./b" -> "a/b"); absolute paths, "..", and the workspace itself
 * are refused, so a destination always names an entry strictly beneath the workspace.
 */
export function relativePath(name: string, value: unknown): string {
  if (typeof value !== 'string') throw invalidType(name, 'a relative path string', value)
  // Already relative and normal (no empty, "." or ".." component): normalising would return it unchanged.
  if (value.length !== 0 && !value.includes('\0') && !notNormalRelative.test(value)) return value
  const normal = path.posix.normalize(value).replace(/\/+$/, '')
  if (
    value.length === 0 ||
    value.includes('\0') ||
    path.posix.isAbsolute(value) ||
    normal === '.' ||
    normal === '..' ||
    normal.startsWith('../')
  )
    throw invalidValue(name, 'a relative path that stays beneath the workspace', value)
  return normal
}

/**
 * The workspace-relative paths of a commit's shared files (`share`): 1–64 distinct strings, each without NUL, at
 * most 4096 bytes, not absolute, with no empty, "." or ".." component (kept as given: never normalised).
 */
export function sharePaths(name: string, value: unknown): string[] | undefined {
  if (value === undefined) return undefined
  if (!Array.isArray(value)) throw invalidType(name, 'an array of workspace-relative paths', value)
  if (value.length < 1 || value.length > 64) throw invalidValue(name, '1 to 64 paths', value, true)
  const seen = new Set<string>()
  value.forEach((p: unknown, i) => {
    if (typeof p !== 'string') throw invalidType(`${name}[${i}]`, 'a relative path string', p)
    if (p.length === 0 || p.includes('\0') || Buffer.byteLength(p) > 4096 || notNormalRelative.test(p))
      throw invalidValue(`${name}[${i}]`, 'a relative path of at most 4096 bytes with no empty, "." or ".." component', p)
    if (seen.has(p)) throw invalidValue(`${name}[${i}]`, 'a path not named before', p)
    seen.add(p)
  })
  return value as string[]
}

/** A workspace, template or checkpoint id: 32 lowercase hex characters (128 random bits). */
export const ID = /^[0-9a-f]{32}$/

/** An object that is not null and not an array (what JSON calls an object). */
export function isPlainObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value)
}

/**
 * An options object, checked strictly: a key that is not one of `known` is ERR_INVALID_ARG_VALUE naming it, so a
 * misspelt option (`{ qouta: … }`, `{ reflnk: 'always' }`) fails instead of silently taking the default. `known`
 * lists every key of T (the mapped type makes tsc refuse a list that misses one).
 */
export function optionsObject<T extends object>(
  name: string,
  value: unknown,
  known: { readonly [K in keyof Required<T>]: true },
): Partial<T> {
  if (value === undefined) return {}
  if (!isPlainObject(value)) throw invalidType(name, 'an object', value)
  for (const key of Object.keys(value)) {
    if (!Object.prototype.hasOwnProperty.call(known, key)) {
      const names = Object.keys(known).map((k) => `\`${k}\``).join(', ')
      throw invalidValue(`${name}.${key}`, `no such option (known: ${names})`, value[key])
    }
  }
  return value as Partial<T>
}

export function oneOf<T extends string>(name: string, value: unknown, allowed: readonly T[], fallback: T): T {
  if (value === undefined) return fallback
  if (typeof value !== 'string') throw invalidType(name, `one of ${allowed.map((a) => `'${a}'`).join(', ')}`, value)
  if (!allowed.includes(value as T)) throw invalidValue(name, `one of ${allowed.map((a) => `'${a}'`).join(', ')}`, value)
  return value as T
}

export function boolean(name: string, value: unknown, fallback: boolean): boolean {
  if (value === undefined) return fallback
  if (typeof value !== 'boolean') throw invalidType(name, 'a boolean', value)
  return value
}

export function integerIn(name: string, value: unknown, min: number, max: number, fallback: number): number {
  if (value === undefined) return fallback
  if (typeof value !== 'number') throw invalidType(name, 'an integer', value)
  if (!Number.isInteger(value) || value < min || value > max)
    throw invalidValue(name, `an integer from ${min} to ${max}`, value, true)
  return value
}

export function abortSignal(name: string, value: unknown): AbortSignal | undefined {
  if (value === undefined) return undefined
  if (!(value instanceof AbortSignal)) throw invalidType(name, 'an AbortSignal', value)
  return value
}

export function func<F extends (...args: never[]) => unknown>(name: string, value: unknown): F | undefined {
  if (value === undefined) return undefined
  if (typeof value !== 'function') throw invalidType(name, 'a function', value)
  return value as F
}

/**
 * JSON.stringify of `value` when JSON.parse gives back exactly that value: null, booleans, finite numbers, strings,
 * arrays without holes and plain objects (prototype Object.prototype or null) of those. JSON.stringify alone would
 * change the others silently (ECMA-262 SerializeJSONProperty: `undefined`, functions and symbols dropped, NaN and
 * ±Infinity written as null, a Date as a string, a Map or a class instance as its own keys), so each is
 * ERR_INVALID_ARG_VALUE naming where it is (`options.meta["when"]`); so are cycles and BigInt.
 */
export function exactJson(name: string, value: unknown): string {
  let text: string
  try {
    text = JSON.stringify(value)
  } catch (e) {
    // JSON.stringify's own refusals (a cycle, a BigInt) are TypeErrors; anything else was thrown by the value itself
    // (a getter, a toJSON), and is named as such, with what it threw as the cause.
    const own = e instanceof TypeError && /circular|BigInt/i.test(e.message)
    const err = invalidValue(name, own ? 'a JSON-serialisable value (no cycle, no BigInt)' : `a value whose serialisation does not throw (it threw: ${e instanceof Error ? e.message : String(e)})`, value)
    if (!own) (err as { cause?: unknown }).cause = e
    throw err
  }
  // No cycle remains past JSON.stringify through plain objects and arrays, and the walk stops at anything else.
  const stack: [unknown, string][] = [[value, name]]
  while (stack.length) {
    const [v, at] = stack.pop()!
    if (v === null || typeof v === 'string' || typeof v === 'boolean') continue
    if (typeof v === 'number') {
      if (!Number.isFinite(v)) throw invalidValue(at, 'a finite number (JSON has no NaN or Infinity)', v)
      if (Object.is(v, -0)) throw invalidValue(at, 'a number JSON keeps (it writes -0 as 0)', v)
      continue
    }
    if (Array.isArray(v)) {
      if (Object.keys(v).length !== v.length) throw invalidValue(at, 'an array without holes or extra keys', v)
      for (let i = 0; i < v.length; i++) stack.push([dataProperty(v, String(i), `${at}[${i}]`), `${at}[${i}]`])
      continue
    }
    const proto = typeof v === 'object' ? Object.getPrototypeOf(v) : undefined
    if (typeof v !== 'object' || (proto !== Object.prototype && proto !== null))
      throw invalidValue(at, 'a JSON value (null, boolean, finite number, string, array or plain object)', v)
    if (Object.getOwnPropertySymbols(v).some((s) => Object.prototype.propertyIsEnumerable.call(v, s)))
      throw invalidValue(at, 'an object without symbol keys', v)
    for (const k of Object.keys(v)) stack.push([dataProperty(v, k, `${at}[${JSON.stringify(k)}]`), `${at}[${JSON.stringify(k)}]`])
  }
  return text
}

// The value of own property `key` of `o`, read without calling a getter: JSON.stringify has already called it once,
// and a second call could return something else than what was serialised (a getter's -0 after a first 0).
function dataProperty(o: object, key: string, at: string): unknown {
  const d = Object.getOwnPropertyDescriptor(o, key)!
  if (d.get || d.set) throw invalidValue(at, 'a data property (not a getter or setter)', o)
  return d.value
}

/**
 * Bad arguments (DESIGN.md, "Errors"): each is a TypeError (RangeError for numbers and sizes) with Node's code
 * ERR_INVALID_ARG_TYPE (wrong type) or ERR_INVALID_ARG_VALUE (right type, value refused), naming the argument,
 * raised before any system call: nothing is created, nothing changes.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import * as fc from 'fast-check'
import { describe, expect, test } from 'vitest'
import { absolutePath, relativePath } from '../lib/args.js'
import { clone, exchange, lockFile, openPool, removeTree, renameNoReplace, updateJsonFile } from '../lib/index.js'
import { emptyPoolState, freshDir, poolState, snapshotTree, writeRandomFile } from './helpers.js'

type Expected = { code: 'ERR_INVALID_ARG_TYPE' | 'ERR_INVALID_ARG_VALUE'; type: typeof TypeError | typeof RangeError; arg: string }

const TYPE = (arg: string): Expected => ({ code: 'ERR_INVALID_ARG_TYPE', type: TypeError, arg })
const VALUE = (arg: string): Expected => ({ code: 'ERR_INVALID_ARG_VALUE', type: TypeError, arg })
const RANGE = (arg: string): Expected => ({ code: 'ERR_INVALID_ARG_VALUE', type: RangeError, arg })

async function expectArgError(p: Promise<unknown>, want: Expected): Promise<void> {
  const err = await p.then(
    () => expect.fail('resolved, expected a rejection'),
    (e: unknown) => e,
  )
  expect(err).toBeInstanceOf(want.type)
  expect(err).toMatchObject({ code: want.code })
  expect((err as Error).message).toContain(`\`${want.arg}\``)
}

const circular: Record<string, unknown> = { a: 1 }
circular.self = circular

describe('openPool', () => {
  const cases: [string, (dir: string) => [unknown, unknown?], Expected][] = [
    ['root not a string', () => [42], TYPE('root')],
    ['root missing', () => [undefined], TYPE('root')],
    ['root empty', () => [''], VALUE('root')],
    ['root with a NUL byte', (d) => [`${d}/pool\0x`], VALUE('root')],
    ['options not an object', (d) => [`${d}/pool`, 'create'], TYPE('options')],
    ['options null', (d) => [`${d}/pool`, null], TYPE('options')],
    ['options an array', (d) => [`${d}/pool`, []], TYPE('options')],
    ['create not a boolean', (d) => [`${d}/pool`, { create: 'yes' }], TYPE('options.create')],
    ['prefix not a string', (d) => [`${d}/pool`, { prefix: 42 }], TYPE('options.prefix')],
    ['prefix null', (d) => [`${d}/pool`, { prefix: null }], TYPE('options.prefix')],
    ['prefix empty', (d) => [`${d}/pool`, { prefix: '' }], VALUE('options.prefix')],
    ['prefix starting with a dash', (d) => [`${d}/pool`, { prefix: '-vm' }], VALUE('options.prefix')],
    ['prefix with a slash', (d) => [`${d}/pool`, { prefix: 'a/b' }], VALUE('options.prefix')],
    ['prefix with a dot', (d) => [`${d}/pool`, { prefix: 'a.b' }], VALUE('options.prefix')],
    ['prefix "."', (d) => [`${d}/pool`, { prefix: '.' }], VALUE('options.prefix')],
    ['prefix "..", which would escape the root', (d) => [`${d}/pool`, { prefix: '..' }], VALUE('options.prefix')],
    ['prefix with a NUL byte', (d) => [`${d}/pool`, { prefix: 'vm\0' }], VALUE('options.prefix')],
    ['prefix of 65 characters', (d) => [`${d}/pool`, { prefix: 'a'.repeat(65) }], VALUE('options.prefix')],
    ['reflink an unknown value', (d) => [`${d}/pool`, { reflink: 'sometimes' }], VALUE('options.reflink')],
    ['reflink not a string', (d) => [`${d}/pool`, { reflink: true }], TYPE('options.reflink')],
    ['durable not a boolean', (d) => [`${d}/pool`, { durable: 1 }], TYPE('options.durable')],
    ['a misspelt option (reflnk)', (d) => [`${d}/pool`, { reflnk: 'always' }], VALUE('options.reflnk')],
  ]
  test.each(cases)('%s is refused and nothing is created', async (_, args, want) => {
    const dir = freshDir()
    const [root, options] = args(dir)
    await expectArgError(openPool(root as string, options as never), want)
    expect(fs.readdirSync(dir)).toEqual([])
  })

  test('a prefix of 64 characters of [A-Za-z0-9_-] is accepted', async () => {
    const dir = freshDir()
    const prefix = 'A1_-'.repeat(16)
    const pool = await openPool(path.join(dir, 'pool'), { prefix })
    const ws = await pool.allocate()
    expect(ws.name).toBe(`${prefix}-${ws.id}`)
    await ws.dispose()
  })
})

describe('Pool.allocate', () => {
  const src = (d: string) => path.join(d, 'src.img')
  const cases: [string, (dir: string) => unknown, Expected][] = [
    ['options not an object', () => 'template', TYPE('options')],
    ['options null', () => null, TYPE('options')],
    ['mode -1', () => ({ mode: -1 }), RANGE('options.mode')],
    ['mode 0o10000', () => ({ mode: 0o10000 }), RANGE('options.mode')],
    ['mode 1.5', () => ({ mode: 1.5 }), RANGE('options.mode')],
    ['mode NaN', () => ({ mode: NaN }), RANGE('options.mode')],
    ['mode a string', () => ({ mode: '0700' }), TYPE('options.mode')],
    ['meta a string', () => ({ meta: 'x' }), TYPE('options.meta')],
    ['meta an array', () => ({ meta: [1] }), TYPE('options.meta')],
    ['meta null', () => ({ meta: null }), TYPE('options.meta')],
    ['meta over 64 KiB of JSON', () => ({ meta: { big: 'x'.repeat(64 * 1024) } }), RANGE('options.meta')],
    ['meta circular', () => ({ meta: circular }), VALUE('options.meta')],
    ['meta holding a BigInt', () => ({ meta: { n: 1n } }), VALUE('options.meta')],
    ['meta holding a Date (JSON would make it a string)', () => ({ meta: { when: new Date(0) } }), VALUE('options.meta["when"]')],
    ['meta holding undefined (JSON would drop the key)', () => ({ meta: { a: 1, b: undefined } }), VALUE('options.meta["b"]')],
    ['meta holding NaN (JSON would write null)', () => ({ meta: { list: [1, NaN] } }), VALUE('options.meta["list"][1]')],
    ['meta holding -0 (JSON would write 0)', () => ({ meta: { z: -0 } }), VALUE('options.meta["z"]')],
    ['meta holding Infinity deep down', () => ({ meta: { a: { b: [{ c: Infinity }] } } }), VALUE('options.meta["a"]["b"][0]["c"]')],
    ['meta holding a function', () => ({ meta: { f: () => 1 } }), VALUE('options.meta["f"]')],
    ['meta holding a Map', () => ({ meta: { m: new Map([[1, 2]]) } }), VALUE('options.meta["m"]')],
    ['meta an array with a hole', () => ({ meta: { l: Object.assign(new Array(3), { 0: 1, 2: 3 }) } }), VALUE('options.meta["l"]')],
    ['meta a class instance', () => ({ meta: new (class Point { x = 1 })() }), VALUE('options.meta')],
    ['meta with a symbol key', () => ({ meta: { [Symbol('s')]: 1 } }), VALUE('options.meta')],
    ['meta with a getter (read once by JSON, again by a check)', () => ({ meta: { get g() { return 1 } } }), VALUE('options.meta["g"]')],
    ['meta with a getter in an array', () => ({ meta: { l: Object.defineProperty([0], 0, { get: () => 1, enumerable: true }) } }), VALUE('options.meta["l"][0]')],
    ['template an empty directory path', () => ({ template: '' }), VALUE('options.template')],
    ['template a directory path with a NUL byte', (d) => ({ template: `${d}\0` }), VALUE('options.template')],
    ['template a number', () => ({ template: 42 }), TYPE('options.template')],
    ['template null', () => ({ template: null }), TYPE('options.template')],
    ['template an array', (d) => ({ template: [src(d)] }), TYPE('options.template')],
    ['template dest "../x"', (d) => ({ template: { '../x': src(d) } }), VALUE('options.template["../x"]')],
    ['template dest absolute', (d) => ({ template: { '/x': src(d) } }), VALUE('options.template["/x"]')],
    ['template dest "."', (d) => ({ template: { '.': src(d) } }), VALUE('options.template["."]')],
    ['template dest "a/../../x"', (d) => ({ template: { 'a/../../x': src(d) } }), VALUE('options.template["a/../../x"]')],
    ['template dest with a NUL byte', (d) => ({ template: { 'a\0b': src(d) } }), VALUE('options.template["a\\u0000b"]')],
    ['template source not a string', () => ({ template: { a: 42 } }), TYPE('options.template["a"]')],
    ['template source empty', () => ({ template: { a: '' } }), VALUE('options.template["a"]')],
    ['template source with a NUL byte', (d) => ({ template: { a: `${src(d)}\0` } }), VALUE('options.template["a"]')],
    ['template naming one dest twice', (d) => ({ template: { a: src(d), './a': src(d) } }), VALUE('options.template')],
    ['signal not an AbortSignal', () => ({ signal: {} }), TYPE('options.signal')],
    ['a misspelt option (quota as qouta), never a silent default', () => ({ qouta: { bytes: 1 } }), VALUE('options.qouta')],
    ['an option of another call (reflink belongs to openPool)', () => ({ reflink: 'always' }), VALUE('options.reflink')],
  ]
  test.each(cases)('%s is refused and nothing is created', async (_, options, want) => {
    const dir = freshDir()
    writeRandomFile(src(dir), 4096)
    const pool = await openPool(path.join(dir, 'pool'))
    await expectArgError(pool.allocate(options(dir) as never), want)
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    expect(pool.stats().allocated + pool.stats().failed).toBe(0)
  })

  test('a meta whose getter throws is refused naming what it threw (as the cause), not as a cycle or a BigInt', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const thrown = new Error('not readable here')
    const err = (await pool.allocate({ meta: { get secret(): string { throw thrown } } }).catch((e: unknown) => e)) as Error & { code: string; cause: unknown }
    expect(err).toMatchObject({ code: 'ERR_INVALID_ARG_VALUE', cause: thrown })
    expect(err.message).toContain('it threw: not readable here')
    expect(err.message).not.toContain('no cycle')
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })

  test('a meta over 64 KiB is refused with its size in the message', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const meta = { big: 'x'.repeat(64 * 1024) }
    const err = (await pool.allocate({ meta }).catch((e: unknown) => e)) as Error
    expect(err.message).toContain(`at most 65536 bytes of JSON (it is ${JSON.stringify(meta).length})`)
  })
})

describe('clone (standalone)', () => {
  const cases: [string, (dir: string) => unknown[], Expected][] = [
    ['source not a string', (d) => [42, `${d}/dst`], TYPE('source')],
    ['dest missing', (d) => [`${d}/src`], TYPE('dest')],
    ['source with a NUL byte', (d) => [`${d}/src\0`, `${d}/dst`], VALUE('source')],
    ['dest with a NUL byte', (d) => [`${d}/src`, `${d}/dst\0x`], VALUE('dest')],
    ['dest empty', (d) => [`${d}/src`, ''], VALUE('dest')],
    ['options not an object', (d) => [`${d}/src`, `${d}/dst`, 'always'], TYPE('options')],
    ['reflink an unknown value', (d) => [`${d}/src`, `${d}/dst`, { reflink: 'sometimes' }], VALUE('options.reflink')],
    ['reflink not a string', (d) => [`${d}/src`, `${d}/dst`, { reflink: 0 }], TYPE('options.reflink')],
    ['overwrite not a boolean', (d) => [`${d}/src`, `${d}/dst`, { overwrite: 'yes' }], TYPE('options.overwrite')],
    ['durable not a boolean', (d) => [`${d}/src`, `${d}/dst`, { durable: 1 }], TYPE('options.durable')],
    ['onProgress not a function', (d) => [`${d}/src`, `${d}/dst`, { onProgress: 'log' }], TYPE('options.onProgress')],
    ['signal not an AbortSignal', (d) => [`${d}/src`, `${d}/dst`, { signal: 'abort' }], TYPE('options.signal')],
    ['a misspelt option (overwirte)', (d) => [`${d}/src`, `${d}/dst`, { overwirte: true }], VALUE('options.overwirte')],
  ]
  test.each(cases)('%s is refused and nothing is created', async (_, args, want) => {
    const dir = freshDir()
    writeRandomFile(path.join(dir, 'src'), 4096)
    const before = snapshotTree(dir)
    await expectArgError((clone as (...a: unknown[]) => Promise<unknown>)(...args(dir)), want)
    expect(snapshotTree(dir)).toEqual(before)
  })
})

describe('Workspace.clone', () => {
  const cases: [string, (dir: string) => unknown[], Expected][] = [
    ['dest "../x" (escapes the workspace)', (d) => [`${d}/src`, '../x'], VALUE('dest')],
    ['dest absolute', (d) => [`${d}/src`, `${d}/abs`], VALUE('dest')],
    ['dest "."', (d) => [`${d}/src`, '.'], VALUE('dest')],
    ['dest "./"', (d) => [`${d}/src`, './'], VALUE('dest')],
    ['dest ".."', (d) => [`${d}/src`, '..'], VALUE('dest')],
    ['dest "a/.." (the workspace itself)', (d) => [`${d}/src`, 'a/..'], VALUE('dest')],
    ['dest "a/../../x" (escapes after normalising)', (d) => [`${d}/src`, 'a/../../x'], VALUE('dest')],
    ['dest empty', (d) => [`${d}/src`, ''], VALUE('dest')],
    ['dest with a NUL byte', (d) => [`${d}/src`, 'a\0b'], VALUE('dest')],
    ['dest not a string', (d) => [`${d}/src`, 42], TYPE('dest')],
    ['source not a string', () => [null, 'x'], TYPE('source')],
    ['source with a NUL byte', (d) => [`${d}/src\0`, 'x'], VALUE('source')],
    ['reflink an unknown value', (d) => [`${d}/src`, 'x', { reflink: 'sometimes' }], VALUE('options.reflink')],
    ['overwrite not a boolean', (d) => [`${d}/src`, 'x', { overwrite: 1 }], TYPE('options.overwrite')],
  ]
  test.each(cases)('%s is refused and nothing is created', async (_, args, want) => {
    const dir = freshDir()
    writeRandomFile(path.join(dir, 'src'), 4096)
    const pool = await openPool(path.join(dir, 'pool'))
    const ws = await pool.allocate()
    const before = snapshotTree(dir)
    await expectArgError((ws.clone as (...a: unknown[]) => Promise<unknown>).apply(ws, args(dir)), want)
    expect(snapshotTree(dir)).toEqual(before)
    await ws.dispose()
  })
})

describe('removeTree, renameNoReplace, exchange', () => {
  const cases: [string, (dir: string) => Promise<unknown>, Expected][] = [
    ['removeTree of a non-string', () => removeTree(42 as never), TYPE('path')],
    ['removeTree of an empty path', () => removeTree(''), VALUE('path')],
    ['removeTree of a path with a NUL byte', (d) => removeTree(`${d}/a\0`), VALUE('path')],
    ['removeTree of the root directory', () => removeTree('/'), VALUE('path')],
    ['removeTree of "/.." (the root directory)', () => removeTree('/..'), VALUE('path')],
    ['renameNoReplace from a non-string', (d) => renameNoReplace(undefined as never, `${d}/b`), TYPE('from')],
    ['renameNoReplace to a path with a NUL byte', (d) => renameNoReplace(`${d}/a`, `${d}/b\0`), VALUE('to')],
    ['exchange of a non-string', (d) => exchange(`${d}/a`, {} as never), TYPE('b')],
    ['exchange of a path with a NUL byte', (d) => exchange(`${d}/a\0`, `${d}/b`), VALUE('a')],
  ]
  test.each(cases)('%s is refused and nothing changes', async (_, call, want) => {
    const dir = freshDir()
    fs.writeFileSync(path.join(dir, 'a'), 'a')
    const before = snapshotTree(dir)
    await expectArgError(call(dir), want)
    expect(snapshotTree(dir)).toEqual(before)
  })
})

describe('options are strict everywhere: an unknown key is ERR_INVALID_ARG_VALUE naming it', () => {
  const cases: [string, (dir: string) => Promise<unknown>, Expected][] = [
    ['lockFile { timeout } (timeoutMs misspelt)', (d) => lockFile(`${d}/l`, { timeout: 5 } as never), VALUE('options.timeout')],
    ['updateJsonFile { durabel }', (d) => updateJsonFile(`${d}/i.json`, () => ({}), { durabel: true } as never), VALUE('options.durabel')],
    ['Pool.sweep { grace }', async (d) => {
      const pool = await openPool(`${d}/pool`)
      try {
        return await pool.sweep({ grace: 0 } as never)
      } finally {
        await pool.close()
      }
    }, VALUE('options.grace')],
  ]
  test.each(cases)('%s is refused and nothing is created or changed', async (_, call, want) => {
    const dir = freshDir()
    await expectArgError(call(dir), want)
    const left = fs.readdirSync(dir).filter((n) => n !== 'pool')
    expect(left).toEqual([])
  })
})

// absolutePath/relativePath return an already-normal path as given, without normalising it: property test that the
// result is exactly what path.resolve / path.posix.normalize (and the refusals) give, for paths built of the
// components that matter ("", ".", "..", "...", ".a", "a.", names) with or without a leading or trailing slash.
describe('path arguments: the already-normal fast path changes no result', () => {
  const component = fc.constantFrom('', '.', '..', '...', '.a', 'a.', 'a', 'b c', 'é')
  const anyPath = fc.tuple(fc.boolean(), fc.array(component, { maxLength: 6 }), fc.boolean()).map(
    ([lead, parts, trail]) => (lead ? '/' : '') + parts.join('/') + (trail ? '/' : ''),
  )
  const outcome = (f: () => string) => {
    try {
      return { value: f() }
    } catch (e) {
      return { code: (e as { code?: string }).code }
    }
  }
  test('absolutePath is path.resolve', () => {
    fc.assert(
      fc.property(anyPath, (p) => {
        const want = p === '' ? { code: 'ERR_INVALID_ARG_VALUE' } : { value: path.resolve(p) }
        expect(outcome(() => absolutePath('p', p))).toEqual(want)
      }),
      { numRuns: 2000 },
    )
  })
  test('relativePath is the normalised path, or ERR_INVALID_ARG_VALUE for one that leaves the workspace', () => {
    fc.assert(
      fc.property(anyPath, (p) => {
        const normal = path.posix.normalize(p).replace(/\/+$/, '')
        const refused = p === '' || path.posix.isAbsolute(p) || normal === '.' || normal === '..' || normal.startsWith('../')
        expect(outcome(() => relativePath('p', p))).toEqual(refused ? { code: 'ERR_INVALID_ARG_VALUE' } : { value: normal })
      }),
      { numRuns: 2000 },
    )
  })
})

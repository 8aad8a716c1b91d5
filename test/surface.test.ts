/**
 * The library's surface: removeTree's `force`, updateJsonFile's `signal`, `await using` on a pool, strict
 * option keys, and the codes a VmspaceError can carry.
 */
import { spawn, spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { AbortError, lockFile, openPool, removeTree, updateJsonFile, VmspaceError } from '../lib/index.js'
import { errnoName } from '../lib/errors.js'
import { emptyPoolState, freshDir, poolState, repoRoot, tryFlockPath } from './helpers.js'
import { indexTemps, waitersOn } from './lock-helpers.js'

describe('removeTree with force', () => {
  test('resolves for a missing path and for a path under a missing directory, as fs.rm does', async () => {
    const dir = freshDir()
    await removeTree(path.join(dir, 'missing'), { force: true })
    await removeTree(path.join(dir, 'missing', 'below'), { force: true })
    expect(fs.readdirSync(dir)).toEqual([])
  })

  test('still removes an existing tree', async () => {
    const dir = freshDir()
    fs.mkdirSync(path.join(dir, 't', 'a'), { recursive: true })
    fs.writeFileSync(path.join(dir, 't', 'a', 'f'), 'x')
    await removeTree(path.join(dir, 't'), { force: true })
    expect(fs.readdirSync(dir)).toEqual([])
  })

  test('without force a missing path is ENOENT naming it', async () => {
    const p = path.join(freshDir(), 'missing')
    await expect(removeTree(p)).rejects.toMatchObject({ code: 'ENOENT', path: p })
    await expect(removeTree(p, { force: false })).rejects.toMatchObject({ code: 'ENOENT', path: p })
  })

  test('other errors still reject: a path under a regular file is ENOTDIR', async () => {
    const dir = freshDir()
    fs.writeFileSync(path.join(dir, 'file'), 'x')
    const err = await removeTree(path.join(dir, 'file', 'x'), { force: true }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ENOTDIR' })
    expect(fs.readFileSync(path.join(dir, 'file'), 'utf8')).toBe('x')
  })

  test.each([
    ['force not a boolean', { force: 1 }, 'ERR_INVALID_ARG_TYPE', '`options.force`'],
    ['an unknown key', { forse: true }, 'ERR_INVALID_ARG_VALUE', '`options.forse`'],
    ['options not an object', 'force', 'ERR_INVALID_ARG_TYPE', '`options`'],
  ])('%s is refused and nothing is removed', async (_, options, code, name) => {
    const dir = freshDir()
    fs.mkdirSync(path.join(dir, 't'))
    const err = await removeTree(path.join(dir, 't'), options as never).catch((e: Error) => e)
    expect(err).toBeInstanceOf(TypeError)
    expect(err).toMatchObject({ code })
    expect((err as Error).message).toContain(name)
    expect(fs.readdirSync(dir)).toEqual(['t'])
  })
})

/** flock(1) holding `file` in a process of its own until release(). */
async function heldByFlock(file: string): Promise<{ release(): Promise<void> }> {
  const proc = spawn('flock', [file, 'cat'], { stdio: ['pipe', 'ignore', 'inherit'] })
  const exited = new Promise((resolve) => proc.once('exit', resolve))
  while (spawnSync('flock', ['-n', '-E', '99', file, 'true']).status !== 99) await new Promise((r) => setTimeout(r, 5))
  return {
    release: async () => {
      proc.stdin.end()
      await exited
    },
  }
}

describe('updateJsonFile with signal', () => {
  test('an abort while waiting for the lock rejects with AbortError; the file and the lock are as they were', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'i.json')
    fs.writeFileSync(file, '{"n":1}\n')
    const held = await heldByFlock(file) // another process: this test's own lock would make the update a wait on itself
    const ac = new AbortController()
    let called = false
    const p = updateJsonFile(file, () => ((called = true), { n: 2 }), { signal: ac.signal })
    await waitersOn(file, 1)
    ac.abort()
    await expect(p).rejects.toBeInstanceOf(AbortError)
    expect(called).toBe(false)
    await held.release()
    expect(fs.readFileSync(file, 'utf8')).toBe('{"n":1}\n')
    expect(tryFlockPath(file)).toBe(0) // released: a new exclusive lock is granted at once
  })

  test('an abort during mutate writes nothing and leaves no temp file; the lock is released', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'i.json')
    fs.writeFileSync(file, '{"n":1}\n')
    const before = fs.statSync(file).ino
    const ac = new AbortController()
    const reason = new Error('stop')
    const err = await updateJsonFile<{ n: number }>(
      file,
      async (cur) => {
        ac.abort(reason)
        return { n: cur!.n + 1 }
      },
      { signal: ac.signal },
    ).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(AbortError)
    expect((err as AbortError).cause).toBe(reason)
    expect(fs.readFileSync(file, 'utf8')).toBe('{"n":1}\n')
    expect(fs.statSync(file).ino).toBe(before)
    expect(indexTemps(dir)).toEqual([])
    expect(fs.readdirSync(dir).sort()).toEqual(['i.json'])
    expect(tryFlockPath(file)).toBe(0)
    // The next update goes through.
    await expect(updateJsonFile<{ n: number }>(file, (c) => ({ n: c!.n + 10 }))).resolves.toEqual({ n: 11 })
  })

  test('an already aborted signal rejects before anything is made', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'i.json')
    await expect(updateJsonFile(file, () => ({}), { signal: AbortSignal.abort() })).rejects.toBeInstanceOf(AbortError)
    expect(fs.readdirSync(dir)).toEqual([])
  })

  test('a signal that never fires changes nothing', async () => {
    const file = path.join(freshDir(), 'i.json')
    await expect(updateJsonFile(file, () => ({ a: 1 }), { signal: new AbortController().signal })).resolves.toEqual({ a: 1 })
    expect(fs.readFileSync(file, 'utf8')).toBe('{"a":1}\n')
  })

  test.each([
    ['signal not an AbortSignal', { signal: {} }, 'ERR_INVALID_ARG_TYPE', '`options.signal`'],
    ['an unknown key', { timeout: 5 }, 'ERR_INVALID_ARG_VALUE', '`options.timeout`'],
  ])('%s is refused and nothing is made', async (_, options, code, name) => {
    const dir = freshDir()
    const err = await updateJsonFile(path.join(dir, 'i.json'), () => ({}), options as never).catch((e: Error) => e)
    expect(err).toMatchObject({ code })
    expect((err as Error).message).toContain(name)
    expect(fs.readdirSync(dir)).toEqual([])
  })
})

test('lockFile refuses an unknown option key before opening anything', async () => {
  const dir = freshDir()
  const err = await lockFile(path.join(dir, 'l'), { timeout: 5 } as never).catch((e: Error) => e)
  expect(err).toBeInstanceOf(TypeError)
  expect(err).toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
  expect((err as Error).message).toContain('`options.timeout`')
  expect(fs.readdirSync(dir)).toEqual([])
})

describe('Pool and Symbol.asyncDispose', () => {
  test('`await using` closes the pool at the end of the block (ERR_POOL_CLOSED after)', async () => {
    const root = path.join(freshDir(), 'pool')
    let escaped
    {
      await using pool = await openPool(root)
      escaped = pool
      await (await pool.allocate()).dispose()
    }
    await expect(escaped.allocate()).rejects.toMatchObject({ code: 'ERR_POOL_CLOSED' })
    expect(poolState(root)).toEqual(emptyPoolState)
  })

  test('is close()', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    expect(pool[Symbol.asyncDispose]).toBeTypeOf('function')
    await pool[Symbol.asyncDispose]()
    await expect(pool.list()).rejects.toMatchObject({ code: 'ERR_POOL_CLOSED' })
  })
})

test('SystemErrorCode lists every code a system error can get: each errno name vmspace gives, and EUNKNOWN', () => {
  const source = fs.readFileSync(path.join(repoRoot, 'lib', 'errors.ts'), 'utf8')
  const union = /export type SystemErrorCode =([^/]*?)\n\n/.exec(source)![1]
  const names = new Set([...union.matchAll(/'([A-Z0-9]+)'/g)].map((m) => m[1]))
  const given = new Set(Array.from({ length: 200 }, (_, n) => errnoName(n + 1)))
  expect([...given].filter((n) => !names.has(n))).toEqual([])
  // And nothing beyond Node's table, the Linux names errors.ts adds, and EUNKNOWN.
  expect([...names].filter((n) => !(n in os.constants.errno) && !given.has(n))).toEqual([])
  expect(names.has('EUNKNOWN')).toBe(true)
})

/**
 * updateJsonFile, the locked JSON index (DESIGN.md, "Locked JSON index"): no update is ever lost — across 32
 * processes, with a slow mutate, across a rename that replaces the data file under a waiting writer, after a holder
 * is SIGKILLed — corrupt input is ERR_CORRUPT_INDEX with the file left byte-identical, a failing mutate writes
 * nothing, and no temp file survives a failure.
 * Whether a writer waits is read from /proc/locks (the kernel's view), never guessed with a sleep.
 */
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, onTestFinished, test } from 'vitest'
import { lockFile, updateJsonFile, VmspaceError } from '../lib/index.js'
import { eventually, freshDir, MiB, mounts, needs, repoRoot, stressRounds, tryFlockPath } from './helpers.js'
import { flocksOn, IndexChild, indexTemps, waitersOn } from './lock-helpers.js'

type Index = Record<string, unknown>

/** Everything about a path that a write would change: kind, inode, mode, size, mtime and bytes. */
function fingerprint(p: string): string {
  const st = fs.lstatSync(p, { bigint: true })
  const bytes = st.isFile() ? fs.readFileSync(p).toString('hex') : fs.readdirSync(p).sort().join(',')
  return `${st.mode} ino=${st.ino} size=${st.size} mtime=${st.mtimeNs} ${bytes}`
}

function readIndex(file: string): Index {
  return JSON.parse(fs.readFileSync(file, 'utf8')) as Index
}

async function children(n: number): Promise<IndexChild[]> {
  const cs = Array.from({ length: n }, () => new IndexChild())
  await Promise.all(cs.map((c) => c.expect('ready')))
  return cs
}

describe('no update is lost', () => {
  const updates = stressRounds(100, 10)
  test(`32 processes × ${updates} updates, each adding its own key: exactly ${32 * updates} keys`, { timeout: 600_000 }, async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    const cs = await children(32)
    // All 32 are up and block on stdin: one line each releases them together.
    cs.forEach((c, i) => c.command({ op: 'fill', file, count: updates, prefix: `p${i}-` }))
    await Promise.all(cs.map((c) => c.expect('filled')))
    const index = readIndex(file)
    expect(Object.keys(index)).toHaveLength(32 * updates)
    cs.forEach((c, i) => {
      for (let k = 0; k < updates; k++) expect(index[`p${i}-${k}`]).toBe(c.pid)
    })
    expect(fs.readdirSync(dir).sort()).toEqual(['index.json'])
    for (const c of cs) c.proc.stdin!.end()
    await Promise.all(cs.map((c) => c.exited))
  })

  test('100 concurrent calls in one process (an async mutate) keep all 100 keys', async () => {
    const file = path.join(freshDir(), 'index.json')
    let inside = 0
    let maxInside = 0
    const results = await Promise.all(
      Array.from({ length: 100 }, (_, i) =>
        updateJsonFile<Index>(file, async (current) => {
          maxInside = Math.max(maxInside, ++inside)
          await new Promise((r) => setImmediate(r))
          inside--
          return { ...current, [`k${i}`]: i }
        }),
      ),
    )
    expect(maxInside).toBe(1)
    expect(Object.keys(readIndex(file))).toHaveLength(100)
    // Each call returns what it wrote: sizes 1..100, in some order.
    expect(results.map((r) => Object.keys(r).length).sort((a, b) => a - b)).toEqual(Array.from({ length: 100 }, (_, i) => i + 1))
  })

  test('a slow mutate: writer B waits (in flock on the data file) while A sits in mutate; B then sees A’s update', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    fs.writeFileSync(file, '{}\n')
    const [a, b] = await children(2)
    a.command({ op: 'update', file, key: 'a', value: 1, hold: true })
    expect((await a.expect('mutate')).current).toEqual({})
    b.command({ op: 'update', file, key: 'b', value: 2 })
    await waitersOn(file, 1, b.pid) // B is blocked in flock, not merely about to call
    a.send('continue')
    expect((await a.expect('updated')).result).toEqual({ a: 1 })
    expect((await b.expect('mutate')).current).toEqual({ a: 1 })
    expect((await b.expect('updated')).result).toEqual({ a: 1, b: 2 })
    expect(readIndex(file)).toEqual({ a: 1, b: 2 })
    expect(fs.readdirSync(dir)).toEqual(['index.json'])
  })

  test('a writer waiting on the data file while another exchanges a new one in follows it to the new inode and sees the update', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    fs.writeFileSync(file, '{"base":0}\n')
    const dataIno = fs.statSync(file).ino
    // Held open so that its inode number is not given to A's new file once it is freed (ext4 reuses them).
    const keep = fs.openSync(file, 'r')
    onTestFinished(() => fs.closeSync(keep))
    const [a, b] = await children(2)
    a.command({ op: 'update', file, key: 'a', value: 1, hold: true })
    expect((await a.expect('mutate')).current).toEqual({ base: 0 })
    b.command({ op: 'update', file, key: 'b', value: 2 })
    await waitersOn(file, 1, b.pid)
    a.send('continue')
    await a.expect('updated')
    // A replaced the data file (a new inode) while B waited on the old one: B's grant was on a dead inode.
    expect(fs.statSync(file).ino).not.toBe(dataIno)
    expect((await b.expect('mutate')).current).toEqual({ base: 0, a: 1 })
    await b.expect('updated')
    expect(readIndex(file)).toEqual({ base: 0, a: 1, b: 2 })
    expect(fs.readdirSync(dir)).toEqual(['index.json'])
  })

  test('the first write of a missing file: two writers race, one creates it, the other’s mutate runs again on it (both keys)', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    const [a, b] = await children(2)
    a.command({ op: 'update', file, key: 'a', value: 1, hold: true })
    expect((await a.expect('mutate')).current).toBe(null) // nothing to lock: A runs mutate on a missing file
    b.command({ op: 'update', file, key: 'b', value: 2 })
    expect((await b.expect('mutate')).current).toBe(null)
    expect((await b.expect('updated')).result).toEqual({ b: 2 })
    a.send('continue')
    // A's file would have replaced B's: it is published only where no file is, so A starts over on B's file.
    expect((await a.expect('mutate')).current).toEqual({ b: 2 })
    a.send('continue')
    expect((await a.expect('updated')).result).toEqual({ b: 2, a: 1 })
    expect(readIndex(file)).toEqual({ b: 2, a: 1 })
    expect(fs.readdirSync(dir)).toEqual(['index.json'])
  })

  test('a holder SIGKILLed inside mutate releases the lock; the next writer sees the last committed state', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    const [a, b] = await children(2)
    a.command({ op: 'fill', file, count: 5, prefix: 'a' })
    await a.expect('filled')
    const committed = fs.readFileSync(file)
    a.command({ op: 'update', file, key: 'lost', value: 1, hold: true })
    expect(Object.keys((await a.expect('mutate')).current as Index)).toHaveLength(5)
    b.command({ op: 'update', file, key: 'b', value: 2 })
    await waitersOn(file, 1, b.pid)
    a.proc.kill('SIGKILL')
    expect((await a.exited).signal).toBe('SIGKILL')
    const seen = (await b.expect('mutate')).current as Index
    expect(seen).toEqual(JSON.parse(committed.toString('utf8')))
    await b.expect('updated')
    expect(readIndex(file)).toEqual({ a0: a.pid, a1: a.pid, a2: a.pid, a3: a.pid, a4: a.pid, b: 2 })
    expect(indexTemps(dir)).toEqual([])
  })
})

describe('corrupt input: ERR_CORRUPT_INDEX, the file left byte-identical, mutate never called', () => {
  const invalidUtf8 = Buffer.concat([Buffer.from('{"a":"'), Buffer.from([0xff, 0xfe]), Buffer.from('"}')])
  const cases: { label: string; content: Buffer | 'directory'; create?: 'object' | 'array'; offset?: number | 'absent' }[] = [
    { label: 'null', content: Buffer.from('null'), offset: 'absent' },
    { label: '[] where an object is declared (the default)', content: Buffer.from('[]'), offset: 'absent' },
    { label: '[] where create: "object" is declared', content: Buffer.from('[1]\n'), create: 'object', offset: 'absent' },
    { label: '{} where create: "array" is declared', content: Buffer.from('{}'), create: 'array', offset: 'absent' },
    { label: 'a JSON string', content: Buffer.from('"index"'), offset: 'absent' },
    { label: 'a JSON number', content: Buffer.from('42\n'), offset: 'absent' },
    { label: 'truncated JSON (ends inside a value)', content: Buffer.from('{"a":1,"b":'), offset: 11 },
    { label: 'truncated JSON (ends after a value)', content: Buffer.from('{"a":1'), offset: 6 },
    { label: 'truncated array', content: Buffer.from('[1,2'), create: 'array', offset: 4 },
    { label: 'a syntax error after a multi-byte character (offset in bytes)', content: Buffer.from('{"é":1 x}'), offset: 8 },
    { label: 'invalid UTF-8 inside a string', content: invalidUtf8, offset: 'absent' },
    { label: 'UTF-16 surrogate encoded as UTF-8 (CESU-8)', content: Buffer.from([0x7b, 0x22, 0xed, 0xa0, 0x80, 0x22, 0x3a, 0x31, 0x7d]) },
    { label: 'an empty file', content: Buffer.alloc(0), offset: 0 },
    { label: 'whitespace only', content: Buffer.from(' \n') },
    { label: 'NUL bytes', content: Buffer.alloc(16) },
    { label: 'a directory in its place', content: 'directory', offset: 'absent' },
  ]
  test.each(cases)('$label', async ({ content, create, offset }) => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    if (content === 'directory') {
      fs.mkdirSync(file)
      fs.writeFileSync(path.join(file, 'inside'), 'x')
    } else fs.writeFileSync(file, content)
    const before = fingerprint(file)
    let called = 0
    const err = await updateJsonFile(file, (c) => (++called, c ?? {}), create ? { create } : undefined).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ name: 'VmspaceError', code: 'ERR_CORRUPT_INDEX', path: file })
    expect((err as Error).message).toContain(file)
    if (offset === 'absent') expect('offset' in (err as object)).toBe(false)
    else if (offset !== undefined) expect((err as { offset?: number }).offset).toBe(offset)
    expect(called).toBe(0)
    expect(fingerprint(file)).toBe(before)
    expect(indexTemps(dir)).toEqual([])
    // The lock was released.
    const lock = await lockFile(file, { wait: false })
    await lock.release()
  })

  test('a FIFO in its place: ERR_CORRUPT_INDEX at once, no thread left blocked opening it', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    expect(spawnSync('mkfifo', [file]).status).toBe(0)
    /** A thread of this process asleep in open(2) of a FIFO, waiting for a writer (the kernel's wait_for_partner). */
    const blockedInFifoOpen = () =>
      fs.readdirSync('/proc/self/task').some((t) => {
        try {
          return fs.readFileSync(`/proc/self/task/${t}/wchan`, 'utf8') === 'wait_for_partner'
        } catch {
          return false
        }
      })
    let called = false
    let settled = false
    const p = updateJsonFile(file, (c) => ((called = true), c ?? {})).catch((e: unknown) => e).finally(() => (settled = true))
    let sawBlocked = false
    await eventually(() => settled || (sawBlocked = blockedInFifoOpen()))
    if (sawBlocked) {
      // Unblock the pool thread (open for writing, then close: the reader sees end of file) so the test can end.
      fs.closeSync(fs.openSync(file, fs.constants.O_WRONLY | fs.constants.O_NONBLOCK))
    }
    const err = await p
    expect(sawBlocked, 'a libuv pool thread blocked in open() of the FIFO, holding the index lock').toBe(false)
    expect(err).toMatchObject({ code: 'ERR_CORRUPT_INDEX', path: file })
    expect(called).toBe(false)
    expect(fs.lstatSync(file).isFIFO()).toBe(true)
  })

  test('the error names the offset where it is known (recorded: what the implementation gives per input)', async () => {
    const dir = freshDir()
    const got: Record<string, number | undefined> = {}
    for (const [name, text] of Object.entries({ trunc: '{"a":', token: '{"a": x}', trailing: '{} x', badEscape: '{"a":"\\q"}' })) {
      const file = path.join(dir, `${name}.json`)
      fs.writeFileSync(file, text)
      const err = (await updateJsonFile(file, (c) => c).catch((e: unknown) => e)) as VmspaceError & { offset?: number }
      expect(err).toMatchObject({ code: 'ERR_CORRUPT_INDEX', path: file })
      got[name] = err.offset
      if (err.offset !== undefined) {
        expect(err.offset).toBeGreaterThanOrEqual(0)
        expect(err.offset).toBeLessThanOrEqual(Buffer.byteLength(text))
      }
    }
    // Only "end of input" and V8 messages with "at position N" carry an offset; V8's "Unexpected token 'x'" names
    // none, so `token` has none today (not asserted: naming it would be an improvement).
    expect(got).toMatchObject({ trunc: 5, trailing: 3, badEscape: 7 })
  })
})

describe('a failing update writes nothing and releases the lock', () => {
  test('a throwing mutate (sync or async): same error out, file untouched, lock free, no temp file', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    fs.writeFileSync(file, '{"keep":true}\n')
    const before = fingerprint(file)
    const boom = new Error('boom')
    await expect(updateJsonFile(file, () => { throw boom })).rejects.toBe(boom)
    await expect(updateJsonFile(file, async () => { await null; throw boom })).rejects.toBe(boom)
    expect(fingerprint(file)).toBe(before)
    expect(tryFlockPath(file)).toBe(0)
    expect(indexTemps(dir)).toEqual([])
    // …and the next update proceeds.
    await updateJsonFile<Index>(file, (c) => ({ ...c, next: 1 }))
    expect(readIndex(file)).toEqual({ keep: true, next: 1 })
  })

  test('a throwing mutate on a missing file creates no data file', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    await expect(updateJsonFile(file, () => { throw new Error('no') })).rejects.toThrow('no')
    expect(fs.readdirSync(dir)).toEqual([])
  })

  const wrong: [string, unknown, ('object' | 'array')?][] = [
    ['a number', 5],
    ['a string', '{}'],
    ['null', null],
    ['a boolean', true],
    ['an array where an object is declared', []],
    ['an object where an array is declared', {}, 'array'],
    ['a function', () => ({})],
  ]
  test.each(wrong)('mutate returning %s: TypeError ERR_INVALID_RETURN_VALUE, nothing written', async (_l, value, create) => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    fs.writeFileSync(file, create === 'array' ? '[1]\n' : '{"keep":1}\n')
    const before = fingerprint(file)
    const err = await updateJsonFile(file, () => value as never, create ? { create } : undefined).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(TypeError)
    expect(err).toMatchObject({ code: 'ERR_INVALID_RETURN_VALUE' })
    expect(fingerprint(file)).toBe(before)
    expect(indexTemps(dir)).toEqual([])
    expect(tryFlockPath(file)).toBe(0)
  })

  test('mutate returning a wrong type on a missing file creates no data file', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    await expect(updateJsonFile(file, () => [] as never)).rejects.toMatchObject({ code: 'ERR_INVALID_RETURN_VALUE' })
    expect(fs.existsSync(file)).toBe(false)
  })

  test('mutate returning an object that serialises to another JSON type (Date, toJSON) writes nothing', async () => {
    // Checked on the JS value only, a Date passes as an "object" but is written as a JSON string, and an object whose
    // toJSON() returns undefined is written as the text "undefined": the next update then fails ERR_CORRUPT_INDEX.
    const dir = freshDir()
    const results: Record<string, string> = {}
    for (const [name, value] of Object.entries({ date: new Date(0), toJSONUndefined: { toJSON: () => undefined } })) {
      const file = path.join(dir, `${name}.json`)
      fs.writeFileSync(file, '{"keep":1}\n')
      await updateJsonFile(file, () => value as never).catch(() => undefined)
      results[name] = fs.readFileSync(file, 'utf8')
    }
    expect(results).toEqual({ date: '{"keep":1}\n', toJSONUndefined: '{"keep":1}\n' })
  })

  test('mutate returning a value JSON cannot encode (BigInt, a cycle) rejects; nothing written, no temp file', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    fs.writeFileSync(file, '{"keep":1}\n')
    const before = fingerprint(file)
    const cyclic: Index = {}
    cyclic.self = cyclic
    await expect(updateJsonFile(file, () => ({ n: 1n }))).rejects.toBeInstanceOf(TypeError)
    await expect(updateJsonFile(file, () => cyclic)).rejects.toBeInstanceOf(TypeError)
    expect(fingerprint(file)).toBe(before)
    expect(indexTemps(dir)).toEqual([])
    expect(tryFlockPath(file)).toBe(0)
  })

  test('a directory put in the file’s place during mutate: nothing written over it, the update starts over and finds ERR_CORRUPT_INDEX', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    fs.writeFileSync(file, '{}\n')
    let calls = 0
    const err = await updateJsonFile<Index>(file, (c) => {
      if (++calls === 1) {
        fs.rmSync(file)
        fs.mkdirSync(file)
        fs.writeFileSync(path.join(file, 'x'), 'x')
      }
      return { ...c, a: 1 }
    }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ERR_CORRUPT_INDEX', path: file })
    expect(calls).toBe(1)
    expect(indexTemps(dir)).toEqual([])
    expect(fs.readdirSync(file)).toEqual(['x'])
  })

  describe.skipIf(!mounts.small)(`on a full file system ${needs('a small loop-mounted ext4', mounts.missing.small)}`, () => {
    test('a value that does not fit: ENOSPC, the old file intact, no temp file', async () => {
      const dir = freshDir(mounts.small!)
      const file = path.join(dir, 'index.json')
      fs.writeFileSync(file, '{"keep":1}\n')
      const before = fingerprint(file)
      const err = await updateJsonFile<Index>(file, (c) => ({ ...c, big: 'x'.repeat(80 * MiB) })).catch((e: unknown) => e)
      expect(err).toBeInstanceOf(VmspaceError)
      expect(err).toMatchObject({ code: 'ENOSPC' })
      expect(fingerprint(file)).toBe(before)
      expect(indexTemps(dir)).toEqual([])
      expect(tryFlockPath(file)).toBe(0)
    })
  })
})

describe('what is written', () => {
  test('a missing file: mutate gets undefined; the result is returned and written as JSON + newline', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    const seen: unknown[] = []
    const r = await updateJsonFile<Index>(file, (c) => (seen.push(c), { a: [1, 'é'] }))
    expect(seen).toEqual([undefined])
    expect(r).toEqual({ a: [1, 'é'] })
    expect(fs.readFileSync(file, 'utf8')).toBe('{"a":[1,"é"]}\n')
    expect(fs.statSync(file).mode & 0o777).toBe(0o644 & ~process.umask())
    expect(fs.readdirSync(dir).sort()).toEqual(['index.json'])
  })

  test('create: "array" holds an array', async () => {
    const file = path.join(freshDir(), 'list.json')
    await updateJsonFile<number[]>(file, (c) => [...(c ?? []), 1], { create: 'array' })
    await updateJsonFile<number[]>(file, (c) => [...(c ?? []), 2], { create: 'array' })
    expect(JSON.parse(fs.readFileSync(file, 'utf8'))).toEqual([1, 2])
  })

  test('mutate returning undefined writes nothing and returns the current value', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    expect(await updateJsonFile(file, () => undefined)).toBeUndefined()
    expect(fs.existsSync(file)).toBe(false)
    fs.writeFileSync(file, '{"a":1}')
    const before = fingerprint(file)
    expect(await updateJsonFile(file, () => undefined)).toEqual({ a: 1 })
    expect(fingerprint(file)).toBe(before)
  })

  test('the mode of the file being replaced is kept', async () => {
    const file = path.join(freshDir(), 'index.json')
    fs.writeFileSync(file, '{}', { mode: 0o640 })
    fs.chmodSync(file, 0o640)
    await updateJsonFile<Index>(file, () => ({ a: 1 }))
    expect(fs.statSync(file).mode & 0o7777).toBe(0o640)
  })

  test('a symlink at the path is refused with ELOOP: the link, its target and the directory are as they were, nothing made', async () => {
    const dir = freshDir()
    const target = path.join(dir, 'real.json')
    fs.writeFileSync(target, '{"a":1}\n')
    const link = path.join(dir, 'index.json')
    fs.symlinkSync('real.json', link)
    const dangling = path.join(dir, 'dangling.json')
    fs.symlinkSync('missing.json', dangling)
    const print = () => [fingerprint(target), ...[link, dangling].map((l) => `ino=${fs.lstatSync(l).ino} -> ${fs.readlinkSync(l)}`)]
    const before = print()
    let called = 0
    for (const p of [link, dangling]) {
      const err = await updateJsonFile<Index>(p, () => (++called, { b: 2 })).catch((e: unknown) => e)
      expect(err).toBeInstanceOf(VmspaceError)
      expect(err).toMatchObject({ code: 'ELOOP', errno: -40, syscall: 'open', path: p })
      expect((err as Error).message).toBe(`ELOOP: ${p} is a symbolic link; updateJsonFile replaces the file at its path, give the real path`)
    }
    expect(called).toBe(0)
    expect(print()).toEqual(before)
    expect(fs.readdirSync(dir).sort()).toEqual(['dangling.json', 'index.json', 'real.json'])
    // The real path works as ever.
    expect(await updateJsonFile<Index>(target, (c) => ({ ...c, b: 2 }))).toEqual({ a: 1, b: 2 })
  })

  test('no lock file: a name `<path>.lock` beside the index, even a dangling symlink, is neither used nor made', async () => {
    const dir = freshDir()
    const outside = freshDir()
    const file = path.join(dir, 'j.json')
    fs.symlinkSync(path.join(outside, 'made'), file + '.lock')
    expect(await updateJsonFile<Index>(file, () => ({ a: 1 }))).toEqual({ a: 1 })
    expect(await updateJsonFile<Index>(file, (c) => ({ ...c, b: 2 }))).toEqual({ a: 1, b: 2 })
    expect(fs.readdirSync(outside)).toEqual([])
    expect(fs.readdirSync(dir).sort()).toEqual(['j.json', 'j.json.lock'])
  })

  test('durable: true writes the same and leaves no temp file', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    for (let i = 0; i < 5; i++) await updateJsonFile<Index>(file, (c) => ({ ...c, [`k${i}`]: i }), { durable: true })
    expect(readIndex(file)).toEqual({ k0: 0, k1: 1, k2: 2, k3: 3, k4: 4 })
    expect(fs.readdirSync(dir).sort()).toEqual(['index.json'])
  })

  const hasStrace = spawnSync('sh', ['-c', 'command -v strace'], { stdio: 'ignore' }).status === 0
  test.skipIf(!hasStrace)('durable: true fsyncs the directory too (strace: one more fsync than without)', async () => {
    const dir = freshDir()
    const script = `
      const v = require(${JSON.stringify(path.join(repoRoot, 'dist', 'index.js'))})
      v.updateJsonFile(process.argv[1], (c) => ({ ...c, k: 1 }), { durable: process.argv[2] === '1' })
    `
    const fsyncs = (durable: boolean): string[] => {
      const r = spawnSync('strace', ['-f', '-qq', '-e', 'trace=fsync,fdatasync', process.execPath, '-e', script, path.join(dir, 'i.json'), durable ? '1' : '0'], {
        encoding: 'utf8',
      })
      expect(r.status, r.stderr).toBe(0)
      return r.stderr.split('\n').filter((l) => /\b(fsync|fdatasync)\(/.test(l))
    }
    const plain = fsyncs(false)
    const durable = fsyncs(true)
    expect(plain).toHaveLength(1)
    expect(durable).toHaveLength(2)
  })

  test('timeoutMs: a lock held by another process gives ERR_LOCK_TIMEOUT and mutate is never called', async () => {
    const file = path.join(freshDir(), 'index.json')
    fs.writeFileSync(file, '{"a":1}\n')
    const [holder] = await children(1)
    holder.command({ op: 'lock', path: file })
    await holder.expect('locked')
    let called = false
    const err = await updateJsonFile(file, () => ((called = true), {}), { timeoutMs: 20 }).catch((e: unknown) => e)
    expect(err).toMatchObject({ code: 'ERR_LOCK_TIMEOUT', path: file })
    expect(called).toBe(false)
    expect(fs.readFileSync(file, 'utf8')).toBe('{"a":1}\n')
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: false, pid: holder.pid }])
    holder.proc.stdin!.end()
    await holder.exited
  })
})

describe('bad arguments (TypeError/RangeError before any syscall)', () => {
  const ok = (c: unknown) => c ?? {}
  const cases: [string, unknown, unknown, unknown, string, string][] = [
    ['path not a string', 1, ok, undefined, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['path empty', '', ok, undefined, 'TypeError', 'ERR_INVALID_ARG_VALUE'],
    ['mutate missing', 'FILE', undefined, undefined, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['mutate not a function', 'FILE', {}, undefined, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['mutate a string', 'FILE', 'x => x', undefined, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['options not an object', 'FILE', ok, 5, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['options null', 'FILE', ok, null, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['create unknown', 'FILE', ok, { create: 'map' }, 'TypeError', 'ERR_INVALID_ARG_VALUE'],
    ['create not a string', 'FILE', ok, { create: 1 }, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['durable not a boolean', 'FILE', ok, { durable: 'yes' }, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['timeoutMs negative', 'FILE', ok, { timeoutMs: -5 }, 'RangeError', 'ERR_INVALID_ARG_VALUE'],
    ['timeoutMs fractional', 'FILE', ok, { timeoutMs: 0.5 }, 'RangeError', 'ERR_INVALID_ARG_VALUE'],
    ['timeoutMs a string', 'FILE', ok, { timeoutMs: '5' }, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
  ]
  test.each(cases)('%s', async (_l, p, mutate, options, ctor, code) => {
    const dir = freshDir()
    const file = p === 'FILE' ? path.join(dir, 'index.json') : p
    const err = await updateJsonFile(file as string, mutate as never, options as never).catch((e: unknown) => e)
    expect((err as Error).constructor.name).toBe(ctor)
    expect(err).toMatchObject({ code })
    expect(fs.readdirSync(dir)).toEqual([])
  })
})

describe('an update never waits on itself (ERR_LOCK_REENTRANT, nothing changed); independent ones take turns', () => {
  const reentrant = { name: 'VmspaceError', code: 'ERR_LOCK_REENTRANT', errno: -35, syscall: 'flock' }

  test('updateJsonFile of the same file inside its own mutate (sync and after an await) rejects at once; the file is unchanged', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    fs.writeFileSync(file, '{"a":1}\n')
    const before = fingerprint(file)
    const errors: unknown[] = []
    const result = await updateJsonFile<Index>(file, async () => {
      errors.push(await updateJsonFile<Index>(file, (c) => ({ ...c, nested: 1 })).catch((e: unknown) => e))
      await new Promise((r) => setImmediate(r))
      errors.push(await updateJsonFile<Index>(file, (c) => ({ ...c, nested: 2 })).catch((e: unknown) => e))
      return undefined
    })
    expect(result).toEqual({ a: 1 })
    expect(errors).toHaveLength(2)
    for (const e of errors) {
      expect(e).toBeInstanceOf(VmspaceError)
      expect(e).toMatchObject({ ...reentrant, path: file })
      expect((e as Error).cause).toMatchObject({ code: 'EDEADLK' })
    }
    expect(fingerprint(file)).toBe(before)
    expect(indexTemps(dir)).toEqual([])
    // The lock was released: the next update goes through.
    expect(await updateJsonFile<Index>(file, (c) => ({ ...c, b: 2 }))).toEqual({ a: 1, b: 2 })
  })

  test('the nested update under another name of the same file (a hard link) is refused by device and inode', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'index.json')
    const link = path.join(dir, 'alias.json')
    fs.writeFileSync(file, '{"a":1}\n')
    fs.linkSync(file, link)
    const err = await updateJsonFile<Index>(file, async (c) => {
      const e = await updateJsonFile<Index>(link, (x) => ({ ...x, nested: 1 })).catch((e: unknown) => e)
      expect(e).toMatchObject({ ...reentrant, path: link })
      return c
    }).catch((e: unknown) => e)
    expect(err).toEqual({ a: 1 })
    expect(fs.readFileSync(link, 'utf8')).toBe('{"a":1}\n')
  })

  test('lockFile of the data file inside mutate, and updateJsonFile inside a lockFile critical section on it: ERR_LOCK_REENTRANT', async () => {
    const file = path.join(freshDir(), 'index.json')
    fs.writeFileSync(file, '{"a":1}\n')
    await updateJsonFile<Index>(file, async (c) => {
      await expect(lockFile(file, { wait: false })).rejects.toMatchObject({ ...reentrant, path: file })
      await expect(lockFile(file)).rejects.toMatchObject({ ...reentrant, path: file })
      await expect(lockFile(file, { shared: true })).rejects.toMatchObject({ ...reentrant, path: file })
      return c
    })
    const held = await lockFile(file)
    let called = false
    const err = await updateJsonFile<Index>(file, () => ((called = true), { b: 2 })).catch((e: unknown) => e)
    expect(err).toMatchObject({ ...reentrant, path: file })
    expect(called).toBe(false)
    expect(fs.readFileSync(file, 'utf8')).toBe('{"a":1}\n')
    await held.release()
    expect(await updateJsonFile<Index>(file, (c) => ({ ...c, b: 2 }))).toEqual({ a: 1, b: 2 })
  })

  test('an update and a lockFile of one file from independent tasks of one thread wait for each other, in call order', async () => {
    const file = path.join(freshDir(), 'index.json')
    fs.writeFileSync(file, '{"n":0}\n')
    const order: string[] = []
    // Each task runs as a request handler would: in a microtask of its own.
    const task = (fn: () => Promise<void>) => Promise.resolve().then(fn)
    const locker = (name: string) =>
      task(async () => {
        await using _lock = await lockFile(file)
        order.push(`in ${name}`)
        await new Promise((r) => setImmediate(r))
        order.push(`out ${name}`)
      })
    const updater = (name: string) =>
      task(async () => {
        await updateJsonFile<Index>(file, async (c) => {
          order.push(`in ${name}`)
          await new Promise((r) => setImmediate(r))
          order.push(`out ${name}`)
          return { n: (c!.n as number) + 1 }
        })
      })
    await Promise.all([locker('lock 1'), updater('update 1'), locker('lock 2'), updater('update 2')])
    expect(order).toEqual(['lock 1', 'update 1', 'lock 2', 'update 2'].flatMap((n) => [`in ${n}`, `out ${n}`]))
    expect(readIndex(file)).toEqual({ n: 2 })
    expect(tryFlockPath(file)).toBe(0)
  })

  test('concurrent (not nested) updates of one file in this thread take turns instead: none is refused', async () => {
    const file = path.join(freshDir(), 'index.json')
    const order: string[] = []
    await Promise.all(
      ['x', 'y', 'z'].map((k) =>
        updateJsonFile<Index>(file, async (c) => {
          order.push(`in ${k}`)
          await new Promise((r) => setTimeout(r, 5))
          order.push(`out ${k}`)
          return { ...c, [k]: 1 }
        }),
      ),
    )
    expect(order).toEqual(['in x', 'out x', 'in y', 'out y', 'in z', 'out z'])
    expect(readIndex(file)).toEqual({ x: 1, y: 1, z: 1 })
  })
})

test('a file in a missing directory: ENOENT before mutate runs, nothing made', async () => {
  const dir = freshDir()
  const file = path.join(dir, 'missing', 'index.json')
  let called = false
  const err = await updateJsonFile(file, () => ((called = true), {})).catch((e: unknown) => e)
  expect(err).toBeInstanceOf(VmspaceError)
  expect(err).toMatchObject({ code: 'ENOENT', syscall: 'open', path: file })
  expect(called).toBe(false)
  expect(fs.readdirSync(dir)).toEqual([])
})

/**
 * lockFile / FileLock (DESIGN.md, "Locked JSON index" and "Threads"): flock(2) on a stable lock file, shared and
 * exclusive modes, wait: false, timeoutMs, AbortSignal, release on SIGKILL, and waits that never park a libuv pool
 * thread (64 waiters with UV_THREADPOOL_SIZE=4 leave fs calls working).
 * Whether someone waits is read from /proc/locks (the kernel's view), never guessed with a sleep.
 */
import { spawn } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import * as readline from 'node:readline'
import { describe, expect, onTestFinished, test } from 'vitest'
import { AbortError, FileLock, lockFile, VmspaceError } from '../lib/index.js'
import { Child, eventually, fixtures, freshDir, openFdTargets, runCommand, tryFlockPath } from './helpers.js'
import { flocksOn, flockWaiters, IndexChild, waitersOn } from './lock-helpers.js'

/** `flock -n -s` in another process: 99 when a shared lock cannot be had now, 0 when it could. */
function tryFlockShared(target: string): number | null {
  return runCommand('flock', ['-n', '-s', '-E', '99', target, 'true']).status
}

/** A settled-state probe for a promise, without waiting on it. */
function track<T>(p: Promise<T>): { readonly state: 'pending' | 'fulfilled' | 'rejected'; readonly value?: T; readonly error?: unknown } {
  const s: { state: 'pending' | 'fulfilled' | 'rejected'; value?: T; error?: unknown } = { state: 'pending' }
  p.then(
    (v) => Object.assign(s, { state: 'fulfilled', value: v }),
    (e) => Object.assign(s, { state: 'rejected', error: e }),
  )
  return s
}

/** A lock that the test releases when it finishes, whatever happens. */
async function held(file: string, options?: Parameters<typeof lockFile>[1]): Promise<FileLock> {
  const lock = await lockFile(file, options)
  onTestFinished(() => lock.release())
  return lock
}

/** Asserts nobody holds `file` now: another process gets it exclusively at once. */
function expectFree(file: string): void {
  expect(tryFlockPath(file)).toBe(0)
}

/** A lock on `file` held by another process (test/fixtures/json-file-child.cjs); released by the test's end. */
interface Elsewhere {
  pid: number
  release(): Promise<void>
}

async function heldElsewhere(file: string, shared = false): Promise<Elsewhere> {
  const child = new IndexChild()
  await child.expect('ready')
  child.command({ op: 'lock', path: file, shared })
  await child.expect('locked')
  let released: Promise<void> | undefined
  const release = () =>
    (released ??= (async () => {
      child.command({ op: 'release' })
      await child.expect('released')
      child.proc.stdin!.end()
      await child.exited
    })())
  onTestFinished(release)
  return { pid: child.pid, release }
}

/** Releases `holder`, takes `file` again at once (wait: false) and releases it: then nobody holds it. */
async function releaseAndRetake(file: string, holder: { release(): Promise<void> }): Promise<void> {
  await holder.release()
  const again = await lockFile(file, { wait: false })
  await again.release()
  expectFree(file)
}

describe('lockFile basics', () => {
  test('creates a missing lock file with mode 0600, holds an exclusive flock on it, and never deletes it', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const lock = await lockFile(file)
    expect(lock).toBeInstanceOf(FileLock)
    expect(lock.path).toBe(file)
    expect(lock.shared).toBe(false)
    const st = fs.statSync(file)
    expect(st.isFile()).toBe(true)
    expect(st.mode & 0o7777).toBe(0o600)
    expect(st.size).toBe(0)
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: false, pid: process.pid }])
    expect(tryFlockPath(file)).toBe(99)
    await lock.release()
    expectFree(file)
    expect(fs.existsSync(file)).toBe(true)
    expect(flocksOn(file)).toEqual([])
  })

  test('an existing lock file keeps its mode and content', async () => {
    const file = path.join(freshDir(), 'a.lock')
    fs.writeFileSync(file, 'keep', { mode: 0o640 })
    fs.chmodSync(file, 0o640)
    const ino = fs.statSync(file).ino
    const lock = await lockFile(file)
    await lock.release()
    const st = fs.statSync(file)
    expect(st.mode & 0o7777).toBe(0o640)
    expect(st.ino).toBe(ino)
    expect(fs.readFileSync(file, 'utf8')).toBe('keep')
  })

  test('a relative path resolves against the cwd', async () => {
    const dir = freshDir()
    const rel = path.relative(process.cwd(), path.join(dir, 'rel.lock'))
    const lock = await lockFile(rel)
    expect(lock.path).toBe(path.join(dir, 'rel.lock'))
    await lock.release()
  })

  test('release is idempotent, and a second release never closes an fd reused by a later lock', async () => {
    const dir = freshDir()
    const [a, b] = [path.join(dir, 'a.lock'), path.join(dir, 'b.lock')]
    const first = await lockFile(a)
    const r1 = first.release()
    const r2 = first.release()
    expect(r2).toBe(r1)
    await Promise.all([r1, r2])
    expectFree(a)
    // The kernel hands out the lowest free fd: the next lock most likely reuses first's number.
    const second = await held(b)
    await first.release()
    await first[Symbol.asyncDispose]()
    expect(tryFlockPath(b)).toBe(99)
    await second.release()
    expectFree(b)
  })

  test('[Symbol.asyncDispose] releases the lock', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const lock = await lockFile(file)
    expect(tryFlockPath(file)).toBe(99)
    await lock[Symbol.asyncDispose]()
    expectFree(file)
    await lock.release() // still idempotent
  })

  test('`await using` releases the lock at the end of the block', async () => {
    const file = path.join(freshDir(), 'a.lock')
    {
      await using lock = await lockFile(file)
      expect(lock.path).toBe(file)
      expect(tryFlockPath(file)).toBe(99)
    }
    expectFree(file)
    // …also when the block throws
    await expect(
      (async () => {
        await using _lock = await lockFile(file)
        expect(tryFlockPath(file)).toBe(99)
        throw new Error('boom')
      })(),
    ).rejects.toThrow('boom')
    expectFree(file)
  })

  test('a lock file in a missing directory rejects with ENOENT (the directory is not made)', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'missing', 'a.lock')
    const err = await lockFile(file).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ENOENT', syscall: 'open', path: file })
    expect(fs.existsSync(path.join(dir, 'missing'))).toBe(false)
  })

  test('a symlink at the lock path, dangling or not, rejects with ELOOP: nothing made, the target not locked', async () => {
    const dir = freshDir()
    const outside = freshDir()
    const dangling = path.join(dir, 'dangling.lock')
    fs.symlinkSync(path.join(outside, 'made.lock'), dangling)
    const target = path.join(outside, 'real.lock')
    fs.writeFileSync(target, '')
    const link = path.join(dir, 'link.lock')
    fs.symlinkSync(target, link)
    for (const p of [dangling, link]) {
      const err = await lockFile(p).catch((e: unknown) => e)
      expect(err).toBeInstanceOf(VmspaceError)
      expect(err).toMatchObject({ code: 'ELOOP', syscall: 'open', path: p })
    }
    expect(fs.readdirSync(outside)).toEqual(['real.lock'])
    expect(fs.readdirSync(dir).sort()).toEqual(['dangling.lock', 'link.lock'])
    expectFree(target)
  })
})

describe('exclusion', () => {
  test('lockFile inside the critical section of a lock on the same file rejects at once with ERR_LOCK_REENTRANT (EDEADLK); after release it succeeds', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const first = await lockFile(file)
    for (const options of [undefined, { wait: false }, { shared: true }, { timeoutMs: 60_000 }]) {
      const err = await lockFile(file, options).catch((e: unknown) => e)
      expect(err).toBeInstanceOf(VmspaceError)
      expect(err).toMatchObject({ name: 'VmspaceError', code: 'ERR_LOCK_REENTRANT', errno: -35, syscall: 'flock', path: file })
      expect((err as Error).cause).toMatchObject({ code: 'EDEADLK', errno: -35 })
    }
    // Nothing changed: the first lock alone, no waiter, no fd left open by the refused calls.
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: false, pid: process.pid }])
    expect([...openFdTargets(process.pid).values()].filter((t) => t === file)).toHaveLength(1)
    await first.release()
    const again = await lockFile(file, { wait: false })
    await again.release()
    expectFree(file)
  })

  test('the same file under another name (a hard link) is the same lock: ERR_LOCK_REENTRANT from the registry (same thread, same file)', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'a.lock')
    const link = path.join(dir, 'b.lock')
    const first = await held(file)
    fs.linkSync(file, link)
    await expect(lockFile(link, { wait: false })).rejects.toMatchObject({ code: 'ERR_LOCK_REENTRANT', path: link })
    await first.release()
    const viaLink = await lockFile(link, { wait: false })
    await viaLink.release()
  })

  test('a second call while the first still waits (for another process) queues behind it: no fd, no flock wait; it gets the lock after the first', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const other = await heldElsewhere(file)
    const first = track(lockFile(file))
    await waitersOn(file, 1, process.pid)
    const second = track(lockFile(file))
    // Only the first has the file open and waits in flock; the second waits on a promise.
    expect(flocksOn(file)).toEqual([
      { blocked: false, shared: false, pid: other.pid },
      { blocked: true, shared: false, pid: process.pid },
    ])
    expect([...openFdTargets(process.pid).values()].filter((t) => t === file)).toHaveLength(1)
    await other.release()
    await eventually(() => first.state !== 'pending')
    expect(first.state).toBe('fulfilled')
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: false, pid: process.pid }])
    expect(second.state).toBe('pending')
    await first.value!.release()
    await eventually(() => second.state !== 'pending')
    expect(second.state).toBe('fulfilled')
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: false, pid: process.pid }])
    await second.value!.release()
    expectFree(file)
  })

  test('an exclusive lock asked for inside a shared critical section is refused (it would wait on itself)', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const sh = await held(file, { shared: true })
    await expect(lockFile(file)).rejects.toMatchObject({ code: 'ERR_LOCK_REENTRANT' })
    await expect(lockFile(file, { wait: false })).rejects.toMatchObject({ code: 'ERR_LOCK_REENTRANT' })
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: true, pid: process.pid }])
    await sh.release()
  })

  test('shared locks coexist, in this process and with another process', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const a = await held(file, { shared: true })
    const b = await held(file, { shared: true, wait: false })
    expect([a.shared, b.shared]).toEqual([true, true])
    expect(tryFlockShared(file)).toBe(0)
    expect(tryFlockPath(file)).toBe(99)
    expect(flocksOn(file).map((e) => [e.blocked, e.shared])).toEqual([
      [false, true],
      [false, true],
    ])
  })

  test('an exclusive lock excludes shared ones, and a shared lock excludes exclusive ones', async () => {
    const dir = freshDir()
    const file = path.join(dir, 'a.lock')
    const ex = await heldElsewhere(file)
    await expect(lockFile(file, { shared: true, wait: false })).rejects.toMatchObject({ code: 'ERR_LOCK_HELD' })
    expect(tryFlockShared(file)).toBe(99)
    await ex.release()

    const sh = await heldElsewhere(file, true)
    await expect(lockFile(file, { wait: false })).rejects.toMatchObject({ code: 'ERR_LOCK_HELD' })
    expect(tryFlockPath(file)).toBe(99)
    // A waiting exclusive lock gets it once the shared one goes.
    const ex2 = track(lockFile(file))
    await waitersOn(file, 1, process.pid)
    await sh.release()
    await eventually(() => ex2.state !== 'pending')
    expect(ex2.state).toBe('fulfilled')
    await ex2.value!.release()
    expectFree(file)
  })

  test('a lock held by another process excludes this one; a shared one held there admits shared ones here', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const child = new IndexChild()
    await child.expect('ready')
    child.command({ op: 'lock', path: file })
    await child.expect('locked')
    await expect(lockFile(file, { wait: false })).rejects.toMatchObject({ code: 'ERR_LOCK_HELD' })
    await expect(lockFile(file, { wait: false, shared: true })).rejects.toMatchObject({ code: 'ERR_LOCK_HELD' })
    const waiting = track(lockFile(file))
    await waitersOn(file, 1, process.pid)
    child.command({ op: 'release' })
    await child.expect('released')
    await eventually(() => waiting.state !== 'pending')
    expect(waiting.state).toBe('fulfilled')
    await waiting.value!.release()

    child.command({ op: 'lock', path: file, shared: true })
    await child.expect('locked')
    const sh = await lockFile(file, { shared: true, wait: false })
    await sh.release()
    await expect(lockFile(file, { wait: false })).rejects.toMatchObject({ code: 'ERR_LOCK_HELD' })
    child.proc.stdin!.end()
    expect((await child.exited).code).toBe(0)
    expectFree(file)
  })
})

/**
 * lockFile from a task of its own, as another request handler would call it: it runs in a microtask, so the
 * caller's async context is not inside the lock's critical section (docs/locks.md, "Waiting in one process").
 */
function lockInTask(file: string, options?: Parameters<typeof lockFile>[1]): Promise<FileLock> {
  return Promise.resolve().then(() => lockFile(file, options))
}

describe('independent requests of one thread take turns (docs/locks.md, "Waiting in one process")', () => {
  test('8 concurrent handlers of one thread lock one file in call order, one at a time; none is refused, nothing is left held', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const log: string[] = []
    const handle = async (n: number) => {
      await using _lock = await lockFile(file)
      log.push(`enter ${n}`)
      await fs.promises.stat(file) // a pool round trip inside the critical section, while the others wait
      log.push(`leave ${n}`)
    }
    await Promise.all(Array.from({ length: 8 }, (_, n) => handle(n)))
    expect(log).toEqual(Array.from({ length: 8 }, (_, n) => [`enter ${n}`, `leave ${n}`]).flat())
    expectFree(file)
    expect([...openFdTargets(process.pid).values()].filter((t) => t === file)).toEqual([])
  })

  test('wait: false and timeoutMs: 0 while another task of this thread holds the lock: ERR_LOCK_HELD / ERR_LOCK_TIMEOUT at once, nothing opened', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const holder = await lockInTask(file)
    onTestFinished(() => holder.release())
    const err = await lockInTask(file, { wait: false }).catch((e: unknown) => e)
    expect(err).toMatchObject({ name: 'VmspaceError', code: 'ERR_LOCK_HELD', path: file, syscall: 'flock' })
    expect((err as Error).cause).toMatchObject({ code: 'EAGAIN' })
    await expect(lockInTask(file, { timeoutMs: 0 })).rejects.toMatchObject({ code: 'ERR_LOCK_TIMEOUT', path: file })
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: false, pid: process.pid }])
    expect([...openFdTargets(process.pid).values()].filter((t) => t === file)).toHaveLength(1)
    await holder.release()
    expectFree(file)
  })

  test('timeoutMs and an abort apply to a queued request: it leaves the queue, and the next ones still get the lock in order', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const other = await heldElsewhere(file)
    const granted: string[] = []
    const ac = new AbortController()
    const take = (name: string, options?: Parameters<typeof lockFile>[1]) =>
      track(
        lockFile(file, options).then(async (lock) => {
          granted.push(name)
          await lock.release()
        }),
      )
    const a = take('a')
    await waitersOn(file, 1, process.pid)
    const b = take('b', { timeoutMs: 20 })
    const c = take('c', { signal: ac.signal })
    const d = take('d', { timeoutMs: 2 ** 31 - 1 })
    await eventually(() => b.state !== 'pending')
    expect(b.error).toMatchObject({ name: 'VmspaceError', code: 'ERR_LOCK_TIMEOUT', path: file, syscall: 'flock' })
    ac.abort()
    await eventually(() => c.state !== 'pending')
    expect(c.error).toBeInstanceOf(AbortError)
    // The cancelled ones never waited in flock; the first still does, alone.
    expect(flockWaiters(file, process.pid)).toBe(1)
    expect([a.state, d.state]).toEqual(['pending', 'pending'])
    await other.release()
    await eventually(() => d.state !== 'pending')
    expect([a.state, d.state]).toEqual(['fulfilled', 'fulfilled'])
    expect(granted).toEqual(['a', 'd'])
    expectFree(file)
    expect([...openFdTargets(process.pid).values()].filter((t) => t === file)).toEqual([])
  })

  test('shared requests of independent tasks are granted together, even past a queued exclusive one (as flock grants them); the exclusive one gets it after them', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const s1 = await lockInTask(file, { shared: true })
    const ex = track(lockInTask(file))
    await new Promise((r) => setImmediate(r))
    // ex has asked: it is queued behind s1, with no fd, so the kernel sees s1 alone.
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: true, pid: process.pid }])
    const s2 = await lockInTask(file, { shared: true })
    expect(flocksOn(file)).toEqual([
      { blocked: false, shared: true, pid: process.pid },
      { blocked: false, shared: true, pid: process.pid },
    ])
    await s1.release()
    expect(ex.state).toBe('pending')
    await s2.release()
    await eventually(() => ex.state !== 'pending')
    expect(ex.state).toBe('fulfilled')
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: false, pid: process.pid }])
    // Shared requests queued behind an exclusive holder all come in when it lets go.
    const shared = [track(lockInTask(file, { shared: true })), track(lockInTask(file, { shared: true }))]
    await ex.value!.release()
    await eventually(() => shared.every((s) => s.state !== 'pending'))
    expect(shared.map((s) => s.state)).toEqual(['fulfilled', 'fulfilled'])
    expect(flocksOn(file).map((e) => [e.blocked, e.shared])).toEqual([
      [false, true],
      [false, true],
    ])
    for (const s of shared) await s.value!.release()
    expectFree(file)
  })
})

describe('a wait on itself is refused at once (ERR_LOCK_REENTRANT), changing nothing', () => {
  test('the critical section is what follows `await lockFile()` in that context and what it starts, until release() is called', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const lock = await lockFile(file)
    const codes: unknown[] = []
    const attempt = () => lockFile(file).then((l) => (codes.push('granted'), l.release()), (e: { code: string }) => void codes.push(e.code))
    await attempt() // in the critical section itself
    await new Promise((r) => setImmediate(r))
    await attempt() // after another await
    await new Promise<void>((resolve) => setImmediate(() => void attempt().then(resolve))) // in a callback it scheduled
    await Promise.resolve().then(attempt) // in a promise reaction it started
    expect(codes).toEqual(['ERR_LOCK_REENTRANT', 'ERR_LOCK_REENTRANT', 'ERR_LOCK_REENTRANT', 'ERR_LOCK_REENTRANT'])
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: false, pid: process.pid }])
    // release() ends it at once, even before it has settled: the next call queues behind the release.
    const released = lock.release()
    const again = await lockFile(file)
    await released
    await again.release()
    expectFree(file)
  })

  test('a shared request inside a shared critical section is granted, even with an exclusive request of another task queued', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const other = await lockInTask(file, { shared: true })
    const ex = track(lockInTask(file))
    await new Promise((r) => setImmediate(r)) // ex has asked: it is queued behind `other`
    const outer = await lockFile(file, { shared: true })
    const inner = await lockFile(file, { shared: true })
    expect(flocksOn(file).map((e) => [e.blocked, e.shared])).toEqual([
      [false, true],
      [false, true],
      [false, true],
    ])
    for (const l of [inner, outer, other]) await l.release()
    await eventually(() => ex.state !== 'pending')
    expect(ex.state).toBe('fulfilled')
    await ex.value!.release()
    expectFree(file)
  })

  test('a shared request inside an exclusive critical section is refused', async () => {
    const file = path.join(freshDir(), 'a.lock')
    await held(file)
    await expect(lockFile(file, { shared: true })).rejects.toMatchObject({ code: 'ERR_LOCK_REENTRANT', path: file })
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: false, pid: process.pid }])
  })

  // AsyncLocalStorage.enterWith marks the caller's synchronous frame, so the frame that started handler 1 (and what it
  // starts later) is inside handler 1's critical section too: the one pattern docs/locks.md names, with its way out.
  test('a handler started without an await by a frame that called lockFile before its first await: refused while an earlier one holds the lock; started in a microtask of its own, it waits its turn', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const dispatch = async (start: (job: () => Promise<unknown>) => Promise<unknown>) => {
      let letGo!: () => void
      const holding = new Promise<void>((resolve) => (letGo = resolve))
      const handle = async (until?: Promise<void>) => {
        const lock = await lockFile(file)
        await until
        await lock.release()
        return 'granted'
      }
      const first = start(() => handle(holding))
      await eventually(() => flocksOn(file).length === 1) // handler 1 holds the lock
      const second = start(() => handle()).catch((e: { code: string }) => e.code)
      letGo()
      return [await first, await second]
    }
    expect(await dispatch((job) => job())).toEqual(['granted', 'ERR_LOCK_REENTRANT'])
    expect(await dispatch((job) => new Promise((resolve) => queueMicrotask(() => resolve(job()))))).toEqual(['granted', 'granted'])
    expectFree(file)
  })
})

describe('wait: false, timeoutMs, AbortSignal', () => {
  test('wait: false on a held lock rejects at once with ERR_LOCK_HELD (path, syscall, EWOULDBLOCK cause)', async () => {
    const file = path.join(freshDir(), 'a.lock')
    await heldElsewhere(file)
    const err = await lockFile(file, { wait: false }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ name: 'VmspaceError', code: 'ERR_LOCK_HELD', path: file, syscall: 'flock' })
    expect((err as Error).cause).toMatchObject({ code: 'EAGAIN' })
    expect(flockWaiters(file)).toBe(0)
    expect(flocksOn(file)).toHaveLength(1)
    // The refused call left nothing registered here: a second one is refused by the other process again.
    expect(await lockFile(file, { wait: false }).catch((e: { code: string }) => e.code)).toBe('ERR_LOCK_HELD')
  })

  test('wait: false on a free lock takes it', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const lock = await lockFile(file, { wait: false })
    expect(tryFlockPath(file)).toBe(99)
    await lock.release()
  })

  test('timeoutMs rejects with ERR_LOCK_TIMEOUT and leaves no waiter and no lock behind', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const holder = await heldElsewhere(file)
    const err = await lockFile(file, { timeoutMs: 30 }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ERR_LOCK_TIMEOUT', path: file })
    await expect(lockFile(file, { timeoutMs: 0 })).rejects.toMatchObject({ code: 'ERR_LOCK_TIMEOUT', path: file })
    await expect(lockFile(file, { timeoutMs: 1, shared: true })).rejects.toMatchObject({ code: 'ERR_LOCK_TIMEOUT' })
    await eventually(() => flockWaiters(file) === 0)
    await releaseAndRetake(file, holder)
  })

  test('timeoutMs on a lock granted before it expires gives the lock', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const holder = await heldElsewhere(file)
    const waiting = track(lockFile(file, { timeoutMs: 2 ** 31 - 1 }))
    await waitersOn(file, 1, process.pid)
    await holder.release()
    await eventually(() => waiting.state !== 'pending')
    expect(waiting.state).toBe('fulfilled')
    await waiting.value!.release()
  })

  test('an already-aborted signal rejects with an AbortError before anything is opened (no lock file made)', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const reason = new Error('stop')
    const err = await lockFile(file, { signal: AbortSignal.abort(reason) }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(AbortError)
    expect(err).toMatchObject({ name: 'AbortError', code: 'ABORT_ERR' })
    expect((err as Error).cause).toBe(reason)
    expect(fs.existsSync(file)).toBe(false)
  })

  test('an abort while waiting rejects with an AbortError; the lock is never left held', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const holder = await heldElsewhere(file)
    const ac = new AbortController()
    const waiting = track(lockFile(file, { signal: ac.signal }))
    await waitersOn(file, 1, process.pid)
    ac.abort()
    await eventually(() => waiting.state !== 'pending')
    expect(waiting.state).toBe('rejected')
    expect(waiting.error).toBeInstanceOf(AbortError)
    expect(waiting.error).toMatchObject({ name: 'AbortError', code: 'ABORT_ERR' })
    await eventually(() => flockWaiters(file) === 0)
    await releaseAndRetake(file, holder)
  })

  test('an abort right after the call (before the wait has begun) rejects with an AbortError', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const holder = await heldElsewhere(file)
    const ac = new AbortController()
    const waiting = track(lockFile(file, { signal: ac.signal }))
    ac.abort() // lockFile is still opening the file on the pool: the wait has not started yet
    // Let the holder go after a while, so a wait that missed the abort ends (granted) instead of hanging.
    const letGo = setTimeout(() => void holder.release(), 500)
    onTestFinished(() => {
      clearTimeout(letGo)
      return holder.release()
    })
    await eventually(() => waiting.state !== 'pending')
    if (waiting.state === 'fulfilled') await waiting.value!.release()
    expect(waiting.state, 'the abort was missed: lockFile waited on and resolved with a held lock').toBe('rejected')
    expect(waiting.error).toMatchObject({ name: 'AbortError' })
    await holder.release()
    const later = await lockFile(file, { wait: false })
    await later.release()
  })

  test('aborts racing with grants: each call either gets the lock or rejects with AbortError, none is left held', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const outcomes = { granted: 0, aborted: 0 }
    for (let i = 0; i < 40; i++) {
      const holder = await heldElsewhere(file)
      const ac = new AbortController()
      // Settle into a value at once: the call may reject while the awaits below run, and a rejection with no
      // handler yet is an unhandled rejection.
      const outcome = lockFile(file, { signal: ac.signal }).then(
        (lock) => lock,
        (e: unknown) => e,
      )
      if (i % 2 === 0) await waitersOn(file, 1, process.pid)
      // Release and abort in the same turn: the grant and the cancel race.
      const released = holder.release()
      if (i % 4 < 2) ac.abort()
      else setImmediate(() => ac.abort())
      await released
      const r = await outcome
      if (r instanceof FileLock) {
        outcomes.granted++
        await r.release()
      } else {
        expect(r).toMatchObject({ name: 'AbortError' })
        outcomes.aborted++
      }
      await eventually(() => flocksOn(file).length === 0)
    }
    expect(outcomes.granted + outcomes.aborted).toBe(40)
    const last = await lockFile(file, { wait: false })
    await last.release()
  })
})

describe('crash', () => {
  test('a holder killed with SIGKILL releases the lock; a waiter here gets it', async () => {
    const file = path.join(freshDir(), 'a.lock')
    const child = new IndexChild()
    await child.expect('ready')
    child.command({ op: 'lock', path: file })
    await child.expect('locked')
    expect(tryFlockPath(file)).toBe(99)
    const waiting = track(lockFile(file))
    await waitersOn(file, 1, process.pid)
    child.proc.kill('SIGKILL')
    expect((await child.exited).signal).toBe('SIGKILL')
    await eventually(() => waiting.state !== 'pending')
    expect(waiting.state).toBe('fulfilled')
    expect(flocksOn(file)).toEqual([{ blocked: false, shared: false, pid: process.pid }])
    await waiting.value!.release()
    expect(fs.existsSync(file)).toBe(true)
  })
})

/**
 * test/fixtures/lock-waiters-child.cjs with UV_THREADPOOL_SIZE=4: 64 waiters, each on a file of its own (`files`)
 * or all on one (`one`). Resolves with its last message of each event once it exited 0.
 */
async function waitersChild(mode: 'files' | 'one'): Promise<{ messages: Record<string, Record<string, unknown>>; stderr: string }> {
  const dir = freshDir()
  const proc = spawn(process.execPath, [path.join(fixtures, 'lock-waiters-child.cjs'), dir, '64', mode], {
    env: { ...process.env, UV_THREADPOOL_SIZE: '4' },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  let stderr = ''
  proc.stderr.setEncoding('utf8').on('data', (s: string) => (stderr += s))
  onTestFinished(() => {
    if (proc.exitCode === null && proc.signalCode === null) proc.kill('SIGKILL')
  })
  const messages: Record<string, Record<string, unknown>> = {}
  readline.createInterface({ input: proc.stdout }).on('line', (line) => {
    const m = JSON.parse(line) as Record<string, unknown>
    messages[m.event as string] = m
  })
  const code = await new Promise<number | null>((resolve) => proc.on('exit', (code) => resolve(code)))
  expect(messages.error, stderr).toBeUndefined()
  expect(code, stderr).toBe(0)
  return { messages, stderr }
}

describe('threads (DESIGN.md, "Threads")', () => {
  test('64 waiters with UV_THREADPOOL_SIZE=4: fs calls still complete while they wait; then all get their locks', async () => {
    const { messages, stderr } = await waitersChild('files')
    // All 64 waited in flock (each on a thread of its own), and the pool still served fs calls.
    expect(messages.waiting, JSON.stringify(messages.waiting)).toMatchObject({ blocked: 64, pool: '4' })
    // Nobody got the lock while the holder had it, and the reads did not wait for the holder.
    expect(messages['fs-ok']).toMatchObject({ reads: 16, inside: 0, granted: 0 })
    const granted = messages.granted as { order: number[]; count: number }
    expect([...granted.order].sort((a, b) => a - b), stderr).toEqual(Array.from({ length: 64 }, (_, i) => i))
    expect(messages.index).toMatchObject({ keys: 64 })
  })

  test('64 concurrent waiters on one file held by another process: one waits in flock, all get it one at a time in call order', async () => {
    const { messages, stderr } = await waitersChild('one')
    // The others wait on a promise: no fd, no thread, no pool thread each.
    expect(messages.waiting).toMatchObject({ blocked: 1, pool: '4' })
    expect(messages['fs-ok']).toMatchObject({ reads: 16, inside: 0, granted: 0 })
    expect(messages.granted, stderr).toEqual({ event: 'granted', order: Array.from({ length: 64 }, (_, i) => i), count: 64, most: 1 })
    expect(messages.index).toMatchObject({ keys: 64 })
  })

  test.skipIf(process.getuid?.() !== 0)('no thread for a wait (RLIMIT_NPROC): the call rejects with EAGAIN and closes its fd, the process lives on', async () => {
    const dir = freshDir()
    fs.chmodSync(dir, 0o777)
    const child = new Child(path.join(fixtures, 'lock-nproc-child.cjs'), [dir])
    expect(await child.next()).toEqual({
      event: 'result',
      error: { name: 'VmspaceError', code: 'EAGAIN', errno: -11, syscall: 'pthread_create', path: path.join(dir, 'n.lock') },
      fdsBefore: 0,
      fdsAfter: 0,
      again: true,
    })
    expect((await child.exited).code, child.stderr).toBe(0)
  })
})

describe('bad arguments (TypeError/RangeError before any syscall)', () => {
  const cases: [string, unknown, unknown, string, string][] = [
    ['path not a string', 42, undefined, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['path empty', '', undefined, 'TypeError', 'ERR_INVALID_ARG_VALUE'],
    ['path with NUL', '/tmp/a\0b', undefined, 'TypeError', 'ERR_INVALID_ARG_VALUE'],
    ['options not an object', 'FILE', 'yes', 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['options an array', 'FILE', [], 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['shared not a boolean', 'FILE', { shared: 1 }, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['wait not a boolean', 'FILE', { wait: 'no' }, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['timeoutMs negative', 'FILE', { timeoutMs: -1 }, 'RangeError', 'ERR_INVALID_ARG_VALUE'],
    ['timeoutMs fractional', 'FILE', { timeoutMs: 1.5 }, 'RangeError', 'ERR_INVALID_ARG_VALUE'],
    ['timeoutMs NaN', 'FILE', { timeoutMs: NaN }, 'RangeError', 'ERR_INVALID_ARG_VALUE'],
    ['timeoutMs Infinity', 'FILE', { timeoutMs: Infinity }, 'RangeError', 'ERR_INVALID_ARG_VALUE'],
    ['timeoutMs too large for a timer', 'FILE', { timeoutMs: 2 ** 31 }, 'RangeError', 'ERR_INVALID_ARG_VALUE'],
    ['timeoutMs a string', 'FILE', { timeoutMs: '10' }, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
    ['signal not an AbortSignal', 'FILE', { signal: { aborted: false } }, 'TypeError', 'ERR_INVALID_ARG_TYPE'],
  ]
  test.each(cases)('%s', async (_label, p, options, ctor, code) => {
    const dir = freshDir()
    const file = p === 'FILE' ? path.join(dir, 'a.lock') : p
    const err = await lockFile(file as string, options as never).catch((e: unknown) => e)
    expect((err as Error).constructor.name).toBe(ctor)
    expect(err).toMatchObject({ code })
    expect(fs.readdirSync(dir)).toEqual([])
  })
})

/**
 * Leases that survive the sidecar (DESIGN.md, "lease handoff"): a child given `leaseFd` keeps the workspace live
 * after its sidecar exits or releases it; sweep leaves it alone until the child is gone, then reclaims it.
 * `pool.adopt(id)` takes over a workspace whose lease is free: of two sidecars racing for one orphan exactly one
 * wins; a live or unknown workspace is refused.
 */
import { spawn } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, onTestFinished, test } from 'vitest'
import { openPool, VmspaceError, type Pool, type Workspace } from '../lib/index.js'
import {
  allocateIn,
  Child,
  emptyPoolState,
  eventually,
  fixtures,
  freshDir,
  killOnFinish,
  loopChild,
  leasePath,
  openFdTargets,
  orphan,
  poolState,
  randomId,
  runCommand,
  tryLease,
  workspaceChild,
} from './helpers.js'
import { flocksOn } from './lock-helpers.js'

/** A fifo below a fresh directory; writing a line to it ends the `read line < fifo` children of these tests. */
function makeFifo(): string {
  const fifo = path.join(freshDir(), 'vm.fifo')
  const r = runCommand('mkfifo', [fifo])
  expect(r.status, r.stderr).toBe(0)
  return fifo
}

/** Writes a line to the fifo once its reader has it open (ENXIO until then). */
async function endReader(fifo: string): Promise<void> {
  let fd = -1
  await eventually(() => {
    try {
      fd = fs.openSync(fifo, fs.constants.O_WRONLY | fs.constants.O_NONBLOCK)
      return true
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'ENXIO') return false
      throw e
    }
  })
  fs.writeSync(fd, 'exit\n')
  fs.closeSync(fd)
}

async function errorOf(p: Promise<unknown>): Promise<VmspaceError> {
  const e = await p.then(
    () => expect.fail('expected a rejection'),
    (e: unknown) => e,
  )
  expect(e).toBeInstanceOf(VmspaceError)
  return e as VmspaceError
}

describe('a lease handed to a child process', () => {
  test('keeps the workspace live after its sidecar exits: sweep leaves it (live), list() shows it live; once the child exits, sweep reclaims it', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const fifo = makeFifo()
    const sidecar = new Child(path.join(fixtures, 'handoff-parent.cjs'), [pool.root, fifo])
    const handed = (await sidecar.expect('handed')) as unknown as { id: string; name: string; path: string; content: string; pid: number }
    killOnFinish(handed.pid)
    expect(await sidecar.exited).toEqual({ code: 0, signal: null })

    // The sidecar is gone; the VM process holds the lease as its fd 3.
    expect(openFdTargets(handed.pid).get(3)).toBe(leasePath(pool.root, handed.name))
    expect(tryLease(pool.root, handed.name)).toBe(99)
    for (const options of [{}, { graceMs: 0 }]) {
      const report = await pool.sweep(options)
      expect(report).toEqual({ reclaimed: [], live: 1, failed: [], leasesRemoved: 0, foreign: [] })
    }
    expect(await pool.list()).toEqual([
      expect.objectContaining({ id: handed.id, name: handed.name, live: true, pid: sidecar.pid, meta: { parent: sidecar.pid } }),
    ])
    expect(fs.readFileSync(path.join(handed.path, 'own.txt'), 'utf8')).toBe(handed.content)
    expect((await errorOf(pool.adopt(handed.id))).code).toBe('ERR_LEASE_HELD')

    // The VM process exits by itself: the last holder of the lease is gone.
    await endReader(fifo)
    await eventually(() => tryLease(pool.root, handed.name) === 0)
    expect(await pool.list()).toEqual([expect.objectContaining({ id: handed.id, live: false })])
    const report = await pool.sweep()
    expect(report.failed).toEqual([])
    expect(report.reclaimed).toEqual([expect.objectContaining({ id: handed.id, name: handed.name, from: 'published' })])
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })

  test('in one process: after release() the child alone holds it; sweep leaves it until the child exits, then reclaims it', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const fifo = makeFifo()
    const ws = await pool.allocate({ meta: { vm: 'in-process' } })
    fs.writeFileSync(path.join(ws.path, 'own.txt'), 'mine')
    const child = spawn('sh', ['-c', 'read line < "$1"', 'vm', fifo], { stdio: ['ignore', 'ignore', 'ignore', ws.leaseFd] })
    const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)))
    onTestFinished(() => void child.kill('SIGKILL'))
    await new Promise((r) => child.once('spawn', r))

    await ws.release()
    expect(ws.status).toBe('released')
    // This process no longer has the lease open; the child does.
    expect([...openFdTargets(process.pid).values()]).not.toContain(leasePath(pool.root, ws.name))
    expect(openFdTargets(child.pid!).get(3)).toBe(leasePath(pool.root, ws.name))
    expect((await errorOf(ws.dispose())).code).toBe('ERR_DISPOSED')
    expect((await errorOf(ws.clone(fifo, 'x'))).code).toBe('ERR_DISPOSED')
    expect((await errorOf(ws.release())).code).toBe('ERR_DISPOSED')

    const report = await pool.sweep({ graceMs: 0 })
    expect(report).toEqual({ reclaimed: [], live: 1, failed: [], leasesRemoved: 0, foreign: [] })
    expect(await pool.list()).toEqual([expect.objectContaining({ id: ws.id, live: true, meta: { vm: 'in-process' } })])
    expect(fs.readFileSync(path.join(ws.path, 'own.txt'), 'utf8')).toBe('mine')

    await endReader(fifo)
    expect(await exited).toBe(0)
    const after = await pool.sweep({ graceMs: 0 })
    expect(after.failed).toEqual([])
    expect(after.reclaimed.map((e) => [e.id, e.from])).toEqual([[ws.id, 'published']])
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })

  test('release() without a handoff frees the lease at once: the workspace is an orphan that sweep reclaims', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const ws = await orphan(pool)
    expect(tryLease(pool.root, ws.name)).toBe(0)
    expect(await pool.list()).toEqual([expect.objectContaining({ id: ws.id, live: false })])
    const report = await pool.sweep()
    expect(report.reclaimed.map((e) => e.id)).toEqual([ws.id])
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })
})

describe('a hand-over that did not happen', () => {
  /** A workspace whose release() must reject and keep it: ERR_LEASE_NOT_HANDED_OVER, then still live and disposable. */
  async function expectKept(pool: Pool, ws: Workspace): Promise<void> {
    const err = await errorOf(ws.release())
    expect(err).toMatchObject({ code: 'ERR_LEASE_NOT_HANDED_OVER', path: ws.path })
    expect(ws.status).toBe('ready')
    expect(tryLease(pool.root, ws.name)).toBe(99)
    expect(await pool.sweep({ graceMs: 0 })).toEqual({ reclaimed: [], live: 1, failed: [], leasesRemoved: 0, foreign: [] })
    expect(fs.readFileSync(path.join(ws.path, 'own.txt'), 'utf8')).toBe(ws.id)
    await ws.dispose()
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  }

  async function allocated(): Promise<{ pool: Pool; ws: Workspace }> {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const ws = await pool.allocate()
    fs.writeFileSync(path.join(ws.path, 'own.txt'), ws.id)
    return { pool, ws }
  }

  test('a child that closes the fds it inherited (sh: exec 3>&-) drops the lease: release() rejects and keeps it', async () => {
    const { pool, ws } = await allocated()
    const lease = fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)
    const child = spawn('sh', ['-c', 'exec 3>&-; exec sleep 60'], { stdio: ['ignore', 'ignore', 'ignore', ws.leaseFd] })
    onTestFinished(() => void child.kill('SIGKILL'))
    await eventually(() => fs.readlinkSync(`/proc/${child.pid}/exe`).endsWith('/sleep'))
    // No fd of the child is the lease file (fd 3 itself may be taken again: a preloaded sanitizer runtime opens files).
    expect([...openFdTargets(child.pid!).values()]).not.toContain(lease)
    await expectKept(pool, ws)
  })

  test('a launcher that starts the VM without the fd and exits (Python subprocess, close_fds by default) drops it: release() rejects', async () => {
    const { pool, ws } = await allocated()
    const launcher = 'import subprocess; print(subprocess.Popen(["sleep", "60"], start_new_session=True).pid)'
    const child = spawn('python3', ['-c', launcher], { stdio: ['ignore', 'pipe', 'inherit', ws.leaseFd] })
    let out = ''
    child.stdout!.on('data', (d: Buffer) => (out += String(d)))
    expect(await new Promise((resolve) => child.once('exit', resolve))).toBe(0)
    const vm = Number(out)
    killOnFinish(vm)
    expect([...openFdTargets(vm).values()]).not.toContain(leasePath(pool.root, ws.name))
    await expectKept(pool, ws)
  })

  test('a command that cannot start (ENOENT) never held it: release() rejects and keeps it', async () => {
    const { pool, ws } = await allocated()
    const child = spawn('/nonexistent/vm', [], { stdio: ['ignore', 'ignore', 'ignore', ws.leaseFd] })
    const failed = new Promise((resolve) => child.once('error', resolve))
    await expectKept(pool, ws)
    expect(await failed).toMatchObject({ code: 'ENOENT' })
  })

  // spawn() returns once the child has exec'd (libuv waits on a close-on-exec pipe), so its fd 3 is in place.
  test('release() right after spawn(), without waiting for its spawn event, finds the child holding the lease', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    for (let i = 0; i < 20; i++) {
      const ws = await pool.allocate()
      const child = spawn('sleep', ['60'], { stdio: ['ignore', 'ignore', 'ignore', ws.leaseFd] })
      onTestFinished(() => void child.kill('SIGKILL'))
      await ws.release()
      expect(ws.status).toBe('released')
      expect(openFdTargets(child.pid!).get(3)).toBe(leasePath(pool.root, ws.name))
    }
    expect(await pool.sweep({ graceMs: 0 })).toMatchObject({ reclaimed: [], live: 20, failed: [] })
  })
})

describe('adopt', () => {
  test('two processes adopting one orphan at once (released by a barrier): exactly one wins, the other gets ERR_LEASE_HELD; the winner disposes it', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const adopters = [new Child(path.join(fixtures, 'adopt-child.cjs'), [pool.root]), new Child(path.join(fixtures, 'adopt-child.cjs'), [pool.root])]
    await Promise.all(adopters.map((c) => c.expect('ready')))

    // The first orphan's owner is a process that died; the others are released here.
    const owner = workspaceChild(pool.root)
    const [first] = await allocateIn([owner])
    owner.send('exit')
    await owner.exited
    const orphans: { id: string; path: string; content: string; meta: Record<string, number> }[] = [
      { id: first.id, path: first.path, content: first.content, meta: { owner: owner.pid } },
    ]
    for (let i = 0; i < 24; i++) {
      const ws = await orphan(pool, { round: i })
      orphans.push({ id: ws.id, path: ws.path, content: ws.id, meta: { round: i } })
    }

    const wins = [0, 0]
    for (const o of orphans) {
      // Both children block reading stdin; the two writes release them together.
      for (const c of adopters) c.send(`adopt ${o.id}`)
      const answers = await Promise.all(adopters.map((c) => c.next()))
      const winners = answers.flatMap((a, i) => (a.event === 'adopted' ? [i] : []))
      expect(winners, JSON.stringify(answers)).toHaveLength(1)
      const [w] = winners
      wins[w]++
      expect(answers[w]).toMatchObject({ id: o.id, path: o.path, meta: o.meta })
      expect(answers[1 - w]).toMatchObject({ event: 'error', code: 'ERR_LEASE_HELD' })
      expect(fs.readFileSync(path.join(o.path, 'own.txt'), 'utf8')).toBe(o.content)
      expect(tryLease(pool.root, `vm-${o.id}`)).toBe(99)
      expect((await pool.list()).find((e) => e.id === o.id)).toMatchObject({ live: true })

      adopters[w].send('dispose')
      expect(await adopters[w].expect('disposed')).toMatchObject({ status: 'disposed' })
      expect(fs.existsSync(o.path)).toBe(false)
      expect(fs.existsSync(leasePath(pool.root, `vm-${o.id}`))).toBe(false)
    }
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    console.log(`adopt race: ${orphans.length} orphans, won ${wins[0]} / ${wins[1]} by the two processes`)
  })

  test('an unknown id rejects with ENOENT and makes nothing', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const id = randomId()
    const err = await errorOf(pool.adopt(id))
    expect(err).toMatchObject({ code: 'ENOENT', path: path.join(pool.root, `vm-${id}`) })
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })

  test('an id disposed meanwhile rejects with ENOENT', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const ws = await pool.allocate()
    await ws.dispose()
    expect((await errorOf(pool.adopt(ws.id))).code).toBe('ENOENT')
  })

  test('a live workspace is refused with ERR_LEASE_HELD, whether another process or this one holds it, and left as it is', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const other = workspaceChild(pool.root)
    const [theirs] = await allocateIn([other])
    const mine = await pool.allocate()

    for (const id of [theirs.id, mine.id]) {
      const err = await errorOf(pool.adopt(id))
      expect(err).toMatchObject({ code: 'ERR_LEASE_HELD', path: path.join(pool.root, `vm-${id}`) })
    }
    // A second pool object in this process is refused too (the lease is held by another open file description).
    const again = await openPool(pool.root)
    expect((await errorOf(again.adopt(mine.id))).code).toBe('ERR_LEASE_HELD')

    expect(fs.readFileSync(path.join(theirs.path, 'own.txt'), 'utf8')).toBe(theirs.content)
    other.send('check')
    expect((await other.expect('checked')).content).toBe(theirs.content)
    expect((await pool.list()).every((e) => e.live)).toBe(true)
    await mine.dispose()
  })

  test('an adopted workspace carries its metadata and its files, holds the lease, and disposes cleanly', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const owner = workspaceChild(pool.root)
    const [theirs] = await allocateIn([owner])
    owner.send('exit')
    await owner.exited

    const ws = await pool.adopt(theirs.id)
    expect(ws).toMatchObject({ id: theirs.id, name: theirs.name, path: theirs.path, status: 'ready' })
    expect(ws.info).toMatchObject({ id: theirs.id, live: true, meta: { owner: owner.pid }, pid: owner.pid })
    expect(fs.readFileSync(path.join(ws.path, 'own.txt'), 'utf8')).toBe(theirs.content)
    expect(fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)).toBe(leasePath(pool.root, ws.name))
    expect(tryLease(pool.root, ws.name)).toBe(99)
    expect((await pool.sweep({ graceMs: 0 })).live).toBe(1)

    await ws.dispose()
    expect(ws.status).toBe('disposed')
    expect(fs.existsSync(leasePath(pool.root, ws.name))).toBe(false)
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })

  test('an orphan whose lease file another taker has flocked (a sweep or adopt at work) is refused ERR_LEASE_HELD naming flock, and left', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const ws = await orphan(pool)
    const file = leasePath(pool.root, ws.name)
    // flock(1) holds LOCK_EX on the lease file, as a sweep taking it does, until its `cat` reads end of input.
    const taker = spawn('flock', ['-o', '-x', file, 'cat'], { stdio: ['pipe', 'ignore', 'ignore'] })
    onTestFinished(() => void taker.kill('SIGKILL'))
    await eventually(() => flocksOn(file).some((e) => !e.shared && !e.blocked && e.pid !== process.pid))
    expect(await errorOf(pool.adopt(ws.id))).toMatchObject({ code: 'ERR_LEASE_HELD', syscall: 'flock', path: ws.path })
    expect(fs.readFileSync(path.join(ws.path, 'own.txt'), 'utf8')).toBe(ws.id)
    taker.stdin!.end()
    await new Promise((r) => taker.once('exit', r))
    const adopted = await pool.adopt(ws.id)
    await adopted.dispose()
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })

  test('a flock put on a workspace directory by someone else changes nothing: adopt and sweep judge the lease file alone', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    for (const op of ['adopt', 'sweep'] as const) {
      const ws = await orphan(pool)
      // flock(1) holds LOCK_SH on the directory until its `cat` reads end of input (-o: cat itself holds no fd of it).
      const prober = spawn('flock', ['-o', '-s', ws.path, 'cat'], { stdio: ['pipe', 'ignore', 'ignore'] })
      onTestFinished(() => void prober.kill('SIGKILL'))
      await eventually(() => flocksOn(ws.path).some((e) => e.shared && !e.blocked && e.pid !== process.pid))
      const outcome = (op === 'adopt' ? pool.adopt(ws.id) : pool.sweep({ graceMs: 0 })).then(
        (value) => ({ value }),
        (error: unknown) => ({ error }),
      )
      setTimeout(() => prober.stdin!.end(), 50)
      const r = await outcome
      expect(r).not.toHaveProperty('error')
      if (op === 'adopt') {
        const adopted = (r as { value: Workspace }).value
        expect(adopted).toMatchObject({ id: ws.id, status: 'ready' })
        await adopted.dispose()
      } else {
        expect((r as { value: { reclaimed: { id: string }[]; live: number } }).value).toMatchObject({
          reclaimed: [expect.objectContaining({ id: ws.id })],
          live: 0,
        })
      }
      expect(poolState(pool.root)).toEqual(emptyPoolState)
    }
  })

  // list() probes a lease without taking any lock (F_OFD_GETLK): an adopt never meets it.
  test('an orphan is never refused with ERR_LEASE_HELD because another process lists the pool', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const ws = await orphan(pool)
    const lister = loopChild(pool.root, 'list')
    await lister.expect('ready')
    const refused: string[] = []
    for (let i = 0; i < 2000; i++) {
      try {
        const adopted = await pool.adopt(ws.id)
        await adopted.release({ force: true })
      } catch (e) {
        refused.push((e as VmspaceError).code)
      }
    }
    lister.send('stop')
    await lister.expect('stopped')
    expect(refused.length, `refused ${refused.length} of 2000: ${[...new Set(refused)].join(', ')}`).toBe(0)
  })
})

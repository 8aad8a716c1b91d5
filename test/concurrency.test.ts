/**
 * Many allocators on one pool at once (DESIGN.md: "many sidecar processes share one pool directory at the same
 * time"): concurrent callers in one process, processes released together by a barrier, and worker threads.
 * Every workspace is distinct, and disposing some never touches the others.
 */
import { randomBytes } from 'node:crypto'
import { once } from 'node:events'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { Worker } from 'node:worker_threads'
import { describe, expect, onTestFinished, test } from 'vitest'
import { openPool } from '../lib/index.js'
import { allocateIn, Barrier, emptyPoolState, fixtures, freshDir, openFdTargets, poolState, workspaceChild } from './helpers.js'

function distinct<T>(values: T[]): number {
  return new Set(values).size
}

describe('16 concurrent callers in one process', () => {
  test('get distinct workspaces; after half are disposed, every survivor reads its own file back', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const barrier = new Barrier(16)
    const workspaces = await Promise.all(
      Array.from({ length: 16 }, async (_, i) => {
        await barrier.wait()
        return pool.allocate({ meta: { i } })
      }),
    )
    expect(distinct(workspaces.map((w) => w.id))).toBe(16)
    expect(distinct(workspaces.map((w) => w.path))).toBe(16)
    expect(distinct(workspaces.map((w) => w.leaseFd))).toBe(16)
    const contents = workspaces.map((w) => {
      const data = randomBytes(4096)
      fs.writeFileSync(path.join(w.path, 'own.bin'), data)
      return data
    })

    const [gone, survivors] = [workspaces.filter((_, i) => i % 2 === 0), workspaces.filter((_, i) => i % 2 === 1)]
    await Promise.all(gone.map((w) => w.dispose()))
    for (const w of gone) expect(fs.existsSync(w.path)).toBe(false)
    workspaces.forEach((w, i) => {
      if (i % 2 === 1) expect(fs.readFileSync(path.join(w.path, 'own.bin')).equals(contents[i])).toBe(true)
    })
    expect(poolState(pool.root).visible).toEqual(survivors.map((w) => w.name).sort())
    expect((await pool.list()).filter((e) => e.live).map((e) => e.id).sort()).toEqual(survivors.map((w) => w.id).sort())

    await Promise.all(survivors.map((w) => w.dispose()))
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })
})

describe('many calls in flight at once (served in batches per libuv hop)', () => {
  test('400 allocates, every other one failing, each settle with their own result; then 200 disposes leave nothing', async () => {
    const dir = freshDir()
    const pool = await openPool(path.join(dir, 'pool'))
    fs.writeFileSync(path.join(dir, 'src'), 'bytes')
    const missing = path.join(dir, 'missing')
    const results = await Promise.allSettled(
      Array.from({ length: 400 }, (_, i) =>
        pool.allocate({ meta: { i }, template: { f: i % 2 ? missing : path.join(dir, 'src') } }),
      ),
    )
    const made = results.flatMap((r, i) => {
      if (i % 2) {
        expect(r).toMatchObject({ status: 'rejected', reason: { code: 'ENOENT', path: missing } })
        return []
      }
      expect(r.status).toBe('fulfilled')
      return [(r as PromiseFulfilledResult<Awaited<ReturnType<typeof pool.allocate>>>).value]
    })
    expect(made).toHaveLength(200)
    expect(distinct(made.map((w) => w.leaseFd))).toBe(200)
    expect(made.map((w) => fs.readFileSync(path.join(w.path, 'f'), 'utf8'))).toEqual(made.map(() => 'bytes'))
    const listed = new Map((await pool.list()).map((e) => [e.id, (e.meta as { i: number }).i]))
    expect(made.map((w) => listed.get(w.id))).toEqual(made.map((_, i) => 2 * i))
    await Promise.all(made.map((w) => w.dispose()))
    expect(made.map((w) => w.status)).toEqual(made.map(() => 'disposed'))
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    await pool.close()
    expect([...openFdTargets(process.pid).values()].filter((t) => t.startsWith(pool.root))).toEqual([])
  })
})

describe('8 processes released together by a barrier', () => {
  test('get distinct workspaces; after half are disposed, every survivor reads its own file back', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const children = Array.from({ length: 8 }, () => workspaceChild(pool.root))
    // Each child has opened the pool and now blocks reading stdin: the barrier. One write each releases them.
    const allocated = await allocateIn(children)

    expect(distinct(allocated.map((a) => a.id))).toBe(8)
    expect(distinct(allocated.map((a) => a.path))).toBe(8)
    for (const a of allocated) {
      expect(a.path).toBe(path.join(pool.root, a.name))
      expect(fs.readFileSync(path.join(a.path, 'own.txt'), 'utf8')).toBe(a.content)
    }
    const listed = await pool.list()
    expect(listed).toHaveLength(8)
    expect(listed.every((e) => e.live)).toBe(true)
    expect(listed.map((e) => e.meta?.owner).sort()).toEqual(children.map((c) => c.pid).sort())

    const [gone, survivors] = [children.slice(0, 4), children.slice(4)]
    for (const c of gone) c.send('dispose')
    await Promise.all(gone.map((c) => c.expect('disposed')))
    for (const a of allocated.slice(0, 4)) expect(fs.existsSync(a.path)).toBe(false)

    for (const c of survivors) c.send('check')
    const checked = await Promise.all(survivors.map((c) => c.expect('checked')))
    checked.forEach((m, i) => {
      const mine = allocated[4 + i]
      expect(m.content).toBe(mine.content)
      expect(fs.readFileSync(path.join(mine.path, 'own.txt'), 'utf8')).toBe(mine.content)
    })
    expect(poolState(pool.root).visible).toEqual(allocated.slice(4).map((a) => a.name).sort())

    for (const c of survivors) c.send('dispose')
    await Promise.all(survivors.map((c) => c.expect('disposed')))
    for (const c of children) c.proc.stdin!.end()
    const exits = await Promise.all(children.map((c) => c.exited))
    expect(exits.every((e) => e.code === 0)).toBe(true)
    expect(poolState(pool.root)).toEqual(emptyPoolState)
  })
})

describe('worker_threads', () => {
  test('two workers at once load the addon, allocate, dispose and exit cleanly', async () => {
    const root = path.join(freshDir(), 'pool')
    fs.mkdirSync(root)
    const errors: unknown[] = []
    const workers = [0, 1].map(() => {
      const w = new Worker(path.join(fixtures, 'worker.cjs'), { workerData: { root } })
      w.on('error', (e) => errors.push(e))
      onTestFinished(() => {
        void w.terminate()
      })
      return w
    })
    // once() rejects on an 'error' event: kept as a value until awaited below, never an unhandled rejection.
    const exits = workers.map((w) => once(w, 'exit').catch((e: unknown) => [e]))
    const messages = workers.map((w) => {
      const queue: unknown[] = []
      const waiters: ((m: unknown) => void)[] = []
      w.on('message', (m) => (waiters.length ? waiters.shift()!(m) : queue.push(m)))
      return () => (queue.length ? Promise.resolve(queue.shift()) : new Promise((r) => waiters.push(r)))
    })
    expect(await Promise.all(messages.map((next) => next()))).toEqual([{ event: 'ready' }, { event: 'ready' }])
    for (const w of workers) w.postMessage('go')
    const done = (await Promise.all(messages.map((next) => next()))) as { event: string; id: string; content: string; expected: string; status: string }[]
    for (const d of done) {
      expect(d).toMatchObject({ event: 'done', status: 'disposed' })
      expect(d.content).toBe(d.expected)
    }
    expect(distinct(done.map((d) => d.id))).toBe(2)
    expect((await Promise.all(exits)).map(([code]) => code)).toEqual([0, 0])
    expect(errors).toEqual([])
    expect(poolState(root)).toEqual(emptyPoolState)
  })

  test('a worker that ends without dispose releases its workspace’s lease (the addon’s cleanup hooks)', async () => {
    const root = path.join(freshDir(), 'pool')
    fs.mkdirSync(root)
    const w = new Worker(path.join(fixtures, 'worker.cjs'), { workerData: { root, leave: true } })
    onTestFinished(() => {
      void w.terminate()
    })
    const exited = once(w, 'exit')
    const messages: { event: string; id?: string; path?: string }[] = []
    w.on('message', (m) => {
      messages.push(m)
      if (m.event === 'ready') w.postMessage('go')
    })
    expect((await exited)[0]).toBe(0)
    const left = messages.find((m) => m.event === 'left')!
    // The workspace the worker left: one of this pool's, named for its id.
    expect(left).toMatchObject({ event: 'left', id: expect.stringMatching(/^[0-9a-f]{32}$/) })
    expect(path.dirname(left.path!)).toBe(root)
    expect(path.basename(left.path!).endsWith(`-${left.id}`)).toBe(true)
    expect([...openFdTargets(process.pid).values()]).not.toContain(left.path)
    const pool = await openPool(root)
    expect(await pool.list()).toEqual([expect.objectContaining({ id: left.id, live: false })])
  })
})

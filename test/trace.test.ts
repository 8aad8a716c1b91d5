/**
 * What vmspace shows from outside: a `diagnostics_channel` tracing channel per operation (vmspace:allocate, :clone,
 * :dispose, :sweep, :lock) whose subscribers see start/end/asyncStart/asyncEnd on success and start/end/error/
 * asyncStart/asyncEnd on failure, with the exact fields of each; and `NODE_DEBUG=vmspace` lines. Nothing here
 * measures time: the cost without a subscriber is shown by `npm run bench -- --only trace`.
 */
import { spawn, spawnSync } from 'node:child_process'
import * as dc from 'node:diagnostics_channel'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterEach, describe, expect, test } from 'vitest'
import { clone, lockFile, openPool, VmspaceError, type Workspace } from '../lib/index.js'
import { freshDir, leasePath, openFdsUnder, randomId, repoRoot, writeRandomFile } from './helpers.js'
import { waitersOn } from './lock-helpers.js'

type Event = 'start' | 'end' | 'asyncStart' | 'asyncEnd' | 'error'
interface Seen {
  event: Event
  /** The context's fields at that moment, `result` and `error` left out (checked on their own). */
  fields: Record<string, unknown>
  result?: unknown
  error?: unknown
}

const unsubscribes: (() => void)[] = []
afterEach(() => {
  while (unsubscribes.length) unsubscribes.pop()!()
})

/** Records every event of the tracing channel `name` until the test ends. */
function record(name: string): Seen[] {
  const seen: Seen[] = []
  const on = (event: Event) => (ctx: object) => {
    const { result, error, ...fields } = ctx as { result?: unknown; error?: unknown }
    seen.push({ event, fields: { ...fields }, ...('result' in ctx ? { result } : {}), ...('error' in ctx ? { error } : {}) })
  }
  const handlers = { start: on('start'), end: on('end'), asyncStart: on('asyncStart'), asyncEnd: on('asyncEnd'), error: on('error') }
  const channel = dc.tracingChannel(name)
  channel.subscribe(handlers)
  unsubscribes.push(() => channel.unsubscribe(handlers))
  return seen
}

const success: Event[] = ['start', 'end', 'asyncStart', 'asyncEnd']
const failure: Event[] = ['start', 'end', 'error', 'asyncStart', 'asyncEnd']

describe('vmspace:allocate', () => {
  test('a subscriber sees start with the pool, then the new workspace, retries and template bytes at the end', async () => {
    const dir = freshDir()
    const base = path.join(dir, 'base.img')
    writeRandomFile(base, 300_000)
    const pool = await openPool(path.join(dir, 'pool'), { prefix: 'tr', reflink: 'never' })
    const seen = record('vmspace:allocate')
    const ws = await pool.allocate({ template: { 'rootfs.img': base } })
    expect(seen.map((s) => s.event)).toEqual(success)
    const start = { root: pool.root, prefix: 'tr' }
    expect(seen[0].fields).toEqual(start)
    expect(seen[1].fields).toEqual(start) // end: the call returned its promise, nothing known yet
    const done = { ...start, id: ws.id, name: ws.name, retries: 0, files: 1, bytes: 300_000, method: 'copy' }
    expect(seen[2]).toEqual({ event: 'asyncStart', fields: done, result: ws })
    expect(seen[3]).toEqual({ event: 'asyncEnd', fields: done, result: ws })
    await ws.dispose()
    await pool.close()
  })

  test('without a template there is no method, and files and bytes are 0', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const seen = record('vmspace:allocate')
    const ws = await pool.allocate()
    expect(seen[3].fields).toEqual({ root: pool.root, prefix: 'vm', id: ws.id, name: ws.name, retries: 0, files: 0, bytes: 0 })
    await ws.dispose()
    await pool.close()
  })

  test('a failed allocate publishes error with the VmspaceError, and no workspace fields', async () => {
    const dir = freshDir()
    const pool = await openPool(path.join(dir, 'pool'))
    const seen = record('vmspace:allocate')
    const err = await pool.allocate({ template: { a: path.join(dir, 'missing') } }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ENOENT' })
    expect(seen.map((s) => s.event)).toEqual(failure)
    for (const s of seen) expect(s.fields).toEqual({ root: pool.root, prefix: 'vm' })
    expect(seen[2].error).toBe(err)
    await pool.close()
  })
})

describe('vmspace:clone', () => {
  test('clone(): source and dest as passed, then path, kind, method, files and bytes', async () => {
    const dir = freshDir()
    const src = path.join(dir, 'src')
    writeRandomFile(src, 5000)
    const seen = record('vmspace:clone')
    const r = await clone(src, path.join(dir, 'dst'), { reflink: 'never' })
    expect(seen.map((s) => s.event)).toEqual(success)
    expect(seen[0].fields).toEqual({ source: src, dest: path.join(dir, 'dst') })
    expect(seen[3]).toEqual({
      event: 'asyncEnd',
      fields: { source: src, dest: path.join(dir, 'dst'), path: path.join(dir, 'dst'), kind: 'file', method: 'copy', files: 1, bytes: 5000 },
      result: r,
    })
  })

  test('Workspace.clone(): the pool root and workspace id too; an EEXIST is an error event', async () => {
    const dir = freshDir()
    const src = path.join(dir, 'tree')
    fs.mkdirSync(src)
    writeRandomFile(path.join(src, 'a'), 100)
    writeRandomFile(path.join(src, 'b'), 200)
    const pool = await openPool(path.join(dir, 'pool'), { reflink: 'never' })
    const ws = await pool.allocate()
    const seen = record('vmspace:clone')
    await ws.clone(src, 'copy', { reflink: 'never' })
    const start = { root: pool.root, id: ws.id, source: src, dest: 'copy' }
    expect(seen[0].fields).toEqual(start)
    expect(seen[3].fields).toEqual({ ...start, path: path.join(ws.path, 'copy'), kind: 'tree', method: 'copy', files: 2, bytes: 300 })
    seen.length = 0
    const err = await ws.clone(src, 'copy').catch((e: unknown) => e)
    expect(err).toMatchObject({ code: 'EEXIST' })
    expect(seen.map((s) => s.event)).toEqual(failure)
    expect(seen[2]).toEqual({ event: 'error', fields: start, error: err })
    await ws.dispose()
    await pool.close()
  })
})

describe('vmspace:dispose', () => {
  test('one traced operation per workspace, however often dispose() is called', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const ws = await pool.allocate()
    const seen = record('vmspace:dispose')
    await Promise.all([ws.dispose(), ws.dispose()])
    await ws.dispose()
    expect(seen.map((s) => s.event)).toEqual(success)
    for (const s of seen) expect(s.fields).toEqual({ root: pool.root, id: ws.id, name: ws.name })
    await pool.close()
  })

  test('a start subscriber that reaches back into the workspace finds it disposing: the same promise, ERR_DISPOSED, and the pool closes all its fds', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const ws = await pool.allocate()
    let inner: Promise<void> | undefined
    let clone: Promise<unknown> | undefined
    let release: Promise<unknown> | undefined
    const handlers = {
      start: () => {
        if (inner) return
        inner = ws.dispose()
        clone = ws.clone('/etc/hostname', 'h').catch((e: VmspaceError) => e.code)
        release = ws.release().catch((e: VmspaceError) => e.code)
      },
      end: () => {},
      asyncStart: () => {},
      asyncEnd: () => {},
      error: () => {},
    }
    const channel = dc.tracingChannel('vmspace:dispose')
    channel.subscribe(handlers)
    unsubscribes.push(() => channel.unsubscribe(handlers))
    const outer = ws.dispose()
    await outer
    expect(inner).toBe(outer)
    expect(await clone).toBe('ERR_DISPOSED')
    expect(await release).toBe('ERR_DISPOSED')
    expect(ws.status).toBe('disposed')
    await pool.close()
    expect(openFdsUnder(pool.root)).toEqual([])
    expect(fs.readdirSync(pool.root)).toEqual(['.vmspace'])
  })
})

describe('vmspace:sweep', () => {
  test('the options as passed, then the counts of the report', async () => {
    const root = path.join(freshDir(), 'pool')
    const pool = await openPool(root)
    const kept = await pool.allocate()
    const orphaned: Workspace = await pool.allocate()
    fs.writeFileSync(path.join(orphaned.path, 'data'), Buffer.alloc(8192, 1))
    await orphaned.release({ force: true })
    // A directory named like a workspace without a lease file (not vmspace's: foreign, left), and a lease file whose
    // workspace is nowhere (removed: leasesRemoved).
    const foreign = path.join(root, `vm-${randomId()}`)
    fs.mkdirSync(foreign)
    fs.writeFileSync(leasePath(root, `vm-${randomId()}`), '', { mode: 0o600 })
    const seen = record('vmspace:sweep')
    const options = { graceMs: 0 }
    const report = await pool.sweep(options)
    expect(report.reclaimed.map((e) => e.id)).toEqual([orphaned.id])
    expect(report).toMatchObject({ live: 1, failed: [], leasesRemoved: 1, foreign: [foreign] })
    expect(seen.map((s) => s.event)).toEqual(success)
    expect(seen[0].fields).toEqual({ root, options })
    expect(seen[3]).toEqual({
      event: 'asyncEnd',
      fields: { root, options, reclaimed: 1, bytes: report.reclaimed[0].bytes, live: 1, failed: 0, leasesRemoved: 1, foreign: 1 },
      result: report,
    })
    expect(report.reclaimed[0].bytes).toBeGreaterThan(0)
    await kept.dispose()
    await pool.close()
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

describe('vmspace:lock', () => {
  test('a lock got at once: waited false; one got after a wait: waited true; both with waitMs', async () => {
    const file = path.join(freshDir(), 'l.lock')
    const seen = record('vmspace:lock')
    const first = await lockFile(file)
    expect(seen.map((s) => s.event)).toEqual(success)
    expect(seen[3].fields).toEqual({ path: file, options: undefined, waited: false, waitMs: expect.any(Number) })
    expect(seen[3].result).toBe(first)
    await first.release()
    const holder = await heldByFlock(file) // another process: the wait is one in flock(2)
    seen.length = 0
    const options = { timeoutMs: 60_000 }
    const called = performance.now()
    const second = lockFile(file, options)
    await waitersOn(file, 1) // the second call is blocked in flock (the kernel's view, /proc/locks)
    await holder.release()
    const lock = await second
    const callMs = performance.now() - called
    expect(seen.map((s) => s.event)).toEqual(success)
    expect(seen[0].fields).toEqual({ path: file, options })
    expect(seen[3].fields).toEqual({ path: file, options, waited: true, waitMs: expect.any(Number) })
    // It did wait (blocked in flock until the holder let go), and no longer than the call took.
    expect(seen[3].fields.waitMs as number).toBeGreaterThan(0)
    expect(seen[3].fields.waitMs as number).toBeLessThanOrEqual(callMs)
    await lock.release()
  })

  test('a lock got after an earlier request of this thread let go: waited true', async () => {
    const file = path.join(freshDir(), 'l.lock')
    const first = await Promise.resolve().then(() => lockFile(file)) // another task's, as a request handler's
    const seen = record('vmspace:lock')
    const second = lockFile(file) // queued behind the first: no fd, no flock wait
    await first.release()
    const lock = await second
    expect(seen.map((s) => s.event)).toEqual(success)
    expect(seen[3].fields).toEqual({ path: file, options: undefined, waited: true, waitMs: expect.any(Number) })
    await lock.release()
  })

  test('ERR_LOCK_HELD is an error event with the error', async () => {
    const file = path.join(freshDir(), 'l.lock')
    const held = await heldByFlock(file)
    const seen = record('vmspace:lock')
    const err = await lockFile(file, { wait: false }).catch((e: unknown) => e)
    expect(err).toMatchObject({ code: 'ERR_LOCK_HELD' })
    expect(seen.map((s) => s.event)).toEqual(failure)
    expect(seen[2]).toEqual({ event: 'error', fields: { path: file, options: { wait: false } }, error: err })
    await held.release()
  })
})

test('without a subscriber, nothing is published and the calls work as before', async () => {
  const names = ['allocate', 'clone', 'dispose', 'sweep', 'lock'].map((n) => `vmspace:${n}`)
  for (const n of names) {
    const c = dc.tracingChannel(n) as unknown as Record<Event, dc.Channel>
    for (const e of ['start', 'end', 'asyncStart', 'asyncEnd', 'error'] as const) expect(c[e].hasSubscribers).toBe(false)
  }
  const pool = await openPool(path.join(freshDir(), 'pool'))
  const ws = await pool.allocate()
  await ws.dispose()
  await pool.close()
})

describe('NODE_DEBUG=vmspace', () => {
  const script = (root: string) => `
    const v = require(${JSON.stringify(repoRoot)} + '/dist/index.js')
    ;(async () => {
      const pool = await v.openPool(${JSON.stringify(root)})
      const ws = await pool.allocate()
      console.log(ws.id)
      await ws.dispose()
      await (await v.lockFile(${JSON.stringify(root)} + '/x.lock')).release()
      await v.lockFile(${JSON.stringify(root)} + '/x.lock', { wait: 1 }).catch(() => {})
      await pool.close()
    })()`

  // Runs dist/ (built by npm test, as test/package.test.ts does), in a process of its own: debuglog reads
  // NODE_DEBUG once, at start.
  test('prints one line per operation on stderr: its fields, and its time or its error code', () => {
    const root = path.join(freshDir(), 'pool')
    const r = spawnSync(process.execPath, ['-e', script(root)], { env: { ...process.env, NODE_DEBUG: 'vmspace' }, encoding: 'utf8' })
    expect(r.status).toBe(0)
    const id = r.stdout.trim()
    const name = `vm-${id}`
    const lines = r.stderr
      .trim()
      .split('\n')
      .map((l) => l.replace(/^VMSPACE \d+: /, '').replace(/ [0-9.]+ms$/, ' <ms>').replace(/"waitMs":[0-9.e-]+/, '"waitMs":<n>'))
    expect(lines).toEqual([
      `allocate {"root":"${root}","prefix":"vm","id":"${id}","name":"${name}","retries":0,"files":0,"bytes":0} <ms>`,
      `dispose {"root":"${root}","id":"${id}","name":"${name}"} <ms>`,
      `lock {"path":"${root}/x.lock","waited":false,"waitMs":<n>} <ms>`,
      `lock {"path":"${root}/x.lock","options":{"wait":1}} failed ERR_INVALID_ARG_TYPE after <ms>`,
    ])
  })

  test('a call whose options cannot be serialised still gets its line, and its own error', () => {
    const file = path.join(freshDir(), 'x.lock')
    const code = `const v = require(${JSON.stringify(repoRoot)} + '/dist/index.js'); const o = {}; o.self = o
      v.lockFile(${JSON.stringify(file)}, o).catch((e) => console.log(e.code))`
    const r = spawnSync(process.execPath, ['-e', code], { env: { ...process.env, NODE_DEBUG: 'vmspace' }, encoding: 'utf8' })
    expect(r.status).toBe(0)
    expect(r.stdout.trim()).toBe('ERR_INVALID_ARG_VALUE')
    expect(r.stderr.trim()).toMatch(/^VMSPACE \d+: lock \(fields not serialisable\) failed ERR_INVALID_ARG_VALUE after [0-9.]+ms$/)
  })

  test('prints nothing without it', () => {
    const root = path.join(freshDir(), 'pool')
    const r = spawnSync(process.execPath, ['-e', script(root)], { env: { ...process.env, NODE_DEBUG: '' }, encoding: 'utf8' })
    expect(r.status).toBe(0)
    expect(r.stderr).toBe('')
  })
})

/**
 * Leases (DESIGN.md, "Leases"): a workspace's lease file in .vmspace/leases/ holds an OFD lock for as long as its
 * owner lives. The fd handed over (`leaseFd`) is a read-only regular file, never the workspace directory; it is
 * O_CLOEXEC, so a plain child does not inherit it, while a child given `leaseFd` in its stdio holds the lease, even
 * after the owner is gone.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, onTestFinished, test } from 'vitest'
import { openPool } from '../lib/index.js'
import { allocateIn, eventually, freshDir, killOnFinish, leasePath, openFdTargets, tryLease, workspaceChild } from './helpers.js'

async function setup() {
  const pool = await openPool(path.join(freshDir(), 'pool'))
  const ws = await pool.allocate()
  onTestFinished(async () => {
    await ws.dispose().catch(() => {})
  })
  return { pool, ws }
}

/** A `sleep` child, killed when the test finishes. */
function sleeper(stdio: (number | 'ignore')[]): ChildProcess {
  const child = spawn('sleep', ['60'], { stdio: stdio as never })
  onTestFinished(() => {
    child.kill('SIGKILL')
  })
  return child
}

function holds(pid: number, file: string): boolean {
  return [...openFdTargets(pid).values()].includes(file)
}

describe('the lease', () => {
  test('another process sees a live workspace’s lease held', async () => {
    const { pool, ws } = await setup()
    expect(tryLease(pool.root, ws.name)).toBe(99)
  })

  test('dispose releases it and removes the lease file after the workspace', async () => {
    const { pool, ws } = await setup()
    const file = leasePath(pool.root, ws.name)
    expect(fs.statSync(file).isFile()).toBe(true)
    await ws.dispose()
    expect(fs.existsSync(ws.path)).toBe(false)
    expect(fs.existsSync(file)).toBe(false)
  })

  test('leaseFd is a read-only fd of the lease file, not of the workspace directory', async () => {
    const { pool, ws } = await setup()
    expect(fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)).toBe(leasePath(pool.root, ws.name))
    expect(fs.fstatSync(ws.leaseFd).isFile()).toBe(true)
    const flags = parseInt(/^flags:\s+([0-7]+)$/m.exec(fs.readFileSync(`/proc/self/fdinfo/${ws.leaseFd}`, 'utf8'))![1], 8)
    expect(flags & 3).toBe(0) // O_RDONLY
    expect(() => fs.opendirSync(`/proc/self/fd/${ws.leaseFd}/..`)).toThrow(expect.objectContaining({ code: 'ENOTDIR' }))
  })

  test('leaseFd throws ERR_DISPOSED after dispose() and after release(): a spawn after them gets no stale number', async () => {
    const { pool, ws } = await setup()
    await ws.dispose()
    expect(() => ws.leaseFd).toThrow(expect.objectContaining({ code: 'ERR_DISPOSED', path: ws.path }))
    const next = await pool.allocate()
    onTestFinished(async () => {
      await next.dispose().catch(() => {})
    })
    expect(fs.readlinkSync(`/proc/self/fd/${next.leaseFd}`)).toBe(leasePath(pool.root, next.name))
    await next.release({ force: true })
    expect(() => next.leaseFd).toThrow(expect.objectContaining({ code: 'ERR_DISPOSED', message: `ERR_DISPOSED: workspace ${next.name} was released` }))
  })

  test('release() before the hand-over (the wrong order) rejects ERR_LEASE_NOT_HANDED_OVER and keeps the lease: live, never swept, disposable', async () => {
    const { pool, ws } = await setup()
    expect(fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)).toBe(leasePath(pool.root, ws.name)) // opened, never given to a child
    const err = await ws.release().then(
      () => expect.fail('expected a rejection'),
      (e: unknown) => e,
    )
    expect(err).toMatchObject({ code: 'ERR_LEASE_NOT_HANDED_OVER', path: ws.path, syscall: 'fcntl(F_OFD_GETLK)' })
    expect(ws.status).toBe('ready')
    // The handover fd was closed (no child had it); the owner's hold was not: another process sees the lease held.
    expect(tryLease(pool.root, ws.name)).toBe(99)
    expect(await pool.sweep({ graceMs: 0 })).toEqual({ reclaimed: [], live: 1, failed: [], leasesRemoved: 0, foreign: [] })
    expect(await pool.list()).toEqual([expect.objectContaining({ id: ws.id, live: true })])
    // Still this handle's: a new handover fd, and a dispose that removes everything.
    expect(fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)).toBe(leasePath(pool.root, ws.name))
    await ws.dispose()
    expect(ws.status).toBe('disposed')
    expect(fs.existsSync(ws.path)).toBe(false)
    expect(fs.existsSync(leasePath(pool.root, ws.name))).toBe(false)
  })

  test('release({ force: true }) lets go without a holder: the workspace is an orphan a sweep reclaims', async () => {
    const { pool, ws } = await setup()
    await ws.release({ force: true })
    expect(ws.status).toBe('released')
    expect(tryLease(pool.root, ws.name)).toBe(0)
    expect((await pool.sweep()).reclaimed.map((e) => e.id)).toEqual([ws.id])
  })

  test('release() options are strict: an unknown key or a non-boolean force is ERR_INVALID_ARG_VALUE/TYPE, and nothing is released', async () => {
    const { pool, ws } = await setup()
    await expect(ws.release({ forse: true } as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE', message: expect.stringContaining('forse') })
    await expect(ws.release({ force: 1 } as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_TYPE' })
    await expect(ws.release(null as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_TYPE' })
    expect(ws.status).toBe('ready')
    expect(tryLease(pool.root, ws.name)).toBe(99)
  })
})

describe('children', () => {
  test('a child spawned without handoff does not inherit the lease (O_CLOEXEC)', async () => {
    const { pool, ws } = await setup()
    expect(fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)).toBe(leasePath(pool.root, ws.name))
    const child = sleeper(['ignore', 'ignore', 'ignore'])
    await new Promise((r) => child.once('spawn', r))
    expect(holds(child.pid!, leasePath(pool.root, ws.name))).toBe(false)
  })

  test('a child spawned with leaseFd in its stdio holds the lease file open', async () => {
    const { pool, ws } = await setup()
    const child = sleeper(['ignore', 'ignore', 'ignore', ws.leaseFd])
    await new Promise((r) => child.once('spawn', r))
    expect(openFdTargets(child.pid!).get(3)).toBe(leasePath(pool.root, ws.name))
  })

  test('a handed-off child keeps the workspace live after its owner exits without dispose; its death frees it', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const owner = workspaceChild(pool.root)
    const [{ id, name }] = await allocateIn([owner])
    owner.send('handoff')
    const { pid } = (await owner.expect('handed')) as unknown as { pid: number }
    killOnFinish(pid)
    owner.send('exit')
    expect((await owner.exited).code).toBe(0)

    expect(openFdTargets(pid).get(3)).toBe(leasePath(pool.root, name))
    expect(await pool.list()).toEqual([expect.objectContaining({ id, live: true })])
    expect(tryLease(pool.root, name)).toBe(99)

    process.kill(pid, 'SIGKILL')
    await eventually(async () => !(await pool.list())[0].live)
    expect(tryLease(pool.root, name)).toBe(0)
  })
})

/**
 * Leases (DESIGN.md, "lease handoff"): a workspace's directory fd holds flock(LOCK_EX) for as long as its owner
 * lives. Another process cannot take it; dispose releases it; the fd is O_CLOEXEC, so a plain child does not
 * inherit it, while a child given `leaseFd` in its stdio holds it, even after the owner is gone.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, onTestFinished, test } from 'vitest'
import { openPool } from '../lib/index.js'
import { allocateIn, eventually, freshDir, killOnFinish, openFdTargets, tryFlockFd, tryFlockPath, workspaceChild } from './helpers.js'

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

function holds(pid: number, dir: string): boolean {
  return [...openFdTargets(pid).values()].includes(dir)
}

describe('the lease', () => {
  test('another process cannot take a live workspace’s lease (flock -n fails)', async () => {
    const { ws } = await setup()
    expect(tryFlockPath(ws.path)).toBe(99)
  })

  test('dispose releases it: flock on the (removed) directory succeeds from another process afterwards', async () => {
    const { ws } = await setup()
    const fd = fs.openSync(ws.path, 'r')
    try {
      expect(tryFlockFd(fd)).toBe(99)
      await ws.dispose()
      expect(tryFlockFd(fd)).toBe(0)
    } finally {
      fs.closeSync(fd)
    }
  })

  test('the lease fd is open on the workspace directory in this process', async () => {
    const { ws } = await setup()
    expect(fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)).toBe(ws.path)
  })

  test('leaseFd is -1 after dispose() and after release() (its number may be reused by the next fd opened)', async () => {
    const { pool, ws } = await setup()
    await ws.dispose()
    expect(ws.leaseFd).toBe(-1)
    const next = await pool.allocate()
    onTestFinished(async () => {
      await next.dispose().catch(() => {})
    })
    expect(next.leaseFd).toBeGreaterThanOrEqual(0)
    await next.release()
    expect(next.leaseFd).toBe(-1)
  })
})

describe('children', () => {
  test('a child spawned without handoff does not inherit the lease fd (O_CLOEXEC)', async () => {
    const { ws } = await setup()
    const child = sleeper(['ignore', 'ignore', 'ignore'])
    await new Promise((r) => child.once('spawn', r))
    expect(holds(child.pid!, ws.path)).toBe(false)
  })

  test('a child spawned with leaseFd in its stdio holds the workspace directory open', async () => {
    const { ws } = await setup()
    const child = sleeper(['ignore', 'ignore', 'ignore', ws.leaseFd])
    await new Promise((r) => child.once('spawn', r))
    expect(openFdTargets(child.pid!).get(3)).toBe(ws.path)
  })

  test('a handed-off child keeps the workspace live after its owner exits without dispose; its death frees it', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const owner = workspaceChild(pool.root)
    const [{ id, path: wsPath }] = await allocateIn([owner])
    owner.send('handoff')
    const { pid } = (await owner.expect('handed')) as unknown as { pid: number }
    killOnFinish(pid)
    owner.send('exit')
    expect((await owner.exited).code).toBe(0)

    expect(openFdTargets(pid).get(3)).toBe(wsPath)
    expect(await pool.list()).toEqual([expect.objectContaining({ id, live: true })])
    expect(tryFlockPath(wsPath)).toBe(99)

    process.kill(pid, 'SIGKILL')
    await eventually(async () => !(await pool.list())[0].live)
    expect(tryFlockPath(wsPath)).toBe(0)
  })
})

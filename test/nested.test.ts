/**
 * A pool inside a pool (docs/pool-on-disk.md, "A pool inside a pool"): openPool refuses a root in another pool's
 * workspace, .vmspace/ or trash, and a workspace's removal (dispose, sweep) never enters a pool's root it meets,
 * leaving it whole and reporting ERR_POOL_NESTED; a guest's fake .vmspace/ under a uid of its own is no pool.
 */
import { spawn } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { openPool, removeTree } from '../lib/index.js'
import { freshDir, mounts, needs } from './helpers.js'

async function outerPool() {
  const dir = freshDir()
  const pool = await openPool(path.join(dir, 'pool'))
  const ws = await pool.allocate()
  return { dir, pool, ws }
}

/** A fake pool root a guest writes into its workspace: .vmspace/version with the layout's words. */
function forgePool(dir: string): void {
  fs.mkdirSync(path.join(dir, '.vmspace'), { recursive: true })
  fs.writeFileSync(path.join(dir, '.vmspace', 'version'), 'vmspace-pool 1\n')
  fs.writeFileSync(path.join(dir, 'payload'), 'x'.repeat(4096))
}

describe('openPool inside another pool', () => {
  test('a root in a workspace, in .vmspace/ or in its trash, or the workspace itself, is ERR_POOL_NESTED; nothing made', async () => {
    const { dir, pool, ws } = await outerPool()
    const root = path.join(dir, 'pool')
    for (const inner of [
      path.join(ws.path, 'inner'),
      ws.path,
      path.join(ws.path, 'a', 'b', 'c'),
      path.join(root, '.vmspace', 'inner'),
      path.join(root, '.vmspace', 'trash', 'inner'),
      path.join(root, 'beside'),
    ]) {
      for (const options of [undefined, { nonEmpty: true }]) {
        await expect(openPool(inner, options), inner).rejects.toMatchObject({
          code: 'ERR_POOL_NESTED', errno: -16, path: inner, message: expect.stringContaining(root),
        })
      }
    }
    expect(fs.readdirSync(ws.path)).toEqual([])
    expect(fs.readdirSync(path.join(root, '.vmspace')).sort()).toEqual(['cache', 'leases', 'staging', 'trash', 'version'])
    expect(fs.readdirSync(path.join(root, '.vmspace', 'trash'))).toEqual([])
    expect(fs.existsSync(path.join(root, 'beside'))).toBe(false)
    // The pool itself, and a pool beside it, still open.
    await (await openPool(root)).close()
    await (await openPool(path.join(dir, 'other'))).close()
    await ws.dispose()
    await pool.close()
  })

  test('a symlink into a workspace is followed to where it leads: ERR_POOL_NESTED', async () => {
    const { dir, pool, ws } = await outerPool()
    fs.symlinkSync(ws.path, path.join(dir, 'link'))
    await expect(openPool(path.join(dir, 'link', 'inner'))).rejects.toMatchObject({ code: 'ERR_POOL_NESTED' })
    expect(fs.readdirSync(ws.path)).toEqual([])
    await ws.dispose()
    await pool.close()
  })
})

describe('a workspace whose tree holds a pool', () => {
  test('dispose never enters a pool made in it (moved there), whose workspace a running process holds: ERR_POOL_NESTED, the inner pool whole, the rest removed', async () => {
    const { dir, pool, ws } = await outerPool()
    // A pool made before openPool refused nesting: made beside, then moved into the workspace.
    const innerRoot = path.join(dir, 'inner')
    const inner = await openPool(innerRoot)
    const innerWs = await inner.allocate()
    fs.writeFileSync(path.join(innerWs.path, 'vm-disk'), 'guest data')
    const holder = spawn('sleep', ['600'], { stdio: ['ignore', 'ignore', 'ignore', innerWs.leaseFd] })
    await innerWs.release()
    await inner.close()
    const moved = path.join(ws.path, 'nested')
    fs.renameSync(innerRoot, moved)
    fs.writeFileSync(path.join(ws.path, 'other'), 'removed')
    try {
      const err = await ws.dispose().catch((e: unknown) => e)
      expect(err).toMatchObject({ code: 'ERR_POOL_NESTED', errno: -16, syscall: 'rmdir' })
      expect((err as { path: string }).path).toMatch(/\/\.vmspace\/trash\/vm-[0-9a-f]{32}\/nested$/)
      expect(ws.status).toBe('unrecoverable')
      const left = path.join(dir, 'pool', '.vmspace', 'trash', ws.name)
      expect(fs.readdirSync(left)).toEqual(['nested'])
      expect(fs.readFileSync(path.join(left, 'nested', innerWs.name, 'vm-disk'), 'utf8')).toBe('guest data')
      // A sweep reports it every time and leaves it.
      for (let i = 0; i < 2; i++) {
        const report = await pool.sweep()
        expect(report.failed).toMatchObject([{ name: ws.name, code: 'ERR_POOL_NESTED' }])
        expect(fs.readFileSync(path.join(left, 'nested', innerWs.name, 'vm-disk'), 'utf8')).toBe('guest data')
      }
    } finally {
      holder.kill()
      await new Promise((r) => holder.once('exit', r))
    }
    await pool.close()
  })

  test('a fake .vmspace/ the pool owner\'s uid wrote is refused the same way, reported, and removeTree takes it', async () => {
    const { dir, pool, ws } = await outerPool()
    forgePool(ws.path)
    await expect(ws.dispose()).rejects.toMatchObject({ code: 'ERR_POOL_NESTED', path: path.join(dir, 'pool', '.vmspace', 'trash', ws.name) })
    const left = path.join(dir, 'pool', '.vmspace', 'trash', ws.name)
    expect(fs.readdirSync(left).sort()).toEqual(['.vmspace', 'payload'])
    expect((await pool.sweep()).failed).toMatchObject([{ name: ws.name, code: 'ERR_POOL_NESTED' }])
    // The operator, having looked: removeTree does not stop at pools; the next sweep drops the lease.
    await removeTree(left)
    const report = await pool.sweep()
    expect(report.failed).toEqual([])
    expect(await pool.list()).toEqual([])
    await pool.close()
  })
})

describe.skipIf(!mounts.root)(`a guest's fake pool under a uid of its own ${needs('root (chown)', !mounts.root && 'not running as root')}`, () => {
  test('is no pool: dispose removes it all', async () => {
    const { dir, pool, ws } = await outerPool()
    forgePool(path.join(ws.path, 'deep'))
    for (const p of ['deep', 'deep/.vmspace', 'deep/.vmspace/version']) fs.lchownSync(path.join(ws.path, p), 65534, 65534)
    await ws.dispose()
    expect(fs.readdirSync(path.join(dir, 'pool', '.vmspace', 'trash'))).toEqual([])
    await pool.close()
  })
})

// What a hostile or careless caller can do must not hang, crash or defeat cleanup.
import { execFileSync, spawn, spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { Worker } from 'node:worker_threads'
import { afterEach, beforeEach, describe, expect, test } from 'vitest'
import { clone, openPool } from '../lib/index.js'
import * as readline from 'node:readline'
import { emptyPoolState, fixtures, leasePath, ls, mounts, needs, openFdsUnder, poolState } from './helpers.js'

/** Every file in the lease shards (spares included), as "<shard>/<name>". */
function leaseFiles(root: string): string[] {
  const leases = path.join(root, '.vmspace', 'leases')
  return ls(leases).flatMap((x) => ls(path.join(leases, x)).map((n) => `${x}/${n}`))
}

const dist = path.resolve(__dirname, '..', 'dist', 'index.js')
let dir: string
beforeEach(() => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-robust-'))
})
afterEach(() => fs.rmSync(dir, { recursive: true, force: true }))

function deepTree(root: string, depth: number) {
  // Built fd-relative (like a guest would), since the full path outgrows PATH_MAX.
  execFileSync('python3', [
    '-c',
    `import os\nfd = os.open(${JSON.stringify(root)}, os.O_RDONLY)\nfor i in range(${depth}):\n    os.mkdir('d', dir_fd=fd)\n    os.close(os.open('f', os.O_CREAT | os.O_WRONLY, dir_fd=fd))\n    n = os.open('d', os.O_RDONLY, dir_fd=fd)\n    os.close(fd)\n    fd = n\n`,
  ])
}

describe('removal does not depend on depth', () => {
  test('removeTree of a tree 3000 directories deep succeeds with only 256 fds allowed', () => {
    const root = path.join(dir, 'deep')
    fs.mkdirSync(root)
    deepTree(root, 3000)
    const r = spawnSync('bash', ['-c', `ulimit -n 256 && exec "$0" -e "require(process.argv[1]).removeTree(process.argv[2]).then(() => console.log('ok'), (e) => console.log(e.code))" "$1" "$2"`, process.execPath, dist, root], { encoding: 'utf8' })
    expect(r.stdout.trim()).toBe('ok')
    expect(fs.existsSync(root)).toBe(false)
  })

  test('dispose of a workspace a guest filled 3000 directories deep leaves nothing', async () => {
    const pool = await openPool(path.join(dir, 'pool'))
    const ws = await pool.allocate()
    deepTree(ws.path, 3000)
    await ws.dispose()
    expect(ws.status).toBe('disposed')
    expect(fs.readdirSync(pool.root)).toEqual(['.vmspace'])
    expect(fs.readdirSync(path.join(pool.root, '.vmspace', 'trash'))).toEqual([])
    await pool.close()
  })
})

describe('fifos never park a thread', () => {
  test('a fifo as clone source is refused with ERR_SOURCE_TYPE at once, and leaves nothing', async () => {
    const fifo = path.join(dir, 'fifo')
    execFileSync('mkfifo', [fifo])
    await expect(clone(fifo, path.join(dir, 'out'))).rejects.toMatchObject({ code: 'ERR_SOURCE_TYPE' })
    expect(fs.readdirSync(dir).sort()).toEqual(['fifo'])
  })

  test('a fifo in place of a lease file is no lease: list() and sweep() do not hang and leave that workspace out (foreign); dispose removes it, close() leaves nothing', async () => {
    const pool = await openPool(path.join(dir, 'pool'))
    const ws = await pool.allocate()
    const lease = leasePath(pool.root, ws.name)
    fs.rmSync(lease)
    execFileSync('mkfifo', [lease])
    // A lease path that is not a regular file is not vmspace's lease (opened O_NONBLOCK: no wait for a writer).
    expect(await pool.list()).toEqual([])
    expect(await pool.sweep({ graceMs: 0, dryRun: true })).toEqual({ reclaimed: [], live: 0, failed: [], leasesRemoved: 0, foreign: [ws.path] })
    expect(await pool.sweep({ graceMs: 0 })).toEqual({ reclaimed: [], live: 0, failed: [], leasesRemoved: 0, foreign: [ws.path] })
    expect(fs.lstatSync(ws.path).isDirectory()).toBe(true)
    // Its owner still holds the lease it made (the fd of the file that was unlinked): dispose removes the workspace.
    await ws.dispose()
    expect(ws.status).toBe('disposed')
    await pool.close()
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    expect(leaseFiles(pool.root)).toEqual([])
  })
})

describe('worker threads that end mid-operation', () => {
  test('a worker exiting while its allocate and clone run does not take the process down; a sweep reclaims what it left', async () => {
    const big = path.join(dir, 'big')
    fs.writeFileSync(big, Buffer.alloc(32 << 20, 7))
    const poolRoot = path.join(dir, 'pool')
    for (let i = 0; i < 4; i++) {
      const w = new Worker(
        `const v = require(${JSON.stringify(dist)}); v.clone(${JSON.stringify(big)}, ${JSON.stringify(path.join(dir, 'c'))} + Math.random()).catch(() => {}); v.openPool(${JSON.stringify(poolRoot)}).then((p) => p.allocate({ template: { r: ${JSON.stringify(big)} } })).catch(() => {}); setTimeout(() => process.exit(0), ${i * 2})`,
        { eval: true },
      )
      await new Promise((resolve) => w.once('exit', resolve))
    }
    const pool = await openPool(poolRoot)
    await pool.sweep({ graceMs: 0 })
    expect(fs.readdirSync(pool.root)).toEqual(['.vmspace'])
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    await pool.close()
  })
})

describe('a worker thread ending with batched calls in flight', () => {
  test('300 allocates and disposes queued in a worker that exits or is terminated: the process survives, no fd of the pool stays open, a sweep leaves the pool empty', async () => {
    const poolRoot = path.join(dir, 'pool')
    for (const delay of [0, 1, 5]) {
      const w = new Worker(
        `const v = require(${JSON.stringify(dist)}); v.openPool(${JSON.stringify(poolRoot)}).then((p) => { for (let i = 0; i < 300; i++) p.allocate().then((ws) => i % 2 ? ws.dispose() : ws).catch(() => {}); setTimeout(() => process.exit(0), ${delay}) })`,
        { eval: true },
      )
      await new Promise((resolve) => w.once('exit', resolve))
    }
    // terminate() from outside while calls are queued and running: N-API calls then fail in the worker, which must
    // not abort the process (node-addon-api's NODE_API_SWALLOW_UNTHROWABLE_EXCEPTIONS).
    for (const delay of Array.from({ length: 24 }, (_, i) => i % 12)) {
      const w = new Worker(
        `const v = require(${JSON.stringify(dist)}); const { parentPort } = require('node:worker_threads'); v.openPool(${JSON.stringify(poolRoot)}).then((p) => { for (let i = 0; i < 300; i++) p.allocate().then((ws) => i % 2 ? ws.dispose() : ws).catch(() => {}); parentPort.postMessage('go') })`,
        { eval: true },
      )
      await new Promise((resolve) => w.once('message', resolve))
      await new Promise((resolve) => setTimeout(resolve, delay))
      await w.terminate()
    }
    expect(openFdsUnder(poolRoot)).toEqual([])
    const pool = await openPool(poolRoot)
    await pool.sweep({ graceMs: 0 })
    expect(fs.readdirSync(pool.root)).toEqual(['.vmspace'])
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    // No spare either: no fd of the pool is open, so any a terminated worker kept is free, and the sweep removed it.
    expect(leaseFiles(pool.root)).toEqual([])
    await pool.close()
  })
})

describe('a worker thread terminated while handles and leases are being made', () => {
  test('warm reserves being built, pools being opened, leases being released: after 24 terminates no fd of the pool stays open, and a sweep leaves the pool empty', async () => {
    // What finishes during the teardown is still let go of: a warm entry's lease, an openPool's 5 directory fds,
    // a release()'s lease.
    const poolRoot = path.join(dir, 'pool')
    const image = path.join(dir, 'image')
    fs.writeFileSync(image, Buffer.alloc(1 << 20, 3))
    const scripts = [
      `v.openPool(root, { warm: { template: { 'a.bin': ${JSON.stringify(image)} }, count: 2 } }).then(async (p) => { parentPort.postMessage('go'); for (;;) { const ws = await p.allocate({ template: { 'a.bin': ${JSON.stringify(image)} } }); await ws.dispose() } })`,
      `parentPort.postMessage('go'); for (let i = 0; i < 8; i++) v.openPool(root).catch(() => {})`,
      `v.openPool(root).then(async (p) => { parentPort.postMessage('go'); for (;;) { const ws = await Promise.all([1, 2, 3, 4].map(() => p.allocate())); await Promise.all(ws.map((w) => w.release({ force: true }))) } })`,
    ]
    for (let i = 0; i < 24; i++) {
      const w = new Worker(
        `const v = require(${JSON.stringify(dist)}); const { parentPort } = require('node:worker_threads'); const root = ${JSON.stringify(poolRoot)}; ${scripts[i % 3]}`,
        { eval: true },
      )
      await new Promise((resolve) => w.once('message', resolve))
      await new Promise((resolve) => setTimeout(resolve, 2 + ((i * 7) % 20)))
      await w.terminate()
    }
    expect(openFdsUnder(poolRoot)).toEqual([])
    const pool = await openPool(poolRoot)
    const report = await pool.sweep({ graceMs: 0 })
    expect(report.live).toBe(0)
    expect(fs.readdirSync(pool.root)).toEqual(['.vmspace'])
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    // No spare either: no fd of the pool is open, so any a terminated worker kept is free, and the sweep removed it.
    expect(leaseFiles(pool.root)).toEqual([])
    await pool.close()
  })
})

describe('abort', () => {
  test('aborting a single-file copy stops it and leaves nothing', async () => {
    const big = path.join(dir, 'big')
    fs.writeFileSync(big, Buffer.alloc(256 << 20, 1))
    const ac = new AbortController()
    const p = clone(big, path.join(dir, 'copy'), { reflink: 'never', signal: ac.signal, onProgress: () => {} })
    ac.abort()
    await expect(p).rejects.toMatchObject({ name: 'AbortError' })
    expect(fs.readdirSync(dir)).toEqual(['big'])
  })
})

describe('a guest swapping a device node with a regular file as fast as it can (renameat2 RENAME_EXCHANGE)', () => {
  // A walk that stats `f`, sees a regular file and opens the name again would open the device (as root: a watchdog,
  // a tape) and, for a clone, copy from it: /dev/null's SEEK_DATA and SEEK_HOLE both say 0, where a copy loop
  // makes no progress. Each walk opens a file only while it is the inode it saw (openRegularAtNoFollow).
  const root = process.geteuid?.() === 0
  test.skipIf(!root)(`commit, copyOut and usage all settle, and the device is never opened ${needs('root (mknod)', !root && 'not root')}`, async () => {
    const pool = await openPool(path.join(mounts.xfs ?? mounts.scratch, `devswap-${path.basename(dir)}`))
    const ws = await pool.allocate()
    const guest = spawn('python3', [path.join(fixtures, 'devswap.py'), ws.path], { stdio: ['pipe', 'pipe', 'inherit'] })
    const lines = readline.createInterface({ input: guest.stdout! })[Symbol.asyncIterator]()
    expect((await lines.next()).value).toBe('ready')
    const codes: Record<string, number> = {}
    const attempt = async (op: () => Promise<unknown>) => {
      try {
        await op()
        codes.ok = (codes.ok ?? 0) + 1
      } catch (e) {
        const code = (e as { code?: string }).code ?? String(e)
        codes[code] = (codes[code] ?? 0) + 1
      }
    }
    for (let i = 0; i < 30; i++) {
      await attempt(async () => pool.removeTemplate((await pool.commit(ws)).id))
      await attempt(() => ws.copyOut('f', path.join(dir, `devswap-out-${i}`)))
      await attempt(() => ws.usage())
    }
    guest.stdin!.end()
    const { swaps, opens } = JSON.parse((await lines.next()).value as string) as { swaps: number; opens: number }
    expect(swaps).toBeGreaterThan(0)
    expect(opens).toBe(0)
    // A file swapped between the walk's stat and its open is ERR_SOURCE_CHANGED, and copyOut meeting the device
    // ERR_SOURCE_TYPE; nothing else fails.
    expect(Object.keys(codes).filter((c) => !['ok', 'ERR_SOURCE_CHANGED', 'ERR_SOURCE_TYPE'].includes(c))).toEqual([])
    await ws.dispose()
    expect((await pool.sweep({ graceMs: 0 })).failed).toEqual([])
    expect(poolState(pool.root)).toEqual(emptyPoolState)
    await pool.close()
    fs.rmSync(pool.root, { recursive: true, force: true })
  })
})

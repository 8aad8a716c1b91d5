// Locks and worker_threads: two threads' requests wait for each other in flock, as two processes' do, and what a
// thread holds or waits for is given up when the thread ends.
import { spawn, spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { Worker } from 'node:worker_threads'
import { afterEach, beforeEach, describe, expect, test } from 'vitest'
import { FileLock, lockFile, updateJsonFile } from '../lib/index.js'
import { flockWaiters, waitersOn } from './lock-helpers.js'

const dist = path.resolve(__dirname, '..', 'dist', 'index.js')
let dir: string
beforeEach(() => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-wlock-'))
})
afterEach(() => fs.rmSync(dir, { recursive: true, force: true }))

/** flock(1) holding `file` in a process of its own until release() (which waits for it to exit). */
async function heldByFlock(file: string): Promise<{ release(): Promise<void> }> {
  const proc = spawn('flock', [file, 'cat'], { stdio: ['pipe', 'ignore', 'inherit'] })
  while (spawnSync('flock', ['-n', '-E', '99', file, 'true']).status !== 99) await new Promise((r) => setTimeout(r, 5))
  const exited = new Promise((resolve) => proc.once('exit', resolve))
  return {
    release: async () => {
      proc.stdin.end()
      await exited
    },
  }
}

function runWorker(code: string): Worker {
  return new Worker(`const v = require(${JSON.stringify(dist)}); ${code}`, { eval: true })
}

describe('locks held by worker threads', () => {
  test('a worker terminated while holding a lock releases it', async () => {
    const file = path.join(dir, 'held.lock')
    // The interval keeps the worker alive until it is terminated.
    const w = runWorker(
      `setInterval(() => {}, 1000); v.lockFile(${JSON.stringify(file)}).then(() => require('worker_threads').parentPort.postMessage('held'))`,
    )
    await new Promise((resolve) => w.once('message', resolve))
    // Held by another thread: as if by another process, held now, and waited for.
    await expect(lockFile(file, { wait: false })).rejects.toMatchObject({ code: 'ERR_LOCK_HELD' })
    const waiting = lockFile(file)
    await waitersOn(file, 1, process.pid)
    await w.terminate()
    const lock = await waiting
    await lock.release()
  })

  test('a worker whose event loop ends while holding a lock releases it', async () => {
    const file = path.join(dir, 'ended.lock')
    const w = runWorker(`v.lockFile(${JSON.stringify(file)}).then((l) => { globalThis.kept = l })`)
    await new Promise((resolve) => w.once('exit', resolve))
    const lock = await lockFile(file, { wait: false })
    await lock.release()
  })

  test('a worker terminated while waiting for a lock never comes to hold it, and the process survives', async () => {
    const file = path.join(dir, 'wait.lock')
    const mine = await heldByFlock(file)
    const w = runWorker(
      `require('worker_threads').parentPort.postMessage('waiting'); v.lockFile(${JSON.stringify(file)}).then(() => require('worker_threads').parentPort.postMessage('got it'))`,
    )
    const messages: string[] = []
    w.on('message', (m) => messages.push(m))
    await new Promise((resolve) => w.once('message', resolve))
    await new Promise((resolve) => setTimeout(resolve, 100)) // let it block in flock on its wait thread
    await w.terminate()
    await mine.release()
    // The cancelled wait either never got the lock or dropped it at once: it is free again.
    let again
    for (let i = 0; i < 100 && !again; i++) {
      again = await lockFile(file, { wait: false }).catch(() => undefined)
      if (!again) await new Promise((resolve) => setTimeout(resolve, 20))
    }
    expect(again).toBeInstanceOf(FileLock)
    expect(again!.path).toBe(file)
    await again!.release()
    expect(messages).toEqual(['waiting'])
  })
})

describe('one process, several threads: they wait for each other in flock, as processes do', () => {
  /** Runs `code` in a worker and resolves with the first message it posts. */
  function answer(code: string): Promise<unknown> {
    const w = runWorker(`const post = (m) => require('worker_threads').parentPort.postMessage(m); ${code}`)
    return new Promise((resolve, reject) => {
      w.once('message', resolve)
      w.once('error', reject)
    }).finally(() => w.terminate())
  }

  test('a worker’s lockFile on a file the main thread holds waits in flock and gets it once released', async () => {
    const file = path.join(dir, 'main.lock')
    const mine = await lockFile(file)
    const granted = answer(`v.lockFile(${JSON.stringify(file)}).then((l) => l.release().then(() => post('granted')), (e) => post(e.code))`)
    await waitersOn(file, 1, process.pid)
    await mine.release()
    expect(await granted).toBe('granted')
  })

  test('a worker’s updateJsonFile of a file the main thread holds with lockFile waits, and writes once released', async () => {
    const file = path.join(dir, 'index.json')
    fs.writeFileSync(file, '{"a":1}\n')
    const mine = await lockFile(file)
    const written = answer(`v.updateJsonFile(${JSON.stringify(file)}, (c) => ({ ...c, b: 2 })).then(() => post('written'), (e) => post(e.code))`)
    await waitersOn(file, 1, process.pid)
    expect(fs.readFileSync(file, 'utf8')).toBe('{"a":1}\n')
    await mine.release()
    expect(await written).toBe('written')
    expect(JSON.parse(fs.readFileSync(file, 'utf8'))).toEqual({ a: 1, b: 2 })
  })

  test('4 worker threads lock one file held by another process: all wait in flock, then each gets it, one at a time', async () => {
    const file = path.join(dir, 'four.lock')
    const log = path.join(dir, 'holders.log')
    const holder = await heldByFlock(file)
    const script = (n: number) =>
      `const fs = require('node:fs'); v.lockFile(${JSON.stringify(file)}).then(async (l) => {
        fs.appendFileSync(${JSON.stringify(log)}, 'enter ${n}\\n')
        await fs.promises.readFile(${JSON.stringify(file)}) // a pool round trip while holding it
        fs.appendFileSync(${JSON.stringify(log)}, 'leave ${n}\\n')
        await l.release()
        post('done')
      }, (e) => post(e.code))`
    const workers = [0, 1, 2, 3].map((n) => answer(script(n)))
    // (A worker that failed instead of waiting ends the race too, and the answers below say how.)
    await Promise.race([waitersOn(file, 4, process.pid), Promise.any(workers)])
    expect(flockWaiters(file, process.pid)).toBe(4)
    expect(fs.existsSync(log)).toBe(false)
    await holder.release()
    expect(await Promise.all(workers)).toEqual(['done', 'done', 'done', 'done'])
    const lines = fs.readFileSync(log, 'utf8').trim().split('\n')
    expect(lines).toHaveLength(8)
    // No overlap: each enter is followed by its own leave; every worker had its turn.
    for (let i = 0; i < 8; i += 2) expect(lines[i + 1]).toBe(lines[i]!.replace('enter', 'leave'))
    expect(lines.filter((l) => l.startsWith('enter')).sort()).toEqual(['enter 0', 'enter 1', 'enter 2', 'enter 3'])
    const free = await lockFile(file, { wait: false })
    await free.release()
  })

  test('updateJsonFile from two worker_threads and the main thread at once: they wait for each other, all 150 keys land', async () => {
    const file = path.join(dir, 'index.json')
    const fill = (prefix: string) =>
      `(async () => { for (let i = 0; i < 50; i++) await v.updateJsonFile(${JSON.stringify(file)}, async (c) => { await new Promise((r) => setImmediate(r)); return { ...c, ['${prefix}' + i]: i } }) })().then(() => post('done'), (e) => post(e.code))`
    const main = (async () => {
      for (let i = 0; i < 50; i++) await updateJsonFile<Record<string, number>>(file, (c) => ({ ...c, [`m${i}`]: i }))
      return 'done'
    })()
    expect(await Promise.all([answer(fill('a')), answer(fill('b')), main])).toEqual(['done', 'done', 'done'])
    expect(Object.keys(JSON.parse(fs.readFileSync(file, 'utf8')) as object)).toHaveLength(150)
  })
})

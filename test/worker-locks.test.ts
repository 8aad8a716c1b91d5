// Locks and worker_threads: what a thread holds or waits for is given up when the thread ends.
import { spawn, spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { Worker } from 'node:worker_threads'
import { afterEach, beforeEach, describe, expect, test } from 'vitest'
import { lockFile, updateJsonFile } from '../lib/index.js'

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
    // The worker's lock is this process's: another thread's call is refused at once, as a second call here would be.
    await expect(lockFile(file, { wait: false })).rejects.toMatchObject({ code: 'ERR_LOCK_REENTRANT' })
    await expect(lockFile(file)).rejects.toMatchObject({ code: 'ERR_LOCK_REENTRANT' })
    await w.terminate()
    const lock = await lockFile(file, { wait: false })
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
    const mine = await heldByFlock(file) // another process: a wait behind this process's own lock is refused
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
    expect(again).toBeDefined()
    await again!.release()
    expect(messages).toEqual(['waiting'])
  })
})

describe('one process, several threads (the rule: a lock is the process’s; updates of two threads take turns)', () => {
  /** Runs `code` in a worker and resolves with the first message it posts. */
  function answer(code: string): Promise<unknown> {
    const w = runWorker(`const post = (m) => require('worker_threads').parentPort.postMessage(m); ${code}`)
    return new Promise((resolve, reject) => {
      w.once('message', resolve)
      w.once('error', reject)
    }).finally(() => w.terminate())
  }

  test('a worker’s lockFile on a file the main thread holds rejects at once with ERR_LOCK_REENTRANT; once released it gets it', async () => {
    const file = path.join(dir, 'main.lock')
    const mine = await lockFile(file)
    const script = `v.lockFile(${JSON.stringify(file)}).then((l) => l.release().then(() => post('granted')), (e) => post(e.code))`
    expect(await answer(script)).toBe('ERR_LOCK_REENTRANT')
    await mine.release()
    expect(await answer(script)).toBe('granted')
  })

  test('a worker’s updateJsonFile of a file the main thread holds with lockFile rejects with ERR_LOCK_REENTRANT; the file unchanged', async () => {
    const file = path.join(dir, 'index.json')
    fs.writeFileSync(file, '{"a":1}\n')
    const mine = await lockFile(file)
    const script = `v.updateJsonFile(${JSON.stringify(file)}, (c) => ({ ...c, b: 2 })).then(() => post('written'), (e) => post(e.code))`
    expect(await answer(script)).toBe('ERR_LOCK_REENTRANT')
    expect(fs.readFileSync(file, 'utf8')).toBe('{"a":1}\n')
    await mine.release()
    expect(await answer(script)).toBe('written')
    expect(JSON.parse(fs.readFileSync(file, 'utf8'))).toEqual({ a: 1, b: 2 })
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

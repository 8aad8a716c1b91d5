// Locks and worker_threads: what a thread holds or waits for is given up when the thread ends.
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { Worker } from 'node:worker_threads'
import { afterEach, beforeEach, describe, expect, test } from 'vitest'
import { lockFile } from '../lib/index.js'

const dist = path.resolve(__dirname, '..', 'dist', 'index.js')
let dir: string
beforeEach(() => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-wlock-'))
})
afterEach(() => fs.rmSync(dir, { recursive: true, force: true }))

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
    await expect(lockFile(file, { wait: false })).rejects.toMatchObject({ code: 'ERR_LOCK_HELD' })
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
    const mine = await lockFile(file)
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

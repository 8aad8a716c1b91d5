/**
 * The lock-wait signal (docs/locks.md, "The lock-wait signal"): a waiting lockFile is interrupted by a real-time signal
 * whose handler vmspace installs at the first wait; VMSPACE_LOCK_SIGNAL chooses it (N) or turns it off (0: waits
 * poll). Each case runs in a child process (the choice is read once per process) and reads the caught-signal mask
 * the kernel reports (/proc/self/status, SigCgt).
 */
import { spawnSync } from 'node:child_process'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { freshDir, repoRoot } from './helpers.js'

// The child has flock(1) hold the lock (another process, so that the wait is one in flock(2) on its own thread),
// waits for it with timeoutMs, and prints the wait's code and the real-time signals it catches.
const script = `
  const v = require(${JSON.stringify(path.join(repoRoot, 'dist', 'index.js'))})
  const fs = require('node:fs')
  const file = process.argv[1]
  const rt = () => {
    const line = fs.readFileSync('/proc/self/status', 'utf8').split('\\n').find((l) => l.startsWith('SigCgt:'))
    const mask = BigInt('0x' + line.split(/\\s+/)[1])
    const out = []
    for (let s = 32; s <= 64; s++) if (mask & (1n << BigInt(s - 1))) out.push(s)
    return out
  }
  const before = rt()
  const { spawn, spawnSync } = require('node:child_process')
  ;(async () => {
    const holder = spawn('flock', [file, 'cat'], { stdio: ['pipe', 'ignore', 'inherit'] })
    while (spawnSync('flock', ['-n', '-E', '99', file, 'true']).status !== 99) await new Promise((r) => setTimeout(r, 5))
    const code = await v.lockFile(file, { timeoutMs: 50 }).then(() => 'granted', (e) => e.code)
    holder.stdin.end()
    console.log(JSON.stringify({ code, added: rt().filter((s) => !before.includes(s)) }))
  })()
`

function run(env: Record<string, string>) {
  const file = path.join(freshDir(), 'l.lock')
  const r = spawnSync(process.execPath, ['-e', script, file], { encoding: 'utf8', env: { ...process.env, ...env } })
  expect(r.status, r.stderr).toBe(0)
  return JSON.parse(r.stdout) as { code: string; added: number[] }
}

describe('VMSPACE_LOCK_SIGNAL', () => {
  test('unset: the first wait installs a handler for one free real-time signal, and the timeout interrupts the wait', () => {
    const r = run({})
    expect(r.code).toBe('ERR_LOCK_TIMEOUT')
    expect(r.added).toHaveLength(1)
  })

  test('0: no handler is installed; the wait polls and still times out', () => {
    expect(run({ VMSPACE_LOCK_SIGNAL: '0' })).toEqual({ code: 'ERR_LOCK_TIMEOUT', added: [] })
  })

  test('a number: that real-time signal and no other', () => {
    expect(run({ VMSPACE_LOCK_SIGNAL: '50' })).toEqual({ code: 'ERR_LOCK_TIMEOUT', added: [50] })
  })

  test('not a real-time signal (SIGTERM, text): no handler; the wait polls', () => {
    expect(run({ VMSPACE_LOCK_SIGNAL: '15' })).toEqual({ code: 'ERR_LOCK_TIMEOUT', added: [] })
    expect(run({ VMSPACE_LOCK_SIGNAL: 'rt' })).toEqual({ code: 'ERR_LOCK_TIMEOUT', added: [] })
  })
})

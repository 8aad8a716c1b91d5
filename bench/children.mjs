// What the benches that race several processes share (json-file.mjs, throughput.mjs): the built package, and the
// barrier that starts child processes (copies of the bench in `--child` mode) at the same moment: each child loads
// and warms up, says "ready", waits for "go" on stdin, does its work and answers one line.
import { spawn } from 'node:child_process'
import { createRequire } from 'node:module'
import * as path from 'node:path'
import * as readline from 'node:readline'
import { fileURLToPath } from 'node:url'

export const require = createRequire(import.meta.url)
export const vmspace = require(path.join(path.dirname(fileURLToPath(import.meta.url)), '..', 'dist', 'index.js'))

/** Child side: says "ready" and resolves on the parent's "go" line. */
export async function readyThenGo() {
  process.stdout.write('ready\n')
  const rl = readline.createInterface({ input: process.stdin })
  await new Promise((resolve) => rl.once('line', resolve))
  rl.close()
}

/**
 * Parent side: starts `argv.length` processes of `script` (argv[i]: the arguments of the i-th), waits until all
 * are ready, sends "go" to all and returns each one's answer line and the seconds from "go" to the last answer,
 * after every child has exited. A child that exits early rejects with its stderr.
 */
export async function raceChildren(script, name, argv) {
  const children = argv.map((a) => {
    const p = spawn(process.execPath, [script, ...a], { stdio: ['pipe', 'pipe', 'pipe'] })
    let stderr = ''
    p.stderr.setEncoding('utf8').on('data', (s) => (stderr += s))
    const lines = readline.createInterface({ input: p.stdout })
    const next = () =>
      new Promise((resolve, reject) => {
        lines.once('line', resolve)
        p.once('exit', (code) => reject(new Error(`${name} child exited ${code}: ${stderr}`)))
      })
    return { p, next }
  })
  await Promise.all(children.map((c) => c.next())) // all loaded and waiting: the barrier
  const done = children.map((c) => c.next())
  const t0 = process.hrtime.bigint()
  for (const c of children) c.p.stdin.write('go\n')
  const answers = await Promise.all(done)
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9
  await Promise.all(children.map((c) => (c.p.exitCode === null ? new Promise((r) => c.p.once('exit', r)) : null)))
  return { answers, seconds }
}

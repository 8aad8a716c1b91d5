#!/usr/bin/env node
// The locked JSON index (updateJsonFile) against the usual npm pair doing the same read-modify-write:
// proper-lockfile (lock on the path, retried so it waits) + write-file-atomic. Both read the file, parse it, apply the
// same mutate, write a temp file, fsync it and rename it over; "durable" adds an fsync of the directory (vmspace's
// durable: true; for the baseline an explicit directory fsync after write-file-atomic, which has none).
//   1. one writer, round trip per update (medians, the two implementations interleaved), non-durable and durable;
//   2. 8 processes updating one index at once, each adding its own keys: throughput, and a key count to show that
//      no update was lost (for both implementations).
// Every ratio compares figures measured in the same run (the machine is shared and noisy).
//   node bench/json-file.mjs [--dir DIR] [--time MS] [--procs 8] [--ops 40] [--rounds 5]
import { execFileSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import { median } from './median.mjs'
import { raceChildren, readyThenGo, require, vmspace } from './children.mjs'

const script = fileURLToPath(import.meta.url)
const lockfile = require('proper-lockfile')
const writeFileAtomic = require('write-file-atomic')

const { values: args } = parseArgs({
  options: {
    dir: { type: 'string' },
    time: { type: 'string', default: '3000' }, // ms per single-writer mode (both implementations, interleaved)
    procs: { type: 'string', default: '8' },
    ops: { type: 'string', default: '40' }, // updates per process in the contended run
    rounds: { type: 'string', default: '5' },
    // internal: a contending child process
    child: { type: 'string' },
    file: { type: 'string' },
    prefix: { type: 'string' },
  },
})

// proper-lockfile fails at once on a held lock unless told to retry: retry often (1-10 ms apart, randomised) and
// long enough never to give up here (1000 tries). Its lock is a directory `${file}.lock`; realpath: false lets the
// data file be missing.
const PL_OPTIONS = { realpath: false, retries: { retries: 1000, factor: 1.5, minTimeout: 1, maxTimeout: 10, randomize: true } }

/** The baseline: the same read-modify-write under proper-lockfile, written by write-file-atomic. */
async function baselineUpdate(file, mutate, { durable = false } = {}) {
  const release = await lockfile.lock(file, PL_OPTIONS)
  try {
    let current
    try {
      current = JSON.parse(await fs.promises.readFile(file, 'utf8'))
    } catch (e) {
      if (e.code !== 'ENOENT') throw e
    }
    const next = await mutate(current)
    await writeFileAtomic(file, JSON.stringify(next) + '\n') // temp file, fsync (its default), rename
    if (durable) {
      const dir = await fs.promises.open(path.dirname(file), 'r')
      try {
        await dir.sync()
      } finally {
        await dir.close()
      }
    }
    return next
  } finally {
    await release()
  }
}

const impls = {
  vmspace: (file, mutate, opts) => vmspace.updateJsonFile(file, mutate, opts),
  baseline: baselineUpdate,
}

// ---- child mode: one contending process ----
if (args.child) {
  const update = impls[args.child]
  const n = Number(args.ops)
  await readyThenGo()
  let failed = 0
  for (let i = 0; i < n; i++) {
    try {
      await update(args.file, (current) => {
        const next = current ?? {}
        next[`${args.prefix}${i}`] = process.pid
        return next
      })
    } catch (e) {
      failed++
      process.stderr.write(`${args.child} update failed: ${e.code ?? ''} ${e.message}\n`)
    }
  }
  process.stdout.write(`done ${failed}\n`)
  process.exit(0)
}

// ---- main ----
const base = args.dir ?? os.tmpdir()
const work = fs.mkdtempSync(path.join(base, 'vmspace-json-file-bench-'))
process.on('exit', () => fs.rmSync(work, { recursive: true, force: true }))
for (const sig of ['SIGINT', 'SIGTERM']) process.on(sig, () => process.exit(130))

let fsType = '?'
try {
  fsType = execFileSync('stat', ['-f', '-c', '%T', work], { encoding: 'utf8' }).trim()
} catch {}
console.log(`index benchmark in ${work} (${fsType}); node ${process.version}, ${os.cpus().length} cpus`)

// 1. One writer: the round trip of one update on an index of 100 entries (one counter bumped, so the size stays).
// The two implementations alternate update by update (ABAB…, the order flipped every other pair), so that the load
// of a shared machine drifting over time falls on both alike; tinybench runs its tasks one after the other, which
// on this machine skewed the ratio by up to 2x between runs.
{
  const seed = Object.fromEntries(Array.from({ length: 100 }, (_, i) => [`vm-${String(i).padStart(3, '0')}`, { pid: 1000 + i, state: 'running' }]))
  const bump = (current) => {
    current.n = (current.n ?? 0) + 1
    return current
  }
  const names = Object.keys(impls)
  const rows = []
  for (const durable of [false, true]) {
    const files = Object.fromEntries(names.map((n) => [n, path.join(work, `single-${n}-${durable ? 'durable' : 'plain'}.json`)]))
    for (const f of Object.values(files)) fs.writeFileSync(f, JSON.stringify(seed) + '\n')
    const samples = Object.fromEntries(names.map((n) => [n, []]))
    const budget = Number(args.time) * 1e6 // ns, per mode, both implementations together
    const start = process.hrtime.bigint()
    for (let i = 0; ; i++) {
      const elapsed = Number(process.hrtime.bigint() - start)
      if (elapsed > budget && i >= 40) break
      for (const n of i % 2 ? [...names].reverse() : names) {
        const t0 = process.hrtime.bigint()
        await impls[n](files[n], bump, { durable })
        if (i >= 10) samples[n].push(Number(process.hrtime.bigint() - t0) / 1e3) // the first 10 pairs: warm-up
      }
    }
    for (const [n, f] of Object.entries(files)) {
      const v = JSON.parse(fs.readFileSync(f, 'utf8'))
      if (Object.keys(v).length !== 101) throw new Error(`${n}: the index lost its entries`)
    }
    const vm = median(samples.vmspace)
    const pl = median(samples.baseline)
    rows.push({
      'one writer, round trip': durable ? 'durable (+ dir fsync)' : 'non-durable (file fsync)',
      'vmspace µs': vm.toFixed(0),
      'baseline µs': pl.toFixed(0),
      'baseline / vmspace': (pl / vm).toFixed(2),
      'samples each': samples.vmspace.length,
    })
  }
  console.log('\nupdateJsonFile round trip, one writer (median per update, interleaved; baseline: proper-lockfile + write-file-atomic)')
  console.table(rows)
}

// 2. Contended: `procs` processes × `ops` updates on one index, released together; each adds its own key.
async function contended(name, round) {
  const procs = Number(args.procs)
  const ops = Number(args.ops)
  const file = path.join(work, `contended-${name}-${round}.json`)
  const argv = Array.from({ length: procs }, (_, i) => ['--child', name, '--file', file, '--ops', String(ops), '--prefix', `p${i}-`])
  const { answers, seconds } = await raceChildren(script, name, argv)
  const failed = answers.reduce((n, a) => n + Number(a.split(' ')[1]), 0)
  const keys = Object.keys(JSON.parse(fs.readFileSync(file, 'utf8'))).length
  return { opsPerSec: (procs * ops) / seconds, keys, expected: procs * ops, failed }
}

{
  const rounds = Number(args.rounds)
  const results = { vmspace: [], baseline: [] }
  for (let r = 0; r < rounds; r++) {
    // Alternate the order, so that neither always runs on a warmer (or busier) machine.
    for (const name of r % 2 ? ['baseline', 'vmspace'] : ['vmspace', 'baseline']) results[name].push(await contended(name, r))
  }
  const m = Object.fromEntries(Object.entries(results).map(([k, v]) => [k, median(v.map((x) => x.opsPerSec))]))
  const rows = Object.entries(results).map(([name, rs]) => ({
    [`${args.procs} processes × ${args.ops} updates`]: name === 'vmspace' ? 'vmspace updateJsonFile' : 'proper-lockfile + write-file-atomic',
    'ops/s (median)': m[name].toFixed(0),
    'ops/s per round': rs.map((x) => x.opsPerSec.toFixed(0)).join(' '),
    'keys found / expected': rs.map((x) => `${x.keys}/${x.expected}`).join(' '),
    'failed updates': rs.reduce((n, x) => n + x.failed, 0),
    'lost updates': rs.reduce((n, x) => n + (x.expected - x.failed - x.keys), 0),
  }))
  console.log(`\ncontended: ${args.procs} processes released together, each adding its own key per update (${rounds} rounds)`)
  console.table(rows)
  // Each round runs the two back to back: the median of the per-round ratios is the figure least moved by load
  // that comes and goes between rounds.
  const paired = median(results.vmspace.map((v, r) => v.opsPerSec / results.baseline[r].opsPerSec))
  console.log(
    `throughput ratio vmspace / baseline: ${paired.toFixed(2)} (median of per-round ratios; ratio of medians ${(m.vmspace / m.baseline).toFixed(2)})`,
  )
  const lost = Object.values(results).flat().some((x) => x.keys !== x.expected)
  console.log(lost ? 'LOST OR FAILED UPDATES: see the table' : 'no lost updates: every key of every process is in the index, for both')
  if (lost) process.exitCode = 1
}

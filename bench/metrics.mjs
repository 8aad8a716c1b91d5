#!/usr/bin/env node
// What metrics cost (docs/metrics.md), each figure a ratio or a time from this run:
//   1. allocate+dispose throughput (`--inflight` pairs in flight) with metrics disabled, with startMetrics() and
//      with registerPrometheus() (prom-client's counters and histogram fed per call), the variants interleaved
//      round by round, the order rotating; the ratio of medians against disabled and the median of each round's
//      ratio (target >= 0.97);
//   2. a gauge scrape of a pool of `--workspaces` (10,000) workspaces: poolGauges(), metricsText(), a prom-client
//      registry.metrics(), `vmspace metrics ROOT` as a process, and, for comparison, pool.usage() (which walks every
//      workspace's tree: what a scrape must not do).
//   node bench/metrics.mjs --dir DIR [--time MS] [--rounds N] [--inflight N] [--workspaces N] [--only throughput,scrape]
import { execFileSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import { median } from './median.mjs'

const require = createRequire(import.meta.url)
const here = path.dirname(fileURLToPath(import.meta.url))
const vmspace = require(path.join(here, '..', 'dist', 'index.js'))
const { Registry } = require('prom-client')

const { values: args } = parseArgs({
  options: {
    dir: { type: 'string' },
    time: { type: 'string', default: '2000' }, // ms per variant per round
    rounds: { type: 'string', default: '5' },
    inflight: { type: 'string', default: '16' },
    workspaces: { type: 'string', default: '10000' },
    only: { type: 'string' },
  },
})
if (!args.dir) throw new Error('--dir DIR is required')
const want = (s) => !args.only || args.only.split(',').includes(s)
const load = () => os.loadavg().map((x) => x.toFixed(2)).join(' ')
const base = fs.mkdtempSync(path.join(args.dir, 'vmspace-metrics-'))

// Pairs per second, and the process's CPU time (all threads) per pair: the second moves less with other load.
async function loop(pool, inflight, ms) {
  let done = 0
  const cpu0 = process.cpuUsage()
  const until = performance.now() + ms
  await Promise.all(
    Array.from({ length: inflight }, async () => {
      while (performance.now() < until) {
        await (await pool.allocate()).dispose()
        done++
      }
    }),
  )
  const cpu = process.cpuUsage(cpu0)
  return { rate: done / (ms / 1000), cpuUs: (cpu.user + cpu.system) / done }
}

async function throughput() {
  const pool = await vmspace.openPool(path.join(base, 'throughput'))
  let handle
  const variants = [
    { name: 'disabled', on() {}, off() {} },
    { name: 'startMetrics()', on: () => (handle = vmspace.startMetrics()), off: () => handle.close() },
    {
      name: 'registerPrometheus()',
      on: () => (handle = vmspace.registerPrometheus(new Registry(), { pools: [pool] })),
      off: () => handle.close(),
    },
  ]
  const samples = variants.map(() => [])
  const cpu = variants.map(() => [])
  await loop(pool, Number(args.inflight), 500) // warm-up
  for (let round = 0; round < Number(args.rounds); round++) {
    for (let k = 0; k < variants.length; k++) {
      const i = (k + round) % variants.length
      variants[i].on()
      const r = await loop(pool, Number(args.inflight), Number(args.time))
      samples[i].push(r.rate)
      cpu[i].push(r.cpuUs)
      variants[i].off()
    }
  }
  const off = median(samples[0])
  console.log(`\nmetrics: allocate+dispose throughput, ${args.inflight} in flight (median of ${args.rounds} rounds, pairs/s); load average ${load()}`)
  console.table(
    variants.map((v, i) => ({
      variant: v.name,
      'pairs/s': median(samples[i]).toFixed(0),
      '/ disabled': (median(samples[i]) / off).toFixed(3),
      // Each round's ratio to the disabled run of the same round: less of the drift of a shared machine.
      'median of per-round ratios': median(samples[i].map((x, r) => x / samples[0][r])).toFixed(3),
      'CPU µs/pair': median(cpu[i]).toFixed(1),
      'disabled CPU / this CPU': (median(cpu[0]) / median(cpu[i])).toFixed(3),
      'rounds (pairs/s)': samples[i].map((x) => x.toFixed(0)).join(' '),
    })),
  )
  await pool.close()
}

async function timeIt(n, fn) {
  const t = []
  for (let i = 0; i < n; i++) {
    const t0 = performance.now()
    await fn()
    t.push(performance.now() - t0)
  }
  return median(t)
}

async function scrape() {
  const n = Number(args.workspaces)
  const pool = await vmspace.openPool(path.join(base, 'scrape'))
  const held = []
  let made = 0
  // Most released (free: a lease file and record each, as a pool of ended sidecars), 100 held (live).
  await Promise.all(
    Array.from({ length: 16 }, async () => {
      while (made < n) {
        made++
        const ws = await pool.allocate({ meta: { vm: made } })
        if (held.length < 100) held.push(ws)
        else await ws.release({ force: true })
      }
    }),
  )
  const registry = new Registry()
  const reg = vmspace.registerPrometheus(registry, { pools: [pool] })
  const g = await vmspace.poolGauges(pool)
  const rows = [
    { what: 'poolGauges(pool)', ms: await timeIt(5, () => vmspace.poolGauges(pool)) },
    { what: 'metricsText({ pools })', ms: await timeIt(5, () => vmspace.metricsText({ pools: [pool] })) },
    { what: 'prom-client registry.metrics()', ms: await timeIt(5, () => registry.metrics()) },
    {
      what: '`vmspace metrics ROOT` (a process: node start, open, read, print)',
      ms: await timeIt(3, () => execFileSync(process.execPath, [path.join(here, '..', 'dist', 'cli', 'vmspace.js'), 'metrics', pool.root], { stdio: ['ignore', 'ignore', 'inherit'] })),
    },
    { what: 'pool.usage() (walks every tree; not part of a scrape)', ms: await timeIt(1, () => pool.usage()) },
  ]
  console.log(`\nmetrics: one gauge scrape of a pool of ${n} workspaces (live ${g.workspaces.live}, free ${g.workspaces.free}; median ms); load average ${load()}`)
  console.table(rows.map((r) => ({ what: r.what, ms: r.ms.toFixed(1), 'µs per workspace': ((r.ms * 1000) / n).toFixed(1) })))
  reg.close()
  for (const ws of held) await ws.release({ force: true })
  await pool.close()
}

try {
  console.log(`vmspace metrics bench on ${args.dir}: node ${process.version}, ${os.cpus().length} CPUs, load average ${load()}`)
  if (want('throughput')) await throughput()
  if (want('scrape')) await scrape()
} finally {
  fs.rmSync(base, { recursive: true, force: true })
}

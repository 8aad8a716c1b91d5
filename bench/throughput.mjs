#!/usr/bin/env node
// Throughput of allocate+dispose under the load of many callers (issue 12), each ratio from one run with the
// compared implementations interleaved round by round (the machine is shared; absolute figures drift):
//   1. `--inflight` (64) pairs in flight in one process: vmspace, fs.promises mkdtemp+rm, and the native floors
//      (bench/syscalls.cc: vmspace's syscall sequence in UV_THREADPOOL_SIZE threads, the parallelism the libuv pool
//      gives vmspace), and mkdtemp+rm's own floor (mkdir + rmdir in as many threads: "mkdtemp+rm / its floor", how
//      much of its syscalls' throughput Node's fs.promises keeps, beside "vmspace / floor");
//   2. `--procs` (2 × CPUs) processes each running pairs back to back: the same three (the floor in as many threads);
//   3. pool growth: allocate+dispose latency (p50, p99) with `--entries` (100,000) orphaned workspaces in the pool
//      against an empty pool, and list() / sweep() of those entries (time, RSS growth).
//   Pools of formats 1, 2 and 3 (3: staging shards), each against the floor of its own sequence. With --baseline DIR
//   (a built checkout of an earlier version), its format-2 allocate+dispose runs interleaved with the others in rows
//   1 and 2 ("vmspace / baseline", for the format-2 and format-3 rows).
//   node bench/throughput.mjs --dir DIR --floor BIN [--time MS] [--rounds N] [--only inflight,procs,growth] [--baseline DIR]
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import { execFileSync } from 'node:child_process'
import { createRequire } from 'node:module'
import { median } from './median.mjs'
import { raceChildren, readyThenGo, vmspace } from './children.mjs'

const script = fileURLToPath(import.meta.url)

const { values: args } = parseArgs({
  options: {
    dir: { type: 'string' },
    floor: { type: 'string' },
    time: { type: 'string', default: '1000' }, // ms per implementation per round
    rounds: { type: 'string', default: '3' },
    inflight: { type: 'string', default: '64' },
    procs: { type: 'string', default: String(2 * os.cpus().length) },
    entries: { type: 'string', default: '100000' },
    only: { type: 'string' },
    baseline: { type: 'string' },
    // internal: one looping child process
    child: { type: 'string' },
  },
})
const timeMs = Number(args.time)
const rounds = Number(args.rounds)
const want = (s) => !args.only || args.only.split(',').includes(s)
const before = args.baseline ? createRequire(import.meta.url)(path.join(path.resolve(args.baseline), 'dist', 'index.js')) : undefined

// Runs pairs of `impl` with `inflight` in flight for `ms`; resolves the pairs done.
async function loop(impl, inflight, ms) {
  let done = 0
  const until = performance.now() + ms
  await Promise.all(
    Array.from({ length: inflight }, async () => {
      while (performance.now() < until) {
        await impl()
        done++
      }
    }),
  )
  return done
}

async function implementations(dir) {
  const pool = await vmspace.openPool(path.join(dir, 'pool'))
  const pool2 = await vmspace.openPool(path.join(dir, 'pool2'), { format: 2 })
  const pool3 = await vmspace.openPool(path.join(dir, 'pool3'), { format: 3 })
  const poolB = before ? await before.openPool(path.join(dir, 'pool-baseline'), { format: 2 }) : undefined
  const tmpBase = path.join(dir, 'mkdtemp')
  fs.mkdirSync(tmpBase, { recursive: true })
  return {
    pools: poolB ? [pool, pool2, pool3, poolB] : [pool, pool2, pool3],
    baseline2: async () => {
      const ws = await poolB.allocate()
      await ws.dispose()
    },
    vmspace: async () => {
      const ws = await pool.allocate()
      await ws.dispose()
    },
    vmspace2: async () => {
      const ws = await pool2.allocate()
      await ws.dispose()
    },
    vmspace3: async () => {
      const ws = await pool3.allocate()
      await ws.dispose()
    },
    mkdtemp: async () => {
      const d = await fs.promises.mkdtemp(path.join(tmpBase, 'vm-'))
      await fs.promises.rm(d, { recursive: true })
    },
  }
}

// ---- child mode: one process looping one pair at a time; "ready", then "go" on stdin, then its count ----
if (args.child) {
  const impls = await implementations(args.dir)
  await loop(impls[args.child], 1, 200) // warm-up
  await readyThenGo()
  const n = await loop(impls[args.child], 1, timeMs)
  process.stdout.write(`${n}\n`)
  for (const p of impls.pools) await p.close()
  process.exit(0)
}

const dir = fs.mkdtempSync(path.join(args.dir ?? os.tmpdir(), 'vmspace-throughput-'))
process.on('exit', () => fs.rmSync(dir, { recursive: true, force: true }))
// The native floors: vmspace's syscall sequence for a format-1 pool (metadata file), a format-2 pool (xattr) and a
// format-3 pool (xattr, a staging shard per thread), and mkdtemp+rm's own (mkdir + rmdir): bench/syscalls.cc's
// META 2, 3, 4 and 5.
const floorModes = { floor1: 2, floor2: 3, floor3: 4, floorMk: 5 }
const floorOps = (name, threads) =>
  Number(execFileSync(args.floor, [path.join(dir, name), '0', String(floorModes[name]), String(threads), String(timeMs)]).toString())
const names = ['vmspace', 'vmspace2', 'vmspace3', 'mkdtemp', 'floor1', 'floor2', 'floor3', 'floorMk', ...(before ? ['baseline2'] : [])]
const threadpool = Number(process.env.UV_THREADPOOL_SIZE ?? 4)
const fsType = (() => {
  try {
    return execFileSync('stat', ['-f', '-c', '%T', dir], { encoding: 'utf8' }).trim()
  } catch {
    return '?'
  }
})()
const load = () => os.loadavg()[0].toFixed(1)
const ratioRows = (label, res) => {
  const r = (a, b) => median(res[a].map((x, i) => x / res[b][i])).toFixed(2)
  const row = (format, vm, floor) => ({
    callers: label,
    pool: `format ${format}`,
    'vmspace ops/s': median(res[vm]).toFixed(0),
    'mkdtemp+rm ops/s': median(res.mkdtemp).toFixed(0),
    'native floor ops/s': median(res[floor]).toFixed(0),
    'vmspace / mkdtemp+rm': r(vm, 'mkdtemp'),
    'vmspace / floor': r(vm, floor),
    'mkdtemp+rm / its floor': r('mkdtemp', 'floorMk'),
    'per round (vm/mk/floor)': res[vm].map((v, i) => `${v.toFixed(0)}/${res.mkdtemp[i].toFixed(0)}/${res[floor][i].toFixed(0)}`).join(' '),
    ...(before && format >= 2 ? { 'baseline ops/s': median(res.baseline2).toFixed(0), 'vmspace / baseline': r(vm, 'baseline2') } : {}),
  })
  return [row(1, 'vmspace', 'floor1'), row(2, 'vmspace2', 'floor2'), row(3, 'vmspace3', 'floor3')]
}
// Each round runs every implementation once, the order reversed every other round.
async function rounds_(run) {
  const res = Object.fromEntries(names.map((n) => [n, []]))
  for (let r = 0; r < rounds; r++) for (const name of r % 2 ? [...names].reverse() : names) res[name].push(await run(name))
  return res
}
const rows = []
console.log(`throughput on ${fsType} (${dir}); ${os.cpus().length} CPUs; load average ${load()} at start`)

if (want('inflight')) {
  const inflight = Number(args.inflight)
  const impls = await implementations(dir)
  for (const n of ['vmspace', 'vmspace2', 'vmspace3', 'mkdtemp', ...(before ? ['baseline2'] : [])]) await loop(impls[n], inflight, 300)
  const res = await rounds_(async (name) =>
    name.startsWith('floor') ? floorOps(name, threadpool) : (await loop(impls[name], inflight, timeMs)) / (timeMs / 1000),
  )
  for (const p of impls.pools) await p.close()
  rows.push(...ratioRows(`${inflight} in flight, 1 process (floor: ${threadpool} threads); load ${load()}`, res))
}

async function processes(name, procs) {
  const argv = Array.from({ length: procs }, () => ['--child', name, '--dir', dir, '--time', String(timeMs), ...(before ? ['--baseline', args.baseline] : [])])
  const { answers, seconds } = await raceChildren(script, name, argv)
  return answers.reduce((a, b) => a + Number(b), 0) / seconds
}

if (want('procs')) {
  const procs = Number(args.procs)
  const res = await rounds_((name) => (name.startsWith('floor') ? floorOps(name, procs) : processes(name, procs)))
  rows.push(...ratioRows(`${procs} processes, 1 in flight each (floor: ${procs} threads); load ${load()}`, res))
}

if (rows.length) {
  console.log('\nallocate+dispose throughput (pairs/s; ratios: median of per-round ratios, interleaved)')
  console.table(rows)
}

if (want('growth')) {
  const entries = Number(args.entries)
  const pct = (xs, p) => [...xs].sort((a, b) => a - b)[Math.floor((xs.length - 1) * p)]
  const measure = async (fn) => {
    global.gc?.()
    const rss0 = process.memoryUsage().rss
    const t = performance.now()
    const out = await fn()
    return { ms: performance.now() - t, rssMiB: (process.memoryUsage().rss - rss0) / 2 ** 20, out }
  }
  const latency = []
  const calls = []
  for (const format of [1, 2, 3]) {
    const full = await vmspace.openPool(path.join(dir, `full${format}`), { format })
    const empty = await vmspace.openPool(path.join(dir, `empty${format}`), { format })
    // Fill: orphaned workspaces (allocated, lease released), 64 at a time.
    const t0 = performance.now()
    for (let i = 0; i < entries; i += 64)
      await Promise.all(Array.from({ length: Math.min(64, entries - i) }, async () => (await full.allocate()).release()))
    const fillS = (performance.now() - t0) / 1000
    const lat = { full: [], empty: [] }
    const pair = async (pool) => {
      const t = process.hrtime.bigint()
      const ws = await pool.allocate()
      await ws.dispose()
      return Number(process.hrtime.bigint() - t) / 1e3
    }
    for (let i = 0; i < 200; i++) await pair(i % 2 ? full : empty) // warm-up
    for (let i = 0; i < 4000; i++) {
      const which = i % 2 ? 'full' : 'empty' // alternate pair by pair
      lat[which].push(await pair(which === 'full' ? full : empty))
    }
    const row = (label, xs) => ({ pool: `format ${format}, ${label}`, 'p50 µs': pct(xs, 0.5).toFixed(0), 'p99 µs': pct(xs, 0.99).toFixed(0) })
    latency.push(row('empty', lat.empty), row(`${entries} entries`, lat.full), {
      pool: `format ${format}, full / empty`,
      'p50 µs': (pct(lat.full, 0.5) / pct(lat.empty, 0.5)).toFixed(2),
      'p99 µs': (pct(lat.full, 0.99) / pct(lat.empty, 0.99)).toFixed(2),
    })
    const list = await measure(() => full.list())
    const dry = await measure(() => full.sweep({ dryRun: true }))
    const sweep = await measure(() => full.sweep({ graceMs: 0 }))
    calls.push(
      { call: `format ${format}: list() of ${entries}`, ms: list.ms.toFixed(0), 'RSS growth MiB': list.rssMiB.toFixed(1), result: `${list.out.length} entries` },
      { call: `format ${format}: sweep({ dryRun: true })`, ms: dry.ms.toFixed(0), 'RSS growth MiB': dry.rssMiB.toFixed(1), result: `${dry.out.reclaimed.length} reclaimable` },
      { call: `format ${format}: sweep() reclaiming all`, ms: sweep.ms.toFixed(0), 'RSS growth MiB': sweep.rssMiB.toFixed(1), result: `${sweep.out.reclaimed.length} reclaimed (filled in ${fillS.toFixed(0)} s)` },
    )
    await full.close()
    await empty.close()
  }
  console.log(`\npool growth on ${fsType}: allocate+dispose latency with ${entries} orphaned workspaces in the pool against an empty pool (alternating pair by pair); load ${load()}`)
  console.table(latency)
  console.log(`list() and sweep() of ${entries} entries (RSS growth of this process during the call)`)
  console.table(calls)
}

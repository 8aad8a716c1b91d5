#!/usr/bin/env node
// Throughput of allocate+dispose under the load of many callers, each ratio from one run with the
// compared implementations interleaved round by round (the machine is shared; absolute figures drift):
//   1. `--inflight` (64) pairs in flight in one process: vmspace's pool, fs.promises mkdtemp+rm, and the native
//      floors (bench/syscalls.cc: vmspace's syscall sequence, META 6, in UV_THREADPOOL_SIZE − 1 threads, as many as
//      the binding's batch runs allocate/dispose on (native/binding/batch.cc, workerLimit): the fair floor; and in
//      `--inflight` threads, what the syscalls alone reach with one thread per caller), and mkdtemp+rm's own floor
//      (mkdir + rmdir in UV_THREADPOOL_SIZE threads, all of which fs.promises uses: "mkdtemp+rm / its floor", how
//      much of its syscalls' throughput Node's fs.promises keeps, beside "vmspace / floor");
//   2. `--procs` (2 × CPUs) processes each running pairs back to back: the same (the floors in as many threads);
//   3. pool growth: allocate+dispose latency (p50, p99) with `--entries` (100,000) orphaned workspaces in the pool
//      against an empty pool, and list() / sweep() of those entries (time, RSS growth).
//   With --baseline DIR (a built checkout of an earlier version; bench/baseline.mjs), its format-3 pool's
//   allocate+dispose runs interleaved with the others in rows 1 and 2 ("vmspace / baseline (format 3)").
//   node bench/throughput.mjs --dir DIR --floor BIN [--time MS] [--rounds N] [--only inflight,procs,growth] [--baseline DIR]
//   node bench/throughput.mjs --dir DIR --profile vmspace|mkdtemp [--inflight N] [--time MS]: one implementation
//   alone, N in flight (after 300 ms of warm-up), to run under `perf record -g`, `perf stat` or `strace -c -f`;
//   prints the pairs done (bench/perf-split.mjs divides a profile by them)
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import { execFileSync } from 'node:child_process'
import { median } from './median.mjs'
import { raceChildren, readyThenGo, vmspace } from './children.mjs'
import { loadBaseline, nameBaselinePool, openBaselinePool } from './baseline.mjs'

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
    profile: { type: 'string' },
    // internal: one looping child process
    child: { type: 'string' },
  },
})
const timeMs = Number(args.time)
const rounds = Number(args.rounds)
const want = (s) => !args.only || args.only.split(',').includes(s)
const before = loadBaseline(args.baseline)

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
  const poolB = before ? await openBaselinePool(before, path.join(dir, 'pool-baseline')) : undefined
  const tmpBase = path.join(dir, 'mkdtemp')
  fs.mkdirSync(tmpBase, { recursive: true })
  return {
    pools: poolB ? [pool, poolB] : [pool],
    baseline: async () => {
      const ws = await poolB.allocate()
      await ws.dispose()
    },
    vmspace: async () => {
      const ws = await pool.allocate()
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

// ---- profile mode: one implementation, --inflight in flight, alone in its process ----
if (args.profile) {
  const impls = await implementations(fs.mkdtempSync(path.join(args.dir ?? os.tmpdir(), 'vmspace-profile-')))
  const inflight = Number(args.inflight)
  await loop(impls[args.profile], inflight, 300)
  const n = await loop(impls[args.profile], inflight, timeMs)
  console.log(`${args.profile}: ${n} pairs, ${((n * 1000) / timeMs).toFixed(0)} pairs/s, ${inflight} in flight`)
  for (const p of impls.pools) await p.close()
  process.exit(0)
}

const dir = fs.mkdtempSync(path.join(args.dir ?? os.tmpdir(), 'vmspace-throughput-'))
process.on('exit', () => fs.rmSync(dir, { recursive: true, force: true }))
// The native floors: vmspace's syscall sequence (bench/syscalls.cc's META 6) and mkdtemp+rm's own (mkdir + rmdir,
// META 5).
// floorWide: vmspace's sequence in as many threads as the row has callers (the inflight row only).
const floorModes = { floor: 6, floorMk: 5, floorWide: 6 }
const floorOps = (name, threads) =>
  Number(execFileSync(args.floor, [path.join(dir, name), '0', String(floorModes[name]), String(threads), String(timeMs)]).toString())
const baseNames = ['vmspace', 'mkdtemp', 'floor', 'floorMk', ...(before ? ['baseline'] : [])]
// The baseline's pool, opened once here to name it (its children open the same one).
const baselineName = before && (await nameBaselinePool(before, path.join(dir, 'pool-baseline')))
const threadpool = Number(process.env.UV_THREADPOOL_SIZE ?? 4)
const workers = Math.max(1, threadpool - 1) // the batch's pool threads (native/binding/batch.cc, workerLimit)
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
  return {
    callers: label,
    'vmspace ops/s': median(res.vmspace).toFixed(0),
    'mkdtemp+rm ops/s': median(res.mkdtemp).toFixed(0),
    'native floor ops/s': median(res.floor).toFixed(0),
    'vmspace / mkdtemp+rm': r('vmspace', 'mkdtemp'),
    'vmspace / floor': r('vmspace', 'floor'),
    ...(res.floorWide ? { [`floor in ${args.inflight} threads ops/s`]: median(res.floorWide).toFixed(0), [`vmspace / floor in ${args.inflight} threads`]: r('vmspace', 'floorWide') } : {}),
    'mkdtemp+rm / its floor': r('mkdtemp', 'floorMk'),
    'per round (vm/mk/floor)': res.vmspace.map((v, i) => `${v.toFixed(0)}/${res.mkdtemp[i].toFixed(0)}/${res.floor[i].toFixed(0)}`).join(' '),
    ...(before ? { [`${baselineName} ops/s`]: median(res.baseline).toFixed(0), [`vmspace / ${baselineName}`]: r('vmspace', 'baseline') } : {}),
  }
}
// Each round runs every implementation once, the order reversed every other round.
async function rounds_(run, names = baseNames) {
  const res = Object.fromEntries(names.map((n) => [n, []]))
  for (let r = 0; r < rounds; r++) for (const name of r % 2 ? [...names].reverse() : names) res[name].push(await run(name))
  return res
}
const rows = []
console.log(`throughput on ${fsType} (${dir}); ${os.cpus().length} CPUs; load average ${load()} at start`)

if (want('inflight')) {
  const inflight = Number(args.inflight)
  const impls = await implementations(dir)
  for (const n of ['vmspace', 'mkdtemp', ...(before ? ['baseline'] : [])]) await loop(impls[n], inflight, 300)
  const res = await rounds_(
    async (name) =>
      name.startsWith('floor')
        ? floorOps(name, name === 'floorWide' ? inflight : name === 'floor' ? workers : threadpool)
        : (await loop(impls[name], inflight, timeMs)) / (timeMs / 1000),
    [...baseNames, 'floorWide'],
  )
  for (const p of impls.pools) await p.close()
  rows.push(ratioRows(`${inflight} in flight, 1 process (floor: ${workers} threads, its own: ${threadpool}); load ${load()}`, res))
}

async function processes(name, procs) {
  const argv = Array.from({ length: procs }, () => ['--child', name, '--dir', dir, '--time', String(timeMs), ...(before ? ['--baseline', args.baseline] : [])])
  const { answers, seconds } = await raceChildren(script, name, argv)
  return answers.reduce((a, b) => a + Number(b), 0) / seconds
}

if (want('procs')) {
  const procs = Number(args.procs)
  const res = await rounds_((name) => (name.startsWith('floor') ? floorOps(name, procs) : processes(name, procs)))
  rows.push(ratioRows(`${procs} processes, 1 in flight each (floor: ${procs} threads); load ${load()}`, res))
}

if (rows.length) {
  console.log('\nallocate+dispose throughput (pairs/s; ratios: median of per-round ratios, interleaved)')
  console.table(rows)
}

// Pool growth: allocate+dispose latency in a pool of `entries` orphaned workspaces against an empty pool, then
// list() and sweep() of those entries.
async function growth(entries) {
  const pct = (xs, p) => [...xs].sort((a, b) => a - b)[Math.floor((xs.length - 1) * p)]
  const measure = async (fn) => {
    global.gc?.()
    const rss0 = process.memoryUsage().rss
    const t = performance.now()
    const out = await fn()
    return { ms: performance.now() - t, rssMiB: (process.memoryUsage().rss - rss0) / 2 ** 20, out }
  }
  const full = await vmspace.openPool(path.join(dir, 'full'))
  const empty = await vmspace.openPool(path.join(dir, 'empty'))
  // Fill: orphaned workspaces (allocated, lease released), 64 at a time.
  const t0 = performance.now()
  for (let i = 0; i < entries; i += 64)
    await Promise.all(Array.from({ length: Math.min(64, entries - i) }, async () => (await full.allocate()).release({ force: true })))
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
  const row = (pool, xs) => ({ pool, 'p50 µs': pct(xs, 0.5).toFixed(0), 'p99 µs': pct(xs, 0.99).toFixed(0) })
  const latency = [
    row('empty', lat.empty),
    row(`${entries} entries`, lat.full),
    {
      pool: 'full / empty',
      'p50 µs': (pct(lat.full, 0.5) / pct(lat.empty, 0.5)).toFixed(2),
      'p99 µs': (pct(lat.full, 0.99) / pct(lat.empty, 0.99)).toFixed(2),
    },
  ]
  const list = await measure(() => full.list())
  const dry = await measure(() => full.sweep({ dryRun: true }))
  const sweep = await measure(() => full.sweep({ graceMs: 0 }))
  const call = (name, m, result) => ({ call: name, ms: m.ms.toFixed(0), 'RSS growth MiB': m.rssMiB.toFixed(1), result })
  const calls = [
    call(`list() of ${entries}`, list, `${list.out.length} entries`),
    call('sweep({ dryRun: true })', dry, `${dry.out.reclaimed.length} reclaimable`),
    call('sweep() reclaiming all', sweep, `${sweep.out.reclaimed.length} reclaimed (filled in ${fillS.toFixed(0)} s)`),
  ]
  await full.close()
  await empty.close()
  console.log(`\npool growth on ${fsType}: allocate+dispose latency with ${entries} orphaned workspaces in the pool against an empty pool (alternating pair by pair); load ${load()}`)
  console.table(latency)
  console.log(`list() and sweep() of ${entries} entries (RSS growth of this process during the call); load ${load()}`)
  console.table(calls)
}

if (want('growth')) await growth(Number(args.entries))

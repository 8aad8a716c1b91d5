#!/usr/bin/env node
// vmspace benchmark suite. Every figure is reported as a ratio measured in the same run (the machine is shared
// and noisy; absolute times drift). Run as root to get loop-mounted XFS and ext4 (the root file system here is
// mounted `discard`, which makes unlink/rmdir slow); otherwise `--dir DIR` benchmarks in DIR only.
//   npm run bench [-- --dir DIR] [-- --iterations N]
//   npm run bench -- --only allocate,throughput,trace,clone,tree [--baseline DIR]   DIR: a checkout of an earlier version,
//   built (`npm ci` in it); its pools are format 3 where it has formats (bench/baseline.mjs)
//   npm run bench -- --only metrics [--dir DIR]   metrics disabled vs enabled, and a gauge scrape of 10,000 workspaces
//   npm run bench -- --only tree [--load 0,2]   the tree section once per count of busy-loop processes (default: 0 and the CPUs)
//   npm run bench -- --only floor   allocate+dispose against its native floor on loop XFS: one caller, and 64 in flight
//   npm run bench -- --only share   16 children reading a shared 1 GiB file against reflinked ones (page cache, allocate p50)
import { execFileSync, spawn } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { parseArgs } from 'node:util'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { Bench } from 'tinybench'
import { median } from './median.mjs'
import { baselineLabel, loadBaseline, openBaselinePool } from './baseline.mjs'

const require = createRequire(import.meta.url)
const here = path.dirname(fileURLToPath(import.meta.url))
const vmspace = require(path.join(here, '..', 'dist', 'index.js'))
const { native: binding } = require(path.join(here, '..', 'dist', 'binding.js'))

const { values: args } = parseArgs({
  options: {
    dir: { type: 'string' },
    iterations: { type: 'string', default: '3000' },
    time: { type: 'string', default: '2000' },
    rounds: { type: 'string', default: '5' },
    only: { type: 'string' }, // allocate | throughput | floor | growth | clone | tree | soak | json-file | lease | trace | metrics | warm | templates-btrfs | template-cache | import | share | checkpoint
    baseline: { type: 'string' }, // allocate, throughput, trace, clone, tree: a built checkout of an earlier version, run interleaved with this one
    entries: { type: 'string', default: '100000' }, // growth: workspaces in the full pool
    'soak-cycles': { type: 'string', default: '1000000' },
    'warm-rounds': { type: 'string', default: '20' },
    'warm-count': { type: 'string', default: '2' },
    'template-files': { type: 'string', default: '10000,10' }, // templates-btrfs: tree sizes (files)
    'clone-rounds': { type: 'string', default: '200' },
    load: { type: 'string', default: `0,${os.cpus().length}` }, // tree: one pass per count of busy-loop processes
  },
})
const want = (section) => !args.only || args.only.split(',').includes(section)
// --baseline DIR: an earlier version (its dist/ and build/ built), timed in the same run as this one.
const before = loadBaseline(args.baseline)
const iterations = Number(args.iterations)
const timeMs = Number(args.time)

function sh(cmd, argv) {
  return execFileSync(cmd, argv, { stdio: ['ignore', 'pipe', 'pipe'] }).toString()
}

const work = fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-bench-'))
const mounts = []
function loopMount(kind, sizeMb) {
  const img = path.join(work, `${kind}.img`)
  const mnt = path.join(work, kind)
  fs.mkdirSync(mnt)
  fs.closeSync(fs.openSync(img, 'w'))
  fs.truncateSync(img, sizeMb * 1024 * 1024)
  if (kind.startsWith('xfs')) sh('mkfs.xfs', ['-q', '-f', '-m', 'reflink=1', img])
  else if (kind === 'btrfs') sh('mkfs.btrfs', ['-q', '-f', img])
  else sh('mkfs.ext4', ['-q', '-F', img])
  sh('mount', ['-o', 'loop', img, mnt])
  mounts.push(mnt)
  return mnt
}
function cleanup() {
  for (const m of mounts.reverse()) {
    try { sh('umount', [m]) } catch { try { sh('umount', ['-l', m]) } catch {} }
  }
  fs.rmSync(work, { recursive: true, force: true })
}
process.on('exit', cleanup)
for (const sig of ['SIGINT', 'SIGTERM']) process.on(sig, () => process.exit(130))

const targets = []
if (args.dir) targets.push({ fs: `dir ${args.dir}`, dir: fs.mkdtempSync(path.join(args.dir, 'vmspace-bench-')) })
else if (process.getuid?.() === 0) {
  for (const kind of ['xfs', 'ext4']) {
    try { targets.push({ fs: kind + ' (loop)', dir: loopMount(kind, kind === 'xfs' ? 4096 : 1024) }) } catch (e) { console.error(`no ${kind}: ${e.message}`) }
  }
}
if (!targets.length) targets.push({ fs: 'tmp (' + os.tmpdir() + ')', dir: work })

// The native floor: the same syscalls in a C++ loop.
const floorBin = path.join(work, 'syscalls')
sh('g++', ['-O2', '-std=c++17', '-pthread', '-o', floorBin, path.join(here, 'syscalls.cc')])
const load = () => `load average ${os.loadavg().map((x) => x.toFixed(1)).join(' ')}`
console.log(`vmspace bench: node ${process.version}, ${os.cpus().length} CPUs, ${load()}`)

const ms = (t0) => Number(process.hrtime.bigint() - t0) / 1e6

// 1. One caller: allocate + lease + dispose of the default pool against the bare syscalls (bench/syscalls.cc's
// META 6: the same sequence in a C++ loop), Node's mkdtemp + rm and (--baseline) the earlier version's format-3 pool.
async function oneCaller(t) {
  const floor = Number(sh(floorBin, [path.join(t.dir, 'floor'), String(iterations), '6'])) / 1e3
  const pool = await vmspace.openPool(path.join(t.dir, 'pool'))
  const poolB = before && (await openBaselinePool(before, path.join(t.dir, 'pool-baseline')))
  const tmpBase = path.join(t.dir, 'mkdtemp')
  fs.mkdirSync(tmpBase)
  // They alternate pair by pair (the order rotating), so that load coming and going on a shared machine falls on
  // all of them alike; tinybench runs its tasks one after the other, which skewed these ratios by up to 2x here.
  const impls = {
    vmspace: async () => (await pool.allocate()).dispose(),
    // The floor of any async Node call: two round trips through the libuv pool doing nothing (close(-1)).
    '2 no-op pool hops': async () => {
      await binding.lockRelease(-1)
      await binding.lockRelease(-1)
    },
    'fs.promises mkdtemp+rm': async () => fs.promises.rm(await fs.promises.mkdtemp(path.join(tmpBase, 'vm-')), { recursive: true }),
    ...(poolB ? { baseline: async () => (await poolB.allocate()).dispose() } : {}),
  }
  const names = Object.keys(impls)
  const samples = Object.fromEntries(names.map((n) => [n, []]))
  for (let i = 0; i < iterations + 300; i++) {
    for (let k = 0; k < names.length; k++) {
      const n = names[(i + k) % names.length]
      const t0 = process.hrtime.bigint()
      await impls[n]()
      if (i >= 300) samples[n].push(Number(process.hrtime.bigint() - t0) / 1e3) // the first 300: warm-up
    }
  }
  await pool.close()
  if (poolB) await poolB.close()
  const p50 = (name) => median(samples[name])
  const vm = p50('vmspace')
  const hops = p50('2 no-op pool hops')
  const node = p50('fs.promises mkdtemp+rm')
  const label = poolB && baselineLabel(poolB)
  return {
    'file system': t.fs,
    'native floor µs': floor.toFixed(1),
    'vmspace µs': vm.toFixed(1),
    'vmspace / floor': (vm / floor).toFixed(2),
    '2 no-op hops µs': hops.toFixed(1),
    '(vmspace − hops) / floor': ((vm - hops) / floor).toFixed(2),
    'mkdtemp+rm µs': node.toFixed(1),
    'mkdtemp+rm / vmspace': (node / vm).toFixed(2),
    // As mkdtemp+rm's: above 1, vmspace is the faster (the throughput rows divide pairs/s, vmspace's first).
    ...(poolB ? { [`${label} µs`]: p50('baseline').toFixed(1), [`${label} / vmspace`]: (p50('baseline') / vm).toFixed(2) } : {}),
  }
}
if (want('allocate')) {
  const rows = []
  for (const t of targets) rows.push(await oneCaller(t))
  console.log(`\nallocate + lease + dispose, one caller (medians; one empty workspace per pair); ${load()}`)
  console.table(rows)
}

// 1b. Many callers (64 in flight; 2 × CPU processes) and pool growth (100,000 entries; list and sweep): bench/throughput.mjs.
const xfsTarget = targets.find((x) => x.fs.startsWith('xfs')) ?? targets[0]
for (const section of ['throughput', 'growth']) {
  if (!want(section)) continue
  const only = section === 'throughput' ? 'inflight,procs' : 'growth'
  console.log('')
  const baseline = args.baseline && section === 'throughput' ? ['--baseline', args.baseline] : []
  process.stdout.write(
    execFileSync(process.execPath, [path.join(here, 'throughput.mjs'), '--dir', xfsTarget.dir, '--floor', floorBin, '--only', only, '--entries', args.entries, ...baseline], {
      maxBuffer: 1 << 24,
    }),
  )
}

// 1b'. The floor alone: the one-caller row and the in-flight row, on the XFS target only.
if (want('floor')) {
  const dir = path.join(xfsTarget.dir, 'floor-section') // apart from --only allocate's
  fs.mkdirSync(dir)
  const row = await oneCaller({ ...xfsTarget, dir })
  console.log(`\nallocate + lease + dispose against the native floor, one caller (medians); ${load()}`)
  console.table([row])
  process.stdout.write(
    execFileSync(process.execPath, [path.join(here, 'throughput.mjs'), '--dir', xfsTarget.dir, '--floor', floorBin, '--only', 'inflight', '--rounds', args.rounds], {
      maxBuffer: 1 << 24,
    }),
  )
}

// 1c. Workspace.clone of a 1 GiB base (reflink) against fs.promises.copyFile(COPYFILE_FICLONE_FORCE), interleaved.
if (want('clone')) {
  const t = xfsTarget
  const base = path.join(t.dir, 'base-1g.img')
  {
    const fd = fs.openSync(base, 'w')
    const chunk = Buffer.alloc(16 << 20)
    for (let i = 0; i < 64; i++) {
      for (let j = 0; j < chunk.length; j += 4096) chunk.writeUInt32LE((i * chunk.length + j) >>> 0, j) // not all zero
      fs.writeSync(fd, chunk)
    }
    fs.fsyncSync(fd) // bases are fsynced once when made (DESIGN.md), never on the clone path
    fs.closeSync(fd)
  }
  const pool = await vmspace.openPool(path.join(t.dir, 'clone-pool'))
  const ws = await pool.allocate()
  const basePool = before && (await openBaselinePool(before, path.join(t.dir, 'clone-pool-before')))
  const baseWs = basePool && (await basePool.allocate())
  const out = path.join(t.dir, 'clone-out')
  fs.mkdirSync(out)
  const r = { vmspace: [], copyFile: [], ...(before ? { before: [] } : {}) }
  const names = Object.keys(r)
  const rounds = Number(args['clone-rounds'])
  for (let i = 0; i < rounds + 10; i++) {
    // The order rotates, so that none always runs first (or last) on a warm or busy machine.
    for (let k = 0; k < names.length; k++) {
      const name = names[(i + k) % names.length]
      const t0 = process.hrtime.bigint()
      if (name === 'vmspace') await ws.clone(base, `img-${i}`, { reflink: 'always' })
      else if (name === 'before') await baseWs.clone(base, `img-${i}`, { reflink: 'always' })
      else await fs.promises.copyFile(base, path.join(out, `img-${i}`), fs.constants.COPYFILE_FICLONE_FORCE)
      if (i >= 10) r[name].push(Number(process.hrtime.bigint() - t0) / 1e3)
    }
  }
  await ws.dispose()
  await pool.close()
  if (baseWs) {
    await baseWs.dispose()
    await basePool.close()
  }
  fs.rmSync(out, { recursive: true })
  const vm = median(r.vmspace)
  const cf = median(r.copyFile)
  console.log(`\nclone of a 1 GiB base on ${t.fs} (medians of ${r.vmspace.length}, interleaved); ${load()}`)
  const row = { 'Workspace.clone µs': vm.toFixed(0), 'copyFile FICLONE_FORCE µs': cf.toFixed(0), 'vmspace / copyFile': (vm / cf).toFixed(2) }
  if (before) Object.assign(row, { 'baseline Workspace.clone µs': median(r.before).toFixed(0), 'baseline / copyFile': (median(r.before) / cf).toFixed(2) })
  console.table([row])
}

// 2. Tree clone of 10,000 files (100 dirs x 100 files, 1-16 KiB) against cp -a --reflink=always (XFS: reflink),
// and its removal (Workspace.dispose / removeTree) against fs.promises.rm({ recursive: true }) and the native floor
// (bench/unlinks.cc: readdir + unlinkat/rmdir over fds in one thread, no checks), on every target file system
// (ext4: removal only; its tree is a copy). CPU ms: this process's user+system time over the step (for cp, its own,
// from /proc/self/stat's cutime+cstime, 10 ms ticks); the unlink floor reports its own.
if (want('tree')) {
  const unlinksBin = path.join(work, 'unlinks')
  sh('g++', ['-O2', '-std=c++17', '-o', unlinksBin, path.join(here, 'unlinks.cc')])
  const ticks = Number(sh('getconf', ['CLK_TCK']).trim())
  const childCpuMs = () => {
    const stat = fs.readFileSync('/proc/self/stat', 'utf8')
    const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ') // fields from 3 (state) on
    return ((Number(f[13]) + Number(f[14])) * 1000) / ticks // cutime, cstime (fields 16, 17)
  }
  // --load N,M…: the section runs once per count, with that many processes spinning on the CPUs for the whole pass
  // (a sidecar shares its machine). Default: idle, then one busy loop per CPU.
  if (!/^\d+(,\d+)*$/.test(args.load)) throw new Error(`--load: counts of busy loops, comma-separated (0,2), not '${args.load}'`)
  const loads = args.load.split(',').map(Number)
  for (const busy of loads) {
    const spinners = Array.from({ length: busy }, () =>
      spawn(process.execPath, ['-e', 'for (;;);'], { stdio: 'ignore' }),
    )
    for (const t of targets) {
      const reflink = t.fs.startsWith('xfs')
      const src = path.join(t.dir, `tree-src-${busy}`)
      fs.mkdirSync(src)
      for (let d = 0; d < 100; d++) {
        fs.mkdirSync(path.join(src, `d${d}`))
        for (let f = 0; f < 100; f++)
          fs.writeFileSync(path.join(src, `d${d}`, `f${f}`), Buffer.alloc(1024 * (1 + ((d * 100 + f) % 16)), d))
      }
      sh('sync', [])
      const pool = await vmspace.openPool(path.join(t.dir, `tree-pool-${busy}`))
      const r = { clone: [], allocate: [], cp: [], dispose: [], removeTree: [], rm: [], unlinks: [], ...(before && reflink ? { before: [] } : {}) }
      const cpu = Object.fromEntries(Object.keys(r).map((k) => [k, []]))
      let method
      // Each timed step starts after a sync, so that none pays for the writeback of the one before it.
      const timed = async (key, fn) => {
        sh('sync', [])
        const c0 = process.cpuUsage()
        const k0 = childCpuMs()
        const t0 = process.hrtime.bigint()
        const out = await fn()
        r[key].push(ms(t0))
        const c = process.cpuUsage(c0)
        cpu[key].push((c.user + c.system) / 1e3 + (childCpuMs() - k0))
        return out
      }
      for (let i = 0; i < Number(args.rounds); i++) {
        if (reflink) {
          method = (await timed('clone', () => vmspace.clone(src, path.join(t.dir, `v${busy}-${i}`), { reflink: 'always' }))).method
          await timed('cp', () => sh('cp', ['-a', '--reflink=always', src, path.join(t.dir, `c${busy}-${i}`)]))
          if (before) {
            await timed('before', () => before.clone(src, path.join(t.dir, `b${busy}-${i}`), { reflink: 'always' }))
            await before.removeTree(path.join(t.dir, `b${busy}-${i}`))
          }
        } else {
          method = (await vmspace.clone(src, path.join(t.dir, `v${busy}-${i}`))).method
          sh('cp', ['-a', src, path.join(t.dir, `c${busy}-${i}`)])
        }
        sh('cp', ['-a', '--reflink=auto', src, path.join(t.dir, `u${busy}-${i}`)])
        const ws = reflink ? await timed('allocate', () => pool.allocate({ template: src })) : await pool.allocate({ template: src })
        // The three removals rotate, so that none always runs first (or last) on a warm or busy machine.
        const removals = [
          () => timed('dispose', () => ws.dispose()),
          () => timed('removeTree', () => vmspace.removeTree(path.join(t.dir, `v${busy}-${i}`))),
          () => timed('rm', () => fs.promises.rm(path.join(t.dir, `c${busy}-${i}`), { recursive: true })),
          async () => {
            sh('sync', [])
            const [elapsed, cpuMs] = sh(unlinksBin, [path.join(t.dir, `u${busy}-${i}`)]).trim().split(' ').map(Number)
            r.unlinks.push(elapsed)
            cpu.unlinks.push(cpuMs)
          },
        ]
        for (let k = 0; k < removals.length; k++) await removals[(i + k) % removals.length]()
      }
      await pool.close()
      const m = Object.fromEntries(Object.entries(r).map(([k, v]) => [k, median(v)]))
      const c = Object.fromEntries(Object.entries(cpu).map(([k, v]) => [k, median(v)]))
      console.log(`\ntree of 10,000 files on ${t.fs} (method ${method}; medians of ${args.rounds} rounds, ms; ${spinners.length} busy-loop processes); ${load()}`)
      const rows = []
      const row = (operation, key, base, baseline) =>
        rows.push({
          operation,
          'vmspace ms': m[key].toFixed(0),
          'vmspace CPU ms': c[key].toFixed(0),
          baseline,
          'baseline ms': m[base].toFixed(0),
          'baseline CPU ms': c[base].toFixed(0),
          'speed-up': (m[base] / m[key]).toFixed(2),
          'unlink floor ms': base === 'rm' ? m.unlinks.toFixed(0) : '-',
          'vmspace / floor': base === 'rm' ? (m[key] / m.unlinks).toFixed(2) : '-',
        })
      if (reflink) {
        row('clone (standalone)', 'clone', 'cp', 'cp -a --reflink=always')
        if (before) row(`clone (standalone), baseline ${path.basename(path.resolve(args.baseline))}`, 'before', 'cp', 'cp -a --reflink=always')
        row('allocate({ template: dir })', 'allocate', 'cp', 'cp -a --reflink=always')
      }
      row('Workspace.dispose', 'dispose', 'rm', 'fs.promises.rm recursive')
      row('removeTree', 'removeTree', 'rm', 'fs.promises.rm recursive')
      console.table(rows)
    }
    for (const p of spinners) p.kill('SIGKILL')
  }
}

// 2b. Soak: a million allocate/dispose pairs; RSS and fds from the start and after warm-up (bench/soak.mjs). Once more
// with V8's young generation held at 1 MiB semi-spaces, so that its growth with the allocation rate does not show as
// RSS growth.
if (want('soak')) {
  for (const v8 of [[], ['--max-semi-space-size=1']]) {
    console.log(v8.length ? `\nnode ${v8.join(' ')}:` : '')
    process.stdout.write(
      execFileSync(process.execPath, ['--expose-gc', ...v8, path.join(here, 'soak.mjs'), '--dir', xfsTarget.dir, '--cycles', args['soak-cycles']]),
    )
  }
}

// 3. Liveness: how fast adopt() refuses a live lease and sweep() passes live workspaces (8 held by another
// process), against list() of the same pool and a no-op pool hop. A lease is probed with F_OFD_GETLK, which takes
// no lock, so a live lease costs no back-off and a listing never makes an adopt or a sweep wait (DESIGN.md, Leases).
if (want('lease')) {
  const t = targets[0]
  const root = path.join(t.dir, 'lease-pool')
  const pool = await vmspace.openPool(root)
  const dist = path.join(here, '..', 'dist', 'index.js')
  const holder = spawn(process.execPath, ['-e', `
    const v = require(${JSON.stringify(dist)})
    v.openPool(${JSON.stringify(root)}).then(async (p) => {
      const ids = []
      for (let i = 0; i < 8; i++) ids.push((await p.allocate()).id)
      console.log(JSON.stringify(ids))
      process.stdin.on('end', () => process.exit(0)).resume()
    })`], { stdio: ['pipe', 'pipe', 'inherit'] })
  const liveIds = JSON.parse(await new Promise((r) => holder.stdout.once('data', (d) => r(String(d)))))
  const orphan = await pool.allocate()
  await orphan.release({ force: true })
  const probes = new Bench({ time: timeMs, warmupTime: 300 })
  probes.add('no-op pool hop', () => binding.lockRelease(-1))
  probes.add('list() (9 workspaces)', () => pool.list())
  probes.add('adopt() of a live workspace (refused)', () =>
    pool.adopt(liveIds[0]).then(
      () => { throw new Error('adopted a live workspace') },
      (e) => { if (e.code !== 'ERR_LEASE_HELD') throw e },
    ))
  probes.add('adopt() + release() of an orphan', async () => (await pool.adopt(orphan.id)).release({ force: true }))
  await probes.run()
  // Now held here as well, so that a sweep counts 9 live and reclaims nothing.
  const held = await pool.adopt(orphan.id)
  const sweeps = new Bench({ time: timeMs, warmupTime: 300 })
  sweeps.add('sweep() (9 live)', async () => {
    const r = await pool.sweep()
    if (r.live !== 9) throw new Error(`sweep counted ${r.live} live`)
  })
  await sweeps.run()
  await held.dispose()
  holder.stdin.end()
  const all = [...probes.tasks, ...sweeps.tasks]
  for (const x of all) if (x.result.error) throw x.result.error
  const hop = all[0].result.latency.p50 * 1e3
  console.log(`\nliveness on ${t.fs} (medians, µs; 8 workspaces leased by another process)`)
  console.table(
    all.map((x) => ({
      operation: x.name,
      'µs': (x.result.latency.p50 * 1e3).toFixed(1),
      '/ no-op hop': ((x.result.latency.p50 * 1e3) / hop).toFixed(1),
    })),
  )
  await pool.close()
}

// 5. The warm reserve and the writeback stall, on ext4 (no reflink: every template clone is a copy). A VM image
// cloned by copy is dirty page cache, all of it, and the VM's first fsync pays for writing it back. Compared in the
// same run: allocate({ template: image }) built on the caller's path (writeback 'none', and 'start'), against one
// served by a reserve of `--warm-count` entries (openPool's warm), the caller pacing itself at the refill rate
// (it allocates once the reserve is full again: "while the reserve keeps up"). Each allocate starts after a sync,
// so that none pays for the one before it; its workspace's image is then fsynced once (the VM's first fsync).
// Two images: the demo's (a 256 MiB ext4 file system of Node's npm package and headers, sparse) and 256 MiB of
// random data (dense). On a 4 GiB loop-mounted ext4 when root (mounted without `discard`: on the root file system
// here every dispose's discards stall the journal, and with it the next allocate's metadata, whatever allocate
// does); else --dir, else os.tmpdir().
if (want('warm')) {
  let base = args.dir ? targets[0].dir : work
  if (!args.dir && process.getuid?.() === 0) {
    try {
      base = loopMount('ext4-warm', 4096)
    } catch (e) {
      console.error(`no ext4 loop mount for the warm reserve (${e.message.split('\n')[0]}): ${base}`)
    }
  }
  const fsType = sh('findmnt', ['-no', 'FSTYPE', '-T', base]).trim()
  const rounds = Number(args['warm-rounds'])
  const count = Number(args['warm-count'])
  const images = []
  // The demo's image (demo/base.ts builds and caches it with this name), else one built the same way now.
  const demoImage = path.join(os.tmpdir(), `vmspace-demo-base-node-${process.version}-${process.arch}.ext4`)
  const demoCopy = path.join(base, 'demo.ext4')
  // Copied with its holes (copyFileSync would fill them).
  if (fs.existsSync(demoImage) && fs.statSync(demoImage).size === 256 * 1024 * 1024)
    await vmspace.clone(demoImage, demoCopy, { reflink: 'never', writeback: 'wait' })
  else {
    const prefix = path.resolve(path.dirname(fs.realpathSync(process.execPath)), '..')
    const src = path.join(prefix, 'lib', 'node_modules')
    try {
      sh('mkfs.ext4', ['-q', '-F', '-t', 'ext4', '-d', src, demoCopy, '262144k'])
    } catch (e) {
      console.error(`no demo image (${e.message.split('\n')[0]}): dense image only`)
    }
  }
  if (fs.existsSync(demoCopy)) images.push({ what: 'demo image', file: demoCopy })
  const dense = path.join(base, 'dense.img')
  {
    const fd = fs.openSync(dense, 'w')
    const chunk = Buffer.alloc(4 * 1024 * 1024)
    for (let i = 0; i < 64; i++) fs.writeSync(fd, require('node:crypto').randomFillSync(chunk))
    fs.closeSync(fd)
  }
  images.push({ what: 'dense 256 MiB', file: dense })
  const fsyncMs = (file) => {
    const fd = fs.openSync(file, 'r+')
    try {
      const t0 = process.hrtime.bigint()
      fs.fsyncSync(fd)
      return ms(t0)
    } finally {
      fs.closeSync(fd)
    }
  }
  // Nearest-rank percentile.
  const pct = (xs, p) => [...xs].sort((a, b) => a - b)[Math.max(0, Math.ceil((p / 100) * xs.length) - 1)]
  const rows = []
  const summary = []
  for (const img of images) {
    sh('sync', [])
    const dataMiB = (fs.statSync(img.file).blocks * 512) / 2 ** 20
    const template = { 'rootfs.ext4': img.file }
    const runs = {}
    // `bootMs`: the VM's first fsync comes that long after the allocate (a boot), not at once.
    const once = async (pool, key, { bootMs = 0, ...opts } = {}) => {
      sh('sync', [])
      const t0 = process.hrtime.bigint()
      const ws = await pool.allocate({ template, ...opts }) // opts.template: undefined for an empty workspace
      const a = ms(t0)
      if (bootMs) await new Promise((r) => setTimeout(r, bootMs))
      const f = ws.template.length ? fsyncMs(path.join(ws.path, 'rootfs.ext4')) : NaN
      ;(runs[key] ??= { allocate: [], fsync: [], method: ws.template[0]?.method ?? '-' }).allocate.push(a)
      runs[key].fsync.push(f)
      await ws.dispose()
    }
    const fresh = await vmspace.openPool(path.join(base, 'pool-fresh'))
    const warm = await vmspace.openPool(path.join(base, 'pool-warm'), { warm: { template, count } })
    const full = async () => {
      while (warm.warmStats().ready < count) {
        if (warm.warmStats().lastError) throw warm.warmStats().lastError
        await new Promise((r) => setTimeout(r, 5))
      }
    }
    // Interleaved, so that drifting load weighs on every mode alike.
    for (let i = 0; i < rounds; i++) {
      await once(fresh, 'fresh, writeback none')
      await once(fresh, "fresh, writeback 'start'", { writeback: 'start' })
      await once(fresh, 'fresh, writeback none, fsync 250 ms later', { bootMs: 250 })
      await once(fresh, "fresh, writeback 'start', fsync 250 ms later", { writeback: 'start', bootMs: 250 })
      await full()
      // The floor of any allocate: an empty workspace (name, lease, metadata, publish), same pool, no refill running.
      await once(warm, 'empty workspace (no template; the floor)', { template: undefined })
      await once(warm, `warm reserve (count ${count})`)
    }
    await full()
    const ws = warm.warmStats()
    await warm.close()
    await fresh.close()
    if (ws.hits !== rounds) throw new Error(`the reserve served ${ws.hits} of ${rounds}`)
    const rate = (ws.built / ws.buildMs) * 1000
    for (const [mode, r] of Object.entries(runs))
      rows.push({
        image: `${img.what} (${dataMiB.toFixed(0)} MiB data)`,
        allocate: mode,
        method: r.method,
        'allocate p50 ms': median(r.allocate).toFixed(1),
        'allocate p99 ms': pct(r.allocate, 99).toFixed(1),
        'first fsync p50 ms': r.method === '-' ? '-' : median(r.fsync).toFixed(1),
        'first fsync p99 ms': r.method === '-' ? '-' : pct(r.fsync, 99).toFixed(1),
      })
    const warmRun = runs[`warm reserve (count ${count})`]
    const freshRun = runs['fresh, writeback none']
    summary.push({
      image: img.what,
      'fresh p99 ms': pct(freshRun.allocate, 99).toFixed(1),
      'warm p99 ms': pct(warmRun.allocate, 99).toFixed(1),
      'goal warm p99 < 5 ms': pct(warmRun.allocate, 99) < 5 ? 'met' : 'not met',
      'fresh / warm (p50)': (median(freshRun.allocate) / median(warmRun.allocate)).toFixed(0),
      'refill: entries/s': rate.toFixed(2),
      'refill: MiB/s of data': (rate * dataMiB).toFixed(0),
      'first fsync fresh / warm (p50)': (median(freshRun.fsync) / median(warmRun.fsync)).toFixed(0),
    })
  }
  const vm = (k) => fs.readFileSync(`/proc/sys/vm/${k}`, 'utf8').trim()
  console.log(`\nwarm reserve and writeback stall on ${fsType} (${base}; ${rounds} rounds, nearest-rank p99 = the worst of fewer than 100)`)
  console.log(`  kernel writeback: dirty_background_ratio ${vm('dirty_background_ratio')}, dirty_background_bytes ${vm('dirty_background_bytes')}, dirty_expire_centisecs ${vm('dirty_expire_centisecs')}; the warm entry's fsync runs at once, before the refill starts (on the event loop's next turn)`)
  console.table(rows)
  console.table(summary)
}

/** Runs `fn(mountPoint)` on a loop mount of its own (`kind`: btrfs, or xfs-<name>), or says why the section is skipped. */
async function onLoopMount(label, kind, sizeMb, fn) {
  const fsName = kind.startsWith('xfs') ? 'xfs' : kind
  let mnt = null
  if (process.getuid?.() === 0) {
    try { mnt = loopMount(kind, sizeMb) } catch (e) { console.error(`no ${fsName}: ${e.message}`) }
  }
  if (!mnt) console.log(`\n${label}: skipped (needs root and mkfs.${fsName} for a loop mount)`)
  else await fn(mnt)
}

// Templates on btrfs: subvolume snapshots against the reflink walk, on a btrfs of its own (bench/template.mjs).
if (want('templates-btrfs'))
  await onLoopMount('templates on btrfs', 'btrfs', 2048, async (mnt) =>
    (await import('./template.mjs')).benchTemplatesBtrfs({ vmspace, dir: mnt, load, sizes: args['template-files'].split(',').map(Number) }))

// The template cache (bench/template-cache.mjs): a dense 2 GiB image on the host file system into a loop XFS pool.
if (want('template-cache'))
  await onLoopMount('template cache', 'xfs-cache', 6144, async (mnt) => (await import('./template-cache.mjs')).benchTemplateCache({ vmspace, dir: mnt, src: work }))

// Shared files (bench/share.mjs): 16 children reading a shared 1 GiB memory file against reflinked ones (page cache,
// allocate p50) on a loop XFS.
if (want('share')) await onLoopMount('shared files', 'xfs-share', 6144, async (mnt) => (await import('./share.mjs')).benchShare({ vmspace, dir: mnt }))

// Image import (bench/import.mjs): a 5-layer image of /usr against umoci unpack on a loop XFS; re-import; allocate
// from the image as a tree and as rootfs.ext4 on the loop XFS and on an image-backed pool.
if (want('import')) await onLoopMount('image import', 'xfs-import', 8192, async (mnt) => (await import('./import.mjs')).benchImport({ vmspace, dir: mnt, src: work }))

// Checkpoint and rollback of a workspace holding a 2 GiB rootfs image (bench/checkpoint.mjs): on a loop XFS and on an
// image-backed (btrfs) pool.
if (want('checkpoint')) {
  const { benchCheckpoint, makeRootfsTree } = await import('./checkpoint.mjs')
  const tree = path.join(work, 'rootfs-tree')
  makeRootfsTree(tree, 384)
  const rows = []
  await onLoopMount('checkpoint on XFS', 'xfs-checkpoint', 8192, async (mnt) => {
    rows.push(await benchCheckpoint({ vmspace, label: 'loop XFS', root: path.join(mnt, 'pool'), tree }))
  })
  if (process.getuid?.() === 0)
    rows.push(await benchCheckpoint({
      vmspace, label: 'image-backed (btrfs)', root: path.join(work, 'image-pool'),
      poolOptions: { image: { path: path.join(work, 'pool.img'), size: 8 * 2 ** 30 } }, tree,
    }))
  console.log('\ncheckpoint and rollback of a workspace holding a 2 GiB rootfs image (20 rounds; 4 MiB written before each)')
  console.table(rows)
}

// 4. The locked JSON index against proper-lockfile + write-file-atomic (bench/json-file.mjs).
if (want('json-file')) {
  const t = targets[0]
  console.log(`\nlocked JSON index on ${t.fs}`)
  process.stdout.write(execFileSync(process.execPath, [path.join(here, 'json-file.mjs'), '--dir', t.dir]))
}

// Metrics (bench/metrics.mjs): allocate+dispose throughput with metrics disabled, startMetrics() and
// registerPrometheus() interleaved in one run; the cost of a gauge scrape of a 10,000-workspace pool.
if (want('metrics')) {
  const t = targets[0]
  console.log(`\nmetrics on ${t.fs}`)
  process.stdout.write(
    execFileSync(process.execPath, [path.join(here, 'metrics.mjs'), '--dir', t.dir, '--time', String(timeMs), '--rounds', args.rounds]),
  )
}

// 5. Tracing costs nothing unless someone listens: allocate+dispose with no subscriber, with a subscriber on the
// vmspace:allocate and vmspace:dispose tracing channels, and (--baseline DIR) an earlier version of the code, which
// had no tracing, with none. The variants alternate round by round on one file system; medians of the rounds.
if (want('trace')) {
  const dc = await import('node:diagnostics_channel')
  const t = targets[0]
  const variants = [
    { name: 'no subscriber', lib: vmspace },
    { name: 'subscriber (allocate, dispose)', lib: vmspace, subscribe: true },
  ]
  if (before) variants.push({ name: 'baseline', lib: before, baseline: true }) // named once its pool is open
  const handlers = { start() {}, end() {}, asyncStart() {}, asyncEnd() {}, error() {} }
  const channels = ['vmspace:allocate', 'vmspace:dispose'].map((n) => dc.tracingChannel(n))
  const hooks = {
    beforeAll: () => channels.forEach((c) => c.subscribe(handlers)),
    afterAll: () => channels.forEach((c) => c.unsubscribe(handlers)),
  }
  const pools = []
  for (const [i, v] of variants.entries()) {
    const root = path.join(t.dir, `trace-${i}`)
    pools.push(v.baseline ? await openBaselinePool(v.lib, root) : await v.lib.openPool(root))
    if (v.baseline) v.name = `${baselineLabel(pools[i])} of ${path.basename(path.resolve(args.baseline))}, no subscriber`
  }
  const samples = variants.map(() => [])
  for (let round = 0; round < Number(args.rounds); round++) {
    const bench = new Bench({ time: timeMs / 2, warmupTime: 200 })
    // The order rotates each round, so that no variant always runs first (or last) on a warm or busy machine.
    const order = variants.map((_, k) => (k + round) % variants.length)
    for (const i of order) {
      const v = variants[i]
      const task = async () => {
        const ws = await pools[i].allocate()
        await ws.dispose()
      }
      bench.add(v.name, task, v.subscribe ? hooks : {})
    }
    await bench.run()
    for (const [k, x] of bench.tasks.entries()) {
      if (x.result.error) throw x.result.error
      samples[order[k]].push(x.result.latency.p50 * 1e3) // ms -> µs
    }
  }
  const base = median(samples[0])
  console.log(`\ntracing: allocate+dispose on ${t.fs} (median of ${args.rounds} rounds of per-round medians, µs)`)
  console.table(
    variants.map((v, i) => ({
      variant: v.name,
      'µs': median(samples[i]).toFixed(1),
      '/ no subscriber': (median(samples[i]) / base).toFixed(3),
      'rounds (µs)': samples[i].map((x) => x.toFixed(0)).join(' '),
    })),
  )
  for (const p of pools) await p.close()
}

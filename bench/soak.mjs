#!/usr/bin/env node
// Soak: `--cycles` allocate/dispose pairs (64 in flight) on one pool; RSS and open fds at the start, after the
// first tenth (warm-up: JIT, heap and malloc arenas reach their working size), at half way, and at the end. Growth
// after the warm-up is what a leak shows as; growth from the start includes the warm-up; the second half's growth
// tells a leak from a warm-up that outlasted the first tenth (RSS reached its plateau only at ~300,000 pairs in one
// run of 1,000,000).
//   node --expose-gc bench/soak.mjs --dir DIR [--cycles 1000000]
import { execFileSync } from 'node:child_process'
import * as fs from 'node:fs'
import { createRequire } from 'node:module'
import * as os from 'node:os'
import * as path from 'node:path'
import { parseArgs } from 'node:util'

const require = createRequire(import.meta.url)
const vmspace = require(path.join(path.dirname(new URL(import.meta.url).pathname), '..', 'dist', 'index.js'))
const { values: args } = parseArgs({
  options: { dir: { type: 'string' }, cycles: { type: 'string', default: '1000000' } },
})
const cycles = Number(args.cycles)
const dir = fs.mkdtempSync(path.join(args.dir ?? os.tmpdir(), 'vmspace-soak-'))
process.on('exit', () => fs.rmSync(dir, { recursive: true, force: true }))
const fsType = execFileSync('stat', ['-f', '-c', '%T', dir], { encoding: 'utf8' }).trim()
const fds = () => fs.readdirSync('/proc/self/fd').length
const snap = () => {
  global.gc?.()
  const m = process.memoryUsage()
  return { rss: m.rss, heap: m.heapUsed, heapTotal: m.heapTotal, fds: fds() }
}
const pool = await vmspace.openPool(path.join(dir, 'pool'))
const start = snap()
let warm
let half // at cycles / 2: the second half's growth shows a leak even where the warm-up outlasts the first tenth
const trace = [] // RSS MiB at every tenth
let done = 0
const t0 = performance.now()
await Promise.all(
  Array.from({ length: 64 }, async () => {
    while (done < cycles) {
      const i = ++done
      const ws = await pool.allocate()
      await ws.dispose()
      if (i % Math.floor(cycles / 10) === 0) {
        const now = snap()
        if (!warm) warm = now
        if (i === Math.floor(cycles / 10) * 5) half = now
        trace.push(`${(now.rss / 2 ** 20).toFixed(1)}/${(now.heapTotal / 2 ** 20).toFixed(1)}`)
      }
    }
  }),
)
const s = (performance.now() - t0) / 1000
const end = snap()
await pool.close()
const MiB = (b) => (b / 2 ** 20).toFixed(2)
console.log(`soak on ${fsType}: ${cycles} allocate/dispose pairs, 64 in flight, ${s.toFixed(0)} s (${(cycles / s).toFixed(0)}/s); load average ${os.loadavg()[0].toFixed(1)}`)
// RSS includes the V8 heap V8 has committed (heapTotal), which grows with the allocation rate (the young generation's
// semi-spaces double up to --max-semi-space-size, 16 MiB by default: a 16 MiB step once the loop runs at full
// speed) without anything being kept: "RSS − V8 heap" is the memory outside V8's heap (the addon's, libuv's,
// malloc's). Fds: the mid-run snapshots are taken with 64 workspaces leased, so only start -> end counts fds.
const row = (span, from, fdsToo) => ({
  span,
  'RSS growth MiB': MiB(end.rss - from.rss),
  'V8 heap committed growth MiB': MiB(end.heapTotal - from.heapTotal),
  'RSS − V8 heap growth MiB': MiB(end.rss - end.heapTotal - (from.rss - from.heapTotal)),
  'heap used growth MiB': MiB(end.heap - from.heap),
  'fds leaked': fdsToo ? end.fds - from.fds : '-',
})
console.table([
  row('start -> end', start, true),
  row(`after warm-up (${cycles / 10}) -> end`, warm, false),
  row(`second half (${cycles / 2}) -> end`, half, false),
])
console.log(`RSS/V8 heap committed MiB: start ${MiB(start.rss)}/${MiB(start.heapTotal)}, at each tenth ${trace.join(' ')}, end ${MiB(end.rss)}/${MiB(end.heapTotal)}`)

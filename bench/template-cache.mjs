// The template cache: a dense 2 GiB image on the host's file system (`src`, ext4 here) into a pool on a loop XFS
// (`dir`, reflink=1). The first allocate copies it into .vmspace/cache/ (a miss); each next one reflinks the cached
// copy. Reports the first allocate, then p50/p99 over `count` allocates after it, the bytes of its own of one such
// workspace (exclusive extents, Workspace.usage), and the load average during the run. Run by bench/run.mjs
// (`npm run bench -- --only template-cache`).
import { randomFillSync } from 'node:crypto'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'

const ms = (t0) => Number(process.hrtime.bigint() - t0) / 1e6
const rank = (xs, p) => {
  const s = [...xs].sort((a, b) => a - b)
  return s[Math.min(s.length - 1, Math.ceil((p / 100) * s.length) - 1)]
}

/** A file of `size` random bytes (no holes: every block allocated), fsynced. */
function denseFile(file, size) {
  const fd = fs.openSync(file, 'wx', 0o644)
  const chunk = Buffer.alloc(64 << 20)
  for (let off = 0; off < size; off += chunk.length) fs.writeSync(fd, randomFillSync(chunk), 0, Math.min(chunk.length, size - off), off)
  fs.fsyncSync(fd)
  fs.closeSync(fd)
}

export async function benchTemplateCache({ vmspace, dir, src, size = 2 * 2 ** 30, count = 50 }) {
  const image = path.join(src, 'rootfs.ext4')
  denseFile(image, size)
  const template = { 'rootfs.ext4': image }
  const pool = await vmspace.openPool(path.join(dir, 'pool'))
  const load0 = os.loadavg()
  let t0 = process.hrtime.bigint()
  const first = await pool.allocate({ template })
  const firstMs = ms(t0)
  if (first.template[0].cache !== 'miss') throw new Error(`first allocate: cache ${first.template[0].cache}`)
  const times = []
  const made = [first]
  for (let i = 0; i < count; i++) {
    t0 = process.hrtime.bigint()
    const ws = await pool.allocate({ template })
    times.push(ms(t0))
    if (ws.template[0].cache !== 'hit' || ws.template[0].method !== 'reflink') throw new Error(`allocate ${i}: ${ws.template[0].method}/${ws.template[0].cache}`)
    made.push(ws)
  }
  const own = await made[made.length - 1].usage()
  const load1 = os.loadavg()
  for (const ws of made) await ws.dispose()
  await pool.close()
  fs.rmSync(image)
  console.log(`\ntemplate cache: dense ${(size / 2 ** 30).toFixed(0)} GiB image on the host (${src}) into a loop XFS pool (${dir})`)
  console.table([{
    'first allocate (copy into the cache) ms': firstMs.toFixed(0),
    [`allocate p50 ms (${count} after the first)`]: rank(times, 50).toFixed(2),
    'allocate p99 ms': rank(times, 99).toFixed(2),
    'bytes of its own (exclusive)': own.exclusiveBytes,
    'load average 1 min (start, end)': `${load0[0].toFixed(2)}, ${load1[0].toFixed(2)}`,
  }])
}

// Shared files (commit's `share`): `n` children of a template holding a 1 GiB memory file, each reading it whole,
// against `n` children of the same tree without share (reflinked: one inode each). Reports the page cache held for
// the file (util-linux fincore, summed over distinct inodes) and allocate({ from }) p50 for each. Each child's inode
// has no pages before it is read (the template's copy is another inode), so no cache needs dropping first. Run by
// bench/run.mjs (`npm run bench -- --only share`) on a loop XFS of its own.
import { execFileSync } from 'node:child_process'
import { randomFillSync } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { median } from './median.mjs'

const ms = (t0) => Number(process.hrtime.bigint() - t0) / 1e6
const GiB = 2 ** 30

/** Bytes of `file` in the page cache. */
const resident = (file) => Number(execFileSync('fincore', ['--bytes', '--noheadings', '--output', 'RES', file]).toString().trim())

/** Reads `file` whole through a 4 MiB buffer. */
function readWhole(file) {
  const fd = fs.openSync(file, 'r')
  const buf = Buffer.allocUnsafe(4 << 20)
  while (fs.readSync(fd, buf, 0, buf.length, null) > 0);
  fs.closeSync(fd)
}

/** Page cache of `files`, each inode once; and how many distinct inodes they are. */
function cacheOf(files) {
  const seen = new Map()
  for (const f of files) {
    const st = fs.statSync(f)
    seen.set(`${st.dev}:${st.ino}`, resident(f))
  }
  return { bytes: [...seen.values()].reduce((a, b) => a + b, 0), inodes: seen.size }
}

async function variant(pool, from, n, file) {
  const times = []
  const children = []
  for (let i = 0; i < n; i++) {
    const t0 = process.hrtime.bigint()
    children.push(await pool.allocate({ from }))
    times.push(ms(t0))
  }
  const files = children.map((ws) => path.join(ws.path, file))
  for (const f of files) readWhole(f)
  const cache = cacheOf(files)
  await Promise.all(children.map((ws) => ws.dispose()))
  return { p50: median(times), ...cache }
}

export async function benchShare({ vmspace, dir, n = 16, size = GiB }) {
  const pool = await vmspace.openPool(path.join(dir, 'pool'))
  const src = await pool.allocate()
  const file = 'mem.snap'
  const fd = fs.openSync(path.join(src.path, file), 'wx', 0o644)
  const chunk = Buffer.alloc(64 << 20)
  for (let off = 0; off < size; off += chunk.length) fs.writeSync(fd, randomFillSync(chunk), 0, Math.min(chunk.length, size - off), off)
  fs.fsyncSync(fd)
  fs.closeSync(fd)
  fs.writeFileSync(path.join(src.path, 'vmstate'), 'state')
  const shared = await pool.commit(src, { name: 'shared', share: [file] })
  const plain = await pool.commit(src, { name: 'plain' })
  const s = await variant(pool, 'shared', n, file)
  const p = await variant(pool, 'plain', n, file)
  console.log(`\nshared files: ${n} children of a template with a ${(size / GiB).toFixed(0)} GiB memory file, each read whole (loop XFS, ${dir})`)
  const row = (label, v) =>
    console.log(`  ${label.padEnd(22)} page cache ${(v.bytes / GiB).toFixed(2).padStart(6)} GiB over ${String(v.inodes).padStart(2)} inode(s)   allocate p50 ${v.p50.toFixed(2).padStart(7)} ms`)
  row('share (hard links)', s)
  row('no share (reflinks)', p)
  console.log(`  page cache ratio no share / share: ${(p.bytes / s.bytes).toFixed(1)}x`)
  await pool.removeTemplate(shared.id)
  await pool.removeTemplate(plain.id)
  await src.dispose()
  await pool.close()
}

// Checkpoint and rollback of a workspace holding a 2 GiB rootfs image (docs/checkpoints.md): `mke2fs -t ext4 -d` of
// a few hundred MiB of files into a 2 GiB image in the workspace, so the image has real extents; then `rounds`
// rounds of: a few MiB written at scattered offsets into the image, checkpoint (keepNewest 2, as an agent loop
// keeps a short history), a few MiB more, rollback to that checkpoint. p50/p90 of each, against the target of
// p50 ≤ 20 ms. Run by bench/run.mjs (`npm run bench -- --only checkpoint`) on a loop XFS and on an image-backed
// (btrfs) pool.
import { execFileSync } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'

const ms = (t0) => Number(process.hrtime.bigint() - t0) / 1e6
const pct = (xs, p) => {
  const s = [...xs].sort((a, b) => a - b)
  return s[Math.min(s.length - 1, Math.ceil((p / 100) * s.length) - 1)]
}

/** `dir` filled with `mib` MiB of files from 4 KiB to 4 MiB (random bytes: nothing compresses or dedups). */
export function makeRootfsTree(dir, mib) {
  fs.mkdirSync(dir, { recursive: true })
  let left = mib * 2 ** 20
  for (let i = 0; left > 0; i++) {
    const size = Math.min(left, 4096 << i % 11)
    const sub = path.join(dir, `d${i % 32}`)
    fs.mkdirSync(sub, { recursive: true })
    fs.writeFileSync(path.join(sub, `f${i}`), randomBytes(size))
    left -= size
  }
}

/** `mib` MiB written into `file` in 64 KiB pieces at random 4 KiB-aligned offsets (a guest's scattered writes). */
function scatterWrite(file, mib) {
  const fd = fs.openSync(file, 'r+')
  const size = fs.fstatSync(fd).size
  const piece = randomBytes(64 * 1024)
  for (let i = 0; i < mib * 16; i++) fs.writeSync(fd, piece, 0, piece.length, Math.floor(Math.random() * ((size - piece.length) / 4096)) * 4096)
  fs.fsyncSync(fd)
  fs.closeSync(fd)
}

/**
 * On the pool `poolOptions` opens at `root`: a workspace with a 2 GiB ext4 image made from `tree`, then `rounds`
 * rounds. Returns the row for the report.
 */
export async function benchCheckpoint({ vmspace, label, root, poolOptions = {}, tree, rounds = 20, writeMiB = 4 }) {
  const pool = await vmspace.openPool(root, poolOptions)
  try {
    const ws = await pool.allocate()
    const image = path.join(ws.path, 'rootfs.ext4')
    execFileSync('mke2fs', ['-q', '-F', '-t', 'ext4', '-d', tree, image, '2G'], { stdio: ['ignore', 'ignore', 'pipe'] })
    const extents = execFileSync('filefrag', [image]).toString().trim()
    const checkpoint = []
    const rollback = []
    for (let r = 0; r < rounds; r++) {
      scatterWrite(image, writeMiB)
      let t0 = process.hrtime.bigint()
      const cp = await ws.checkpoint({ keepNewest: 2 })
      checkpoint.push(ms(t0))
      scatterWrite(image, writeMiB)
      t0 = process.hrtime.bigint()
      const rb = await ws.rollback(cp)
      rollback.push(ms(t0))
      if (!rb.removed) throw new Error('the old tree was left in trash')
    }
    const after = execFileSync('filefrag', [image]).toString().trim()
    await ws.dispose()
    for (const cp of await pool.templates()) await pool.removeTemplate(cp.id)
    return {
      pool: label,
      'checkpoint p50 ms': pct(checkpoint, 50).toFixed(1),
      'checkpoint p90 ms': pct(checkpoint, 90).toFixed(1),
      'rollback p50 ms': pct(rollback, 50).toFixed(1),
      'rollback p90 ms': pct(rollback, 90).toFixed(1),
      'target p50 ≤ 20 ms': pct(checkpoint, 50) <= 20 && pct(rollback, 50) <= 20 ? 'met' : 'not met',
      extents: `${extents.replace(/^.*: /, '')} → ${after.replace(/^.*: /, '')}`,
    }
  } finally {
    await pool.close()
    if (poolOptions.image) await vmspace.unmountImage(root)
  }
}

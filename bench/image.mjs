#!/usr/bin/env node
// Image-backed pool on the host's own file system (os.tmpdir(): ext4 on the dev machines), as root:
//   allocate:  51 allocate({ template }) of a dense 2 GiB base on the host file system: the first copies it into
//              the pool's template cache, the others reflink from there; p50/p99 of the 50 after the first, and
//              the bytes of its own of one workspace (usage().exclusiveBytes).
//   churn:     64 allocate+dispose pairs in flight, of the same host base, on the image pool and on a plain
//              loop-mounted XFS (reflink=1) pool (each through its template cache, warmed first); the ratio of
//              their median rates over 5 interleaved rounds (one run).
//   guest I/O: 1 GiB sequential write and read with dd oflag=direct / iflag=direct (bs 1 MiB) of a file in the
//              image pool (through the loop device) and of a file on the host file system; the ratio.
// Usage: node bench/image.mjs [--size-gib N]  (needs npm run build; prints one JSON document)
import { execFileSync } from 'node:child_process'
import * as crypto from 'node:crypto'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'

const { openPool, unmountImage } = (await import(new URL('../dist/index.js', import.meta.url).href)).default

const GiB = 1024 ** 3
const sizeArg = process.argv.indexOf('--size-gib')
const templateBytes = (sizeArg > 0 ? Number(process.argv[sizeArg + 1]) : 2) * GiB
const ms = (t0) => Number(process.hrtime.bigint() - t0) / 1e6
const pct = (xs, p) => {
  const s = [...xs].sort((a, b) => a - b)
  return s[Math.min(s.length - 1, Math.ceil((p / 100) * s.length) - 1)]
}
const sh = (cmd, args) => execFileSync(cmd, args, { encoding: 'utf8', env: { ...process.env, PATH: `${process.env.PATH}:/usr/sbin:/sbin`, LC_ALL: 'C' } })

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-bench-image-'))
const root = path.join(dir, 'pool')
const image = path.join(dir, 'pool.img')
const xfsImage = path.join(dir, 'xfs.img')
const xfsRoot = path.join(dir, 'xfs')
const out = { host: sh('findmnt', ['-n', '-o', 'FSTYPE,OPTIONS', '-T', dir]).trim(), loadavgBefore: os.loadavg() }

function denseFile(file, bytes) {
  const fd = fs.openSync(file, 'wx')
  const chunk = crypto.randomBytes(16 * 1024 * 1024)
  for (let off = 0; off < bytes; off += chunk.length) fs.writeSync(fd, chunk, 0, chunk.length, off)
  fs.fsyncSync(fd)
  fs.closeSync(fd)
}

async function churn(pool, template) {
  const t0 = process.hrtime.bigint()
  await Promise.all(Array.from({ length: 64 }, async () => (await pool.allocate({ template: { 'rootfs.ext4': template } })).dispose()))
  return 64 / (ms(t0) / 1000)
}

const ddRate = (args) => execFileSync('dd', [...args, 'status=none'])
function timed(fn) {
  const t0 = process.hrtime.bigint()
  fn()
  return ms(t0)
}
function seqIo(file) {
  const count = 1024
  const write = timed(() => ddRate(['if=/dev/zero', `of=${file}`, 'bs=1M', `count=${count}`, 'oflag=direct', 'conv=fsync']))
  const read = timed(() => ddRate([`if=${file}`, 'of=/dev/null', 'bs=1M', 'iflag=direct']))
  fs.rmSync(file)
  return { writeMiBs: count / (write / 1000), readMiBs: count / (read / 1000) }
}

try {
  const host = path.join(dir, 'base.ext4')
  denseFile(host, templateBytes)
  const pool = await openPool(root, { image: { path: image, size: 4 * templateBytes } })
  const holder = await pool.allocate()
  const times = []
  const made = []
  for (let i = 0; i < 51; i++) {
    const t0 = process.hrtime.bigint()
    made.push(await pool.allocate({ template: { 'rootfs.ext4': host } }))
    times.push(ms(t0))
  }
  const after = times.slice(1)
  out.allocate = {
    first: { method: made[0].template[0].method, cache: made[0].template[0].cache, ms: times[0] },
    method: made[1].template[0].method,
    cache: made[1].template[0].cache,
    p50Ms: pct(after, 50),
    p99Ms: pct(after, 99),
    ownBytes: (await made[1].usage()).exclusiveBytes,
    templateBytes,
  }
  for (const ws of made) await ws.dispose()

  fs.writeFileSync(xfsImage, '')
  fs.truncateSync(xfsImage, 4 * templateBytes)
  sh('mkfs.xfs', ['-q', '-m', 'reflink=1', xfsImage])
  fs.mkdirSync(xfsRoot)
  sh('mount', ['-o', 'loop', xfsImage, xfsRoot])
  const xfsPool = await openPool(xfsRoot)
  await churn(pool, host) // warm-up of each (the XFS pool's cache copy), not counted
  await churn(xfsPool, host)
  // Rounds interleaved, medians compared: one round each swings by 2x on a shared machine (btrfs's rate also falls
  // over the first rounds, as its freed extents are discarded and cleaned in the background).
  const imageRates = []
  const xfsRates = []
  for (let i = 0; i < 5; i++) {
    imageRates.push(await churn(pool, host))
    xfsRates.push(await churn(xfsPool, host))
  }
  const imageRate = pct(imageRates, 50)
  const xfsRate = pct(xfsRates, 50)
  out.churn64 = { imagePairsPerS: imageRate, xfsPairsPerS: xfsRate, ratio: imageRate / xfsRate, imageRates, xfsRates }
  await xfsPool.close()

  const ioImage = seqIo(path.join(holder.path, 'io'))
  const ioHost = seqIo(path.join(dir, 'io'))
  out.guestIo = { image: ioImage, host: ioHost, writeRatio: ioImage.writeMiBs / ioHost.writeMiBs, readRatio: ioImage.readMiBs / ioHost.readMiBs }
  await holder.dispose()
  await pool.close()
  out.loadavgAfter = os.loadavg()
} finally {
  try {
    await unmountImage(root)
  } catch {}
  try {
    sh('umount', [xfsRoot])
  } catch {}
  fs.rmSync(dir, { recursive: true, force: true })
}
process.stdout.write(JSON.stringify(out, null, 2) + '\n')

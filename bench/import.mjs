// Image import (pool.importImage) on a loop XFS (reflink=1), against `umoci unpack` of the same image, in one run:
//   import:    a ~300 MiB, 5-layer image (files of this machine's /usr, in sorted order, 60 MiB of files a layer, gzip)
//              imported into a fresh pool, and `umoci unpack` of it onto the same file system, interleaved over
//              `rounds` rounds (each after a sync); the medians and their ratio.
//   re-import: the same image again into a pool that has it (everything reused): median of `rounds` (ms).
//   allocate:  allocate({ from: image }) p50/p99 over `count` allocates and the bytes of its own of one workspace
//              (usage().exclusiveBytes), for the image as a tree and as rootfs.ext4, on the loop XFS and on an
//              image-backed pool (btrfs in a sparse file on the host file system).
// Run by bench/run.mjs (`npm run bench -- --only import`, as root, with umoci installed).
import { execFileSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'

const MiB = 2 ** 20
const ms = (t0) => Number(process.hrtime.bigint() - t0) / 1e6
const rank = (xs, p) => {
  const s = [...xs].sort((a, b) => a - b)
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))]
}
const sh = (cmd, args, opts = {}) => execFileSync(cmd, args, { maxBuffer: 1024 * MiB, ...opts })
const sha256 = (buf) => createHash('sha256').update(buf).digest('hex')

/**
 * Paths below `/usr` (relative to /, sorted depth-first) split into `layers` groups of at most `perLayer` bytes of
 * regular files each (files over 4 MiB left out); every group lists the directories above its entries first, so that each layer tar is whole.
 */
function usrLayers(layers, perLayer) {
  const groups = Array.from({ length: layers }, () => ({ entries: [], bytes: 0, dirs: new Set() }))
  let g = 0
  const walk = (rel) => {
    let names
    try {
      names = fs.readdirSync(path.join('/', rel)).sort()
    } catch {
      return true // unreadable: left out
    }
    for (const name of names) {
      const r = `${rel}/${name}`
      const st = fs.lstatSync(path.join('/', r))
      if (st.isDirectory()) {
        if (!walk(r)) return false
        continue
      }
      if (!st.isFile() && !st.isSymbolicLink()) continue
      const size = st.isFile() ? st.size : 0
      if (size > 4 * MiB) continue // a few large binaries would make layers of a handful of files
      // A file that would take the group past its share starts the next one (the last group ends the walk).
      if (groups[g].bytes > 0 && groups[g].bytes + size > perLayer && ++g === layers) return false
      const group = groups[g]
      for (let d = path.dirname(r); d !== '.' && !group.dirs.has(d); d = path.dirname(d)) group.dirs.add(d)
      group.entries.push(r)
      group.bytes += size
    }
    return true
  }
  walk('usr')
  return groups.map((group) => ({ list: [...[...group.dirs].sort(), ...group.entries], bytes: group.bytes }))
}

/** Writes the OCI layout `dir` with image `ref`: one gzip layer per group; the total of the tars' bytes. */
function writeLayout(dir, ref, groups) {
  const blobs = path.join(dir, 'blobs', 'sha256')
  fs.mkdirSync(blobs, { recursive: true })
  const put = (buf) => {
    const hex = sha256(buf)
    fs.writeFileSync(path.join(blobs, hex), buf)
    return { digest: `sha256:${hex}`, size: buf.length }
  }
  const layers = []
  const diffIds = []
  let tarBytes = 0
  for (const [i, group] of groups.entries()) {
    const listFile = path.join(dir, `layer-${i}.list`)
    fs.writeFileSync(listFile, group.list.join('\0'))
    const tar = sh('tar', ['-C', '/', '--null', '--no-recursion', '-T', listFile, '-cf', '-'])
    fs.rmSync(listFile)
    tarBytes += tar.length
    diffIds.push(`sha256:${sha256(tar)}`)
    layers.push({ mediaType: 'application/vnd.oci.image.layer.v1.tar+gzip', ...put(sh('gzip', ['-6', '-c'], { input: tar })) })
  }
  const arch = { x64: 'amd64', arm64: 'arm64' }[process.arch] ?? process.arch
  const config = { architecture: arch, os: 'linux', config: { Cmd: ['/bin/sh'] }, rootfs: { type: 'layers', diff_ids: diffIds } }
  const manifest = { schemaVersion: 2, mediaType: 'application/vnd.oci.image.manifest.v1+json', config: { mediaType: 'application/vnd.oci.image.config.v1+json', ...put(Buffer.from(JSON.stringify(config))) }, layers }
  const m = put(Buffer.from(JSON.stringify(manifest)))
  const index = { schemaVersion: 2, manifests: [{ mediaType: 'application/vnd.oci.image.manifest.v1+json', ...m, annotations: { 'org.opencontainers.image.ref.name': ref } }] }
  fs.writeFileSync(path.join(dir, 'index.json'), JSON.stringify(index))
  fs.writeFileSync(path.join(dir, 'oci-layout'), JSON.stringify({ imageLayoutVersion: '1.0.0' }))
  return { tarBytes, blobBytes: layers.reduce((n, l) => n + l.size, 0) }
}

/** Times one call after a sync (so that no earlier round's writeback lands on it). */
async function timed(fn) {
  sh('sync', [])
  const t0 = process.hrtime.bigint()
  await fn()
  return ms(t0)
}

/** allocate({ from }) `count` times: p50, p99 and the bytes of its own of the last workspace (then all disposed). */
async function allocateFrom(pool, id, count) {
  const times = []
  const made = []
  for (let i = 0; i < count; i++) {
    const t0 = process.hrtime.bigint()
    made.push(await pool.allocate({ from: id }))
    times.push(ms(t0))
  }
  const own = await made[made.length - 1].usage()
  for (const ws of made) await ws.dispose()
  return { p50: rank(times, 50), p99: rank(times, 99), own: own.exclusiveBytes }
}

/** Imports `source` as a tree and as rootfs.ext4 into `pool` and allocates from both. */
async function allocateRows(label, pool, source, count) {
  const rows = []
  for (const format of ['tree', 'ext4']) {
    const t = await pool.importImage(source, { name: `bench-${format}`, format })
    const a = await allocateFrom(pool, t.id, count)
    rows.push({ pool: label, format, 'allocate p50 ms': a.p50.toFixed(2), 'allocate p99 ms': a.p99.toFixed(2), 'bytes of its own': a.own })
  }
  return rows
}

export async function benchImport({ vmspace, dir, src, rounds = 3, count = 50, layers = 5, perLayer = 60 * MiB }) {
  try {
    sh('umoci', ['--version'])
  } catch {
    console.log('\nimage import: skipped (needs umoci: apt-get install umoci)')
    return
  }
  const layout = path.join(src, 'import-image')
  const groups = usrLayers(layers, perLayer)
  const sizes = writeLayout(layout, 'bench', groups)
  const source = `oci:${layout}:bench`

  const importMs = []
  const umociMs = []
  for (let r = 0; r < rounds; r++) {
    const root = path.join(dir, `pool-${r}`)
    const pool = await vmspace.openPool(root)
    importMs.push(await timed(() => pool.importImage(source)))
    await pool.close()
    const bundle = path.join(dir, `umoci-${r}`)
    umociMs.push(await timed(() => sh('umoci', ['unpack', '--image', `${layout}:bench`, bundle])))
    fs.rmSync(bundle, { recursive: true, force: true })
    if (r < rounds - 1) fs.rmSync(root, { recursive: true, force: true })
  }
  // The last round's pool has the image: every import of it again reuses all of it.
  const pool = await vmspace.openPool(path.join(dir, `pool-${rounds - 1}`))
  const again = []
  for (let r = 0; r < Math.max(rounds, 5); r++) again.push(await timed(() => pool.importImage(source)))
  const rows = await allocateRows('loop XFS', pool, source, count)
  await pool.close()

  const imageRoot = path.join(src, 'import-image-pool')
  const imageFile = `${imageRoot}.img`
  try {
    const imagePool = await vmspace.openPool(imageRoot, { image: { path: imageFile, size: 4 * 2 ** 30 } })
    rows.push(...(await allocateRows('image-backed (btrfs)', imagePool, source, count)))
    await imagePool.close()
  } catch (e) {
    console.error(`image-backed pool: ${e.message}`)
  } finally {
    await vmspace.unmountImage(imageRoot).catch(() => {})
    fs.rmSync(imageFile, { force: true })
    fs.rmSync(`${imageFile}.lock`, { force: true })
  }
  fs.rmSync(layout, { recursive: true, force: true })

  const [imp, umo] = [rank(importMs, 50), rank(umociMs, 50)]
  console.log(`\nimage import: ${layers} layers of /usr, ${(sizes.tarBytes / MiB).toFixed(0)} MiB of tar (${(sizes.blobBytes / MiB).toFixed(0)} MiB gzip), into a loop XFS (${dir}); medians of ${rounds} interleaved rounds`)
  console.table([{
    'importImage ms': imp.toFixed(0),
    'umoci unpack ms': umo.toFixed(0),
    'import / umoci': (imp / umo).toFixed(2),
    're-import ms (all reused)': rank(again, 50).toFixed(1),
  }])
  console.table(rows)
}

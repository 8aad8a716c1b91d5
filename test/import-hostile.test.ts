/**
 * importImage against hostile images (indexes that fan out, archives with bad PAX records, zstd windows, layer counts,
 * JSON depth, a gzip bomb against the pool's floor) and a source form the CLI must take. Each test states the
 * behaviour that must hold; a canary outside the pool keeps its hash throughout.
 */
import { createHash } from 'node:crypto'
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterAll, describe, expect, test } from 'vitest'
import { openPool, type VmspaceError } from '../lib/index.js'
import { freshDir, mounts, needs, repoRoot, stagingEntries } from './helpers.js'
import { hostArchitecture, makeTar, MEDIA, ociToolsMissing, rawLayerImage, setIndexRef, tarEntry, toArchive, writeBlob, type Descriptor } from './oci-helpers.js'

const missing = ociToolsMissing()

function errorOf(p: Promise<unknown>): Promise<VmspaceError> {
  return p.then(
    () => {
      throw new Error('expected a rejection')
    },
    (e: VmspaceError) => e,
  )
}

const canaryDir = fs.mkdtempSync(path.join(mounts.scratch, 'vmspace-canary-'))
const canary = path.join(canaryDir, 'passwd')
fs.writeFileSync(canary, 'root:x:0:0:canary\n')
const hash = () => createHash('sha256').update(fs.readFileSync(canary)).digest('hex')
const canaryBefore = hash()

afterAll(() => {
  expect(hash()).toBe(canaryBefore)
  expect(fs.readdirSync(canaryDir)).toEqual(['passwd'])
})

function nothingStaged(root: string) {
  const t = path.join(root, '.vmspace', 'templates')
  expect(stagingEntries(root)).toEqual([])
  expect(fs.existsSync(path.join(t, 'staging')) ? fs.readdirSync(path.join(t, 'staging')) : []).toEqual([])
}

describe.skipIf(!!missing)(`review: hostile images ${needs('umoci, skopeo, root', missing)}`, () => {
  test('an index whose entries fan out to one nested index is read once per document: no hang', async () => {
    const dir = freshDir(mounts.scratch, 'fan')
    // A manifest for a platform the host is not: every candidate is read, none fits.
    const raw = rawLayerImage(dir, [makeTar([{ name: 'f', data: 'x' }])], { platform: { os: 'linux', architecture: 'nosuch' } })
    let inner: Descriptor = { ...raw.manifest, platform: undefined }
    delete inner.platform
    for (let level = 0; level < 4; level++) {
      const doc = { schemaVersion: 2, mediaType: MEDIA.index, manifests: Array.from({ length: 60 }, () => inner) }
      inner = writeBlob(dir, MEDIA.index, JSON.stringify(doc))
    }
    fs.writeFileSync(path.join(dir, 'index.json'), JSON.stringify({ schemaVersion: 2, manifests: [] }))
    setIndexRef(dir, 'fan', inner)
    const pool = await openPool(freshDir())
    const e = await errorOf(pool.importImage(`oci:${dir}:fan`))
    expect(e.code).toBe('ERR_OCI_PLATFORM')
    nothingStaged(pool.root)
    await pool.close()
  }, 60_000)

  test('an oci-archive whose PAX size is negative is ERR_OCI_INVALID naming the PAX size', async () => {
    const dir = freshDir(mounts.scratch, 'pax')
    // -1536 takes the reader back to the PAX header itself: a loop until the member count runs out.
    const tar = Buffer.concat([tarEntry({ name: 'oci-layout', data: '', pax: { size: '-1536' } }), Buffer.alloc(1024)])
    const file = path.join(dir, 'a.tar')
    fs.writeFileSync(file, tar)
    const pool = await openPool(freshDir())
    const e = await errorOf(pool.importImage(`oci-archive:${file}`, { name: 'x' }))
    expect(e.code).toBe('ERR_OCI_INVALID')
    expect(e.message).toMatch(/PAX size/)
    await pool.close()
  }, 60_000)
})

/** A zstd frame (RFC 8878) of raw blocks holding `data`, with the window descriptor byte `windowByte`. */
function zstdRawFrame(data: Buffer, windowByte: number): Buffer {
  const parts: Buffer[] = [Buffer.from([0x28, 0xb5, 0x2f, 0xfd, 0x00, windowByte])]
  for (let at = 0; ; at += 65536) {
    const chunk = data.subarray(at, at + 65536)
    const last = at + 65536 >= data.length ? 1 : 0
    const h = (chunk.length << 3) | last
    parts.push(Buffer.from([h & 0xff, (h >> 8) & 0xff, (h >> 16) & 0xff]), chunk)
    if (last) return Buffer.concat(parts)
  }
}

describe.skipIf(!!missing)(`review: hostile zstd layers ${needs('umoci, skopeo, root', missing)}`, () => {
  test('a zstd frame asking for a window over 128 MiB is ERR_OCI_INVALID; one within it imports', async () => {
    const tar = makeTar([{ name: 'f', data: Buffer.alloc(300_000, 1) }])
    const image = (windowByte: number) => {
      const dir = freshDir(mounts.scratch, 'zstd')
      // Two frames: the second one's window is the one checked.
      const blob = Buffer.concat([zstdRawFrame(tar.subarray(0, 70_000), 17 << 3), zstdRawFrame(tar.subarray(70_000), windowByte)])
      const layer = writeBlob(dir, MEDIA.layerZstd, blob)
      const platform = { os: 'linux', architecture: hostArchitecture() }
      const config = writeBlob(dir, MEDIA.config, JSON.stringify({ ...platform, config: {}, rootfs: { type: 'layers', diff_ids: [`sha256:${createHash('sha256').update(tar).digest('hex')}`] } }))
      const manifest = writeBlob(dir, MEDIA.manifest, JSON.stringify({ schemaVersion: 2, mediaType: MEDIA.manifest, config, layers: [layer] }))
      setIndexRef(dir, 'z', manifest)
      return dir
    }
    const pool = await openPool(freshDir(mounts.xfs ?? mounts.scratch))
    // Window 2^30 + 7/8 of it: fzstd allocated and copied all of it per block (Node 20's decoder).
    const e = await errorOf(pool.importImage(image((20 << 3) | 7), { name: 'big' }))
    expect(e.code).toBe('ERR_OCI_INVALID')
    expect(e.message).toMatch(/window/)
    nothingStaged(pool.root)
    expect(await pool.templates()).toEqual([])
    const t = await pool.importImage(image(17 << 3), { name: 'ok' }) // 128 MiB
    expect(fs.readFileSync(path.join(t.path, 'f'))).toEqual(Buffer.alloc(300_000, 1))
    await pool.close()
  }, 60_000)
})

describe.skipIf(!!missing)(`review: images of many layers ${needs('umoci, skopeo, root', missing)}`, () => {
  test('an image of more than 128 layers is ERR_OCI_INVALID before a layer is read; 128 import', async () => {
    const pool = await openPool(freshDir(mounts.xfs ?? mounts.scratch))
    // One small layer listed many times: each is a template, a clone of the tree below.
    const tars = (n: number) => Array.from({ length: n }, (_, i) => makeTar([{ name: 'f', data: String(i % 2) }]))
    const many = rawLayerImage(freshDir(mounts.scratch, 'many'), tars(129))
    const e = await errorOf(pool.importImage(many.layoutDir, { name: 'many' }))
    expect(e.code).toBe('ERR_OCI_INVALID')
    expect(e.message).toMatch(/129 layers, more than 128/)
    expect(await pool.templates()).toEqual([])
    nothingStaged(pool.root)
    const ok = rawLayerImage(freshDir(mounts.scratch, 'many'), tars(128))
    expect((await pool.importImage(ok.layoutDir, { name: 'ok' })).image.layers).toHaveLength(128)
    await pool.close()
  }, 120_000)
})

// The applier checks the pool's minFreeBytes as it writes (only allocate did).
describe.skipIf(!!missing || !mounts.small)(`review: minFreeBytes ${needs('umoci, skopeo, root, the small ext4', missing)}`, () => {
  test('a gzip bomb of a layer stops at the pool\'s minFreeBytes: ENOSPC, nothing left, the floor kept', async () => {
    const root = freshDir(mounts.small!)
    const floor = 32 << 20
    const pool = await openPool(root, { minFreeBytes: floor })
    const free = () => {
      const s = fs.statfsSync(root)
      return s.bavail * s.bsize
    }
    // 40 MiB of one byte value: a 40 KB blob; the small ext4 has about 53 MiB free.
    const bomb = rawLayerImage(freshDir(mounts.scratch, 'bomb'), [makeTar([{ name: 'f', data: Buffer.alloc(40 << 20, 1) }])], { compression: 'gzip' })
    const e = await errorOf(pool.importImage(bomb.layoutDir, { name: 'bomb' }))
    expect(e.code).toBe('ENOSPC')
    expect(await pool.templates()).toEqual([])
    nothingStaged(root)
    expect(free()).toBeGreaterThanOrEqual(floor)
    await pool.close()
  }, 60_000)
})

describe.skipIf(!!missing)(`review: the command's SOURCE ${needs('umoci, skopeo, root', missing)}`, () => {
  test('vmspace image import takes docker-archive:FILE:REF with a colon in the ref (the path ends at the first colon)', async () => {
    const dir = freshDir(mounts.scratch, 'cli')
    rawLayerImage(path.join(dir, 'layout'), [makeTar([{ name: 'f', data: 'x' }])], { ref: 'v1' })
    const archive = toArchive(path.join(dir, 'layout'), 'v1', 'docker-archive') // ref localhost/v1:latest
    const root = path.join(dir, 'pool')
    const r = spawnSync(process.execPath, [path.join(repoRoot, 'dist', 'cli', 'vmspace.js'), 'image', 'import', root, `docker-archive:${archive.file}:${archive.ref}`, '--name', 'v1'], { encoding: 'utf8' })
    expect(r.status, r.stderr).toBe(0)
    const pool = await openPool(root)
    expect((await pool.images()).map((t) => [t.name, t.image.ref])).toEqual([['v1', 'localhost/v1:latest']])
    await pool.close()
  }, 60_000)
})

describe.skipIf(!!missing)(`review: deep JSON ${needs('umoci, skopeo, root', missing)}`, () => {
  test('a config nesting deeper than 64 is ERR_OCI_INVALID before a layer is read; 64 imports', async () => {
    const pool = await openPool(freshDir(mounts.xfs ?? mounts.scratch))
    const image = (depth: number) => {
      const dir = freshDir(mounts.scratch, 'deep')
      const tar = makeTar([{ name: 'f', data: 'x' }])
      const layer = writeBlob(dir, MEDIA.layer, tar)
      const platform = { os: 'linux', architecture: hostArchitecture() }
      // The config object is depth 1, Labels 2: the array takes the rest.
      const nested = '['.repeat(depth - 2) + ']'.repeat(depth - 2)
      const text = JSON.stringify({ ...platform, config: { Labels: '@' }, rootfs: { type: 'layers', diff_ids: [`sha256:${createHash('sha256').update(tar).digest('hex')}`] } }).replace('"@"', nested)
      const config = writeBlob(dir, MEDIA.config, text)
      setIndexRef(dir, 'd', writeBlob(dir, MEDIA.manifest, JSON.stringify({ schemaVersion: 2, mediaType: MEDIA.manifest, config, layers: [layer] })))
      return dir
    }
    const e = await errorOf(pool.importImage(image(10_000), { name: 'deep' }))
    expect(e.code).toBe('ERR_OCI_INVALID')
    expect(e.message).toMatch(/nests deeper than 64/)
    expect(await pool.templates()).toEqual([])
    nothingStaged(pool.root)
    expect((await errorOf(pool.importImage(image(65), { name: 'deep' }))).code).toBe('ERR_OCI_INVALID')
    await pool.importImage(image(64), { name: 'ok' })
    await pool.close()
  }, 60_000)
})

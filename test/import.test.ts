/**
 * Pool.importImage, images and removeImage: OCI images built with umoci from local files (test/oci-helpers.ts),
 * imported into pools on the loop-mounted XFS and btrfs and compared with `umoci unpack` of the same image; the
 * three source formats; layer reuse; corrupt, truncated and missing blobs; refs and platforms; abort, SIGKILL and
 * four concurrent importers; removeImage and prune against shared layers; format 'ext4'; non-root refusal.
 */
import { spawnSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterAll, beforeAll, describe, expect, test } from 'vitest'
import { openPool, type Pool, type Template, type VmspaceError } from '../lib/index.js'
import { chainIds } from '../lib/image-import.js'
import { Child, fixtures, freshDir, mounts, needs, stagingEntries, unprivilegedChildren } from './helpers.js'
import {
  blobPath,
  buildImage,
  compareTrees,
  hostArchitecture,
  makeTar,
  MEDIA,
  ociToolsMissing,
  rawLayerImage,
  readManifest,
  setIndexRef,
  toArchive,
  umociUnpack,
  writeBlob,
  type LayerSpec,
} from './oci-helpers.js'

const missing = ociToolsMissing()
const child = path.join(fixtures, 'import-child.cjs')

/** Three layers with every entry type, owners, set-id bits, a capability, xattrs, holes, whiteouts and links across layers. */
const EVERY: LayerSpec[] = [
  [
    { dir: 'etc' }, { dir: 'bin' }, { dir: 'opt', uid: 1000, gid: 1000, mode: 0o750 }, { dir: 'gone-dir' },
    { file: 'etc/hostname', data: 'image\n' }, { file: 'etc/removed', data: 'whited out above' },
    { file: 'gone-dir/a', data: 'a' }, { file: 'bin/tool', data: '#!/bin/sh\necho tool\n', mode: 0o755 },
    { file: 'bin/su', data: 'setuid', mode: 0o4755 }, { file: 'bin/sg', data: 'setgid', mode: 0o2755, gid: 50 },
    { file: 'bin/ping', data: 'ping', mode: 0o755 }, { capability: 'bin/ping', caps: 'cap_net_raw+ep' },
    { file: 'opt/owned', data: 'owned', uid: 1000, gid: 1001, xattrs: { 'user.note': 'kept' } },
    { file: 'opt/sparse', sparse: { size: 8 << 20, offset: 4 << 20, data: 'middle' } },
    { symlink: 'bin/sh', target: 'tool' }, { symlink: 'etc/escape', target: '../../../../etc/passwd' },
    { link: 'bin/tool-again', target: 'bin/tool' },
    { device: 'null', kind: 'char', major: 1, minor: 3, mode: 0o666 }, { device: 'loop9', kind: 'block', major: 7, minor: 9, mode: 0o660 },
    { fifo: 'fifo', mode: 0o600 },
  ],
  [
    { remove: 'etc/removed' }, { remove: 'gone-dir' }, { file: 'gone-dir', data: 'a file where a directory was' },
    { link: 'etc/hostname-link', target: 'etc/hostname' }, { file: 'etc/new', data: 'second layer', mtime: 1234567890 },
  ],
  [{ remove: 'bin/sh' }, { dir: 'bin/sh' }, { file: 'bin/sh/inside', data: 'a directory where a symlink was' }, { file: 'top', data: 'top layer file' }],
]

const CONFIG = { Env: ['PATH=/usr/bin:/bin', 'A=1'], Cmd: ['/bin/tool'], WorkingDir: '/opt', User: '1000:1000', Labels: { k: 'v' } }

/** Image fixtures, built once per file. */
let work: string
let layout: string
let archives: Record<'oci-archive' | 'docker-archive', { file: string; ref: string }>

function errorOf(p: Promise<unknown>): Promise<VmspaceError> {
  return p.then(
    () => {
      throw new Error('expected a rejection')
    },
    (e: VmspaceError) => e,
  )
}

/** The pool's templates by kind. */
async function kinds(pool: Pool): Promise<{ layers: Template[]; images: Template[]; other: Template[] }> {
  const all = await pool.templates()
  return { layers: all.filter((t) => t.layer), images: all.filter((t) => t.image), other: all.filter((t) => !t.layer && !t.image) }
}

/** What a failed import must leave: no template, no staging entry, no layer link. */
async function expectNothingLeft(pool: Pool): Promise<void> {
  expect(await pool.templates()).toEqual([])
  expect(builds(pool.root)).toEqual({ staging: [], templateStaging: [], templates: [], layers: [] })
}

/** What a pool's root holds of builds and templates, read from the directories (no pool opened). */
function builds(root: string) {
  const t = path.join(root, '.vmspace', 'templates')
  const ls = (d: string) => (fs.existsSync(d) ? fs.readdirSync(d) : [])
  return {
    staging: stagingEntries(root),
    templateStaging: ls(path.join(t, 'staging')),
    templates: ls(t).filter((n) => /^[0-9a-f]{32}$/.test(n)),
    layers: ls(path.join(t, 'layers')),
  }
}

/** A workspace from template `id` compared with umoci's unpack of `ref`: every difference. */
async function againstUmoci(pool: Pool, id: string, ref: string, layoutDir = layout) {
  const ws = await pool.allocate({ from: id })
  try {
    const ref0 = umociUnpack(layoutDir, ref, path.join(freshDir(mounts.scratch, 'umoci'), 'bundle'))
    return compareTrees(ws.path, ref0, { root: false })
  } finally {
    await ws.dispose()
  }
}

beforeAll(() => {
  if (missing) return
  work = fs.mkdtempSync(path.join(mounts.scratch, 'vmspace-oci-'))
  layout = path.join(work, 'layout')
  buildImage(layout, EVERY, { ref: 'every', config: CONFIG })
  buildImage(layout, [[{ dir: 'usr' }, { file: 'usr/base', data: 'base' }], [{ file: 'usr/base2', data: 'base 2' }]], { ref: 'base' })
  buildImage(layout, [[{ file: 'usr/app', data: 'app' }]], { ref: 'app', from: 'base' })
  buildImage(layout, [[{ file: 'usr/other', data: 'other' }]], { ref: 'other', from: 'base' })
  archives = { 'oci-archive': toArchive(layout, 'every', 'oci-archive'), 'docker-archive': toArchive(layout, 'every', 'docker-archive') }
})

afterAll(() => {
  if (work) fs.rmSync(work, { recursive: true, force: true })
})

describe.skipIf(!!missing)(`importImage: options and sources ${needs('umoci, skopeo, root', missing)}`, () => {
  test('options are strict and checked before anything is read', async () => {
    const pool = await openPool(freshDir())
    await expect(pool.importImage(42 as unknown as string)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_TYPE' })
    await expect(pool.importImage(layout, { reff: 'x' } as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE', message: /options\.reff/ })
    await expect(pool.importImage(layout, { platform: 'linux' })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
    await expect(pool.importImage(layout, { format: 'qcow2' as 'ext4' })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
    await expect(pool.importImage(layout, { name: 'a/b' })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
    await expect(pool.importImage(layout, { ext4: { headroomBytes: 1 } })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
    await expect(pool.importImage(layout, { format: 'ext4', ext4: { headroomBytes: -1 } })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
    await pool.close()
  })

  test('a directory without oci-layout, a file that is no tar, and a missing path are ERR_OCI_INVALID', async () => {
    const pool = await openPool(freshDir())
    const dir = freshDir(mounts.scratch, 'notoci')
    fs.writeFileSync(path.join(dir, 'file'), 'not a tar at all'.repeat(100))
    for (const source of [dir, path.join(dir, 'file'), path.join(dir, 'absent'), `oci-archive:${dir}`, `oci:${path.join(dir, 'file')}`])
      expect((await errorOf(pool.importImage(source))).code, source).toBe('ERR_OCI_INVALID')
    await expectNothingLeft(pool)
    await pool.close()
  })

  test('a ref that is not there is ERR_OCI_REF listing the refs; several refs and none given too', async () => {
    const pool = await openPool(freshDir())
    const e = await errorOf(pool.importImage(`oci:${layout}:nope`))
    expect(e.code).toBe('ERR_OCI_REF')
    expect(e.message).toMatch(/every/)
    expect(e.message).toMatch(/base/)
    expect((await errorOf(pool.importImage(layout))).code).toBe('ERR_OCI_REF')
    expect((await errorOf(pool.importImage(`oci:${layout}:every`, { ref: 'base' }))).code).toBe('ERR_OCI_REF')
    await expectNothingLeft(pool)
    await pool.close()
  })

  test('a manifest for another platform only is ERR_OCI_PLATFORM naming the one there', async () => {
    const pool = await openPool(freshDir())
    const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), [makeTar([{ name: 'f', data: 'x' }])], { platform: { os: 'linux', architecture: 's390x' } })
    const e = await errorOf(pool.importImage(raw.layoutDir))
    expect(e.code).toBe('ERR_OCI_PLATFORM')
    expect(e.message).toMatch(/linux\/s390x/)
    await expectNothingLeft(pool)
    await pool.close()
  })

  test('a layer of a media type not supported is ERR_OCI_MEDIA_TYPE', async () => {
    const pool = await openPool(freshDir())
    const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), [makeTar([{ name: 'f', data: 'x' }])], { mediaTypes: ['application/vnd.oci.image.layer.v1.tar+bzip2'] })
    expect((await errorOf(pool.importImage(raw.layoutDir))).code).toBe('ERR_OCI_MEDIA_TYPE')
    await expectNothingLeft(pool)
    await pool.close()
  })

  test('a manifest digest that is not hex, or a size that is not its blob\'s, is refused before any layer is read', async () => {
    const pool = await openPool(freshDir())
    const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), [makeTar([{ name: 'f', data: 'x' }])])
    const indexFile = path.join(raw.layoutDir, 'index.json')
    const index = JSON.parse(fs.readFileSync(indexFile, 'utf8'))
    index.manifests[0].digest = 'sha256:../../../etc/passwd'
    fs.writeFileSync(indexFile, JSON.stringify(index))
    expect((await errorOf(pool.importImage(raw.layoutDir))).code).toBe('ERR_OCI_INVALID')
    index.manifests[0].digest = raw.manifest.digest
    index.manifests[0].size = raw.manifest.size + 1
    fs.writeFileSync(indexFile, JSON.stringify(index))
    expect((await errorOf(pool.importImage(raw.layoutDir))).code).toBe('ERR_OCI_DIGEST_MISMATCH')
    await expectNothingLeft(pool)
    await pool.close()
  })

  test('plain, gzip and zstd layers import alike; onProgress reaches the blobs\' total', async () => {
    const pool = await openPool(freshDir())
    const tars = ['none', 'gzip', 'zstd'].map((c) => makeTar([{ name: c, data: `${c} `.repeat(5000) }]))
    const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), tars, { compression: ['none', 'gzip', 'zstd'] })
    const seen: { bytes: number; totalBytes: number }[] = []
    const t = await pool.importImage(raw.layoutDir, { onProgress: (p) => void seen.push(p) })
    const total = raw.layers.reduce((n, l) => n + l.size, 0)
    expect(seen.at(-1)).toEqual({ bytes: total, totalBytes: total })
    expect(t.image.layers.map((l) => [l.digest, l.bytes])).toEqual(raw.layers.map((l) => [l.digest, l.size]))
    const ws = await pool.allocate({ from: t.id })
    for (const c of ['none', 'gzip', 'zstd']) expect(fs.readFileSync(path.join(ws.path, c), 'utf8')).toBe(`${c} `.repeat(5000))
    await ws.dispose()
    await pool.close()
  })

  test('an onProgress that throws fails the import with its error; an aborted signal fails before anything is read', async () => {
    const pool = await openPool(freshDir())
    const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), [makeTar([{ name: 'f', data: 'x' }])])
    const thrown = new Error('from onProgress')
    await expect(pool.importImage(raw.layoutDir, { onProgress: () => { throw thrown } })).rejects.toBe(thrown)
    await expectNothingLeft(pool)
    await expect(pool.importImage(raw.layoutDir, { signal: AbortSignal.abort() })).rejects.toMatchObject({ name: 'AbortError' })
    await expectNothingLeft(pool)
    await pool.close()
  })

  test('hostile layers reach nothing outside: .. is ERR_LAYER_UNSAFE, a lower layer\'s symlink to / leads back to the root', async () => {
    const pool = await openPool(freshDir())
    const outside = freshDir(mounts.scratch, 'canary')
    const canary = path.join(outside, 'canary')
    fs.writeFileSync(canary, 'canary')
    const up = path.relative('/', canary)
    const dotdot = rawLayerImage(freshDir(mounts.scratch, 'raw'), [makeTar([{ name: `../../../../../../../../${up}`, data: 'owned' }])])
    const e = await errorOf(pool.importImage(dotdot.layoutDir))
    expect(e.code).toBe('ERR_LAYER_UNSAFE')
    await expectNothingLeft(pool)
    const through = rawLayerImage(freshDir(mounts.scratch, 'raw'), [
      makeTar([{ name: 'evil', type: 'symlink', linkname: '/' }]),
      makeTar([{ name: `evil/${up}`, data: 'owned' }]),
    ])
    const t = await pool.importImage(through.layoutDir)
    expect(fs.readFileSync(canary, 'utf8')).toBe('canary')
    expect(fs.readFileSync(path.join(t.path, up), 'utf8')).toBe('owned')
    await pool.close()
  })

  test('close() during an import waits for it to publish', async () => {
    const root = freshDir()
    const pool = await openPool(root)
    const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), [makeTar([{ name: 'big', data: Buffer.alloc(8 << 20, 3) }])])
    const importing = pool.importImage(raw.layoutDir, { name: 'img' })
    await Promise.all([importing, pool.close()])
    const again = await openPool(root)
    expect((await again.template('img')).id).toBe((await importing).id)
    expect(builds(root)).toMatchObject({ staging: [], templateStaging: [] })
    await again.close()
  })

  test('an image index is searched for the platform, nested indexes too', async () => {
    const pool = await openPool(freshDir())
    const dir = freshDir(mounts.scratch, 'multi')
    const host = rawLayerImage(dir, [makeTar([{ name: 'which', data: 'host' }])], { ref: 'host' })
    const s390x = rawLayerImage(dir, [makeTar([{ name: 'which', data: 's390x' }])], { ref: 's390x', platform: { os: 'linux', architecture: 's390x' } })
    const nested = writeBlob(dir, MEDIA.index, JSON.stringify({ schemaVersion: 2, mediaType: MEDIA.index, manifests: [host.manifest, s390x.manifest] }))
    setIndexRef(dir, 'multi', nested)
    for (const [platform, want] of [[undefined, 'host'], ['linux/s390x', 's390x']] as const) {
      const t = await pool.importImage(`oci:${dir}:multi`, { platform, name: want })
      const ws = await pool.allocate({ from: t.id })
      expect(fs.readFileSync(path.join(ws.path, 'which'), 'utf8')).toBe(want)
      await ws.dispose()
    }
    const e = await errorOf(pool.importImage(`oci:${dir}:multi`, { platform: 'linux/mips64le', name: 'none' }))
    expect(e.code).toBe('ERR_OCI_PLATFORM')
    expect(e.message).toMatch(/linux\/s390x/)
    await pool.close()
  })

  test('a docker-archive whose manifest.json or a link in it leads out of the archive is ERR_OCI_INVALID', async () => {
    const pool = await openPool(freshDir())
    const dir = freshDir(mounts.scratch, 'docker')
    const config = JSON.stringify({ os: 'linux', architecture: hostArchitecture(), rootfs: { type: 'layers', diff_ids: ['sha256:' + 'a'.repeat(64)] } })
    for (const [layer, extra] of [['../../etc/passwd', []], ['l.tar', [{ name: 'l.tar', type: 'symlink', linkname: '/etc/passwd' }]]] as const) {
      const manifest = JSON.stringify([{ Config: 'c.json', RepoTags: ['x:1'], Layers: [layer] }])
      const file = path.join(dir, `${extra.length}.tar`)
      fs.writeFileSync(file, makeTar([{ name: 'manifest.json', data: manifest }, { name: 'c.json', data: config }, ...extra]))
      expect((await errorOf(pool.importImage(`docker-archive:${file}`))).code, layer).toBe('ERR_OCI_INVALID')
    }
    await expectNothingLeft(pool)
    await pool.close()
  })

  test('an archive\'s members with PAX and GNU long names, and a symlink member, are found', async () => {
    const pool = await openPool(freshDir())
    const dir = freshDir(mounts.scratch, 'docker')
    const layers = [makeTar([{ name: 'one', data: '1' }]), makeTar([{ name: 'two', data: '2' }])]
    const config = JSON.stringify({ os: 'linux', architecture: hostArchitecture(), rootfs: { type: 'layers', diff_ids: layers.map((t) => 'sha256:' + createHash('sha256').update(t).digest('hex')) } })
    const long = 'd'.repeat(120)
    const manifest = JSON.stringify([{ Config: `${long}/config.json`, RepoTags: ['long:1'], Layers: [`${long}/pax/layer.tar`, 'link.tar'] }])
    const file = path.join(dir, 'long.tar')
    fs.writeFileSync(file, makeTar([
      { name: 'manifest.json', data: manifest },
      { name: `${long}/config.json`, data: config, gnu: true },
      { name: `${long}/pax/layer.tar`, data: layers[0] },
      { name: `${long}/gnu/layer.tar`, data: layers[1], gnu: true },
      { name: 'link.tar', type: 'symlink', linkname: `${long}/gnu/layer.tar` },
    ]))
    const t = await pool.importImage(file)
    expect([t.name, t.image.ref]).toEqual(['long-1', 'long:1'])
    const ws = await pool.allocate({ from: t.id })
    expect(['one', 'two'].map((n) => fs.readFileSync(path.join(ws.path, n), 'utf8'))).toEqual(['1', '2'])
    await ws.dispose()
    await pool.close()
  })

  test('chainIDs follow image-spec config.md', () => {
    const d = ['sha256:' + 'a'.repeat(64), 'sha256:' + 'b'.repeat(64)]
    const [c0, c1] = chainIds(d)
    expect(c0).toBe(d[0])
    expect(c1).toBe('sha256:' + createHash('sha256').update(`${d[0]} ${d[1]}`).digest('hex'))
  })
})

const pools = [
  { label: 'XFS', dir: mounts.xfs, why: mounts.missing.xfs },
  { label: 'btrfs', dir: mounts.btrfs, why: mounts.missing.btrfs },
  { label: `${mounts.scratchFsType} (copies)`, dir: mounts.scratch, why: undefined },
]

describe.each(pools)('importImage on $label', ({ label, dir, why }) => {
  const skip = !!missing || !dir
  const fresh = () => openPool(freshDir(dir!, 'import'))

  test.skipIf(skip)(`the image's tree is umoci unpack's: every entry type, owners, modes, xattrs, capabilities, mtimes, hard links ${needs(label, !dir && why)} ${needs('umoci, skopeo, root', missing)}`, async () => {
    const pool = await fresh()
    const t = await pool.importImage(`oci:${layout}:every`)
    expect(t.name).toBe('every')
    expect(t.image.format).toBe('tree')
    expect(t.image.config).toMatchObject({ Env: CONFIG.Env, Cmd: CONFIG.Cmd, WorkingDir: '/opt', User: '1000:1000', Labels: { k: 'v' } })
    expect(t.image.layers.map((l) => l.reused)).toEqual([false, false, false])
    expect(t.image.layers.map((l) => l.chainId)).toEqual(chainIds(t.image.layers.map((l) => l.diffId)))
    expect(await againstUmoci(pool, t.id, 'every')).toEqual([])
    const { layers, images } = await kinds(pool)
    expect(layers.map((l) => l.layer!.chainId).sort()).toEqual(t.image.layers.map((l) => l.chainId).sort())
    expect(images.map((i) => i.id)).toEqual([t.id])
    expect((await pool.images()).map((i) => i.id)).toEqual([t.id])
    await pool.close()
  })

  test.skipIf(skip)("each whiteout case gives umoci unpack's tree: .wh. of a file and of a directory, an opaque directory with the same layer's entries before and after its marker, a file and a directory replacing each other", async () => {
    const pool = await fresh()
    const lower = makeTar([
      { name: 'a', type: 'dir' }, { name: 'a/x', data: 'x' }, { name: 'a/y', data: 'y' },
      { name: 'b', type: 'dir', mode: 0o750 }, { name: 'b/z', data: 'z' }, { name: 'b/sub', type: 'dir' }, { name: 'b/sub/deep', data: 'deep' },
      { name: 'c', data: 'c' }, { name: 'd', type: 'dir' }, { name: 'd/w', data: 'w' }, { name: 'e', data: 'e' },
      { name: 'f', type: 'dir' }, { name: 'f/1', data: '1' }, { name: 'f/2', type: 'dir' },
    ])
    const upper = makeTar([
      { name: 'a/.wh.x' },
      { name: 'b/early', data: 'same layer, before the marker' },
      { name: 'b/.wh..wh..opq' },
      { name: 'b/new', data: 'same layer, after the marker' },
      { name: 'c', type: 'dir' }, { name: 'c/inner', data: 'inner' },
      { name: 'd', data: 'file now' },
      { name: '.wh.e' },
      { name: '.wh.f' },
    ])
    const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), [lower, upper], { compression: ['gzip', 'none'] })
    const t = await pool.importImage(raw.layoutDir, { name: 'whiteouts' })
    expect(await againstUmoci(pool, t.id, raw.ref, raw.layoutDir)).toEqual([])
    expect(fs.readdirSync(t.path).sort()).toEqual(['a', 'b', 'c', 'd'])
    expect(fs.readdirSync(path.join(t.path, 'b')).sort()).toEqual(['early', 'new'])
    await pool.close()
  })

  test.skipIf(skip)('the three source formats give the same tree', async () => {
    const pool = await fresh()
    const oci = await pool.importImage(`oci:${layout}:every`, { name: 'from-oci' })
    const { 'oci-archive': ociArchive, 'docker-archive': dockerArchive } = archives
    const a = await pool.importImage(ociArchive.file, { ref: ociArchive.ref, name: 'from-oci-archive' })
    const d = await pool.importImage(`docker-archive:${dockerArchive.file}`, { name: 'from-docker-archive' })
    expect(a.image.layers.every((l) => l.reused)).toBe(true)
    expect(d.image.layers.map((l) => l.chainId)).toEqual(oci.image.layers.map((l) => l.chainId))
    for (const t of [a, d]) expect(await againstUmoci(pool, t.id, 'every')).toEqual([])
    await pool.close()
  })

  test.skipIf(skip)('two images on one base share its layer templates; re-import reads no blob', async () => {
    const pool = await fresh()
    const app = await pool.importImage(`oci:${layout}:app`)
    const other = await pool.importImage(`oci:${layout}:other`)
    expect(app.image.layers.map((l) => l.reused)).toEqual([false, false, false])
    expect(other.image.layers.map((l) => l.reused)).toEqual([true, true, false])
    expect(other.image.layers.slice(0, 2).map((l) => l.bytes)).toEqual([0, 0])
    const { layers } = await kinds(pool)
    expect(layers).toHaveLength(4)
    expect(new Set(layers.map((l) => l.layer!.chainId)).size).toBe(4)
    // Every layer blob gone: a re-import reads only the index, the manifest and the config.
    for (const l of readManifest(layout, 'app').manifest.layers) fs.renameSync(blobPath(layout, l.digest), blobPath(layout, l.digest) + '.away')
    try {
      const again = await pool.importImage(`oci:${layout}:app`)
      expect(again.id).toBe(app.id)
      expect(again.image.layers.map((l) => [l.reused, l.bytes])).toEqual([[true, 0], [true, 0], [true, 0]])
    } finally {
      for (const l of readManifest(layout, 'app').manifest.layers) fs.renameSync(blobPath(layout, l.digest) + '.away', blobPath(layout, l.digest))
    }
    expect(await againstUmoci(pool, other.id, 'other')).toEqual([])
    await pool.close()
  })

  test.skipIf(skip)('another image under a taken name is EEXIST unless replace', async () => {
    const pool = await fresh()
    await pool.importImage(`oci:${layout}:base`, { name: 'img' })
    const e = await errorOf(pool.importImage(`oci:${layout}:app`, { name: 'img' }))
    expect(e.code).toBe('EEXIST')
    const r = await pool.importImage(`oci:${layout}:app`, { name: 'img', replace: true })
    expect((await pool.template('img')).id).toBe(r.id)
    await pool.close()
  })

  test.skipIf(skip)('removeImage and prune keep the layers another image lists and remove the rest', async () => {
    const pool = await fresh()
    const app = await pool.importImage(`oci:${layout}:app`)
    const other = await pool.importImage(`oci:${layout}:other`)
    const r = await pool.removeImage('app')
    expect(r.removed[0]).toBe(app.id)
    expect(r.removed).toHaveLength(2) // the image and its own top layer
    const { layers } = await kinds(pool)
    expect(layers.map((l) => l.layer!.chainId).sort()).toEqual(other.image.layers.map((l) => l.chainId).sort())
    // Nothing is old enough to prune by age; a layer no image lists goes anyway, one an image lists stays.
    await pool.pruneTemplates({ unusedForMs: 0, name: 'nothing-of-that-name' })
    expect((await kinds(pool)).layers).toHaveLength(3)
    await pool.pruneTemplates({ unusedForMs: 0 })
    expect(await pool.templates()).toEqual([])
    expect((await errorOf(pool.removeImage('app'))).code).toBe('ERR_TEMPLATE_NOT_FOUND')
    await pool.close()
  })

  test.skipIf(skip)('a flipped byte and a truncated blob are ERR_OCI_DIGEST_MISMATCH; nothing published (not the layer below either), no staging left', async () => {
    const pool = await fresh()
    for (const [how, compression] of [['flip', 'gzip'], ['flip', 'none'], ['flip', 'zstd'], ['truncate', 'gzip']] as const) {
      const lower = makeTar([{ name: 'lower', data: 'a layer that applies' }])
      const tar = makeTar([{ name: 'file', data: Buffer.alloc(256 * 1024, 7) }])
      const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), [lower, tar], { compression })
      const blob = blobPath(raw.layoutDir, raw.layers[1].digest)
      const bytes = fs.readFileSync(blob)
      if (how === 'flip') bytes[bytes.length >> 1] ^= 0x20
      fs.writeFileSync(blob, how === 'flip' ? bytes : bytes.subarray(0, bytes.length - 100))
      const e = await errorOf(pool.importImage(raw.layoutDir, { name: 'x' }))
      expect([how, compression, e.code]).toEqual([how, compression, 'ERR_OCI_DIGEST_MISMATCH'])
      expect(e.blob).toBe(raw.layers[1].digest)
      await expectNothingLeft(pool)
    }
    await pool.close()
  })

  test.skipIf(skip)('a wrong diffID is ERR_OCI_DIGEST_MISMATCH naming it; a missing blob ERR_OCI_BLOB_MISSING', async () => {
    const pool = await fresh()
    const tar = makeTar([{ name: 'file', data: 'x' }])
    const wrong = 'sha256:' + 'e'.repeat(64)
    const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), [tar], { diffIds: [wrong], compression: 'gzip' })
    const e = await errorOf(pool.importImage(raw.layoutDir))
    expect([e.code, e.expected]).toEqual(['ERR_OCI_DIGEST_MISMATCH', wrong])
    await expectNothingLeft(pool)
    const gone = rawLayerImage(freshDir(mounts.scratch, 'raw'), [tar])
    fs.unlinkSync(blobPath(gone.layoutDir, gone.layers[0].digest))
    expect((await errorOf(pool.importImage(gone.layoutDir))).code).toBe('ERR_OCI_BLOB_MISSING')
    await expectNothingLeft(pool)
    await pool.close()
  })

  test.skipIf(skip)('an abort mid-import leaves nothing at once', async () => {
    const pool = await fresh()
    const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), [makeTar([{ name: 'big', data: Buffer.alloc(32 << 20, 1) }])])
    const ac = new AbortController()
    const e = await errorOf(pool.importImage(raw.layoutDir, { signal: ac.signal, onProgress: () => ac.abort() }))
    expect(e).toMatchObject({ name: 'AbortError', code: 'ABORT_ERR' })
    await expectNothingLeft(pool)
    await pool.close()
  })

  test.skipIf(skip)('a SIGKILLed import leaves only staging, which the next sweep reclaims', async () => {
    const root = freshDir(dir!, 'import')
    const raw = rawLayerImage(freshDir(mounts.scratch, 'raw'), [makeTar([{ name: 'big', data: Buffer.alloc(32 << 20, 1) }])])
    const c = new Child(child, [root, raw.layoutDir, '{}', 'progress'])
    expect(await c.next()).toMatchObject({ event: 'progress' })
    c.proc.kill('SIGKILL')
    await c.exited
    const pool = await openPool(root)
    expect(await pool.templates()).toEqual([])
    expect(builds(root)).toMatchObject({ templates: [], layers: [], templateStaging: [expect.stringMatching(/^[0-9a-f]{32}$/)] })
    await pool.sweep({ graceMs: 0 })
    await expectNothingLeft(pool)
    await pool.close()
  })

  test.skipIf(skip)('four processes importing one image at once all succeed, one template per chainID', async () => {
    const root = freshDir(dir!, 'import')
    await (await openPool(root)).close()
    const kids = Array.from({ length: 4 }, () => new Child(child, [root, `oci:${layout}:app`, '{}', 'go']))
    for (const k of kids) expect(await k.next()).toMatchObject({ event: 'ready' })
    for (const k of kids) k.proc.stdin!.write('go\n')
    const done = await Promise.all(kids.map((k) => k.next()))
    expect(done.map((d) => d.ok)).toEqual([true, true, true, true])
    expect(new Set(done.map((d) => d.id)).size).toBe(1)
    const pool = await openPool(root)
    const { layers, images } = await kinds(pool)
    expect(layers).toHaveLength(3)
    expect(images).toHaveLength(1)
    expect(builds(root)).toMatchObject({ staging: [], templateStaging: [] })
    expect(await againstUmoci(pool, images[0].id, 'app')).toEqual([])
    await pool.close()
  })
})

const ext4Pool = mounts.xfs ?? mounts.btrfs
describe.skipIf(!!missing || !ext4Pool)(`importImage format 'ext4' ${needs('XFS or btrfs', !ext4Pool && 'neither')}`, () => {
  const debugfs = (image: string, req: string) => spawnSync('debugfs', ['-R', req, image], { encoding: 'utf8' }).stdout

  test('rootfs.ext4 checks clean and keeps owners, modes, capabilities, devices and hard links', async () => {
    const pool = await openPool(freshDir(ext4Pool!, 'import'))
    const t = await pool.importImage(`oci:${layout}:every`, { format: 'ext4', name: 'every-ext4' })
    expect(t.image.format).toBe('ext4')
    expect(fs.readdirSync(t.path)).toEqual(['rootfs.ext4'])
    const ws = await pool.allocate({ from: t.id })
    const image = path.join(ws.path, 'rootfs.ext4')
    const fsck = spawnSync('e2fsck', ['-fn', image], { encoding: 'utf8' })
    expect(fsck.status, fsck.stdout).toBe(0)
    const su = debugfs(image, 'stat /bin/su')
    expect(su).toMatch(/Mode:\s+04755/)
    expect(debugfs(image, 'stat /opt/owned')).toMatch(/User:\s+1000\s+Group:\s+1001/)
    expect(debugfs(image, 'ea_list /bin/ping')).toMatch(/security\.capability/)
    expect(debugfs(image, 'stat /null')).toMatch(/Device major\/minor number: 01:03/)
    const inode = (p: string) => /Inode: (\d+)/.exec(debugfs(image, `stat ${p}`))?.[1]
    expect(inode('/bin/tool')).toBe(inode('/bin/tool-again'))
    expect(debugfs(image, 'cat /top')).toBe('top layer file')
    await ws.dispose()
    await pool.close()
  })

  test('a small tree with no headroom gets a journal that fits (mke2fs refuses one of more than half)', async () => {
    const pool = await openPool(freshDir(ext4Pool!, 'import'))
    const t = await pool.importImage(`oci:${layout}:base`, { format: 'ext4', name: 'tiny', ext4: { headroomBytes: 0 } })
    const image = path.join(t.path, 'rootfs.ext4')
    const fsck = spawnSync('e2fsck', ['-fn', image], { encoding: 'utf8' })
    expect(fsck.status, fsck.stdout).toBe(0)
    await pool.close()
  })

  test('an image larger than the free space is ENOSPC before anything is written', async () => {
    const pool = await openPool(freshDir(ext4Pool!, 'import'))
    const e = await errorOf(pool.importImage(`oci:${layout}:base`, { format: 'ext4', ext4: { headroomBytes: 2 ** 50 } }))
    expect(e.code).toBe('ENOSPC')
    expect((await kinds(pool)).images).toEqual([])
    expect(stagingEntries(pool.root)).toEqual([])
    await pool.close()
  })
})

describe.skipIf(!!missing || !unprivilegedChildren)(`importImage as non-root ${needs('a child as uid 65534', !unprivilegedChildren && 'not root, or the checkout is not reachable by others')}`, () => {
  test('is refused with ERR_OCI_NOT_PERMITTED and makes nothing', async () => {
    const root = freshDir(mounts.scratch, 'nonroot')
    fs.chownSync(root, 65534, 65534)
    const r = spawnSync('setpriv', ['--reuid=65534', '--regid=65534', '--clear-groups', process.execPath, child, root, `oci:${layout}:base`, '{}', 'now'], { encoding: 'utf8' })
    const lines = r.stdout.trim().split('\n').map((l) => JSON.parse(l) as { event: string })
    expect([lines[lines.length - 1], r.stderr]).toMatchObject([{ event: 'done', ok: false, code: 'ERR_OCI_NOT_PERMITTED' }, ''])
    expect(builds(root)).toEqual({ staging: [], templateStaging: [], templates: [], layers: [] })
  })
})

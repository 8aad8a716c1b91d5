/**
 * The OCI image fixtures themselves (test/oci-helpers.ts): an image umoci builds has every entry type and the
 * whiteouts of its deletions, a hand-written layout with each whiteout case unpacks as the OCI image spec says, the
 * archives skopeo writes hold the image, and compareTrees reports exactly the differences there are.
 *
 * Needs root, umoci and skopeo (skipped with the reason printed otherwise).
 */
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import * as zlib from 'node:zlib'
import { describe, expect, test } from 'vitest'
import { freshDir, needs } from './helpers.js'
import {
  blobPath,
  buildImage,
  compareTrees,
  makeTar,
  MEDIA,
  ociToolsMissing,
  rawLayerImage,
  readManifest,
  sha256,
  toArchive,
  treeView,
  umociUnpack,
  type LayerSpec,
} from './oci-helpers.js'

const missing = ociToolsMissing()
const data = (n: number, seed: number) => Buffer.alloc(n, seed)

/** Three layers: every entry type; deletions and replacements of lower entries; a hard link to a lower file. */
const everyKind: LayerSpec[] = [
  [
    { dir: 'etc', mode: 0o755 },
    { file: 'etc/passwd', data: 'root:x:0:0::/root:/bin/sh\n' },
    { dir: 'bin', mode: 0o755, xattrs: { 'user.dir': 'bin dir' } },
    { file: 'bin/tool', data: data(20_000, 1), mode: 0o755, uid: 1234, gid: 5678, xattrs: { 'user.note': 'hello' } },
    { file: 'bin/suid', data: data(9000, 2), mode: 0o4755 },
    { file: 'bin/sgid', data: data(9000, 3), mode: 0o2711, gid: 42 },
    { file: 'bin/ping', data: data(9000, 4), mode: 0o755 },
    { capability: 'bin/ping', caps: 'cap_net_raw+ep' },
    { file: 'sparse.img', sparse: { size: 4 << 20, offset: 1 << 20, data: data(4096, 5) } },
    { link: 'bin/tool-link', target: 'bin/tool' },
    { symlink: 'bin/sh', target: 'tool', uid: 7, gid: 8, mtime: 1_200_000_000 },
    { symlink: 'dangling', target: '/does/not/exist' },
    { dir: 'dev', mode: 0o755 },
    { device: 'dev/null', kind: 'char', major: 1, minor: 3, mode: 0o666 },
    { device: 'dev/loop9', kind: 'block', major: 7, minor: 9, mode: 0o660, gid: 6 },
    { fifo: 'dev/fifo', mode: 0o600, uid: 65534, gid: 65534 },
    { dir: 'tmp', mode: 0o1777 },
    { dir: 'gone', mode: 0o700 },
    { file: 'gone/a', data: 'a' },
    { file: 'old-file', data: 'will be a dir' },
    { dir: 'old-dir' },
    { file: 'old-dir/x', data: 'x' },
  ],
  [
    { remove: 'gone' },
    { remove: 'etc/passwd' },
    { remove: 'old-file' },
    { dir: 'old-file' },
    { file: 'old-file/inner', data: 'inner' },
    { remove: 'old-dir' },
    { file: 'old-dir', data: 'now a file' },
    { link: 'lower-link', target: 'bin/suid' },
  ],
  [
    { file: 'etc/passwd', data: 'root:x:0:0::/root:/bin/ash\n', mode: 0o640 },
    { file: 'top.txt', data: 'top layer\n', mtime: 1_300_000_000 },
  ],
]

/** The uncompressed tar of a layer blob, as `tar -t` lists it. */
function layerNames(layoutDir: string, digest: string): string[] {
  const tar = zlib.gunzipSync(fs.readFileSync(blobPath(layoutDir, digest)))
  const r = spawnSync('tar', ['-t'], { input: tar, encoding: 'utf8' })
  return r.stdout.split('\n').filter(Boolean)
}

describe.skipIf(missing)(`OCI image fixtures ${needs('root, umoci and skopeo', missing)}`, () => {
  test('buildImage writes one layer per spec, deletions as whiteouts, and umoci unpacks the tree the specs describe', () => {
    const dir = freshDir()
    const layout = path.join(dir, 'oci')
    const { ref } = buildImage(layout, everyKind, { ref: 'every', config: { Env: ['A=1'], Cmd: ['/bin/sh', '-c', 'true'], WorkingDir: '/tmp' } })
    const { manifest } = readManifest(layout, ref)
    expect(manifest.layers).toHaveLength(3)
    const whiteouts = manifest.layers.map((l) => layerNames(layout, l.digest).filter((n) => path.basename(n).startsWith('.wh.')))
    expect(whiteouts[0]).toEqual([])
    // umoci also writes a whiteout of each child of a directory replaced by a file.
    expect(whiteouts[1].sort()).toEqual(['.wh.gone', 'etc/.wh.passwd', 'old-dir/.wh.x'])
    const config = JSON.parse(fs.readFileSync(blobPath(layout, manifest.config.digest), 'utf8'))
    expect(config.config).toMatchObject({ Env: ['A=1'], Cmd: ['/bin/sh', '-c', 'true'], WorkingDir: '/tmp' })

    const v = treeView(umociUnpack(layout, ref, path.join(dir, 'ref')))
    expect([...v.keys()].filter((p) => p !== '.').sort()).toEqual(
      [
        'bin', 'bin/ping', 'bin/sgid', 'bin/sh', 'bin/suid', 'bin/tool', 'bin/tool-link', 'dangling', 'dev', 'dev/fifo',
        'dev/loop9', 'dev/null', 'etc', 'etc/passwd', 'lower-link', 'old-dir', 'old-file', 'old-file/inner', 'sparse.img',
        'tmp', 'top.txt',
      ].sort(),
    )
    expect(v.get('bin/tool')).toMatchObject({ type: 'file', mode: 0o755, uid: 1234, gid: 5678, size: 20_000, sha256: sha256(data(20_000, 1)) })
    expect(v.get('bin/tool')!.xattrs).toEqual({ 'user.note': '0x68656c6c6f' })
    expect(v.get('bin/tool')!.links).toEqual(['bin/tool', 'bin/tool-link'])
    expect(v.get('lower-link')!.links).toEqual(['bin/suid', 'lower-link'])
    expect(v.get('bin/suid')!.mode).toBe(0o4755)
    expect(v.get('bin/sgid')).toMatchObject({ mode: 0o2711, gid: 42 })
    expect(Object.keys(v.get('bin/ping')!.xattrs)).toEqual(['security.capability'])
    expect(v.get('bin/sh')).toMatchObject({ type: 'symlink', target: 'tool', uid: 7, gid: 8, mtimeNs: 1_200_000_000_000_000_000n })
    expect(v.get('dev/null')).toMatchObject({ type: 'char', rdev: (1 << 8) | 3, mode: 0o666 })
    expect(v.get('dev/loop9')).toMatchObject({ type: 'block', rdev: (7 << 8) | 9, gid: 6 })
    expect(v.get('dev/fifo')).toMatchObject({ type: 'fifo', mode: 0o600, uid: 65534 })
    expect(v.get('tmp')!.mode).toBe(0o1777)
    expect(v.get('old-file')!.type).toBe('dir')
    expect(v.get('old-dir')).toMatchObject({ type: 'file', sha256: sha256('now a file') })
    expect(v.get('etc/passwd')).toMatchObject({ mode: 0o640, sha256: sha256('root:x:0:0::/root:/bin/ash\n') })
    expect(v.get('top.txt')!.mtimeNs).toBe(1_300_000_000_000_000_000n)
    expect(v.get('sparse.img')!.size).toBe(4 << 20)
  })

  test('rawLayerImage writes hand-made layers that umoci unpacks per the OCI whiteout rules', () => {
    const dir = freshDir()
    const lower = makeTar([
      { name: 'a', type: 'dir' },
      { name: 'a/x', data: 'x' },
      { name: 'a/y', data: 'y' },
      { name: 'b', type: 'dir', mode: 0o750 },
      { name: 'b/z', data: 'z' },
      { name: 'b/sub', type: 'dir' },
      { name: 'c', data: 'c' },
      { name: 'd', type: 'dir' },
      { name: 'd/w', data: 'w' },
      { name: 'e', data: 'e' },
      { name: `long/${'n'.repeat(120)}`, data: 'pax name', xattrs: { 'user.k': 'v' } },
      { name: `gnu/${'g'.repeat(120)}`, data: 'gnu name', gnu: true },
    ])
    const upper = makeTar([
      { name: 'a/.wh.x' },
      { name: 'b/early', data: 'same layer, before the marker' },
      { name: 'b/.wh..wh..opq' },
      { name: 'b/new', data: 'same layer' },
      { name: 'c', type: 'dir' },
      { name: 'c/inner', data: 'inner' },
      { name: 'd', data: 'file now' },
      { name: '.wh.e' },
    ])
    const img = rawLayerImage(path.join(dir, 'raw'), [lower, upper], { compression: ['gzip', 'none'], config: { Cmd: ['/x'] } })
    expect(img.layers.map((l) => l.diffId)).toEqual([`sha256:${sha256(lower)}`, `sha256:${sha256(upper)}`])
    expect(img.layers.map((l) => l.mediaType)).toEqual([MEDIA.layerGzip, MEDIA.layer])

    const v = treeView(umociUnpack(img.layoutDir, img.ref, path.join(dir, 'ref')))
    expect([...v.keys()].filter((p) => p !== '.').sort()).toEqual(
      ['a', 'a/y', 'b', 'b/early', 'b/new', 'c', 'c/inner', 'd', 'gnu', `gnu/${'g'.repeat(120)}`, 'long', `long/${'n'.repeat(120)}`].sort(),
    )
    expect(v.get('b')!.mode).toBe(0o750)
    expect(v.get('b/early')!.sha256).toBe(sha256('same layer, before the marker'))
    expect(v.get('d')).toMatchObject({ type: 'file', sha256: sha256('file now') })
    expect(v.get(`long/${'n'.repeat(120)}`)).toMatchObject({ sha256: sha256('pax name'), xattrs: { 'user.k': '0x76' } })
  })

  test('rawLayerImage compresses a layer with zstd (umoci 0.4.7 reads none: checked with the zstd command)', () => {
    const tar = makeTar([{ name: 'f', data: 'zstd' }])
    const img = rawLayerImage(path.join(freshDir(), 'raw'), [tar], { compression: 'zstd' })
    const blob = fs.readFileSync(blobPath(img.layoutDir, img.layers[0].digest))
    expect(img.layers[0]).toMatchObject({ mediaType: MEDIA.layerZstd, size: blob.length, diffId: `sha256:${sha256(tar)}` })
    expect(spawnSync('zstd', ['-d', '-c'], { input: blob }).stdout).toEqual(tar)
  })

  test('toArchive writes oci-archive and docker-archive files of the image with the same layers', () => {
    const dir = freshDir()
    const layout = path.join(dir, 'oci')
    buildImage(layout, [[{ file: 'one', data: '1' }], [{ file: 'two', data: '2' }]], { ref: 'v1' })
    const { manifest } = readManifest(layout, 'v1')
    const oci = toArchive(layout, 'v1', 'oci-archive')
    expect(oci.ref).toBe('v1')
    const docker = toArchive(layout, 'v1', 'docker-archive')
    expect(docker.ref).toBe('localhost/v1:latest')
    const inspect = (src: string) => JSON.parse(spawnSync('skopeo', ['inspect', '--raw', src], { encoding: 'utf8' }).stdout)
    expect(inspect(`oci-archive:${oci.file}:v1`).layers.map((l: { digest: string }) => l.digest)).toEqual(manifest.layers.map((l) => l.digest))
    expect(inspect(`docker-archive:${docker.file}:${docker.ref}`).layers).toHaveLength(2)
  })

  test('compareTrees of a tree and itself is empty, and names exactly the mode, xattr, mtime and link changed', () => {
    const dir = freshDir()
    const layout = path.join(dir, 'oci')
    buildImage(layout, everyKind, { ref: 'every' })
    const a = umociUnpack(layout, 'every', path.join(dir, 'a'))
    const b = umociUnpack(layout, 'every', path.join(dir, 'b'))
    expect(compareTrees(a, a)).toEqual([])
    expect(compareTrees(a, b)).toEqual([])

    fs.chmodSync(path.join(b, 'bin/sgid'), 0o711)
    spawnSync('setfattr', ['-n', 'user.note', '-v', 'HELLO', path.join(b, 'etc/passwd')])
    fs.utimesSync(path.join(b, 'top.txt'), 1_300_000_000, 1_300_000_001)
    // The hard link broken: same bytes, owner, mode, xattrs and mtime, another inode.
    fs.unlinkSync(path.join(b, 'lower-link'))
    spawnSync('cp', ['-a', path.join(b, 'bin/suid'), path.join(b, 'lower-link')])
    expect(compareTrees(a, b)).toEqual([
      { path: 'bin/sgid', field: 'mode', a: 0o2711, b: 0o711 },
      { path: 'bin/suid', field: 'links', a: ['bin/suid', 'lower-link'], b: undefined },
      { path: 'etc/passwd', field: 'xattrs', a: {}, b: { 'user.note': '0x48454c4c4f' } },
      { path: 'lower-link', field: 'links', a: ['bin/suid', 'lower-link'], b: undefined },
      { path: 'top.txt', field: 'mtimeNs', a: 1_300_000_000_000_000_000n, b: 1_300_000_001_000_000_000n },
    ])
    fs.rmSync(path.join(b, 'dev/fifo'))
    expect(compareTrees(a, b).filter((d) => d.field === 'exists')).toEqual([{ path: 'dev/fifo', field: 'exists', a: true, b: false }])
  })
})

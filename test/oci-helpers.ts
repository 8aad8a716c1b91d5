/**
 * OCI image fixtures for the image-import suites: images built from local files with umoci (the reference
 * implementation of the OCI image spec's layer rules), layouts written by hand around arbitrary (hostile) layer tars,
 * archives made with skopeo, `umoci unpack` as the reference rootfs, and a tree comparison that names every
 * difference (type, mode, owner, size, bytes, link target, device numbers, xattrs, mtime, hard-link groups).
 *
 * Needs root (umoci writes owners, devices and security.* xattrs as root only), umoci and skopeo (Debian packages).
 */
import { spawnSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import * as zlib from 'node:zlib'
import { MiB } from './helpers.js'

/** Runs a command that must succeed; its stdout. */
function run(cmd: string, args: string[]): string {
  const r = spawnSync(cmd, args, { encoding: 'utf8', maxBuffer: 64 * MiB })
  if (r.error) throw new Error(`${cmd}: ${r.error.message}`)
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')} exited ${r.status}: ${r.stderr}`)
  return r.stdout
}

/** Which of umoci, skopeo and root the image fixtures need are missing (for a suite's skip reason), or false. */
export function ociToolsMissing(): string | false {
  if (process.geteuid?.() !== 0) return 'not root'
  const missing = ['umoci', 'skopeo', 'zstd'].filter((t) => spawnSync(t, ['--version'], { stdio: 'ignore' }).status !== 0)
  if (missing.length > 0 && process.env.VMSPACE_REQUIRE_OCI === '1')
    throw new Error(`${missing.join(', ')} not installed (required by VMSPACE_REQUIRE_OCI=1: .ci/run installs them)`)
  return missing.length > 0 ? `${missing.join(', ')} not installed` : false
}

export const sha256 = (data: Buffer | string): string => createHash('sha256').update(data).digest('hex')

// ---- a small tar writer ----

/**
 * One tar entry. `type` is a kind or a raw typeflag character (e.g. 'S' for GNU sparse, 'x' for a bare PAX
 * header). Names and link names longer than the ustar fields go into PAX records (or GNU 'L'/'K' entries with
 * `gnu: true`); `xattrs` become `SCHILY.xattr.<name>` records. `size` and `checksum` override what the header
 * says (for truncated or corrupt entries); everything else is written as given, `..` and absolute names included.
 */
export interface TarEntry {
  name: string
  type?: 'file' | 'dir' | 'symlink' | 'link' | 'char' | 'block' | 'fifo' | string
  data?: Buffer | string
  mode?: number
  uid?: number
  gid?: number
  /** Seconds since the epoch; a fraction goes into a PAX `mtime` record. Default 1000000000. */
  mtime?: number
  linkname?: string
  devmajor?: number
  devminor?: number
  xattrs?: Record<string, Buffer | string>
  /** Extra PAX records (written before the xattrs). */
  pax?: Record<string, Buffer | string>
  gnu?: boolean
  size?: number
  checksum?: number
}

const TYPEFLAGS: Record<string, string> = { file: '0', link: '1', symlink: '2', char: '3', block: '4', dir: '5', fifo: '6' }
const BLOCK = 512

/** A numeric header field: octal, NUL-terminated, or base-256 when it does not fit. */
function octal(value: number, width: number): Buffer {
  const buf = Buffer.alloc(width)
  const text = value.toString(8)
  if (text.length < width) {
    buf.write(text.padStart(width - 1, '0'), 0, 'ascii')
    return buf
  }
  buf[0] = 0x80
  for (let i = width - 1, v = BigInt(value); i > 0; i--, v >>= 8n) buf[i] = Number(v & 0xffn)
  return buf
}

/** One 512-byte ustar header. */
function header(f: { name: Buffer; typeflag: string; size: number; e: TarEntry; linkname: Buffer }): Buffer {
  const h = Buffer.alloc(BLOCK)
  f.name.copy(h, 0, 0, Math.min(100, f.name.length))
  octal(f.e.mode ?? (f.e.type === 'dir' ? 0o755 : 0o644), 8).copy(h, 100)
  octal(f.e.uid ?? 0, 8).copy(h, 108)
  octal(f.e.gid ?? 0, 8).copy(h, 116)
  octal(f.size, 12).copy(h, 124)
  octal(Math.floor(f.e.mtime ?? 1e9), 12).copy(h, 136)
  h.write(f.typeflag, 156, 'latin1')
  f.linkname.copy(h, 157, 0, Math.min(100, f.linkname.length))
  h.write('ustar\u000000', 257, 'latin1')
  octal(f.e.devmajor ?? 0, 8).copy(h, 329)
  octal(f.e.devminor ?? 0, 8).copy(h, 337)
  h.fill(0x20, 148, 156)
  let sum = 0
  for (const b of h) sum += b
  octal(f.e.checksum ?? sum, 7).copy(h, 148)
  return h
}

const pad = (data: Buffer): Buffer => Buffer.concat([data, Buffer.alloc((BLOCK - (data.length % BLOCK)) % BLOCK)])

/** A PAX record `<len> <key>=<value>\n`, whose length counts its own digits. */
function paxRecord(key: string, value: Buffer | string): Buffer {
  const body = Buffer.concat([Buffer.from(` ${key}=`), Buffer.from(value), Buffer.from('\n')])
  let len = body.length + 1
  while (String(len).length + body.length !== len) len++
  return Buffer.concat([Buffer.from(String(len)), body])
}

/** The header(s) and data of one entry. */
export function tarEntry(e: TarEntry): Buffer {
  const name = Buffer.from(e.name)
  const linkname = Buffer.from(e.linkname ?? '')
  const data = Buffer.from(e.data ?? '')
  const typeflag = TYPEFLAGS[e.type ?? 'file'] ?? e.type ?? '0'
  const out: Buffer[] = []
  const records: Buffer[] = []
  const longField = (value: Buffer, paxKey: string, gnuFlag: string) => {
    if (value.length <= 100) return
    if (!e.gnu) return records.push(paxRecord(paxKey, value))
    const body = Buffer.concat([value, Buffer.alloc(1)])
    out.push(header({ name: Buffer.from('././@LongLink'), typeflag: gnuFlag, size: body.length, e: {} as TarEntry, linkname: Buffer.alloc(0) }))
    out.push(pad(body))
  }
  longField(name, 'path', 'L')
  longField(linkname, 'linkpath', 'K')
  if (e.mtime !== undefined && !Number.isInteger(e.mtime)) records.push(paxRecord('mtime', e.mtime.toFixed(9)))
  for (const [k, v] of Object.entries(e.pax ?? {})) records.push(paxRecord(k, v))
  for (const [k, v] of Object.entries(e.xattrs ?? {})) records.push(paxRecord(`SCHILY.xattr.${k}`, v))
  if (records.length > 0) {
    const body = Buffer.concat(records)
    const paxName = Buffer.from(`PaxHeaders/${e.name}`.slice(0, 100))
    out.push(header({ name: paxName, typeflag: 'x', size: body.length, e: { name: '' }, linkname: Buffer.alloc(0) }))
    out.push(pad(body))
  }
  out.push(header({ name, typeflag, size: e.size ?? data.length, e, linkname }))
  out.push(pad(data))
  return Buffer.concat(out)
}

/** A tar stream of `entries` followed by the two zero blocks (`end: false` leaves them out). */
export function makeTar(entries: TarEntry[], opts: { end?: boolean } = {}): Buffer {
  const parts = entries.map(tarEntry)
  if (opts.end ?? true) parts.push(Buffer.alloc(2 * BLOCK))
  return Buffer.concat(parts)
}

// ---- OCI layouts written by hand ----

export const MEDIA = {
  index: 'application/vnd.oci.image.index.v1+json',
  manifest: 'application/vnd.oci.image.manifest.v1+json',
  config: 'application/vnd.oci.image.config.v1+json',
  layer: 'application/vnd.oci.image.layer.v1.tar',
  layerGzip: 'application/vnd.oci.image.layer.v1.tar+gzip',
  layerZstd: 'application/vnd.oci.image.layer.v1.tar+zstd',
} as const

/** The host's OCI architecture name (Node's arch names differ for x64 and ia32). */
export function hostArchitecture(): string {
  return ({ x64: 'amd64', ia32: '386' } as Record<string, string>)[process.arch] ?? process.arch
}

/** A descriptor of a blob written into `<layout>/blobs/sha256/`. */
export interface Descriptor {
  mediaType: string
  digest: string
  size: number
  annotations?: Record<string, string>
  platform?: { os: string; architecture: string; variant?: string }
}

/** Writes `data` as a blob of the layout (idempotent); its descriptor. */
export function writeBlob(layoutDir: string, mediaType: string, data: Buffer | string): Descriptor {
  const bytes = Buffer.from(data)
  const hex = sha256(bytes)
  const dir = path.join(layoutDir, 'blobs', 'sha256')
  fs.mkdirSync(dir, { recursive: true })
  fs.writeFileSync(path.join(dir, hex), bytes)
  return { mediaType, digest: `sha256:${hex}`, size: bytes.length }
}

/** The path of the blob `digest` ('sha256:<hex>') of a layout. */
export function blobPath(layoutDir: string, digest: string): string {
  const [algo, hex] = digest.split(':')
  return path.join(layoutDir, 'blobs', algo, hex)
}

export interface RawImageOptions {
  /** The tag (`org.opencontainers.image.ref.name`); default 'latest'. A manifest of that tag already there is replaced. */
  ref?: string
  /** Per layer, or one for all; default 'none'. */
  compression?: 'none' | 'gzip' | 'zstd' | ('none' | 'gzip' | 'zstd')[]
  /** The image config's `config` object (Env, Cmd, ...). */
  config?: Record<string, unknown>
  /** Default linux/<host arch>. */
  platform?: { os: string; architecture: string; variant?: string }
  /** Overrides the layers' media types (e.g. an unsupported one). */
  mediaTypes?: string[]
  /** Overrides the diffIDs written in the config (e.g. a wrong one). */
  diffIds?: string[]
}

export interface RawImage {
  layoutDir: string
  ref: string
  manifest: Descriptor
  config: Descriptor
  /** Per layer: the blob's descriptor and the diffID (sha256 of the uncompressed tar). */
  layers: (Descriptor & { diffId: string })[]
}

/** A layer's blob: zstd by zlib where this Node has it, else by the zstd command (Debian `zstd`). */
export function compress(tar: Buffer, how: 'none' | 'gzip' | 'zstd'): Buffer {
  if (how === 'gzip') return zlib.gzipSync(tar)
  if (how === 'none') return tar
  const z = zlib as unknown as { zstdCompressSync?: (b: Buffer) => Buffer }
  if (z.zstdCompressSync) return z.zstdCompressSync(tar)
  const r = spawnSync('zstd', ['-q', '-c'], { input: tar, maxBuffer: 1024 * MiB })
  if (r.status !== 0) throw new Error(`zstd exited ${r.status}: ${r.stderr}`)
  return r.stdout
}

/** Adds (or replaces) the manifest of tag `ref` in the layout's index.json, making the layout when missing. */
export function setIndexRef(layoutDir: string, ref: string, manifest: Descriptor): void {
  fs.mkdirSync(layoutDir, { recursive: true })
  fs.writeFileSync(path.join(layoutDir, 'oci-layout'), JSON.stringify({ imageLayoutVersion: '1.0.0' }))
  const indexFile = path.join(layoutDir, 'index.json')
  const index = fs.existsSync(indexFile) ? JSON.parse(fs.readFileSync(indexFile, 'utf8')) : { schemaVersion: 2, manifests: [] }
  const refKey = 'org.opencontainers.image.ref.name'
  index.manifests = (index.manifests as Descriptor[]).filter((m) => m.annotations?.[refKey] !== ref)
  index.manifests.push({ ...manifest, annotations: { ...manifest.annotations, [refKey]: ref } })
  fs.writeFileSync(indexFile, JSON.stringify(index))
}

/**
 * Writes an OCI image layout in `dir` (made when missing; other tags already there are kept) whose image `ref` has
 * `tars` as its layers, bottom first, written exactly as given (hostile ones included) with correct digests,
 * diffIDs and sizes unless overridden.
 */
export function rawLayerImage(dir: string, tars: Buffer[], opts: RawImageOptions = {}): RawImage {
  const ref = opts.ref ?? 'latest'
  const layers = tars.map((tar, i) => {
    const how = Array.isArray(opts.compression) ? opts.compression[i] : (opts.compression ?? 'none')
    const mediaType = opts.mediaTypes?.[i] ?? { none: MEDIA.layer, gzip: MEDIA.layerGzip, zstd: MEDIA.layerZstd }[how]
    return { ...writeBlob(dir, mediaType, compress(tar, how)), diffId: `sha256:${sha256(tar)}` }
  })
  const platform = opts.platform ?? { os: 'linux', architecture: hostArchitecture() }
  const configJson = {
    ...platform,
    created: '2001-02-03T04:05:06Z',
    config: opts.config ?? {},
    rootfs: { type: 'layers', diff_ids: opts.diffIds ?? layers.map((l) => l.diffId) },
    history: layers.map(() => ({ created: '2001-02-03T04:05:06Z', created_by: 'rawLayerImage' })),
  }
  const config = writeBlob(dir, MEDIA.config, JSON.stringify(configJson))
  const manifestJson = {
    schemaVersion: 2,
    mediaType: MEDIA.manifest,
    config,
    layers: layers.map(({ mediaType, digest, size }) => ({ mediaType, digest, size })),
  }
  const manifest = { ...writeBlob(dir, MEDIA.manifest, JSON.stringify(manifestJson)), platform }
  setIndexRef(dir, ref, manifest)
  return { layoutDir: dir, ref, manifest, config, layers }
}

// ---- images built with umoci ----

/**
 * One entry of a layer built by buildImage, made in umoci's bundle before the layer is repacked. Paths are relative
 * to the rootfs; parents must exist (made by an earlier entry or layer). `remove` deletes (a whiteout in the
 * layer); `run` does anything else to the rootfs.
 */
export type LayerEntry =
  | { file: string; data?: Buffer | string; mode?: number; uid?: number; gid?: number; xattrs?: Record<string, string>; mtime?: number }
  | { file: string; sparse: { size: number; offset: number; data: Buffer | string }; mode?: number; mtime?: number }
  | { dir: string; mode?: number; uid?: number; gid?: number; xattrs?: Record<string, string>; mtime?: number }
  | { symlink: string; target: string; uid?: number; gid?: number; mtime?: number }
  | { link: string; target: string }
  | { device: string; kind: 'char' | 'block'; major: number; minor: number; mode?: number; uid?: number; gid?: number; mtime?: number }
  | { fifo: string; mode?: number; uid?: number; gid?: number; mtime?: number }
  | { capability: string; caps: string }
  | { remove: string }
  | { run: (rootfs: string) => void }

/** A layer: what to do to the rootfs of the layer below. */
export type LayerSpec = LayerEntry[]

export interface BuildOptions {
  /** The tag written; default 'latest'. */
  ref?: string
  /** A tag of the same layout to start from (its layers become this image's lower layers); default an empty image. */
  from?: string
  /** The image config's fields, set with `umoci config`. */
  config?: { Env?: string[]; Entrypoint?: string[]; Cmd?: string[]; User?: string; WorkingDir?: string; Labels?: Record<string, string> }
  /** Default the host's (umoci's) linux/<arch>. */
  platform?: { os?: string; architecture?: string }
}

/** Seconds since the epoch given to entries without an `mtime` (so that a layer's bytes do not depend on the clock). */
const T0 = 1_000_000_000

function setXattrs(abs: string, xattrs: Record<string, string> | undefined): void {
  for (const [k, v] of Object.entries(xattrs ?? {})) run('setfattr', ['-h', '-n', k, '-v', v, '--', abs])
}

function chownIf(abs: string, e: { uid?: number; gid?: number }): void {
  if (e.uid !== undefined || e.gid !== undefined) fs.lchownSync(abs, e.uid ?? 0, e.gid ?? 0)
}

/** Makes one entry in `rootfs`; the mtime it should get last (after every entry of the layer), if any. */
function makeEntry(rootfs: string, e: LayerEntry): [string, number] | undefined {
  if ('run' in e) return void e.run(rootfs)
  if ('remove' in e) return void fs.rmSync(path.join(rootfs, e.remove), { recursive: true })
  if ('capability' in e) return void run('setcap', [e.caps, path.join(rootfs, e.capability)])
  if ('link' in e) return void fs.linkSync(path.join(rootfs, e.target), path.join(rootfs, e.link))
  const rel = 'file' in e ? e.file : 'dir' in e ? e.dir : 'symlink' in e ? e.symlink : 'device' in e ? e.device : e.fifo
  const abs = path.join(rootfs, rel)
  if ('sparse' in e) {
    fs.writeFileSync(abs, '', { flag: 'wx' })
    fs.truncateSync(abs, e.sparse.size)
    const fd = fs.openSync(abs, 'r+')
    fs.writeSync(fd, Buffer.from(e.sparse.data), 0, Buffer.from(e.sparse.data).length, e.sparse.offset)
    fs.closeSync(fd)
  } else if ('file' in e) fs.writeFileSync(abs, e.data ?? '', { flag: 'wx' })
  else if ('dir' in e) fs.mkdirSync(abs)
  else if ('symlink' in e) fs.symlinkSync(e.target, abs)
  else if ('device' in e) run('mknod', ['--', abs, e.kind === 'char' ? 'c' : 'b', String(e.major), String(e.minor)])
  else run('mkfifo', ['--', abs])
  if (!('sparse' in e)) chownIf(abs, e)
  // chmod after chown: a change of owner clears setuid and setgid.
  if ('mode' in e && e.mode !== undefined) fs.chmodSync(abs, e.mode)
  else if ('dir' in e) fs.chmodSync(abs, 0o755)
  else if (!('symlink' in e)) fs.chmodSync(abs, 0o644)
  if ('xattrs' in e) setXattrs(abs, e.xattrs)
  return [abs, e.mtime ?? T0]
}

/** Applies a layer's entries to `rootfs`, then sets every made entry's mtime (children before their directories). */
function applyLayer(rootfs: string, spec: LayerSpec): void {
  const stamps = spec.map((e) => makeEntry(rootfs, e)).filter((s): s is [string, number] => s !== undefined)
  stamps.sort((a, b) => b[0].split('/').length - a[0].split('/').length)
  const script = stamps.map(([abs, t]) => `touch -h -d @${t} -- '${abs.replace(/'/g, `'\\''`)}'`)
  if (script.length > 0) run('sh', ['-ec', script.join('\n')])
}

function configArgs(opts: BuildOptions): string[] {
  const c = opts.config ?? {}
  const args: string[] = []
  for (const env of c.Env ?? []) args.push('--config.env', env)
  for (const ep of c.Entrypoint ?? []) args.push('--config.entrypoint', ep)
  for (const cmd of c.Cmd ?? []) args.push('--config.cmd', cmd)
  if (c.User !== undefined) args.push('--config.user', c.User)
  if (c.WorkingDir !== undefined) args.push('--config.workingdir', c.WorkingDir)
  for (const [k, v] of Object.entries(c.Labels ?? {})) args.push('--config.label', `${k}=${v}`)
  if (opts.platform?.os) args.push('--os', opts.platform.os)
  if (opts.platform?.architecture) args.push('--architecture', opts.platform.architecture)
  return args
}

/**
 * Builds image `ref` in the OCI layout `dir` (made with `umoci init` when it has no index.json) with umoci: an
 * empty image (or tag `from`), then per LayerSpec the entries made in an unpacked bundle and `umoci repack`
 * (deleting an entry of a lower layer gives a whiteout; umoci writes per-entry whiteouts, never opaque
 * directories: rawLayerImage writes those), then `umoci config`. Layers are gzip-compressed (umoci's only kind).
 * The bundle lives next to `dir` and is removed after.
 */
export function buildImage(dir: string, layers: LayerSpec[], opts: BuildOptions = {}): { layoutDir: string; ref: string } {
  const ref = opts.ref ?? 'latest'
  if (!fs.existsSync(path.join(dir, 'index.json'))) run('umoci', ['init', '--layout', dir])
  if (opts.from === undefined) run('umoci', ['new', '--image', `${dir}:${ref}`])
  else if (opts.from !== ref) run('umoci', ['config', '--image', `${dir}:${opts.from}`, '--tag', ref, '--no-history'])
  const work = fs.mkdtempSync(`${dir}.bundle-`)
  const bundle = path.join(work, 'bundle')
  try {
    run('umoci', ['unpack', '--image', `${dir}:${ref}`, bundle])
    for (const spec of layers) {
      applyLayer(path.join(bundle, 'rootfs'), spec)
      run('umoci', ['repack', '--refresh-bundle', '--image', `${dir}:${ref}`, bundle])
    }
  } finally {
    fs.rmSync(work, { recursive: true, force: true })
  }
  const args = configArgs(opts)
  if (args.length > 0) run('umoci', ['config', '--image', `${dir}:${ref}`, '--no-history', ...args])
  run('umoci', ['gc', '--layout', dir])
  return { layoutDir: dir, ref }
}

/** The manifest of tag `ref` of a layout, parsed, with its descriptor. */
export function readManifest(layoutDir: string, ref: string): { descriptor: Descriptor; manifest: { config: Descriptor; layers: Descriptor[] } } {
  const index = JSON.parse(fs.readFileSync(path.join(layoutDir, 'index.json'), 'utf8'))
  const descriptor = (index.manifests as Descriptor[]).find((m) => m.annotations?.['org.opencontainers.image.ref.name'] === ref)
  if (!descriptor) throw new Error(`${layoutDir}: no tag ${ref}`)
  return { descriptor, manifest: JSON.parse(fs.readFileSync(blobPath(layoutDir, descriptor.digest), 'utf8')) }
}

/**
 * Copies image `ref` of a layout into an archive with `skopeo copy`: `oci-archive` (the tag kept) or `docker-archive`
 * (tagged `localhost/<ref>:latest`, skopeo's docker reference form); the file (default next to the layout, named
 * `<ref>.<kind>.tar`) and the ref the archive knows the image by.
 */
export function toArchive(layoutDir: string, ref: string, kind: 'oci-archive' | 'docker-archive', file?: string): { file: string; ref: string } {
  const out = file ?? path.join(path.dirname(layoutDir), `${path.basename(layoutDir)}-${ref}.${kind}.tar`)
  const archiveRef = kind === 'oci-archive' ? ref : `localhost/${ref}:latest`
  run('skopeo', ['--insecure-policy', 'copy', '--quiet', `oci:${layoutDir}:${ref}`, `${kind}:${out}:${archiveRef}`])
  return { file: out, ref: archiveRef }
}

/** `umoci unpack` of image `ref` into the bundle `dest` (must not exist): the reference rootfs, `<dest>/rootfs`. */
export function umociUnpack(layoutDir: string, ref: string, dest: string): string {
  run('umoci', ['unpack', '--image', `${layoutDir}:${ref}`, dest])
  return path.join(dest, 'rootfs')
}

// ---- tree comparison ----

/** What one entry of a tree is, as compareTrees sees it. */
export interface EntryView {
  type: string
  mode: number
  uid: number
  gid: number
  /** Regular files and symlinks only (a directory's size depends on the file system). */
  size?: number
  sha256?: string
  target?: string
  rdev?: number
  xattrs: Record<string, string>
  /** Nanoseconds; non-directories only (applying a layer changes its directories' mtimes). */
  mtimeNs?: bigint
  /** The sorted paths sharing this entry's inode, when it has more than one name in the tree. */
  links?: string[]
}

/** One difference between two trees; `a`/`b` are undefined where the entry or the value is absent. */
export interface TreeDifference {
  path: string
  field: 'exists' | keyof EntryView
  a: unknown
  b: unknown
}

function typeOf(st: fs.BigIntStats): string {
  if (st.isFile()) return 'file'
  if (st.isDirectory()) return 'dir'
  if (st.isSymbolicLink()) return 'symlink'
  if (st.isCharacterDevice()) return 'char'
  if (st.isBlockDevice()) return 'block'
  if (st.isFIFO()) return 'fifo'
  return 'socket'
}

/** Every xattr (all namespaces, hex values) of every entry below and at `root`, by relative path ('.' the root). */
function xattrsOf(root: string): Record<string, Record<string, string>> {
  const out: Record<string, Record<string, string>> = {}
  let current: Record<string, string> | undefined
  for (const line of run('getfattr', ['-R', '-P', '-h', '-d', '-m', '-', '-e', 'hex', '--absolute-names', root]).split('\n')) {
    const m = /^# file: (.*)$/.exec(line)
    if (m) current = out[m[1] === root ? '.' : path.relative(root, m[1])] = {}
    else if (line && current) {
      const eq = line.indexOf('=')
      current[line.slice(0, eq)] = line.slice(eq + 1)
    }
  }
  return out
}

/** Every entry below and at `root` ('.' the root), never following a symlink. */
export function treeView(root: string): Map<string, EntryView> {
  const xattrs = xattrsOf(root)
  const out = new Map<string, EntryView>()
  const inodes = new Map<bigint, string[]>()
  const walk = (rel: string) => {
    const abs = rel === '.' ? root : path.join(root, rel)
    const st = fs.lstatSync(abs, { bigint: true })
    const type = typeOf(st)
    const v: EntryView = { type, mode: Number(st.mode & 0o7777n), uid: Number(st.uid), gid: Number(st.gid), xattrs: xattrs[rel] ?? {} }
    if (type === 'file' || type === 'symlink') v.size = Number(st.size)
    if (type === 'file') v.sha256 = sha256(fs.readFileSync(abs))
    if (type === 'symlink') v.target = fs.readlinkSync(abs)
    if (type === 'char' || type === 'block') v.rdev = Number(st.rdev)
    if (type !== 'dir') {
      v.mtimeNs = st.mtimeNs
      if (st.nlink > 1n) inodes.set(st.ino, [...(inodes.get(st.ino) ?? []), rel])
    }
    out.set(rel, v)
    if (type === 'dir') for (const name of fs.readdirSync(abs).sort()) walk(rel === '.' ? name : `${rel}/${name}`)
  }
  walk('.')
  for (const group of inodes.values()) if (group.length > 1) for (const rel of group) out.get(rel)!.links = [...group].sort()
  return out
}

const FIELDS: (keyof EntryView)[] = ['type', 'mode', 'uid', 'gid', 'size', 'sha256', 'target', 'rdev', 'xattrs', 'mtimeNs', 'links']

/**
 * The differences between the trees at `a` and `b`, sorted by path then field: an entry in one only (`exists`),
 * then per entry in both each field of EntryView that differs. `[]` when they agree. `root: false` leaves out the
 * roots' own metadata.
 */
export function compareTrees(a: string, b: string, opts: { root?: boolean } = {}): TreeDifference[] {
  const [va, vb] = [treeView(a), treeView(b)]
  if (opts.root === false) for (const v of [va, vb]) v.delete('.')
  const out: TreeDifference[] = []
  for (const p of [...new Set([...va.keys(), ...vb.keys()])].sort()) {
    const [ea, eb] = [va.get(p), vb.get(p)]
    if (!ea || !eb) {
      out.push({ path: p, field: 'exists', a: ea !== undefined, b: eb !== undefined })
      continue
    }
    for (const f of FIELDS) {
      if (JSON.stringify(ea[f], bigintJson) !== JSON.stringify(eb[f], bigintJson)) out.push({ path: p, field: f, a: ea[f], b: eb[f] })
    }
  }
  return out
}

const bigintJson = (_k: string, v: unknown) => (typeof v === 'bigint' ? v.toString() : v)

/**
 * OCI image sources (docs/images.md): an OCI image layout directory, an oci-archive (a tar of one) or a
 * docker-archive (`docker save`). An archive is never unpacked: its tar headers are read once and each blob is read
 * as a byte range of it. Everything in a source is hostile input: JSON is bounded and checked strictly, digests
 * must be sha256 hex, and a path a docker-archive's manifest names must stay inside the archive. Every failure is a
 * named `ERR_OCI_*` error. The blob streams here verify size and digest while they stream (lib/oci-stream.ts).
 */
import * as crypto from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { isPlainObject } from './args.js'
import { VmspaceError, type VmspaceErrorCode } from './errors.js'
import { readTar, type TarEntry } from './oci-tar.js'

/** The largest index, manifest, config or manifest.json read (bytes). */
export const JSON_MAX_BYTES = 4 * 2 ** 20

const DIGEST = /^sha256:[0-9a-f]{64}$/
const REF_ANNOTATION = 'org.opencontainers.image.ref.name'
const INDEX_TYPES = ['application/vnd.oci.image.index.v1+json', 'application/vnd.docker.distribution.manifest.list.v2+json']
const MANIFEST_TYPES = ['application/vnd.oci.image.manifest.v1+json', 'application/vnd.docker.distribution.manifest.v2+json']
const CONFIG_TYPES = ['application/vnd.oci.image.config.v1+json', 'application/vnd.docker.container.image.v1+json']
// How deep an index may nest others (an image index of indexes is legal; a cycle is not).
const INDEX_DEPTH = 4
// The most layers an image may have: Docker's (overlay2's) limit, which every image a registry serves keeps. Each
// layer is a template, a clone of the tree below it: a few MB of manifest listing one small layer thousands of
// times would otherwise make as many trees.
export const LAYERS_MAX = 128

/** How a layer blob is compressed. 'sniff': a docker-archive's layer, whose compression its first bytes tell. */
export type Compression = 'gzip' | 'zstd' | 'none' | 'sniff'

const LAYER_TYPES: Record<string, Compression> = {
  'application/vnd.oci.image.layer.v1.tar': 'none',
  'application/vnd.oci.image.layer.v1.tar+gzip': 'gzip',
  'application/vnd.oci.image.layer.v1.tar+zstd': 'zstd',
  'application/vnd.oci.image.layer.nondistributable.v1.tar': 'none',
  'application/vnd.oci.image.layer.nondistributable.v1.tar+gzip': 'gzip',
  'application/vnd.oci.image.layer.nondistributable.v1.tar+zstd': 'zstd',
  'application/vnd.docker.image.rootfs.diff.tar.gzip': 'gzip',
  'application/vnd.docker.image.rootfs.foreign.diff.tar.gzip': 'gzip',
}

/** An OCI content descriptor, checked. */
export interface Descriptor {
  mediaType: string
  digest: string
  size: number
  platform?: Platform
  annotations?: Record<string, string>
}

export interface Platform {
  os: string
  architecture: string
  variant?: string
}

/** Where a blob's bytes are: `size` bytes of `file` from `start`; `name` is how messages name it. */
export interface BlobLocation {
  file: string
  start: number
  size: number
  name: string
}

/** One layer of the chosen image: where its blob is, what it must hash to, how it is compressed. */
export interface LayerSource {
  /** The blob's digest from the manifest; a docker-archive's layer has none (only its diffID is known). */
  digest?: string
  /** The descriptor's size (OCI), else the blob's own. */
  size: number
  mediaType: string
  compression: Compression
  diffId: string
  blob: BlobLocation
}

/** The image a source and a ref/platform choose. */
export interface SourceImage {
  /** The manifest's digest (OCI); a docker-archive's: its config's digest, the image ID `docker save` names. */
  digest: string
  ref: string | null
  platform: string
  /** The image config's `config` object (Env, Entrypoint, Cmd, User, WorkingDir, Labels…), or {}. */
  config: Record<string, unknown>
  /** The whole image config's digest. */
  configDigest: string
  layers: LayerSource[]
}

export type SourceKind = 'oci' | 'oci-archive' | 'docker-archive'

/** `source` as importImage takes it: skopeo's `oci:DIR[:REF]`, `oci-archive:FILE[:REF]`, `docker-archive:FILE[:REF]`, or a path. */
export function parseSource(source: string): { kind: SourceKind | undefined; path: string; ref: string | undefined } {
  const m = /^(oci|oci-archive|docker-archive):(.*)$/s.exec(source)
  if (!m) return { kind: undefined, path: path.resolve(source), ref: undefined }
  // skopeo splits at the first colon after the transport: the reference may hold colons (alpine:3.20), the path not.
  const rest = m[2]
  const colon = rest.indexOf(':')
  const p = colon < 0 ? rest : rest.slice(0, colon)
  const ref = colon < 0 ? undefined : rest.slice(colon + 1)
  return { kind: m[1] as SourceKind, path: path.resolve(p), ref: ref === '' ? undefined : ref }
}

/** An ERR_OCI_* error naming the source. */
export function ociError(code: VmspaceErrorCode, message: string, where: string, extra: { blob?: string; expected?: string; actual?: string } = {}): VmspaceError {
  return new VmspaceError(`${code}: ${message}`, { code, path: where, ...extra })
}

/**
 * An open source: the layout directory, or the archive with its tar's entries. `close()` releases the archive's fd.
 * Blobs are found by digest (`blob`) or, in a docker-archive, by the path its manifest.json gives (`entry`).
 */
export class OciSource {
  readonly kind: SourceKind
  readonly path: string
  readonly #entries: Map<string, TarEntry> | undefined

  private constructor(kind: SourceKind, p: string, entries: Map<string, TarEntry> | undefined) {
    this.kind = kind
    this.path = p
    this.#entries = entries
  }

  /** Opens `p`: a directory is an OCI layout; a file is a tar, an oci-archive when it holds `oci-layout`, else a docker-archive. */
  static async open(kind: SourceKind | undefined, p: string): Promise<OciSource> {
    let st: fs.Stats
    try {
      st = await fs.promises.stat(p)
    } catch (e) {
      throw ociError('ERR_OCI_INVALID', `cannot read the image source ${p} (${(e as NodeJS.ErrnoException).code})`, p)
    }
    if (st.isDirectory()) {
      if (kind !== undefined && kind !== 'oci') throw ociError('ERR_OCI_INVALID', `${p} is a directory, not a ${kind} file`, p)
      const source = new OciSource('oci', p, undefined)
      await source.#checkLayout()
      return source
    }
    if (!st.isFile()) throw ociError('ERR_OCI_INVALID', `${p} is neither a directory nor a file`, p)
    if (kind === 'oci') throw ociError('ERR_OCI_INVALID', `${p} is a file, not an OCI layout directory`, p)
    const entries = await readTar(p, st.size)
    const found: SourceKind | undefined = entries.has('oci-layout') ? 'oci-archive' : entries.has('manifest.json') ? 'docker-archive' : undefined
    if (found === undefined || (kind !== undefined && kind !== found))
      throw ociError('ERR_OCI_INVALID', `${p} is not ${kind === undefined ? 'an oci-archive or a docker-archive' : `a ${kind}`} (no ${kind === 'docker-archive' ? 'manifest.json' : 'oci-layout'} in it)`, p)
    const source = new OciSource(found, p, entries)
    if (found === 'oci-archive') await source.#checkLayout()
    return source
  }

  async #checkLayout(): Promise<void> {
    const loc = this.entry('oci-layout')
    if (!loc) throw ociError('ERR_OCI_INVALID', `${this.path} is not an OCI image layout (no oci-layout file)`, this.path)
    const layout = await this.readJson(loc)
    if (layout.imageLayoutVersion !== '1.0.0')
      throw ociError('ERR_OCI_INVALID', `${this.path}: oci-layout's imageLayoutVersion is not "1.0.0"`, this.path)
  }

  /**
   * The entry `name` (relative, '/'-separated): a file of the layout directory, or an archive's member (its
   * symlinks and hard links followed inside the archive). undefined when absent. A name with `..`, an absolute
   * name, or a link that leaves the archive is ERR_OCI_INVALID.
   */
  entry(name: string): BlobLocation | undefined {
    const clean = insideName(name, this.path)
    if (this.#entries === undefined) {
      const file = path.join(this.path, clean)
      let st: fs.Stats
      try {
        st = fs.statSync(file)
      } catch {
        return undefined
      }
      return st.isFile() ? { file, start: 0, size: st.size, name: file } : undefined
    }
    let e = this.#entries.get(clean)
    for (let hops = 0; e !== undefined && e.link !== undefined; hops++) {
      if (hops === 16) throw ociError('ERR_OCI_INVALID', `${this.path}: too many links from ${name}`, this.path)
      e = this.#entries.get(insideName(e.link, this.path))
    }
    return e === undefined ? undefined : { file: this.path, start: e.offset, size: e.size, name: `${this.path}:${clean}` }
  }

  /** The blob of `digest` (`blobs/sha256/<hex>`); ERR_OCI_BLOB_MISSING when absent. */
  blob(digest: string): BlobLocation {
    const loc = this.entry(`blobs/${digest.replace(':', '/')}`)
    if (!loc) throw ociError('ERR_OCI_BLOB_MISSING', `blob ${digest} is not in ${this.path}`, this.path, { blob: digest })
    return loc
  }

  /** A whole small blob, read (at most JSON_MAX_BYTES). */
  async read(loc: BlobLocation): Promise<Buffer> {
    if (loc.size > JSON_MAX_BYTES) throw ociError('ERR_OCI_INVALID', `${loc.name} is ${loc.size} bytes, more than the ${JSON_MAX_BYTES} a JSON document may be`, this.path)
    const fh = await fs.promises.open(loc.file, 'r')
    try {
      const buf = Buffer.alloc(loc.size)
      let done = 0
      while (done < loc.size) {
        const { bytesRead } = await fh.read(buf, done, loc.size - done, loc.start + done)
        if (bytesRead === 0) break
        done += bytesRead
      }
      if (done !== loc.size) throw ociError('ERR_OCI_INVALID', `${loc.name} was cut short while it was read`, this.path)
      return buf
    } finally {
      await fh.close()
    }
  }

  /** A JSON object read from `loc`; checked against `desc` (size and digest) when given. */
  async readJson(loc: BlobLocation, desc?: Descriptor): Promise<Record<string, unknown>> {
    const value = await this.readJsonValue(loc, desc)
    if (!isPlainObject(value)) throw ociError('ERR_OCI_INVALID', `${loc.name} is not a JSON object`, this.path)
    return value
  }

  /** A JSON value read from `loc`; checked against `desc` (size and digest) when given. */
  async readJsonValue(loc: BlobLocation, desc?: Descriptor): Promise<unknown> {
    if (desc !== undefined && loc.size !== desc.size)
      throw ociError('ERR_OCI_DIGEST_MISMATCH', `blob ${desc.digest} is ${loc.size} bytes, its descriptor says ${desc.size}`, this.path, { blob: desc.digest, expected: String(desc.size), actual: String(loc.size) })
    const buf = await this.read(loc)
    if (desc !== undefined) {
      const actual = 'sha256:' + crypto.createHash('sha256').update(buf).digest('hex')
      if (actual !== desc.digest)
        throw ociError('ERR_OCI_DIGEST_MISMATCH', `blob ${desc.digest} hashes to ${actual}`, this.path, { blob: desc.digest, expected: desc.digest, actual })
    }
    let value: unknown
    try {
      value = JSON.parse(buf.toString('utf8')) as unknown
    } catch {
      throw ociError('ERR_OCI_INVALID', `${loc.name} is not JSON`, this.path)
    }
    if (jsonDepth(value) > JSON_DEPTH_MAX) throw ociError('ERR_OCI_INVALID', `${loc.name} nests deeper than ${JSON_DEPTH_MAX}`, this.path)
    return value
  }
}

// How deep a JSON document may nest: the config is stored in template.json and handed back, by code that recurses
// (a few KB of brackets overflowed the stack: a RangeError, after a layer was built). Real ones nest a few levels.
const JSON_DEPTH_MAX = 64

/** How deep `value` nests (a scalar 0), walked without recursion. */
function jsonDepth(value: unknown): number {
  let max = 0
  const stack: [unknown, number][] = [[value, 0]]
  while (stack.length > 0) {
    const [v, depth] = stack.pop()!
    if (v === null || typeof v !== 'object') continue
    max = Math.max(max, depth + 1)
    if (max > JSON_DEPTH_MAX) return max
    for (const child of Object.values(v)) stack.push([child, depth + 1])
  }
  return max
}

/** `name` as a path inside the source: relative, no `..`, no empty components past a leading `./`. */
function insideName(name: string, where: string): string {
  const clean = path.posix.normalize(name.replace(/^(\.\/)+/, ''))
  if (name === '' || name.includes('\0') || path.posix.isAbsolute(name) || clean === '..' || clean.startsWith('../') || clean === '.')
    throw ociError('ERR_OCI_INVALID', `${where}: the path ${JSON.stringify(name)} leaves the image source`, where)
  return clean
}

/** `value` as a descriptor, or ERR_OCI_INVALID naming `what`. */
export function descriptor(value: unknown, what: string, where: string): Descriptor {
  const bad = (why: string) => ociError('ERR_OCI_INVALID', `${where}: ${what} ${why}`, where)
  if (!isPlainObject(value)) throw bad('is not a JSON object')
  const { mediaType, digest, size, platform, annotations } = value
  if (typeof mediaType !== 'string' || mediaType.length > 255) throw bad('has no mediaType')
  if (typeof digest !== 'string' || !DIGEST.test(digest)) throw bad(`has a digest that is not sha256:<64 lowercase hex> (${JSON.stringify(digest)?.slice(0, 80)})`)
  if (typeof size !== 'number' || !Number.isSafeInteger(size) || size < 0) throw bad('has no size (a non-negative integer)')
  const d: Descriptor = { mediaType, digest, size }
  if (platform !== undefined) d.platform = platformOf(platform, `${what}'s platform`, where)
  if (annotations !== undefined) {
    if (!isPlainObject(annotations) || !Object.values(annotations).every((v) => typeof v === 'string')) throw bad('has annotations that are not strings')
    d.annotations = annotations as Record<string, string>
  }
  return d
}

function platformOf(value: unknown, what: string, where: string): Platform {
  if (!isPlainObject(value) || typeof value.os !== 'string' || typeof value.architecture !== 'string')
    throw ociError('ERR_OCI_INVALID', `${where}: ${what} has no os and architecture`, where)
  const p: Platform = { os: value.os, architecture: value.architecture }
  if (typeof value.variant === 'string' && value.variant !== '') p.variant = value.variant
  return p
}

/** The host's platform as the OCI image spec spells it (Go's GOOS/GOARCH), with the arm variant. */
export function hostPlatform(): string {
  const arch: Record<string, string> = { x64: 'amd64', ia32: '386', arm64: 'arm64', arm: 'arm', ppc64: 'ppc64le', s390x: 's390x', riscv64: 'riscv64', loong64: 'loong64', mips64el: 'mips64le' }
  const a = arch[process.arch] ?? process.arch
  if (a !== 'arm') return `linux/${a}`
  const v = (process.config.variables as { arm_version?: string }).arm_version
  return `linux/arm${v ? `/v${v}` : ''}`
}

/** `os/arch[/variant]` parsed. */
export function parsePlatform(value: string): Platform {
  const [os, architecture, variant, ...rest] = value.split('/')
  if (!os || !architecture || rest.length > 0 || variant === '') throw new Error('bad platform')
  return variant === undefined ? { os, architecture } : { os, architecture, variant }
}

export function platformText(p: Platform): string {
  return `${p.os}/${p.architecture}${p.variant ? `/${p.variant}` : ''}`
}

/** Whether `have` serves a request for `want`: os and architecture equal; the variant too when `want` names one (arm64's absent variant is v8). */
function platformMatches(want: Platform, have: Platform): boolean {
  if (want.os !== have.os || want.architecture !== have.architecture) return false
  if (want.variant === undefined) return true
  const norm = (p: Platform) => p.variant ?? (p.architecture === 'arm64' ? 'v8' : undefined)
  return norm(want) === norm(have)
}

/** A manifest descriptor found in the index tree, with the ref of the top-level entry it came from. */
interface Candidate {
  desc: Descriptor
  ref: string | null
}

/**
 * Chooses the image of an OCI layout (a directory or an oci-archive): index.json's entries of `ref` (all when none
 * is given and they share one ref or have none), nested indexes followed, then the manifest for `platform`.
 * ERR_OCI_REF when the ref is absent or needed; ERR_OCI_PLATFORM when no manifest is for the platform.
 */
export async function chooseOciImage(src: OciSource, ref: string | undefined, platform: Platform): Promise<SourceImage> {
  const indexLoc = src.entry('index.json')
  if (!indexLoc) throw ociError('ERR_OCI_INVALID', `${src.path} has no index.json`, src.path)
  const top = indexEntries(await src.readJson(indexLoc), 'index.json', src.path)
  const refOf = (d: Descriptor) => d.annotations?.[REF_ANNOTATION] ?? null
  const refs = [...new Set(top.map(refOf).filter((r): r is string => r !== null))]
  let chosen = top
  if (ref !== undefined) {
    chosen = top.filter((d) => refOf(d) === ref)
    if (chosen.length === 0) throw ociError('ERR_OCI_REF', `no image of the ref '${ref}' in ${src.path} (refs there: ${refs.join(', ') || 'none'})`, src.path)
  } else if (refs.length > 1) {
    throw ociError('ERR_OCI_REF', `${src.path} holds several images: give one of the refs ${refs.join(', ')}`, src.path)
  }
  const candidates: Candidate[] = []
  const seen = new Set<string>()
  for (const d of chosen) await expandIndex(src, d, refOf(d), 0, candidates, seen)
  const fitting = candidates.filter((c) => c.desc.platform === undefined || platformMatches(platform, c.desc.platform))
  for (const c of fitting) {
    const image = await readOciManifest(src, c)
    if (platformMatches(platform, image.platformOf)) return { ...image.image, platform: platformText(image.platformOf) }
    if (fitting.length === 1 && candidates.length === 1)
      throw ociError('ERR_OCI_PLATFORM', `no manifest for ${platformText(platform)} in ${src.path} (there: ${platformText(image.platformOf)})`, src.path)
  }
  const there = candidates.map((c) => (c.desc.platform ? platformText(c.desc.platform) : c.desc.digest)).join(', ')
  throw ociError('ERR_OCI_PLATFORM', `no manifest for ${platformText(platform)} in ${src.path} (there: ${there || 'none'})`, src.path)
}

/** The `manifests` of an index document, each a descriptor. */
function indexEntries(doc: Record<string, unknown>, what: string, where: string): Descriptor[] {
  if (doc.schemaVersion !== 2) throw ociError('ERR_OCI_INVALID', `${where}: ${what} has schemaVersion ${JSON.stringify(doc.schemaVersion)}, not 2`, where)
  if (doc.mediaType !== undefined && !INDEX_TYPES.includes(doc.mediaType as string))
    throw ociError('ERR_OCI_INVALID', `${where}: ${what} has the mediaType ${JSON.stringify(doc.mediaType)}, not an image index's`, where)
  if (!Array.isArray(doc.manifests)) throw ociError('ERR_OCI_INVALID', `${where}: ${what} has no manifests array`, where)
  return doc.manifests.map((m, i) => descriptor(m, `${what}'s manifests[${i}]`, where))
}

async function expandIndex(src: OciSource, d: Descriptor, ref: string | null, depth: number, out: Candidate[], seen: Set<string>): Promise<void> {
  // Each document once: indexes listing one index many times over would otherwise be read (and their manifests
  // tried) as many times as the product of their lengths.
  if (seen.has(d.digest)) return
  seen.add(d.digest)
  if (MANIFEST_TYPES.includes(d.mediaType)) {
    out.push({ desc: d, ref })
    return
  }
  if (!INDEX_TYPES.includes(d.mediaType))
    throw ociError('ERR_OCI_INVALID', `${src.path}: ${d.digest} has the mediaType ${d.mediaType}, neither a manifest's nor an index's`, src.path)
  if (depth >= INDEX_DEPTH) throw ociError('ERR_OCI_INVALID', `${src.path}: indexes nest deeper than ${INDEX_DEPTH}`, src.path)
  const doc = await src.readJson(src.blob(d.digest), d)
  for (const inner of indexEntries(doc, `index ${d.digest}`, src.path)) await expandIndex(src, inner, ref, depth + 1, out, seen)
}

/** A manifest and its config read and checked: the image, and the platform its config declares. */
async function readOciManifest(src: OciSource, c: Candidate): Promise<{ image: Omit<SourceImage, 'platform'>; platformOf: Platform }> {
  const where = src.path
  const m = await src.readJson(src.blob(c.desc.digest), c.desc)
  const what = `manifest ${c.desc.digest}`
  if (m.schemaVersion !== 2) throw ociError('ERR_OCI_INVALID', `${where}: ${what} has schemaVersion ${JSON.stringify(m.schemaVersion)}, not 2`, where)
  if (m.mediaType !== undefined && m.mediaType !== c.desc.mediaType)
    throw ociError('ERR_OCI_INVALID', `${where}: ${what} has the mediaType ${JSON.stringify(m.mediaType)}, its descriptor ${c.desc.mediaType}`, where)
  const configDesc = descriptor(m.config, `${what}'s config`, where)
  if (!CONFIG_TYPES.includes(configDesc.mediaType))
    throw ociError('ERR_OCI_INVALID', `${where}: ${what}'s config has the mediaType ${configDesc.mediaType}, not an image config's`, where)
  if (!Array.isArray(m.layers)) throw ociError('ERR_OCI_INVALID', `${where}: ${what} has no layers array`, where)
  if (m.layers.length > LAYERS_MAX) throw ociError('ERR_OCI_INVALID', `${where}: ${what} has ${m.layers.length} layers, more than ${LAYERS_MAX}`, where)
  const layerDescs = m.layers.map((l, i) => descriptor(l, `${what}'s layers[${i}]`, where))
  const config = await src.readJson(src.blob(configDesc.digest), configDesc)
  const { diffIds, platformOf, settings } = imageConfig(config, `config ${configDesc.digest}`, where)
  if (diffIds.length !== layerDescs.length)
    throw ociError('ERR_OCI_INVALID', `${where}: ${what} has ${layerDescs.length} layers, its config ${diffIds.length} diff_ids`, where)
  const layers = layerDescs.map((d, i): LayerSource => {
    const compression = LAYER_TYPES[d.mediaType]
    if (compression === undefined) throw ociError('ERR_OCI_MEDIA_TYPE', `${where}: layer ${d.digest} has the media type ${d.mediaType}, which is not supported (tar, tar+gzip, tar+zstd)`, where)
    return { digest: d.digest, size: d.size, mediaType: d.mediaType, compression, diffId: diffIds[i], blob: { file: '', start: 0, size: -1, name: d.digest } }
  })
  return { image: { digest: c.desc.digest, ref: c.ref, config: settings, configDigest: configDesc.digest, layers }, platformOf }
}

/** An image config's diff_ids, platform and `config` object, checked. */
export function imageConfig(config: Record<string, unknown>, what: string, where: string): { diffIds: string[]; platformOf: Platform; settings: Record<string, unknown> } {
  const platformOf = configPlatform(config, what, where)
  const rootfs = config.rootfs
  if (!isPlainObject(rootfs) || rootfs.type !== 'layers' || !Array.isArray(rootfs.diff_ids))
    throw ociError('ERR_OCI_INVALID', `${where}: ${what} has no rootfs of type "layers" with diff_ids`, where)
  const diffIds = rootfs.diff_ids.map((d) => {
    if (typeof d !== 'string' || !DIGEST.test(d)) throw ociError('ERR_OCI_INVALID', `${where}: ${what} has a diff_id that is not sha256:<64 lowercase hex>`, where)
    return d
  })
  if (config.config !== undefined && config.config !== null && !isPlainObject(config.config))
    throw ociError('ERR_OCI_INVALID', `${where}: ${what}'s config member is not an object`, where)
  const settings = isPlainObject(config.config) ? config.config : {}
  return { diffIds, platformOf, settings }
}

function configPlatform(config: Record<string, unknown>, what: string, where: string): Platform {
  return platformOf({ os: config.os, architecture: config.architecture, variant: config.variant }, what, where)
}

/**
 * Chooses the image of a docker-archive: manifest.json's entry whose RepoTags hold `ref` (the only entry when none
 * is given), its config and layer paths checked to stay inside the archive, its platform checked.
 */
export async function chooseDockerImage(src: OciSource, ref: string | undefined, platform: Platform): Promise<SourceImage> {
  const where = src.path
  const doc = await src.readJsonValue(src.entry('manifest.json')!)
  if (!Array.isArray(doc) || doc.length === 0) throw ociError('ERR_OCI_INVALID', `${where}: manifest.json is not a non-empty array`, where)
  const entries = doc.map((e, i) => dockerEntry(e, i, where))
  const tags = entries.flatMap((e) => e.tags)
  const short = (t: string) => t.replace(/^docker\.io\/(library\/)?/, '')
  let entry = entries[0]
  let chosenRef: string | null = entries[0].tags[0] ?? null
  if (ref !== undefined) {
    const found = entries.find((e) => e.tags.some((t) => t === ref || short(t) === ref))
    if (!found) throw ociError('ERR_OCI_REF', `no image of the ref '${ref}' in ${where} (refs there: ${tags.join(', ') || 'none'})`, where)
    entry = found
    chosenRef = ref
  } else if (entries.length > 1) {
    throw ociError('ERR_OCI_REF', `${where} holds several images: give one of the refs ${tags.join(', ') || '(none tagged)'}`, where)
  }
  const configLoc = src.entry(entry.config)
  if (!configLoc) throw ociError('ERR_OCI_BLOB_MISSING', `the config ${entry.config} is not in ${where}`, where, { blob: entry.config })
  const configBytes = await src.read(configLoc)
  const configDigest = 'sha256:' + crypto.createHash('sha256').update(configBytes).digest('hex')
  const config = await src.readJson(configLoc)
  const { diffIds, platformOf, settings } = imageConfig(config, `config ${entry.config}`, where)
  if (!platformMatches(platform, platformOf))
    throw ociError('ERR_OCI_PLATFORM', `no manifest for ${platformText(platform)} in ${where} (there: ${platformText(platformOf)})`, where)
  if (diffIds.length !== entry.layers.length)
    throw ociError('ERR_OCI_INVALID', `${where}: manifest.json lists ${entry.layers.length} layers, the config ${diffIds.length} diff_ids`, where)
  const layers = entry.layers.map((name, i): LayerSource => {
    const blob = src.entry(name)
    if (!blob) throw ociError('ERR_OCI_BLOB_MISSING', `the layer ${name} is not in ${where}`, where, { blob: name })
    return { size: blob.size, mediaType: 'application/vnd.docker.image.rootfs.diff.tar', compression: 'sniff', diffId: diffIds[i], blob }
  })
  return { digest: configDigest, ref: chosenRef, platform: platformText(platformOf), config: settings, configDigest, layers }
}

function dockerEntry(e: unknown, i: number, where: string): { config: string; tags: string[]; layers: string[] } {
  const bad = (why: string) => ociError('ERR_OCI_INVALID', `${where}: manifest.json[${i}] ${why}`, where)
  if (!isPlainObject(e)) throw bad('is not an object')
  if (typeof e.Config !== 'string') throw bad('has no Config path')
  if (!Array.isArray(e.Layers) || !e.Layers.every((l) => typeof l === 'string')) throw bad('has no Layers array of paths')
  if (e.Layers.length > LAYERS_MAX) throw bad(`has ${e.Layers.length} layers, more than ${LAYERS_MAX}`)
  const tags = e.RepoTags ?? []
  if (!Array.isArray(tags) || !tags.every((t) => typeof t === 'string')) throw bad('has RepoTags that are not strings')
  for (const p of [e.Config, ...e.Layers]) insideName(p, where)
  return { config: e.Config, tags, layers: e.Layers as string[] }
}

/** Opens `source` and chooses its image; the layers' blobs located (ERR_OCI_BLOB_MISSING for one absent). */
export async function openImage(source: string, ref: string | undefined, platform: Platform): Promise<{ src: OciSource; image: SourceImage }> {
  const parsed = parseSource(source)
  if (parsed.ref !== undefined && ref !== undefined && parsed.ref !== ref)
    throw ociError('ERR_OCI_REF', `the source names the ref '${parsed.ref}' and options.ref '${ref}'`, parsed.path)
  const src = await OciSource.open(parsed.kind, parsed.path)
  const want = ref ?? parsed.ref
  const image = src.kind === 'docker-archive' ? await chooseDockerImage(src, want, platform) : await chooseOciImage(src, want, platform)
  return { src, image }
}

/** Locates every layer blob of an OCI image (docker-archive layers are located already). */
export function locateLayers(src: OciSource, image: SourceImage): void {
  for (const l of image.layers) if (l.digest !== undefined && l.blob.size < 0) l.blob = src.blob(l.digest)
}

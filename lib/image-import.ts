/**
 * Pool.importImage, Pool.images and Pool.removeImage (docs/images.md). An image becomes one layer template per
 * layer, keyed by its chainID (`.vmspace/templates/layers/<algo>-<hex>`), each built in staging from its parent
 * layer's tree with the layer applied by the addon while the blob streams (lib/oci-stream.ts verifies it), and
 * published only once both digests checked; then one named image template from the top layer's tree ('tree') or
 * holding `rootfs.ext4` made from it by mke2fs ('ext4'). The source is read by lib/oci.ts.
 */
import * as crypto from 'node:crypto'
import * as fs from 'node:fs'
import * as net from 'node:net'
import * as path from 'node:path'
import { abortSignal, boolean, ID, integerIn, invalidType, invalidValue, oneOf, optionsObject } from './args.js'
import { jsonMembers, native, type BuildHandle, type PoolHandle, type ProgressHandle } from './binding.js'
import { AbortError, call, errnoError, VmspaceError } from './errors.js'
import { runOk } from './image.js'
import { templateMetaPath, templateNamePath, templatesPath } from './layout.js'
import { hostPlatform, locateLayers, openImage, parsePlatform, type LayerSource, type OciSource, type Platform, type SourceImage } from './oci.js'
import { streamLayer, type LayerDigests } from './oci-stream.js'
import { templateInfo, templateName, unlistedLayers } from './template.js'
import type { ImageLayer, ImageTemplate, ImportImageOptions, JsonObject, Reflink, Template } from './types.js'


/** The default free space an ext4 image has beyond its tree: 128 MiB. */
export const EXT4_HEADROOM_BYTES = 128 * 2 ** 20

/** The Pool's parts an import uses. */
export interface ImportHost {
  handle: PoolHandle
  root: string
  reflink: Reflink
  durable: boolean
  templates(): Promise<Template[]>
  /** Tracks a call as in flight (close() waits for it). */
  track<T>(p: Promise<T>): Promise<T>
}

interface CheckedImport {
  ref: string | undefined
  platform: Platform
  name: string | undefined
  format: 'tree' | 'ext4'
  replace: boolean
  headroom: number
  signal: AbortSignal | undefined
  onProgress: ((p: { bytes: number; totalBytes: number }) => void) | undefined
}

/** importImage's arguments, checked (nothing is read yet). */
export function importOptions(source: unknown, options: ImportImageOptions | undefined): CheckedImport {
  if (typeof source !== 'string') throw invalidType('source', 'a path or oci:DIR[:REF], oci-archive:FILE[:REF], docker-archive:FILE[:REF]', source)
  if (source === '' || source.includes('\0')) throw invalidValue('source', 'a non-empty path without NUL bytes', source)
  const o = optionsObject<ImportImageOptions>('options', options, {
    ref: true, platform: true, name: true, format: true, replace: true, ext4: true, signal: true, onProgress: true,
  })
  if (o.ref !== undefined && (typeof o.ref !== 'string' || o.ref === '' || o.ref.length > 255))
    throw invalidType('options.ref', 'a non-empty string of up to 255 characters', o.ref)
  let platform: Platform
  if (o.platform === undefined) platform = parsePlatform(hostPlatform())
  else if (typeof o.platform !== 'string') throw invalidType('options.platform', "a string 'os/architecture[/variant]'", o.platform)
  else {
    try {
      platform = parsePlatform(o.platform)
    } catch {
      throw invalidValue('options.platform', "'os/architecture[/variant]'", o.platform)
    }
  }
  const name = templateName('options.name', o.name)
  const format = oneOf('options.format', o.format, ['tree', 'ext4'] as const, 'tree')
  const ext4 = optionsObject<NonNullable<ImportImageOptions['ext4']>>('options.ext4', o.ext4, { headroomBytes: true })
  if (o.ext4 !== undefined && format !== 'ext4') throw invalidValue('options.ext4', "nothing unless format is 'ext4'", o.ext4)
  const headroom = integerIn('options.ext4.headroomBytes', ext4.headroomBytes, 0, Number.MAX_SAFE_INTEGER, EXT4_HEADROOM_BYTES)
  if (o.onProgress !== undefined && typeof o.onProgress !== 'function') throw invalidType('options.onProgress', 'a function', o.onProgress)
  return {
    ref: o.ref, platform, name, format, replace: boolean('options.replace', o.replace, false), headroom,
    signal: abortSignal('options.signal', o.signal), onProgress: o.onProgress,
  }
}

/** A template name from a ref: every character outside `[A-Za-z0-9._-]` made `-`, a leading one dropped. */
export function nameOfRef(ref: string): string {
  const name = ref.replace(/[^A-Za-z0-9._-]/g, '-').replace(/^[^A-Za-z0-9]+/, '').slice(0, 128)
  return ID.test(name) ? `image-${name}` : name
}

/** ChainIDs of `diffIds` (image-spec config.md): ChainID(L0) = DiffID(L0), ChainID(Ln) = sha256(ChainID(Ln-1) + " " + DiffID(Ln)). */
export function chainIds(diffIds: string[]): string[] {
  const out: string[] = []
  for (const d of diffIds) out.push(out.length === 0 ? d : 'sha256:' + crypto.createHash('sha256').update(`${out[out.length - 1]} ${d}`).digest('hex'))
  return out
}

/** A chainID as a layer link's name: `sha256:abc…` is `sha256-abc…`. */
const layerKey = (chainId: string) => chainId.replace(':', '-')

/** Pool.importImage. */
export async function importImage(host: ImportHost, source: unknown, options: ImportImageOptions | undefined): Promise<ImageTemplate> {
  const o = importOptions(source, options)
  if (process.geteuid?.() !== 0)
    throw new VmspaceError('ERR_OCI_NOT_PERMITTED: importing an image needs root (its layers set owners, device nodes and capabilities); nothing made', { code: 'ERR_OCI_NOT_PERMITTED', path: host.root })
  if (o.signal?.aborted) throw new AbortError(o.signal.reason)
  const { src, image } = await openImage(source as string, o.ref, o.platform)
  const name = o.name ?? (image.ref !== null ? nameOfRef(image.ref) : undefined)
  if (name === undefined || name === '')
    throw new VmspaceError(`ERR_OCI_REF: the image in ${src.path} has no ref to name its template after: give options.name`, { code: 'ERR_OCI_REF', path: src.path })
  const chains = chainIds(image.layers.map((l) => l.diffId))
  const existing = await sameImage(host, name, image, o.format)
  if (existing) return reusedImage(existing, chains)
  if (existing === null && !o.replace) throw nameTaken(host, name)
  const progress = native.newProgress()
  const onAbort = () => native.cancelProgress(progress)
  o.signal?.addEventListener('abort', onAbort, { once: true })
  const built: string[] = []
  try {
    return await withRetry(o.signal, async () => {
      const { topId, layers } = await buildChain(host, src, image, chains, progress, o, built)
      return publishImage(host, { ...o, name }, image, topId, layers, progress)
    })
  } catch (e) {
    await discardLayers(host, built)
    if (o.signal?.aborted) throw new AbortError(o.signal.reason)
    throw e
  } finally {
    o.signal?.removeEventListener('abort', onAbort)
  }
}

/** The current template named `name`: the image template of this image (same digest and format), null for another one, undefined for none. */
async function sameImage(host: ImportHost, name: string, image: SourceImage, format: string): Promise<Template | null | undefined> {
  const t = (await host.templates()).find((x) => x.current && x.name === name)
  if (!t) return undefined
  return t.image && t.image.digest === image.digest && t.image.format === format && t.image.platform === image.platform ? t : null
}

function nameTaken(host: ImportHost, name: string): VmspaceError {
  const e = errnoError(17, 'symlinkat', templateNamePath(host.root, name))
  e.message = `EEXIST: a template named '${name}' holds another image or none (pass replace: true to replace it), symlinkat '${e.path}'`
  return e
}

/** An existing image template as a re-import returns it: every layer reused. */
function reusedImage(t: Template, chains: string[]): ImageTemplate {
  const image = t.image!
  const layers: ImageLayer[] = image.layers.map((l, i) => ({ digest: l.digest, diffId: l.diffId, chainId: l.chainId ?? chains[i], size: l.size, reused: true, bytes: 0 }))
  return { ...t, image: { ...image, layers } }
}

/**
 * `build`, again when it failed with ERR_TEMPLATE_NOT_FOUND (at most 3 times): a layer template removed (a prune, a
 * removeImage) between its publish or lookup and the build of what stands on it; the chain is then walked again.
 */
async function withRetry<T>(signal: AbortSignal | undefined, build: () => Promise<T>): Promise<T> {
  for (let attempt = 0; ; attempt++) {
    try {
      return await build()
    } catch (e) {
      if ((e as VmspaceError).code !== 'ERR_TEMPLATE_NOT_FOUND' || attempt === 2 || signal?.aborted) throw e
    }
  }
}

/**
 * A failed import's layer templates, removed (newest first) so that nothing it published stays: those it built
 * itself (`built`), unless an image lists one by now or someone reads it (another import building on it keeps it,
 * removeTemplate's unlessCurrent). Never throws: the import's own error is the one reported.
 */
async function discardLayers(host: ImportHost, built: string[]): Promise<void> {
  if (built.length === 0) return
  try {
    const templates = await host.templates()
    const listed = new Set(templates.flatMap((t) => (t.image && !t.retired ? t.image.layers.map((l) => l.chainId) : [])))
    const all = new Map(templates.map((t) => [t.id, t]))
    for (const id of [...built].reverse()) {
      const chainId = all.get(id)?.layer?.chainId
      if (chainId !== undefined && listed.has(chainId)) continue
      await call(host.track(native.removeTemplate(host.handle, id, true))).catch(() => {})
    }
  } catch {
    // The pool closed or its templates are unreadable: what is left is unlisted, and pruneTemplates removes it.
  }
}

/** The layer templates of `image`, lowest first: each found by its chainID, or built and published (ids in `built`). */
async function buildChain(
  host: ImportHost, src: OciSource, image: SourceImage, chains: string[], progress: ProgressHandle, o: CheckedImport, built: string[],
) {
  const found = await Promise.all(chains.map((c) => call(host.track(native.findLayer(host.handle, layerKey(c))))))
  const missing = image.layers.filter((_, i) => found[i] === null)
  locateLayers(src, { ...image, layers: missing })
  const totalBytes = missing.reduce((n, l) => n + l.size, 0)
  let bytes = 0
  let rejected: { error: unknown } | undefined
  const onBytes = (n: number) => {
    bytes += n
    // A throw (or an async callback's rejection, at the next chunk) fails the import with what it threw.
    if (rejected) throw rejected.error
    const r = o.onProgress?.({ bytes, totalBytes }) as unknown
    if (typeof (r as PromiseLike<void> | undefined)?.then === 'function') (r as PromiseLike<void>).then(undefined, (error) => (rejected ??= { error }))
  }
  const layers: ImageLayer[] = []
  let parent = ''
  for (const [i, layer] of image.layers.entries()) {
    const before = bytes
    const reused = found[i] !== null
    let id = found[i]
    if (id === null) {
      const r = await buildLayer(host, parent, layer, chains[i], progress, onBytes, o.signal)
      if (!r.existing) built.push(r.id)
      id = r.id
    }
    parent = id
    layers.push({ digest: layer.digest ?? '', diffId: layer.diffId, chainId: chains[i], size: layer.size, reused, bytes: bytes - before })
  }
  return { topId: parent, layers }
}

/** One layer template built on `parent` ('' for none) from `layer`'s blob: its id (`existing`: another process's, published first). */
async function buildLayer(
  host: ImportHost, parent: string, layer: LayerSource, chainId: string, progress: ProgressHandle, onBytes: (n: number) => void, signal: AbortSignal | undefined,
): Promise<{ id: string; existing: boolean }> {
  const b = await call(host.track(native.templateBuildStart(host.handle, { parent, reflink: host.reflink, durable: host.durable, progress })))
  try {
    const d = await applyLayer(b.build, layer, progress, onBytes, host.durable, signal)
    if (signal?.aborted) throw new AbortError(signal.reason)
    layer.digest ??= d.digest // a docker-archive's blob: its digest is what it hashed to
    const record = { chainId, diffId: d.diffId, digest: d.digest, mediaType: layer.mediaType, size: d.bytes }
    const info = jsonMembers({ format: 1, createdAt: Date.now(), parent: parent || undefined, layer: record })
    const r = await call(host.track(native.templateBuildPublish(b.build, { info, layerKey: layerKey(chainId) })))
    return r
  } catch (e) {
    await native.templateBuildAbandon(b.build)
    throw e
  }
}

/**
 * Streams `layer` through a pipe into the applier. The error reported: the blob's (a digest mismatch, a decoder's
 * failure, an abort) when the stream failed on its own side; the applier's when it failed first (the stream then
 * meets EPIPE).
 */
async function applyLayer(
  build: BuildHandle, layer: LayerSource, progress: ProgressHandle, onBytes: (n: number) => void, durable: boolean, signal: AbortSignal | undefined,
): Promise<LayerDigests> {
  const [readFd, writeFd] = native.pipe()
  let out: net.Socket
  try {
    out = new net.Socket({ fd: writeFd, readable: false, writable: true })
  } catch (e) {
    fs.closeSync(readFd)
    fs.closeSync(writeFd)
    throw e
  }
  const [applied, streamed] = await Promise.allSettled([call(native.layerApply(build, readFd, { progress, durable })), streamLayer(layer, out, onBytes, signal)])
  if (streamed.status === 'rejected' && (streamed.reason as { code?: string }).code !== 'EPIPE') throw streamed.reason
  if (applied.status === 'rejected') throw applied.reason
  if (streamed.status === 'rejected') throw streamed.reason
  return streamed.value
}

/** The named image template: the top layer's tree ('tree'), or an empty tree holding rootfs.ext4 ('ext4'). */
async function publishImage(
  host: ImportHost, o: CheckedImport & { name: string }, image: SourceImage, topId: string, layers: ImageLayer[], progress: ProgressHandle,
): Promise<ImageTemplate> {
  const record = {
    digest: image.digest, ref: image.ref, platform: image.platform, format: o.format, config: image.config as JsonObject,
    layers: layers.map(({ digest, diffId, chainId, size }) => ({ digest, diffId, chainId, size })),
  }
  const info = jsonMembers({ format: 1, createdAt: Date.now(), parent: topId || undefined, image: record })
  const b = await call(host.track(native.templateBuildStart(host.handle, { parent: o.format === 'tree' ? topId : '', reflink: host.reflink, durable: host.durable, progress })))
  let r
  try {
    if (o.format === 'ext4') await writeExt4(host, topId, b.treePath, o.headroom, progress, o.signal)
    if (o.signal?.aborted) throw new AbortError(o.signal.reason)
    r = await call(host.track(native.templateBuildPublish(b.build, { info, name: o.name, replace: o.replace })))
  } catch (e) {
    await native.templateBuildAbandon(b.build)
    // Another importer published the same image under the name first: theirs is the result.
    const same = (e as VmspaceError).code === 'EEXIST' && !o.replace ? await sameImage(host, o.name, image, o.format) : undefined
    if (same) return reusedImage(same, layers.map((l) => l.chainId))
    throw e
  }
  const metaPath = templateMetaPath(host.root, r.id)
  const t = templateInfo(host.root, { id: r.id, currentName: o.name, lastUsedMs: 0, retired: false, recordPath: metaPath, record: r.record })
  t.lastUsedAt = t.createdAt ?? null
  return { ...t, image: { ...record, layers } }
}

/** What mke2fs -d needs for `tree`: bytes of data (each file's in whole blocks, hard links once) and inodes. */
async function treeNeeds(tree: string): Promise<{ dataBytes: number; inodes: number }> {
  const block = 4096
  const seen = new Set<number>()
  let dataBytes = 0
  let inodes = 1
  const walk = async (dir: string): Promise<void> => {
    const names = await fs.promises.readdir(dir)
    // A directory's entries: ~ 8 bytes of header and the name each, in whole blocks.
    dataBytes += Math.max(block, Math.ceil(names.reduce((n, x) => n + 12 + Buffer.byteLength(x), 24) / block) * block)
    for (const name of names) {
      const p = path.join(dir, name)
      const st = await fs.promises.lstat(p, { bigint: false })
      if (st.nlink > 1 && !st.isDirectory()) {
        if (seen.has(st.ino)) continue
        seen.add(st.ino)
      }
      inodes++
      if (st.isDirectory()) await walk(p)
      else if (st.isFile() || (st.isSymbolicLink() && st.size > 59)) dataBytes += Math.ceil(st.size / block) * block
    }
  }
  await walk(tree)
  return { dataBytes, inodes }
}

/**
 * `rootfs.ext4` in `destDir`, made by mke2fs -d from a clone of the top layer's tree (a staging build, removed
 * after): sized from the tree (data in whole blocks, inode tables, a 10 % margin for block groups' metadata, the
 * journal) plus `headroom`, after a check that the file system has that much free.
 */
async function writeExt4(host: ImportHost, topId: string, destDir: string, headroom: number, progress: ProgressHandle, signal: AbortSignal | undefined): Promise<void> {
  const b = await call(host.track(native.templateBuildStart(host.handle, { parent: topId, reflink: host.reflink, durable: host.durable, progress })))
  try {
    const { dataBytes, inodes } = await treeNeeds(b.treePath)
    const inodeCount = inodes + Math.ceil(headroom / 16384) + 64
    const MiB = 2 ** 20
    // Everything but the journal, at least 16 MiB; the journal is a quarter of that up to 64 MiB (mke2fs refuses a
    // journal of more than half the file system), at least mke2fs's minimum of 1024 blocks.
    const base = Math.max(16 * MiB, Math.ceil((dataBytes + inodeCount * 256) * 1.1) + headroom + 4 * MiB)
    const journalMiB = Math.min(64, Math.max(4, Math.floor(base / 4 / MiB)))
    const size = Math.ceil((base + journalMiB * MiB) / MiB) * MiB
    const fsStat = await fs.promises.statfs(destDir)
    const free = fsStat.bavail * fsStat.bsize
    if (free < size) {
      const e = errnoError(28, 'statfs', destDir)
      e.message = `ENOSPC: rootfs.ext4 needs ${size} bytes and the file system has ${free} free, statfs '${destDir}'`
      throw e
    }
    const file = path.join(destDir, 'rootfs.ext4')
    const fh = await fs.promises.open(file, 'wx', 0o644)
    try {
      await fh.truncate(size)
    } finally {
      await fh.close()
    }
    const args = ['-q', '-F', '-t', 'ext4', '-b', '4096', '-m', '0', '-N', String(inodeCount), '-J', `size=${journalMiB}`, '-E', 'root_owner=0:0', '-d', b.treePath, file]
    await runOk('mke2fs', args, file, signal)
  } finally {
    await native.templateBuildAbandon(b.build)
  }
}

/** Pool.images: the current image templates, oldest first (each layer as a re-import reports it: reused). */
export async function listImages(host: ImportHost): Promise<ImageTemplate[]> {
  return (await host.templates()).filter((t) => t.image && t.current).map((t) => reusedImage(t, []))
}

/**
 * Pool.removeImage: the image template `nameOrId`, then the layer templates that no remaining image lists.
 * ERR_TEMPLATE_NOT_FOUND when there is no image template of that name or id.
 */
export async function removeImage(
  host: ImportHost, nameOrId: string, remove: (id: string) => Promise<{ id: string; removed: boolean }>,
): Promise<{ removed: string[] }> {
  const all = await host.templates()
  const byId = ID.test(nameOrId)
  const t = all.find((x) => x.image && !x.retired && (byId ? x.id === nameOrId : x.current && x.name === nameOrId))
  if (!t)
    throw new VmspaceError(`ERR_TEMPLATE_NOT_FOUND: no image template with the id or name '${nameOrId}'`, { code: 'ERR_TEMPLATE_NOT_FOUND', path: templatesPath(host.root) })
  await remove(t.id)
  const removed = [t.id]
  for (const layer of unlistedLayers(all.filter((x) => x.id !== t.id))) {
    try {
      await remove(layer.id)
      removed.push(layer.id)
    } catch (e) {
      if ((e as VmspaceError).code !== 'ERR_TEMPLATE_NOT_FOUND') throw e // removed meanwhile by someone else
    }
  }
  return { removed }
}

/**
 * `vmspace image import ROOT SOURCE …`, `vmspace image ls ROOT`, `vmspace image inspect ROOT IMAGE` and `vmspace
 * image rm ROOT IMAGE`: OCI images (a layout directory, an oci-archive or a docker-archive) imported into a pool as
 * templates (pool.importImage, one layer template per chainID shared between images), listed, shown and removed.
 * `vmspace run --from IMAGE` allocates from one as from any template.
 */
import { openPool, type ImageTemplate, type ImportImageOptions } from 'vmspace'
import { EXIT_OK, humanAge, humanBytes, interruptible, poolRoot, poolRootOrNew, printJson, table, UsageError } from './common.js'
import { imageSourceProblem } from '../shared/image-source.js'
import { ByteProgress } from './progress.js'

/** The flags `vmspace image import` takes. */
export interface ImportFlags {
  ref?: string
  platform?: string
  format?: 'tree' | 'ext4'
  name?: string
  replace?: boolean
  ext4Headroom?: number
  json?: boolean
}

/** SOURCE as importImage takes it (see imageSourceProblem), checked to name something that exists. */
function sourceArg(arg: string): string {
  const problem = imageSourceProblem(arg)
  if (problem) throw new UsageError(`SOURCE ${problem}`)
  return arg
}

/**
 * What --json gives for an image template: every key present, null where unknown. Layers as the pool records them;
 * after an import also whether each was reused and the bytes of its blob read (`imported`).
 */
function imageJson(t: ImageTemplate, imported = false) {
  const { digest, ref, platform, format, config } = t.image
  const layers = t.image.layers.map((l) => (imported ? l : { digest: l.digest, diffId: l.diffId, chainId: l.chainId, size: l.size }))
  return { id: t.id, name: t.name, current: t.current, path: t.path, createdAt: t.createdAt ?? null, digest, ref, platform, format, config, layers }
}

export async function imageImport(rootArg: string, sourceText: string, o: ImportFlags): Promise<number> {
  const root = poolRootOrNew('ROOT', rootArg)
  const source = sourceArg(sourceText)
  if (o.ext4Headroom !== undefined && o.format !== 'ext4') throw new UsageError('--ext4-headroom needs --format ext4')
  // importImage refuses a non-root caller too, but only once the pool is opened (made, where it was missing).
  if (process.geteuid?.() !== 0) throw new Error('ERR_OCI_NOT_PERMITTED: importing an image needs root (its layers set owners, device nodes and capabilities); nothing made')
  const options: ImportImageOptions = { ref: o.ref, platform: o.platform, name: o.name, format: o.format, replace: o.replace }
  if (o.ext4Headroom !== undefined) options.ext4 = { headroomBytes: o.ext4Headroom }
  const pool = await openPool(root)
  const progress = new ByteProgress('image import')
  try {
    const t = await interruptible(
      (signal) => pool.importImage(source, { ...options, signal, onProgress: (p) => progress.update(p.bytes, p.totalBytes) }),
      (sig) => {
        progress.stop()
        process.stderr.write(`vmspace image import: ${sig}: stopped, nothing published\n`)
      },
    )
    progress.stop()
    if (typeof t === 'number') return t
    if (o.json) printJson({ root, ...imageJson(t, true) })
    else {
      const layers = t.image.layers
      const reused = layers.filter((l) => l.reused).length
      const read = layers.reduce((n, l) => n + (l.reused ? 0 : l.bytes), 0)
      process.stdout.write(`${t.id}\n`)
      process.stderr.write(
        `vmspace image import: ${t.name ?? t.id} (${t.id}): ${t.image.ref}, ${t.image.platform}, ${t.image.format}, ${layers.length} layer(s) ` +
          `(${reused} reused, ${humanBytes(read)} read)\n`,
      )
    }
    return EXIT_OK
  } finally {
    progress.stop()
    await pool.close()
  }
}

/** The image templates of a pool: a table, or --json `{ root, images }`. */
export async function imageLs(rootArg: string, o: { json?: boolean }): Promise<number> {
  const root = poolRoot(rootArg)
  const pool = await openPool(root, { create: false })
  try {
    const list = await pool.images()
    if (o.json) printJson({ root, images: list.map((t) => imageJson(t)) })
    else {
      const now = Date.now()
      const rows = list.map((t) => [
        t.name ?? '-',
        t.id,
        t.image.format,
        t.image.platform,
        String(t.image.layers.length),
        t.createdAt === undefined ? '-' : humanAge(now - t.createdAt),
        t.image.digest.replace(/^(\w+:[0-9a-f]{12}).*$/, '$1'),
      ])
      process.stdout.write(table(['NAME', 'ID', 'FORMAT', 'PLATFORM', 'LAYERS', 'AGE', 'DIGEST'], rows))
    }
    return EXIT_OK
  } finally {
    await pool.close()
  }
}

/** One image template (id, or the name it is current under) as JSON: its config and layers. */
export async function imageInspect(rootArg: string, ref: string): Promise<number> {
  const root = poolRoot(rootArg)
  const pool = await openPool(root, { create: false })
  try {
    const t = (await pool.images()).find((i) => i.id === ref || (i.name === ref && i.current))
    if (!t) throw new Error(`no image ${ref} in ${root} (vmspace image ls ROOT lists them)`)
    printJson({ root, ...imageJson(t) })
    return EXIT_OK
  } finally {
    await pool.close()
  }
}

/** Removes an image template, then the layer templates no other image lists (pool.removeImage). */
export async function imageRm(rootArg: string, ref: string, o: { json?: boolean }): Promise<number> {
  const root = poolRoot(rootArg)
  const pool = await openPool(root, { create: false })
  try {
    const r = await pool.removeImage(ref)
    if (o.json) printJson({ root, removed: r.removed })
    else for (const id of r.removed) process.stdout.write(`removed ${id}\n`)
    return EXIT_OK
  } finally {
    await pool.close()
  }
}

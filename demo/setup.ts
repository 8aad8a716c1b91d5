/**
 * Phase 1, setup: the base image (or the template tree), the pool, and what the checks compare against later
 * (the base's sha256, the template's manifest, the pool's entries before the run).
 */
import * as fs from 'node:fs'
import * as fsp from 'node:fs/promises'
import * as os from 'node:os'
import * as path from 'node:path'
import { performance } from 'node:perf_hooks'
import { openPool, unmountImage, type Pool, type Workspace } from 'vmspace'
import { baseInfo, prepareBase, type Base } from './base.js'
import type { Demo } from './context.js'
import type { TreeSpec } from './protocol.js'
import { fsType, humanBytes, poolEntries, removeIfThere, sha256, status, treeManifest, type Manifest } from './util.js'

export interface TemplateTree {
  spec: TreeSpec
  /** --template-dir as given (spec.dir is its copy in the pool when it lives on another file system). */
  original: string
  /** Full manifest (contents, times) of spec.dir before the run. */
  before: Manifest
  /** The same of the original, when spec.dir is a copy. */
  originalBefore?: Manifest
  /** --image: the image template the workspaces are allocated from. */
  image?: { id: string; name: string | null; layers: number; reused: number }
}

export interface Setup {
  root: string
  /** The pool directory was made by this run (and is removed at its end). */
  ownRoot: boolean
  pool: Pool
  /** Pool entries (see poolEntries) that were there before the run. */
  before: Set<string>
  rootFs: string
  /** The base as given or built; `base` is what the workers clone (its copy in the pool, where one was made). */
  base0?: Base
  base?: Base
  hashBefore: string
  /** The workspace holding the copy of the base or template on the pool's file system, live for the whole run. */
  baseWs?: Workspace
  tree?: TemplateTree
}

export async function setup(demo: Demo): Promise<Setup> {
  const o = demo.opts
  const base0 = o.templateDir || o.image ? undefined : await prepareBase(o, demo.cleanup)
  let root: string
  let ownRoot = false
  let pool: Pool | undefined
  if (o.root) root = o.root
  else {
    root = await fsp.mkdtemp(path.join(os.tmpdir(), 'vmspace-demo-'))
    ownRoot = true
  }
  if (ownRoot) {
    demo.cleanup.add(() => removeIfThere(root))
    pool = await imagePool(demo, root)
  }
  // durable: the one workspace this process allocates holds a base, fsynced once when it is made.
  pool ??= await openPool(root, { durable: true })
  const opened = pool
  demo.cleanup.add(() => opened.close())
  const s: Setup = { root, ownRoot, pool, before: new Set(await poolEntries(root)), rootFs: await fsType(root), base0, hashBefore: '' }

  let base = base0
  if (base0 && fs.statSync(base0.path).dev !== fs.statSync(root).dev) {
    s.baseWs = await copyIntoPool(demo, s, 'base', base0.path, 'base.img', (_, seconds) => `, ${seconds} s, fsynced`)
    // Data is counted on the original: XFS keeps speculative preallocation (unwritten extents) in st_blocks.
    base = { ...(await baseInfo(path.join(s.baseWs.path, 'base.img'), base0.what)), allocated: base0.allocated }
  }
  s.base = base
  if (base) {
    status(`hashing the base (${humanBytes(base.size)})`)
    s.hashBefore = await sha256(base.path)
  }
  if (o.templateDir) s.tree = await templateTree(demo, s, o.templateDir)
  if (o.image) s.tree = await imageTree(demo, s, o.image)
  return s
}

/** Size of the demo's image: sparse, so the host gives only what the workspaces write. */
const DEMO_IMAGE_BYTES = 4 * 1024 ** 3

/**
 * The demo's default pool where it can have one: image-backed (a btrfs in a sparse file beside `root`, mounted at
 * `root`), so that its clones are reflinks on any host. Without root, mkfs.btrfs or the space, undefined (a
 * plain directory pool) and one line saying why. The image is unmounted, detached and deleted at the end.
 */
async function imagePool(demo: Demo, root: string): Promise<Pool | undefined> {
  const image = `${root}.img`
  let pool: Pool
  try {
    pool = await openPool(root, { durable: true, image: { path: image, size: DEMO_IMAGE_BYTES } })
  } catch (e) {
    const code = (e as { code?: string }).code
    if (code !== 'ERR_IMAGE_NOT_PERMITTED' && code !== 'ERR_IMAGE_TOOL_MISSING' && code !== 'ENOSPC' && code !== 'ERR_IMAGE_TOOL_FAILED') throw e
    const why = code === 'ERR_IMAGE_NOT_PERMITTED' ? 'not running as root' : (e as Error).message.replace(/^\w+: /, '')
    status(`plain directory pool on ${await fsType(root)}, not an image-backed one: ${why}`)
    return undefined
  }
  demo.cleanup.add(async () => {
    await unmountImage(root)
    await fsp.rm(image, { force: true })
    await fsp.rm(`${image}.lock`, { force: true })
  })
  status(`image-backed pool: btrfs in ${image} (sparse, ${humanBytes(DEMO_IMAGE_BYTES)}), loop-mounted at ${root}`)
  return pool
}

/**
 * Reflink shares extents within one file system only: a base (or template tree) on another file system than the
 * pool is first cloned into the pool (a workspace of its own, live for the whole run), and the workers clone
 * that. `details` adds to the note what was copied and how long it took.
 */
async function copyIntoPool(
  demo: Demo,
  s: Setup,
  role: 'base' | 'template',
  source: string,
  entry: string,
  details: (ws: Workspace, seconds: string) => string,
): Promise<Workspace> {
  const t0 = performance.now()
  status(`the ${role} is on another file system than the pool: cloning it into the pool once (${s.rootFs})`)
  const ws = await s.pool.allocate({ template: { [entry]: source }, meta: { demo: 'vmspace', role, source } })
  demo.cleanup.add(() => ws.dispose())
  demo.notes.push(
    `the ${role} (${source}) is on another file system than the pool, so it was copied once into the pool's ` +
      `${s.rootFs} (workspace ${ws.name}${details(ws, ((performance.now() - t0) / 1000).toFixed(1))}) and the ` +
      `workspaces were cloned from that copy.`,
  )
  return ws
}

/** The template tree: its full manifest (contents, times) before the run, and its shape for the workers. */
async function templateTree(demo: Demo, s: Setup, original: string): Promise<TemplateTree> {
  let dir = original
  if (fs.statSync(dir).dev !== fs.statSync(s.root).dev) {
    s.baseWs = await copyIntoPool(demo, s, 'template', dir, 'template', (ws, seconds) => {
      const c = ws.template[0]
      return `: ${c.files} files, ${humanBytes(c.bytes)}, ${seconds} s`
    })
    dir = path.join(s.baseWs.path, 'template')
  }
  status(`hashing the template tree ${dir} (listing, modes, sizes, times, contents)`)
  const full = await treeManifest(dir, { contents: true })
  const shape = await treeManifest(dir, { contents: false })
  return {
    original,
    before: full,
    originalBefore: dir === original ? undefined : await treeManifest(original, { contents: true }),
    spec: { dir, shape: shape.digest, entries: shape.entries, files: shape.files, bytes: shape.bytes, probe: full.probe },
  }
}

/**
 * --image: the image imported into the pool (its layers as templates, reused where the pool has them), and what
 * every workspace allocated from it must hold: the shape of one allocated here for reference (its write bits are
 * given back, so it is not the template's own), and the template's full manifest, which must not change.
 */
async function imageTree(demo: Demo, s: Setup, source: string): Promise<TemplateTree> {
  const t0 = performance.now()
  status(`importing the image ${source} into the pool`)
  const t = await s.pool.importImage(source)
  const layers = t.image.layers
  const reused = layers.filter((l) => l.reused).length
  demo.notes.push(
    `the image ${source} was imported as template ${t.name ?? t.id} (${t.id}, ${layers.length} layer(s), ${reused} reused, ` +
      `${((performance.now() - t0) / 1000).toFixed(1)} s); every workspace was allocated from it (allocate({ from })).`,
  )
  const reference = await s.pool.allocate({ from: t.id, meta: { demo: 'vmspace', role: 'image-reference' } })
  let full: Manifest
  let shape: Manifest
  try {
    full = await treeManifest(reference.path, { contents: true })
    shape = await treeManifest(reference.path, { contents: false })
  } finally {
    await reference.dispose()
  }
  status(`hashing the image template ${t.path} (listing, modes, sizes, times, contents)`)
  return {
    original: source,
    before: await treeManifest(t.path, { contents: true }),
    image: { id: t.id, name: t.name, layers: layers.length, reused },
    spec: { dir: t.path, from: t.id, shape: shape.digest, entries: shape.entries, files: shape.files, bytes: shape.bytes, probe: full.probe },
  }
}

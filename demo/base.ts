/** The base image every workspace clones: --base, else a cached ext4 image built once, else the node executable. */
import { randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as fsp from 'node:fs/promises'
import * as os from 'node:os'
import * as path from 'node:path'
import { performance } from 'node:perf_hooks'
import { renameNoReplace } from 'vmspace'
import { describe } from './protocol.js'
import type { Options } from './options.js'
import { Cleanup, fsyncPath, humanBytes, removeIfThere, runOk, statOrUndefined, status, which } from './util.js'

const IMAGE_SIZE = 256 * 1024 * 1024
/** At most this much file data goes into the image (the rest of it is file-system metadata and free space). */
const MAX_IMAGE_DATA = 160 * 1024 * 1024

/** Bytes of the regular files below `dir` (not following symlinks). */
async function treeBytes(dir: string): Promise<number> {
  let total = 0
  for (const e of await fsp.readdir(dir, { recursive: true, withFileTypes: true })) {
    if (!e.isFile()) continue
    try {
      total += (await fsp.lstat(path.join(e.path, e.name))).size
    } catch {
      // gone meanwhile
    }
  }
  return total
}

export interface Base {
  path: string
  size: number
  /** Bytes of data actually stored (the rest are holes). */
  allocated: number
  what: string
}

export async function baseInfo(file: string, what: string): Promise<Base> {
  const st = await fsp.stat(file)
  return { path: file, size: st.size, allocated: Math.min(st.size, st.blocks * 512), what }
}

/** --base, else the cached ext4 image (built now if missing), else the node executable. */
export async function prepareBase(opts: Options, cleanup: Cleanup): Promise<Base> {
  if (opts.base) return baseInfo(opts.base, 'given with --base')
  const nodeExe = fs.realpathSync(process.execPath)
  const what = "ext4 image of Node's npm package and headers"
  const cached = path.join(os.tmpdir(), `vmspace-demo-base-node-${process.version}-${process.arch}.ext4`)
  const st = statOrUndefined(cached)
  if (st?.isFile() && st.size === IMAGE_SIZE) return baseInfo(cached, `${what} (cached)`)
  const mke2fs = which(['mke2fs', 'mkfs.ext4'], ['/usr/sbin', '/sbin', '/usr/local/sbin'])
  if (!mke2fs) {
    status('mke2fs not found (PATH, /usr/sbin, /sbin): using the node executable as the base')
    return baseInfo(nodeExe, 'the node executable (mke2fs not found)')
  }
  const prefix = path.resolve(path.dirname(nodeExe), '..')
  const trees = [
    { src: path.join(prefix, 'lib', 'node_modules'), dest: path.join('lib', 'node_modules') },
    { src: path.join(prefix, 'include', 'node'), dest: path.join('include', 'node') },
  ].filter((t) => statOrUndefined(t.src)?.isDirectory())
  // Tens of MB of real files; a tree that would overfill the image (a node with many global packages) is left out.
  let budget = MAX_IMAGE_DATA
  for (let i = 0; i < trees.length; i++) {
    const size = await treeBytes(trees[i].src)
    if (size > budget) {
      status(`leaving ${trees[i].src} out of the base image: ${humanBytes(size)} of files is more than fits`)
      trees.splice(i--, 1)
    } else budget -= size
  }
  if (trees.length === 0) {
    status(`no ${path.join(prefix, 'lib', 'node_modules')} or ${path.join(prefix, 'include', 'node')}: using the node executable as the base`)
    return baseInfo(nodeExe, 'the node executable (no npm package or headers to build an image from)')
  }

  const t0 = performance.now()
  status(`building the base image once: ${trees.map((t) => t.src).join(' + ')} -> ${cached}`)
  const stage = await fsp.mkdtemp(path.join(os.tmpdir(), 'vmspace-demo-src-'))
  const dropStage = cleanup.add(() => removeIfThere(stage))
  const tmp = `${cached}.tmp-${process.pid}-${randomBytes(4).toString('hex')}`
  const dropTmp = cleanup.add(() => fsp.rm(tmp, { force: true }))
  try {
    for (const t of trees) {
      await fsp.mkdir(path.dirname(path.join(stage, t.dest)), { recursive: true })
      await fsp.cp(t.src, path.join(stage, t.dest), { recursive: true, verbatimSymlinks: true, preserveTimestamps: true })
    }
    await runOk(mke2fs, ['-q', '-F', '-t', 'ext4', '-L', 'vmspace-base', '-d', stage, tmp, `${IMAGE_SIZE / 1024}k`])
    // Bases are fsynced once, when they are made, so that no clone pays for their writeback.
    await fsyncPath(tmp, 'r+')
    try {
      await renameNoReplace(tmp, cached)
    } catch (e) {
      if ((e as { code?: string }).code !== 'EEXIST') throw e
      status(`another run built ${cached} meanwhile: using that one`)
    }
    await fsyncPath(os.tmpdir())
  } catch (e) {
    status(`could not build the image (${describe(e)}): using the node executable as the base`)
    return baseInfo(nodeExe, 'the node executable (building an ext4 image failed)')
  } finally {
    await fsp.rm(tmp, { force: true })
    dropTmp()
    await removeIfThere(stage)
    dropStage()
  }
  status(`base image built in ${((performance.now() - t0) / 1000).toFixed(1)} s`)
  return baseInfo(cached, `${what} (built now)`)
}

/**
 * `vmspace mount ROOT --image PATH [--size SIZE]` and `vmspace unmount ROOT`: an image-backed pool (a btrfs in a
 * sparse file, loop-mounted at ROOT) made and mounted, or unmounted, as openPool({ image }) does it.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { openPool, unmountImage } from 'vmspace'
import { EXIT_OK, errorText, existingDir, printJson, UsageError } from './common.js'
import { loopOf, mountOf } from '../shared/fsinfo.js'

export async function mount(rootArg: string, o: { image: string; size?: number; json?: boolean }): Promise<number> {
  const root = path.resolve(rootArg)
  const image = path.resolve(o.image)
  // The size only makes a new image: an existing one is mounted as it is.
  if (o.size === undefined && !fs.existsSync(image)) throw new UsageError(`--size is needed to make the image: ${image} does not exist`)
  const pool = await openPool(root, { image: { path: image, size: o.size } })
  await pool.close()
  const loop = loopOf(root)
  const result = { root, image: path.resolve(o.image), device: loop?.device ?? null, directIo: loop?.directIo ?? null }
  if (o.json) printJson(result)
  else process.stdout.write(`${root}: pool on ${result.image} (btrfs${loop ? ` through ${loop.device}, direct I/O ${loop.directIo ? 'on' : 'off'}` : ''})\n`)
  return EXIT_OK
}

/**
 * Exit 0 also when nothing is mounted at ROOT (unmounted already: a systemd ExecStop after a manual unmount must
 * not fail the unit), with a note on stderr; `--json` gives `image: null` then. A busy pool names its live
 * workspaces.
 */
export async function unmount(rootArg: string, o: { json?: boolean }): Promise<number> {
  const root = existingDir('ROOT', rootArg)
  let image: string
  try {
    image = await unmountImage(root)
  } catch (e) {
    const code = (e as { code?: string }).code
    if (code === 'ERR_IMAGE_NOT_MOUNTED' && mountOf(fs.realpathSync(root))?.mountPoint !== fs.realpathSync(root)) {
      process.stderr.write(`vmspace unmount: nothing is mounted at ${root} (unmounted already); nothing done\n`)
      if (o.json) printJson({ root, image: null })
      return EXIT_OK
    }
    if (code === 'ERR_IMAGE_TOOL_FAILED' && /busy/.test(errorText(e))) throw new Error(await busyText(root, e))
    throw e
  }
  if (o.json) printJson({ root, image })
  else process.stdout.write(`${root}: unmounted; ${image} kept\n`)
  return EXIT_OK
}

/** Why umount found the pool busy, as far as the pool tells: its live workspaces (other users of it are not listed). */
async function busyText(root: string, e: unknown): Promise<string> {
  let live: number | undefined
  try {
    const pool = await openPool(root, { create: false })
    try {
      live = (await pool.list()).filter((w) => w.live).length
    } finally {
      await pool.close()
    }
  } catch {
    live = undefined
  }
  const holders = live === undefined ? 'its live workspaces could not be counted' : `${live} live workspace(s) in it`
  return `${errorText(e)}: ${root} is in use (${holders}; processes with files open or a cwd in it count too): see vmspace ls ${root}, end them, then unmount again`
}

/**
 * `vmspace mount ROOT --image PATH --size SIZE` and `vmspace unmount ROOT`: an image-backed pool (a btrfs in a
 * sparse file, loop-mounted at ROOT) made and mounted, or unmounted, as openPool({ image }) does it.
 */
import * as path from 'node:path'
import { openPool, unmountImage } from 'vmspace'
import { EXIT_OK, printJson } from './common.js'
import { loopOf } from '../shared/fsinfo.js'

export async function mount(rootArg: string, o: { image: string; size: number; json?: boolean }): Promise<number> {
  const root = path.resolve(rootArg)
  const pool = await openPool(root, { image: { path: path.resolve(o.image), size: o.size } })
  await pool.close()
  const loop = loopOf(root)
  const result = { root, image: path.resolve(o.image), device: loop?.device ?? null, directIo: loop?.directIo ?? null }
  if (o.json) printJson(result)
  else process.stdout.write(`${root}: pool on ${result.image} (btrfs${loop ? ` through ${loop.device}, direct I/O ${loop.directIo ? 'on' : 'off'}` : ''})\n`)
  return EXIT_OK
}

export async function unmount(rootArg: string, o: { json?: boolean }): Promise<number> {
  const root = path.resolve(rootArg)
  const image = await unmountImage(root)
  if (o.json) printJson({ root, image })
  else process.stdout.write(`${root}: unmounted; ${image} kept\n`)
  return EXIT_OK
}

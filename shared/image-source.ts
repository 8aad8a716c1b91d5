/** An image SOURCE as pool.importImage takes it, checked by the vmspace command (cli/) and the demo (demo/). */
import * as fs from 'node:fs'
import * as path from 'node:path'
import type { Pool, Template } from 'vmspace'

/** The transport prefixes skopeo spells, which importImage accepts before a path. */
const PREFIXES = ['oci:', 'oci-archive:', 'docker-archive:']

/**
 * Why `source` (a path, or `oci:DIR[:REF]`, `oci-archive:FILE[:REF]`, `docker-archive:FILE[:REF]`) names nothing
 * that exists, or undefined when it does; which kind of source it is, importImage decides. With a prefix the path
 * may be followed by `:REF`: a path holding ':' itself is tried whole first.
 */
export function imageSourceProblem(source: string): string | undefined {
  const prefix = PREFIXES.find((p) => source.startsWith(p))
  const rest = prefix ? source.slice(prefix.length) : source
  const colon = rest.lastIndexOf(':')
  const candidates = prefix && colon > 0 ? [rest, rest.slice(0, colon)] : [rest]
  if (rest !== '' && candidates.some((p) => fs.existsSync(p))) return undefined
  return `${path.resolve(candidates.at(-1) ?? '')}: no such file or directory`
}

/** One layer of an image template (pool.importImage, pool.images). */
interface ImageLayer {
  digest: string
  diffId: string
  chainId: string
  reused: boolean
  bytes: number
}

/** A template made by pool.importImage. */
export type ImageTemplate = Template & {
  image: { digest: string; ref: string; platform: string; format: 'tree' | 'ext4'; config: Record<string, unknown>; layers: ImageLayer[] }
}

/** The image calls of a pool (docs/images.md). */
interface ImagePool {
  importImage(source: string, options: Record<string, unknown>): Promise<ImageTemplate>
  images(): Promise<ImageTemplate[]>
  removeImage(nameOrId: string): Promise<{ removed: string[] }>
}
export const imagesOf = (pool: Pool) => pool as unknown as ImagePool


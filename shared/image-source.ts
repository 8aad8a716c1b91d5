/** An image SOURCE as pool.importImage takes it, checked by the vmspace command (cli/) and the demo (demo/). */
import * as fs from 'node:fs'
import * as path from 'node:path'

/** The transport prefixes skopeo spells, which importImage accepts before a path. */
const PREFIXES = ['oci:', 'oci-archive:', 'docker-archive:']

/**
 * Why `source` (a path, or `oci:DIR[:REF]`, `oci-archive:FILE[:REF]`, `docker-archive:FILE[:REF]`) names nothing
 * that exists, or undefined when it does; which kind of source it is, importImage decides. With a prefix the path
 * ends at the first ':' (as importImage reads it: the ref, such as `alpine:3.20`, may hold colons).
 */
export function imageSourceProblem(source: string): string | undefined {
  const prefix = PREFIXES.find((p) => source.startsWith(p))
  const rest = prefix ? source.slice(prefix.length) : source
  const colon = rest.indexOf(':')
  const p = prefix && colon >= 0 ? rest.slice(0, colon) : rest
  if (p !== '' && fs.existsSync(p)) return undefined
  return `${p === '' ? JSON.stringify(source) + ' names no path' : path.resolve(p) + ': no such file or directory'}`
}

/** An image SOURCE as pool.importImage takes it, checked by the vmspace command (cli/) and the demo (demo/). */
import * as fs from 'node:fs'
import * as path from 'node:path'

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

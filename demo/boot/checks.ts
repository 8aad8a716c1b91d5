/**
 * What the host checks on a VM's clone after the guest powered off, all from outside without mounting it:
 * e2fsck's verdict, the record the guest wrote (debugfs), every token anywhere in the image's bytes, and how much
 * of the clone still shares extents with the base (FIEMAP through filefrag).
 */
import * as fsp from 'node:fs/promises'
import { TOKEN_FILE, TOKEN_MARKER } from './image.js'
import { run, type BootTools } from './tools.js'

/** The guest's record (`vmspace-token:<hex> id=<id>`), or undefined when the file is missing. */
export async function readGuestRecord(tools: BootTools, image: string): Promise<string | undefined> {
  const r = await run(tools.debugfs, ['-R', `cat ${TOKEN_FILE}`, image])
  if (r.code !== 0 || /not found|File not found|Filesystem not open/i.test(r.stderr)) return undefined
  return r.stdout
}

export interface FsckResult {
  clean: boolean
  /** e2fsck's exit status and, when not clean, its last lines. */
  detail: string
}

/**
 * `e2fsck -fn`: a forced full check that changes nothing. Clean means exit 0 and no journal left to replay (with
 * -n, e2fsck skips a needed recovery and could otherwise call a dirty image clean).
 */
export async function fsckClean(tools: BootTools, image: string): Promise<FsckResult> {
  const r = await run(tools.e2fsck, ['-f', '-n', image])
  const out = `${r.stdout}\n${r.stderr}`
  const recovery = /journal recovery|needs_recovery/i.test(out)
  const clean = r.code === 0 && !recovery
  const tail = out.trim().split('\n').slice(-4).join(' | ')
  return { clean, detail: clean ? 'exit 0' : `exit ${r.code ?? r.signal}${recovery ? ', journal needs recovery' : ''}: ${tail}` }
}

/** Every token found after TOKEN_MARKER in the image's raw bytes (data blocks, journal, free space alike). */
export async function tokensInImage(image: string): Promise<Set<string>> {
  const bytes = await fsp.readFile(image)
  const marker = Buffer.from(TOKEN_MARKER)
  const found = new Set<string>()
  for (let at = bytes.indexOf(marker); at >= 0; at = bytes.indexOf(marker, at + marker.length)) {
    const m = /^[0-9a-f]{32}/.exec(bytes.toString('latin1', at + marker.length, at + marker.length + 32))
    if (m) found.add(m[0])
  }
  return found
}

export interface ExtentBytes {
  /** Allocated bytes whose extents are shared with another file (the base, or other clones of it). */
  shared: number
  /** Allocated bytes this file has to itself (copied, or written by the guest). */
  own: number
}

/** Allocated bytes of `file` by sharing, from `filefrag -v` (FIEMAP's FIEMAP_EXTENT_SHARED flag). */
export async function extentBytes(tools: BootTools, file: string): Promise<ExtentBytes> {
  const r = await run(tools.filefrag, ['-v', file])
  if (r.code !== 0) throw new Error(`filefrag -v ${file} failed: ${r.stderr.trim()}`)
  const bs = Number(/blocks? of (\d+) bytes/.exec(r.stdout)?.[1] ?? 4096)
  const result = { shared: 0, own: 0 }
  // "   3:     2048..    4095:     134144..    136191:   2048:     133120: shared"
  const extent = /^\s*\d+:\s*\d+\.\.\s*\d+:\s*\d+\.\.\s*\d+:\s*(\d+):([^\n]*)$/
  for (const line of r.stdout.split('\n')) {
    const m = extent.exec(line)
    if (!m) continue
    const bytes = Number(m[1]) * bs
    if (/\bshared\b/.test(m[2]!)) result.shared += bytes
    else result.own += bytes
  }
  return result
}

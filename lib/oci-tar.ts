/**
 * The outer tar of an oci-archive or docker-archive, read once for its members' places (never unpacked): ustar
 * (with its prefix field), PAX extended headers (path, linkpath, size) and GNU long names and links. Each member
 * is a byte range of the archive; a symlink or hard link member keeps its target, which lib/oci.ts follows inside
 * the archive. The archive is hostile input: checksums are checked, sizes bounded by the file, members counted.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { VmspaceError } from './errors.js'

/** A member: its data's offset and size in the archive; `link`: an archive-relative target for a link member. */
export interface TarEntry {
  offset: number
  size: number
  link?: string
}

// The most members read (an image's archive has a few per layer), and the largest PAX or GNU long-name data.
const MAX_MEMBERS = 1_000_000
const MAX_META = 1 << 20

function invalid(file: string, why: string): VmspaceError {
  return new VmspaceError(`ERR_OCI_INVALID: ${file} is not a readable tar: ${why}`, { code: 'ERR_OCI_INVALID', path: file })
}

/** A NUL-terminated field as text. */
function field(h: Buffer, start: number, length: number): string {
  const end = h.indexOf(0, start)
  return h.toString('utf8', start, end < 0 || end > start + length ? start + length : end)
}

/** A numeric field: octal text, or base-256 (the high bit of the first byte set) for large values. */
function numeric(h: Buffer, start: number, length: number, file: string): number {
  if (h[start] & 0x80) {
    let v = h[start] & 0x7f
    for (let i = 1; i < length; i++) v = v * 256 + h[start + i]
    if (!Number.isSafeInteger(v)) throw invalid(file, 'a size past 2^53')
    return v
  }
  const text = field(h, start, length).trim()
  if (text === '') return 0
  if (!/^[0-7]+$/.test(text)) throw invalid(file, `the numeric field ${JSON.stringify(text)}`)
  return parseInt(text, 8)
}

function checksumOk(h: Buffer, file: string): boolean {
  let sum = 0
  for (let i = 0; i < 512; i++) sum += i >= 148 && i < 156 ? 0x20 : h[i]
  return sum === numeric(h, 148, 8, file)
}

/** PAX records ("<len> <key>=<value>\n") into a map. */
function paxRecords(data: Buffer, file: string): Map<string, string> {
  const out = new Map<string, string>()
  let pos = 0
  while (pos < data.length) {
    const space = data.indexOf(0x20, pos)
    const len = space < 0 ? NaN : Number(data.toString('ascii', pos, space))
    if (!Number.isInteger(len) || len <= 0 || pos + len > data.length) throw invalid(file, 'a malformed PAX record')
    const rec = data.toString('utf8', space + 1, pos + len - 1)
    const eq = rec.indexOf('=')
    if (eq < 0) throw invalid(file, 'a malformed PAX record')
    out.set(rec.slice(0, eq), rec.slice(eq + 1))
    pos += len
  }
  return out
}

/** A member's name as lib/oci.ts looks it up: no leading './' or '/', no trailing '/'. */
function memberName(name: string): string {
  return path.posix.normalize(name.replace(/^(\.?\/)+/, '')).replace(/\/+$/, '')
}

/** Every file and link member of the tar `file` (`size` bytes) by name; ERR_OCI_INVALID when it does not read as one. */
export async function readTar(file: string, size: number): Promise<Map<string, TarEntry>> {
  const entries = new Map<string, TarEntry>()
  const fh = await fs.promises.open(file, 'r')
  try {
    const h = Buffer.alloc(512)
    const read = async (buf: Buffer, at: number) => {
      const { bytesRead } = await fh.read(buf, 0, buf.length, at)
      if (bytesRead !== buf.length) throw invalid(file, `cut short at byte ${at + bytesRead}`)
    }
    let pending: { path?: string; link?: string; size?: number } = {}
    for (let pos = 0, members = 0; ; members++) {
      if (members > MAX_MEMBERS) throw invalid(file, `more than ${MAX_MEMBERS} members`)
      if (pos + 512 > size) throw invalid(file, 'no end-of-archive marker')
      await read(h, pos)
      if (h.every((b) => b === 0)) return entries
      if (!checksumOk(h, file)) throw invalid(file, `a header checksum at byte ${pos}`)
      const type = String.fromCharCode(h[156] || 0x30)
      const dataSize = pending.size ?? numeric(h, 124, 12, file)
      const data = pos + 512
      const next = data + Math.ceil(dataSize / 512) * 512
      if (next > size) throw invalid(file, `a member's data runs past the end (byte ${pos})`)
      if (type === 'x' || type === 'L' || type === 'K') {
        if (dataSize > MAX_META) throw invalid(file, `an extended header of ${dataSize} bytes`)
        const meta = Buffer.alloc(dataSize)
        await read(meta, data)
        if (type === 'x') {
          const r = paxRecords(meta, file)
          pending = { ...pending, path: r.get('path') ?? pending.path, link: r.get('linkpath') ?? pending.link }
          if (r.has('size')) pending.size = /^[0-9]+$/.test(r.get('size')!) ? Number(r.get('size')) : NaN
          // A negative size would move the reader backwards (back onto this header: a loop).
          if (pending.size !== undefined && !Number.isSafeInteger(pending.size)) throw invalid(file, 'a PAX size that is not a non-negative integer')
        } else {
          const text = meta.toString('utf8').replace(/\0+$/, '')
          pending = type === 'L' ? { ...pending, path: text } : { ...pending, link: text }
        }
        pos = next
        continue
      }
      if (type !== 'g') {
        const prefix = h.toString('ascii', 257, 262) === 'ustar' ? field(h, 345, 155) : ''
        const name = memberName(pending.path ?? (prefix ? `${prefix}/${field(h, 0, 100)}` : field(h, 0, 100)))
        const link = pending.link ?? field(h, 157, 100)
        // A symlink's target is relative to its own directory; a hard link's to the archive's root.
        if (type === '0' || type === '7') entries.set(name, { offset: data, size: dataSize })
        else if (type === '1') entries.set(name, { offset: 0, size: 0, link })
        else if (type === '2') entries.set(name, { offset: 0, size: 0, link: link.startsWith('/') ? link : path.posix.join(path.posix.dirname(name), link) })
        pending = {}
      }
      pos = next
    }
  } finally {
    await fh.close()
  }
}

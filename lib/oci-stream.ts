/**
 * A layer blob streamed into the applier's pipe: its bytes counted and hashed (the blob digest), decompressed by
 * its media type (gzip: node:zlib; zstd: node:zlib's decoder where the running Node has one, else fzstd, a
 * pure-JS streaming decoder; none), and the tar hashed again (the diffID). Both digests and the size are checked
 * against the descriptor; a failure names the blob. Nothing here decides to publish: the caller does, after both
 * the stream and the applier are done.
 */
import * as crypto from 'node:crypto'
import * as fs from 'node:fs'
import { Readable, Transform, type Writable } from 'node:stream'
import { pipeline } from 'node:stream/promises'
import * as zlib from 'node:zlib'
import { Decompress as ZstdDecompress } from 'fzstd'
import { ociError, type BlobLocation, type Compression, type LayerSource } from './oci.js'
import type { VmspaceError } from './errors.js'

/** What a layer's stream read: the blob's digest and size, and the tar's digest (its diffID). */
export interface LayerDigests {
  digest: string
  bytes: number
  diffId: string
}

// Reads of 1 MiB: a sixteenth of the per-chunk work (hash updates, stream callbacks) of the default 64 KiB.
const READ_CHUNK = 2 ** 20

/** The bytes of `loc` from `offset` on (a file, or a member of an archive). */
function blobStream(loc: BlobLocation, offset = 0): Readable {
  // createReadStream reads to the file's end when `end` is below `start`: an empty range is an empty stream.
  if (offset >= loc.size) return Readable.from([])
  return fs.createReadStream(loc.file, { start: loc.start + offset, end: loc.start + loc.size - 1, highWaterMark: READ_CHUNK })
}

/** A pass-through that feeds `hash` and counts; `limit`: more bytes than that fail at once (the descriptor's size). */
function meter(hash: crypto.Hash, count: (n: number) => void, limit: number, tooLong: () => Error): Transform {
  let seen = 0
  return new Transform({
    transform(chunk: Buffer, _enc, done) {
      seen += chunk.length
      if (seen > limit) return done(tooLong())
      hash.update(chunk)
      try {
        count(chunk.length) // the caller's progress callback: what it throws fails the stream
      } catch (e) {
        return done(e as Error)
      }
      done(null, chunk)
    },
  })
}

// node:zlib's zstd decoder (Node 22.15+, 23.8+), where the running Node has one.
const nativeZstd = (zlib as unknown as { createZstdDecompress?: () => Transform }).createZstdDecompress

// The largest window a zstd frame may ask for: libzstd's default decoder limit (2^27, ZSTD_WINDOWLOG_LIMIT_DEFAULT),
// which node:zlib's decoder keeps too.
const ZSTD_WINDOW_MAX = 2 ** 27

/**
 * Walks a zstd stream's frames (RFC 8878, section 3.1) by their headers and block sizes, and throws for a frame whose
 * window is over ZSTD_WINDOW_MAX: fzstd allocates a frame's whole window up front and copies it once per block, so
 * a few bytes asking for 2 GiB cost that much memory and hours of copying. What it cannot read it leaves to fzstd.
 */
function zstdWindowGuard(): (chunk: Buffer) => void {
  let skip = 0 // bytes to pass over (block contents, a checksum, a skippable frame)
  let want = 4 // header bytes `head` must hold before `state` reads them
  let head = Buffer.alloc(0)
  let state: 'magic' | 'frame' | 'block' | 'skippable' = 'magic'
  let checksum = false
  let off = false
  return (chunk) => {
    for (let at = 0; at < chunk.length && !off; ) {
      if (skip > 0) {
        const k = Math.min(skip, chunk.length - at)
        skip -= k
        at += k
        continue
      }
      const k = Math.min(want - head.length, chunk.length - at)
      head = Buffer.concat([head, chunk.subarray(at, at + k)])
      at += k
      if (head.length < want) return
      if (state === 'magic') {
        const magic = head.readUInt32LE(0)
        if ((magic & 0xfffffff0) === 0x184d2a50) [state, want] = ['skippable', 8]
        else if (magic === 0xfd2fb528) [state, want] = ['frame', 6]
        else off = true // not zstd: fzstd says so
        continue
      }
      if (state === 'skippable') {
        ;[skip, state, want, head] = [head.readUInt32LE(4), 'magic', 4, Buffer.alloc(0)]
        continue
      }
      if (state === 'frame') {
        const fhd = head[4]
        const single = (fhd >> 5) & 1
        const fcsBytes = [single, 2, 4, 8][fhd >> 6]
        const full = 5 + (single ? 0 : 1) + [0, 1, 2, 4][fhd & 3] + fcsBytes
        if (head.length < full) {
          want = full
          continue
        }
        let window: number
        if (!single) window = 2 ** (10 + (head[5] >> 3)) * (1 + (head[5] & 7) / 8)
        else window = Number(head.readUIntLE(full - fcsBytes, Math.min(fcsBytes, 6))) + (fcsBytes === 2 ? 256 : 0) + (fcsBytes === 8 ? head.readUInt16LE(full - 2) * 2 ** 48 : 0)
        if (window > ZSTD_WINDOW_MAX) throw new Error(`a zstd frame asks for a window of ${window} bytes, more than the ${ZSTD_WINDOW_MAX} decoders allow`)
        ;[checksum, state, want, head] = [((fhd >> 2) & 1) === 1, 'block', 3, Buffer.alloc(0)]
        continue
      }
      const h = head.readUIntLE(0, 3)
      const type = (h >> 1) & 3
      skip = type === 1 ? 1 : h >>> 3
      head = Buffer.alloc(0)
      if (h & 1) {
        skip += checksum ? 4 : 0
        ;[state, want] = ['magic', 4]
      }
    }
  }
}

/** fzstd's streaming decoder as a Transform (Node without a zstd decoder of its own: Node 20). */
function fzstdTransform(): Transform {
  const guard = zstdWindowGuard()
  const out: Transform = new Transform({
    transform(chunk: Buffer, _enc, done) {
      try {
        guard(chunk)
        d.push(chunk)
        done()
      } catch (e) {
        done(e as Error)
      }
    },
    flush(done) {
      try {
        d.push(new Uint8Array(0), true)
        done()
      } catch (e) {
        done(e as Error)
      }
    },
  })
  const d = new ZstdDecompress((data) => {
    // fzstd may hand out a view of its window, which later pushes overwrite: copied.
    if (data.length > 0) out.push(Buffer.from(data))
  })
  return out
}

/** The decoder of `compression`; 'sniff' decides by the first bytes (gzip 1f 8b, zstd 28 b5 2f fd, else none). */
function decoder(compression: Compression, head: Buffer): Transform {
  let c = compression
  if (c === 'sniff') c = head[0] === 0x1f && head[1] === 0x8b ? 'gzip' : head.readUInt32LE(0) === 0xfd2fb528 ? 'zstd' : 'none'
  if (c === 'gzip') return zlib.createGunzip()
  if (c === 'zstd') return nativeZstd ? nativeZstd() : fzstdTransform()
  return new Transform({ transform: (chunk, _enc, done) => done(null, chunk) })
}

async function firstBytes(loc: BlobLocation): Promise<Buffer> {
  const head = Buffer.alloc(4)
  if (loc.size < 4) return head
  const fh = await fs.promises.open(loc.file, 'r')
  try {
    await fh.read(head, 0, 4, loc.start)
  } finally {
    await fh.close()
  }
  return head
}

/**
 * Streams `layer` into `out` (the applier's pipe), verifying as it goes. `onBytes` is called with each chunk's size
 * of the compressed blob. Rejects with ERR_OCI_DIGEST_MISMATCH (blob, expected, actual) when the blob's size or
 * digest or the tar's diffID is not the descriptor's; when the pipe or the decoder fails first, the rest of the
 * blob is still hashed, and a blob that does not match its digest is reported as that (it explains the rest).
 */
export async function streamLayer(layer: LayerSource, out: Writable, onBytes: (n: number) => void, signal?: AbortSignal): Promise<LayerDigests> {
  try {
    return await verifiedCopy(layer, out, onBytes, signal)
  } catch (e) {
    // Closed on every failure, also one before the copy began: the applier reads the pipe until its EOF.
    out.destroy()
    throw e
  }
}

async function verifiedCopy(layer: LayerSource, out: Writable, onBytes: (n: number) => void, signal?: AbortSignal): Promise<LayerDigests> {
  const name = layer.digest ?? layer.blob.name
  const mismatch = (what: string, expected: string, actual: string) =>
    ociError('ERR_OCI_DIGEST_MISMATCH', `blob ${name}: ${what} is ${actual}, its descriptor says ${expected}`, layer.blob.name, { blob: name, expected, actual })
  if (layer.blob.size !== layer.size) throw mismatch('the size', String(layer.size), String(layer.blob.size))
  const blobHash = crypto.createHash('sha256')
  const diffHash = crypto.createHash('sha256')
  let bytes = 0
  const tooLong = () => mismatch('the size', String(layer.size), `more than ${layer.size}`)
  const count = (n: number) => {
    bytes += n
    onBytes(n)
  }
  const dec = decoder(layer.compression, await firstBytes(layer.blob))
  const stages = [blobStream(layer.blob), meter(blobHash, count, layer.size, tooLong), dec, meter(diffHash, () => {}, Infinity, tooLong), out]
  // The stage that failed first: pipeline destroys every other with the same error.
  let origin: unknown
  for (const stage of stages) stage.once('error', () => (origin ??= stage))
  try {
    await pipeline(stages, { signal })
  } catch (e) {
    if (signal?.aborted || (e as VmspaceError).code === 'ERR_OCI_DIGEST_MISMATCH') throw e
    // The rest of the blob decides whether it was corrupt (then that is the error) or the tar was refused as it is.
    if (layer.digest !== undefined) {
      const rest = await pipeline(blobStream(layer.blob, bytes), meter(blobHash, () => {}, layer.size - bytes, tooLong)).then(() => true, () => false)
      const actual = rest ? 'sha256:' + blobHash.digest('hex') : 'unreadable'
      if (actual !== layer.digest) throw mismatch('the digest', layer.digest, actual)
    }
    if (origin === dec)
      throw Object.assign(ociError('ERR_OCI_INVALID', `blob ${name} does not decompress (${layer.mediaType}): ${(e as Error).message}`, layer.blob.name), { cause: e })
    throw e
  }
  const digest = 'sha256:' + blobHash.digest('hex')
  const diffId = 'sha256:' + diffHash.digest('hex')
  if (bytes !== layer.size) throw mismatch('the size', String(layer.size), String(bytes))
  if (layer.digest !== undefined && digest !== layer.digest) throw mismatch('the digest', layer.digest, digest)
  if (diffId !== layer.diffId) throw mismatch('the diffID', layer.diffId, diffId)
  return { digest, bytes, diffId }
}

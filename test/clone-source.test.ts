/**
 * The source of a clone (DESIGN.md, "Clone engine"): a file that changes while it is cloned is never published
 * (ERR_SOURCE_CHANGED, for a copy on ext4 and a reflink on XFS, through clone(), Workspace.clone and allocate), a
 * single big file reports progress and is cancelled like a tree, and a source of a kind no clone takes (a fifo, a
 * socket) says so. Real file systems throughout; the change is made while the copy is seen under way (its
 * destination file open in this process with data in it), never after a delay.
 */
import { spawn } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { AbortError, clone, openPool, VmspaceError, type Pool } from '../lib/index.js'
import {
  emptyPoolState,
  freshDir,
  GiB,
  ls,
  MiB,
  mounts,
  needs,
  poolState,
  requireMount,
  runCommand,
  tempLeftovers,
  writeRandomFile,
} from './helpers.js'
import { makeSocket } from './tree-helpers.js'
import { injectMissing, runInjected } from './inject-helpers.js'

const ext4 = mounts.scratchFsType === 'ext4' ? mounts.scratch : null
const ext4Missing = `os.tmpdir() is on ${mounts.scratchFsType}, and the copies here are bigger than the small ext4 loop mount`

/** A regular file of `size` bytes of data (no hole), written in 16 MiB chunks. */
function writeFilled(file: string, size: number): void {
  const chunk = Buffer.alloc(16 * MiB, 0x5a)
  const fd = fs.openSync(file, 'w')
  try {
    for (let off = 0; off < size; off += chunk.length) fs.writeSync(fd, chunk, 0, Math.min(chunk.length, size - off), off)
  } finally {
    fs.closeSync(fd)
  }
}

/**
 * Waits (between turns of the event loop, until `settled()`) for a regular file this process has open under
 * `prefix` to hold data: the clone's destination (an O_TMPFILE file, a temp name or a tree's entry) being copied
 * into. Then runs `then` and returns true; false when the clone settled first.
 */
async function whenCopyUnderWay(prefix: string, settled: () => boolean, then: () => void): Promise<boolean> {
  while (!settled()) {
    for (const fd of fs.readdirSync('/proc/self/fd')) {
      try {
        if (!fs.readlinkSync(`/proc/self/fd/${fd}`).startsWith(prefix)) continue
        const st = fs.fstatSync(Number(fd))
        if (!st.isFile() || st.size === 0) continue
      } catch {
        continue // closed meanwhile
      }
      then()
      return true
    }
    await new Promise((resolve) => setImmediate(resolve))
  }
  return false
}

/**
 * Writes `base` (256 MiB, doubled up to 1 GiB while the clone ends before the copy was seen under way), starts the
 * clone, and truncates `base` to 1 MiB once its copy into `destPrefix` is under way. Returns the rejection; fails
 * when every attempt completed first.
 */
async function truncatedMidCopy(
  base: string,
  destPrefix: string,
  start: () => Promise<unknown>,
  cleanup: (value: unknown) => void | Promise<void>,
): Promise<unknown> {
  for (let size = 256 * MiB; size <= GiB; size *= 2) {
    writeFilled(base, size)
    let settled = false
    const p = start().then(
      (value) => ({ ok: true as const, value }),
      (err: unknown) => ({ ok: false as const, err }),
    )
    void p.finally(() => (settled = true))
    const hit = await whenCopyUnderWay(destPrefix, () => settled, () => fs.truncateSync(base, MiB))
    const outcome = await p
    if (outcome.ok) {
      expect(hit).toBe(false) // a clone that saw its source truncated must not succeed
      await cleanup(outcome.value)
      continue
    }
    if (hit) return outcome.err
    throw outcome.err
  }
  throw new Error('every clone completed before its copy was seen under way')
}

/**
 * `dst` is one version of a file whileResized resizes, whose first 4 MiB were `data`: its first 2 MiB alone, or
 * followed by 2 MiB of zeros; and `bytes` is its size.
 */
function expectOneVersion(dst: string, bytes: number, data: Buffer): void {
  const got = fs.readFileSync(dst)
  expect(got.length).toBe(bytes)
  expect([2 * MiB, 4 * MiB]).toContain(got.length)
  expect(got.subarray(0, 2 * MiB).equals(data.subarray(0, 2 * MiB))).toBe(true)
  expect(got.subarray(2 * MiB).every((b) => b === 0)).toBe(true)
}

/**
 * One 'never' clone of `base` (a file whileResized resizes, whose first 4 MiB were `data`) to `dst`: null when it
 * resolved (its bytes checked to be one version, then removed), else the VmspaceError it rejected with.
 */
async function cloneResized(base: string, dst: string, data: Buffer): Promise<VmspaceError | null> {
  const settled = await outcome(clone(base, dst, { reflink: 'never' }))
  if ('error' in settled) {
    expect(settled.error).toBeInstanceOf(VmspaceError)
    return settled.error as VmspaceError
  }
  expectOneVersion(dst, settled.value.bytes, data)
  fs.rmSync(dst)
  return null
}

/**
 * How `p` settled, so that the checks of either outcome run outside a catch: a failed check is reported as itself,
 * never caught and re-read as the operation's error.
 */
async function outcome<T>(p: Promise<T>): Promise<{ value: T } | { error: unknown }> {
  return p.then(
    (value) => ({ value }),
    (error: unknown) => ({ error }),
  )
}

function expectSourceChanged(err: unknown, source: string): void {
  expect(err).toBeInstanceOf(VmspaceError)
  expect(err).toMatchObject({ code: 'ERR_SOURCE_CHANGED', path: source })
  expect((err as VmspaceError).errno).toBeUndefined()
}

function expectPoolEmpty(pool: Pool): void {
  expect(poolState(pool.root)).toEqual(emptyPoolState)
}

describe.skipIf(!ext4)(`a file truncated while it is copied, on ext4 ${needs('os.tmpdir() on ext4', !ext4 && ext4Missing)}`, () => {
  test('clone() rejects with ERR_SOURCE_CHANGED and publishes nothing: no destination, no temp file', async () => {
    const d = freshDir(ext4!)
    const base = path.join(d, 'rootfs.ext4')
    const dst = path.join(d, 'out', 'rootfs.ext4')
    fs.mkdirSync(path.dirname(dst))
    const err = await truncatedMidCopy(base, path.dirname(dst) + '/', () => clone(base, dst), () => fs.rmSync(dst))
    expectSourceChanged(err, base)
    expect(err).toMatchObject({ dest: dst })
    expect(ls(path.dirname(dst))).toEqual([])
  })

  test('clone() with overwrite (a named temp file) rejects the same way; the old destination stays, no temp file', async () => {
    const d = freshDir(ext4!)
    const base = path.join(d, 'rootfs.ext4')
    const out = path.join(d, 'out')
    const dst = path.join(out, 'rootfs.ext4')
    fs.mkdirSync(out)
    fs.writeFileSync(dst, 'old')
    const err = await truncatedMidCopy(
      base,
      out + '/',
      () => clone(base, dst, { overwrite: true }),
      () => fs.writeFileSync(dst, 'old'),
    )
    expectSourceChanged(err, base)
    expect(ls(out)).toEqual(['rootfs.ext4'])
    expect(fs.readFileSync(dst, 'utf8')).toBe('old')
  })

  test('Workspace.clone rejects with ERR_SOURCE_CHANGED and leaves the workspace empty', async () => {
    const d = freshDir(ext4!)
    const base = path.join(d, 'rootfs.ext4')
    const pool = await openPool(path.join(d, 'pool'))
    const ws = await pool.allocate()
    const err = await truncatedMidCopy(
      base,
      ws.path + '/',
      () => ws.clone(base, 'rootfs.ext4'),
      () => fs.rmSync(path.join(ws.path, 'rootfs.ext4')),
    )
    expectSourceChanged(err, base)
    expect(ls(ws.path)).toEqual([])
    await ws.dispose()
    await pool.close()
  })

  test("allocate({ template: { 'rootfs.ext4': base } }) rejects with ERR_SOURCE_CHANGED: no workspace, staging entry or metadata", async () => {
    const d = freshDir(ext4!)
    const base = path.join(d, 'base.ext4')
    const pool = await openPool(path.join(d, 'pool'))
    const err = await truncatedMidCopy(
      base,
      path.join(pool.root, '.vmspace') + '/',
      () => pool.allocate({ template: { 'rootfs.ext4': base } }),
      (ws) => (ws as Awaited<ReturnType<Pool['allocate']>>).dispose(),
    )
    expectSourceChanged(err, base)
    expectPoolEmpty(pool)
    await pool.close()
  })

  test("clone() ('never') racing a writer that shrinks and regrows the file: each clone is one version it reports, or ERR_SOURCE_CHANGED (never EIO)", async () => {
    const d = freshDir(ext4!)
    const base = path.join(d, 'base.img')
    const data = writeRandomFile(base, 4 * MiB)
    const out = path.join(d, 'out')
    fs.mkdirSync(out)
    let changed = 0
    await whileResized(
      base,
      async () => {
        const err = await cloneResized(base, path.join(out, 'clone.img'), data)
        if (err) {
          expectSourceChanged(err, base)
          changed++
        }
        expect(ls(out)).toEqual([])
      },
      () => changed > 0,
    )
    expect(changed).toBeGreaterThan(0)
  })

  test('a tree clone rejects with ERR_SOURCE_CHANGED naming the entry (path and dest); no temp tree, no destination', async () => {
    const d = freshDir(ext4!)
    const src = path.join(d, 'src')
    fs.mkdirSync(path.join(src, 'images'), { recursive: true })
    fs.writeFileSync(path.join(src, 'config'), 'x')
    const big = path.join(src, 'images', 'rootfs.ext4')
    const dst = path.join(d, 'dst')
    const err = await truncatedMidCopy(big, path.join(d, '.vmspace-tmp-'), () => clone(src, dst), () =>
      fs.rmSync(dst, { recursive: true }),
    )
    expectSourceChanged(err, big)
    expect(err).toMatchObject({ dest: path.join(dst, 'images', 'rootfs.ext4') })
    expect(ls(d)).toEqual(['src'])
  })
})

/**
 * Runs `attempt` while another process keeps resizing `file` (4 MiB of data: ftruncate between 4 and 2 MiB in a
 * loop, each changing size, mtime and ctime where timestamps are fine-grained): 100 times, and on up to 2,000 until
 * `enough()`. The writer shrinks and regrows the file once before the first attempt, so that every version is its
 * first 2 MiB, alone or followed by 2 MiB of zeros (expectOneVersion).
 */
async function whileResized(file: string, attempt: () => Promise<void>, enough: () => boolean): Promise<void> {
  const writer = spawn(
    process.execPath,
    [
      '-e',
      `const fs = require('fs'); const fd = fs.openSync(${JSON.stringify(file)}, 'r+');` +
        ` fs.ftruncateSync(fd, ${2 * MiB}); fs.ftruncateSync(fd, ${4 * MiB}); fs.writeSync(1, 'ready\\n');` +
        ` for (let i = 0; ; i++) fs.ftruncateSync(fd, i & 1 ? ${2 * MiB} : ${4 * MiB})`,
    ],
    { stdio: ['ignore', 'pipe', 'ignore'] },
  )
  try {
    await new Promise<void>((resolve, reject) => {
      writer.stdout.once('data', () => resolve())
      writer.once('exit', (code) => reject(new Error(`the writer exited (${code}) before it started`)))
    })
    for (let i = 0; i < 2000 && (i < 100 || !enough()); i++) await attempt()
  } finally {
    writer.kill('SIGKILL')
  }
}

describe.skipIf(!mounts.root)(`a file resized while it is copied, on ramfs (coarse timestamps) ${needs('root for mount -t ramfs', !mounts.root && 'not running as root')}`, () => {
  // ramfs keeps one timestamp per clock tick, as every file system did before Linux 6.13: a truncate and a regrow
  // within one tick leave size, mtime and ctime as they were, so the version check alone cannot see them.
  test("clone() ('never'): each clone is one version it reports, or ERR_SOURCE_CHANGED or EIO; never a clone of another size, nothing left", async () => {
    const d = freshDir()
    const ramfs = path.join(d, 'ramfs')
    fs.mkdirSync(ramfs)
    expect(runCommand('mount', ['-t', 'ramfs', 'vmspace-test', ramfs]).status).toBe(0)
    const base = path.join(ramfs, 'base.img')
    const data = writeRandomFile(base, 4 * MiB)
    const out = path.join(ramfs, 'out')
    fs.mkdirSync(out)
    const codes = new Set<string>()
    let attempts = 0
    await whileResized(base, async () => {
      attempts++
      const dst = path.join(out, 'clone.img')
      const err = await cloneResized(base, dst, data)
      if (err) {
        expect(['ERR_SOURCE_CHANGED', 'EIO']).toContain(err.code)
        expect(err).toMatchObject({ path: base, dest: dst })
        codes.add(err.code)
      }
      expect(ls(out)).toEqual([])
    }, () => attempts >= 500)
    expect(codes.has('ERR_SOURCE_CHANGED')).toBe(true)
  })
})

requireMount('XFS', mounts.xfs, mounts.missing.xfs)

describe.skipIf(!mounts.xfs)(`a file resized while it is reflinked, on XFS ${needs('a loop-mounted XFS', !mounts.xfs && mounts.missing.xfs)}`, () => {
  test("clone() ('always'): each clone is the version it reports (bytes = its size) or ERR_SOURCE_CHANGED leaving nothing; some are refused", async () => {
    const d = freshDir(mounts.xfs!)
    const base = path.join(d, 'base.img')
    writeRandomFile(base, 4 * MiB)
    const out = path.join(d, 'out')
    fs.mkdirSync(out)
    let changed = 0
    await whileResized(base, async () => {
      const dst = path.join(out, 'clone.img')
      const settled = await outcome(clone(base, dst, { reflink: 'always' }))
      if ('error' in settled) {
        expectSourceChanged(settled.error, base)
        changed++
      } else {
        expect(settled.value.method).toBe('reflink')
        expect(fs.statSync(dst).size).toBe(settled.value.bytes)
        fs.rmSync(dst)
      }
      expect(ls(out)).toEqual([])
    }, () => changed > 0)
    expect(changed).toBeGreaterThan(0)
  })

  test('allocate({ template }) (pool reflink: always): the identity recorded is that of the clone, or ERR_SOURCE_CHANGED leaving the pool empty', async () => {
    const d = freshDir(mounts.xfs!)
    const base = path.join(d, 'base.img')
    writeRandomFile(base, 4 * MiB)
    const pool = await openPool(path.join(d, 'pool'), { reflink: 'always' })
    let changed = 0
    await whileResized(base, async () => {
      const settled = await outcome(pool.allocate({ template: { 'rootfs.img': base } }))
      if ('error' in settled) {
        expectSourceChanged(settled.error, base)
        changed++
      } else {
        const ws = settled.value
        const size = fs.statSync(path.join(ws.path, 'rootfs.img')).size
        expect(ws.template[0]).toMatchObject({ method: 'reflink', bytes: size })
        const [info] = await pool.list()
        expect(info.template![0]).toMatchObject({ dest: 'rootfs.img', size })
        await ws.dispose()
      }
      expectPoolEmpty(pool)
    }, () => changed > 0)
    expect(changed).toBeGreaterThan(0)
    await pool.close()
  })
})

// ---- progress and cancel of one file ----

/**
 * Clones a file of data (256 MiB, doubled up to 2 GiB while the copy ends before `onProgress` was called twice)
 * with `reflink: 'never'`, passing `options(onProgress)`. Returns the events seen and the outcome.
 */
async function cloneReporting(
  d: string,
  run: (src: string, onProgress: (p: { files: number; bytes: number }) => void) => Promise<unknown>,
  enough: (events: { files: number; bytes: number }[], outcome: { ok: boolean; err?: unknown }) => boolean,
  cleanup: () => void,
): Promise<{ events: { files: number; bytes: number }[]; size: number; outcome: { ok: boolean; err?: unknown } }> {
  const src = path.join(d, 'big.img')
  for (let size = 256 * MiB; size <= 2 * GiB; size *= 2) {
    writeFilled(src, size)
    const events: { files: number; bytes: number }[] = []
    const outcome = await run(src, (p) => events.push(p)).then(
      () => ({ ok: true }),
      (err: unknown) => ({ ok: false, err }),
    )
    if (enough(events, outcome)) return { events, size, outcome }
    cleanup()
  }
  throw new Error('no copy up to 2 GiB gave the events (and outcome) the test needs')
}

describe('a single-file clone reports progress and is cancelled as a tree is', () => {
  test("onProgress is called while one big file is copied (reflink 'never'): bytes never decrease nor exceed its size", async () => {
    const d = freshDir()
    const dst = path.join(d, 'copy.img')
    const { events, size, outcome } = await cloneReporting(
      d,
      (src, onProgress) => clone(src, dst, { reflink: 'never', onProgress }),
      (e) => e.length >= 2,
      () => fs.rmSync(dst, { force: true }),
    )
    expect(outcome.ok).toBe(true)
    expect(fs.statSync(dst).size).toBe(size)
    for (const [i, e] of events.entries()) {
      expect(Object.keys(e).sort()).toEqual(['bytes', 'files'])
      expect(e.files).toBeLessThanOrEqual(1)
      expect(e.bytes).toBeGreaterThan(0)
      expect(e.bytes).toBeLessThanOrEqual(size)
      if (i > 0) expect(e.bytes).toBeGreaterThanOrEqual(events[i - 1].bytes)
    }
    expect(events[0].files).toBe(0) // reported before the file was done
  })

  test('a throw from onProgress cancels the copy: it rejects with that exception; no destination, no temp file', async () => {
    const d = freshDir()
    const out = path.join(d, 'out')
    fs.mkdirSync(out)
    const dst = path.join(out, 'copy.img')
    const boom = new Error('progress bar broke')
    const { outcome } = await cloneReporting(
      d,
      (src, onProgress) =>
        clone(src, dst, {
          reflink: 'never',
          onProgress: (p) => {
            onProgress(p)
            throw boom
          },
        }),
      // A copy that completed before the throw was seen (it then rejects and keeps its complete destination, as
      // documented) is tried again, larger.
      (e, o) => e.length >= 1 && !o.ok && !fs.existsSync(dst),
      () => fs.rmSync(dst, { force: true }),
    )
    expect(outcome.ok).toBe(false)
    expect(outcome.err).toBe(boom)
    expect(ls(out)).toEqual([])
  })

  test('an abort (signal) cancels the copy with the AbortError a tree gives; overwrite leaves the old file and no temp file', async () => {
    const d = freshDir()
    const out = path.join(d, 'out')
    fs.mkdirSync(out)
    const dst = path.join(out, 'copy.img')
    fs.writeFileSync(dst, 'old')
    const { outcome } = await cloneReporting(
      d,
      (src, onProgress) => {
        const ac = new AbortController()
        return clone(src, dst, {
          reflink: 'never',
          overwrite: true,
          signal: ac.signal,
          onProgress: (p) => {
            onProgress(p)
            ac.abort()
          },
        })
      },
      // A copy that completed before the abort was seen is tried again, larger.
      (e, o) => e.length >= 1 && !o.ok && fs.readFileSync(dst, 'utf8') === 'old',
      () => fs.writeFileSync(dst, 'old'),
    )
    expect(outcome.err).toBeInstanceOf(AbortError)
    expect(outcome.err).toMatchObject({ name: 'AbortError', code: 'ABORT_ERR' })
    expect(ls(out)).toEqual(['copy.img'])
    expect(tempLeftovers(out)).toEqual([])
    expect(fs.readFileSync(dst, 'utf8')).toBe('old')
  })

  test('Workspace.clone: an abort mid-copy leaves the workspace empty', async () => {
    const d = freshDir()
    const pool = await openPool(path.join(d, 'pool'))
    const ws = await pool.allocate()
    const { outcome } = await cloneReporting(
      d,
      (src, onProgress) => {
        const ac = new AbortController()
        return ws.clone(src, 'disk.img', {
          reflink: 'never',
          signal: ac.signal,
          onProgress: (p) => {
            onProgress(p)
            ac.abort()
          },
        })
      },
      // A copy that completed before the abort was seen is tried again, larger.
      (e, o) => e.length >= 1 && !o.ok && !fs.existsSync(path.join(ws.path, 'disk.img')),
      () => fs.rmSync(path.join(ws.path, 'disk.img'), { force: true }),
    )
    expect(outcome.err).toBeInstanceOf(AbortError)
    expect(ls(ws.path)).toEqual([])
    await ws.dispose()
    await pool.close()
  })
})

// ---- sources no clone takes ----

describe('a source that is neither a regular file nor a directory', () => {
  test("a fifo is ERR_SOURCE_TYPE ('the source is a fifo'), no errno, nothing made; clone(), Workspace.clone and allocate alike", async () => {
    const d = freshDir()
    const fifo = path.join(d, 'fifo')
    const out = path.join(d, 'out')
    fs.mkdirSync(out)
    expect(runCommand('mkfifo', [fifo]).status).toBe(0)
    const err = await clone(fifo, path.join(out, 'x')).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ERR_SOURCE_TYPE', path: fifo, dest: path.join(out, 'x') })
    expect((err as Error).message).toContain('the source is a fifo')
    expect((err as VmspaceError).errno).toBeUndefined()
    expect((err as VmspaceError).syscall).toBeUndefined()
    expect(ls(out)).toEqual([])

    const pool = await openPool(path.join(d, 'pool'))
    const ws = await pool.allocate()
    await expect(ws.clone(fifo, 'x')).rejects.toMatchObject({ code: 'ERR_SOURCE_TYPE', path: fifo })
    expect(ls(ws.path)).toEqual([])
    await ws.dispose()
    await expect(pool.allocate({ template: { x: fifo } })).rejects.toMatchObject({ code: 'ERR_SOURCE_TYPE', path: fifo })
    expectPoolEmpty(pool)
    await pool.close()
  })

  test("a socket (which open(2) refuses with ENXIO) is ERR_SOURCE_TYPE ('the source is a socket')", async () => {
    const d = freshDir()
    const sock = path.join(d, 'sock')
    await makeSocket(sock)
    const err = await clone(sock, path.join(d, 'x')).catch((e: unknown) => e)
    expect(err).toMatchObject({ code: 'ERR_SOURCE_TYPE', path: sock })
    expect((err as Error).message).toContain('the source is a socket')
    expect(ls(d)).toEqual(['sock'])
  })
})

// open(2) flags, x86-64 and aarch64: the walk opens a file it stat'ed by O_PATH|O_NOFOLLOW (openRegularAtNoFollow),
// a directory never by O_PATH.
const O_PATH = 0o10000000
const O_DIRECTORY = 0o200000
const noInject = injectMissing()

describe.skipIf(noInject !== undefined)(`an entry gone between the walk's stat and its open ${needs('cc', noInject)}`, () => {
  test('a tree clone is ERR_SOURCE_CHANGED naming the entry, as for any other change, never a bare ENOENT; nothing left', () => {
    const d = freshDir()
    const src = path.join(d, 'src')
    fs.mkdirSync(src)
    fs.writeFileSync(path.join(src, 'config'), 'x')
    // Every O_PATH open of a file answers ENOENT: the file was removed after the walk stat'ed it.
    const [r] = runInjected({ syscall: 'openat', answer: 'ENOENT', arg: { index: 2, mask: O_PATH | O_DIRECTORY, value: O_PATH } }, [
      { op: 'clone', source: src, dest: path.join(d, 'dst') },
    ])
    expect(r).toMatchObject({ ok: false, code: 'ERR_SOURCE_CHANGED', path: path.join(src, 'config'), dest: path.join(d, 'dst', 'config') })
    expect(ls(d)).toEqual(['src'])
  })
})

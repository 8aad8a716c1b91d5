/**
 * Fault handling of the data path: what each copy_file_range/read/write/FICLONE returns
 * is checked, kernel answers that some file systems give (copy_file_range returning 0 before the end, EAGAIN from
 * OpenZFS) are played by a seccomp filter (inject-helpers.ts), and set-id bits follow the owner. Real file
 * systems throughout: ext4 for copies, XFS for FICLONE.
 */
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { clone, openPool } from '../lib/index.js'
import {
  Child,
  emptyPoolState,
  fixtures,
  freshDir,
  makeSparseFile,
  MiB,
  mounts,
  needs,
  poolState,
  runCommand,
  tempLeftovers,
  unprivilegedChildren,
  writeRandomFile,
} from './helpers.js'
import { FICLONE, injectMissing, runInjected } from './inject-helpers.js'

const noInject = injectMissing()
const sha256 = (b: Buffer) => createHash('sha256').update(b).digest('hex')
const ext4 = mounts.scratchFsType === 'ext4' ? mounts.scratch : mounts.small

describe.skipIf(noInject !== undefined || ext4 === null)(
  `copy_file_range answering 0 before the end (FUSE, network file systems) ${needs('cc and ext4', noInject ?? (ext4 === null && 'no ext4'))}`,
  () => {
    test('clone() of 8 MiB of random data copies every byte by read/write, not 8 MiB of holes', () => {
      const d = freshDir(ext4!)
      const data = writeRandomFile(path.join(d, 'base.img'), 8 * MiB)
      const [r] = runInjected({ syscall: 'copy_file_range', answer: '0' }, [
        { op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'out.img') },
      ])
      expect(r).toMatchObject({ ok: true, result: { kind: 'file', method: 'copy', bytes: 8 * MiB } })
      expect(fs.readFileSync(path.join(d, 'out.img')).equals(data)).toBe(true)
      expect(tempLeftovers(d)).toEqual([])
    })

    test('a sparse source keeps its data and its size', () => {
      const d = freshDir(ext4!)
      const data = makeSparseFile(path.join(d, 'sparse.img'), 16 * MiB, 5 * MiB, 1 * MiB)
      const [r] = runInjected({ syscall: 'copy_file_range', answer: '0' }, [
        { op: 'clone', source: path.join(d, 'sparse.img'), dest: path.join(d, 'out.img') },
      ])
      expect(r).toMatchObject({ ok: true, result: { method: 'copy', bytes: 16 * MiB } })
      const out = fs.readFileSync(path.join(d, 'out.img'))
      expect(out.length).toBe(16 * MiB)
      expect(out.subarray(5 * MiB, 6 * MiB).equals(data)).toBe(true)
      expect(out.subarray(0, 5 * MiB).every((b) => b === 0)).toBe(true)
    })

    test('allocate({ template }) with a file entry gets the real bytes', () => {
      const d = freshDir(ext4!)
      const data = writeRandomFile(path.join(d, 'base.img'), 8 * MiB)
      const root = path.join(d, 'pool')
      const [r] = runInjected({ syscall: 'copy_file_range', answer: '0' }, [
        { op: 'allocate', root, template: { 'rootfs.img': path.join(d, 'base.img') } },
      ])
      expect(r.ok).toBe(true)
      if (!r.ok) return
      expect(r.result.files['rootfs.img']).toBe(sha256(data))
      expect(r.result.template[0]).toMatchObject({ method: 'copy' })
      expect(poolState(root)).toEqual(emptyPoolState)
    })

    test('a tree clone copies every file of the tree by read/write', () => {
      const d = freshDir(ext4!)
      const src = path.join(d, 'src')
      fs.mkdirSync(path.join(src, 'sub'), { recursive: true })
      const big = writeRandomFile(path.join(src, 'sub', 'big.img'), 3 * MiB + 5)
      const small = writeRandomFile(path.join(src, 'small'), 100)
      const [r] = runInjected({ syscall: 'copy_file_range', answer: '0' }, [
        { op: 'clone', source: src, dest: path.join(d, 'dst') },
      ])
      expect(r).toMatchObject({ ok: true, result: { kind: 'tree', method: 'copy', files: 2, bytes: 3 * MiB + 105 } })
      expect(fs.readFileSync(path.join(d, 'dst', 'sub', 'big.img')).equals(big)).toBe(true)
      expect(fs.readFileSync(path.join(d, 'dst', 'small')).equals(small)).toBe(true)
    })

    test("clone('/proc/self/mountinfo') publishes the bytes read to end of file, never an empty file", () => {
      const d = freshDir(ext4!)
      const [r] = runInjected({ syscall: 'copy_file_range', answer: '0' }, [
        { op: 'clone', source: '/proc/self/mountinfo', dest: path.join(d, 'm') },
      ])
      expect(r).toMatchObject({ ok: true, result: { method: 'copy' } })
      const text = fs.readFileSync(path.join(d, 'm'), 'utf8')
      expect(r.ok && r.result.bytes).toBe(Buffer.byteLength(text))
      expect(text.length).toBeGreaterThan(0)
      expect(text.endsWith('\n')).toBe(true)
      // Every line is a mountinfo line: "<id> <parent> <major>:<minor> <root> <mount point> ... - <fstype> ..."
      for (const line of text.trimEnd().split('\n')) expect(line).toMatch(/^\d+ \d+ \d+:\d+ \S+ \S+ .* - \S+ /)
    })
  },
)

describe.skipIf(ext4 === null)(`pseudo-files whose st_size is 0 (procfs, binfmt_misc) or 4096 (sysfs) ${needs('ext4', ext4 === null && 'no ext4')}`, () => {
  test("clone('/proc/version') gives exactly the bytes read(2) returns", async () => {
    const d = freshDir(ext4!)
    const r = await clone('/proc/version', path.join(d, 'version'))
    const expected = fs.readFileSync('/proc/version')
    expect(expected.length).toBeGreaterThan(0)
    expect(r).toMatchObject({ kind: 'file', method: 'copy', bytes: expected.length })
    expect(fs.readFileSync(path.join(d, 'version')).equals(expected)).toBe(true)
  })

  test("clone('/proc/self/mountinfo') is not empty and its size is the bytes reported", async () => {
    const d = freshDir(ext4!)
    const r = await clone('/proc/self/mountinfo', path.join(d, 'm'))
    const size = fs.statSync(path.join(d, 'm')).size
    expect(size).toBeGreaterThan(0)
    expect(r.bytes).toBe(size)
  })

  const sysfsAttr = '/sys/devices/system/cpu/online'
  test.skipIf(!fs.existsSync(sysfsAttr))(
    `a sysfs attribute (st_size 4096, a few bytes of text) is published with the bytes read, not 4096 ${needs('sysfs', !fs.existsSync(sysfsAttr) && `no ${sysfsAttr}`)}`,
    async () => {
      const d = freshDir(ext4!)
      const r = await clone(sysfsAttr, path.join(d, 'online'))
      const expected = fs.readFileSync(sysfsAttr)
      expect(fs.statSync(sysfsAttr).size).toBe(4096)
      expect(r).toMatchObject({ method: 'copy', bytes: expected.length })
      expect(fs.readFileSync(path.join(d, 'online')).equals(expected)).toBe(true)
    },
  )

  test.skipIf(!mounts.root)(
    `a file of another pseudo file system (binfmt_misc's status: st_size 0) is copied to its end, not taken for a file that grew ${needs('root for mount -t binfmt_misc', !mounts.root && 'not running as root')}`,
    async () => {
      const d = freshDir(ext4!)
      const bm = path.join(d, 'binfmt_misc')
      fs.mkdirSync(bm)
      expect(runCommand('mount', ['-t', 'binfmt_misc', 'vmspace-test', bm]).status).toBe(0)
      const status = path.join(bm, 'status')
      expect(fs.statSync(status).size).toBe(0)
      const expected = fs.readFileSync(status)
      expect(expected.toString()).toMatch(/^(enabled|disabled)\n$/)
      for (const reflink of ['auto', 'never'] as const) {
        const r = await clone(status, path.join(d, reflink), { reflink })
        expect(r).toMatchObject({ method: 'copy', bytes: expected.length })
        expect(fs.readFileSync(path.join(d, reflink)).equals(expected)).toBe(true)
      }
    },
  )

  test("reflink: 'never' copies a procfs file to its end too", async () => {
    const d = freshDir(ext4!)
    const r = await clone('/proc/version', path.join(d, 'version'), { reflink: 'never' })
    expect(fs.readFileSync(path.join(d, 'version')).equals(fs.readFileSync('/proc/version'))).toBe(true)
    expect(r.bytes).toBe(fs.statSync(path.join(d, 'version')).size)
  })
})

describe.skipIf(noInject !== undefined || ext4 === null)(
  `copy_file_range answering EAGAIN ${needs('cc and ext4', noInject ?? (ext4 === null && 'no ext4'))}`,
  () => {
    test('clone() tries again, then copies by read/write: the bytes arrive, EAGAIN never reaches the caller', () => {
      const d = freshDir(ext4!)
      const data = writeRandomFile(path.join(d, 'base.img'), 8 * MiB)
      const [r] = runInjected({ syscall: 'copy_file_range', answer: 'EAGAIN' }, [
        { op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'out.img') },
      ])
      expect(r).toMatchObject({ ok: true, result: { method: 'copy', bytes: 8 * MiB } })
      expect(fs.readFileSync(path.join(d, 'out.img')).equals(data)).toBe(true)
    })

    test('copy_file_range answering EINTR: the same', () => {
      const d = freshDir(ext4!)
      const data = writeRandomFile(path.join(d, 'base.img'), 3 * MiB + 17)
      const [r] = runInjected({ syscall: 'copy_file_range', answer: 'EINTR' }, [
        { op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'out.img') },
      ])
      expect(r).toMatchObject({ ok: true, result: { method: 'copy', bytes: 3 * MiB + 17 } })
      expect(fs.readFileSync(path.join(d, 'out.img')).equals(data)).toBe(true)
    })

    test('allocate({ template }) with a file entry: the bytes arrive', () => {
      const d = freshDir(ext4!)
      const data = writeRandomFile(path.join(d, 'base.img'), 2 * MiB)
      const root = path.join(d, 'pool')
      const [r] = runInjected({ syscall: 'copy_file_range', answer: 'EAGAIN' }, [
        { op: 'allocate', root, template: { 'rootfs.img': path.join(d, 'base.img') } },
      ])
      expect(r.ok).toBe(true)
      if (r.ok) expect(r.result.files['rootfs.img']).toBe(sha256(data))
    })
  },
)

describe.skipIf(noInject !== undefined || mounts.xfs === null)(
  `ioctl(FICLONE) answering EAGAIN (OpenZFS: blocks of the open transaction group) ${needs('cc and XFS', noInject ?? (mounts.xfs === null && mounts.missing.xfs))}`,
  () => {
    const ficloneEagain = { syscall: 'ioctl', answer: 'EAGAIN', arg: { index: 1, mask: 0xffffffff, value: FICLONE } } as const

    test("reflink: 'auto' tries again, then copies: method 'copy', every byte", () => {
      const d = freshDir(mounts.xfs!)
      const data = writeRandomFile(path.join(d, 'base.img'), 8 * MiB)
      const [r] = runInjected(ficloneEagain, [{ op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'out.img') }])
      expect(r).toMatchObject({ ok: true, result: { method: 'copy', bytes: 8 * MiB } })
      expect(fs.readFileSync(path.join(d, 'out.img')).equals(data)).toBe(true)
    })

    test("reflink: 'always' fails with ERR_REFLINK_UNSUPPORTED (cause EAGAIN); no destination, no temp file", () => {
      const d = freshDir(mounts.xfs!)
      writeRandomFile(path.join(d, 'base.img'), 1 * MiB)
      const [r] = runInjected(ficloneEagain, [
        { op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'out.img'), options: { reflink: 'always' } },
      ])
      expect(r).toMatchObject({ ok: false, code: 'ERR_REFLINK_UNSUPPORTED', causeCode: 'EAGAIN', syscall: 'ioctl(FICLONE)' })
      expect(fs.readdirSync(d)).toEqual(['base.img'])
    })

    test("allocate({ template }): 'auto' gets the bytes; 'always' fails with ERR_REFLINK_UNSUPPORTED and leaves the pool empty", () => {
      const d = freshDir(mounts.xfs!)
      const data = writeRandomFile(path.join(d, 'base.img'), 2 * MiB)
      const root = path.join(d, 'pool')
      const template = { 'rootfs.img': path.join(d, 'base.img') }
      const [auto, always] = runInjected(ficloneEagain, [
        { op: 'allocate', root, template },
        { op: 'allocate', root, template, reflink: 'always' },
      ])
      expect(auto.ok).toBe(true)
      if (auto.ok) {
        expect(auto.result.files['rootfs.img']).toBe(sha256(data))
        expect(auto.result.template[0]).toMatchObject({ method: 'copy' })
      }
      expect(always).toMatchObject({ ok: false, code: 'ERR_REFLINK_UNSUPPORTED', causeCode: 'EAGAIN' })
      expect(poolState(root)).toEqual(emptyPoolState)
    })
  },
)

describe.skipIf(noInject !== undefined || ext4 === null)(
  `read(2) and write(2) answers on the read/write copy (reflink: 'never') ${needs('cc and ext4', noInject ?? (ext4 === null && 'no ext4'))}`,
  () => {
    // Only the copy's own 1 MiB reads and writes are answered (count == 1 MiB): the dynamic loader and node read
    // with pread64 too, in smaller pieces.
    const oneMiB = { index: 2, mask: 0xffffffff, value: MiB }
    const cases = [
      { syscall: 'pread64', answer: '0', code: 'EIO', step: 'read', why: 'a read that ends before the size the file still reports' },
      { syscall: 'pread64', answer: 'EAGAIN', code: 'EAGAIN', step: 'read', why: 'a read answering EAGAIN past the retries' },
      { syscall: 'pwrite64', answer: '0', code: 'EIO', step: 'write', why: 'a write that writes nothing' },
      { syscall: 'pwrite64', answer: 'EINTR', code: 'EINTR', step: 'write', why: 'a write interrupted past the retries' },
    ] as const
    for (const c of cases) {
      test(`${c.why} fails with ${c.code} (never loops, never publishes a short file); no destination, no temp`, () => {
        const d = freshDir(ext4!)
        writeRandomFile(path.join(d, 'base.img'), 3 * MiB)
        const [r] = runInjected({ syscall: c.syscall, answer: c.answer, arg: oneMiB }, [
          { op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'out.img'), options: { reflink: 'never' } },
        ])
        expect(r).toMatchObject({ ok: false, code: c.code, syscall: c.step })
        expect(fs.readdirSync(d)).toEqual(['base.img'])
      })
    }
  },
)

// ---- set-id bits follow the owner ----

/** A 4755 file (and a 2755 one) owned by uid/gid 1000, as root makes them. */
function setIdFiles(d: string): { suid: string; sgid: string } {
  const suid = path.join(d, 'suid')
  const sgid = path.join(d, 'sgid')
  writeRandomFile(suid, 4096, 0o755)
  writeRandomFile(sgid, 4096, 0o755)
  fs.chownSync(suid, 1000, 1000)
  fs.chownSync(sgid, 1000, 1000)
  fs.chmodSync(suid, 0o4755) // after the chown, which clears it
  fs.chmodSync(sgid, 0o2755)
  return { suid, sgid }
}

const asRoot = mounts.root

describe.skipIf(!asRoot)(`set-id bits are kept only where the owner is kept ${needs('root', !asRoot && 'not root')}`, () => {
  test('clone() of a 4755 file owned by uid 1000: owned by root, mode 0755 (no root-owned set-uid binary)', async () => {
    const d = freshDir()
    const { suid, sgid } = setIdFiles(d)
    await clone(suid, path.join(d, 'suid.clone'))
    await clone(sgid, path.join(d, 'sgid.clone'))
    expect(fs.statSync(path.join(d, 'suid.clone'))).toMatchObject({ uid: 0, gid: 0, mode: 0o100755 })
    expect(fs.statSync(path.join(d, 'sgid.clone'))).toMatchObject({ uid: 0, gid: 0, mode: 0o100755 })
  })

  test('clone() of a 4755 file root owns keeps the bit (the owner is the same)', async () => {
    const d = freshDir()
    writeRandomFile(path.join(d, 'own'), 4096, 0o755)
    fs.chmodSync(path.join(d, 'own'), 0o6755)
    await clone(path.join(d, 'own'), path.join(d, 'own.clone'))
    expect(fs.statSync(path.join(d, 'own.clone'))).toMatchObject({ uid: 0, gid: 0, mode: 0o106755 })
  })

  test('a template map entry and ws.clone() drop the bits the same way', async () => {
    const d = freshDir()
    const { suid } = setIdFiles(d)
    const pool = await openPool(path.join(d, 'pool'))
    try {
      const ws = await pool.allocate({ template: { 'bin/tool': suid } })
      await ws.clone(suid, 'tool2')
      expect(fs.statSync(path.join(ws.path, 'bin/tool'))).toMatchObject({ uid: 0, mode: 0o100755 })
      expect(fs.statSync(path.join(ws.path, 'tool2'))).toMatchObject({ uid: 0, mode: 0o100755 })
      await ws.dispose()
    } finally {
      await pool.close()
    }
  })

  test('a tree clone as root keeps the owner (uid 1000), and so keeps the bits', async () => {
    const d = freshDir()
    const src = path.join(d, 'src')
    fs.mkdirSync(src)
    setIdFiles(src)
    await clone(src, path.join(d, 'dst'))
    expect(fs.statSync(path.join(d, 'dst', 'suid'))).toMatchObject({ uid: 1000, gid: 1000, mode: 0o104755 })
    expect(fs.statSync(path.join(d, 'dst', 'sgid'))).toMatchObject({ uid: 1000, gid: 1000, mode: 0o102755 })
  })
})

describe.skipIf(!unprivilegedChildren)(
  `as uid 65534, a clone is the caller's: set-id bits of another owner are dropped ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`,
  () => {
    async function runChild(req: object): Promise<Record<string, unknown>> {
      const child = new Child(path.join(fixtures, 'clone-tree-child.cjs'), [JSON.stringify(req)])
      child.proc.stdin!.end()
      const m = await child.next()
      await child.exited
      return m
    }

    test('file and tree clones of a 4755 file owned by uid 1000 are owned by 65534, mode 0755', async () => {
      const d = freshDir()
      fs.chmodSync(d, 0o755)
      const src = path.join(d, 'src')
      fs.mkdirSync(src, { mode: 0o755 })
      fs.chmodSync(src, 0o755)
      const { suid } = setIdFiles(src)
      const out = path.join(d, 'out')
      fs.mkdirSync(out)
      fs.chownSync(out, 65534, 65534)
      expect(await runChild({ op: 'clone', source: suid, dest: path.join(out, 'file') })).toMatchObject({ event: 'done' })
      expect(await runChild({ op: 'clone', source: src, dest: path.join(out, 'tree') })).toMatchObject({ event: 'done' })
      expect(fs.statSync(path.join(out, 'file'))).toMatchObject({ uid: 65534, mode: 0o100755 })
      expect(fs.statSync(path.join(out, 'tree', 'suid'))).toMatchObject({ uid: 65534, mode: 0o100755 })
      expect(fs.statSync(path.join(out, 'tree', 'sgid'))).toMatchObject({ uid: 65534, gid: 65534, mode: 0o100755 })
    })
  },
)

/**
 * Per-workspace quotas, the free-space floor and space accounting, on real file systems as root:
 * a btrfs of this suite's own with quotas enabled (qgroups slow btrfs down: the shared btrfs mount stays without),
 * and, wherever the kernel mounts them, XFS with prjquota and ext4 with project quotas (skipped here with the
 * reason printed otherwise).
 */
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { afterAll, describe, expect, test } from 'vitest'
import { openPool, probeQuota, type Pool } from '../lib/index.js'
import { removeScratch, unmountBeneath } from './setup/mounts.js'
import { Child, MiB, emptyPoolState, fixtures, freshDir, mounts, needs, poolState, repoRoot, stressRounds, writeRandomFile } from './helpers.js'

// ---- file systems of this suite ----

interface OwnMount {
  dir: string | null
  why: string | undefined
}

const base = mounts.root ? fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-quota-')) : null
afterAll(() => {
  if (base) removeScratch(base)
})

function sh(cmd: string, args: string[]): string | null {
  const r = spawnSync(cmd, args, { encoding: 'utf8' })
  if (r.error) return `${cmd}: ${r.error.message}`
  if (r.status !== 0) return `${cmd} ${args.join(' ')} exited ${r.status}: ${(r.stderr || r.stdout).trim().split('\n').pop()}`
  return null
}

/** A sparse image formatted by `mkfs`, loop-mounted with `options`, then `after` run on the mount point. */
function ownMount(name: string, size: number, mkfs: string[], options: string, after?: string[]): OwnMount {
  if (!base) return { dir: null, why: 'not running as root (loop mounts need root)' }
  const image = path.join(base, `${name}.img`)
  const dir = path.join(base, name)
  const fd = fs.openSync(image, 'wx')
  fs.ftruncateSync(fd, size)
  fs.closeSync(fd)
  fs.mkdirSync(dir)
  const why =
    sh(mkfs[0], [...mkfs.slice(1), image]) ??
    sh('mount', ['-o', `loop,${options}`, image, dir]) ??
    (after ? sh(after[0], [...after.slice(1), dir]) : null)
  if (why) {
    removeScratch(dir)
    return { dir: null, why: `${why} (kernel ${os.release()})` }
  }
  fs.chmodSync(dir, 0o755)
  return { dir, why: undefined }
}

const btrfsQ = ownMount('btrfs-quota', 1536 * MiB, ['mkfs.btrfs', '-q', '-f'], 'rw', ['btrfs', 'quota', 'enable'])
const xfsPrj = ownMount('xfs-prj', 512 * MiB, ['mkfs.xfs', '-q', '-f', '-m', 'reflink=1'], 'prjquota')
const ext4Prj = ownMount('ext4-prj', 256 * MiB, ['mkfs.ext4', '-q', '-F', '-O', 'project,quota'], 'prjquota')
for (const [label, m] of [['XFS prjquota', xfsPrj], ['ext4 project quota', ext4Prj], ['btrfs with quotas', btrfsQ]] as const)
  if (!m.dir) console.log(`quota.test.ts: ${label} suite skipped: ${m.why}`)

const QUOTA = 64 * MiB

function writer(mode: 'file' | 'rewrite' | 'files', target: string): { code: string | null; bytes: number; files: number } {
  const r = spawnSync(process.execPath, [path.join(fixtures, 'quota-writer.cjs'), mode, target], { encoding: 'utf8' })
  if (r.status !== 0) throw new Error(`quota-writer exited ${r.status}: ${r.stderr}`)
  return JSON.parse(r.stdout)
}

function btrfsLines(args: string[]): string[] {
  const r = spawnSync('btrfs', args, { encoding: 'utf8' })
  if (r.status !== 0) throw new Error(`btrfs ${args.join(' ')}: ${r.stderr}`)
  return r.stdout.split('\n').filter((l) => l.trim() !== '')
}

/** Subvolumes below `mnt` (paths relative to the file system's top). */
function subvolumes(mnt: string): string[] {
  return subvolumeIds(mnt).map((s) => s[1])
}

/** Subvolumes below `mnt` as [id, path]. */
function subvolumeIds(mnt: string): [string, string][] {
  return btrfsLines(['subvolume', 'list', '-o', mnt]).map((l) => [l.split(' ')[1], l.split(' path ')[1]])
}

/**
 * Level-0 qgroups other than the top level's (0/5), as [qgroup, max exclusive]; with `cleaned`, once those
 * deleted subvolumes are dropped by the cleaner (btrfs subvolume sync) and a transaction committed.
 */
function qgroups(mnt: string, cleaned: string[] = []): [string, string][] {
  if (cleaned.length) {
    btrfsLines(['subvolume', 'sync', mnt, ...cleaned])
    btrfsLines(['filesystem', 'sync', mnt])
  }
  return btrfsLines(['qgroup', 'show', '-e', '--raw', mnt])
    .filter((l) => /^0\/\d+/.test(l) && !l.startsWith('0/5 '))
    .map((l) => {
      const f = l.trim().split(/\s+/)
      return [f[0], f[3]]
    })
}

// ---- argument checks (no file system needed beyond scratch) ----

describe('quota options are strict', () => {
  test.each([
    [{ qouta: { bytes: MiB } }, 'options.qouta'],
    [{ quota: { byte: MiB } }, 'options.quota.byte'],
    [{ quota: {} }, 'options.quota'],
    [{ quota: { bytes: 0 } }, 'options.quota.bytes'],
    [{ quota: { bytes: 1.5 } }, 'options.quota.bytes'],
    [{ quota: { bytes: -1 } }, 'options.quota.bytes'],
    [{ quota: { inodes: 2 ** 32 } }, 'options.quota.inodes'],
  ])('allocate(%j) is ERR_INVALID_ARG_VALUE naming %s, and makes nothing', async (options, name) => {
    const root = freshDir()
    const pool = await openPool(root)
    await expect(pool.allocate(options as never)).rejects.toMatchObject({
      code: 'ERR_INVALID_ARG_VALUE',
      message: expect.stringContaining(`\`${name}\``),
    })
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test('a quota that is not an object is ERR_INVALID_ARG_TYPE', async () => {
    const pool = await openPool(freshDir())
    await expect(pool.allocate({ quota: 64 as never })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_TYPE' })
    await pool.close()
  })

  test.each([
    [{ minFreeBytes: -1 }, 'ERR_INVALID_ARG_VALUE'],
    [{ minFreeBytes: '1G' }, 'ERR_INVALID_ARG_TYPE'],
    [{ projectIds: [10, 5] }, 'ERR_INVALID_ARG_VALUE'],
    [{ projectIds: [0, 5] }, 'ERR_INVALID_ARG_VALUE'],
    [{ projectIds: 5 }, 'ERR_INVALID_ARG_TYPE'],
    [{ minFreeByte: 1 }, 'ERR_INVALID_ARG_VALUE'],
  ])('openPool(root, %j) is %s', async (options, code) => {
    await expect(openPool(freshDir(), options as never)).rejects.toMatchObject({ code })
  })
})

// ---- file systems that cannot enforce a quota ----

describe('where no quota can be enforced, allocate({ quota }) fails with ERR_QUOTA_UNSUPPORTED and leaves nothing', () => {
  const cases: [string, () => string | null, string | undefined][] = [
    ['the machine ext4 (no project quota)', () => mounts.scratch, undefined],
    ['XFS mounted without prjquota', () => mounts.xfs, mounts.missing.xfs],
    ['btrfs without quotas enabled', () => mounts.btrfs, mounts.missing.btrfs],
  ]
  for (const [label, dir, missing] of cases) {
    test.skipIf(dir() === null)(`${label} ${needs('the mount', missing)}`, async () => {
      const root = freshDir(dir()!)
      const pool = await openPool(root)
      const support = await probeQuota(root)
      expect(support.supported).toBe(false)
      const err = await pool.allocate({ quota: { bytes: QUOTA } }).catch((e) => e)
      expect(err).toMatchObject({ code: 'ERR_QUOTA_UNSUPPORTED', cause: { code: support.code } })
      expect(poolState(root)).toEqual(emptyPoolState)
      if (label.startsWith('btrfs')) {
        expect(support).toMatchObject({ backend: 'btrfs-qgroup', code: 'ENOTCONN' })
        expect(err.message).toContain('btrfs quota enable')
        expect(subvolumes(root).filter((p) => p.includes(path.basename(root)))).toEqual([])
      }
      // A workspace without a quota is still fine there.
      const ws = await pool.allocate()
      await ws.dispose()
      await pool.close()
    })
  }
})

// ---- btrfs with quotas ----

describe.skipIf(!btrfsQ.dir)(`btrfs: a subvolume per workspace with a qgroup limit ${needs('root, mkfs.btrfs, btrfs qgroups', btrfsQ.why)}`, () => {
  const mnt = btrfsQ.dir!
  let image256: string

  function ownBase(): string {
    if (image256) return image256
    const dir = path.join(mnt, 'images')
    fs.mkdirSync(dir, { recursive: true })
    image256 = path.join(dir, 'base-256.img')
    writeRandomFile(image256, 256 * MiB)
    return image256
  }

  test('probeQuota says btrfs qgroups work, bytes only', async () => {
    expect(await probeQuota(mnt)).toEqual({
      supported: true,
      backend: 'btrfs-qgroup',
      inodes: false,
      detail: expect.stringContaining('qgroup'),
    })
  })

  test('a quota workspace is a subvolume published like any workspace, its qgroup limited to quota.bytes', async () => {
    const root = freshDir(mnt)
    const pool = await openPool(root)
    const ws = await pool.allocate({ quota: { bytes: QUOTA }, mode: 0o750 })
    const st = fs.statSync(ws.path)
    expect(st.ino).toBe(256) // BTRFS_FIRST_FREE_OBJECTID: the root of a subvolume
    expect(st.mode & 0o7777).toBe(0o750 & ~process.umask())
    expect(subvolumes(mnt).some((p) => p.endsWith(`/${ws.name}`))).toBe(true)
    expect(qgroups(mnt).map((q) => q[1])).toContain(String(QUOTA))
    expect((await pool.list())[0].quota).toEqual({ bytes: QUOTA })
    expect(poolState(root).staging).toEqual([])
    await ws.dispose()
    expect(poolState(root)).toEqual(emptyPoolState)
    expect(subvolumes(mnt).some((p) => p.includes(path.basename(root)))).toBe(false)
    await pool.close()
  })

  test('rollback of a quota workspace: the checkpoint\'s tree in a new subvolume with the same qgroup limit; the old subvolume and its qgroup go', async () => {
    const root = freshDir(mnt)
    const pool = await openPool(root)
    const ws = await pool.allocate({ quota: { bytes: QUOTA } })
    fs.writeFileSync(path.join(ws.path, 'a.txt'), 'first')
    const cp = await ws.checkpoint()
    fs.writeFileSync(path.join(ws.path, 'a.txt'), 'second')
    expect(await ws.rollback(cp)).toEqual({ checkpoint: cp.id, removed: true })
    expect(fs.readFileSync(path.join(ws.path, 'a.txt'), 'utf8')).toBe('first')
    expect(fs.statSync(ws.path).ino).toBe(256)
    expect((await ws.usage()).quota).toMatchObject({ limitBytes: QUOTA })
    expect(subvolumes(mnt).filter((p) => p.includes(path.basename(root)) && !p.includes('/.vmspace/templates/'))).toEqual([
      expect.stringMatching(new RegExp(`/${ws.name}$`)),
    ])
    expect(writer('file', path.join(ws.path, 'fill')).code).toBe('EDQUOT')
    await ws.dispose()
    await pool.removeTemplate(cp.id)
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test('allocate({ from, quota }) from a template: a writable snapshot of its read-only subvolume, with the qgroup limit; a guest past it gets EDQUOT; nothing left after', async () => {
    const root = freshDir(mnt)
    const pool = await openPool(root)
    const src = await pool.allocate({ quota: { bytes: QUOTA } })
    fs.writeFileSync(path.join(src.path, 'base.txt'), 'base')
    // A quota workspace is a subvolume: its commit is a read-only snapshot.
    const t = await pool.commit(src, { name: 'base' })
    expect(t.clone.method).toBe('snapshot')
    const ws = await pool.allocate({ from: 'base', quota: { bytes: QUOTA } })
    expect(ws.template[0]!.method).toBe('snapshot')
    expect(fs.statSync(ws.path).ino).toBe(256)
    expect(fs.readFileSync(path.join(ws.path, 'base.txt'), 'utf8')).toBe('base')
    const id = subvolumeIds(mnt).find((x) => x[1].endsWith(`/${ws.name}`))![0]
    expect(qgroups(mnt)).toContainEqual([`0/${id}`, String(QUOTA)])
    expect((await pool.list()).find((w) => w.id === ws.id)!.quota).toEqual({ bytes: QUOTA })
    const run = writer('file', path.join(ws.path, 'fill'))
    expect(run.code).toBe('EDQUOT')
    expect(run.bytes).toBeLessThanOrEqual(QUOTA)
    expect(fs.readFileSync(path.join(t.path, 'base.txt'), 'utf8')).toBe('base')
    for (const w of [ws, src]) await w.dispose()
    await pool.removeTemplate('base')
    expect(poolState(root)).toEqual(emptyPoolState)
    expect(subvolumes(mnt).some((p) => p.includes(path.basename(root)))).toBe(false)
    await pool.close()
  })

  test('a guest writing past quota.bytes gets EDQUOT, through a file and through a reflinked image it rewrites, while a second workspace and the pool keep allocating, cloning and disposing', async () => {
    const root = freshDir(mnt)
    const img = ownBase()
    const pool = await openPool(root)
    const a = await pool.allocate({ quota: { bytes: QUOTA } })
    const b = await pool.allocate({ quota: { bytes: QUOTA }, template: { 'rootfs.img': img } })
    // The rest of the pool at the same time: plain and quota'd workspaces, reflinked, disposed.
    const others = (async () => {
      let n = 0
      for (let i = 0; i < 20; i++) {
        const ws = await pool.allocate({ quota: i % 2 ? { bytes: QUOTA } : undefined, template: { 'rootfs.img': img } })
        const r = await ws.clone(img, 'second.img')
        expect(r.method).toBe('reflink')
        await ws.dispose()
        n++
      }
      return n
    })()
    const [fileRun, imageRun] = await Promise.all([
      Promise.resolve().then(() => writer('file', path.join(a.path, 'fill'))),
      Promise.resolve().then(() => writer('rewrite', path.join(b.path, 'rootfs.img'))),
    ])
    expect(await others).toBe(20)
    expect(fileRun.code).toBe('EDQUOT')
    expect(fileRun.bytes).toBeLessThanOrEqual(QUOTA)
    expect(fileRun.bytes).toBeGreaterThan(QUOTA / 2)
    expect(imageRun.code).toBe('EDQUOT')
    expect(imageRun.bytes).toBeLessThanOrEqual(QUOTA)
    expect(imageRun.bytes).toBeGreaterThan(QUOTA / 2)
    // The other workspace's guest is not affected by the full one.
    const c = await pool.allocate({ quota: { bytes: QUOTA } })
    expect(writer('file', path.join(c.path, 'fill'))).toMatchObject({ code: 'EDQUOT' })
    for (const ws of [a, b, c]) await ws.dispose()
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
  })

  test('a quota allocate that fails after its subvolume was made (a missing template source, an abort) leaves nothing: no entry, no subvolume', async () => {
    const root = freshDir(mnt)
    const pool = await openPool(root)
    const err = await pool.allocate({ quota: { bytes: QUOTA }, template: { 'rootfs.img': path.join(root, 'missing.img') } }).catch((e) => e)
    expect(err).toMatchObject({ code: 'ENOENT' })
    const ac = new AbortController()
    const p = pool.allocate({ quota: { bytes: QUOTA }, template: { 'rootfs.img': ownBase() }, signal: ac.signal })
    ac.abort()
    await expect(p).rejects.toMatchObject({ name: 'AbortError' })
    expect(poolState(root)).toEqual(emptyPoolState)
    expect(subvolumes(mnt).filter((s) => s.includes(path.basename(root)))).toEqual([])
    await pool.close()
  })

  test('a quota allocate on a pool with a warm reserve of the same template is built as a subvolume, never served a warm (unlimited) entry', async () => {
    const root = freshDir(mnt)
    const img = ownBase()
    const pool = await openPool(root, { warm: { template: { 'rootfs.img': img }, count: 1 } })
    const ws = await pool.allocate({ quota: { bytes: QUOTA }, template: { 'rootfs.img': img } })
    expect(fs.statSync(ws.path).ino).toBe(256)
    expect((await ws.usage()).quota).toMatchObject({ limitBytes: QUOTA })
    await ws.dispose()
    await pool.close()
  })

  test('quota.inodes on btrfs is refused with ERR_QUOTA_UNSUPPORTED (qgroups limit bytes only), nothing made', async () => {
    const root = freshDir(mnt)
    const pool = await openPool(root)
    for (const quota of [{ inodes: 100 }, { bytes: QUOTA, inodes: 100 }]) {
      const err = await pool.allocate({ quota }).catch((e) => e)
      expect(err).toMatchObject({ code: 'ERR_QUOTA_UNSUPPORTED', cause: { code: 'EINVAL' } })
      expect(err.message).toContain('inodes')
    }
    expect(poolState(root)).toEqual(emptyPoolState)
    expect(subvolumes(mnt).some((p) => p.includes(path.basename(root)))).toBe(false)
    await pool.close()
  })

  const each = stressRounds(50, 10)
  test(`8 processes x ${each} quota allocates get distinct subvolumes and qgroups; after dispose, and after a SIGKILLed owner plus sweep, no subvolume and no stale qgroup is left`, async () => {
    const root = freshDir(mnt)
    const pool = await openPool(root)
    const children = Array.from({ length: 8 }, () => new Child(path.join(fixtures, 'quota-child.cjs'), [root, String(each), String(QUOTA)]))
    const names = (await Promise.all(children.map((c) => c.expect('allocated')))).flatMap((m) => m.names as string[])
    expect(new Set(names).size).toBe(8 * each)
    const subs = subvolumeIds(mnt).filter((s) => s[1].includes(path.basename(root)))
    expect(subs.map((s) => path.basename(s[1])).sort()).toEqual([...names].sort())
    const ids = subs.map((s) => s[0])
    const ours = new Set(ids.map((id) => `0/${id}`))
    const limited = qgroups(mnt).filter((q) => ours.has(q[0]))
    expect(limited).toHaveLength(8 * each)
    for (const q of limited) expect(q[1]).toBe(String(QUOTA))
    // Four dispose, four are SIGKILLed and their workspaces swept.
    for (const c of children.slice(0, 4)) c.send('dispose')
    await Promise.all(children.slice(0, 4).map((c) => c.expect('disposed')))
    for (const c of children.slice(4)) c.proc.kill('SIGKILL')
    await Promise.all(children.slice(4).map((c) => c.exited))
    const report = await pool.sweep()
    expect(report.failed).toEqual([])
    expect(report.reclaimed).toHaveLength(4 * each)
    expect(poolState(root)).toEqual(emptyPoolState)
    expect(subvolumes(mnt).filter((p) => p.includes(path.basename(root)))).toEqual([])
    expect(qgroups(mnt, ids).filter((q) => ours.has(q[0]))).toEqual([])
    await pool.close()
  }, 240_000) // a hang guard only: the cleaner drops 400 subvolumes with qgroup accounting

  test('dispose of a subvolume workspace never follows a symlink out of it, and a mount inside it is refused EBUSY until unmounted', async () => {
    const root = freshDir(mnt)
    const outside = freshDir(mounts.scratch, 'outside')
    fs.writeFileSync(path.join(outside, 'keep.txt'), 'keep')
    const pool = await openPool(root)
    const ws = await pool.allocate({ quota: { bytes: QUOTA } })
    fs.symlinkSync(outside, path.join(ws.path, 'link'))
    fs.mkdirSync(path.join(ws.path, 'sub/deeper'), { recursive: true })
    fs.writeFileSync(path.join(ws.path, 'sub/deeper/f'), 'x')
    // A guest's nested subvolume is emptied and removed with the rest.
    expect(spawnSync('btrfs', ['subvolume', 'create', path.join(ws.path, 'nested')]).status).toBe(0)
    fs.writeFileSync(path.join(ws.path, 'nested/f'), 'y')
    const mnt2 = path.join(ws.path, 'mnt')
    fs.mkdirSync(mnt2)
    expect(spawnSync('mount', ['--bind', outside, mnt2]).status).toBe(0)
    await expect(ws.dispose()).rejects.toMatchObject({ code: 'EBUSY' })
    expect(fs.readFileSync(path.join(outside, 'keep.txt'), 'utf8')).toBe('keep')
    // The mount moved into trash with the workspace.
    expect(unmountBeneath(root)).toBe(true)
    const report = await pool.sweep()
    expect(report.failed).toEqual([])
    expect(report.reclaimed.map((e) => e.name)).toEqual([ws.name])
    expect(poolState(root)).toEqual(emptyPoolState)
    expect(fs.readFileSync(path.join(outside, 'keep.txt'), 'utf8')).toBe('keep')
    expect(subvolumes(mnt).filter((p) => p.includes(path.basename(root)))).toEqual([])
    await pool.close()
  })

  test('vmspace ls shows exclusive, shared and quota columns, vmspace probe says quotas work, and the demo with --quota sees its runaway writer stopped with EDQUOT while every other workspace finishes', async () => {
    const root = freshDir(mnt)
    const img = ownBase()
    const pool = await openPool(root)
    const ws = await pool.allocate({ quota: { bytes: QUOTA }, template: { 'rootfs.img': img } })
    const cli = path.join(repoRoot, 'dist', 'cli', 'vmspace.js')
    const ls = spawnSync(process.execPath, [cli, 'ls', '--json', root], { encoding: 'utf8' })
    expect(ls.status).toBe(0)
    expect(JSON.parse(ls.stdout).workspaces).toEqual([
      expect.objectContaining({ id: ws.id, exclusiveBytes: 0, sharedBytes: 256 * MiB, quota: expect.objectContaining({ limitBytes: QUOTA }) }),
    ])
    const text = spawnSync(process.execPath, [cli, 'ls', root], { encoding: 'utf8' })
    expect(text.stdout.split('\n')[0].split(/\s+/)).toEqual(['ID', 'STATE', 'AGE', 'ALLOCATOR', 'HOST', 'METHOD', 'ALLOCATED', 'EXCLUSIVE', 'SHARED', 'QUOTA', 'META'])
    expect(text.stdout).toMatch(new RegExp(`^${ws.id}\\s.*\\s0 B\\s+256 MiB\\s+[^/]+/64 MiB\\s`, 'm'))
    const probe = spawnSync(process.execPath, [cli, 'probe', '--json', root], { encoding: 'utf8' })
    expect(JSON.parse(probe.stdout).features.quota).toMatchObject({ supported: true, code: null })
    await ws.dispose()
    await pool.close()
    const demo = spawnSync(process.execPath, [cli, 'demo', '--vms', '12', '--workers', '2', '--quota', '64M', '--root', freshDir(mnt), '--base', img], {
      encoding: 'utf8',
    })
    expect(demo.status, demo.stdout + demo.stderr).toBe(0)
    expect(demo.stdout).toMatch(/\| quota\s+\| 64 MiB per workspace; runaway writer in [0-9a-f]{8}\.\.\.: EDQUOT after /)
    expect(demo.stdout).toMatch(/\| workspaces\s+\| 12 of 12 /)
  })

  test('usage: a workspace cloned from a 256 MiB base reports ~0 exclusive and 256 MiB shared; after the guest rewrites 32 MiB, ~32 MiB exclusive; the quota shows its limit', async () => {
    const root = freshDir(mnt)
    const img = ownBase()
    const pool = await openPool(root)
    const ws = await pool.allocate({ quota: { bytes: QUOTA }, template: { 'rootfs.img': img } })
    const u0 = await ws.usage()
    expect(u0).toMatchObject({ files: 1, dirs: 0, others: 0, logicalBytes: 256 * MiB, sharedBytes: 256 * MiB, exclusiveBytes: 0 })
    expect(u0.quota).toMatchObject({ limitBytes: QUOTA, limitInodes: 0 })
    const fd = fs.openSync(path.join(ws.path, 'rootfs.img'), 'r+')
    const chunk = Buffer.alloc(MiB, 7)
    for (let i = 0; i < 32; i++) fs.writeSync(fd, chunk, 0, MiB, i * 2 * MiB) // every other MiB: 32 MiB rewritten
    fs.fsyncSync(fd)
    fs.closeSync(fd)
    const u1 = await ws.usage()
    expect(u1.exclusiveBytes).toBe(32 * MiB)
    expect(u1.sharedBytes).toBe(224 * MiB)
    spawnSync('btrfs', ['filesystem', 'sync', mnt])
    const u2 = await ws.usage()
    expect(u2.quota!.usedBytes).toBeGreaterThanOrEqual(32 * MiB)
    expect(u2.quota!.usedBytes).toBeLessThan(33 * MiB)
    const listed = await pool.list({ usage: true })
    expect(listed[0].usage).toMatchObject({ exclusiveBytes: 32 * MiB, sharedBytes: 224 * MiB })
    const total = await pool.usage()
    expect(total).toMatchObject({ workspaces: 1, exclusiveBytes: 32 * MiB, sharedBytes: 224 * MiB, quota: { supported: true } })
    expect(total.availableBytes).toBeGreaterThan(0)
    await ws.dispose()
    await pool.close()
  })
})

// ---- usage elsewhere, and cancel ----

describe('usage', () => {
  test('the copy fallback on ext4 reports every byte exclusive', async () => {
    const root = freshDir(mounts.scratch)
    const src = path.join(freshDir(mounts.scratch, 'src'), 'base.img')
    writeRandomFile(src, 8 * MiB)
    const pool = await openPool(root)
    const ws = await pool.allocate({ template: { 'rootfs.img': src, 'dir/x.img': src } })
    fs.symlinkSync('/etc/passwd', path.join(ws.path, 'link'))
    fs.linkSync(path.join(ws.path, 'rootfs.img'), path.join(ws.path, 'hard.img'))
    const u = await ws.usage()
    expect(u).toMatchObject({ files: 2, dirs: 1, others: 1, sharedBytes: 0, exclusiveBytes: 16 * MiB, logicalBytes: 16 * MiB })
    expect(u.quota).toBeUndefined()
    await ws.dispose()
    await pool.close()
  })

  test.skipIf(!mounts.xfs)(`on XFS a reflinked template is shared until rewritten ${needs('XFS', mounts.missing.xfs)}`, async () => {
    const root = freshDir(mounts.xfs!)
    const src = path.join(freshDir(mounts.xfs!, 'src'), 'base.img')
    writeRandomFile(src, 16 * MiB)
    const pool = await openPool(root)
    const ws = await pool.allocate({ template: { 'rootfs.img': src } })
    expect(await ws.usage()).toMatchObject({ files: 1, sharedBytes: 16 * MiB, exclusiveBytes: 0 })
    const fd = fs.openSync(path.join(ws.path, 'rootfs.img'), 'r+')
    fs.writeSync(fd, Buffer.alloc(4 * MiB, 1), 0, 4 * MiB, 0)
    fs.fsyncSync(fd)
    fs.closeSync(fd)
    expect(await ws.usage()).toMatchObject({ sharedBytes: 12 * MiB, exclusiveBytes: 4 * MiB })
    await ws.dispose()
    await pool.close()
  })

  test('usage is cancellable with signal (AbortError), also mid-walk of 10,000 files', async () => {
    const root = freshDir(mounts.scratch)
    const pool = await openPool(root)
    const ws = await pool.allocate()
    for (let d = 0; d < 100; d++) {
      fs.mkdirSync(path.join(ws.path, `d${d}`))
      for (let f = 0; f < 100; f++) fs.writeFileSync(path.join(ws.path, `d${d}`, `f${f}`), 'x')
    }
    await expect(ws.usage({ signal: AbortSignal.abort() })).rejects.toMatchObject({ name: 'AbortError' })
    const ac = new AbortController()
    const p = ws.usage({ signal: ac.signal })
    ac.abort()
    await expect(p).rejects.toMatchObject({ name: 'AbortError' })
    expect(await ws.usage()).toMatchObject({ files: 10000, dirs: 100 })
    await ws.dispose()
    await expect(ws.usage()).rejects.toMatchObject({ code: 'ERR_DISPOSED' })
    await pool.close()
  })

  test('a tree deeper than the fd bound is walked whole', async () => {
    const root = freshDir(mounts.scratch)
    const pool = await openPool(root)
    const ws = await pool.allocate()
    let d = ws.path
    for (let i = 0; i < 150; i++) {
      d = path.join(d, 'd')
      fs.mkdirSync(d)
      fs.writeFileSync(path.join(d, 'a'), 'a')
      fs.writeFileSync(path.join(d, 'b'), 'b')
    }
    expect(await ws.usage()).toMatchObject({ files: 300, dirs: 150 })
    await ws.dispose()
    await pool.close()
  })
})

// ---- free-space floor ----

describe.skipIf(!mounts.small)(`minFreeBytes ${needs('the small ext4', mounts.missing.small)}`, () => {
  test('allocate refuses with ENOSPC before cloning anything when the file system has less than minFreeBytes available; nothing is left', async () => {
    const root = freshDir(mounts.small!)
    const src = path.join(freshDir(mounts.scratch, 'src'), 'base.img')
    writeRandomFile(src, MiB)
    const avail = fs.statfsSync(root).bavail * fs.statfsSync(root).bsize
    const pool = await openPool(root, { minFreeBytes: avail + 256 * MiB })
    await expect(pool.allocate({ template: { 'rootfs.img': src } })).rejects.toMatchObject({ code: 'ENOSPC', syscall: 'statvfs' })
    expect(poolState(root)).toEqual(emptyPoolState)
    await pool.close()
    const ok = await openPool(root, { minFreeBytes: 4 * MiB })
    const ws = await ok.allocate({ template: { 'rootfs.img': src } })
    await ws.dispose()
    await ok.close()
  })
})

// ---- project quotas (XFS prjquota, ext4 project) wherever the kernel mounts them ----

for (const [label, m] of [['XFS prjquota', xfsPrj], ['ext4 project quota', ext4Prj]] as const) {
  describe.skipIf(!m.dir)(`${label}: a project id per workspace ${needs(`a ${label} mount`, m.why)}`, () => {
    const projectIds: [number, number] = [0x40000000, 0x40000fff]

    async function open(): Promise<{ root: string; pool: Pool }> {
      const root = freshDir(m.dir!)
      return { root, pool: await openPool(root, { projectIds }) }
    }

    test('probeQuota says project quotas work, with inodes', async () => {
      expect(await probeQuota(m.dir!)).toMatchObject({ supported: true, backend: 'project', inodes: true })
    })

    test('a guest writing past quota.bytes gets EDQUOT; past quota.inodes too', async () => {
      const { root, pool } = await open()
      const a = await pool.allocate({ quota: { bytes: 32 * MiB } })
      const r = writer('file', path.join(a.path, 'fill'))
      expect(r.code).toBe('EDQUOT')
      expect(r.bytes).toBeLessThanOrEqual(32 * MiB)
      const b = await pool.allocate({ quota: { inodes: 50 } })
      const f = writer('files', b.path)
      expect(f.code).toBe('EDQUOT')
      expect(f.files).toBeLessThan(50)
      expect((await b.usage()).quota).toMatchObject({ limitInodes: 50 })
      await a.dispose()
      await b.dispose()
      expect(poolState(root)).toEqual(emptyPoolState)
      expect(fs.readdirSync(path.join(root, '.vmspace', 'projects'))).toEqual([])
      await pool.close()
    })

    test('rollback of a quota workspace: the new tree gets its own project id with the same limits, claimed under the workspace\'s name; the old id is released', async () => {
      const { root, pool } = await open()
      const ws = await pool.allocate({ quota: { bytes: 32 * MiB, inodes: 50 } })
      fs.writeFileSync(path.join(ws.path, 'a.txt'), 'first')
      const cp = await ws.checkpoint()
      fs.writeFileSync(path.join(ws.path, 'a.txt'), 'second')
      const claimsBefore = fs.readdirSync(path.join(root, '.vmspace', 'projects'))
      expect(await ws.rollback(cp)).toEqual({ checkpoint: cp.id, removed: true })
      expect(fs.readFileSync(path.join(ws.path, 'a.txt'), 'utf8')).toBe('first')
      expect((await ws.usage()).quota).toMatchObject({ limitBytes: 32 * MiB, limitInodes: 50 })
      const claims = fs.readdirSync(path.join(root, '.vmspace', 'projects'))
      expect(claims).toHaveLength(1)
      expect(claims).not.toEqual(claimsBefore)
      expect(fs.readFileSync(path.join(root, '.vmspace', 'projects', claims[0]), 'utf8')).toBe(`${ws.name}\n`)
      expect(writer('file', path.join(ws.path, 'fill')).code).toBe('EDQUOT')
      await ws.dispose()
      expect(fs.readdirSync(path.join(root, '.vmspace', 'projects'))).toEqual([])
      await pool.removeTemplate(cp.id)
      expect(poolState(root)).toEqual(emptyPoolState)
      await pool.close()
    })

    test('4 processes x 25 quota allocates claim distinct project ids inside the range; dispose and sweep after SIGKILL release them', async () => {
      const { root, pool } = await open()
      const children = Array.from({ length: 4 }, () => new Child(path.join(fixtures, 'quota-child.cjs'), [root, '25', String(8 * MiB)]))
      await Promise.all(children.map((c) => c.expect('allocated')))
      const claims = fs.readdirSync(path.join(root, '.vmspace', 'projects')).map(Number)
      expect(new Set(claims).size).toBe(100)
      for (const id of claims) expect(id >= projectIds[0] && id <= projectIds[1]).toBe(true)
      for (const c of children.slice(0, 2)) c.send('dispose')
      await Promise.all(children.slice(0, 2).map((c) => c.expect('disposed')))
      for (const c of children.slice(2)) c.proc.kill('SIGKILL')
      await Promise.all(children.slice(2).map((c) => c.exited))
      expect((await pool.sweep()).reclaimed).toHaveLength(50)
      expect(poolState(root)).toEqual(emptyPoolState)
      expect(fs.readdirSync(path.join(root, '.vmspace', 'projects'))).toEqual([])
      await pool.close()
    })
  })
}

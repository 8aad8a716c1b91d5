/**
 * Shared files (commit's `share`, docs/templates.md "Shared files"): every workspace made from a template holds each
 * as a hard link of one read-only inode, outside the template's tree, resident in the page cache once. On the scratch
 * ext4 (copies), the loop XFS (reflinks), the plain loop btrfs and an image-backed btrfs pool (whose children are
 * plain directories: a hard link cannot cross subvolumes). One pool, template and set of children per file system.
 */
import { spawn, spawnSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterAll, beforeAll, describe, expect, test } from 'vitest'
import { openPool, type CommitResult, type Pool, type Workspace } from '../lib/index.js'
import { removeScratch } from './setup/mounts.js'
import { MiB, mounts, poolState, reachableByOthers, repoRoot, runCommand, writeRandomFile } from './helpers.js'
import { rejection } from './layout-helpers.js'

const SIZE = 64 * MiB
const N = 4
const SHARED = 'vm/mem.snap'
const mkfsMissing = spawnSync('sh', ['-c', 'PATH=$PATH:/usr/sbin:/sbin command -v mkfs.btrfs'], { stdio: 'ignore' }).status !== 0
const imageMissing = !mounts.root ? 'not root' : mkfsMissing ? 'mkfs.btrfs is not installed' : undefined

interface FsCase {
  label: string
  base: string | null
  missing?: string
  image?: boolean
  btrfs?: boolean
}

const cases: FsCase[] = [
  { label: `ext4 scratch (${mounts.scratchFsType})`, base: mounts.scratch },
  { label: 'loop XFS (reflink=1)', base: mounts.xfs, missing: mounts.missing.xfs },
  { label: 'loop btrfs', base: mounts.btrfs, missing: mounts.missing.btrfs, btrfs: true },
  { label: 'image-backed btrfs pool', base: imageMissing ? null : mounts.scratch, missing: imageMissing, image: true, btrfs: true },
]

const sha = (file: string) => createHash('sha256').update(fs.readFileSync(file)).digest('hex')
const inode = (file: string) => {
  const st = fs.statSync(file, { bigint: true })
  return `${st.dev}:${st.ino}`
}
/** Bytes of `file` resident in the page cache (util-linux fincore). */
const resident = (file: string) => Number(runCommand('fincore', ['--bytes', '--noheadings', '--output', 'RES', file]).stdout.trim())
/** Reads `file` whole (its pages come into the page cache). */
const readWhole = (file: string) => {
  const fd = fs.openSync(file, 'r')
  const buf = Buffer.allocUnsafe(4 * MiB)
  try {
    while (fs.readSync(fd, buf, 0, buf.length, null) > 0);
  } finally {
    fs.closeSync(fd)
  }
}
/** Page cache held by the files `files`, each inode counted once. */
const cacheOfInodes = (files: string[]) => {
  const seen = new Map<string, number>()
  for (const f of files) seen.set(inode(f), resident(f))
  return [...seen.values()].reduce((a, b) => a + b, 0)
}
/**
 * Reads each of `files` whole, then gives the page cache they hold (each inode once). Between the read and fincore
 * the kernel may evict a few pages under memory pressure from the suite's other files, so up to 5 rounds, until
 * `want` is seen: distinct inodes stay distinct in every round, so a wrong count is never read as right.
 */
const cachedAfterReading = (files: string[], want: number) => {
  let got = -1
  for (let round = 0; round < 5 && got !== want; round++) {
    for (const f of files) readWhole(f)
    got = cacheOfInodes(files)
  }
  return got
}
const templatesDir = (root: string) => path.join(root, '.vmspace', 'templates')
/** Every entry below `dir`, relative and sorted (the exact shape of what is there). */
const listing = (dir: string): string[] => {
  const out: string[] = []
  const walk = (rel: string) => {
    for (const name of fs.readdirSync(path.join(dir, rel)).sort()) {
      const r = rel ? `${rel}/${name}` : name
      out.push(r)
      if (fs.lstatSync(path.join(dir, r)).isDirectory()) walk(r)
    }
  }
  walk('')
  return out.sort()
}
/** Runs `script` (sh) as uid/gid 65534 with no groups. */
const asNobody = (script: string, ...args: string[]) =>
  spawnSync('setpriv', ['--reuid=65534', '--regid=65534', '--clear-groups', 'sh', '-c', script, 'sh', ...args], { encoding: 'utf8' })

describe.each(cases)('$label', (c) => {
  const skip = c.base === null
  let dir = ''
  let root = ''
  let pool: Pool
  let source: Workspace
  let t: CommitResult
  let children: Workspace[] = []
  let data = ''

  beforeAll(async () => {
    if (skip) return
    dir = fs.mkdtempSync(path.join(c.base!, 'vmspace-share-'))
    fs.chmodSync(dir, 0o755)
    root = path.join(dir, 'pool')
    pool = c.image ? await openPool(root, { image: { path: path.join(dir, 'pool.img'), size: 1024 * MiB } }) : await openPool(root)
    source = await pool.allocate({ mode: 0o755 })
    fs.mkdirSync(path.join(source.path, 'vm'))
    writeRandomFile(path.join(source.path, SHARED), SIZE)
    fs.writeFileSync(path.join(source.path, 'vm', 'disk.img'), 'private disk')
    data = sha(path.join(source.path, SHARED))
    t = await pool.commit(source, { name: 'base', share: [SHARED] })
    children = await Promise.all(Array.from({ length: N }, () => pool.allocate({ from: 'base', mode: 0o755 })))
  })

  afterAll(async () => {
    if (skip) return
    await pool?.close().catch(() => {})
    removeScratch(dir)
    if (c.image)
      for (const l of runCommand('losetup', ['--list', '--noheadings', '--output', 'NAME,BACK-FILE']).stdout.split('\n'))
        if (l.includes(dir)) spawnSync('losetup', ['--detach', l.trim().split(/\s+/)[0]])
  })

  test.skipIf(skip)(`every child's shared file is the template's shared/0 inode, read-only, resident once after ${N} children read it`, () => {
    const shared0 = path.join(templatesDir(root), t.id, 'shared', '0')
    expect(t.shared).toEqual([{ path: SHARED, bytes: SIZE }])
    expect(JSON.parse(fs.readFileSync(path.join(templatesDir(root), t.id, 'template.json'), 'utf8')).shared).toEqual([{ path: SHARED, bytes: SIZE }])
    // The tree holds the parent directory and the private files, not the shared one.
    expect(fs.readdirSync(path.join(t.path, 'vm')).sort()).toEqual(['disk.img'])
    const st = fs.statSync(shared0)
    expect(st.mode & 0o7777).toBe(0o444)
    expect(st.uid).toBe(mounts.root ? 4294967294 : process.getuid!())
    expect(st.nlink).toBe(1 + N)
    for (const ws of children) {
      const f = path.join(ws.path, SHARED)
      expect(inode(f)).toBe(inode(shared0))
      expect(sha(f)).toBe(data)
      expect(fs.readFileSync(path.join(ws.path, 'vm', 'disk.img'), 'utf8')).toBe('private disk')
    }
    const files = children.map((ws) => path.join(ws.path, SHARED))
    expect(cachedAfterReading(files, SIZE)).toBe(SIZE) // one inode: its pages once
  })

  test.skipIf(skip)("a child's usage counts the shared file in sharedBytes, not exclusiveBytes", async () => {
    const u = await children[0].usage()
    expect(u.sharedBytes).toBeGreaterThanOrEqual(SIZE)
    expect(u.exclusiveBytes).toBeLessThan(SIZE)
    expect(u.logicalBytes).toBe(SIZE + 'private disk'.length)
  })

  test.skipIf(skip)(`without share, ${N} children of the same tree are ${N} inodes (each read: ${N} copies in the page cache)`, async () => {
    const plain = await pool.commit(source)
    const kids = await Promise.all(Array.from({ length: N }, () => pool.allocate({ from: plain.id })))
    try {
      const files = kids.map((ws) => path.join(ws.path, SHARED))
      expect(new Set(files.map(inode)).size).toBe(N)
      expect(cachedAfterReading(files, N * SIZE)).toBe(N * SIZE)
    } finally {
      await Promise.all(kids.map((k) => k.dispose()))
      await pool.removeTemplate(plain.id)
    }
  })

  test.skipIf(skip || !mounts.root)(
    "a child's write to the shared file is refused (EACCES) to uid 65534; its unlink is the child's own and touches no other",
    async () => {
      const extra = await pool.allocate({ from: 'base', mode: 0o755 })
      try {
        const f = path.join(extra.path, SHARED)
        expect(reachableByOthers(path.dirname(f))).toBe(true)
        const w = asNobody(`exec node -e "try { require('fs').openSync(process.argv[1], 'r+'); console.log('opened') } catch (e) { console.log(e.code) }" "$1"`, f)
        expect(w.stdout.trim()).toBe('EACCES')
        expect(asNobody('echo x >> "$1"', f).status).not.toBe(0)
        expect(asNobody('chmod 666 "$1"', f).status).not.toBe(0) // not its owner
        expect(sha(f)).toBe(data)
        // The child owns its directory: removing its link is its business.
        fs.chownSync(path.join(extra.path, 'vm'), 65534, 65534)
        expect(asNobody('rm -f "$1"', f).status).toBe(0)
        expect(fs.existsSync(f)).toBe(false)
        const shared0 = path.join(templatesDir(root), t.id, 'shared', '0')
        expect(fs.statSync(shared0).nlink).toBe(1 + N)
        for (const ws of children) expect(inode(path.join(ws.path, SHARED))).toBe(inode(shared0))
      } finally {
        await extra.dispose()
      }
    },
  )

  test.skipIf(skip)('a commit of a child keeps the file shared (the same inode); a child that replaced it shares nothing', async () => {
    const shared0 = path.join(templatesDir(root), t.id, 'shared', '0')
    const inherited = await pool.commit(children[0])
    expect(inherited.shared).toEqual([{ path: SHARED, bytes: SIZE }])
    expect(inode(path.join(templatesDir(root), inherited.id, 'shared', '0'))).toBe(inode(shared0))
    expect(fs.readdirSync(path.join(inherited.path, 'vm'))).toEqual(['disk.img'])
    const own = await pool.allocate({ from: 'base' })
    try {
      fs.rmSync(path.join(own.path, SHARED))
      fs.writeFileSync(path.join(own.path, SHARED), 'my own')
      const mine = await pool.commit(own)
      expect(mine.shared).toBeUndefined()
      expect(fs.existsSync(path.join(templatesDir(root), mine.id, 'shared'))).toBe(false)
      expect(fs.readFileSync(path.join(mine.path, SHARED), 'utf8')).toBe('my own')
      await pool.removeTemplate(mine.id)
    } finally {
      await own.dispose()
      await pool.removeTemplate(inherited.id)
    }
  })

  test.skipIf(skip)("a child's checkpoint keeps the file shared, and a rollback to it links the same inode back", async () => {
    const shared0 = path.join(templatesDir(root), t.id, 'shared', '0')
    const ws = await pool.allocate({ from: 'base', mode: 0o755 })
    try {
      fs.writeFileSync(path.join(ws.path, 'vm', 'disk.img'), 'at the checkpoint')
      const cp = await ws.checkpoint()
      expect(cp.shared).toEqual([{ path: SHARED, bytes: SIZE }])
      expect(inode(path.join(templatesDir(root), cp.id, 'shared', '0'))).toBe(inode(shared0))
      fs.rmSync(path.join(ws.path, SHARED))
      fs.writeFileSync(path.join(ws.path, 'vm', 'disk.img'), 'after it')
      expect(await ws.rollback(cp)).toEqual({ checkpoint: cp.id, removed: true })
      expect(inode(path.join(ws.path, SHARED))).toBe(inode(shared0))
      expect(fs.readFileSync(path.join(ws.path, 'vm', 'disk.img'), 'utf8')).toBe('at the checkpoint')
      expect(fs.statSync(shared0).nlink).toBe(1 + N + 2) // the children, the checkpoint's shared/0, this workspace
      await pool.removeTemplate(cp.id)
    } finally {
      await ws.dispose()
    }
    expect(fs.statSync(shared0).nlink).toBe(1 + N)
  })

  test.skipIf(skip || !c.btrfs)("btrfs: children are plain directories holding the links; with a quota, ERR_SHARE_UNSUPPORTED and nothing made", async () => {
    for (const ws of children) expect(fs.statSync(ws.path).ino).not.toBe(256) // a subvolume's root is inode 256
    if (!c.image) return // the plain loop btrfs has no quotas: its refusal is ERR_QUOTA_UNSUPPORTED, before this
    expect(runCommand('btrfs', ['quota', 'enable', root]).status).toBe(0)
    const before = poolState(root)
    const templatesBefore = listing(templatesDir(root))
    const err = await rejection(pool.allocate({ from: 'base', quota: { bytes: 256 * MiB } }))
    expect(err).toMatchObject({ code: 'ERR_SHARE_UNSUPPORTED', path: SHARED, cause: { code: 'EXDEV' } })
    expect(err.message).toContain(SHARED)
    expect(poolState(root)).toEqual(before)
    expect(listing(templatesDir(root))).toEqual(templatesBefore)
    expect(runCommand('btrfs', ['quota', 'disable', root]).status).toBe(0)
  })

  test.skipIf(skip)('removeTemplate while children live keeps their file; dispose and sweep leave nothing and free the inode', async () => {
    const shared0 = path.join(templatesDir(root), t.id, 'shared', '0')
    const held = fs.openSync(shared0, 'r')
    try {
      await pool.removeTemplate('base')
      expect(fs.existsSync(path.join(templatesDir(root), t.id))).toBe(false)
      for (const ws of children) expect(sha(path.join(ws.path, SHARED))).toBe(data)
      await source.dispose()
      await Promise.all(children.map((ws) => ws.dispose()))
      await pool.sweep({ graceMs: 0 })
      expect(poolState(root)).toEqual({ visible: [], staging: [], trash: [], leases: [] })
      expect(listing(templatesDir(root))).toEqual(['layers', 'names', 'retired', 'staging'])
      expect(fs.fstatSync(held).nlink).toBe(0) // the last link went: the kernel frees it at this close
    } finally {
      fs.closeSync(held)
    }
  })
})

describe.skipIf(mounts.xfs === null)('bad share values (loop XFS)', () => {
  let dir = ''
  let root = ''
  let pool: Pool
  let ws: Workspace

  beforeAll(async () => {
    dir = fs.mkdtempSync(path.join(mounts.xfs!, 'vmspace-share-bad-'))
    root = path.join(dir, 'pool')
    pool = await openPool(root)
    ws = await pool.allocate()
    fs.mkdirSync(path.join(ws.path, 'd'))
    fs.writeFileSync(path.join(ws.path, 'd', 'f'), 'x')
    fs.symlinkSync('d/f', path.join(ws.path, 'link'))
    fs.symlinkSync('d', path.join(ws.path, 'dlink'))
    spawnSync('mkfifo', [path.join(ws.path, 'fifo')])
    await pool.removeTemplate((await pool.commit(ws)).id) // templates/ made
  })

  afterAll(async () => {
    await pool?.close().catch(() => {})
    removeScratch(dir)
  })

  const lib: [string, string, unknown, string][] = [
    ['an empty path', 'ERR_INVALID_ARG_VALUE', [''], 'options.share[0]'],
    ['an absolute path', 'ERR_INVALID_ARG_VALUE', ['/abs'], 'options.share[0]'],
    ['a .. component', 'ERR_INVALID_ARG_VALUE', ['a/../b'], 'options.share[0]'],
    ["'.'", 'ERR_INVALID_ARG_VALUE', ['.'], 'options.share[0]'],
    ['a duplicate', 'ERR_INVALID_ARG_VALUE', ['d/f', 'd/f'], 'options.share[1]'],
    ['65 entries', 'ERR_INVALID_ARG_VALUE', Array.from({ length: 65 }, (_, i) => `f${i}`), 'options.share'],
    ['no array', 'ERR_INVALID_ARG_TYPE', 'd/f', 'options.share'],
  ]
  test.each(lib)('%s is %s naming it, before anything is made', async (_, code, share, named) => {
    const before = listing(root)
    const err = await pool.commit(ws, { share: share as string[] }).then(
      () => expect.fail('expected a rejection'),
      (e: NodeJS.ErrnoException) => e,
    )
    expect(err.code).toBe(code)
    expect(err.message).toContain(named)
    expect(listing(root)).toEqual(before)
  })

  const native: [string, string, string][] = [
    ['a directory', 'ERR_INVALID_ARG_VALUE', 'd'],
    ['a symlink', 'ERR_INVALID_ARG_VALUE', 'link'],
    ['a symlink in a parent', 'ERR_INVALID_ARG_VALUE', 'dlink/f'],
    ['a fifo', 'ERR_INVALID_ARG_VALUE', 'fifo'],
    ['a missing file', 'ENOENT', 'd/missing'],
  ]
  test.each(native)('%s is %s naming it, nothing made', async (_, code, p) => {
    const before = listing(root)
    const err = await rejection(pool.commit(ws, { share: [p] }))
    expect(err.code).toBe(code)
    if (code === 'ENOENT') expect(err.path).toBe(path.join(ws.path, p))
    else expect(err.message).toContain(`options.share: '${p}'`)
    expect(listing(root)).toEqual(before)
  })

  test('fork({ share }) gives every child the one inode; the fork removes its template, the children keep it', async () => {
    const kids = await pool.fork(ws, 2, { share: ['d/f'] })
    try {
      expect(inode(path.join(kids[0].path, 'd', 'f'))).toBe(inode(path.join(kids[1].path, 'd', 'f')))
      expect(inode(path.join(kids[0].path, 'd', 'f'))).not.toBe(inode(path.join(ws.path, 'd', 'f')))
      expect(fs.statSync(path.join(kids[0].path, 'd', 'f')).nlink).toBe(2)
      expect(fs.readFileSync(path.join(kids[1].path, 'd', 'f'), 'utf8')).toBe('x')
    } finally {
      await Promise.all(kids.map((k) => k.dispose()))
    }
  })

  test('vmspace commit --share PATH (repeated) shares each; a bad one exits with the library error', () => {
    const bin = path.join(repoRoot, 'dist', 'cli', 'vmspace.js')
    const ok = spawnSync(process.execPath, [bin, 'commit', root, ws.id, '--share', 'd/f', '--share', 'fifo', '--json'], { encoding: 'utf8' })
    expect(ok.stderr).toContain('ERR_INVALID_ARG_VALUE')
    expect(ok.status).not.toBe(0)
    const r = spawnSync(process.execPath, [bin, 'commit', root, ws.id, '--share', 'd/f', '--json'], { encoding: 'utf8' })
    expect(r.status).toBe(0)
    const t = JSON.parse(r.stdout) as CommitResult
    expect(t.shared).toEqual([{ path: 'd/f', bytes: 1 }])
    expect(fs.statSync(path.join(root, '.vmspace', 'templates', t.id, 'shared', '0')).mode & 0o7777).toBe(0o444)
    spawnSync(process.execPath, [bin, 'template', 'rm', root, t.id])
    expect(fs.existsSync(path.join(root, '.vmspace', 'templates', t.id))).toBe(false)
  })

  test('a commit SIGKILLed while it writes its shared file leaves a staging entry that sweep removes', async () => {
    const ws2 = await pool.allocate()
    writeRandomFile(path.join(ws2.path, 'big'), 256 * MiB)
    const before = listing(root)
    const script = `
      const vmspace = require(${JSON.stringify(path.join(repoRoot, 'dist', 'index.js'))})
      ;(async () => {
        const pool = await vmspace.openPool(process.argv[1], { create: false, reflink: 'never' })
        for (;;) await pool.removeTemplate((await pool.commit(process.argv[2], { share: ['big'] })).id)
      })()`
    const child = spawn(process.execPath, ['-e', script, root, ws2.id], { stdio: 'ignore' })
    try {
      const staging = path.join(templatesDir(root), 'staging')
      // Killed once a build has its shared/ directory (the copy of 256 MiB under way).
      let seen = false
      for (let i = 0; i < 20_000 && !seen; i++) {
        seen = fs.readdirSync(staging).some((id) => fs.existsSync(path.join(staging, id, 'shared')))
        if (!seen) await new Promise((r) => setTimeout(r, 1))
      }
      child.kill('SIGKILL')
      await new Promise((r) => child.once('exit', r))
      expect(seen).toBe(true)
      await pool.sweep({ graceMs: 0 })
      expect(fs.readdirSync(staging)).toEqual([])
      for (const id of fs.readdirSync(templatesDir(root)).filter((n) => /^[0-9a-f]{32}$/.test(n))) await pool.removeTemplate(id)
      await pool.sweep({ graceMs: 0 })
      expect(listing(root)).toEqual(before)
    } finally {
      child.kill('SIGKILL')
      await ws2.dispose()
    }
  })
})

const projectQuotaFs = [
  { label: 'XFS', mkfs: ['mkfs.xfs', '-q', '-f', '-m', 'reflink=1'] },
  { label: 'ext4', mkfs: ['mkfs.ext4', '-q', '-F', '-O', 'project,quota'] },
]

describe.skipIf(!mounts.root).each(projectQuotaFs)('$label with project quotas', ({ label, mkfs }) => {
  let dir = ''
  let mnt: string | null = null
  let why = ''

  beforeAll(() => {
    dir = fs.mkdtempSync(path.join(mounts.scratch, 'vmspace-share-prj-'))
    const image = path.join(dir, 'fs.img')
    fs.closeSync(fs.openSync(image, 'wx'))
    fs.truncateSync(image, 512 * MiB)
    mnt = path.join(dir, 'mnt')
    fs.mkdirSync(mnt)
    for (const [cmd, ...args] of [[...mkfs, image], ['mount', '-o', 'loop,prjquota', image, mnt]]) {
      const r = spawnSync(cmd, args, { encoding: 'utf8' })
      if (r.status !== 0) {
        // This kernel may lack a file system's quota support (XFS: "quota support not available").
        why = `${label}: ${cmd} failed: ${(r.stderr || r.error?.message || '').trim().split('\n')[0]}`
        mnt = null
        return
      }
    }
    fs.chmodSync(mnt, 0o755)
  })

  afterAll(() => removeScratch(dir))

  test('allocate({ from, quota }) of a template with shared files: linkat answers EXDEV (another project id), ERR_SHARE_UNSUPPORTED, nothing made', async (ctx) => {
    if (!mnt) return ctx.skip(why)
    const root = path.join(mnt, 'pool')
    const pool = await openPool(root)
    const projects = () => (fs.existsSync(path.join(root, '.vmspace', 'projects')) ? listing(path.join(root, '.vmspace', 'projects')) : [])
    try {
      const ws = await pool.allocate()
      fs.writeFileSync(path.join(ws.path, 'mem'), 'memory')
      await pool.commit(ws, { name: 'snap', share: ['mem'] })
      const before = poolState(root)
      const claims = projects()
      const err = await rejection(pool.allocate({ from: 'snap', quota: { bytes: 64 * MiB } }))
      expect(err).toMatchObject({ code: 'ERR_SHARE_UNSUPPORTED', path: 'mem', cause: { code: 'EXDEV' } })
      expect(poolState(root)).toEqual(before)
      expect(projects()).toEqual(claims)
      // Without a quota, the same template allocates.
      const child = await pool.allocate({ from: 'snap' })
      expect(fs.readFileSync(path.join(child.path, 'mem'), 'utf8')).toBe('memory')
    } finally {
      await pool.close()
    }
  })
})

/**
 * Templates: commit a workspace into the pool, allocate and fork from it, replace and remove it,
 * corrupt metadata, and sweep after SIGKILL. On real file systems: the scratch ext4 (copies), and the
 * loop-mounted XFS (reflinks) and btrfs (a template is a read-only subvolume, children are snapshots) where the
 * setup made them.
 */
import { spawn, spawnSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { describe, expect, test } from 'vitest'
import { openPool, type Pool, type Template, type Workspace } from '../lib/index.js'
import { pruneCandidates } from '../lib/template.js'
import { Child, emptyPoolState, eventually, fixtures, freshDir, ls, mounts, needs, poolState, stressRounds, requireMount, runCommand, unprivilegedChildren, writeRandomFile } from './helpers.js'

/** Every entry below `dir`: kind, mode, size, content hash or link target (no inode numbers: clones differ). */
function contentTree(dir: string): Record<string, string> {
  const out: Record<string, string> = {}
  const walk = (rel: string) => {
    const abs = path.join(dir, rel)
    const st = fs.lstatSync(abs)
    let desc = `${(st.mode & 0o170000).toString(8)} ${(st.mode & 0o7777).toString(8)} size=${st.isDirectory() ? '-' : st.size}`
    if (st.isFile()) desc += ' sha256=' + createHash('sha256').update(fs.readFileSync(abs)).digest('hex')
    if (st.isSymbolicLink()) desc += ' -> ' + fs.readlinkSync(abs)
    if (rel) out[rel] = desc
    if (st.isDirectory()) for (const name of fs.readdirSync(abs).sort()) walk(path.join(rel, name))
  }
  walk('')
  return out
}

/** The same without the modes: what a committed template holds (write bits removed). */
function withoutModes(tree: Record<string, string>): Record<string, string> {
  return Object.fromEntries(Object.entries(tree).map(([k, v]) => [k, v.replace(/^(\d+) \d+ /, '$1 ')]))
}

/** A small tree of every kind a guest makes: files of several modes, a subdirectory, a symlink, a hard link. */
function populate(ws: Workspace, tag = 'v1'): void {
  fs.writeFileSync(path.join(ws.path, 'a.txt'), `hello ${tag}`)
  fs.mkdirSync(path.join(ws.path, 'etc'))
  fs.writeFileSync(path.join(ws.path, 'etc', 'conf'), `conf ${tag}`, { mode: 0o640 })
  fs.chmodSync(path.join(ws.path, 'etc', 'conf'), 0o640)
  fs.writeFileSync(path.join(ws.path, 'etc', 'ro'), 'read-only', { mode: 0o444 })
  fs.chmodSync(path.join(ws.path, 'etc', 'ro'), 0o444)
  fs.writeFileSync(path.join(ws.path, 'run.sh'), '#!/bin/sh\n', { mode: 0o755 })
  fs.chmodSync(path.join(ws.path, 'run.sh'), 0o755)
  fs.symlinkSync('a.txt', path.join(ws.path, 'link'))
  fs.linkSync(path.join(ws.path, 'a.txt'), path.join(ws.path, 'hard.txt'))
}

function templatesDir(root: string): string {
  return path.join(root, '.vmspace', 'templates')
}

/** The published template ids on disk. */
function publishedIds(root: string): string[] {
  return ls(templatesDir(root)).filter((n) => /^[0-9a-f]{32}$/.test(n))
}

/** Nothing half-built or waiting: no staging entries, no retired markers, nothing in trash. */
function noLeftovers(root: string): void {
  expect(ls(path.join(templatesDir(root), 'staging'))).toEqual([])
  expect(ls(path.join(templatesDir(root), 'retired'))).toEqual([])
  expect(ls(path.join(root, '.vmspace', 'trash'))).toEqual([])
}

async function withPool(base: string, fn: (pool: Pool, root: string) => Promise<void>): Promise<void> {
  const root = path.join(freshDir(base, 'tpl'), 'pool')
  const pool = await openPool(root)
  try {
    await fn(pool, root)
  } finally {
    await pool.close()
  }
}

function btrfs(args: string[]): string {
  const r = spawnSync('btrfs', args, { encoding: 'utf8' })
  if (r.status !== 0) throw new Error(`btrfs ${args.join(' ')}: ${r.stderr}`)
  return r.stdout
}

/** Whether `dir` is a read-only btrfs subvolume (its root, with BTRFS_SUBVOL_RDONLY: `btrfs property get ro`). */
function readOnlySubvolume(dir: string): boolean {
  return fs.statSync(dir).ino === 256 && btrfs(['property', 'get', '-ts', dir, 'ro']).trim() === 'ro=true'
}

/** Subvolumes of the btrfs at `mnt` below `root` (paths relative to `root`), as `btrfs subvolume list` has them. */
function subvolumesBelow(mnt: string, root: string): string[] {
  const rel = path.relative(mnt, root) + '/'
  return btrfs(['subvolume', 'list', mnt])
    .split('\n')
    .map((l) => l.split(' path ')[1])
    .filter((p): p is string => p !== undefined && p.startsWith(rel))
    .map((p) => p.slice(rel.length))
    .sort()
}

const systems = [
  { label: 'scratch', dir: mounts.scratch as string | null, why: undefined as string | undefined },
  { label: 'XFS', dir: mounts.xfs, why: mounts.missing.xfs },
  { label: 'btrfs', dir: mounts.btrfs, why: mounts.missing.btrfs },
]

for (const fsys of systems) {
  requireMount(fsys.label, fsys.dir, fsys.why)
  describe.skipIf(!fsys.dir)(`templates on ${fsys.label} ${needs(fsys.label, !fsys.dir && fsys.why)}`, () => {
    const base = fsys.dir!

    test('commit publishes a complete read-only copy of the workspace; a workspace from it gets the workspace back, modes included', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        populate(ws)
        const before = contentTree(ws.path)
        const t = await pool.commit(ws, { name: 'base', meta: { os: 'alpine' } })
        expect(t).toMatchObject({ name: 'base', current: true, parent: null, meta: { os: 'alpine' }, retired: false })
        expect(t.id).toMatch(/^[0-9a-f]{32}$/)
        expect(t.path).toBe(path.join(root, '.vmspace', 'templates', t.id, 'tree'))
        expect(publishedIds(root)).toEqual([t.id])
        const tree = contentTree(t.path)
        if (fsys.label === 'btrfs') {
          // A read-only subvolume: the modes as they were, and no write possible, root's included.
          expect(tree).toEqual(before)
          expect(t.subvolume).toBe(true)
          expect(readOnlySubvolume(t.path)).toBe(true)
          expect(() => fs.writeFileSync(path.join(t.path, 'a.txt'), 'x')).toThrow(expect.objectContaining({ code: 'EROFS' }))
        } else {
          // The template: the same entries and bytes, and no write bit anywhere but on symlinks.
          expect(withoutModes(tree)).toEqual(withoutModes(before))
          for (const [rel, desc] of Object.entries(tree))
            if (!desc.startsWith('120000')) expect(Number.parseInt(desc.split(' ')[1], 8) & 0o222, rel).toBe(0)
          expect(fs.statSync(t.path).mode & 0o222).toBe(0)
          expect(t.subvolume).toBeUndefined()
        }
        expect(contentTree(ws.path)).toEqual(before) // the workspace itself untouched
        // A plain-directory workspace is walked (into a new subvolume on btrfs): reflinks where the fs has them.
        if (fsys.label !== 'scratch') expect(t.clone.method).toBe('reflink')
        expect(t.usage!.files).toBe(4) // a.txt (hard.txt: the same inode), conf, ro, run.sh
        expect(t.usage!.allocatedBytes).toBeGreaterThan(0)

        const child = await pool.allocate({ from: 'base' })
        expect(contentTree(child.path)).toEqual(before)
        expect(child.templateId).toBe(t.id)
        expect(child.template[0]!.method).toBe(fsys.label === 'btrfs' ? 'snapshot' : t.clone.method)
        expect(fs.statSync(path.join(child.path, 'a.txt')).ino).toBe(fs.statSync(path.join(child.path, 'hard.txt')).ino)
        const info = (await pool.list()).find((w) => w.id === child.id)!
        expect(info.templateId).toBe(t.id)
        // By id too.
        const byId = await pool.allocate({ from: t.id })
        expect(contentTree(byId.path)).toEqual(before)
        for (const w of [ws, child, byId]) await w.dispose()
        noLeftovers(root)
      })
    })

    test('a commit of a workspace allocated from a template names it as its parent', async () => {
      await withPool(base, async (pool) => {
        const ws = await pool.allocate()
        populate(ws)
        const t1 = await pool.commit(ws, { name: 'one' })
        const child = await pool.allocate({ from: 'one' })
        fs.writeFileSync(path.join(child.path, 'added'), 'x')
        const t2 = await pool.commit(child, { name: 'two' })
        expect(t2.parent).toBe(t1.id)
        expect((await pool.template('two')).parent).toBe(t1.id)
        await ws.dispose()
        await child.dispose()
      })
    })

    test('an unknown template id or name is ERR_TEMPLATE_NOT_FOUND and leaves nothing: never an empty workspace', async () => {
      await withPool(base, async (pool, root) => {
        const before = poolState(root)
        // Before any template exists (no templates/ directory), and after one does.
        await expect(pool.allocate({ from: 'missing' })).rejects.toMatchObject({ code: 'ERR_TEMPLATE_NOT_FOUND' })
        const ws = await pool.allocate()
        populate(ws)
        await pool.commit(ws, { name: 'base' })
        const state = poolState(root)
        for (const ref of ['missing', '0123456789abcdef0123456789abcdef'])
          await expect(pool.allocate({ from: ref })).rejects.toMatchObject({ code: 'ERR_TEMPLATE_NOT_FOUND' })
        expect(poolState(root)).toEqual(state)
        expect(before.visible).toEqual([])
        await expect(pool.template('missing')).rejects.toMatchObject({ code: 'ERR_TEMPLATE_NOT_FOUND' })
        await expect(pool.removeTemplate('missing')).rejects.toMatchObject({ code: 'ERR_TEMPLATE_NOT_FOUND' })
        await ws.dispose()
      })
    })

    test('a commit under an existing name is EEXIST and changes nothing; the existing template stays byte-identical', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        populate(ws)
        const t = await pool.commit(ws, { name: 'base' })
        const tree = contentTree(t.path)
        const json = fs.readFileSync(path.join(templatesDir(root), t.id, 'template.json'))
        fs.writeFileSync(path.join(ws.path, 'a.txt'), 'changed')
        await expect(pool.commit(ws, { name: 'base' })).rejects.toMatchObject({
          code: 'EEXIST',
          path: path.join(templatesDir(root), 'names', 'base'),
        })
        expect(publishedIds(root)).toEqual([t.id])
        expect(contentTree(t.path)).toEqual(tree)
        expect(fs.readFileSync(path.join(templatesDir(root), t.id, 'template.json'))).toEqual(json)
        expect(fs.readlinkSync(path.join(templatesDir(root), 'names', 'base'))).toBe(t.id)
        noLeftovers(root)
        await ws.dispose()
      })
    })

    test('replace swaps the name while 8 allocates read the old template: each gets a whole old or a whole new tree', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        // Entries enough that allocates may still be reading when the replace lands (the held-reader case is
        // made certain by the next test).
        for (let d = 0; d < 2; d++) {
          fs.mkdirSync(path.join(ws.path, `d${d}`))
          for (let i = 0; i < 100; i++) fs.writeFileSync(path.join(ws.path, `d${d}`, `f${i}`), `old ${d}/${i}`)
        }
        const oldTree = contentTree(ws.path)
        const old = await pool.commit(ws, { name: 'base' })
        for (let d = 0; d < 2; d++) for (let i = 0; i < 100; i++) fs.writeFileSync(path.join(ws.path, `d${d}`, `f${i}`), `new ${d}/${i}`)
        const newTree = contentTree(ws.path)
        const readers = Array.from({ length: 8 }, () => pool.allocate({ from: 'base' }))
        const replaced = await pool.commit(ws, { name: 'base', replace: true })
        const children = await Promise.all(readers)
        expect(replaced.replaced?.id).toBe(old.id)
        for (const c of children) {
          const tree = contentTree(c.path)
          if (tree['d0/f0'] === oldTree['d0/f0']) {
            expect(tree).toEqual(oldTree)
            expect(c.templateId).toBe(old.id)
          } else {
            expect(tree).toEqual(newTree)
            expect(c.templateId).toBe(replaced.id)
          }
        }
        // The old template is gone once its last reader finished (by that reader, or by the replace itself).
        expect(publishedIds(root)).toEqual([replaced.id])
        noLeftovers(root)
        expect((await pool.templates()).map((t) => [t.id, t.name, t.current])).toEqual([[replaced.id, 'base', true]])
        for (const c of [ws, ...children]) await c.dispose()
      })
    }, 300_000) // copies of 9 trees on a busy ext4: no timing is asserted, only a bound against hangs

    test('a template replaced while a reader holds it stays (retired) until the reader is gone; then a sweep removes it', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        populate(ws)
        const old = await pool.commit(ws, { name: 'base' })
        // A reader as allocate is one: flock(LOCK_SH) on the template's directory, in another process.
        // (-o: the lock stays with flock itself, not with the sleep it runs.)
        const dir = path.join(templatesDir(root), old.id)
        const reader = spawn('flock', ['-s', '-o', dir, 'sleep', '600'], { stdio: 'ignore', detached: true })
        try {
          await eventually(() => runCommand('flock', ['-n', '-x', '-E', '99', dir, 'true']).status === 99)
          const t = await pool.commit(ws, { name: 'base', replace: true })
          expect(t.replaced).toEqual({ id: old.id, removed: false })
          const listed = await pool.templates()
          expect(listed.find((x) => x.id === old.id)).toMatchObject({ retired: true, current: false, name: 'base' })
          // Retired: no new reader gets it, by id or by name.
          await expect(pool.allocate({ from: old.id })).rejects.toMatchObject({ code: 'ERR_TEMPLATE_NOT_FOUND' })
          expect((await pool.sweep({ graceMs: 0 })).reclaimed).toEqual([])
          expect(publishedIds(root).sort()).toEqual([old.id, t.id].sort())
        } finally {
          const exited = new Promise((r) => reader.once('exit', r))
          process.kill(-reader.pid!, 'SIGKILL') // its process group: flock and the sleep it runs
          await exited
        }
        const report = await pool.sweep({ graceMs: 0 })
        expect(report.reclaimed.map((e) => [e.name, e.from]), JSON.stringify(report)).toEqual([[`template-${old.id}`, 'template']])
        expect(report.reclaimed[0].bytes).toBeGreaterThan(0)
        noLeftovers(root)
        await ws.dispose()
      })
    })

    test('corrupt template metadata is listed with its error and path, never rewritten, and allocate from it refuses', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        populate(ws)
        for (const [i, bad] of ['null', '[]', '{"id":"trunc', ''].entries()) {
          const t = await pool.commit(ws, { name: `bad${i}` })
          const dir = path.join(templatesDir(root), t.id)
          const file = path.join(dir, 'template.json')
          fs.chmodSync(dir, 0o755)
          fs.chmodSync(file, 0o644)
          fs.writeFileSync(file, bad)
          fs.chmodSync(file, 0o444)
          fs.chmodSync(dir, 0o555)
          const listed = (await pool.templates()).find((x) => x.id === t.id)!
          expect(listed.error).toMatchObject({ code: 'ERR_CORRUPT_METADATA', path: file })
          const state = poolState(root)
          await expect(pool.allocate({ from: `bad${i}` })).rejects.toMatchObject({ code: 'ERR_CORRUPT_METADATA', path: file })
          expect(poolState(root)).toEqual(state)
          expect(fs.readFileSync(file, 'utf8')).toBe(bad)
        }
        await ws.dispose()
      })
    })

    test('removeTemplate unnames and removes it; workspaces made from it keep their files; lastUsedAt follows allocates', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        populate(ws)
        const t = await pool.commit(ws, { name: 'base' })
        const child = await pool.allocate({ from: 'base' })
        const used = (await pool.template('base')).lastUsedAt!
        expect(used).toBeGreaterThanOrEqual(t.createdAt!)
        expect(await pool.removeTemplate('base')).toEqual({ id: t.id, removed: true })
        expect(publishedIds(root)).toEqual([])
        expect(ls(path.join(templatesDir(root), 'names'))).toEqual([])
        expect(fs.readFileSync(path.join(child.path, 'a.txt'), 'utf8')).toBe('hello v1')
        await expect(pool.allocate({ from: t.id })).rejects.toMatchObject({ code: 'ERR_TEMPLATE_NOT_FOUND' })
        noLeftovers(root)
        await child.dispose()
        await ws.dispose()
      })
    })

    test('pruneTemplates keeps the newest N of a name and removes the rest in one call', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        populate(ws)
        const made = []
        for (let i = 0; i < 4; i++) made.push(await pool.commit(ws, { name: `img-${i}`, meta: { i } }))
        const unnamed = await pool.commit(ws)
        // Four names, one version each: keepNewest per name removes nothing; by age, everything older than 0 ms.
        expect((await pool.pruneTemplates({ keepNewest: 1 })).removed).toEqual([])
        const dry = await pool.pruneTemplates({ unusedForMs: 0, name: 'img-0', dryRun: true })
        expect(dry.removed.map((t) => t.id)).toEqual([made[0].id])
        expect(publishedIds(root)).toHaveLength(5)
        const r = await pool.pruneTemplates({ unusedForMs: 0 })
        expect(r.removed.map((t) => t.id).sort()).toEqual([...made.map((t) => t.id), unnamed.id].sort())
        expect(publishedIds(root)).toEqual([])
        await expect(pool.pruneTemplates({} as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
        await ws.dispose()
      })
    })

    test('fork makes count children of the current state, all or nothing; the template it used is gone after', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        populate(ws)
        const before = contentTree(ws.path)
        const progress: number[] = []
        const kids = await pool.fork(ws, 5, { meta: { role: 'child' }, onProgress: (p) => progress.push(p.done) })
        expect(kids).toHaveLength(5)
        expect(progress).toEqual([1, 2, 3, 4, 5])
        for (const k of kids) expect(contentTree(k.path)).toEqual(before)
        expect(new Set(kids.map((k) => k.path)).size).toBe(5)
        expect(publishedIds(root)).toEqual([])
        noLeftovers(root)
        // An abort: nothing of the fork stays.
        const ac = new AbortController()
        const state = poolState(root)
        const p = pool.fork(ws, 8, { signal: ac.signal, onProgress: () => ac.abort() })
        await expect(p).rejects.toMatchObject({ name: 'AbortError' })
        expect(poolState(root)).toEqual(state)
        expect(publishedIds(root)).toEqual([])
        for (const k of [ws, ...kids]) await k.dispose()
      })
    })

    test('options are strict and names checked before anything is made', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        await expect(pool.commit(ws, { nmae: 'x' } as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
        await expect(pool.commit(ws, { name: '../x' })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
        await expect(pool.commit(ws, { name: '0123456789abcdef0123456789abcdef' })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
        await expect(pool.allocate({ from: 42 } as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_TYPE' })
        await expect(pool.fork(ws, 0)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
        await expect(pool.fork(ws, 2, { count: 3 } as never)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
        expect(fs.existsSync(templatesDir(root))).toBe(false) // made on the first commit only
        await ws.dispose()
        await expect(pool.commit(ws)).rejects.toMatchObject({ code: 'ERR_DISPOSED' })
      })
    })

    test('sweep reclaims a half-built commit and never touches a published template', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        populate(ws)
        const t = await pool.commit(ws, { name: 'base' })
        const tree = contentTree(t.path)
        // What a commit SIGKILLed mid-build leaves: an unlocked staging entry with part of a tree, a name claimed
        // for an id that was never published, and a swap temp link.
        const dead = '0123456789abcdef0123456789abcdef'
        fs.mkdirSync(path.join(templatesDir(root), 'staging', dead, 'tree', 'sub'), { recursive: true })
        fs.writeFileSync(path.join(templatesDir(root), 'staging', dead, 'tree', 'sub', 'half'), 'x')
        fs.symlinkSync(dead, path.join(templatesDir(root), 'names', 'dead'))
        fs.symlinkSync(t.id, path.join(templatesDir(root), 'names', '.base.new-0123456789ab'))
        const report = await pool.sweep({ graceMs: 0 })
        expect(report.reclaimed.map((e) => [e.name, e.from])).toEqual([[`template-${dead}`, 'template-staging']])
        expect(report.failed).toEqual([])
        expect(ls(path.join(templatesDir(root), 'names'))).toEqual(['base'])
        expect(publishedIds(root)).toEqual([t.id])
        expect(contentTree(t.path)).toEqual(tree)
        noLeftovers(root)
        await ws.dispose()
      })
    })

    test('sweep reclaims a template a killed removal left in trash (template-<id>, no write bits), never reported foreign', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        populate(ws)
        const t = await pool.commit(ws, { name: 'base' })
        const tree = contentTree(t.path)
        // What a removal SIGKILLed after its rename into trash leaves: the whole template there, read-only as
        // published (0555 directories, no write bits on files), its directory unlocked.
        const dead = 'fedcba9876543210fedcba9876543210'
        const trashed = path.join(root, '.vmspace', 'trash', `template-${dead}`)
        fs.mkdirSync(path.join(trashed, 'tree', 'sub'), { recursive: true })
        fs.writeFileSync(path.join(trashed, 'tree', 'sub', 'f'), 'x', { mode: 0o444 })
        fs.writeFileSync(path.join(trashed, 'template.json'), '{}', { mode: 0o444 })
        for (const d of [path.join(trashed, 'tree', 'sub'), path.join(trashed, 'tree'), trashed]) fs.chmodSync(d, 0o555)
        const report = await pool.sweep({ graceMs: 0 })
        expect(report).toMatchObject({ failed: [], foreign: [], live: 1, leasesRemoved: 0 })
        expect(report.reclaimed.map((e) => [e.name, e.from])).toEqual([[`template-${dead}`, 'trash']])
        expect(publishedIds(root)).toEqual([t.id])
        expect(contentTree(t.path)).toEqual(tree)
        noLeftovers(root)
        await ws.dispose()
      })
    })

    test.skipIf(!mounts.root)('a guest\'s device node and set-id bits are not carried by commit, fork or copyOut unless asked (copyOut never); a setgid directory is', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        plantPrivileges(ws.path)
        const t = await pool.commit(ws, { name: 'guest' })
        expect(t.clone.skipped).toEqual({ sockets: 0, devices: 1 })
        expectNoPrivileges(t.path)
        const [kid] = await pool.fork(ws, 1)
        expectNoPrivileges(kid.path)
        const out = path.join(path.dirname(root), 'out')
        const copied = await ws.copyOut('.', out).catch((e: unknown) => e)
        expect(copied).toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' }) // '.': the workspace itself is no entry
        fs.mkdirSync(path.join(ws.path, 'sub'))
        for (const e of fs.readdirSync(ws.path)) if (e !== 'sub') fs.renameSync(path.join(ws.path, e), path.join(ws.path, 'sub', e))
        const r = await ws.copyOut('sub', out)
        expect(r.skipped).toEqual({ sockets: 0, devices: 1 })
        expectNoPrivileges(out)
        await ws.copyOut('sub/su', path.join(path.dirname(root), 'su'))
        expect(fs.statSync(path.join(path.dirname(root), 'su')).mode & 0o7777).toBe(0o755)
        // Asked for: carried as they are.
        const kept = await pool.commit(ws, { name: 'trusted', keepDevices: true, keepSetId: true })
        expectPrivileges(path.join(kept.path, 'sub'))
        for (const w of [ws, kid]) await w.dispose()
      })
    })

    test('allocate({ template }) of a path in the pool\'s workspaces (a workspace, a directory in one, the root, through a symlink) is ERR_INVALID_ARG_VALUE; nothing made; one plain file there is a template', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        fs.mkdirSync(path.join(ws.path, 'd'))
        fs.symlinkSync('/etc', path.join(ws.path, 'etc'))
        const link = path.join(path.dirname(root), 'to-ws')
        fs.symlinkSync(ws.path, link)
        const before = fs.readdirSync(root).sort()
        fs.writeFileSync(path.join(ws.path, 'base.img'), 'base')
        fs.symlinkSync('base.img', path.join(ws.path, 'base-link'))
        const templates: (string | Record<string, string>)[] = [ws.path, path.join(ws.path, 'd'), path.join(ws.path, 'etc'), root,
          path.join(root, '.vmspace'), link, { x: ws.path }, { 'rootfs/etc': path.join(ws.path, 'etc') },
          { 'base.img': path.join(ws.path, 'base-link') }, { 'base.img': path.join(link, 'base.img') }]
        for (const template of templates) {
          await expect(pool.allocate({ template }), JSON.stringify(template)).rejects.toMatchObject({
            code: 'ERR_INVALID_ARG_VALUE',
            message: expect.stringContaining("a path outside the pool's workspaces (a workspace becomes a template by commit() or fork())"),
          })
        }
        expect(fs.readdirSync(root).sort()).toEqual(before)
        // One regular file reached without a symlink (a holder's base) is a template.
        const child = await pool.allocate({ template: { 'base.img': path.join(ws.path, 'base.img') } })
        expect(fs.readFileSync(path.join(child.path, 'base.img'), 'utf8')).toBe('base')
        await child.dispose()
        await ws.dispose()
      })
    })

    test.skipIf(!mounts.root)('a template directory outside the pool (the host\'s) keeps its device nodes and set-id bits', async () => {
      await withPool(base, async (pool, root) => {
        const host = path.join(path.dirname(root), 'rootfs')
        fs.mkdirSync(host)
        plantPrivileges(host)
        const ws = await pool.allocate({ template: host })
        expectPrivileges(ws.path)
        await ws.dispose()
      })
    })

    test('keepDevices/keepSetId of another type are ERR_INVALID_ARG_TYPE, a misspelt one ERR_INVALID_ARG_VALUE; nothing committed', async () => {
      await withPool(base, async (pool, root) => {
        const ws = await pool.allocate()
        await expect(pool.commit(ws, { keepDevices: 'yes' } as object)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_TYPE' })
        await expect(pool.commit(ws, { keepDevice: true } as object)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE', message: expect.stringContaining('keepDevice') })
        await expect(pool.fork(ws, 1, { keepSetId: 1 } as object)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_TYPE' })
        await expect(pool.allocate({ keepSetId: true } as object)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE', message: expect.stringContaining('keepSetId') })
        expect(publishedIds(root)).toEqual([])
        await ws.dispose()
      })
    })
  })
}

/** What a guest with CAP_MKNOD plants: a device node of the host's root disk, set-id files, a file capability; a setgid directory. */
function plantPrivileges(dir: string): void {
  const dev = fs.statSync('/').dev
  const r = spawnSync('mknod', [path.join(dir, 'disk'), 'b', String((dev >> 8) & 0xfff), String((dev & 0xff) | ((dev >> 12) & 0xfff00))])
  expect(r.status).toBe(0)
  for (const [name, mode] of [['su', 0o4755], ['sg', 0o2755]] as const) {
    fs.writeFileSync(path.join(dir, name), '#!/bin/sh\n')
    fs.chmodSync(path.join(dir, name), mode)
  }
  fs.mkdirSync(path.join(dir, 'shared'))
  fs.chmodSync(path.join(dir, 'shared'), 0o2775)
  fs.writeFileSync(path.join(dir, 'ping'), '#!/bin/sh\n', { mode: 0o755 })
  expect(runCommand('setcap', ['cap_net_raw+ep', path.join(dir, 'ping')]).status).toBe(0)
}

/** The file capabilities of `file` as getcap prints them ('' for none). */
const capabilities = (file: string) => runCommand('getcap', [file]).stdout.trim().replace(`${file} `, '')

/** No device node, set-id bit on a file or file capability below `dir`; the setgid directory kept. */
function expectNoPrivileges(dir: string): void {
  expect(fs.existsSync(path.join(dir, 'disk'))).toBe(false)
  expect(fs.statSync(path.join(dir, 'su')).mode & 0o6000).toBe(0)
  expect(fs.statSync(path.join(dir, 'sg')).mode & 0o6000).toBe(0)
  expect(fs.statSync(path.join(dir, 'shared')).mode & 0o2000).toBe(0o2000)
  expect(capabilities(path.join(dir, 'ping'))).toBe('')
}

function expectPrivileges(dir: string): void {
  expect(fs.lstatSync(path.join(dir, 'disk')).isBlockDevice()).toBe(true)
  expect(fs.lstatSync(path.join(dir, 'disk')).rdev).toBe(fs.statSync('/').dev)
  expect(fs.statSync(path.join(dir, 'su')).mode & 0o6000).toBe(0o4000)
  expect(fs.statSync(path.join(dir, 'sg')).mode & 0o6000).toBe(0o2000)
  expect(capabilities(path.join(dir, 'ping'))).toBe('cap_net_raw=ep')
}

requireMount('btrfs', mounts.btrfs, mounts.missing.btrfs)
describe.skipIf(!mounts.btrfs)(`templates as btrfs subvolumes ${needs('btrfs', !mounts.btrfs && mounts.missing.btrfs)}`, () => {
  const mnt = mounts.btrfs!

  test('a subvolume workspace commits by a read-only snapshot; fork children are independent writable snapshots; removeTemplate and dispose leave no subvolume', async () => {
    await withPool(mnt, async (pool, root) => {
      const ws = await pool.allocate()
      populate(ws)
      const t1 = await pool.commit(ws, { name: 'base' })
      // A workspace allocated from a subvolume template is a writable snapshot: a subvolume root of its own.
      const parent = await pool.allocate({ from: 'base', mode: 0o750 })
      expect(parent.template[0]).toMatchObject({ method: 'snapshot', files: 0 })
      expect(fs.statSync(parent.path).ino).toBe(256)
      expect(fs.statSync(parent.path).mode & 0o7777).toBe(0o750 & ~process.umask())
      expect(readOnlySubvolume(parent.path)).toBe(false)
      fs.writeFileSync(path.join(parent.path, 'parent.txt'), 'parent')
      const state = contentTree(parent.path)
      // Its commit is a read-only snapshot (no walk: no usage measured), its parent the first template.
      const t2 = await pool.commit(parent, { name: 'snap' })
      expect(t2).toMatchObject({ method: 'snapshot', subvolume: true, parent: t1.id, clone: { method: 'snapshot' } })
      expect(t2.usage).toBeUndefined()
      expect(readOnlySubvolume(t2.path)).toBe(true)
      expect(contentTree(t2.path)).toEqual(state)
      const t1Tree = contentTree(t1.path)

      const kids = await pool.fork(parent, 4)
      for (const k of kids) {
        expect(k.template[0]!.method).toBe('snapshot')
        expect(contentTree(k.path)).toEqual(state)
      }
      // Each child writes its own marker and rewrites a shared file: the others, the parent and both templates
      // keep their bytes.
      kids.forEach((k, i) => {
        fs.writeFileSync(path.join(k.path, 'marker'), `child ${i}`)
        fs.writeFileSync(path.join(k.path, 'a.txt'), `rewritten by ${i}`)
      })
      kids.forEach((k, i) => {
        const own = contentTree(k.path)
        const expected = { ...state, marker: own.marker, 'a.txt': own['a.txt'], 'hard.txt': own['a.txt'] }
        expect(contentTree(k.path)).toEqual(expected)
        expect(fs.readFileSync(path.join(k.path, 'marker'), 'utf8')).toBe(`child ${i}`)
        // hard.txt is the same inode as a.txt in each child, and only there.
        expect(fs.readFileSync(path.join(k.path, 'hard.txt'), 'utf8')).toBe(`rewritten by ${i}`)
      })
      expect(contentTree(parent.path)).toEqual(state)
      expect(contentTree(t2.path)).toEqual(state)
      expect(contentTree(t1.path)).toEqual(t1Tree)

      const ids = [t1.id, t2.id]
      expect(subvolumesBelow(mnt, root)).toEqual(
        [...ids.map((id) => `.vmspace/templates/${id}/tree`), parent.name, ...kids.map((k) => k.name)].sort(),
      )
      expect(await pool.removeTemplate('base')).toEqual({ id: t1.id, removed: true })
      expect(await pool.removeTemplate(t2.id)).toEqual({ id: t2.id, removed: true })
      expect(subvolumesBelow(mnt, root)).toEqual([parent.name, ...kids.map((k) => k.name)].sort())
      for (const w of [ws, parent, ...kids]) await w.dispose()
      expect(subvolumesBelow(mnt, root)).toEqual([])
      expect(poolState(root)).toEqual(emptyPoolState)
      noLeftovers(root)
    })
  })

  test('a subvolume workspace with a subvolume inside is walked, not snapshotted (a snapshot would leave the inner one out)', async () => {
    await withPool(mnt, async (pool, root) => {
      const ws = await pool.allocate()
      populate(ws)
      await pool.commit(ws, { name: 'base' })
      const child = await pool.allocate({ from: 'base' })
      btrfs(['subvolume', 'create', path.join(child.path, 'nested')])
      fs.writeFileSync(path.join(child.path, 'nested', 'inner.txt'), 'inner')
      const t = await pool.commit(child, { name: 'withNested' })
      expect(t.clone.method).toBe('reflink')
      expect(t.subvolume).toBe(true)
      expect(readOnlySubvolume(t.path)).toBe(true)
      expect(fs.readFileSync(path.join(t.path, 'nested', 'inner.txt'), 'utf8')).toBe('inner')
      for (const w of [ws, child]) await w.dispose()
      for (const n of ['base', 'withNested']) await pool.removeTemplate(n)
      expect(subvolumesBelow(mnt, root)).toEqual([])
      noLeftovers(root)
    })
  })

  test('sweep reclaims a read-only subvolume of a killed commit (staging) and of a killed removal (trash)', async () => {
    await withPool(mnt, async (pool, root) => {
      const ws = await pool.allocate()
      populate(ws)
      const t = await pool.commit(ws, { name: 'base' })
      const tree = contentTree(t.path)
      // What a SIGKILL leaves: a staged template whose tree was made read-only before publish, and a template
      // moved into trash by a removal that died before it was emptied.
      const dead = '0123456789abcdef0123456789abcdef'
      const staged = path.join(templatesDir(root), 'staging', dead)
      fs.mkdirSync(staged)
      btrfs(['subvolume', 'create', path.join(staged, 'tree')])
      fs.writeFileSync(path.join(staged, 'tree', 'half'), 'x')
      btrfs(['property', 'set', '-ts', path.join(staged, 'tree'), 'ro', 'true'])
      const dead2 = 'fedcba9876543210fedcba9876543210'
      const trashed = path.join(root, '.vmspace', 'trash', `template-${dead2}`)
      fs.mkdirSync(trashed)
      btrfs(['subvolume', 'snapshot', '-r', t.path, path.join(trashed, 'tree')])
      expect(readOnlySubvolume(path.join(trashed, 'tree'))).toBe(true)
      const report = await pool.sweep({ graceMs: 0 })
      expect(report.failed).toEqual([])
      // What vmspace left in trash (template-<id>) is its own, never foreign, though it is named like a workspace.
      expect(report.foreign).toEqual([])
      expect(report.reclaimed.map((e) => [e.name, e.from]).sort()).toEqual(
        [[`template-${dead2}`, 'trash'], [`template-${dead}`, 'template-staging']].sort(),
      )
      expect(subvolumesBelow(mnt, root)).toEqual([`.vmspace/templates/${t.id}/tree`])
      expect(publishedIds(root)).toEqual([t.id])
      expect(contentTree(t.path)).toEqual(tree)
      expect(readOnlySubvolume(t.path)).toBe(true)
      noLeftovers(root)
      await ws.dispose()
      await pool.removeTemplate(t.id)
      expect(subvolumesBelow(mnt, root)).toEqual([])
    })
  })

  test.skipIf(!mounts.root)('a subvolume workspace commits by a snapshot that drops its guest\'s device node and set-id bits, read-only after; with keepDevices/keepSetId it keeps them', async () => {
    await withPool(mnt, async (pool) => {
      const ws = await pool.allocate()
      await pool.commit(ws, { name: 'base' })
      const sub = await pool.allocate({ from: 'base' })
      plantPrivileges(sub.path)
      const t = await pool.commit(sub, { name: 'guest' })
      expect(t.clone).toMatchObject({ method: 'snapshot', skipped: { devices: 1 } })
      expect(readOnlySubvolume(t.path)).toBe(true)
      expectNoPrivileges(t.path)
      const kept = await pool.commit(sub, { name: 'trusted', keepDevices: true, keepSetId: true })
      expect(kept.clone).toMatchObject({ method: 'snapshot', skipped: { devices: 0 } })
      expectPrivileges(kept.path)
      const kid = await pool.allocate({ from: 'guest' })
      expectNoPrivileges(kid.path)
      for (const w of [ws, sub, kid]) await w.dispose()
    })
  })

  test.skipIf(!unprivilegedChildren)('as uid 65534 (no CAP_SYS_ADMIN): commit, snapshot allocate and fork work, and removal clears read-only and walks (no SNAP_DESTROY): nothing left', () => {
    const d = freshDir(mnt)
    fs.chmodSync(d, 0o755)
    const root = path.join(d, 'pool')
    fs.mkdirSync(root, { mode: 0o700 })
    fs.chownSync(root, 65534, 65534)
    const script = `
      const vm = require(${JSON.stringify(path.join(__dirname, '..', 'dist', 'index.js'))})
      const fs = require('node:fs')
      ;(async () => {
        const pool = await vm.openPool(process.argv[1])
        const ws = await pool.allocate()
        fs.writeFileSync(ws.path + '/a.txt', 'a')
        const t = await pool.commit(ws, { name: 'base' })
        const child = await pool.allocate({ from: 'base' })
        const t2 = await pool.commit(child, { name: 'snap' })
        const kids = await pool.fork(child, 2)
        const out = { commit: t.clone.method, allocate: child.template[0].method, commitSnap: t2.clone.method, fork: kids.map((k) => k.template[0].method),
          removed: [(await pool.removeTemplate('base')).removed, (await pool.removeTemplate('snap')).removed] }
        for (const w of [ws, child, ...kids]) await w.dispose()
        await pool.close()
        process.stdout.write(JSON.stringify(out))
      })().catch((e) => { process.stderr.write(String(e.stack) + ' ' + e.code); process.exit(1) })`
    const r = spawnSync(process.execPath, ['-e', script, root], { uid: 65534, gid: 65534, encoding: 'utf8' })
    expect(r.stderr).toBe('')
    expect(JSON.parse(r.stdout)).toEqual({ commit: 'reflink', allocate: 'snapshot', commitSnap: 'snapshot', fork: ['snapshot', 'snapshot'], removed: [true, true] })
    expect(subvolumesBelow(mnt, root)).toEqual([])
    expect(poolState(root)).toEqual(emptyPoolState)
    noLeftovers(root)
  })

  test('allocate({ from, quota }) on a btrfs without quotas is refused (ERR_QUOTA_UNSUPPORTED) and leaves nothing', async () => {
    await withPool(mnt, async (pool, root) => {
      const ws = await pool.allocate()
      populate(ws)
      await pool.commit(ws, { name: 'base' })
      const state = poolState(root)
      const subs = subvolumesBelow(mnt, root)
      await expect(pool.allocate({ from: 'base', quota: { bytes: 64 * 1024 * 1024 } })).rejects.toMatchObject({ code: 'ERR_QUOTA_UNSUPPORTED' })
      expect(poolState(root)).toEqual(state)
      expect(subvolumesBelow(mnt, root)).toEqual(subs)
      await ws.dispose()
    })
  })
})

requireMount('XFS', mounts.xfs, mounts.missing.xfs)
describe.skipIf(!mounts.xfs)(`fork on XFS ${needs('XFS', !mounts.xfs && mounts.missing.xfs)}`, () => {
  test('commit then 64 children at once: every file reflinked; each child writes its own marker; the template and every sibling keep their bytes', async () => {
    await withPool(mounts.xfs!, async (pool, root) => {
      const ws = await pool.allocate()
      const image = writeRandomFile(path.join(ws.path, 'rootfs.img'), 4 << 20)
      fs.mkdirSync(path.join(ws.path, 'etc'))
      fs.writeFileSync(path.join(ws.path, 'etc', 'hostname'), 'parent')
      const t = await pool.commit(ws, { name: 'snap' })
      expect(t.clone.method).toBe('reflink')
      const templateBefore = contentTree(t.path)
      const kids = await Promise.all(Array.from({ length: 64 }, () => pool.allocate({ from: 'snap' })))
      for (const k of kids) {
        expect(k.template[0]).toMatchObject({ method: 'reflink', copied: 0 })
        const fd = fs.openSync(path.join(k.path, 'rootfs.img'), 'r+')
        fs.writeSync(fd, Buffer.from(k.id), 0, 32, 4096)
        fs.closeSync(fd)
        fs.writeFileSync(path.join(k.path, 'marker'), k.id)
      }
      for (const k of kids) {
        const img = fs.readFileSync(path.join(k.path, 'rootfs.img'))
        const expected = Buffer.from(image)
        Buffer.from(k.id).copy(expected, 4096)
        expect(img.equals(expected)).toBe(true)
        expect(fs.readFileSync(path.join(k.path, 'marker'), 'utf8')).toBe(k.id)
        expect(fs.readFileSync(path.join(k.path, 'etc', 'hostname'), 'utf8')).toBe('parent')
      }
      expect(contentTree(t.path)).toEqual(templateBefore)
      expect(fs.readFileSync(path.join(ws.path, 'rootfs.img')).equals(image)).toBe(true)
      for (const k of [ws, ...kids]) await k.dispose()
      noLeftovers(root)
    })
  })
})

const ROUNDS = stressRounds(200, 8)
const PARALLEL = Number(process.env.VMSPACE_TEMPLATE_CHAOS_PARALLEL ?? 4)

// btrfs too: a commit there ends in a read-only subvolume, a fork in snapshots, a removal in subvolume deletion.
const chaosSystems = [
  { label: mounts.xfs ? 'XFS' : 'scratch', dir: mounts.xfs ?? mounts.scratch, rounds: ROUNDS },
  ...(mounts.btrfs ? [{ label: 'btrfs', dir: mounts.btrfs, rounds: ROUNDS }] : []),
]

describe.each(chaosSystems)('templates under SIGKILL on $label', ({ label, dir, rounds: ROUNDS }) => {
  test(`commit, replace, fork and remove killed at random points (${ROUNDS} rounds, ${PARALLEL} workers), then sweep: only complete templates`, async () => {
    const root = path.join(freshDir(dir, 'tplchaos'), 'pool')
    const pool = await openPool(root)
    const src = await pool.allocate()
    populate(src)
    const expected = withoutModes(contentTree(src.path))
    for (let done = 0; done < ROUNDS; done += PARALLEL) {
      const batch = Array.from({ length: Math.min(PARALLEL, ROUNDS - done) }, () => new Child(path.join(fixtures, 'template-chaos-child.cjs'), [root, src.path]))
      await Promise.all(batch.map((c) => c.expect('ready')))
      for (const c of batch) c.send('go')
      await Promise.all(
        batch.map(async (c) => {
          await sleep(Math.floor(Math.random() * 40))
          c.proc.kill('SIGKILL')
          await c.exited
        }),
      )
      const report = await pool.sweep({ graceMs: 0 })
      expect(report.failed).toEqual([])
      // Everything the killed workers left is vmspace's: a removal's template-<id> in trash included.
      expect(report.foreign).toEqual([])
      // Only complete, published templates are left, each with readable metadata and the whole tree.
      expect(ls(path.join(templatesDir(root), 'staging'))).toEqual([])
      expect(ls(path.join(templatesDir(root), 'retired'))).toEqual([])
      for (const t of await pool.templates()) {
        expect(t.error).toBeUndefined()
        expect(withoutModes(contentTree(t.path))).toEqual(expected)
      }
      for (const n of ls(path.join(templatesDir(root), 'names')))
        expect(publishedIds(root)).toContain(fs.readlinkSync(path.join(templatesDir(root), 'names', n)))
      expect(poolState(root).visible).toEqual([src.name])
      expect(ls(path.join(root, '.vmspace', 'trash'))).toEqual([])
      // btrfs: the only subvolumes left are the published templates' read-only trees (children were swept).
      if (label === 'btrfs') {
        const published = await pool.templates()
        expect(subvolumesBelow(dir, root)).toEqual(published.map((t) => `.vmspace/templates/${t.id}/tree`).sort())
        for (const t of published) expect(readOnlySubvolume(t.path)).toBe(true)
      }
      // Start the next batch from a clean slate, so that leftovers of one batch cannot hide in the next.
      for (const t of await pool.templates()) await pool.removeTemplate(t.id)
    }
    await src.dispose()
    await pool.close()
  }, 600_000)
})

describe('the vmspace command and templates', () => {
  const cli = (args: string[]) => runCommand(process.execPath, [path.join(__dirname, '..', 'dist', 'cli', 'vmspace.js'), ...args])

  test('vmspace commit makes a template (EEXIST: exit 1), vmspace fork leaves N children for adopt, vmspace ls lists templates', async () => {
    const root = path.join(freshDir(mounts.scratch, 'tplcli'), 'pool')
    const pool = await openPool(root)
    try {
      const ws = await pool.allocate()
      populate(ws)
      const made = cli(['commit', root, ws.id, '--name', 'base', '--meta', '{"k":1}', '--json'])
      expect(made.status, made.stderr).toBe(0)
      const t = JSON.parse(made.stdout) as { id: string; name: string; meta: unknown }
      expect(t).toMatchObject({ name: 'base', meta: { k: 1 } })
      const again = cli(['commit', root, ws.id, '--name', 'base'])
      expect(again.status).toBe(1)
      expect(again.stderr).toContain('EEXIST')
      expect(cli(['commit', root, 'nope']).status).toBe(2)
      const forked = cli(['fork', root, ws.name, '2', '--json'])
      expect(forked.status, forked.stderr).toBe(0)
      const children = (JSON.parse(forked.stdout) as { children: { id: string }[] }).children
      expect(children).toHaveLength(2)
      for (const c of children) {
        const child = await pool.adopt(c.id)
        expect(contentTree(child.path)).toEqual(contentTree(ws.path))
        await child.dispose()
      }
      const listed = cli(['ls', root, '--json'])
      expect(listed.status, listed.stderr).toBe(0)
      const doc = JSON.parse(listed.stdout) as { templates: { id: string; name: string; current: boolean; error: unknown }[] }
      expect(doc.templates.map((x) => [x.id, x.name, x.current, x.error])).toEqual([[t.id, 'base', true, null]])
      await ws.dispose()
    } finally {
      await pool.close()
    }
  })

  test.skipIf(!mounts.root)('vmspace commit leaves a guest\'s device node and set-id bits out (reported on stderr); --keep-devices --keep-set-id carry them', async () => {
    const root = path.join(freshDir(mounts.scratch, 'tplcli'), 'pool')
    const pool = await openPool(root)
    try {
      const ws = await pool.allocate()
      plantPrivileges(ws.path)
      const strict = cli(['commit', root, ws.id])
      expect(strict.status, strict.stderr).toBe(0)
      expect(strict.stderr).toContain('; 1 device nodes not carried')
      expectNoPrivileges((await pool.template(strict.stdout.trim())).path)
      const kept = cli(['commit', root, ws.id, '--keep-devices', '--keep-set-id'])
      expect(kept.status, kept.stderr).toBe(0)
      expectPrivileges((await pool.template(kept.stdout.trim())).path)
      await ws.dispose()
    } finally {
      await pool.close()
    }
  })
})

describe('the demo with --fork', () => {
  test('vmspace demo --fork 4: one parent, 4 children, isolation checked, time per child reported, exit 0, nothing left', () => {
    const dir = freshDir(mounts.xfs ?? mounts.scratch, 'tpldemo')
    const base = path.join(dir, 'base.img')
    writeRandomFile(base, 64 * 1024)
    const root = path.join(dir, 'pool')
    const r = runCommand(process.execPath, [path.join(__dirname, '..', 'dist', 'cli', 'vmspace.js'), 'demo', '--fork', '4', '--root', root, '--base', base])
    expect(r.status, r.stderr).toBe(0)
    expect(r.stdout).toMatch(/^fork: 4 children of one parent in [\d.]+ ms: [\d.]+ ms per child .*; isolation ok$/m)
    expect(poolState(root)).toEqual(emptyPoolState)
    expect(publishedIds(root)).toEqual([])
    const bad = runCommand(process.execPath, [path.join(__dirname, '..', 'dist', 'cli', 'vmspace.js'), 'demo', '--fork', '0'])
    expect(bad.status).toBe(2)
  })
})

describe('templates of deep trees', () => {
  test('commit and allocate from a chain 2100 directories deep (past PATH_MAX: 4200 bytes of path): the bottom file comes back with its mode', async () => {
    const dir = freshDir(mounts.scratch, 'tpldeep')
    const build = new Child(path.join(fixtures, 'faults-child.cjs'), [JSON.stringify({ op: 'build', dir, depth: 2100 })])
    build.proc.stdin!.end()
    expect((await build.next()).event).toBe('result')
    await build.exited
    const pool = await openPool(path.join(dir, 'pool'))
    try {
      const ws = await pool.allocate({ template: path.join(dir, 'chain') })
      const t = await pool.commit(ws, { name: 'deep' })
      expect(t.usage!.files).toBe(1)
      const child = await pool.allocate({ from: 'deep' })
      const found = runCommand('find', [child.path, '-type', 'f', '-printf', '%d %m %s\n']).stdout.trim()
      expect(found).toBe('2101 644 6')
      const tfound = runCommand('find', [t.path, '-type', 'f', '-printf', '%d %m\n']).stdout.trim()
      expect(tfound).toBe('2101 444')
      await child.dispose()
      await ws.dispose()
      expect(await pool.removeTemplate('deep')).toEqual({ id: t.id, removed: true })
      noLeftovers(path.join(dir, 'pool'))
    } finally {
      await pool.close()
      runCommand('rm', ['-rf', '--one-file-system', path.join(dir, 'chain')])
    }
  }, 300_000)
})

// Races between processes on one name (docs/templates.md): a reader never sees a replaced name missing, prune
// never removes the template a name points to, and a sweep with graceMs 0 never breaks a live build.
const RACE_ROUNDS = stressRounds(200, 20)
const raceDir = mounts.xfs ?? mounts.scratch

describe('templates under concurrent replace, prune and sweep', () => {
  type Done = { ok: number; errors: Record<string, number>; failed: Record<string, number> }

  /** Starts one child per role on the pool at `root`; the committers run RACE_ROUNDS rounds, the others until then. */
  async function race(root: string, source: string, roles: string[]): Promise<Record<string, Done[]>> {
    const kids = roles.map((role) => ({ role, c: new Child(path.join(fixtures, 'template-race-child.cjs'), [root, role, String(RACE_ROUNDS), source]) }))
    await Promise.all(kids.map((k) => k.c.expect('ready')))
    for (const k of kids) k.c.send('go')
    const out: Record<string, Done[]> = {}
    const finish = async (k: (typeof kids)[number]) => {
      const m = (await k.c.expect('done')) as unknown as Done
      ;(out[k.role] ??= []).push(m)
    }
    await Promise.all(kids.filter((k) => k.role === 'commit').map(finish))
    for (const k of kids) if (k.role !== 'commit') k.c.send('stop')
    await Promise.all(kids.filter((k) => k.role !== 'commit').map(finish))
    return out
  }

  function sourceTree(): string {
    const src = freshDir(raceDir, 'tplsrc')
    fs.writeFileSync(path.join(src, 'a.txt'), 'hello')
    fs.mkdirSync(path.join(src, 'etc'))
    fs.writeFileSync(path.join(src, 'etc', 'conf'), 'conf')
    return src
  }

  test(`a reader of a name replaced ${RACE_ROUNDS} times by another process never finds it missing`, async () => {
    const root = path.join(freshDir(raceDir, 'tplrace'), 'pool')
    const pool = await openPool(root)
    const src = sourceTree()
    const ws = await pool.allocate({ template: src })
    await pool.commit(ws, { name: 'base' })
    const r = await race(root, src, ['commit', 'read', 'read'])
    expect(r.commit[0]).toMatchObject({ ok: RACE_ROUNDS, errors: {} })
    for (const d of r.read) expect(d.errors).toEqual({})
    await ws.dispose()
    await pool.close()
  }, 600_000)

  test(`prune with keepNewest 1 beside two replacing committers and an allocator (${RACE_ROUNDS} rounds each) never removes the current template nor its name`, async () => {
    const root = path.join(freshDir(raceDir, 'tplrace'), 'pool')
    const pool = await openPool(root)
    const src = sourceTree()
    const ws = await pool.allocate({ template: src })
    await pool.commit(ws, { name: 'base' })
    const r = await race(root, src, ['commit', 'commit', 'alloc', 'prune'])
    for (const d of r.commit) expect(d).toMatchObject({ ok: RACE_ROUNDS, errors: {} })
    expect(r.alloc[0].errors).toEqual({})
    expect(r.prune[0].errors).toEqual({})
    // Quiet again: one prune leaves exactly the current template of 'base', the one its name points to.
    await pool.pruneTemplates({ keepNewest: 1 })
    await pool.sweep({ graceMs: 0 })
    const left = await pool.templates()
    expect(left.map((t) => [t.name, t.current])).toEqual([['base', true]])
    expect(fs.readlinkSync(path.join(templatesDir(root), 'names', 'base'))).toBe(left[0].id)
    expect(ls(path.join(templatesDir(root), 'names'))).toEqual(['base'])
    noLeftovers(root)
    await ws.dispose()
    await pool.close()
  }, 600_000)

  test(`a sweep with graceMs 0 beside two replacing committers, an allocator and a fork (${RACE_ROUNDS} rounds) breaks no build and leaves no orphan`, async () => {
    const root = path.join(freshDir(raceDir, 'tplrace'), 'pool')
    const pool = await openPool(root)
    const src = sourceTree()
    const ws = await pool.allocate({ template: src })
    await pool.commit(ws, { name: 'base' })
    const r = await race(root, src, ['commit', 'commit', 'alloc', 'fork', 'sweep'])
    for (const d of r.commit) expect(d).toMatchObject({ ok: RACE_ROUNDS, errors: {} })
    expect(r.alloc[0].errors).toEqual({})
    expect(r.fork[0].errors).toEqual({})
    expect(r.sweep[0]).toMatchObject({ errors: {}, failed: {} })
    // Every replaced template was removed (at once, or by its last reader, or by this sweep): only the current one.
    expect((await pool.sweep({ graceMs: 0 })).failed).toEqual([])
    const left = await pool.templates()
    expect(left.map((t) => [t.name, t.current])).toEqual([['base', true]])
    expect(ls(path.join(templatesDir(root), 'names'))).toEqual(['base'])
    noLeftovers(root)
    await ws.dispose()
    await pool.close()
  }, 600_000)

  test('pruneCandidates keeps the current template of a name whatever createdAt says, and counts it first', () => {
    const t = (id: string, createdAt: number, current: boolean) =>
      ({ id, name: 'base', current, createdAt, path: '', parent: null, lastUsedAt: null, retired: false }) as Template
    const all = [t('a', 1, true), t('b', 3, false), t('c', 2, false)]
    expect(pruneCandidates(all, { keepNewest: 1 }, 10).map((x) => x.id)).toEqual(['b', 'c'])
    expect(pruneCandidates(all, { keepNewest: 2 }, 10).map((x) => x.id)).toEqual(['c'])
    expect(pruneCandidates(all, { keepNewest: 0 }, 10).map((x) => x.id)).toEqual(['b', 'c'])
  })
})

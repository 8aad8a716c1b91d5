/**
 * Pools (DESIGN.md, "The pool on disk"): opening, allocate and its rollback, list(), cancellation.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { AbortError, openPool, VmspaceError } from '../lib/index.js'
import {
  allocateIn,
  emptyPoolState,
  freshDir,
  leasePath,
  setRecord,
  MiB,
  mounts,
  needs,
  openFdsUnder,
  poolState,
  snapshotTree,
  tempLeftovers,
  workspaceChild,
  writeRandomFile,
} from './helpers.js'

describe('openPool', () => {
  test('makes the root and its .vmspace/ state directories when missing', async () => {
    const root = path.join(freshDir(), 'a', 'pool')
    const pool = await openPool(root)
    expect(pool.root).toBe(root)
    expect(fs.readdirSync(path.join(root, '.vmspace')).sort()).toEqual(['cache', 'leases', 'staging', 'trash', 'version'])
    expect(fs.readFileSync(path.join(root, '.vmspace', 'version'), 'utf8')).toBe('vmspace-pool 1\n')
    expect(poolState(root)).toEqual(emptyPoolState)
  })

  test('a pool whose .vmspace/version names another format is refused with ERR_POOL_FORMAT and left unchanged', async () => {
    const root = path.join(freshDir(), 'pool')
    fs.mkdirSync(path.join(root, '.vmspace'), { recursive: true })
    fs.writeFileSync(path.join(root, '.vmspace', 'version'), '999\n')
    const before = snapshotTree(root)
    const err = await openPool(root).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ERR_POOL_FORMAT', path: path.join(root, '.vmspace', 'version') })
    expect(snapshotTree(root)).toEqual(before)
  })

  test('create: false on a missing pool rejects with ENOENT and makes nothing', async () => {
    const dir = freshDir()
    const root = path.join(dir, 'pool')
    const err = await openPool(root, { create: false }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ENOENT', errno: -2, path: root })
    expect(fs.readdirSync(dir)).toEqual([])
  })

  test('create: false opens an existing pool', async () => {
    const root = path.join(freshDir(), 'pool')
    await openPool(root)
    const pool = await openPool(root, { create: false })
    const ws = await pool.allocate()
    expect(ws.path).toBe(path.join(root, ws.name))
    await ws.dispose()
  })
})

describe('close', () => {
  test('a workspace still open keeps working: usage, clone and dispose after the pool was closed', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const ws = await pool.allocate()
    fs.writeFileSync(path.join(ws.path, 'a'), Buffer.alloc(8192, 1))
    await pool.close()
    await expect(pool.allocate()).rejects.toMatchObject({ code: 'ERR_POOL_CLOSED' })
    expect(await ws.usage()).toMatchObject({ files: 1, logicalBytes: 8192 })
    await ws.clone(path.join(ws.path, 'a'), 'b')
    await ws.dispose()
    expect(fs.existsSync(ws.path)).toBe(false)
  })

  test.skipIf(!mounts.xfs)(
    `leaves no fd of this process open below the root, after allocates that used the template cache ${needs('XFS', mounts.missing.xfs)}`,
    async () => {
      const base = path.join(freshDir(), 'base.img') // on the scratch file system: another than the pool's
      fs.writeFileSync(base, Buffer.alloc(64 * 1024, 7))
      const root = path.join(freshDir(mounts.xfs!), 'pool')
      const openBelow = () => openFdsUnder(root)
      const pool = await openPool(root)
      const ws = await pool.allocate({ template: { 'rootfs.img': base } })
      expect(ws.template[0]).toMatchObject({ method: 'reflink', cache: 'miss' })
      await ws.dispose()
      await pool.close()
      expect(openBelow()).toEqual([])
    },
  )
})

describe('allocate', () => {
  test('publishes a directory <root>/<prefix>-<32 hex> with its lease file holding its record, nothing left in staging', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'), { prefix: 'sbx' })
    const ws = await pool.allocate()
    expect(ws.id).toMatch(/^[0-9a-f]{32}$/)
    expect(ws.name).toBe(`sbx-${ws.id}`)
    expect(ws.path).toBe(path.join(pool.root, ws.name))
    expect(ws.status).toBe('ready')
    expect(Number.isInteger(ws.leaseFd) && ws.leaseFd > 2).toBe(true)
    expect(fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)).toBe(leasePath(pool.root, ws.name))
    expect(fs.statSync(ws.path).isDirectory()).toBe(true)
    expect(poolState(pool.root)).toEqual({ visible: [ws.name], staging: [], trash: [], leases: [`${ws.id[0]}/${ws.name}`] })
    await ws.dispose()
  })

  test('the workspace directory gets mode 0o700 by default and `mode` less the umask otherwise', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const a = await pool.allocate()
    const b = await pool.allocate({ mode: 0o777 })
    expect(fs.statSync(a.path).mode & 0o7777).toBe(0o700)
    expect(fs.statSync(b.path).mode & 0o7777).toBe(0o777 & ~process.umask())
    await Promise.all([a.dispose(), b.dispose()])
  })

  test('a template clones each source to its path in the workspace, making missing parent directories', async () => {
    const dir = freshDir()
    const data = writeRandomFile(path.join(dir, 'base.img'), 64 * 1024)
    const pool = await openPool(path.join(dir, 'pool'))
    const ws = await pool.allocate({ template: { 'images/rootfs.img': path.join(dir, 'base.img') } })
    expect(fs.readFileSync(path.join(ws.path, 'images', 'rootfs.img')).equals(data)).toBe(true)
    expect(ws.template).toEqual([
      expect.objectContaining({ kind: 'file', path: path.join(ws.path, 'images', 'rootfs.img'), files: 1, bytes: data.length }),
    ])
    await ws.dispose()
  })

  describe('rollback', () => {
    test('a template whose source is missing rejects with ENOENT and leaves no staging entry, metadata or workspace', async () => {
      const dir = freshDir()
      const pool = await openPool(path.join(dir, 'pool'))
      const missing = path.join(dir, 'missing.img')
      const err = await pool.allocate({ template: { 'rootfs.img': missing } }).catch((e: unknown) => e)
      expect(err).toBeInstanceOf(VmspaceError)
      expect(err).toMatchObject({ code: 'ENOENT', errno: -2, path: missing })
      // The destination named is the template's place in the workspace, as the caller asked for it: never the
      // internal staging entry it was built in (gone already, as the workspace never appeared).
      const dest = (err as VmspaceError).dest!
      expect(dest).toMatch(new RegExp(`^${pool.root}/vm-[0-9a-f]{32}/rootfs\\.img$`))
      expect((err as Error).message).toBe(`ENOENT: no such file or directory, open '${missing}' -> '${dest}'`)
      expect(poolState(pool.root)).toEqual(emptyPoolState)
      expect(pool.stats()).toMatchObject({ allocated: 0, failed: 1 })
    })

    test('a tree template entry failing inside names the file in the workspace (path and dest), not the staging entry', async () => {
      const dir = freshDir()
      writeRandomFile(path.join(dir, 'a.img'), 4096)
      const pool = await openPool(path.join(dir, 'pool'))
      // 'a' is cloned as a file, then 'a/b' needs it as a directory.
      const err = await pool.allocate({ template: { a: path.join(dir, 'a.img'), 'a/b': path.join(dir, 'a.img') } }).catch((e: unknown) => e)
      expect(err).toMatchObject({ code: 'ENOTDIR', path: expect.stringMatching(new RegExp(`^${pool.root}/vm-[0-9a-f]{32}/a$`)) })
      expect((err as Error).message).not.toContain('.vmspace')
      expect((err as Error).stack).not.toContain('.vmspace')
      expect(poolState(pool.root)).toEqual(emptyPoolState)
    })

    test('a directory template (a string) that is a file is ERR_INVALID_ARG_VALUE saying what to write, not ENOTDIR; nothing left', async () => {
      const dir = freshDir()
      const file = path.join(dir, 'rootfs.img')
      writeRandomFile(file, 4096)
      const pool = await openPool(path.join(dir, 'pool'))
      const err = await pool.allocate({ template: file }).catch((e: unknown) => e)
      expect(err).toBeInstanceOf(TypeError)
      expect(err).toMatchObject({
        code: 'ERR_INVALID_ARG_VALUE',
        // The message shows the first 60 characters of the value (lib/args.ts).
        message: `Expected a directory, whose contents become the workspace's (a file goes in a map: { 'name': path }) for \`options.template\` but received ${JSON.stringify(file.length > 60 ? file.slice(0, 60) + '…' : file)} of type string`,
        cause: expect.objectContaining({ code: 'ENOTDIR', path: file }),
      })
      expect(poolState(pool.root)).toEqual(emptyPoolState)
    })

    test('a second template entry failing after the first was cloned leaves nothing either', async () => {
      const dir = freshDir()
      writeRandomFile(path.join(dir, 'a.img'), 256 * 1024)
      const pool = await openPool(path.join(dir, 'pool'))
      const missing = path.join(dir, 'missing.img')
      const err = await pool
        .allocate({ template: { 'a.img': path.join(dir, 'a.img'), 'sub/b.img': missing } })
        .catch((e: unknown) => e)
      expect(err).toMatchObject({ code: 'ENOENT', path: missing })
      expect(poolState(pool.root)).toEqual(emptyPoolState)
      expect(fs.readdirSync(dir).sort()).toEqual(['a.img', 'pool'])
    })

    describe.skipIf(!mounts.small)(
      `on a full file system ${needs('a small loop-mounted ext4', mounts.missing.small)}`,
      () => {
        test('a template that does not fit rejects with ENOSPC and leaves nothing, no temp file either', async () => {
          const src = path.join(freshDir(mounts.scratch), 'big.img')
          fs.writeFileSync(src, Buffer.alloc(96 * MiB, 0x5a))
          const pool = await openPool(path.join(freshDir(mounts.small!), 'pool'))
          const err = await pool.allocate({ template: { 'big.img': src } }).catch((e: unknown) => e)
          expect(err).toBeInstanceOf(VmspaceError)
          expect(err).toMatchObject({ code: 'ENOSPC', errno: -28 })
          expect(poolState(pool.root)).toEqual(emptyPoolState)
          expect(tempLeftovers(path.join(pool.root, '.vmspace', 'meta'))).toEqual([])
        })
      },
    )
  })

  describe('AbortSignal', () => {
    test('an already-aborted signal rejects with an AbortError and creates nothing', async () => {
      const pool = await openPool(path.join(freshDir(), 'pool'))
      const err = await pool.allocate({ signal: AbortSignal.abort() }).catch((e: unknown) => e)
      expect(err).toBeInstanceOf(AbortError)
      expect(err).toMatchObject({ name: 'AbortError', code: 'ABORT_ERR' })
      expect(poolState(pool.root)).toEqual(emptyPoolState)
      expect(pool.stats().allocated).toBe(0)
    })

    test('an abort while allocate runs rolls back: AbortError, and the workspace built meanwhile is gone', async () => {
      const pool = await openPool(path.join(freshDir(), 'pool'))
      const ac = new AbortController()
      const p = pool.allocate({ signal: ac.signal })
      ac.abort()
      await expect(p).rejects.toMatchObject({ name: 'AbortError' })
      expect(poolState(pool.root)).toEqual(emptyPoolState)
    })
  })
})

describe('list', () => {
  test('a live workspace is listed live, with its meta, createdAt and template', async () => {
    const dir = freshDir()
    const base = path.join(dir, 'base.img')
    writeRandomFile(base, 8192)
    const pool = await openPool(path.join(dir, 'pool'))
    const before = Date.now()
    const ws = await pool.allocate({ meta: { vm: 'alpha', cpus: 2 }, template: { 'rootfs.img': base } })
    const after = Date.now()
    const list = await pool.list()
    expect(list).toHaveLength(1)
    const [info] = list
    expect(info).toMatchObject({ id: ws.id, name: ws.name, path: ws.path, live: true, meta: { vm: 'alpha', cpus: 2 } })
    expect(info.error).toBeUndefined()
    expect(info.createdAt).toBeGreaterThanOrEqual(before)
    expect(info.createdAt).toBeLessThanOrEqual(after)
    expect(info.template).toEqual([
      expect.objectContaining({ dest: 'rootfs.img', source: base, size: 8192, ino: String(fs.statSync(base).ino) }),
    ])
    await ws.dispose()
    expect(await pool.list()).toEqual([])
  })

  test('list() racing disposes of this process never lists a disposed workspace with its metadata missing', async () => {
    // A workspace disposed between list()'s open and its record's read must not be listed with error ENOENT.
    const pool = await openPool(path.join(freshDir(), 'pool'))
    let stop = false
    const errors: string[] = []
    const churn = async () => {
      while (!stop) await (await pool.allocate({ meta: { pad: 'x' } })).dispose()
    }
    const lister = async () => {
      while (!stop) for (const e of await pool.list()) if (e.error) errors.push(`${e.name}: ${e.error.code} ${e.error.message}`)
    }
    setTimeout(() => (stop = true), 1500)
    await Promise.all([churn(), churn(), churn(), churn(), lister()])
    expect(errors).toEqual([])
    await pool.close()
  })

  test('a workspace whose owner exited without dispose is listed with live: false', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const child = workspaceChild(pool.root)
    const [{ id }] = await allocateIn([child])
    child.send('exit')
    expect(await child.exited).toEqual({ code: 0, signal: null })
    const list = await pool.list()
    expect(list).toEqual([expect.objectContaining({ id, live: false, meta: { owner: child.pid } })])
  })

  test('a corrupt record is reported as ERR_CORRUPT_METADATA on its entry, naming the lease file, and left as it is', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const ws = await pool.allocate({ meta: { a: 1 } })
    const file = leasePath(pool.root, ws.name)
    setRecord(pool.root, ws.name, '{"format":1,"createdAt":17 not json')
    const [info] = await pool.list()
    expect(info).toMatchObject({ id: ws.id, name: ws.name, live: true })
    expect(info.meta).toBeUndefined()
    expect(info.error).toBeInstanceOf(VmspaceError)
    expect(info.error).toMatchObject({ code: 'ERR_CORRUPT_METADATA', path: file })
    await ws.dispose()
    expect(fs.existsSync(file)).toBe(false)
  })

  test('a missing record is reported as ENODATA on its entry, never read as empty', async () => {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const ws = await pool.allocate({ meta: { a: 1 } })
    fs.rmSync(leasePath(pool.root, ws.name))
    fs.writeFileSync(leasePath(pool.root, ws.name), '')
    const [info] = await pool.list()
    expect(info).toMatchObject({ id: ws.id })
    expect(info.meta).toBeUndefined()
    expect(info.error).toMatchObject({ code: 'ENODATA', syscall: 'fgetxattr', path: leasePath(pool.root, ws.name) })
    await ws.release({ force: true })
  })
})

/**
 * Image-backed pools (openPool({ image }), unmountImage, `vmspace mount`/`unmount`): a btrfs in a sparse file on
 * the host's own file system (mounts.scratch: ext4 on the dev machines), loop-mounted with direct I/O, as root.
 * Every test makes its own image; afterAll unmounts and detaches whatever is left, even after a failure.
 */
import { spawn, spawnSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterAll, describe, expect, test } from 'vitest'
import { openPool, unmountImage, type Pool } from '../lib/index.js'
import { removeScratch } from './setup/mounts.js'
import { MiB, mounts, needs, repoRoot, runCommand, sharedExtents, unprivilegedChildren, writeRandomFile } from './helpers.js'

const SIZE = 256 * MiB
const mkfsMissing = spawnSync('sh', ['-c', 'PATH=$PATH:/usr/sbin:/sbin command -v mkfs.btrfs'], { stdio: 'ignore' }).status !== 0
const missing = !mounts.root ? 'not running as root (loop devices and mounts need root)' : mkfsMissing ? 'mkfs.btrfs is not installed (btrfs-progs)' : false

const base = missing ? null : fs.mkdtempSync(path.join(mounts.scratch, 'vmspace-image-'))
const pools: Pool[] = []

afterAll(async () => {
  for (const p of pools) await p.close().catch(() => {})
  if (!base) return
  // Mounts first (removeScratch unmounts below base), then the loop devices of the images made here.
  removeScratch(base)
  for (const l of loops()) if (l['back-file'].startsWith(base)) spawnSync('losetup', ['--detach', l.name])
})

interface Loop {
  name: string
  'back-file': string
  dio: boolean
}

function loops(): Loop[] {
  const out = runCommand('losetup', ['--list', '--json', '--output', 'NAME,BACK-FILE,DIO']).stdout
  return out.trim() ? (JSON.parse(out) as { loopdevices: Loop[] }).loopdevices : []
}

const loopsOf = (image: string) => loops().filter((l) => l['back-file'] === image || l['back-file'] === `${image} (deleted)`)

/** The mounts at exactly `dir`: [source, fsType, options] each. */
function mountsAt(dir: string): { source: string; fsType: string; options: string }[] {
  return fs
    .readFileSync('/proc/self/mountinfo', 'utf8')
    .split('\n')
    .filter((l) => l.split(' ')[4] === dir)
    .map((l) => {
      const right = l.split(' - ')[1].split(' ')
      return { fsType: right[0], source: right[1], options: right[2] }
    })
}

/** The per-mount options (mountinfo's sixth field) of the topmost mount at `dir`: nodev, nosuid, … */
const mountOptions = (dir: string) =>
  fs.readFileSync('/proc/self/mountinfo', 'utf8').split('\n').filter((l) => l.split(' ')[4] === dir).map((l) => l.split(' ')[5].split(',')).at(-1)

let n = 0
/** A fresh (root, image) pair below base, neither existing. */
function paths(label: string): { root: string; image: string } {
  const dir = path.join(base!, `${label}-${++n}`)
  fs.mkdirSync(dir)
  return { root: path.join(dir, 'pool'), image: path.join(dir, 'pool.img') }
}

async function open(root: string, image: string, size = SIZE): Promise<Pool> {
  const pool = await openPool(root, { image: { path: image, size } })
  pools.push(pool)
  return pool
}

/** Nothing of an attempt at `root`/`image` is left: no image, no lock file, no loop device, no mount, no root. */
function expectNothingMade(root: string, image: string, imageExisted = false): void {
  if (!imageExisted) expect(fs.existsSync(image)).toBe(false)
  expect(fs.existsSync(`${image}.lock`)).toBe(false)
  expect(loopsOf(image)).toEqual([])
  expect(mountsAt(root)).toEqual([])
  expect(fs.existsSync(root)).toBe(false)
}

const sha256 = (file: string) => createHash('sha256').update(fs.readFileSync(file)).digest('hex')

describe.skipIf(missing)(`image-backed pool ${needs('root and mkfs.btrfs', missing)}`, () => {
  test('openPool({ image }) makes a sparse btrfs image labelled vmspace, loop-mounts it with direct I/O at root, and opens the pool', async () => {
    const { root, image } = paths('make')
    const pool = await open(root, image)
    const m = mountsAt(root)
    expect(m).toHaveLength(1)
    expect(m[0].fsType).toBe('btrfs')
    expect(m[0].options.split(',')).toContain('discard=async')
    expect(mountOptions(root)).toContain('nodev')
    const l = loopsOf(image)
    expect(l).toHaveLength(1)
    expect(l[0].name).toBe(m[0].source)
    expect(l[0].dio).toBe(true)
    const st = fs.statSync(image)
    expect(st.size).toBe(SIZE)
    expect(st.blocks * 512).toBeLessThan(SIZE / 2)
    expect(runCommand('blkid', ['-p', '-o', 'value', '-s', 'LABEL', image]).stdout.trim()).toBe('vmspace')
    expect(fs.existsSync(path.join(root, '.vmspace', 'version'))).toBe(true)
    expect(mounts.scratchFsType).not.toBe('btrfs')
    await pool.close()
  })

  test('a base inside the pool is reflinked into 16 children (extents shared), each private, the base unchanged', async () => {
    const { root, image } = paths('reflink')
    const host = path.join(path.dirname(image), 'base.img')
    writeRandomFile(host, 8 * MiB)
    const pool = await open(root, image)
    const holder = await pool.allocate({ template: { 'base.img': host } })
    const inPool = path.join(holder.path, 'base.img')
    const before = sha256(inPool)
    const children = await Promise.all(Array.from({ length: 16 }, () => pool.allocate({ template: { 'rootfs.img': inPool } })))
    for (const ws of children) {
      expect(ws.template[0].method).toBe('reflink')
      expect(sharedExtents(path.join(ws.path, 'rootfs.img')).shared).toBeGreaterThan(0)
    }
    children.forEach((ws, i) => {
      const fd = fs.openSync(path.join(ws.path, 'rootfs.img'), 'r+')
      fs.writeSync(fd, `child ${i}`, 4096)
      fs.closeSync(fd)
    })
    children.forEach((ws, i) => {
      const buf = Buffer.alloc(16)
      const fd = fs.openSync(path.join(ws.path, 'rootfs.img'), 'r')
      fs.readSync(fd, buf, 0, buf.length, 4096)
      fs.closeSync(fd)
      expect(buf.toString('utf8', 0, `child ${i}`.length)).toBe(`child ${i}`)
    })
    expect(sha256(inPool)).toBe(before)
    expect(sha256(host)).toBe(before)
    for (const ws of children) await ws.dispose()
    await holder.dispose()
    await pool.close()
  })

  test('a second openPool of the mounted image opens it again: one mount, one loop device', async () => {
    const { root, image } = paths('reopen')
    const a = await open(root, image)
    const ws = await a.allocate()
    const b = await open(root, image)
    expect((await b.list()).map((w) => w.name)).toEqual([ws.name])
    expect(mountsAt(root)).toHaveLength(1)
    expect(loopsOf(image)).toHaveLength(1)
    await ws.dispose()
    await a.close()
    await b.close()
  })

  test('after an umount openPool mounts it again on its loop device; after a detach (a reboot) on a new one', async () => {
    const { root, image } = paths('reattach')
    const pool = await open(root, image)
    const ws = await pool.allocate({ meta: { kept: true } })
    await ws.release({ force: true })
    await pool.close()
    expect(runCommand('umount', [root]).status).toBe(0)
    expect(loopsOf(image)).toHaveLength(1)
    const again = await open(root, image)
    expect((await again.list()).map((w) => w.meta)).toEqual([{ kept: true }])
    expect(loopsOf(image)).toHaveLength(1)
    await again.close()
    const loop = loopsOf(image)[0].name
    expect(runCommand('umount', [root]).status).toBe(0)
    expect(runCommand('losetup', ['--detach', loop]).status).toBe(0)
    const third = await open(root, image)
    expect((await third.list()).map((w) => w.meta)).toEqual([{ kept: true }])
    expect(loopsOf(image)).toHaveLength(1)
    expect(mountsAt(root)).toHaveLength(1)
    await third.close()
  })

  test('three processes racing the first openPool make one image, one loop device and one mount', async () => {
    const { root, image } = paths('race')
    const script = `
      const { openPool } = require(${JSON.stringify(path.join(repoRoot, 'dist', 'index.js'))})
      openPool(${JSON.stringify(root)}, { image: { path: ${JSON.stringify(image)}, size: ${SIZE} } })
        .then(async (p) => { await p.close(); process.stdout.write('ok') }, (e) => { process.stdout.write(String(e.code)); process.exitCode = 1 })`
    const results = await Promise.all(
      Array.from({ length: 3 }, () => new Promise<string>((resolve) => {
        const c = spawn(process.execPath, ['-e', script], { stdio: ['ignore', 'pipe', 'inherit'] })
        let out = ''
        c.stdout.setEncoding('utf8').on('data', (s: string) => (out += s))
        c.on('close', () => resolve(out))
      })),
    )
    expect(results).toEqual(['ok', 'ok', 'ok'])
    expect(mountsAt(root)).toHaveLength(1)
    expect(loopsOf(image)).toHaveLength(1)
    expect(fs.readdirSync(path.dirname(image)).sort()).toEqual(['pool', 'pool.img', 'pool.img.lock'])
  })

  test('a quota on the image-backed pool is enforced: writes past it fail with EDQUOT (btrfs simple quotas)', async () => {
    const { root, image } = paths('quota')
    const pool = await open(root, image)
    expect((await pool.usage()).quota.supported).toBe(true)
    const out = runCommand(process.execPath, [path.join(repoRoot, 'dist', 'cli', 'vmspace.js'), 'probe', root]).stdout
    expect(out).toMatch(/quota\s+yes .*btrfs simple quotas \(squota\)/)
    const ws = await pool.allocate({ quota: { bytes: 16 * MiB } })
    const fd = fs.openSync(path.join(ws.path, 'big'), 'w')
    const chunk = Buffer.alloc(MiB, 1)
    let error: NodeJS.ErrnoException | undefined
    try {
      for (let i = 0; i < 64; i++) {
        fs.writeSync(fd, chunk)
        fs.fsyncSync(fd)
      }
    } catch (e) {
      error = e as NodeJS.ErrnoException
    } finally {
      fs.closeSync(fd)
    }
    expect(error?.errno).toBe(-122) // EDQUOT (Node names it UNKNOWN: libuv has no UV_EDQUOT)
    await ws.dispose()
    await pool.close()
  })

  test('a first call killed while making the image leaves only <image>.making-<hex>, which the next call removes; quotas turned off are on again at the next mount', async () => {
    const { root, image } = paths('killed')
    const stale = `${image}.making-0123456789abcdef`
    fs.writeFileSync(stale, Buffer.alloc(4096)) // what a call SIGKILLed during mkfs leaves: no file system yet
    const other = path.join(path.dirname(image), 'other.img.making-0123456789abcdef') // another image's: not ours
    fs.writeFileSync(other, 'x')
    const pool = await open(root, image)
    expect(fs.readdirSync(path.dirname(image)).sort()).toEqual(['other.img.making-0123456789abcdef', 'pool', 'pool.img', 'pool.img.lock'])
    await pool.close()
    // A call killed between mkfs and the quota ioctl leaves an image without quotas.
    runCommand('btrfs', ['quota', 'disable', root])
    await unmountImage(root)
    const again = await open(root, image)
    const ws = await again.allocate({ quota: { bytes: 16 * MiB } })
    await ws.dispose()
    await again.close()
  })

  test('unmountImage unmounts and detaches, keeping the image; a root that is not an image mount is ERR_IMAGE_NOT_MOUNTED', async () => {
    const { root, image } = paths('unmount')
    const pool = await open(root, image)
    await pool.close()
    expect(await unmountImage(root)).toBe(image)
    expect(mountsAt(root)).toEqual([])
    expect(loopsOf(image)).toEqual([])
    expect(fs.existsSync(image)).toBe(true)
    await expect(unmountImage(root)).rejects.toMatchObject({ code: 'ERR_IMAGE_NOT_MOUNTED' })
  })

  test('after unmountImage openPool(root) without image is ERR_IMAGE_NOT_MOUNTED, nothing made; the next mount is not refused', async () => {
    const { root, image } = paths('unmounted')
    const pool = await open(root, image)
    const ws = await pool.allocate({ meta: { kept: true } })
    await ws.release({ force: true })
    await pool.close()
    await unmountImage(root)
    expect(fs.readdirSync(root)).toEqual(['.vmspace-image'])
    expect(fs.readFileSync(path.join(root, '.vmspace-image'), 'utf8')).toBe(`${image}\n`)
    for (const options of [undefined, { nonEmpty: true }])
      await expect(openPool(root, options)).rejects.toMatchObject({ code: 'ERR_IMAGE_NOT_MOUNTED', path: root, message: expect.stringContaining(image) })
    // Below the mount point too: a pool there would be on the host's file system all the same.
    const below = path.join(root, 'sub', 'pool')
    await expect(openPool(below)).rejects.toMatchObject({ code: 'ERR_IMAGE_NOT_MOUNTED', path: below, message: expect.stringContaining(image) })
    expect(fs.readdirSync(root)).toEqual(['.vmspace-image'])
    const again = await open(root, image)
    expect((await again.list()).map((w) => w.meta)).toEqual([{ kept: true }])
    expect(fs.existsSync(path.join(root, '.vmspace-image'))).toBe(false)
    await again.close()
  })

  test('a mount point from before the marker (mounted by hand over an empty directory) gets it at unmountImage', async () => {
    const { root, image } = paths('oldpoint')
    const pool = await open(root, image)
    await pool.close()
    const loop = loopsOf(image)[0].name
    expect(runCommand('umount', [root]).status).toBe(0)
    fs.rmSync(path.join(root, '.vmspace-image'))
    expect(runCommand('mount', ['-t', 'btrfs', loop, root]).status).toBe(0)
    await unmountImage(root)
    expect(fs.readdirSync(root)).toEqual(['.vmspace-image'])
    await expect(openPool(root)).rejects.toMatchObject({ code: 'ERR_IMAGE_NOT_MOUNTED' })
  })

  test('an image mounted at one root is ERR_IMAGE_IN_USE at another, which is left as it was; unmountImage through a symlink to the root unmounts it', async () => {
    const { root, image } = paths('elsewhere')
    const pool = await open(root, image)
    await pool.close()
    const other = path.join(path.dirname(root), 'other')
    await expect(open(other, image)).rejects.toMatchObject({ code: 'ERR_IMAGE_IN_USE', path: image, message: expect.stringContaining(root) })
    expect(fs.existsSync(other)).toBe(false)
    expect(mountsAt(root)).toHaveLength(1)
    expect(loopsOf(image)).toHaveLength(1)
    const link = path.join(path.dirname(root), 'link')
    fs.symlinkSync(root, link)
    expect(await unmountImage(link)).toBe(image)
    expect(mountsAt(root)).toEqual([])
    expect(loopsOf(image)).toEqual([])
  })

  test('vmspace mount and unmount: exit 0 and one line each; a bad --size is exit 2 with nothing made', () => {
    const { root, image } = paths('cli')
    const cli = path.join(repoRoot, 'dist', 'cli', 'vmspace.js')
    for (const size of ['lots', '100', '127M', '200000000']) {
      const bad = runCommand(process.execPath, [cli, 'mount', root, '--image', image, '--size', size])
      expect(bad.status, size).toBe(2)
      expect(bad.stderr.trim().split('\n'), size).toHaveLength(1)
      expectNothingMade(root, image)
    }
    const m = runCommand(process.execPath, [cli, 'mount', root, '--image', image, '--size', '256M'])
    expect(m.stderr).toBe('')
    expect(m.status).toBe(0)
    expect(m.stdout).toMatch(/^.*: pool on .*pool\.img \(btrfs through \/dev\/loop\d+, direct I\/O on\)\n$/)
    const u = runCommand(process.execPath, [cli, 'unmount', root])
    expect(u.status).toBe(0)
    expect(mountsAt(root)).toEqual([])
    expect(loopsOf(image)).toEqual([])
  })

  test('vmspace mount needs --size only to make the image: an existing one mounts without it, a missing one is exit 2 with nothing made', () => {
    const { root, image } = paths('nosize')
    const cli = path.join(repoRoot, 'dist', 'cli', 'vmspace.js')
    const missing = runCommand(process.execPath, [cli, 'mount', root, '--image', image])
    expect(missing).toMatchObject({ status: 2, stdout: '', stderr: `vmspace mount: --size is needed to make the image: ${image} does not exist\n` })
    expectNothingMade(root, image)
    expect(runCommand(process.execPath, [cli, 'mount', root, '--image', image, '--size', '256M']).status).toBe(0)
    expect(runCommand(process.execPath, [cli, 'unmount', root]).status).toBe(0)
    const again = runCommand(process.execPath, [cli, 'mount', root, '--image', image])
    expect(again.stderr).toBe('')
    expect(again.status).toBe(0)
    expect(fs.statSync(image).size).toBe(SIZE)
    expect(mountsAt(root)).toHaveLength(1)
    expect(runCommand(process.execPath, [cli, 'unmount', root]).status).toBe(0)
  })

  test('openPool({ image }) without a size opens an existing image; a missing one is ERR_INVALID_ARG_TYPE naming options.image.size, nothing made', async () => {
    const { root, image } = paths('libnosize')
    await expect(openPool(root, { image: { path: image } })).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_TYPE', message: expect.stringContaining('options.image.size') })
    expectNothingMade(root, image)
    await (await open(root, image)).close()
    await unmountImage(root)
    const pool = await openPool(root, { image: { path: image } })
    pools.push(pool)
    expect(mountsAt(root)).toHaveLength(1)
    await pool.close()
    await unmountImage(root)
  })

  test('vmspace unmount of a busy pool says how many workspaces are live and to run vmspace ls; of one unmounted already exits 0 with a note', async () => {
    const { root, image } = paths('busy')
    const cli = path.join(repoRoot, 'dist', 'cli', 'vmspace.js')
    const pool = await open(root, image)
    const ws = await pool.allocate()
    const busy = runCommand(process.execPath, [cli, 'unmount', root])
    expect(busy.status).toBe(1)
    expect(busy.stdout).toBe('')
    expect(busy.stderr).toMatch(/^vmspace unmount: ERR_IMAGE_TOOL_FAILED: umount .*busy.*: .* is in use \(1 live workspace\(s\) in it; .*\): see vmspace ls .*, end them, then unmount again\n$/)
    expect(mountsAt(root)).toHaveLength(1)
    await ws.dispose()
    await pool.close()
    expect(runCommand(process.execPath, [cli, 'unmount', root])).toMatchObject({ status: 0, stderr: '' })
    const twice = runCommand(process.execPath, [cli, 'unmount', root])
    expect(twice).toMatchObject({ status: 0, stdout: '', stderr: `vmspace unmount: nothing is mounted at ${root} (unmounted already); nothing done\n` })
    expect(runCommand(process.execPath, [cli, 'unmount', root, '--json'])).toMatchObject({ status: 0, stdout: `${JSON.stringify({ root, image: null }, null, 2)}\n` })
    expect(runCommand(process.execPath, [cli, 'unmount', path.join(root, 'missing')]).status).toBe(2)
  })
})

describe.skipIf(missing)(`the demo's default pool ${needs('root and mkfs.btrfs', missing)}`, () => {
  test('without --root the demo runs on an image-backed pool in the temp directory, clones by reflink, and removes it all', () => {
    const tmp = fs.mkdtempSync(path.join(base!, 'demo-tmp-'))
    const base0 = path.join(tmp, 'base.img')
    writeRandomFile(base0, 4 * MiB)
    const cli = path.join(repoRoot, 'dist', 'cli', 'vmspace.js')
    const r = runCommand(process.execPath, [cli, 'demo', '--vms', '4', '--workers', '2', '--live', '2', '--base', base0], { env: { ...process.env, TMPDIR: tmp } })
    expect(r.status).toBe(0)
    expect(r.stderr).toMatch(/^demo: image-backed pool: btrfs in .*\.img \(sparse, 4 GiB\), loop-mounted at /m)
    expect(r.stdout).toMatch(/clone methods\s+\| reflink 4 \/ copy 0/)
    expect(fs.readdirSync(tmp)).toEqual(['base.img'])
    expect(loops().filter((l) => l['back-file'].startsWith(tmp))).toEqual([])
  })
})

describe.skipIf(missing)(`image-backed pool: bad input leaves nothing ${needs('root and mkfs.btrfs', missing)}`, () => {
  test('an image the host file system cannot hold is ENOSPC before anything is made', async () => {
    if (!mounts.small) return expect.fail(`the small ext4 is missing: ${mounts.missing.small}`)
    const dir = fs.mkdtempSync(path.join(mounts.small, 'image-'))
    const root = path.join(dir, 'pool')
    const image = path.join(dir, 'pool.img')
    await expect(open(root, image, 512 * MiB)).rejects.toMatchObject({ code: 'ENOSPC', syscall: 'statfs' })
    expectNothingMade(root, image)
    fs.rmSync(dir, { recursive: true })
  })

  test('an existing file that is not a vmspace image is refused untouched (random bytes, an ext4, a btrfs of another label)', async () => {
    for (const kind of ['bytes', 'ext4', 'btrfs'] as const) {
      const { root, image } = paths(`foreign-${kind}`)
      if (kind === 'bytes') writeRandomFile(image, MiB)
      else {
        fs.writeFileSync(image, '')
        fs.truncateSync(image, SIZE)
        const mkfs = kind === 'ext4' ? ['mkfs.ext4', '-q', '-F', image] : ['mkfs.btrfs', '-q', '-L', 'other', image]
        expect(runCommand('sh', ['-c', `PATH=$PATH:/usr/sbin:/sbin ${mkfs.join(' ')}`]).status).toBe(0)
      }
      const before = sha256(image)
      await expect(open(root, image)).rejects.toMatchObject({ code: 'ERR_IMAGE_FOREIGN', path: image })
      expect(sha256(image)).toBe(before)
      expectNothingMade(root, image, true)
    }
  })

  test('a root that is the mount of something else is ERR_IMAGE_ROOT_MOUNTED', async () => {
    const { root, image } = paths('mounted')
    fs.mkdirSync(root)
    expect(runCommand('mount', ['-t', 'tmpfs', 'tmpfs', root]).status).toBe(0)
    try {
      await expect(open(root, image)).rejects.toMatchObject({ code: 'ERR_IMAGE_ROOT_MOUNTED', path: root })
      expect(fs.existsSync(image)).toBe(false)
      expect(fs.existsSync(`${image}.lock`)).toBe(false)
      expect(mountsAt(root)).toHaveLength(1)
    } finally {
      runCommand('umount', [root])
    }
  })

  test('a root holding entries the mount would hide is ERR_POOL_NOT_EMPTY, the image not made', async () => {
    const { root, image } = paths('nonempty')
    fs.mkdirSync(root)
    fs.writeFileSync(path.join(root, 'mine'), 'x')
    await expect(open(root, image)).rejects.toMatchObject({ code: 'ERR_POOL_NOT_EMPTY' })
    expect(fs.readdirSync(path.dirname(image))).toEqual(['pool'])
    expect(loopsOf(image)).toEqual([])
  })

  test('bad image options are ERR_INVALID_ARG_VALUE/TYPE before anything is made (below the minimum size, not 4 KiB aligned, unknown key)', async () => {
    const { root, image } = paths('args')
    const cases: [unknown, string][] = [
      [{ path: image, size: 64 * MiB }, 'ERR_INVALID_ARG_VALUE'],
      [{ path: image, size: SIZE + 1 }, 'ERR_INVALID_ARG_VALUE'],
      [{ path: image, size: SIZE, sise: 1 }, 'ERR_INVALID_ARG_VALUE'],
      [{ size: SIZE }, 'ERR_INVALID_ARG_TYPE'],
      [{ path: image }, 'ERR_INVALID_ARG_TYPE'],
      ['x', 'ERR_INVALID_ARG_TYPE'],
    ]
    for (const [value, code] of cases) {
      await expect(openPool(root, { image: value as never })).rejects.toMatchObject({ code })
      expectNothingMade(root, image)
    }
  })

  test.skipIf(!unprivilegedChildren)('without root it is ERR_IMAGE_NOT_PERMITTED (cause EPERM), nothing made', () => {
    const dir = fs.mkdtempSync(path.join(mounts.scratch, 'vmspace-image-user-'))
    fs.chmodSync(dir, 0o777)
    const root = path.join(dir, 'pool')
    const image = path.join(dir, 'pool.img')
    try {
      const script = `require(${JSON.stringify(path.join(repoRoot, 'dist', 'index.js'))}).openPool(${JSON.stringify(root)}, { image: { path: ${JSON.stringify(image)}, size: ${SIZE} } })
        .then(() => process.stdout.write('opened'), (e) => process.stdout.write(e.code + ' ' + e.cause?.code))`
      const r = runCommand(process.execPath, ['-e', script], { uid: 65534, gid: 65534 })
      expect(r.stdout).toBe('ERR_IMAGE_NOT_PERMITTED EPERM')
      expectNothingMade(root, image)
    } finally {
      fs.rmSync(dir, { recursive: true, force: true })
    }
  })
})

/**
 * The layer applier and template builds (native/core/layer_apply.h, template_build.h): tars written by python3's
 * tarfile (test/fixtures/make-tar.py) streamed through native.pipe() into layerApply, on the loop-mounted XFS and
 * btrfs. Every entry type and field; the OCI whiteout rules; hostile layers, which must neither reach outside the
 * tree (a canary outside the pool keeps its hash) nor leave anything published or staged; cancel; SIGKILL.
 */
import './hooks-env.js'
import { spawn, spawnSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as net from 'node:net'
import * as path from 'node:path'
import { afterAll, beforeAll, describe, expect, test } from 'vitest'
import { native, type BuildHandle, type PoolHandle, type ProgressHandle } from '../lib/binding.js'
import { call } from '../lib/errors.js'
import { openPool } from '../lib/index.js'
import { fixtures, mounts, requireMount } from './helpers.js'
import { removeScratch } from './setup/mounts.js'

interface TarEntry {
  name: string
  type?: 'file' | 'dir' | 'symlink' | 'link' | 'char' | 'block' | 'fifo'
  rawtype?: string
  data?: string
  size?: number
  at?: number
  mode?: number
  uid?: number
  gid?: number
  mtime?: number
  linkname?: string
  major?: number
  minor?: number
  xattrs?: Record<string, string>
  pax?: Record<string, string>
}

/** A tar of `entries` by python3's tarfile. */
function tar(entries: TarEntry[], format: 'pax' | 'gnu' | 'ustar' = 'pax'): Buffer {
  const r = spawnSync('python3', [path.join(fixtures, 'make-tar.py')], { input: JSON.stringify({ format, entries }), maxBuffer: 1 << 30 })
  if (r.status !== 0) throw new Error(`make-tar.py: ${r.stderr.toString()}`)
  return r.stdout
}

/** Streams `bytes` into a pipe whose read end layerApply reads; the writer's EPIPE (the applier failed first) is swallowed. */
async function apply(build: BuildHandle, bytes: Buffer, progress?: ProgressHandle, keepOpen = false) {
  const [readFd, writeFd] = native.pipe()
  const sock = new net.Socket({ fd: writeFd, readable: false, writable: true })
  const closed = new Promise<void>((resolve) => {
    sock.on('error', () => resolve())
    sock.on('close', () => resolve())
  })
  if (keepOpen) sock.write(bytes)
  else sock.end(bytes)
  const applied = call(native.layerApply(build, readFd, { progress }))
  return { applied, sock, closed }
}

async function applyTar(build: BuildHandle, bytes: Buffer) {
  const { applied, sock, closed } = await apply(build, bytes)
  try {
    return await applied
  } finally {
    sock.destroy()
    await closed
  }
}

const canaryDir = fs.mkdtempSync(path.join(mounts.scratch, 'vmspace-canary-'))
const canary = path.join(canaryDir, 'passwd')
fs.writeFileSync(canary, 'root:x:0:0:canary\n')
const canaryHash = () => createHash('sha256').update(fs.readFileSync(canary)).digest('hex')
const canaryBefore = canaryHash()

const fsList = [
  ['xfs', mounts.xfs, mounts.missing.xfs],
  ['btrfs', mounts.btrfs, mounts.missing.btrfs],
] as const

const key = (n: number) => `sha256-${n.toString(16).padStart(64, '0')}`

for (const [label, mountPoint, missing] of fsList) requireMount(label, mountPoint, missing)
afterAll(() => removeScratch(canaryDir))

describe.each(fsList.filter(([, m]) => m !== null))('layers on %s', (label, mountPoint) => {
  let root: string
  let handle: PoolHandle
  beforeAll(async () => {
    root = fs.mkdtempSync(path.join(mountPoint!, 'vmspace-layers-'))
    handle = (await call(native.openPool({ root, create: true, nonEmpty: false, projectIdFirst: 0, projectIdLast: 0 }))).handle
  })
  afterAll(async () => {
    if (handle) await native.closePool(handle)
    if (root) removeScratch(root)
    expect(canaryHash()).toBe(canaryBefore)
  })

  const templatesDir = () => path.join(root, '.vmspace', 'templates')
  const staging = () => fs.readdirSync(path.join(templatesDir(), 'staging'))
  const published = () => (fs.existsSync(templatesDir()) ? fs.readdirSync(templatesDir()).filter((n) => /^[0-9a-f]{32}$/.test(n)) : [])

  /** A build from `parent` with each tar applied in turn, published under `layerKey`: its id. */
  async function layer(parent: string, tars: Buffer[], layerKey?: string): Promise<string> {
    const { build } = await call(native.templateBuildStart(handle, { parent }))
    try {
      for (const t of tars) await applyTar(build, t)
      return (await call(native.templateBuildPublish(build, { info: '"createdAt":"now"', layerKey }))).id
    } finally {
      await native.templateBuildAbandon(build)
    }
  }

  /** Applies `t` on a build from `parent`, expecting `code`; nothing may stay published or staged. */
  async function refused(parent: string, t: Buffer, code: string, entry?: string) {
    const before = published()
    const { build } = await call(native.templateBuildStart(handle, { parent }))
    const err = await applyTar(build, t).then(
      () => null,
      (e: unknown) => e,
    )
    await native.templateBuildAbandon(build)
    expect(err).toMatchObject({ code })
    if (entry !== undefined) expect((err as { path?: string }).path).toBe(entry)
    expect(published()).toEqual(before)
    expect(staging()).toEqual([])
    expect(canaryHash()).toBe(canaryBefore)
  }

  test('every entry type and field: files with holes, dirs, symlinks, hard links, devices, fifos, set-id, capabilities, xattrs, owners, mtimes, long names', async () => {
    const longName = 'long/' + 'n'.repeat(200) + '/' + 'f'.repeat(120)
    const capability = '\u0001\u0000\u0000\u0002\u0000\u0020\u0000\u0000' + '\u0000'.repeat(12) // cap_net_raw+ep
    const entries: TarEntry[] = [
      { name: './', type: 'dir', mode: 0o755, mtime: 1_500_000_000 },
      { name: 'etc', type: 'dir', mode: 0o750, uid: 7, gid: 8, mtime: 1_500_000_001 },
      { name: 'etc/hosts', data: 'hosts\n', mode: 0o640, uid: 1000, gid: 1001, mtime: 1_500_000_002, xattrs: { 'user.note': 'hello' } },
      { name: 'sparse.img', size: 4 << 20, data: 'middle', at: 2 << 20, mode: 0o600 },
      { name: 'bin/ping', data: 'ELF', mode: 0o4755, xattrs: { 'security.capability': capability } },
      { name: 'bin/sgid', data: 'x', mode: 0o2711, gid: 5 },
      { name: 'bin/sh', type: 'symlink', linkname: '/bin/busybox', uid: 3, gid: 4, mtime: 1_400_000_000 },
      { name: 'bin/hosts-link', type: 'link', linkname: 'etc/hosts' },
      { name: 'dev/null', type: 'char', major: 1, minor: 3, mode: 0o666 },
      { name: 'dev/loop9', type: 'block', major: 7, minor: 9, mode: 0o660, gid: 6 },
      { name: 'run/fifo', type: 'fifo', mode: 0o600 },
      { name: longName, data: 'long', pax: { mtime: '1600000000.25' } },
    ]
    const id = await layer('', [tar(entries)], key(1))
    const tree = path.join(templatesDir(), id, 'tree')
    const st = (p: string) => fs.lstatSync(path.join(tree, p))
    expect(st('etc').uid).toBe(7)
    expect(st('etc').gid).toBe(8)
    expect(st('etc').mtimeMs).toBe(1_500_000_001_000)
    expect(st('.').mtimeMs).toBe(1_500_000_000_000)
    expect(fs.readFileSync(path.join(tree, 'etc/hosts'), 'utf8')).toBe('hosts\n')
    expect([st('etc/hosts').uid, st('etc/hosts').gid, st('etc/hosts').mtimeMs]).toEqual([1000, 1001, 1_500_000_002_000])
    expect(spawnSync('getfattr', ['--only-values', '-n', 'user.note', path.join(tree, 'etc/hosts')]).stdout.toString()).toBe('hello')
    const sparse = fs.readFileSync(path.join(tree, 'sparse.img'))
    expect(sparse.length).toBe(4 << 20)
    expect(sparse.subarray(2 << 20, (2 << 20) + 6).toString()).toBe('middle')
    expect(st('sparse.img').blocks * 512).toBeLessThan(1 << 20)
    expect(st('bin/ping').mode & 0o7777).toBe(label === 'btrfs' ? 0o4755 : 0o4555)
    expect(spawnSync('getcap', [path.join(tree, 'bin/ping')]).stdout.toString()).toContain('cap_net_raw=ep')
    expect(st('bin/sgid').mode & 0o7000).toBe(0o2000)
    // bin/ has no entry of its own: made on the way, 0755 (less the write bits a template removes), root's.
    expect([st('bin').mode & 0o7777, st('bin').uid]).toEqual([label === 'btrfs' ? 0o755 : 0o555, 0])
    expect(fs.readlinkSync(path.join(tree, 'bin/sh'))).toBe('/bin/busybox')
    expect([st('bin/sh').uid, st('bin/sh').gid, st('bin/sh').mtimeMs]).toEqual([3, 4, 1_400_000_000_000])
    expect(st('bin/hosts-link').ino).toBe(st('etc/hosts').ino)
    expect(st('dev/null').isCharacterDevice() && st('dev/null').rdev).toBe(0x103)
    expect(st('dev/loop9').isBlockDevice() && st('dev/loop9').rdev).toBe(0x709)
    expect(st('run/fifo').isFIFO()).toBe(true)
    expect(fs.readFileSync(path.join(tree, longName), 'utf8')).toBe('long')
    expect(st(longName).mtimeMs).toBe(1_600_000_000_250)
    expect(await call(native.findLayer(handle, key(1)))).toBe(id)
    expect(fs.readlinkSync(path.join(templatesDir(), 'layers', key(1)))).toBe(id)
  })

  test('GNU long names and links are read as PAX ones are', async () => {
    const name = 'g/' + 'x'.repeat(150)
    const id = await layer('', [tar([{ name, data: 'gnu' }, { name: name + '-link', type: 'symlink', linkname: 'y'.repeat(150) }], 'gnu')])
    const tree = path.join(templatesDir(), id, 'tree')
    expect(fs.readFileSync(path.join(tree, name), 'utf8')).toBe('gnu')
    expect(fs.readlinkSync(path.join(tree, name + '-link'))).toBe('y'.repeat(150))
  })

  test('whiteouts: .wh.<name> removes a lower file or directory; an opaque directory hides the lower entries but keeps the same layer, before or after the marker; file and directory replace each other', async () => {
    const lower = await layer('', [
      tar([
        { name: 'd', type: 'dir' },
        { name: 'd/lower1', data: '1' },
        { name: 'd/sub', type: 'dir' },
        { name: 'd/sub/lower2', data: '2' },
        { name: 'gone', data: 'x' },
        { name: 'gonedir', type: 'dir' },
        { name: 'gonedir/inner', data: 'x' },
        { name: 'was-dir', type: 'dir' },
        { name: 'was-dir/inner', data: 'x' },
        { name: 'was-file', data: 'file' },
        { name: 'kept', data: 'kept' },
      ]),
    ])
    const upper = await layer(lower, [
      tar([
        { name: 'd/before', data: 'b' },
        { name: 'd/sub/new', data: 'n' },
        { name: 'd/.wh..wh..opq' },
        { name: 'd/after', data: 'a' },
        { name: '.wh.gone' },
        { name: '.wh.gonedir' },
        { name: '.wh.never-there' },
        { name: 'was-dir', data: 'now a file' },
        { name: 'was-file', type: 'dir' },
        { name: 'was-file/child', data: 'c' },
      ]),
    ])
    const tree = path.join(templatesDir(), upper, 'tree')
    const ls = (p: string) => fs.readdirSync(path.join(tree, p)).sort()
    expect(ls('.')).toEqual(['d', 'kept', 'was-dir', 'was-file'])
    expect(ls('d')).toEqual(['after', 'before', 'sub'])
    expect(ls('d/sub')).toEqual(['new'])
    expect(fs.readFileSync(path.join(tree, 'was-dir'), 'utf8')).toBe('now a file')
    expect(ls('was-file')).toEqual(['child'])
    // The lower template is as it was.
    expect(fs.readdirSync(path.join(templatesDir(), lower, 'tree', 'd')).sort()).toEqual(['lower1', 'sub'])
  })

  test('a workspace allocated from a layer template holds its tree with the write bits given back', async () => {
    const lower = await layer('', [tar([{ name: 'etc/conf', data: 'lower', mode: 0o644 }])])
    const upper = await layer(lower, [tar([{ name: 'etc/conf', data: 'upper', mode: 0o640 }, { name: 'bin/tool', data: 't', mode: 0o755 }])])
    const pool = await openPool(root)
    try {
      const ws = await pool.allocate({ from: upper })
      expect(fs.readFileSync(path.join(ws.path, 'etc/conf'), 'utf8')).toBe('upper')
      expect(fs.statSync(path.join(ws.path, 'etc/conf')).mode & 0o7777).toBe(0o640)
      expect(fs.statSync(path.join(ws.path, 'bin/tool')).mode & 0o7777).toBe(0o755)
      await ws.dispose()
    } finally {
      await pool.close()
    }
  })

  test('an opaque marker first in its directory keeps the entries after it', async () => {
    const lower = await layer('', [tar([{ name: 'o/old', data: 'o' }])])
    const upper = await layer(lower, [tar([{ name: 'o', type: 'dir' }, { name: 'o/.wh..wh..opq' }, { name: 'o/new', data: 'n' }])])
    expect(fs.readdirSync(path.join(templatesDir(), upper, 'tree', 'o'))).toEqual(['new'])
  })

  test('a lower symlink to / or ../../.. leads back into the tree: the next layer writes inside it, never outside', async () => {
    const lower = await layer('', [
      tar([
        { name: 'evil', type: 'symlink', linkname: '/' },
        { name: 'evil2', type: 'symlink', linkname: '../../..' },
        { name: 'etcl', type: 'symlink', linkname: canaryDir },
      ]),
    ])
    const upper = await layer(lower, [
      tar([
        { name: 'evil/etc/passwd', data: 'inside\n' },
        { name: 'evil2/x', data: 'x' },
        { name: 'evil/.wh.etcl' },
      ]),
    ])
    const tree = path.join(templatesDir(), upper, 'tree')
    expect(fs.readFileSync(path.join(tree, 'etc/passwd'), 'utf8')).toBe('inside\n')
    expect(fs.readFileSync(path.join(tree, 'x'), 'utf8')).toBe('x')
    expect(fs.existsSync(path.join(tree, 'etcl'))).toBe(false)
    // A link to the canary's directory resolves to that path inside the tree, where nothing is: ENOENT, not the canary.
    await refused(lower, tar([{ name: 'etcl/passwd', data: 'not the canary' }]), 'ENOENT', 'etcl/passwd')
    expect(canaryHash()).toBe(canaryBefore)
  })

  test('a hard link through a lower symlink resolves inside the tree; one to a missing entry is refused', async () => {
    const lower = await layer('', [tar([{ name: 'lnk', type: 'symlink', linkname: '/' }, { name: 'target', data: 't' }])])
    const upper = await layer(lower, [tar([{ name: 'h', type: 'link', linkname: 'lnk/target' }])])
    const tree = path.join(templatesDir(), upper, 'tree')
    expect(fs.statSync(path.join(tree, 'h')).ino).toBe(fs.statSync(path.join(tree, 'target')).ino)
    await refused(lower, tar([{ name: 'h2', type: 'link', linkname: 'lnk' + canary }]), 'ERR_LAYER_UNSAFE', 'h2')
  })

  test.each([
    ['../x', [{ name: '../x', data: 'x' }]],
    ['/etc/x', [{ name: '/etc/x', data: 'x' }]],
    ['a/../../x', [{ name: 'a/../../x', data: 'x' }]],
    ['a hard link to ../../outside', [{ name: 'h', type: 'link', linkname: '../../outside' }]],
    ['a hard link to a directory', [{ name: 'd', type: 'dir' }, { name: 'h', type: 'link', linkname: 'd' }]],
    ['a symlink as the root', [{ name: '.', type: 'symlink', linkname: '/' }]],
    ['a bare .wh.', [{ name: 'd/.wh.' }]],
    ['.wh. of ..', [{ name: 'd/.wh...' }]],
    ['.wh. of .', [{ name: '.wh..' }]],
    ['a whiteout with data', [{ name: '.wh.x', data: 'data' }]],
    ['a whiteout that is a directory', [{ name: '.wh.x', type: 'dir' }]],
    ['a whiteout of an entry the same layer made', [{ name: 'x', data: 'x' }, { name: '.wh.x' }]],
  ] as [string, TarEntry[]][])('refused as ERR_LAYER_UNSAFE: %s', async (_what, entries) => {
    await refused('', tar(entries, 'gnu'), 'ERR_LAYER_UNSAFE')
  })

  test('invalid tars are ERR_LAYER_INVALID: bad checksum, truncated, GNU sparse, unknown type, empty stream', async () => {
    const good = tar([{ name: 'a', data: 'x'.repeat(3000) }, { name: 'b', data: 'y' }], 'ustar')
    const flipped = Buffer.from(good)
    flipped[10] ^= 0x01
    await refused('', flipped, 'ERR_LAYER_INVALID')
    await refused('', good.subarray(0, 1200), 'ERR_LAYER_INVALID')
    await refused('', good.subarray(0, 512 * 8), 'ERR_LAYER_INVALID')
    await refused('', tar([{ name: 's', rawtype: 'S' }], 'gnu'), 'ERR_LAYER_INVALID', 's')
    await refused('', tar([{ name: 'q', rawtype: 'Q' }], 'ustar'), 'ERR_LAYER_INVALID', 'q')
    await refused('', Buffer.alloc(0), 'ERR_LAYER_INVALID')
  })

  test('cancel mid-stream rejects with ECANCELED and abandon leaves no staging', async () => {
    const progress = native.newProgress()
    const { build } = await call(native.templateBuildStart(handle, { parent: '' }))
    const { applied, sock, closed } = await apply(build, tar([{ name: 'a', data: 'x'.repeat(100_000) }]).subarray(0, 50_000), progress, true)
    native.cancelProgress(progress)
    sock.destroy()
    await closed
    await expect(applied).rejects.toMatchObject({ code: 'ECANCELED' })
    await native.templateBuildAbandon(build)
    expect(staging()).toEqual([])
  })

  test('two builds of one chain key publish one layer template: the second gets the first with existing', async () => {
    const starts = await Promise.all([0, 1].map(() => call(native.templateBuildStart(handle, { parent: '' }))))
    for (const s of starts) await applyTar(s.build, tar([{ name: 'same', data: 's' }]))
    const first = await call(native.templateBuildPublish(starts[0].build, { info: '', layerKey: key(2) }))
    const second = await call(native.templateBuildPublish(starts[1].build, { info: '', layerKey: key(2) }))
    expect(first.existing).toBe(false)
    expect(second).toMatchObject({ id: first.id, existing: true })
    expect(published()).not.toContain(starts[1].id)
    expect(staging()).toEqual([])
  })

  test('removing a layer template drops its link; a sweep drops a link whose template is gone', async () => {
    const id = await layer('', [tar([{ name: 'f', data: 'f' }])], key(3))
    await call(native.removeTemplate(handle, id))
    expect(fs.existsSync(path.join(templatesDir(), 'layers', key(3)))).toBe(false)
    fs.symlinkSync('0'.repeat(32), path.join(templatesDir(), 'layers', key(4)))
    expect(await call(native.findLayer(handle, key(4)))).toBe(null)
    await call(native.sweep(handle, { dryRun: false, graceMs: 0 }))
    expect(fs.existsSync(path.join(templatesDir(), 'layers', key(4)))).toBe(false)
  })

  /** A node script that opens the pool with the addon as `n`, starts a build as `build`, then runs `body`. */
  function childScript(body: string): string {
    const addon = path.join(process.env.VMSPACE_PREBUILD!, 'build', 'Release', 'vmspace.node')
    return `
      const n = require(${JSON.stringify(addon)});
      (async () => {
        const { handle } = await n.openPool({ root: ${JSON.stringify(root)}, create: false, nonEmpty: false, projectIdFirst: 0, projectIdLast: 0 });
        const { build } = await n.templateBuildStart(handle, { parent: '' });
        ${body}
      })();`
  }

  test('the component walk (no openat2: VMSPACE_TEST_FALLBACK=openat2) resolves in root as openat2 does', async () => {
    const lower = tar([{ name: 'evil', type: 'symlink', linkname: '../..' }, { name: 'abs', type: 'symlink', linkname: '/sub' }, { name: 'sub', type: 'dir' }])
    const upper = tar([{ name: 'evil/etc/passwd', data: 'in' }, { name: 'abs/f', data: 'f' }, { name: 'h', type: 'link', linkname: 'evil/sub/f' }])
    const body = `
        const fs = require('fs');
        const apply = async (b, bytes) => {
          const [r, w] = n.pipe();
          const applied = n.layerApply(b, r, {});
          fs.writeSync(w, Buffer.from(bytes, 'base64'));
          fs.closeSync(w);
          await applied;
        };
        await apply(build, ${JSON.stringify(lower.toString('base64'))});
        const low = await n.templateBuildPublish(build, { info: '' });
        const up = await n.templateBuildStart(handle, { parent: low.id });
        await apply(up.build, ${JSON.stringify(upper.toString('base64'))});
        console.log((await n.templateBuildPublish(up.build, { info: '' })).id);`
    const r = spawnSync(process.execPath, ['-e', childScript(body)], { encoding: 'utf8', env: { ...process.env, VMSPACE_TEST_FALLBACK: 'openat2' } })
    expect(r.stderr).toBe('')
    const tree = path.join(templatesDir(), r.stdout.trim(), 'tree')
    expect(fs.readFileSync(path.join(tree, 'etc/passwd'), 'utf8')).toBe('in')
    expect(fs.readFileSync(path.join(tree, 'sub/f'), 'utf8')).toBe('f')
    expect(fs.statSync(path.join(tree, 'h')).ino).toBe(fs.statSync(path.join(tree, 'sub/f')).ino)
  })

  test('chown refused (EPERM: the import is not root) is ERR_OCI_NOT_PERMITTED naming the entry', async () => {
    const bytes = tar([{ name: 'owned', data: 'x', uid: 1000, gid: 1000 }])
    const body = `
        const [r, w] = n.pipe();
        const applied = n.layerApply(build, r, {}).then(() => ({}), (e) => e);
        require('fs').writeSync(w, Buffer.from(${JSON.stringify(bytes.toString('base64'))}, 'base64'));
        require('fs').closeSync(w);
        const e = await applied;
        await n.templateBuildAbandon(build);
        console.log(JSON.stringify({ code: e.code, errno: e.errno, syscall: e.syscall, path: e.path }));`
    const r = spawnSync('setpriv', ['--bounding-set', '-chown,-mknod', '--', process.execPath, '-e', childScript(body)], { encoding: 'utf8' })
    expect(r.stderr).toBe('')
    expect(JSON.parse(r.stdout)).toEqual({ code: 'ERR_OCI_NOT_PERMITTED', errno: -1, syscall: 'chown', path: 'owned' })
    expect(staging()).toEqual([])
  })

  test('four processes building one chain key at once all succeed with one template', async () => {
    const before = published()
    const bytes = tar([{ name: 'shared', data: 'one' }]).toString('base64')
    const body = `
        const [r, w] = n.pipe();
        const applied = n.layerApply(build, r, {});
        require('fs').writeSync(w, Buffer.from(${JSON.stringify(bytes)}, 'base64'));
        require('fs').closeSync(w);
        await applied;
        const p = await n.templateBuildPublish(build, { info: '', layerKey: ${JSON.stringify(key(5))} });
        console.log(JSON.stringify({ id: p.id, existing: p.existing }));`
    const runs = await Promise.all(
      [0, 1, 2, 3].map(
        () =>
          new Promise<{ id: string; existing: boolean }>((resolve, reject) => {
            const child = spawn(process.execPath, ['-e', childScript(body)], { stdio: ['ignore', 'pipe', 'inherit'] })
            let out = ''
            child.stdout.on('data', (d: Buffer) => (out += d.toString()))
            child.on('exit', (code) => (code === 0 ? resolve(JSON.parse(out) as { id: string; existing: boolean }) : reject(new Error(`exit ${code}`))))
          }),
      ),
    )
    const id = runs[0].id
    expect(runs.every((r) => r.id === id)).toBe(true)
    expect(runs.filter((r) => !r.existing).length).toBe(1)
    expect(await call(native.findLayer(handle, key(5)))).toBe(id)
    expect(fs.readFileSync(path.join(templatesDir(), id, 'tree', 'shared'), 'utf8')).toBe('one')
    expect(published().sort()).toEqual([...before, id].sort()) // the three losers removed their own
    expect(staging()).toEqual([])
  })

  test('a SIGKILLed build leaves only leased staging, which a sweep reclaims', async () => {
    const body = `
        const [r, w] = n.pipe();
        n.layerApply(build, r, {});
        require('fs').writeSync(w, Buffer.alloc(512, 1));
        console.log('applying');
        setInterval(() => {}, 1000);`
    const child = spawn(process.execPath, ['-e', childScript(body)], { stdio: ['ignore', 'pipe', 'inherit'] })
    await new Promise<void>((resolve) => child.stdout.on('data', (d: Buffer) => d.toString().includes('applying') && resolve()))
    expect(staging().length).toBe(1)
    const swept = await call(native.sweep(handle, { dryRun: false, graceMs: 0 }))
    expect(staging().length).toBe(1) // leased while the builder lives
    child.kill('SIGKILL')
    await new Promise((resolve) => child.on('exit', resolve))
    await call(native.sweep(handle, { dryRun: false, graceMs: 0 }))
    expect(staging()).toEqual([])
    // The sweep while the builder lived reclaimed nothing and failed nothing.
    expect(swept).toMatchObject({ reclaimed: [], failed: [] })
  })

  test('a bad layer key is ERR_INVALID_ARG_VALUE (the build stays); a second publish is EBADF', async () => {
    const { build } = await call(native.templateBuildStart(handle, { parent: '' }))
    await expect(call(native.templateBuildPublish(build, { info: '', layerKey: 'sha256:nothex' }))).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
    const { id } = await call(native.templateBuildPublish(build, { info: '' }))
    expect(published()).toContain(id)
    await expect(call(native.templateBuildPublish(build, { info: '' }))).rejects.toMatchObject({ code: 'EBADF' })
    const [readFd, writeFd] = native.pipe()
    await expect(call(native.layerApply(build, readFd, {}))).rejects.toMatchObject({ code: 'EBADF' })
    fs.closeSync(writeFd)
    await native.templateBuildAbandon(build)
    await expect(call(native.templateBuildStart(handle, { parent: 'no-such' }))).rejects.toMatchObject({ code: 'ERR_TEMPLATE_NOT_FOUND' })
    expect(staging()).toEqual([])
  })
})

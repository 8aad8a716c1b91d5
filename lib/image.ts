/**
 * Image-backed pools (DESIGN.md, "The image-backed pool"): a pool whose root is the mount of a btrfs made in a
 * sparse file on the host, attached through a loop device with direct I/O. For hosts whose own file system (ext4)
 * cannot share extents: inside the image every template clone is a reflink.
 *
 * The mechanism is util-linux's and btrfs-progs' tools (losetup, mount, umount, blkid, mkfs.btrfs), run with
 * execFile; the one call they lack (enabling simple quotas: btrfs-progs before 6.7 cannot) is an ioctl in the
 * addon. Everything is done under an flock on `<image>.lock`, and re-checked once it is held, so that concurrent
 * first calls of several processes make one image, one loop device and one mount.
 */
import { execFile } from 'node:child_process'
import * as crypto from 'node:crypto'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { absolutePath, integerIn, invalidType, invalidValue, optionsObject } from './args.js'
import { native } from './binding.js'
import { call, errnoError, vmspaceError } from './errors.js'
import { MOUNT_POINT_MARKER } from './layout.js'
import { lockFile } from './lock.js'
import { renameNoReplace } from './rename.js'
import type { ImageOptions } from './types.js'


/** The smallest image made: mkfs.btrfs refuses a device below ~109 MiB (btrfs-progs 6.2, DUP metadata). */
export const IMAGE_MIN_BYTES = 128 * 1024 * 1024

/** The label mkfs gives an image vmspace makes; an existing image without it is refused untouched. */
export const IMAGE_LABEL = 'vmspace'

/**
 * Mount options: discard=async gives freed extents back to the image file in the background (see DESIGN.md);
 * nodev: a device node a guest made in its workspace opens nothing (nosuid is left out: see docs/image-pool.md).
 */
const MOUNT_OPTIONS = 'discard=async,nodev'


/** A checked `options.image`. */
export interface Image {
  path: string
  /** Needed only to make the image. */
  size?: number
}

/** openPool's `image` option, checked strictly. */
export function imageOptions(value: unknown): Image | undefined {
  if (value === undefined) return undefined
  const o = optionsObject<ImageOptions>('options.image', value, { path: true, size: true })
  if (o.path === undefined) throw invalidType('options.image.path', 'a path string', undefined)
  const p = absolutePath('options.image.path', o.path)
  if (o.size === undefined) return { path: p }
  const size = integerIn('options.image.size', o.size, IMAGE_MIN_BYTES, Number.MAX_SAFE_INTEGER, 0)
  if (size % 4096 !== 0) throw invalidValue('options.image.size', `a multiple of 4096 from ${IMAGE_MIN_BYTES}`, size, true)
  return { path: p, size }
}

// ---- the tools ----

/** Where the tools live on Debian and friends: sbin, which a non-login shell's PATH may lack. */
const TOOL_PATH = [process.env.PATH ?? '', '/usr/local/sbin', '/usr/sbin', '/sbin'].filter(Boolean).join(':')

/** The package that brings each tool (Debian names). */
const PACKAGES: Record<string, string> = {
  'mkfs.btrfs': 'btrfs-progs',
  losetup: 'util-linux (Debian: mount)',
  mount: 'util-linux (Debian: mount)',
  umount: 'util-linux (Debian: mount)',
  blkid: 'util-linux',
  mke2fs: 'e2fsprogs',
}

interface ToolResult {
  status: number
  stdout: string
  stderr: string
}

/** Runs `tool`; a missing tool is ERR_IMAGE_TOOL_MISSING naming its package. Never throws for an exit status. */
function run(tool: string, args: string[], signal?: AbortSignal): Promise<ToolResult> {
  return new Promise((resolve, reject) => {
    execFile(tool, args, { env: { ...process.env, PATH: TOOL_PATH, LC_ALL: 'C' }, encoding: 'utf8', signal }, (err, stdout, stderr) => {
      const code = (err as NodeJS.ErrnoException | null)?.code
      if (code === 'ENOENT')
        return reject(vmspaceError('ERR_IMAGE_TOOL_MISSING', `${tool} is not installed (package ${PACKAGES[tool] ?? tool})`, { cause: err }))
      if (err && typeof code !== 'number') return reject(err)
      resolve({ status: typeof code === 'number' ? code : 0, stdout, stderr })
    })
  })
}

/** Runs `tool` and fails with ERR_IMAGE_TOOL_FAILED (its stderr's first line) unless it exits 0. */
export async function runOk(tool: string, args: string[], p: string, signal?: AbortSignal): Promise<string> {
  const r = await run(tool, args, signal)
  if (r.status !== 0) {
    const why = (r.stderr || r.stdout).trim().split('\n')[0] || `exit status ${r.status}`
    throw vmspaceError('ERR_IMAGE_TOOL_FAILED', `${tool} ${args.join(' ')}: ${why}`, { path: p })
  }
  return r.stdout
}

// ---- what the kernel has ----

/** Decodes the octal escapes (`\040` for a space) of /proc/self/mountinfo fields. */
const unescape = (s: string) => s.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)))

/** The topmost mount at exactly `dir`: its source and file-system type, or undefined. */
export function mountAt(dir: string): { source: string; fsType: string; majMin: string } | undefined {
  let found: { source: string; fsType: string; majMin: string } | undefined
  for (const line of fs.readFileSync('/proc/self/mountinfo', 'utf8').split('\n')) {
    const [left, right] = line.split(' - ')
    if (!right) continue
    const f = left.split(' ')
    // Later lines are mounted later: the last one at `dir` is what a path lookup sees.
    if (unescape(f[4]) === dir) found = { majMin: f[2], fsType: right.split(' ')[0], source: unescape(right.split(' ')[1] ?? '') }
  }
  return found
}

/** The mount points of the block device `source` (/dev/loopN), in mount order. */
function mountPointsOf(source: string): string[] {
  const points: string[] = []
  for (const line of fs.readFileSync('/proc/self/mountinfo', 'utf8').split('\n')) {
    const [left, right] = line.split(' - ')
    if (right && unescape(right.split(' ')[1] ?? '') === source) points.push(unescape(left.split(' ')[4]))
  }
  return points
}

interface LoopDevice {
  name: string
  backFile: string
  backIno: number
  backMajMin: string
  dio: boolean
}

/** The attached loop devices (`losetup --list --json`). */
async function loopDevices(): Promise<LoopDevice[]> {
  const out = await runOk('losetup', ['--list', '--json', '--output', 'NAME,BACK-FILE,BACK-INO,BACK-MAJ:MIN,DIO'], '/dev/loop-control')
  if (!out.trim()) return []
  const list = (JSON.parse(out) as { loopdevices: Record<string, unknown>[] }).loopdevices
  return list.map((d) => ({
    name: String(d.name),
    backFile: String(d['back-file'] ?? ''),
    backIno: Number(d['back-ino']),
    backMajMin: String(d['back-maj:min'] ?? '').trim(),
    dio: d.dio === true || d.dio === '1',
  }))
}

/** The loop devices whose backing file is the file `st` (by device and inode: a name can be replaced). */
async function loopsOf(st: fs.BigIntStats): Promise<LoopDevice[]> {
  // gnu_dev_major/minor of st_dev, as losetup prints BACK-MAJ:MIN.
  const majMin = `${((st.dev >> 8n) & 0xfffn) | ((st.dev >> 32n) & 0xfffff000n)}:${(st.dev & 0xffn) | ((st.dev >> 12n) & 0xffffff00n)}`
  return (await loopDevices()).filter((d) => d.backIno === Number(st.ino) && d.backMajMin === majMin)
}

/** The process has CAP_SYS_ADMIN (losetup and mount need it). */
function hasCapSysAdmin(): boolean {
  const m = /^CapEff:\s*([0-9a-f]+)$/m.exec(fs.readFileSync('/proc/self/status', 'utf8'))
  return m !== null && ((BigInt(`0x${m[1]}`) >> 21n) & 1n) === 1n
}

/** What `blkid` finds in the file at `p`: TYPE and LABEL (empty when it finds no file system). */
async function probeImage(p: string): Promise<{ type: string; label: string }> {
  const r = await run('blkid', ['-p', '-o', 'export', p])
  // Exit 2: nothing recognised.
  if (r.status === 2) return { type: '', label: '' }
  if (r.status !== 0) throw vmspaceError('ERR_IMAGE_TOOL_FAILED', `blkid -p ${p}: ${r.stderr.trim() || `exit status ${r.status}`}`, { path: p })
  const field = (k: string) => new RegExp(`^${k}=(.*)$`, 'm').exec(r.stdout)?.[1] ?? ''
  return { type: field('TYPE'), label: field('LABEL') }
}

function statOrUndefined(p: string): fs.BigIntStats | undefined {
  try {
    return fs.statSync(p, { bigint: true })
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return undefined
    throw e
  }
}

// ---- attach ----

/** What one attach made, undone in reverse order when a later step fails. */
class Made {
  /** The image being made under a temporary name, until it is complete and renamed to its own. */
  making: string | undefined
  image = false
  lock = false
  loop: string | undefined
  /** The first directory made on the way to the mount point (its parents included), empty but for those. */
  dir: string | undefined
  marker = false
  mount = false

  /** Each step only when the one before it worked: a mount left in place keeps its directory and image. */
  async undo(root: string, image: string): Promise<void> {
    if (this.mount && (await run('umount', [root])).status !== 0) return
    if (this.loop && (await run('losetup', ['--detach', this.loop])).status !== 0) return
    if (this.marker) fs.rmSync(path.join(root, MOUNT_POINT_MARKER), { force: true })
    if (this.dir) removeEmptyDirs(this.dir, root)
    if (this.making) fs.rmSync(this.making, { force: true })
    if (this.image) fs.rmSync(image, { force: true })
    if (this.lock) fs.rmSync(`${image}.lock`, { force: true })
  }
}

/** rmdir of `root` and its parents up to `top`: only empty directories go (rmdir refuses any other). */
function removeEmptyDirs(top: string, root: string): void {
  for (let d = root; ; d = path.dirname(d)) {
    fs.rmdirSync(d)
    if (d === top || d === path.dirname(d)) return
  }
}

// One attach at a time per image within this process: flock would refuse a second one as reentrant.
const inProcess = new Map<string, Promise<unknown>>()

/**
 * Runs `open` with `root` the mount of `image`, made first where it is not: the image file (sparse, btrfs labelled
 * `vmspace`, simple quotas or else qgroups enabled), a loop device with direct I/O, the mount. Under the image's
 * lock throughout, including `open`; when `open` fails, what this call made is undone.
 * Throws `ERR_IMAGE_NOT_PERMITTED` (cause EPERM: no CAP_SYS_ADMIN), `ERR_IMAGE_TOOL_MISSING` (naming the package),
 * `ERR_IMAGE_FOREIGN` (an existing file that is not a vmspace image), `ERR_IMAGE_ROOT_MOUNTED` (root is the mount
 * of something else), `ERR_IMAGE_IN_USE` (the image is mounted at another path), `ENOSPC` (syscall statfs: the host cannot hold `size`), `ERR_POOL_NOT_EMPTY` (root holds
 * entries that the mount would hide), `ERR_IMAGE_TOOL_FAILED`, `ENOENT` (the image's directory, or the image
 * with `create: false`), `ERR_INVALID_ARG_TYPE` (the image is missing and no `size` was given), or what `open`
 * throws. Nothing made is left on failure.
 */
export async function withImage<T>(root: string, image: Image, create: boolean, open: () => Promise<T>): Promise<T> {
  if (!hasCapSysAdmin())
    throw vmspaceError('ERR_IMAGE_NOT_PERMITTED', 'an image-backed pool needs root (CAP_SYS_ADMIN) to attach a loop device and mount it', {
      path: image.path,
      cause: errnoError(os.constants.errno.EPERM, 'mount', root),
    })
  const key = image.path
  const before = inProcess.get(key) ?? Promise.resolve()
  const mine = before.catch(() => {}).then(() => attachLocked(root, image, create, open))
  inProcess.set(key, mine)
  try {
    return await mine
  } finally {
    if (inProcess.get(key) === mine) inProcess.delete(key)
  }
}

async function attachLocked<T>(root: string, image: Image, create: boolean, open: () => Promise<T>): Promise<T> {
  const dir = path.dirname(image.path)
  if (!statOrUndefined(dir)?.isDirectory()) throw errnoError(os.constants.errno.ENOENT, 'open', dir)
  const made = new Made()
  made.lock = !fs.existsSync(`${image.path}.lock`)
  const lock = await lockFile(`${image.path}.lock`)
  try {
    removeStaleMaking(image.path)
    try {
      await ensureMounted(root, image, create, made)
      return await open()
    } catch (e) {
      await made.undo(root, image.path)
      throw e
    }
  } finally {
    await lock.release()
  }
}

/** Makes `root` the mount of `image` (see withImage), recording in `made` what it made. */
async function ensureMounted(root: string, image: Image, create: boolean, made: Made): Promise<void> {
  let st = statOrUndefined(image.path)
  // mountinfo names mount points by their real path.
  const mounted = mountAt(statOrUndefined(root) ? fs.realpathSync(root) : root)
  if (mounted) {
    if (st && (await isMountOf(mounted, st))) return
    throw vmspaceError('ERR_IMAGE_ROOT_MOUNTED', `${root} is already the mount of ${mounted.source} (${mounted.fsType}), not of ${image.path}`, { path: root })
  }
  if (st) await checkOurs(image.path, st)
  else {
    if (!create) throw errnoError(os.constants.errno.ENOENT, 'open', image.path)
    // Checked here, not with the options: an existing image needs no size.
    if (image.size === undefined)
      throw invalidType('options.image.size', `an integer (${image.path} does not exist: its size is needed to make it)`, undefined)
    await makeImage({ path: image.path, size: image.size }, made)
    st = fs.statSync(image.path, { bigint: true })
  }
  checkRoot(root, image.path, create, made)
  made.marker = markMountPoint(root, image.path)
  let loop = (await loopsOf(st))[0]?.name
  const elsewhere = loop === undefined ? undefined : mountPointsOf(loop)[0]
  // Two mounts of one image would be one pool under two roots: workspace paths, and what a sweep or an unmount at
  // either means, would depend on which root a caller happened to use.
  if (elsewhere !== undefined)
    throw vmspaceError('ERR_IMAGE_IN_USE', `${image.path} is already mounted at ${elsewhere} (through ${loop}); open the pool there`, { path: image.path })
  if (!loop) {
    loop = (await runOk('losetup', ['--direct-io=on', '--find', '--show', image.path], image.path)).trim()
    made.loop = loop
  }
  await runOk('mount', ['-t', 'btrfs', '-o', MOUNT_OPTIONS, loop, root], root)
  made.mount = true
  // At every mount, not only the first: a first call killed between mkfs and here left an image without quotas
  // (enabling them where they are on is a no-op: fs/btrfs/qgroup.c, btrfs_quota_enable).
  await enableQuota(root)
  // The file system's root is the pool's root: 0755 as openPool makes it.
  if (made.image) fs.chmodSync(root, 0o755)
}

/** The temporary name an image is made under: `<image>.making-<hex>`, renamed to `<image>` once mkfs is done. */
const makingPrefix = (imagePath: string) => `${path.basename(imagePath)}.making-`

/**
 * Removes what a call killed while making this image left (`<image>.making-<hex>`): under the image's lock no
 * other call is making one, so any such file is a dead call's.
 */
function removeStaleMaking(imagePath: string): void {
  const prefix = makingPrefix(imagePath)
  for (const name of fs.readdirSync(path.dirname(imagePath))) {
    if (name.startsWith(prefix) && /^[0-9a-f]{16}$/.test(name.slice(prefix.length)))
      fs.rmSync(path.join(path.dirname(imagePath), name), { force: true })
  }
}

/** Whether `m` (the mount at root) is the image `st` through a loop device. */
async function isMountOf(m: { source: string; majMin: string }, st: fs.BigIntStats): Promise<boolean> {
  const loops = await loopsOf(st)
  return loops.some((l) => l.name === m.source)
}

/** An existing file at the image path must be a btrfs that vmspace made (label `vmspace`); else refused. */
async function checkOurs(p: string, st: fs.BigIntStats): Promise<void> {
  if (!st.isFile()) throw vmspaceError('ERR_IMAGE_FOREIGN', `${p} exists and is not a regular file`, { path: p })
  const { type, label } = await probeImage(p)
  if (type !== 'btrfs' || label !== IMAGE_LABEL)
    throw vmspaceError(
      'ERR_IMAGE_FOREIGN',
      `${p} exists and is not a file system image vmspace made (${type ? `${type}, label ${JSON.stringify(label)}` : 'no file system found'}): left untouched`,
      { path: p },
    )
}

/** The sparse file and its btrfs, after the host's free space was checked. */
async function makeImage(image: Required<Image>, made: Made): Promise<void> {
  const sfs = fs.statfsSync(path.dirname(image.path), { bigint: true })
  const available = sfs.bavail * sfs.bsize
  if (available < BigInt(image.size)) {
    const e = errnoError(os.constants.errno.ENOSPC, 'statfs', path.dirname(image.path))
    e.message += ` (an image of ${image.size} bytes; ${available} available)`
    throw e
  }
  // Made whole under a temporary name, then renamed to its own: a call killed on the way leaves no image without a
  // file system at the image path (which every later call would refuse as foreign), only a temporary file that
  // the next call removes.
  const making = path.join(path.dirname(image.path), makingPrefix(image.path) + crypto.randomBytes(8).toString('hex'))
  const fd = fs.openSync(making, fs.constants.O_WRONLY | fs.constants.O_CREAT | fs.constants.O_EXCL | fs.constants.O_NOFOLLOW, 0o600)
  made.making = making
  try {
    fs.ftruncateSync(fd, image.size)
  } finally {
    fs.closeSync(fd)
  }
  await runOk('mkfs.btrfs', ['-q', '-L', IMAGE_LABEL, making], image.path)
  await renameNoReplace(making, image.path)
  made.making = undefined
  made.image = true
}

/**
 * The mount point: made when missing (with `create`), else an empty directory (a mount would hide entries) but for
 * this image's marker.
 */
function checkRoot(root: string, imagePath: string, create: boolean, made: Made): void {
  const st = statOrUndefined(root)
  if (!st) {
    if (!create) throw errnoError(os.constants.errno.ENOENT, 'open', root)
    made.dir = fs.mkdirSync(root, { recursive: true, mode: 0o755 })
    return
  }
  if (!st.isDirectory()) throw errnoError(os.constants.errno.ENOTDIR, 'open', root)
  const entries = fs.readdirSync(root)
  const marked = entries.length === 1 && entries[0] === MOUNT_POINT_MARKER && markedImage(root) === imagePath
  if (entries.length > 0 && !marked)
    throw vmspaceError('ERR_POOL_NOT_EMPTY', `${root} holds entries that mounting the image there would hide`, { path: root })
}

/** The image the marker in the mount point `root` names, or undefined where there is none (ENOENT, ENOTDIR). */
export function markedImage(root: string): string | undefined {
  let fd: number
  try {
    fd = fs.openSync(path.join(root, MOUNT_POINT_MARKER), fs.constants.O_RDONLY | fs.constants.O_NOFOLLOW)
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code
    if (code === 'ENOENT' || code === 'ENOTDIR') return undefined
    throw e
  }
  try {
    return fs.readFileSync(fd, 'utf8').replace(/\n$/, '')
  } finally {
    fs.closeSync(fd)
  }
}

/** Writes the marker naming `imagePath` into the (unmounted, empty) mount point; false when it was there already. */
function markMountPoint(root: string, imagePath: string): boolean {
  if (markedImage(root) !== undefined) return false
  const fd = fs.openSync(path.join(root, MOUNT_POINT_MARKER), fs.constants.O_WRONLY | fs.constants.O_CREAT | fs.constants.O_EXCL | fs.constants.O_NOFOLLOW, 0o444)
  try {
    fs.writeFileSync(fd, `${imagePath}\n`)
  } finally {
    fs.closeSync(fd)
  }
  return true
}

/**
 * Simple quotas where the kernel has them (Linux 6.7), else qgroups: a quota'd workspace is a subvolume, and
 * btrfs advises simple quotas under frequent subvolume create/delete (no backref walk at each commit).
 */
async function enableQuota(root: string): Promise<void> {
  let err = await call(native.enableBtrfsQuota(root, true))
  if (err === os.constants.errno.EINVAL) err = await call(native.enableBtrfsQuota(root, false))
  if (err !== 0) throw errnoError(err, 'ioctl(BTRFS_IOC_QUOTA_CTL)', root)
}

// ---- detach ----

/**
 * Unmounts the image-backed pool at `root` and detaches its loop device (the image file is kept). Close the
 * pool's handles first. Throws `ERR_IMAGE_NOT_MOUNTED` when `root` is not the mount of a vmspace image through a
 * loop device, `ERR_IMAGE_NOT_PERMITTED`, or `ERR_IMAGE_TOOL_FAILED` (umount's `target is busy` while in use).
 * Resolves to the image file's path.
 */
export async function unmountImage(rootArg: string): Promise<string> {
  const root = absolutePath('root', rootArg)
  if (!hasCapSysAdmin())
    throw vmspaceError('ERR_IMAGE_NOT_PERMITTED', 'unmounting needs root (CAP_SYS_ADMIN)', { path: root, cause: errnoError(os.constants.errno.EPERM, 'umount', root) })
  // mountinfo names mount points by their real path.
  const m = mountAt(statOrUndefined(root) ? fs.realpathSync(root) : root)
  const loop = m && (await loopDevices()).find((l) => l.name === m.source)
  if (!m || !loop || (await probeImage(loop.name)).label !== IMAGE_LABEL)
    throw vmspaceError('ERR_IMAGE_NOT_MOUNTED', `${root} is not the mount of a vmspace image`, { path: root })
  const lock = await lockFile(`${loop.backFile}.lock`)
  try {
    await runOk('umount', [root], root)
    // Another mount of the same device (a second mount point) keeps the loop device busy: leave it then.
    if (mountPointsOf(loop.name).length === 0) await runOk('losetup', ['--detach', loop.name], loop.name)
    // A mount point made before the marker existed gets it now: the pool must not be opened without its image.
    markMountPoint(root, loop.backFile)
  } finally {
    await lock.release()
  }
  return loop.backFile
}

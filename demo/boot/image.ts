/**
 * The guest's two images, built once and cached in the OS temp directory under a name that hashes everything
 * that went into them (so a changed kernel, busybox or init script gets a new image, never a stale one):
 *
 * - the base root file system: a 64 MiB ext4 made with `mke2fs -d` from busybox-static and an /init that records
 *   the VM's id and token (from the kernel command line) in /vmspace/token, syncs, remounts its root read-only
 *   (so the journal is clean for e2fsck) and powers off;
 * - a small initramfs (busybox + the kernel's virtio and ext4 modules from linux-image-amd64) that mounts
 *   /dev/vda read-write and switches to it. Debian's own initrd boots too, but its 30 MiB take seconds longer to
 *   unpack under TCG.
 */
import { spawn } from 'node:child_process'
import { createHash, randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as fsp from 'node:fs/promises'
import * as os from 'node:os'
import * as path from 'node:path'
import { renameNoReplace } from 'vmspace'
import { runOk, type BootTools } from './tools.js'

/** Size of the base root file system (bytes). */
export const ROOTFS_BYTES = 64 * 1024 * 1024

/** Bump when the layout of either image changes in a way the hashed inputs do not show. */
const FORMAT = 1

/** Where the guest writes its record, and the marker before the token (never spelled out in the init script). */
export const TOKEN_FILE = '/vmspace/token'
export const TOKEN_MARKER = 'vmspace-token:'

/**
 * The guest's /init. Busybox applets are called through the binary (no symlinks needed), at `busybox`: the base's
 * /bin/busybox, or the copy the initramfs puts into an imported image (which need not have one). The marker is built
 * with printf so that the base image never holds the literal TOKEN_MARKER: a scan of a clone for the marker finds
 * only tokens that a guest wrote.
 */
function guestInit(busybox: string): string {
  return `#!${busybox} sh
# vmspace boot demo guest: record the id and token the host passed, then power off.
B=${busybox}
$B mkdir -p /proc /vmspace
$B mount -t proc proc /proc
$B mount -o remount,rw / || { echo "vmspace-guest: cannot mount / read-write"; $B poweroff -f; }
id=; tok=
for w in $($B cat /proc/cmdline); do
  case "$w" in
    vmspace.id=*) id=\${w#vmspace.id=} ;;
    vmspace.token=*) tok=\${w#vmspace.token=} ;;
  esac
done
$B printf 'vmspace-%s:%s id=%s\\n' token "$tok" "$id" > /vmspace/token
$B sync
# Read-only before power-off: the journal is checkpointed and the file system marked clean (mount reads
# /proc/mounts, so /proc stays mounted).
$B mount -o remount,ro / || echo "vmspace-guest: cannot remount / read-only"
echo "vmspace-guest: $id wrote its token"
$B poweroff -f
`
}

const GUEST_INIT = guestInit('/bin/busybox')
/** Where the initramfs puts its busybox and the guest's init in an imported image (kernel argument IMAGE_INIT_ARG). */
const IMAGE_GUEST_DIR = '/.vmspace-guest'
/** The kernel argument that makes the initramfs run the demo's guest init from IMAGE_GUEST_DIR (an imported image). */
export const IMAGE_INIT_ARG = 'vmspace.init=initramfs'

/** Modules the initramfs loads (with their dependencies): the disk, its bus, the file system and its checksum. */
const GUEST_MODULES = ['virtio_pci', 'virtio_blk', 'crc32c_generic', 'ext4']

function initramfsInit(modules: string[]): string {
  return `#!/bin/busybox sh
# vmspace boot demo initramfs: load virtio and ext4, mount /dev/vda read-write, switch to it. With
# vmspace.init=initramfs (an imported image, which has no init of the demo's) its own busybox and the guest's init
# are copied into the root first and that init is run.
B=/bin/busybox
$B mount -t proc proc /proc
init=/init
for w in $($B cat /proc/cmdline); do [ "$w" = ${IMAGE_INIT_ARG} ] && init=${IMAGE_GUEST_DIR}/init; done
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
for m in ${modules.join(' ')}; do
  $B insmod /lib/modules/$m.ko || echo "vmspace-initramfs: insmod $m failed"
done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 300 ]; do $B sleep 0.1; i=$((i+1)); done
$B mount -t ext4 -o rw /dev/vda /newroot || { echo "vmspace-initramfs: cannot mount /dev/vda"; $B poweroff -f; }
if [ "$init" != /init ]; then
  $B mkdir -p /newroot${IMAGE_GUEST_DIR} /newroot/dev
  $B cp /bin/busybox /guest-init /newroot${IMAGE_GUEST_DIR}/ && $B mv /newroot${IMAGE_GUEST_DIR}/guest-init /newroot$init
fi
$B umount /sys
$B umount /proc
$B mount --move /dev /newroot/dev
exec $B switch_root /newroot $init
`
}

export interface GuestImages {
  /** The cached base root file system (mode 0444; clone it, never write it). */
  rootfs: string
  /** The cached initramfs (newc cpio). */
  initramfs: string
  kernel: string
  /** Whether this call built them (false: both came from the cache). */
  built: boolean
}

/** Returns the cached guest images, building what is missing. `cacheDir` defaults to os.tmpdir(). */
export async function guestImages(tools: BootTools, cacheDir = os.tmpdir(), log: (s: string) => void = () => {}): Promise<GuestImages> {
  const modules = resolveModules(tools.kernel.modules, GUEST_MODULES)
  const busyboxHash = sha256(fs.readFileSync(tools.busybox))
  const modulesHash = sha256(Buffer.concat(modules.map((m) => fs.readFileSync(m.file))))
  const initramfsKey = sha256(`${FORMAT}\n${busyboxHash}\n${modulesHash}\n${initramfsInit(modules.map((m) => m.name))}\n${guestInit(`${IMAGE_GUEST_DIR}/busybox`)}`).slice(0, 16)
  const rootfsKey = sha256(`${FORMAT}\n${busyboxHash}\n${ROOTFS_BYTES}\n${GUEST_INIT}`).slice(0, 16)
  const initramfs = path.join(cacheDir, `vmspace-boot-initramfs-${tools.kernel.release}-${initramfsKey}.cpio`)
  const rootfs = path.join(cacheDir, `vmspace-boot-rootfs-${rootfsKey}.ext4`)
  let built = false
  if (!fs.existsSync(initramfs)) {
    log(`building the guest initramfs once: busybox + ${modules.map((m) => m.name).join(', ')} -> ${initramfs}`)
    await buildCached(initramfs, (stage, out) => buildInitramfs(tools, modules, stage, out))
    built = true
  }
  if (!fs.existsSync(rootfs)) {
    log(`building the guest base image once: mke2fs -d (busybox-static + /init) -> ${rootfs}`)
    await buildCached(rootfs, (stage, out) => buildRootfs(tools, stage, out))
    built = true
  }
  return { rootfs, initramfs, kernel: tools.kernel.image, built }
}

/**
 * Builds `final` through `build(stageDir, tmpFile)` and publishes it with renameNoReplace, so a reader never sees
 * a half-written image; when a concurrent run published it first (EEXIST), that one is used.
 */
async function buildCached(final: string, build: (stage: string, tmp: string) => Promise<void>): Promise<void> {
  const stage = await fsp.mkdtemp(path.join(path.dirname(final), 'vmspace-boot-stage-'))
  const tmp = `${final}.tmp-${process.pid}-${randomBytes(4).toString('hex')}`
  try {
    await build(stage, tmp)
    await fsp.chmod(tmp, 0o444)
    try {
      await renameNoReplace(tmp, final)
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== 'EEXIST') throw e
    }
  } finally {
    await fsp.rm(stage, { recursive: true, force: true })
    await fsp.rm(tmp, { force: true })
  }
}

async function buildRootfs(tools: BootTools, stage: string, out: string): Promise<void> {
  for (const d of ['bin', 'proc', 'sys', 'dev', 'run', 'tmp', 'vmspace']) await fsp.mkdir(path.join(stage, d))
  await fsp.copyFile(tools.busybox, path.join(stage, 'bin', 'busybox'))
  await fsp.chmod(path.join(stage, 'bin', 'busybox'), 0o755)
  await fsp.writeFile(path.join(stage, 'init'), GUEST_INIT, { mode: 0o755 })
  await runOk(tools.mke2fs, ['-q', '-F', '-t', 'ext4', '-L', 'vmspace-guest', '-d', stage, out, `${ROOTFS_BYTES / 1024}k`])
}

async function buildInitramfs(tools: BootTools, modules: KernelModule[], stage: string, out: string): Promise<void> {
  for (const d of ['bin', 'proc', 'sys', 'dev', 'newroot', 'lib/modules']) await fsp.mkdir(path.join(stage, d), { recursive: true })
  await fsp.copyFile(tools.busybox, path.join(stage, 'bin', 'busybox'))
  await fsp.chmod(path.join(stage, 'bin', 'busybox'), 0o755)
  for (const m of modules) await fsp.writeFile(path.join(stage, 'lib/modules', `${m.name}.ko`), await moduleBytes(m.file))
  await fsp.writeFile(path.join(stage, 'init'), initramfsInit(modules.map((m) => m.name)), { mode: 0o755 })
  await fsp.writeFile(path.join(stage, 'guest-init'), guestInit(`${IMAGE_GUEST_DIR}/busybox`), { mode: 0o755 })
  const entries = ['.', ...(await fsp.readdir(stage, { recursive: true })).map(String).sort()]
  const cpio = await runBytes(tools.cpio, ['-o', '-H', 'newc', '--quiet', '--reproducible'], entries.join('\n') + '\n', stage)
  await fsp.writeFile(out, cpio)
}

/** cpio's archive on stdout is binary: collected as bytes, not text. */
async function runBytes(cmd: string, args: string[], input: string, cwd: string): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const child = spawn(cmd, args, { cwd, stdio: ['pipe', 'pipe', 'pipe'] })
    const out: Buffer[] = []
    let err = ''
    child.stdout.on('data', (b: Buffer) => out.push(b))
    child.stderr.on('data', (b: Buffer) => (err += b.toString()))
    child.on('error', reject)
    child.on('close', (code) =>
      code === 0 ? resolve(Buffer.concat(out)) : reject(new Error(`${cmd} ${args.join(' ')} failed (exit ${code}): ${err.trim()}`)),
    )
    child.stdin.on('error', () => {})
    child.stdin.end(input)
  })
}

export interface KernelModule {
  name: string
  file: string
}

/**
 * `wanted` and their dependencies from modules.dep, dependencies first (the order insmod needs); modules built
 * into the kernel (modules.builtin) are left out.
 */
export function resolveModules(modulesDir: string, wanted: string[]): KernelModule[] {
  const deps = new Map<string, string[]>()
  const byName = new Map<string, string>()
  const nameOf = (rel: string) => path.basename(rel).replace(/\.ko(\.(xz|zst|gz))?$/, '').replace(/-/g, '_')
  for (const line of fs.readFileSync(path.join(modulesDir, 'modules.dep'), 'utf8').split('\n')) {
    const colon = line.indexOf(':')
    if (colon < 0) continue
    const rel = line.slice(0, colon)
    byName.set(nameOf(rel), rel)
    deps.set(rel, line.slice(colon + 1).trim().split(/\s+/).filter(Boolean))
  }
  let builtin = new Set<string>()
  try {
    builtin = new Set(fs.readFileSync(path.join(modulesDir, 'modules.builtin'), 'utf8').split('\n').filter(Boolean).map(nameOf))
  } catch {
    // no modules.builtin: treat every module as loadable
  }
  const order: KernelModule[] = []
  const seen = new Set<string>()
  const visit = (rel: string) => {
    if (seen.has(rel)) return
    seen.add(rel)
    for (const d of deps.get(rel) ?? []) visit(d)
    order.push({ name: nameOf(rel), file: path.join(modulesDir, rel) })
  }
  for (const name of wanted) {
    const rel = byName.get(name)
    if (rel) visit(rel)
    else if (!builtin.has(name)) throw new Error(`kernel module ${name} is neither in ${modulesDir}/modules.dep nor built in`)
  }
  return order
}

/** A module's ELF bytes; compressed modules (Debian 13 ships .ko.xz) are unpacked on the host. */
async function moduleBytes(file: string): Promise<Buffer> {
  if (file.endsWith('.ko')) return fsp.readFile(file)
  const tool = file.endsWith('.xz') ? 'xz' : file.endsWith('.zst') ? 'zstd' : 'gzip'
  return runBytes(tool, ['-dc', file], '', path.dirname(file))
}

export function sha256(data: string | Buffer): string {
  return createHash('sha256').update(data).digest('hex')
}

/** sha256 of a file, streamed. */
export async function sha256File(file: string): Promise<string> {
  const h = createHash('sha256')
  for await (const chunk of fs.createReadStream(file)) h.update(chunk as Buffer)
  return h.digest('hex')
}

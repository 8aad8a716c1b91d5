/**
 * What booting real guests needs on the host, found once: executables (with the Debian package that provides
 * each), the guest kernel and its modules, and a static busybox. Nothing here changes the machine: a missing piece
 * is a BootUnavailableError naming the package to install.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { which as whichOf } from '../util.js'

export { run, runOk, type CommandResult } from '../util.js'

/** The packages the boot demo needs, as `apt-get install --no-install-recommends` takes them (Debian 12). */
export const BOOT_PACKAGES = ['qemu-system-x86', 'linux-image-amd64', 'busybox-static', 'e2fsprogs', 'cpio'] as const

/** Thrown when this machine cannot boot guests; `message` says exactly what to install. */
export class BootUnavailableError extends Error {
  readonly code = 'ERR_BOOT_UNAVAILABLE'
  constructor(message: string) {
    super(message)
    this.name = 'BootUnavailableError'
  }
}

export interface BootTools {
  qemu: string
  mke2fs: string
  e2fsck: string
  debugfs: string
  filefrag: string
  cpio: string
  /** A statically linked busybox: it runs in the guest, which has no C library. */
  busybox: string
  kernel: GuestKernel
}

export interface GuestKernel {
  /** `uname -r` of the guest kernel, e.g. `6.1.0-57-amd64`. */
  release: string
  /** /boot/vmlinuz-<release>. */
  image: string
  /** /lib/modules/<release>. */
  modules: string
}

// sbin is missing from a non-login root shell's PATH on Debian; mke2fs and e2fsck live there.
const EXTRA_DIRS = ['/usr/sbin', '/sbin', '/usr/local/sbin', '/usr/bin', '/bin']

/** The first executable named `name` on PATH or in sbin, or undefined. */
export function which(name: string): string | undefined {
  return whichOf([name], EXTRA_DIRS)
}

/**
 * Whether an ELF executable has no program interpreter (PT_INTERP), i.e. is statically linked. Reads the 64-bit
 * ELF header and program headers (elf(5)); anything else counts as not static.
 */
export function isStaticElf(file: string): boolean {
  let buf: Buffer
  try {
    const fd = fs.openSync(file, 'r')
    try {
      buf = Buffer.alloc(64 * 1024)
      buf = buf.subarray(0, fs.readSync(fd, buf, 0, buf.length, 0))
    } finally {
      fs.closeSync(fd)
    }
  } catch {
    return false
  }
  if (buf.length < 64 || buf.readUInt32BE(0) !== 0x7f454c46 || buf[4] !== 2 || buf[5] !== 1) return false
  const phoff = Number(buf.readBigUInt64LE(0x20))
  const phentsize = buf.readUInt16LE(0x36)
  const phnum = buf.readUInt16LE(0x38)
  if (phentsize < 4 || phoff + phentsize * phnum > buf.length) return false
  for (let i = 0; i < phnum; i++) if (buf.readUInt32LE(phoff + i * phentsize) === 3 /* PT_INTERP */) return false
  return true
}

/** Compares kernel releases by their numeric parts (6.1.0-57 > 6.1.0-9). */
function compareReleases(a: string, b: string): number {
  const pa = a.split(/[^0-9]+/).filter(Boolean).map(Number)
  const pb = b.split(/[^0-9]+/).filter(Boolean).map(Number)
  for (let i = 0; i < Math.max(pa.length, pb.length); i++) {
    const d = (pa[i] ?? -1) - (pb[i] ?? -1)
    if (d !== 0) return d
  }
  return a.localeCompare(b)
}

/** The newest /boot/vmlinuz-<release> that is readable and has /lib/modules/<release>/modules.dep. */
export function findGuestKernel(): GuestKernel | undefined {
  let names: string[]
  try {
    names = fs.readdirSync('/boot')
  } catch {
    return undefined
  }
  const releases = names
    .filter((n) => n.startsWith('vmlinuz-'))
    .map((n) => n.slice('vmlinuz-'.length))
    .sort(compareReleases)
    .reverse()
  for (const release of releases) {
    const image = path.join('/boot', `vmlinuz-${release}`)
    const modules = path.join('/lib/modules', release)
    try {
      fs.accessSync(image, fs.constants.R_OK)
      fs.accessSync(path.join(modules, 'modules.dep'), fs.constants.R_OK)
      return { release, image, modules }
    } catch {
      // a kernel without its modules (or unreadable): the guest could not load virtio and ext4
    }
  }
  return undefined
}

/** Finds everything booting needs; throws BootUnavailableError listing every missing piece and its package. */
export function findBootTools(): BootTools {
  const missing: string[] = []
  const need = (name: string, pkg: string): string => {
    const p = which(name)
    if (!p) missing.push(`${name} (package ${pkg})`)
    return p ?? ''
  }
  const qemu = need('qemu-system-x86_64', 'qemu-system-x86')
  const mke2fs = need('mke2fs', 'e2fsprogs')
  const e2fsck = need('e2fsck', 'e2fsprogs')
  const debugfs = need('debugfs', 'e2fsprogs')
  const filefrag = need('filefrag', 'e2fsprogs')
  const cpio = need('cpio', 'cpio')
  // busybox-static installs /bin/busybox; the dynamic `busybox` package installs the same path, useless in a guest.
  const busybox = ['/bin/busybox', '/usr/bin/busybox', which('busybox')].find((p) => p && isStaticElf(p))
  if (!busybox) missing.push('a static busybox (package busybox-static)')
  const kernel = findGuestKernel()
  if (!kernel) missing.push('a guest kernel /boot/vmlinuz-* with /lib/modules/<release>/modules.dep (package linux-image-amd64)')
  if (missing.length > 0 || !busybox || !kernel)
    throw new BootUnavailableError(
      `cannot boot guests here: missing ${missing.join(', ')}. ` +
        `Install with: apt-get install --no-install-recommends ${BOOT_PACKAGES.join(' ')}`,
    )
  return { qemu, mke2fs, e2fsck, debugfs, filefrag, cpio, busybox, kernel }
}

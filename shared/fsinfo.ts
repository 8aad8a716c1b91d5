/**
 * The file system under a path: its type by statfs(2) f_type (magic numbers from linux/magic.h) and its mount
 * (/proc/self/mountinfo, proc(5)): mount point, source and options. Node APIs only.
 */
import * as fs from 'node:fs'

const FS_TYPES: Record<number, string> = {
  0xef53: 'ext4', // EXT2/3/4_SUPER_MAGIC share it; mountinfo tells them apart
  0x58465342: 'xfs',
  0x9123683e: 'btrfs',
  0xca451a4e: 'bcachefs',
  0x7461636f: 'ocfs2',
  0x01021994: 'tmpfs',
  0x794c7630: 'overlayfs',
  0x2fc12fc1: 'zfs',
  0x6969: 'nfs',
  0xf15f: 'ecryptfs',
  0xff534d42: 'cifs',
  0x65735546: 'fuse',
  0x5346414f: 'afs',
  0x73717368: 'squashfs',
  0x4d44: 'vfat',
  0x2011bab0: 'exfat',
  0x5346544e: 'ntfs',
  0xf2f52010: 'f2fs',
}

/** The name of a statfs(2) f_type, or `fs type 0x…` for one not in the table. */
export function fsTypeName(type: number): string {
  return FS_TYPES[type] ?? `fs type 0x${type.toString(16)}`
}

export interface MountInfo {
  /** Mount point (absolute). */
  mountPoint: string
  /** The file-system type as the kernel names it (`ext4`, `xfs`, `fuse.sshfs`, …). */
  fsType: string
  /** What is mounted (a device, `tmpfs`, a server path). */
  source: string
  /** Per-mount and per-superblock options, e.g. `rw`, `relatime`, `noexec`. */
  options: string[]
  /** st_dev of the mount as `major:minor`. */
  device: string
}

/** mountinfo escapes space, tab, newline and backslash as octal (`\040`). */
function unescape(field: string): string {
  return field.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)))
}

/**
 * The mount that holds `realPath` (a path without symlinks: pass fs.realpathSync's result): the entry of
 * /proc/self/mountinfo with the longest mount point that contains it and whose device is the path's st_dev
 * (stacked mounts on one point: the last one listed is the one visible). Without `dev`, the longest mount point
 * alone: btrfs gives each subvolume, its top level included, an st_dev of its own that mountinfo does not show.
 * Undefined when /proc is missing.
 */
export function mountOf(realPath: string, dev?: { major: number; minor: number }): MountInfo | undefined {
  let text: string
  try {
    text = fs.readFileSync('/proc/self/mountinfo', 'utf8')
  } catch {
    return undefined
  }
  let best: MountInfo | undefined
  for (const line of text.split('\n')) {
    // "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue" (proc(5))
    const sep = line.indexOf(' - ')
    if (sep < 0) continue
    const pre = line.slice(0, sep).split(' ')
    const post = line.slice(sep + 3).split(' ')
    if (pre.length < 6 || post.length < 3) continue
    const mountPoint = unescape(pre[4])
    const inside = mountPoint === '/' || realPath === mountPoint || realPath.startsWith(mountPoint + '/')
    if (!inside || (dev && pre[2] !== `${dev.major}:${dev.minor}`)) continue
    if (best && mountPoint.length < best.mountPoint.length) continue
    best = {
      mountPoint,
      fsType: post[0],
      source: unescape(post[1]),
      options: [...new Set([...pre[5].split(','), ...post[2].split(',')])],
      device: pre[2],
    }
  }
  return best
}

/** major/minor of a dev_t as glibc's gnu_dev_major/minor split it. */
export function devParts(dev: number | bigint): { major: number; minor: number } {
  const d = BigInt(dev)
  const major = Number(((d >> 8n) & 0xfffn) | ((d >> 32n) & 0xfffff000n))
  const minor = Number((d & 0xffn) | ((d >> 12n) & 0xffffff00n))
  return { major, minor }
}

/** The loop device a mount's source names, from sysfs: its backing file and whether it does direct I/O. */
export interface LoopInfo {
  /** `/dev/loopN`. */
  device: string
  /** The backing file's path as the kernel recorded it at attach time. */
  backingFile: string
  /** LO_FLAGS_DIRECT_IO: the loop device reads and writes the file with O_DIRECT (no second page cache). */
  directIo: boolean
}

/** The loop device mounted at or holding `dir` (undefined when its mount is not from a loop device). */
export function loopOf(dir: string): LoopInfo | undefined {
  let real: string
  try {
    real = fs.realpathSync(dir)
  } catch {
    return undefined
  }
  const m = mountOf(real)
  const name = m && /^\/dev\/(loop\d+)$/.exec(m.source)?.[1]
  if (!name) return undefined
  const read = (f: string) => {
    try {
      return fs.readFileSync(`/sys/block/${name}/loop/${f}`, 'utf8').trim()
    } catch {
      return ''
    }
  }
  return { device: `/dev/${name}`, backingFile: read('backing_file'), directIo: read('dio') === '1' }
}

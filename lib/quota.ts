/**
 * Per-workspace disk quotas, the pool's free-space floor, and space accounting. The kernel enforces
 * the limits (native/core/quota.cc); this module checks the options and shapes the answers.
 */
import { native, type NativeQuotaSupport, type NativeUsage } from './binding.js'
import { absolutePath, integerIn, invalidType, invalidValue, optionsObject } from './args.js'
import { call, errnoName } from './errors.js'

/** A workspace's own limit (`allocate({ quota })`), enforced by the kernel: writes past it fail with `EDQUOT`. */
export interface QuotaOptions {
  /**
   * Bytes the workspace may cost. btrfs: the exclusive bytes of its subvolume's qgroup (extents shared with the
   * template by reflink are not charged until rewritten). XFS/ext4 project quota: every block charged to its
   * project (reflinked blocks count in full there), rounded up to 1 KiB.
   */
  bytes?: number
  /** Files and directories the workspace may hold (project quotas only; btrfs has no inode limit: refused). */
  inodes?: number
}

/** Whether a directory's file system can enforce a workspace quota (`probeQuota`, `pool.usage().quota`). */
export interface QuotaSupport {
  /** Whether `allocate({ quota })` can be enforced on this file system (else it fails ERR_QUOTA_UNSUPPORTED). */
  supported: boolean
  /** `'btrfs-qgroup'`: a subvolume per workspace with a qgroup limit; `'project'`: an XFS/ext4 project id. */
  backend: 'btrfs-qgroup' | 'project' | 'none'
  /** Whether `quota.inodes` can be enforced. */
  inodes: boolean
  /** What is used, or why it cannot be (e.g. "btrfs quotas (qgroups) are not enabled …"). */
  detail: string
  /** The errno behind a refusal: `ENOTCONN` (btrfs quotas off), `EPERM` (no CAP_SYS_ADMIN), `ESRCH` (project
   * quota not on), `ENOSYS` (no quota support, or no quotactl_fd before Linux 5.14), `EOPNOTSUPP` (other file
   * systems). Absent when supported. */
  code?: string
}

/** Space accounting of one workspace (`ws.usage()`, `pool.list({ usage: true })`). Bytes throughout. */
export interface WorkspaceUsage {
  /** st_blocks × 512 of every entry (hard links once). */
  allocatedBytes: number
  /** Data extents no other file references (what removing the workspace frees); not yet written-back data too. */
  exclusiveBytes: number
  /** Data extents also referenced elsewhere (FIEMAP_EXTENT_SHARED: reflinks of the template, snapshots). */
  sharedBytes: number
  /** Sum of the regular files' sizes. */
  logicalBytes: number
  /** Regular files below the workspace directory. */
  files: number
  /** Directories below the workspace directory. */
  dirs: number
  /** Symlinks, fifos, sockets, device nodes. */
  others: number
  /**
   * The kernel's view of the workspace's quota, where one is set: `limitBytes`/`usedBytes` (btrfs: exclusive
   * bytes of the qgroup, updated at each transaction commit; project: blocks charged), `limitInodes`/`usedInodes`
   * (project quotas; 0 on btrfs). 0 as a limit: none.
   */
  quota?: {
    /** The byte limit (0: none). */
    limitBytes: number
    /** Bytes the kernel charges to the workspace. */
    usedBytes: number
    /** The inode limit (0: none). */
    limitInodes: number
    /** Inodes the kernel charges to the workspace. */
    usedInodes: number
  }
}

const MAX_SAFE = Number.MAX_SAFE_INTEGER

/** `allocate`'s `quota` option, checked strictly: [bytes, inodes], 0 for none; both 0 when no quota is asked. */
export function quotaLimits(value: unknown): [bytes: number, inodes: number] {
  if (value === undefined) return [0, 0]
  const o = optionsObject<QuotaOptions>('options.quota', value, { bytes: true, inodes: true })
  const bytes = integerIn('options.quota.bytes', o.bytes, 1, MAX_SAFE, 0)
  const inodes = integerIn('options.quota.inodes', o.inodes, 1, 2 ** 32 - 1, 0)
  if (bytes === 0 && inodes === 0) throw invalidValue('options.quota', 'an object with `bytes` and/or `inodes`', value)
  return [bytes, inodes]
}

/** `openPool`'s `projectIds` option: [first, last], 1 ≤ first ≤ last ≤ 2^32 − 2. */
export function projectIdRange(value: unknown): [number, number] {
  if (value === undefined) return [0x40000000, 0x4fffffff]
  if (!Array.isArray(value) || value.length !== 2) throw invalidType('options.projectIds', 'an array [first, last]', value)
  const first = integerIn('options.projectIds[0]', value[0], 1, 2 ** 32 - 2, 0)
  const last = integerIn('options.projectIds[1]', value[1], 1, 2 ** 32 - 2, 0)
  if (first > last) throw invalidValue('options.projectIds', 'first <= last', value)
  return [first, last]
}

export function toQuotaSupport(s: NativeQuotaSupport): QuotaSupport {
  const out: QuotaSupport = { supported: s.supported, backend: s.backend, inodes: s.inodes, detail: s.detail }
  if (s.errno !== undefined) out.code = errnoName(s.errno)
  return out
}

export function toUsage(u: NativeUsage): WorkspaceUsage {
  return { ...u }
}

/**
 * Whether a workspace quota can be enforced on the file system of directory `dir`: btrfs with quotas enabled
 * (`btrfs quota enable`), XFS or ext4 with project quotas on (`prjquota`), and CAP_SYS_ADMIN for either. Asks the
 * kernel (statfs, the btrfs sysfs qgroups state, quotactl_fd Q_XGETQSTATV); makes nothing. Throws the errno of
 * opening `dir`.
 */
export async function probeQuota(dir: string): Promise<QuotaSupport> {
  const p = absolutePath('dir', dir)
  return toQuotaSupport(await call(native.probeQuota(p)))
}

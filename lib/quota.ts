/**
 * Per-workspace disk quotas, the pool's free-space floor, and space accounting. The kernel enforces
 * the limits (native/core/quota.cc); this module checks the options and shapes the answers.
 */
import { native, type NativeQuotaSupport, type NativeUsage } from './binding.js'
import { absolutePath, integerIn, invalidType, invalidValue, optionsObject } from './args.js'
import { call, errnoName } from './errors.js'
import type { QuotaOptions, QuotaSupport, WorkspaceUsage } from './types.js'

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

/**
 * `vmspace probe DIR`: the file system under DIR and whether the kernel features vmspace relies on work there,
 * each learnt by trying it on files in a temporary directory made in DIR (removed at the end), never guessed
 * from the file-system type.
 */
import { randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { exchange, lockFile, probeQuota, renameNoReplace } from 'vmspace'
import { EXIT_FAILED, EXIT_OK, errorJson, existingDir, humanBytes, printJson } from './common.js'
import { devParts, fsTypeName, loopOf, mountOf, type MountInfo } from '../shared/fsinfo.js'

export interface Feature {
  /** null when it could not be tried (see error). */
  supported: boolean | null
  /** What it is for in vmspace, one line. */
  usedFor: string
  /** The errno name of a refusal (`EOPNOTSUPP`, `EXDEV`, `EINVAL`, …) or of the failed try. */
  code: string | null
}

/** errnos that mean "this file system (or kernel) does not do that", as opposed to a failed try. */
const UNSUPPORTED = new Set(['EOPNOTSUPP', 'ENOTSUP', 'EXDEV', 'EINVAL', 'ENOSYS', 'ENOTTY', 'ENOLCK', 'ERR_REFLINK_UNSUPPORTED'])

async function attempt(usedFor: string, fn: () => Promise<boolean> | boolean): Promise<Feature> {
  try {
    return { supported: await fn(), usedFor, code: null }
  } catch (e) {
    const { code } = errorJson(e)
    return { supported: code !== null && UNSUPPORTED.has(code) ? false : null, usedFor, code }
  }
}

/**
 * What the kernel says of quotas beyond probeQuota, by file-system type: on btrfs the mode quotas are enabled in
 * (`/sys/fs/btrfs/<fsid>/qgroups/mode`, Linux 6.7: `qgroup` or `squota`, simple quotas); on XFS whether the kernel
 * has quota support at all (CONFIG_XFS_QUOTA makes /proc/fs/xfs/xqmstat). Undefined when there is nothing to add.
 */
export function quotaNote(fsType: string, source: string | undefined): string | undefined {
  if (fsType === 'xfs' && !fs.existsSync('/proc/fs/xfs/xqmstat'))
    return 'this kernel has no XFS quota support (CONFIG_XFS_QUOTA is not set): project quotas cannot be enforced on any XFS'
  if (fsType !== 'btrfs' || !source) return undefined
  let dev: string
  try {
    dev = path.basename(fs.realpathSync(source))
  } catch {
    return undefined
  }
  for (const fsid of fs.readdirSync('/sys/fs/btrfs')) {
    if (!fs.existsSync(path.join('/sys/fs/btrfs', fsid, 'devices', dev))) continue
    const q = path.join('/sys/fs/btrfs', fsid, 'qgroups')
    if (!fs.existsSync(q)) return 'btrfs quotas are off (btrfs quota enable --simple MNT on Linux 6.7+, else btrfs quota enable MNT)'
    const mode = fs.existsSync(path.join(q, 'mode')) ? fs.readFileSync(path.join(q, 'mode'), 'utf8').trim() : 'qgroup'
    return mode === 'squota'
      ? 'btrfs simple quotas (squota): each extent charged to the subvolume that wrote it, no backref walk per commit'
      : 'btrfs qgroups (full accounting: shared and exclusive bytes, a backref walk per commit; simple quotas are advised under frequent subvolume create/delete)'
  }
  return undefined
}

async function features(tmp: string, note: string | undefined): Promise<Record<string, Feature>> {
  const a = path.join(tmp, 'a')
  const b = path.join(tmp, 'b')
  const c = path.join(tmp, 'c')
  fs.writeFileSync(a, randomBytes(64 * 1024))
  fs.writeFileSync(c, 'c')
  return {
    // FICLONE through copy_file's FICLONE_FORCE: it fails instead of falling back to a copy (copyfile(3) in libuv).
    reflink: await attempt('template and clone() data shared copy-on-write (ioctl FICLONE); else copied', () => {
      fs.copyFileSync(a, b, fs.constants.COPYFILE_FICLONE_FORCE)
      return true
    }),
    renameNoReplace: await attempt('publishing workspaces and clones without replacing (renameat2 RENAME_NOREPLACE)', async () => {
      fs.writeFileSync(b, 'b')
      try {
        await renameNoReplace(b, c)
      } catch (e) {
        if ((e as { code?: string }).code === 'EEXIST') return true
        throw e
      }
      throw Object.assign(new Error('renameat2(RENAME_NOREPLACE) replaced an existing file'), { code: 'EEXIST_IGNORED' })
    }),
    renameExchange: await attempt('clone --overwrite of a tree, exchange() (renameat2 RENAME_EXCHANGE)', async () => {
      await exchange(a, c)
      return true
    }),
    flock: await attempt('leases and lockFile() (flock(2))', async () => {
      const lock = await lockFile(path.join(tmp, 'lock'), { wait: false })
      await lock.release()
      return true
    }),
    birthTime: await attempt("sweep's graceMs counted from the birth time (statx STATX_BTIME; else ctime)", () => fs.statSync(a, { bigint: true }).birthtimeNs > 0n),
    // Asked of the kernel (statfs, btrfs qgroups state, quotactl_fd), not tried: a quota needs a subvolume or a
    // project id that the probe would have to make and release.
    quota: await (async (): Promise<Feature> => {
      const usedFor = "allocate({ quota }): a workspace's own disk limit (btrfs qgroup, XFS/ext4 project quota)"
      try {
        const q = await probeQuota(tmp)
        const detail = note ? `${q.detail}; ${note}` : q.detail
        return { supported: q.supported, usedFor: q.supported ? `${usedFor}: ${detail}` : `${usedFor}; ${detail}`, code: q.code ?? null }
      } catch (e) {
        return { supported: null, usedFor, code: errorJson(e).code }
      }
    })(),
    sparseFiles: await attempt('holes kept by copies (SEEK_DATA/SEEK_HOLE) and by reflinks', () => {
      const s = path.join(tmp, 's')
      const fd = fs.openSync(s, 'w')
      try {
        fs.writeSync(fd, 'x', 16 * 1024 * 1024)
      } finally {
        fs.closeSync(fd)
      }
      const st = fs.statSync(s)
      return st.blocks * 512 < st.size
    }),
  }
}

export async function probe(dirArg: string, opts: { json?: boolean }): Promise<number> {
  const dir = fs.realpathSync(existingDir('DIR', dirArg))
  const sfs = fs.statfsSync(dir)
  const st = fs.statSync(dir, { bigint: true })
  // A btrfs subvolume's st_dev is not the one mountinfo lists: there the longest mount point alone.
  const mount: MountInfo | null = mountOf(dir, devParts(st.dev)) ?? (fsTypeName(sfs.type) === 'btrfs' ? mountOf(dir) : undefined) ?? null
  const result = {
    path: dir,
    fsType: fsTypeName(sfs.type),
    fsMagic: `0x${sfs.type.toString(16)}`,
    blockSize: sfs.bsize,
    totalBytes: sfs.blocks * sfs.bsize,
    availableBytes: sfs.bavail * sfs.bsize,
    mount,
    /** The loop device the mount comes from (an image-backed pool), or null. */
    loop: loopOf(dir) ?? null,
    kernel: os.release(),
    features: {} as Record<string, Feature>,
    /** Why the features could not be tried (the temporary directory could not be made), or null. */
    error: null as { code: string | null; message: string } | null,
  }
  let tmp: string | undefined
  try {
    tmp = fs.mkdtempSync(path.join(dir, '.vmspace-probe-'))
    result.features = await features(tmp, quotaNote(result.fsType, mount?.source))
  } catch (e) {
    result.error = errorJson(e)
  } finally {
    if (tmp) fs.rmSync(tmp, { recursive: true, force: true })
  }
  if (opts.json) printJson(result)
  else {
    const lines = [
      `${dir}: ${result.fsType}${mount ? ` (${mount.fsType} on ${mount.mountPoint} from ${mount.source}, ${mount.options.join(',')})` : ''}`,
      `  size ${humanBytes(result.totalBytes)}, ${humanBytes(result.availableBytes)} available, block size ${result.blockSize}; kernel ${result.kernel}`,
    ]
    if (result.loop) lines.push(`  image ${result.loop.backingFile} through ${result.loop.device}, direct I/O ${result.loop.directIo ? 'on' : 'off'}`)
    const rows = Object.entries(result.features).map(([name, f]) => ({
      name,
      state: f.supported === null ? `unknown (${f.code})` : f.supported ? 'yes' : `no${f.code ? ` (${f.code})` : ''}`,
      usedFor: f.usedFor,
    }))
    const w1 = Math.max(0, ...rows.map((r) => r.name.length))
    const w2 = Math.max(0, ...rows.map((r) => r.state.length))
    for (const r of rows) lines.push(`  ${r.name.padEnd(w1)}  ${r.state.padEnd(w2)}  ${r.usedFor}`)
    if (result.error) lines.push(`  features not tried: ${result.error.message}`)
    process.stdout.write(lines.join('\n') + '\n')
  }
  const failed = result.error !== null || Object.values(result.features).some((f) => f.supported === null)
  return failed ? EXIT_FAILED : EXIT_OK
}


/** `vmspace ls ROOT` and `vmspace inspect ROOT ID`: what the pool holds, from Pool.list() and a walk of each tree. */
import * as fs from 'node:fs'
import { openPool, type Template, type WorkspaceInfo } from 'vmspace'
import { EXIT_FAILED, EXIT_OK, errorJson, humanAge, humanBytes, ID, poolRoot, printJson, table, UsageError, WORKSPACE_NAME } from './common.js'
import { treeUsage, type TreeUsage } from './du.js'
import { checkpointJson } from './checkpoint.js'

/**
 * The members of a workspace's record about the process that allocated it, shown as they are (null where absent).
 * The allocator, not necessarily a holder: the lease may have been handed over or adopted since.
 */
const ALLOCATOR_KEYS = ['pid', 'uid', 'hostname', 'bootId'] as const
type AllocatorJson = { [K in (typeof ALLOCATOR_KEYS)[number]]: NonNullable<WorkspaceInfo[K]> | null }

function allocatorJson(info: WorkspaceInfo): AllocatorJson {
  return Object.fromEntries(ALLOCATOR_KEYS.map((k) => [k, info[k] ?? null])) as AllocatorJson
}

/**
 * Who holds a lease, from the OFD locks on its lease file in /proc/locks (docs/lifecycle.md): `pool`, the lock of
 * a pool handle (the allocating process's, or an adopter's); `handedOver`, a lock of a process given `ws.leaseFd`
 * (the VM). Informative only: the lease probe alone decides `live`.
 */
export interface LeaseHolders {
  pool: boolean
  handedOver: boolean
}

/** The OFD locks of /proc/locks by inode: the bytes locked (0: a pool handle's, 1: handed over), or null unreadable. */
function ofdLocks(): Map<string, Set<string>> | null {
  let text: string
  try {
    text = fs.readFileSync('/proc/locks', 'utf8')
  } catch {
    return null
  }
  const byInode = new Map<string, Set<string>>()
  // "1: OFDLCK ADVISORY  READ -1 07:04:655627 0 0": the device is the superblock's, which a btrfs subvolume's
  // st_dev is not; a lease file is matched by inode number among OFD locks.
  for (const m of text.matchAll(/^\d+: OFDLCK\s+\S+\s+\S+\s+-?\d+\s+[0-9a-f]+:[0-9a-f]+:(\d+)\s+(\d+)\s+\S+$/gm)) {
    const bytes = byInode.get(m[1]) ?? new Set<string>()
    byInode.set(m[1], bytes.add(m[2]))
  }
  return byInode
}

function leaseHolders(leasePath: LeasePath, info: WorkspaceInfo, locks: Map<string, Set<string>> | null): LeaseHolders | null {
  if (locks === null) return null
  let ino: string
  try {
    ino = String(fs.statSync(leasePath(info.name), { bigint: true }).ino)
  } catch {
    return null
  }
  const bytes = locks.get(ino)
  return { pool: bytes?.has('0') ?? false, handedOver: bytes?.has('1') ?? false }
}

/** Where a workspace's lease file is (Pool.leasePath of the pool listed). */
type LeasePath = (name: string) => string

/** One workspace in `ls --json` (every key always present; null where unknown). */
export interface WorkspaceJson extends AllocatorJson {
  id: string
  name: string
  path: string
  live: boolean
  /** Who holds the lease now (null: /proc/locks could not be read). */
  lease: LeaseHolders | null
  /** ms since the epoch, and ms since then. */
  createdAt: number | null
  ageMs: number | null
  meta: WorkspaceInfo['meta'] | null
  /** How the template arrived: 'reflink', 'copy', 'mixed' (over several sources), or null without a template. */
  method: string | null
  template: NonNullable<WorkspaceInfo['template']>
  /** st_blocks × 512 over the tree (du -x), or null when the walk failed (see error). */
  allocatedBytes: number | null
  /** Data only this workspace references, and data shared with other files (reflinks), from Workspace usage (FIEMAP); null where unknown. */
  exclusiveBytes: number | null
  sharedBytes: number | null
  /** The workspace's quota as the kernel reports it (limits 0: none), or null without a quota. */
  quota: { limitBytes: number; usedBytes: number; limitInodes: number; usedInodes: number } | null
  /** Why the metadata or the walk could not be read. */
  error: { code: string | null; message: string } | null
}

function method(info: WorkspaceInfo): string | null {
  const methods = new Set((info.template ?? []).map((t) => t.method))
  if (methods.size === 0) return null
  return methods.size === 1 ? [...methods][0] : 'mixed'
}

async function describeWorkspace(
  leasePath: LeasePath,
  info: WorkspaceInfo,
  now: number,
  locks: Map<string, Set<string>> | null,
): Promise<{ json: WorkspaceJson; usage?: TreeUsage }> {
  let usage: TreeUsage | undefined
  let walkError: unknown
  try {
    usage = await treeUsage(info.path)
  } catch (e) {
    walkError = e
  }
  const error = info.error ?? walkError
  const json: WorkspaceJson = {
    id: info.id,
    name: info.name,
    path: info.path,
    live: info.live,
    lease: leaseHolders(leasePath, info, locks),
    createdAt: info.createdAt ?? null,
    ageMs: info.createdAt === undefined ? null : Math.max(0, now - info.createdAt),
    ...allocatorJson(info),
    meta: info.meta ?? null,
    method: method(info),
    template: info.template ?? [],
    allocatedBytes: usage?.allocatedBytes ?? null,
    exclusiveBytes: info.usage?.exclusiveBytes ?? null,
    sharedBytes: info.usage?.sharedBytes ?? null,
    quota: info.usage?.quota ?? null,
    error: error === undefined ? null : errorJson(error),
  }
  return { json, usage }
}

async function listPool(
  rootArg: string,
  usage = false,
): Promise<{ root: string; infos: WorkspaceInfo[]; templates: Template[]; leasePath: LeasePath }> {
  const root = poolRoot(rootArg)
  const pool = await openPool(root, { create: false })
  try {
    // leasePath makes no syscall: still answers once the pool is closed.
    return { root, infos: await pool.list({ usage }), templates: await pool.templates(), leasePath: (name) => pool.leasePath(name) }
  } finally {
    await pool.close()
  }
}

/** One template in `ls --json` (every key always present, null where unknown). */
export interface TemplateJson {
  id: string
  name: string | null
  current: boolean
  retired: boolean
  path: string
  createdAt: number | null
  lastUsedAt: number | null
  parent: string | null
  meta: Template['meta'] | null
  method: string | null
  allocatedBytes: number | null
  files: number | null
  error: { code: string | null; message: string } | null
}

function templateJson(t: Template): TemplateJson {
  return {
    id: t.id,
    name: t.name,
    current: t.current,
    retired: t.retired,
    path: t.path,
    createdAt: t.createdAt ?? null,
    lastUsedAt: t.lastUsedAt,
    parent: t.parent,
    meta: t.meta ?? null,
    method: t.method ?? null,
    allocatedBytes: t.usage?.allocatedBytes ?? null,
    files: t.usage?.files ?? null,
    error: t.error ? errorJson(t.error) : null,
  }
}

/** Exit 1 when any entry's metadata or tree could not be read (it is listed with its error). */
export async function ls(rootArg: string, opts: { json?: boolean }): Promise<number> {
  const { root, infos, templates, leasePath } = await listPool(rootArg, true)
  const now = Date.now()
  const rows: WorkspaceJson[] = []
  const locks = ofdLocks()
  for (const info of infos.sort((a, b) => (a.createdAt ?? 0) - (b.createdAt ?? 0) || a.name.localeCompare(b.name)))
    rows.push((await describeWorkspace(leasePath, info, now, locks)).json)
  const tpl = templates.map(templateJson)
  const failed = rows.filter((r) => r.error !== null).length + tpl.filter((t) => t.error !== null).length
  if (opts.json) printJson({ root, workspaces: rows, templates: tpl })
  else {
    const cell = (v: string | number | null, f: (x: never) => string = String) => (v === null ? '-' : f(v as never))
    process.stdout.write(
      table(
        ['ID', 'STATE', 'AGE', 'ALLOCATOR', 'HOST', 'METHOD', 'ALLOCATED', 'EXCLUSIVE', 'SHARED', 'QUOTA', 'META'],
        rows.map((r) => [
          r.id,
          stateCell(r),
          cell(r.ageMs, humanAge),
          cell(r.pid),
          cell(r.hostname),
          cell(r.method),
          cell(r.allocatedBytes, humanBytes),
          cell(r.exclusiveBytes, humanBytes),
          cell(r.sharedBytes, humanBytes),
          r.quota === null ? '-' : quotaCell(r.quota),
          r.error ? `error: ${r.error.message}` : r.meta === null ? '-' : JSON.stringify(r.meta),
        ]),
      ),
    )
    if (rows.length === 0) process.stderr.write(`vmspace ls: no workspaces in ${root}\n`)
    if (tpl.length) {
      const cell = (v: number | null, f: (x: number) => string) => (v === null ? '-' : f(v))
      process.stdout.write(
        '\n' +
          table(
            ['TEMPLATE', 'NAME', 'AGE', 'LAST USED', 'PARENT', 'METHOD', 'ALLOCATED', 'META'],
            tpl.map((t) => [
              t.id,
              t.name === null ? '-' : t.retired ? `${t.name} (retired)` : t.current ? t.name : `${t.name} (replaced)`,
              cell(t.createdAt, (c) => humanAge(now - c)),
              cell(t.lastUsedAt, (c) => `${humanAge(now - c)} ago`),
              t.parent ?? '-',
              t.method ?? '-',
              cell(t.allocatedBytes, humanBytes),
              t.error ? `error: ${t.error.message}` : t.meta === null ? '-' : JSON.stringify(t.meta),
            ]),
          ),
      )
    }
  }
  return failed ? EXIT_FAILED : EXIT_OK
}

/**
 * `free`; `live` (a pool handle holds the lease: the allocator's, or an adopter's); `handed` (only processes given
 * the lease hold it, the allocator let go); `live+handed` (both).
 */
function stateCell(r: WorkspaceJson): string {
  if (!r.live) return 'free'
  if (r.lease?.handedOver) return r.lease.pool ? 'live+handed' : 'handed'
  return 'live'
}

/** "used/limit" of the quota's bytes (and inodes where limited). */
function quotaCell(q: NonNullable<WorkspaceJson['quota']>): string {
  const bytes = `${humanBytes(q.usedBytes)}/${q.limitBytes ? humanBytes(q.limitBytes) : '-'}`
  return q.limitInodes ? `${bytes},${q.usedInodes}/${q.limitInodes}i` : bytes
}

function currentBootId(): string | null {
  try {
    return fs.readFileSync('/proc/sys/kernel/random/boot_id', 'utf8').trim()
  } catch {
    return null
  }
}

/**
 * Whether the process that made the workspace still runs: only knowable on its host in this boot (a pid is
 * reused after a reboot). Informative only: the lease alone decides liveness.
 */
function allocatorRunning(info: WorkspaceInfo, bootId: string | null): boolean | null {
  if (info.pid === undefined || info.bootId === undefined || info.bootId !== bootId) return null
  try {
    process.kill(info.pid, 0)
    return true
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'EPERM'
  }
}

interface Inspected extends WorkspaceJson {
  /** The workspace's lease file, whose xattr `metadataXattr` holds its record (its contents, where the file system refused the xattr). */
  metadataPath: string
  metadataXattr: string | null
  /** The lease is free: a sweep would reclaim it, `adopt` would take it over. */
  reclaimable: boolean
  /** The workspace was made in this boot (null: not recorded). */
  sameBoot: boolean | null
  /** Whether the allocating process still runs (null: not knowable here); informative only. */
  allocatorRunning: boolean | null
  directory: { mode: string; uid: number; gid: number; dev: string; ino: string } | null
  usage: TreeUsage | null
  /** Its checkpoints, newest first (cli/checkpoint.ts, checkpointJson). */
  checkpoints: ReturnType<typeof checkpointJson>[]
}

/** Everything the pool knows about one workspace. Exit 1 when there is no such workspace or it cannot be read. */
export async function inspect(rootArg: string, idArg: string, opts: { json?: boolean }): Promise<number> {
  if (!ID.test(idArg) && !WORKSPACE_NAME.test(idArg)) throw new UsageError(`ID must be a workspace id (32 lowercase hex characters) or name, got ${JSON.stringify(idArg)}`)
  // With usage, as ls: exclusiveBytes and sharedBytes are the same numbers in both (Pool.list walks every tree).
  const { root, infos, leasePath } = await listPool(rootArg, true)
  const info = infos.find((i) => i.id === idArg || i.name === idArg)
  if (!info) {
    process.stderr.write(`vmspace inspect: no workspace ${idArg} in ${root}\n`)
    return EXIT_FAILED
  }
  const { json, usage } = await describeWorkspace(leasePath, info, Date.now(), ofdLocks())
  const bootId = currentBootId()
  let directory: Inspected['directory'] = null
  try {
    const st = fs.lstatSync(info.path, { bigint: true })
    directory = { mode: (st.mode & 0o7777n).toString(8).padStart(4, '0'), uid: Number(st.uid), gid: Number(st.gid), dev: String(st.dev), ino: String(st.ino) }
  } catch (e) {
    json.error ??= errorJson(e)
  }
  const full: Inspected = {
    ...json,
    metadataPath: leasePath(info.name),
    metadataXattr: 'user.vmspace.record',
    reclaimable: !info.live,
    sameBoot: info.bootId === undefined || bootId === null ? null : info.bootId === bootId,
    allocatorRunning: allocatorRunning(info, bootId),
    directory,
    usage: usage ?? null,
    checkpoints: await checkpointsOf(root, info.id),
  }
  if (opts.json) printJson(full)
  else process.stdout.write(inspectText(full))
  return full.error ? EXIT_FAILED : EXIT_OK
}

/** The checkpoints of workspace `id` of the pool at `root`, newest first. */
async function checkpointsOf(root: string, id: string): Promise<ReturnType<typeof checkpointJson>[]> {
  const pool = await openPool(root, { create: false })
  try {
    return (await pool.checkpoints(id)).map(checkpointJson)
  } finally {
    await pool.close()
  }
}

/** Who holds a live lease, in words. */
function holdersText(lease: LeaseHolders | null): string {
  const pool = 'a pool handle holds the lease (the allocator, or a process that adopted it)'
  const handed = 'held by processes it was handed to (ws.leaseFd)'
  if (lease?.handedOver) return lease.pool ? `${pool}; also ${handed}` : `${handed}, not by a pool handle`
  return lease?.pool ? pool : 'a process holds the lease'
}

/** `key  value` lines for people. */
function inspectText(w: Inspected): string {
  const { directory: dir, usage } = w
  const lines: [string, string][] = [
    ['id', w.id],
    ['name', w.name],
    ['path', w.path],
    ['state', w.live ? `live (${holdersText(w.lease)})` : 'free (no process holds the lease: a sweep reclaims it)'],
    ['created', w.createdAt === null ? '-' : `${new Date(w.createdAt).toISOString()} (${humanAge(w.ageMs!)} ago)`],
    ['allocator', `${w.pid ?? '-'} on ${w.hostname ?? '-'}${w.allocatorRunning === null ? '' : w.allocatorRunning ? ' (running)' : ' (gone)'}`],
    ['boot', `${w.bootId ?? '-'}${w.sameBoot === null ? '' : w.sameBoot ? ' (this boot)' : ' (an earlier boot)'}`],
    ['meta', w.meta === null ? '-' : JSON.stringify(w.meta)],
    ['metadata', w.metadataXattr ? `${w.metadataPath} (xattr ${w.metadataXattr})` : w.metadataPath],
    ['directory', dir ? `mode ${dir.mode}, uid ${dir.uid}, gid ${dir.gid}, dev ${dir.dev}, ino ${dir.ino}` : '-'],
    [
      'usage',
      usage
        ? `${humanBytes(usage.allocatedBytes)} allocated, ${humanBytes(usage.logicalBytes)} in ${usage.files} files, ${usage.dirs} dirs, ${usage.others} others` +
          (usage.skipped ? `, ${usage.skipped} dirs not entered (mounts)` : '')
        : '-',
    ],
  ]
  // A tree's recorded size is its directory's st_size, not what it holds: its usage is the usage line's.
  for (const t of w.template)
    lines.push(['template', `${t.dest || '.'} <- ${t.source} (${t.kind}, ${t.method}${t.kind === 'file' ? `, ${humanBytes(t.size)}` : ''})`])
  if (w.checkpoints.length === 0) lines.push(['checkpoints', '-'])
  for (const c of w.checkpoints)
    lines.push(['checkpoint', `${c.id} ${c.createdAt === null ? '-' : new Date(c.createdAt).toISOString()} ${humanBytes(c.exclusiveBytes)} exclusive`])
  if (w.error) lines.push(['error', w.error.message])
  const width = Math.max(...lines.map((l) => l[0].length))
  return lines.map(([k, v]) => `${k.padEnd(width)}  ${v}`).join('\n') + '\n'
}

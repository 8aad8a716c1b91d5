/**
 * `vmspace commit ROOT ID`, `vmspace fork ROOT ID N`, `vmspace template rm ROOT NAME` and `vmspace template prune
 * ROOT …`: a workspace's current contents as a template, children of it, and templates removed. The CLI holds no
 * workspace: fork's children are left with free leases for a sidecar to `pool.adopt(id)` (a sweep reclaims those
 * nobody adopts). `vmspace run --from` allocates from a template (cli/run.ts).
 */
import { openPool, type JsonObject, type Template } from 'vmspace'
import { EXIT_OK, ID, printJson, poolRoot, UsageError } from './common.js'

export function workspaceId(arg: string): string {
  const id = /-([0-9a-f]{32})$/.exec(arg)?.[1] ?? arg
  if (!ID.test(id)) throw new UsageError(`ID must be a workspace id (32 lowercase hex characters) or name, got ${JSON.stringify(arg)}`)
  return id
}

export function metaArg(text: string | undefined): JsonObject | undefined {
  if (text === undefined) return undefined
  let meta: unknown
  try {
    meta = JSON.parse(text)
  } catch {
    throw new UsageError(`--meta must be a JSON object, got ${JSON.stringify(text)}`)
  }
  if (typeof meta !== 'object' || meta === null || Array.isArray(meta)) throw new UsageError(`--meta must be a JSON object, got ${JSON.stringify(text)}`)
  return meta as JsonObject
}

/** The flags `vmspace fork` takes. */
export interface ForkFlags {
  meta?: string
  keepDevices?: boolean
  keepSetId?: boolean
  /** --share PATH, once per file (commit's `share`). */
  share?: string[]
  json?: boolean
}

/** Collects a repeated --share PATH into a list (checked by the library: ERR_INVALID_ARG_VALUE naming it). */
export function collectShare(value: string, previous: string[] | undefined): string[] {
  return [...(previous ?? []), value]
}

/** The flags `vmspace commit` takes. */
export interface CommitFlags extends ForkFlags {
  name?: string
  replace?: boolean
}

export async function commit(rootArg: string, idArg: string, o: CommitFlags): Promise<number> {
  const root = poolRoot(rootArg)
  const id = workspaceId(idArg)
  const meta = metaArg(o.meta)
  const pool = await openPool(root, { create: false })
  try {
    const t = await pool.commit(id, {
      name: o.name, replace: o.replace, meta, keepDevices: o.keepDevices === true, keepSetId: o.keepSetId === true, share: o.share,
    })
    if (o.json) printJson(t)
    else {
      process.stdout.write(`${t.id}\n`)
      process.stderr.write(
        `vmspace commit: template ${t.id}${t.name ? ` (${t.name})` : ''}: ${t.clone.files} files, ${t.clone.method}` +
          (t.shared ? `; ${t.shared.length} shared` : '') +
          (t.clone.skipped?.devices ? `; ${t.clone.skipped.devices} device nodes not carried` : '') +
          (t.replaced ? `; replaced ${t.replaced.id}${t.replaced.removed ? '' : ' (removed once its readers finish)'}` : '') +
          '\n',
      )
    }
    return EXIT_OK
  } finally {
    await pool.close()
  }
}

export async function fork(rootArg: string, idArg: string, count: number, o: ForkFlags): Promise<number> {
  const root = poolRoot(rootArg)
  const id = workspaceId(idArg)
  const meta = metaArg(o.meta)
  const pool = await openPool(root, { create: false })
  try {
    const started = process.hrtime.bigint()
    const kids = await pool.fork(id, count, { meta, keepDevices: o.keepDevices === true, keepSetId: o.keepSetId === true, share: o.share })
    const ms = Number(process.hrtime.bigint() - started) / 1e6
    // Released, not disposed: the children outlive this command until someone adopts them (or a sweep runs).
    for (const k of kids) await k.release({ force: true })
    if (o.json) printJson({ root, parent: id, msPerChild: ms / count, children: kids.map((k) => ({ id: k.id, name: k.name, path: k.path })) })
    else {
      for (const k of kids) process.stdout.write(`${k.id}\n`)
      process.stderr.write(`vmspace fork: ${count} children of ${id} in ${ms.toFixed(0)} ms (${(ms / count).toFixed(1)} ms each); leases free: adopt them (pool.adopt) before a sweep reclaims them\n`)
    }
    return EXIT_OK
  } finally {
    await pool.close()
  }
}

/** A template id or name as the library takes it (1-128 of [A-Za-z0-9._-]); whether it exists is the pool's. */
export function templateArg(what: string) {
  return (value: string): string => {
    if (!/^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/.test(value))
      throw new UsageError(`${what} must be a template id (32 hex characters) or name (1-128 of [A-Za-z0-9._-]), got ${JSON.stringify(value)}`)
    return value
  }
}

/** Removes one template: its name at once, its tree once no allocate reads it. */
export async function templateRm(rootArg: string, ref: string, o: { json?: boolean }): Promise<number> {
  const root = poolRoot(rootArg)
  const pool = await openPool(root, { create: false })
  try {
    const r = await pool.removeTemplate(ref)
    if (o.json) printJson({ root, ...r })
    else process.stdout.write(`${r.id}: ${r.removed ? 'removed' : 'retired (removed once the allocates reading it finish, or by a sweep)'}\n`)
    return EXIT_OK
  } finally {
    await pool.close()
  }
}

export interface PruneArgs {
  keepNewest?: number
  unusedFor?: number
  name?: string
  dryRun?: boolean
  json?: boolean
}

/** Pool.pruneTemplates: stale versions, in one call; one line per template (or --json). */
export async function templatePrune(rootArg: string, o: PruneArgs): Promise<number> {
  if (o.keepNewest === undefined && o.unusedFor === undefined) throw new UsageError('give --keep-newest N and/or --unused-for DURATION')
  const root = poolRoot(rootArg)
  const pool = await openPool(root, { create: false })
  try {
    const dryRun = o.dryRun ?? false
    const r = await pool.pruneTemplates({ keepNewest: o.keepNewest, unusedForMs: o.unusedFor, name: o.name, dryRun })
    const brief = (t: Template) => ({ id: t.id, name: t.name, createdAt: t.createdAt ?? null, lastUsedAt: t.lastUsedAt })
    if (o.json) printJson({ root, dryRun, removed: r.removed.map(brief), deferred: r.deferred.map(brief) })
    else {
      for (const t of r.removed) process.stdout.write(`${dryRun ? 'would remove' : 'removed'} ${t.id}${t.name ? ` (${t.name})` : ''}\n`)
      for (const t of r.deferred) process.stdout.write(`retired ${t.id}${t.name ? ` (${t.name})` : ''}: removed once its readers finish\n`)
      process.stdout.write(`${root}: ${r.removed.length} template(s) ${dryRun ? 'to remove' : 'removed'}, ${r.deferred.length} retired\n`)
    }
    return EXIT_OK
  } finally {
    await pool.close()
  }
}

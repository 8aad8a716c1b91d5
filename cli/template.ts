/**
 * `vmspace commit ROOT ID` and `vmspace fork ROOT ID N`: a workspace's current contents as a template,
 * and children of it. The CLI holds no workspace: fork's children are left with free leases for a sidecar to
 * `pool.adopt(id)` (a sweep reclaims those nobody adopts).
 */
import { openPool, type JsonObject } from 'vmspace'
import { EXIT_OK, printJson, poolRoot, UsageError } from './common.js'

const ID = /^[0-9a-f]{32}$/

function workspaceId(arg: string): string {
  const id = /-([0-9a-f]{32})$/.exec(arg)?.[1] ?? arg
  if (!ID.test(id)) throw new UsageError(`ID must be a workspace id (32 lowercase hex characters) or name, got ${JSON.stringify(arg)}`)
  return id
}

function metaArg(text: string | undefined): JsonObject | undefined {
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
  json?: boolean
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
    const t = await pool.commit(id, { name: o.name, replace: o.replace, meta, keepDevices: o.keepDevices === true, keepSetId: o.keepSetId === true })
    if (o.json) printJson(t)
    else {
      process.stdout.write(`${t.id}\n`)
      process.stderr.write(
        `vmspace commit: template ${t.id}${t.name ? ` (${t.name})` : ''}: ${t.clone.files} files, ${t.clone.method}` +
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
    const kids = await pool.fork(id, count, { meta, keepDevices: o.keepDevices === true, keepSetId: o.keepSetId === true })
    const ms = Number(process.hrtime.bigint() - started) / 1e6
    // Released, not disposed: the children outlive this command until someone adopts them (or a sweep runs).
    for (const k of kids) await k.release()
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

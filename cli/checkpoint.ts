/**
 * `vmspace checkpoint ROOT ID …` and `vmspace rollback ROOT ID CHECKPOINT`: a workspace's checkpoints by id
 * (docs/checkpoints.md). The CLI holds no workspace: a rollback takes the workspace's free lease for the call
 * (ERR_LEASE_HELD while its owner or a process it was handed to runs). `vmspace inspect` lists the checkpoints.
 */
import { openPool, type Checkpoint } from 'vmspace'
import { EXIT_OK, humanBytes, ID, printJson, poolRoot, UsageError } from './common.js'
import { metaArg, workspaceId } from './template.js'

/** The flags `vmspace checkpoint` takes. */
export interface CheckpointFlags {
  keepNewest?: number
  maxAge?: number
  share?: string[]
  meta?: string
  json?: boolean
}

/** What the CLI prints of a checkpoint (--json, and inspect's list). */
export function checkpointJson(c: Checkpoint) {
  return { id: c.id, workspace: c.checkpoint.workspace, createdAt: c.createdAt ?? null, exclusiveBytes: c.exclusiveBytes, path: c.path, meta: c.meta ?? null, keepNewest: c.checkpoint.keepNewest ?? null, maxAgeMs: c.checkpoint.maxAgeMs ?? null }
}

export async function checkpoint(rootArg: string, idArg: string, o: CheckpointFlags): Promise<number> {
  const root = poolRoot(rootArg)
  const id = workspaceId(idArg)
  const meta = metaArg(o.meta)
  if (o.maxAge === 0) throw new UsageError('--max-age must be at least 1 ms')
  const pool = await openPool(root, { create: false })
  try {
    const c = await pool.checkpoint(id, {
      meta, keepNewest: o.keepNewest, maxAgeMs: o.maxAge, ...(o.share?.length ? { share: o.share } : {}),
    })
    if (o.json) printJson(checkpointJson(c))
    else {
      process.stdout.write(`${c.id}\n`)
      process.stderr.write(`vmspace checkpoint: ${c.id} of workspace ${id}: ${c.usage?.files ?? '?'} files, ${humanBytes(c.exclusiveBytes)} exclusive\n`)
    }
    return EXIT_OK
  } finally {
    await pool.close()
  }
}

export async function rollback(rootArg: string, idArg: string, checkpointArg: string, o: { json?: boolean }): Promise<number> {
  const root = poolRoot(rootArg)
  const id = workspaceId(idArg)
  if (!ID.test(checkpointArg)) throw new UsageError(`CHECKPOINT must be a checkpoint id (32 lowercase hex characters), got ${JSON.stringify(checkpointArg)}`)
  const pool = await openPool(root, { create: false })
  try {
    const r = await pool.rollback(id, checkpointArg)
    if (o.json) printJson({ root, workspace: id, ...r })
    else
      process.stdout.write(
        `workspace ${id} rolled back to ${r.checkpoint}${r.removed ? '' : '; the old tree is left in trash (a mount inside?) for a sweep'}\n`,
      )
    return EXIT_OK
  } finally {
    await pool.close()
  }
}

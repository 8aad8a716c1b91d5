/**
 * Checkpoints (docs/checkpoints.md): a checkpoint is an unnamed template made by commit whose template.json carries
 * `checkpoint` (the workspace's id and the retention it was made with). This module owns lib/'s side of them: the
 * checks of checkpoint()'s options and of rollback()'s checkpoint, the retention rule (on checkpoint and by sweep),
 * and the listing. The Pool passes in its own calls (lib/pool.ts); the rollback itself is native/core/rollback.cc.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { native, type PoolHandle } from './binding.js'
import { ID, integerIn, invalidType, invalidValue, isPlainObject, optionsObject } from './args.js'
import { call, vmspaceError } from './errors.js'
import { leaseShardPath, templatesPath } from './layout.js'
import { Workspace } from './workspace.js'
import type { Checkpoint, CheckpointOptions, CheckpointRecord, CommitOptions, Template } from './types.js'

/** checkpoint()'s options, checked: the retention, and the rest as commit() takes them (commitOptions checks those). */
export function checkpointOptions(options: CheckpointOptions | undefined): { keepNewest?: number; maxAgeMs?: number; commit: CommitOptions } {
  const o = optionsObject<CheckpointOptions>('options', options, {
    meta: true, share: true, keepDevices: true, keepSetId: true, keepNewest: true, maxAgeMs: true, signal: true, onProgress: true,
  })
  const keepNewest = o.keepNewest === undefined ? undefined : integerIn('options.keepNewest', o.keepNewest, 1, 2 ** 31 - 1, 1)
  const maxAgeMs = o.maxAgeMs === undefined ? undefined : integerIn('options.maxAgeMs', o.maxAgeMs, 1, Number.MAX_SAFE_INTEGER, 1)
  const { keepNewest: _k, maxAgeMs: _m, ...commit } = o
  return { keepNewest, maxAgeMs, commit: commit as CommitOptions }
}

let lastCreatedAt = 0
/**
 * A new checkpoint's `createdAt` (ms since the epoch): Date.now(), but later than every one this process gave
 * before, so that two checkpoints made within one millisecond still have an order (newest first, retention).
 */
export function checkpointCreatedAt(): number {
  lastCreatedAt = Math.max(Date.now(), lastCreatedAt + 1)
  return lastCreatedAt
}

/** template.json's `checkpoint` member of a new checkpoint of workspace `workspace`. */
export function checkpointRecord(workspace: string, keepNewest: number | undefined, maxAgeMs: number | undefined): CheckpointRecord {
  const r: CheckpointRecord = { workspace }
  if (keepNewest !== undefined) r.keepNewest = keepNewest
  if (maxAgeMs !== undefined) r.maxAgeMs = maxAgeMs
  return r
}

/** template.json's `checkpoint` as read back, or undefined when it is not one. */
export function parseCheckpointRecord(value: unknown): CheckpointRecord | undefined {
  if (!isPlainObject(value) || typeof value.workspace !== 'string' || !ID.test(value.workspace)) return undefined
  return checkpointRecord(
    value.workspace,
    Number.isSafeInteger(value.keepNewest) && (value.keepNewest as number) >= 1 ? (value.keepNewest as number) : undefined,
    Number.isSafeInteger(value.maxAgeMs) && (value.maxAgeMs as number) >= 1 ? (value.maxAgeMs as number) : undefined,
  )
}

/** The workspace id of a Workspace or an id argument (`ERR_INVALID_ARG_TYPE`/`ERR_INVALID_ARG_VALUE` otherwise). */
export function workspaceIdArg(ws: unknown): string {
  if (ws instanceof Workspace) return ws.id
  if (typeof ws !== 'string') throw invalidType('ws', 'a Workspace or a workspace id', ws)
  if (!ID.test(ws)) throw invalidValue('ws', 'a workspace id (32 lowercase hex characters)', ws)
  return ws
}

/** The live checkpoints of workspace `id` among `all` (Pool.templates()), newest first. */
export function checkpointsOf(all: Template[], id: string): (Template & { checkpoint: CheckpointRecord })[] {
  return all
    .filter((t): t is Template & { checkpoint: CheckpointRecord } => t.checkpoint?.workspace === id && !t.retired && !t.error)
    .sort((a, b) => (b.createdAt ?? 0) - (a.createdAt ?? 0) || b.id.localeCompare(a.id))
}

/**
 * The checkpoints `newestFirst` (one workspace's) that its retention removes: those outside the newest `keepNewest`
 * and those older than `maxAgeMs` (each rule alone removes; neither given: none). The newest is never removed.
 */
export function retentionVictims(newestFirst: Template[], policy: { keepNewest?: number; maxAgeMs?: number }, now: number): Template[] {
  return newestFirst.filter(
    (t, i) =>
      i > 0 &&
      ((policy.keepNewest !== undefined && i >= policy.keepNewest) ||
        (policy.maxAgeMs !== undefined && now - (t.createdAt ?? 0) > policy.maxAgeMs)),
  )
}

/**
 * rollback()'s checkpoint argument resolved against `all`: `ERR_TEMPLATE_NOT_FOUND` when no template has that id,
 * `ERR_INVALID_ARG_VALUE` when it is not a checkpoint of workspace `id`. Returns the checkpoint's id.
 */
export function rollbackTarget(all: Template[], id: string, checkpoint: unknown, root: string): string {
  let ref: unknown = checkpoint
  if (isPlainObject(checkpoint) && typeof checkpoint.id === 'string') ref = checkpoint.id
  if (typeof ref !== 'string') throw invalidType('checkpoint', 'a Checkpoint or a checkpoint id', checkpoint)
  if (!ID.test(ref)) throw invalidValue('checkpoint', 'a checkpoint id (32 lowercase hex characters)', ref)
  const t = all.find((x) => x.id === ref && !x.retired)
  if (!t)
    throw vmspaceError('ERR_TEMPLATE_NOT_FOUND', `no template with the id '${ref}'`, { path: path.join(templatesPath(root), ref) })
  if (t.checkpoint?.workspace !== id) throw invalidValue('checkpoint', `a checkpoint of workspace ${id}`, ref)
  return ref
}

/** Checkpoint objects of `list` with their exclusive bytes, measured now; those removed meanwhile are left out. */
export async function withExclusiveBytes(handle: PoolHandle, list: (Template & { checkpoint: CheckpointRecord })[]): Promise<Checkpoint[]> {
  if (list.length === 0) return []
  const bytes = await call(native.templateExclusiveBytes(handle, list.map((t) => t.id)))
  const out: Checkpoint[] = []
  list.forEach((t, i) => {
    if (bytes[i] >= 0) out.push({ ...t, exclusiveBytes: bytes[i] })
  })
  return out
}

/**
 * Which workspaces (by id) still have their lease file: the ids among `ids` named by an entry of the pool's
 * `.vmspace/leases/<x>/` (x: the id's first hex digit), of any prefix.
 */
export async function workspacesWithLease(root: string, ids: Iterable<string>): Promise<Set<string>> {
  const shards = new Map<string, string[]>()
  const found = new Set<string>()
  for (const id of ids) {
    let names = shards.get(id[0])
    if (!names) {
      names = await fs.promises.readdir(leaseShardPath(root, id)).catch((e: NodeJS.ErrnoException) => {
        if (e.code === 'ENOENT') return []
        throw e
      })
      shards.set(id[0], names)
    }
    if (names.some((n) => n.endsWith('-' + id))) found.add(id)
  }
  return found
}

/**
 * What a sweep removes of the checkpoints in `all`: every checkpoint of a workspace whose lease file is gone, and
 * what the retention of each remaining workspace's newest checkpoint removes.
 */
export async function sweptCheckpoints(root: string, all: Template[], now: number): Promise<Template[]> {
  const byWorkspace = new Map<string, Template[]>()
  for (const t of all) if (t.checkpoint && !t.retired && !t.error) byWorkspace.set(t.checkpoint.workspace, [])
  const alive = await workspacesWithLease(root, byWorkspace.keys())
  const out: Template[] = []
  for (const id of byWorkspace.keys()) {
    const list = checkpointsOf(all, id)
    out.push(...(alive.has(id) ? retentionVictims(list, list[0].checkpoint!, now) : list))
  }
  return out
}

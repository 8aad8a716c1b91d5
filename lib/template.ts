/**
 * Templates: committed, read-only trees kept in the pool (`.vmspace/templates/`), cloned into new
 * workspaces with `allocate({ from })` and `fork()`. The on-disk layout and its rules: native/core/template.h.
 * This module owns lib/'s side of them: template.json (its writer, templateRecordMembers, and its reader,
 * templateInfo), the checks of commit's options and of template names, and the logic of Pool.fork, Pool.template
 * and Pool.pruneTemplates (the Pool passes in its own calls; its native handle stays in lib/pool.ts).
 */
import { jsonMembers, native, type JsonMembers, type NativeCloneResult, type NativeTemplateListing, type PoolHandle } from './binding.js'
import { abortSignal, boolean, ID, integerIn, invalidType, invalidValue, isPlainObject, optionsObject, sharePaths } from './args.js'
import { AbortError, call, fromNative, vmspaceError, type VmspaceError } from './errors.js'
import { toResult } from './clone.js'
import { metaText } from './metadata.js'
import { checkpointCreatedAt, parseCheckpointRecord } from './checkpoint.js'
import { templateMetaPath, templatesPath, templateTreePath } from './layout.js'
import { Workspace, workspaceMode } from './workspace.js'
import type {
  AllocateOptions,
  CheckpointRecord,
  CommitOptions,
  CommitResult,
  ForkOptions,
  ImageRecord,
  JsonObject,
  LayerRecord,
  PruneOptions,
  SharedFile,
  Template,
  TemplateUsage,
} from './types.js'

/** A template's record (its template.json text, read from `recordPath`), parsed; an error naming the file when it is not a JSON object. */
export function parseTemplateMeta(
  record: string,
  recordPath: string,
): { ok: true; value: Record<string, unknown> } | { ok: false; error: VmspaceError } {
  let parsed: unknown
  try {
    parsed = JSON.parse(record)
  } catch {
    parsed = undefined
  }
  if (!isPlainObject(parsed))
    return {
      ok: false,
      error: vmspaceError('ERR_CORRUPT_METADATA', `template metadata ${recordPath} is not a JSON object`, { path: recordPath }),
    }
  return { ok: true, value: parsed }
}

export function templateInfo(root: string, t: NativeTemplateListing): Template {
  const info: Template = {
    id: t.id,
    name: t.currentName || null,
    current: t.currentName !== '',
    path: templateTreePath(root, t.id),
    parent: null,
    lastUsedAt: t.lastUsedMs || null,
    retired: t.retired,
  }
  if (t.record === undefined) {
    info.error = fromNative(t.recordError) as VmspaceError
    return info
  }
  const parsed = parseTemplateMeta(t.record, t.recordPath)
  if (!parsed.ok) {
    info.error = parsed.error
    return info
  }
  const p = parsed.value
  if (typeof p.name === 'string') info.name = p.name
  if (typeof p.createdAt === 'number') info.createdAt = p.createdAt
  if (typeof p.parent === 'string') info.parent = p.parent
  if (isPlainObject(p.meta)) info.meta = p.meta as JsonObject
  if (p.method === 'reflink' || p.method === 'copy' || p.method === 'mixed' || p.method === 'snapshot') info.method = p.method
  if (p.subvolume === true) info.subvolume = true
  if (isPlainObject(p.usage)) info.usage = p.usage as unknown as TemplateUsage
  if (isPlainObject(p.layer) && typeof p.layer.chainId === 'string') info.layer = p.layer as unknown as LayerRecord
  if (isPlainObject(p.image) && Array.isArray(p.image.layers)) info.image = p.image as unknown as ImageRecord
  if (Array.isArray(p.shared)) info.shared = p.shared as SharedFile[]
  const checkpoint = parseCheckpointRecord(p.checkpoint)
  if (checkpoint) info.checkpoint = checkpoint
  return info
}

export async function listTemplates(handle: PoolHandle, root: string): Promise<Template[]> {
  const list = (await call(native.listTemplates(handle))) as NativeTemplateListing[]
  return list.map((t) => templateInfo(root, t)).sort((a, b) => (a.createdAt ?? 0) - (b.createdAt ?? 0) || a.id.localeCompare(b.id))
}

/** Template names: 1–128 of `[A-Za-z0-9._-]`, starting with a letter or digit, and not 32 hex (an id's shape). */
export const TEMPLATE_NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/

/** Which templates a prune removes: outside the newest `keepNewest` of their name, or unused for `unusedForMs`. */
export function pruneCandidates(all: Template[], o: { keepNewest?: number; unusedForMs?: number; name?: string }, now: number): Template[] {
  const chosen = new Set<Template>()
  const pool = all.filter((t) => !t.retired && !t.error && (o.name === undefined || t.name === o.name))
  if (o.keepNewest !== undefined) {
    const byName = new Map<string, Template[]>()
    for (const t of pool) if (t.name !== null) byName.set(t.name, [...(byName.get(t.name) ?? []), t])
    for (const group of byName.values()) {
      // The current one (its name points there) is kept and counts first, whatever createdAt says: a commit that
      // started earlier can be swapped in after one that started later.
      group.sort((a, b) => Number(b.current) - Number(a.current) || (b.createdAt ?? 0) - (a.createdAt ?? 0))
      for (const t of group.slice(o.keepNewest)) if (!t.current) chosen.add(t)
    }
  }
  if (o.unusedForMs !== undefined)
    for (const t of pool) if (now - (t.lastUsedAt ?? t.createdAt ?? 0) >= o.unusedForMs) chosen.add(t)
  return pool.filter((t) => chosen.has(t))
}

/** An id or a name of a template (checked for shape; existence is the native side's). */
export function templateRef(name: string, value: unknown): string | undefined {
  if (value === undefined) return undefined
  if (typeof value !== 'string') throw invalidType(name, 'a template id or name', value)
  if (!TEMPLATE_NAME.test(value)) throw invalidValue(name, 'a template id (32 hex) or name (1-128 of [A-Za-z0-9._-])', value)
  return value
}

/** A new template's name (1–128 of `[A-Za-z0-9._-]`, not an id's shape), or undefined when not given. */
export function templateName(name: string, value: unknown): string | undefined {
  if (value === undefined) return undefined
  if (typeof value !== 'string') throw invalidType(name, 'a string', value)
  if (!TEMPLATE_NAME.test(value) || ID.test(value)) throw invalidValue(name, '1-128 characters of [A-Za-z0-9._-], not 32 hex characters', value)
  return value
}

/** commit()'s arguments, checked (nothing is touched yet): the name ('' for none), and `meta` as JSON text. */
export function commitOptions(ws: unknown, options: CommitOptions | undefined) {
  if (!(ws instanceof Workspace) && typeof ws !== 'string') throw invalidType('ws', 'a Workspace or a workspace id', ws)
  if (typeof ws === 'string' && !ID.test(ws)) throw invalidValue('ws', 'a workspace id (32 lowercase hex characters)', ws)
  const o = optionsObject<CommitOptions>('options', options, {
    name: true, meta: true, replace: true, signal: true, onProgress: true, keepDevices: true, keepSetId: true, share: true,
  })
  const name = templateName('options.name', o.name) ?? ''
  const share = sharePaths('options.share', o.share) ?? []
  const replace = boolean('options.replace', o.replace, false)
  const signal = abortSignal('options.signal', o.signal)
  if (o.onProgress !== undefined && typeof o.onProgress !== 'function') throw invalidType('options.onProgress', 'a function', o.onProgress)
  const keepDevices = boolean('options.keepDevices', o.keepDevices, false)
  const keepSetId = boolean('options.keepSetId', o.keepSetId, false)
  return { name, replace, signal, onProgress: o.onProgress, meta: metaText(o.meta), keepDevices, keepSetId, share }
}

/** A Workspace object as the source of a commit: `ERR_DISPOSED` unless it is ready. */
export function readySource(ws: Workspace): { path: string; templateId?: string } {
  if (ws.status !== 'ready') throw vmspaceError('ERR_DISPOSED', `workspace ${ws.name} was disposed`, { path: ws.path })
  return ws
}

/**
 * template.json's members lib/ writes (format, createdAt, parent, meta: JSON text, and a checkpoint's record); the
 * core adds id, name, method, usage.
 */
export function templateRecordMembers(parent: string | undefined, meta: string, checkpoint?: CheckpointRecord): JsonMembers {
  const createdAt = checkpoint ? checkpointCreatedAt() : Date.now()
  return jsonMembers({ format: 1, createdAt, parent: parent ?? null, checkpoint }, ['meta', meta])
}

/** What commit() returns, from the native commit's result. */
export function commitResult(
  root: string,
  r: { id: string; record: string; clone: NativeCloneResult; replacedId?: string; replacedRemoved?: boolean },
  name: string,
): CommitResult {
  const metaPath = templateMetaPath(root, r.id)
  const base = templateInfo(root, { id: r.id, currentName: name, lastUsedMs: 0, retired: false, recordPath: metaPath, record: r.record })
  base.lastUsedAt = base.createdAt ?? null
  const result: CommitResult = { ...base, clone: toResult(r.clone, base.path) }
  if (r.replacedId !== undefined) result.replaced = { id: r.replacedId, removed: r.replacedRemoved === true }
  return result
}

/** The Pool's calls fork uses (the Pool itself). */
interface ForkHost {
  commit(
    ws: Workspace | string,
    options: { signal?: AbortSignal; meta: JsonObject; keepDevices: boolean; keepSetId: boolean; share?: string[] },
  ): Promise<CommitResult>
  allocate(options: AllocateOptions): Promise<Workspace>
  removeTemplate(id: string): Promise<unknown>
}

/** Pool.fork: one commit of `ws`, `count` allocates from it at once, the template removed; all or nothing. */
export async function forkFrom(pool: ForkHost, ws: Workspace | string, count: number, options: ForkOptions | undefined): Promise<Workspace[]> {
  const n = integerIn('count', count, 1, 4096, 1)
  const o = optionsObject<ForkOptions>('options', options, {
    meta: true, mode: true, signal: true, onProgress: true, keepDevices: true, keepSetId: true, share: true,
  })
  const signal = abortSignal('options.signal', o.signal)
  const share = sharePaths('options.share', o.share)
  if (o.onProgress !== undefined && typeof o.onProgress !== 'function') throw invalidType('options.onProgress', 'a function', o.onProgress)
  metaText(o.meta)
  workspaceMode('options.mode', o.mode)
  const keepDevices = boolean('options.keepDevices', o.keepDevices, false)
  const keepSetId = boolean('options.keepSetId', o.keepSetId, false)
  const t = await pool.commit(ws, { signal, meta: { forkOf: typeof ws === 'string' ? ws : ws.id }, keepDevices, keepSetId, share })
  const made: Workspace[] = []
  let done = 0
  try {
    const results = await Promise.allSettled(
      Array.from({ length: n }, async () => {
        const child = await pool.allocate({ from: t.id, meta: o.meta, mode: o.mode, signal })
        made.push(child)
        done++
        o.onProgress?.({ done, count: n })
        return child
      }),
    )
    const failed = results.find((r): r is PromiseRejectedResult => r.status === 'rejected')
    if (failed) throw failed.reason
    if (signal?.aborted) throw new AbortError(signal.reason)
    return results.map((r) => (r as PromiseFulfilledResult<Workspace>).value)
  } catch (e) {
    await Promise.allSettled(made.map((w) => w.dispose()))
    throw e
  } finally {
    await pool.removeTemplate(t.id).catch(() => {})
  }
}

/**
 * Pool.template: the template `idOrName` of the pool at `root`, from `list` (Pool.templates); `nameTarget` asks the
 * core what a name's link holds now (native templateNameTarget).
 */
export async function findTemplate(
  root: string,
  idOrName: string,
  list: () => Promise<Template[]>,
  nameTarget: (name: string) => Promise<string | null>,
): Promise<Template> {
  const ref = templateRef('idOrName', idOrName)!
  const byId = ID.test(ref)
  const target = async () => (byId ? null : await nameTarget(ref).catch(() => null))
  let t: Template | undefined
  // The listing reads names/ before the templates: a replace between the two shows the old id named and gone.
  // Not found only when the name is missing, or still points where it did before the listing.
  for (let tries = 0, before = await target(); tries < 16; tries++) {
    const all = await list()
    t = byId ? all.find((x) => x.id === ref && !x.retired) : all.find((x) => x.current && x.name === ref)
    const after = await target()
    if (t || after === null || after === before) break
    before = after
  }
  if (!t) throw vmspaceError('ERR_TEMPLATE_NOT_FOUND', `no template with the id or name '${ref}'`, { path: templatesPath(root) })
  return t
}

/**
 * Pool.pruneTemplates: the options checked, the templates chosen from `list` (Pool.templates), each removed by
 * `remove` (the native removeTemplate of the pool).
 */
export async function pruneTemplates(
  options: PruneOptions,
  list: () => Promise<Template[]>,
  remove: (id: string, unlessCurrent: boolean) => Promise<{ removed: boolean; kept: boolean }>,
): Promise<{ removed: Template[]; deferred: Template[] }> {
  const o = optionsObject<PruneOptions>('options', options, { keepNewest: true, unusedForMs: true, name: true, dryRun: true })
  const keepNewest = o.keepNewest === undefined ? undefined : integerIn('options.keepNewest', o.keepNewest, 0, 2 ** 31 - 1, 0)
  const unusedForMs = o.unusedForMs === undefined ? undefined : integerIn('options.unusedForMs', o.unusedForMs, 0, Number.MAX_SAFE_INTEGER, 0)
  if (keepNewest === undefined && unusedForMs === undefined)
    throw invalidValue('options', 'keepNewest and/or unusedForMs', options)
  const name = o.name === undefined ? undefined : templateRef('options.name', o.name)
  const dryRun = boolean('options.dryRun', o.dryRun, false)
  const all = await list()
  const now = Date.now()
  const chosen = withLayerRule(all, pruneCandidates(all, { keepNewest, unusedForMs, name }, now))
  // Chosen by age: removed even when current (its name goes). Chosen only as an older version: removed only
  // while no name points to it and no commit or reader holds it (native unlessCurrent), else left for later.
  const aged = new Set(unusedForMs === undefined ? [] : pruneCandidates(all, { unusedForMs, name }, now).map((t) => t.id))
  const removed: Template[] = []
  const deferred: Template[] = []
  for (const t of chosen) {
    if (dryRun) {
      removed.push(t)
      continue
    }
    try {
      const r = await remove(t.id, !aged.has(t.id))
      if (r.kept) continue
      ;(r.removed ? removed : deferred).push(t)
    } catch (e) {
      if ((e as VmspaceError).code !== 'ERR_TEMPLATE_NOT_FOUND') throw e // removed meanwhile by someone else
    }
  }
  return { removed, deferred }
}

/** The chainIDs that the live image templates of `all` list. */
export function listedChains(all: Template[]): Set<string> {
  return new Set(all.filter((t) => t.image && !t.retired).flatMap((t) => t.image!.layers.map((l) => l.chainId)))
}

/** The live layer templates of `all` that no live image template of `all` lists. */
export function unlistedLayers(all: Template[]): Template[] {
  const listed = listedChains(all)
  return all.filter((t) => t.layer && !t.retired && !t.error && !listed.has(t.layer.chainId))
}

/**
 * A prune's choice with the layer rule (docs/images.md): never a layer template that an image kept lists, and
 * every layer template that no image kept lists.
 */
function withLayerRule(all: Template[], chosen: Template[]): Template[] {
  const kept = all.filter((t) => !chosen.includes(t))
  const listed = listedChains(kept)
  const out = chosen.filter((t) => !(t.layer && listed.has(t.layer.chainId)))
  for (const t of unlistedLayers(kept)) if (!out.includes(t)) out.push(t)
  return out
}

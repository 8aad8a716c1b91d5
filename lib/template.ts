/**
 * Templates: committed, read-only trees kept in the pool (`.vmspace/templates/`), cloned into new
 * workspaces with `allocate({ from })` and `fork()`. The on-disk layout and its rules: native/core/template.h.
 */
import * as path from 'node:path'
import { native, type NativeTemplateListing, type PoolHandle } from './binding.js'
import { isPlainObject } from './args.js'
import { call, fromNative, vmspaceError, type VmspaceError } from './errors.js'
import type { JsonObject, Template, TemplateUsage } from './types.js'

/** The template.json text of `id`, parsed; an error (with the file's path) when it is not a JSON object. */
export function parseTemplateMeta(
  metaText: string,
  metaPath: string,
): { ok: true; value: Record<string, unknown> } | { ok: false; error: VmspaceError } {
  let parsed: unknown
  try {
    parsed = JSON.parse(metaText)
  } catch {
    parsed = undefined
  }
  if (!isPlainObject(parsed))
    return {
      ok: false,
      error: vmspaceError('ERR_CORRUPT_METADATA', `template metadata ${metaPath} is not a JSON object`, { path: metaPath }),
    }
  return { ok: true, value: parsed }
}

export function templateInfo(root: string, t: NativeTemplateListing): Template {
  const info: Template = {
    id: t.id,
    name: t.currentName || null,
    current: t.currentName !== '',
    path: path.join(root, '.vmspace', 'templates', t.id, 'tree'),
    parent: null,
    lastUsedAt: t.lastUsedMs || null,
    retired: t.retired,
  }
  if (t.metaText === undefined) {
    info.error = fromNative(t.metaError) as VmspaceError
    return info
  }
  const parsed = parseTemplateMeta(t.metaText, t.metaPath)
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
  return info
}

export async function listTemplates(handle: PoolHandle, root: string): Promise<Template[]> {
  const list = (await call(native.listTemplates(handle))) as NativeTemplateListing[]
  return list.map((t) => templateInfo(root, t)).sort((a, b) => (a.createdAt ?? 0) - (b.createdAt ?? 0) || a.id.localeCompare(b.id))
}

/** Template names: 1–128 of `[A-Za-z0-9._-]`, starting with a letter or digit, and not 32 hex (an id's shape). */
export const TEMPLATE_NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/
export const TEMPLATE_ID = /^[0-9a-f]{32}$/

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

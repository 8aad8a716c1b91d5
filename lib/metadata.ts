/**
 * A workspace's metadata record: the JSON object kept in its lease file (`.vmspace/leases/<x>/<name>`), written
 * once when the workspace is built and read by list() and adopt(). This module owns lib/'s side of it: the fields
 * (FIELDS), the writer of the members lib/ supplies (recordMembers), and the reader that turns a record into a
 * {@link WorkspaceInfo} (readRecord). The core appends its own members (name, template, templateId) and writes the
 * object in one write (native/core). A new field: its member in recordMembers and its entry in FIELDS here, its
 * documentation in WorkspaceInfo (lib/types.ts; FIELDS must name every record field of it, or this does not
 * compile), and the core's side if the core writes it.
 */
import * as os from 'node:os'
import * as path from 'node:path'
import { jsonMembers, type JsonMembers } from './binding.js'
import { exactJson, invalidType, invalidValue, isPlainObject } from './args.js'
import { fromNative, vmspaceError, type VmspaceError } from './errors.js'
import { leasePath } from './layout.js'
import type { WorkspaceInfo } from './types.js'

/** The largest `meta` (allocate, commit), in bytes of its JSON text. */
export const MAX_META_BYTES = 64 * 1024

/** The record's format (its `format` member). */
const FORMAT = 1

/** WorkspaceInfo's members that come from the record (the others are the entry's name, path and state). */
type RecordField = Exclude<keyof WorkspaceInfo, 'id' | 'name' | 'path' | 'live' | 'error' | 'usage'>

/** The JSON kind a record member must have to be reported; a member of another kind is left out. */
type FieldKind = 'number' | 'string' | 'object' | 'array'

/** The record's fields as WorkspaceInfo reports them, in this order, each with the kind it must have. */
const FIELDS: { readonly [K in RecordField]-?: FieldKind } = {
  createdAt: 'number',
  meta: 'object',
  template: 'array',
  templateId: 'string',
  pid: 'number',
  uid: 'number',
  hostname: 'string',
  bootId: 'string',
  quota: 'object',
}

const NAME = /^(.+)-([0-9a-f]{32})$/

/** The id of the workspace named `name`: its last 32 hex digits, or the whole name without the `<prefix>-<id>` shape. */
export function workspaceId(name: string): string {
  return NAME.exec(name)?.[2] ?? name
}

/** The record's pid, uid, hostname and bootId members as JSON text: one process's, the same for all its workspaces. */
export function ownerMembers(bootId: string): JsonMembers {
  return jsonMembers({ pid: process.pid, uid: process.geteuid!(), hostname: hostname(), bootId })
}

/**
 * The members lib/ writes, in this order: format, createdAt, the owner's (pid, uid, hostname, bootId: `owner`, from
 * ownerMembers), quota (when one is set), meta. `meta` is the JSON text metaText checked, put in as it is, not
 * parsed and serialised again; string concatenation, as this is on the path of every allocate.
 */
export function recordMembers(owner: JsonMembers, quotaBytes: number, quotaInodes: number, meta: string): JsonMembers {
  const quota = quotaBytes || quotaInodes ? { ...(quotaBytes ? { bytes: quotaBytes } : {}), ...(quotaInodes ? { inodes: quotaInodes } : {}) } : undefined
  return '"format":' + FORMAT + ',"createdAt":' + Date.now() + ',' + owner + (quota ? ',"quota":' + JSON.stringify(quota) : '') + ',"meta":' + meta
}

/**
 * The WorkspaceInfo of the published entry `name` of the pool at `root`, from its record's text (`record`, or
 * `recordError`, the native error of reading it). A record that is missing or not a JSON object is the entry's
 * `error` (`ERR_CORRUPT_METADATA` with the lease file's path), never read as empty; members of the wrong kind are
 * left out.
 */
export function readRecord(root: string, name: string, live: boolean, record: string | undefined, recordError: unknown): WorkspaceInfo {
  const info: WorkspaceInfo = { id: workspaceId(name), name, path: path.join(root, name), live }
  if (record === undefined) {
    info.error = fromNative(recordError) as VmspaceError
    return info
  }
  let parsed: unknown
  try {
    parsed = JSON.parse(record)
  } catch {
    parsed = undefined
  }
  if (!isPlainObject(parsed)) {
    info.error = vmspaceError('ERR_CORRUPT_METADATA', `metadata of ${name} is not a JSON object`, { path: leasePath(root, name) })
    return info
  }
  const members = info as unknown as Record<string, unknown>
  for (const [key, kind] of Object.entries(FIELDS)) {
    const value = parsed[key]
    if (ofKind(value, kind)) members[key] = value
  }
  return info
}

function ofKind(value: unknown, kind: FieldKind): boolean {
  if (kind === 'object') return isPlainObject(value)
  if (kind === 'array') return Array.isArray(value)
  return typeof value === kind
}

/** `meta` (allocate's, commit's) as JSON text, checked: a JSON object of at most MAX_META_BYTES. */
export function metaText(meta: unknown): string {
  if (meta === undefined) return '{}'
  if (!isPlainObject(meta)) throw invalidType('options.meta', 'a JSON object', meta)
  // Refused rather than changed by JSON.stringify (a Date, undefined, NaN...): list() gives back what was given.
  const text = exactJson('options.meta', meta)
  const bytes = Buffer.byteLength(text)
  if (bytes > MAX_META_BYTES) throw invalidValue('options.meta', `at most ${MAX_META_BYTES} bytes of JSON (it is ${bytes})`, meta, true)
  return text
}

let cachedHostname: string | undefined
// os.hostname() is a uname(2) per call; the name is recorded per workspace, so read it once.
function hostname(): string {
  return (cachedHostname ??= os.hostname())
}

/**
 * @internal The pool's on-disk layout as lib/ needs it (docs/pool-on-disk.md): every path lib/ shows or reads,
 * built from the core's names (native/core/layout.h, through the binding), so that no other file of lib/ spells one.
 */
import * as path from 'node:path'
import { native } from './binding.js'

const names = native.layout

/** The name of the pool's own directory in its root (`.vmspace`). */
export const STATE_DIR = names.stateDir

/** A staging shard's name (`s0` ... `s7`): workspaces are built in the shards, never in staging/ itself. */
export const STAGING_SHARD = /^s\d+$/

/**
 * An image-backed pool's marker, left in the mount point under the mount (`<root>/.vmspace-image`, 0444, the image's
 * path): seen only while the image is not mounted, so that opening the pool without it (a pool on the host's file
 * system in the empty mount point) is refused (docs/image-pool.md). lib/'s own: the core never sees it.
 */
export const MOUNT_POINT_MARKER = '.vmspace-image'

/** `<root>/.vmspace`. */
export function statePath(root: string): string {
  return path.join(root, names.stateDir)
}

/** `<root>/.vmspace/staging`: its shards hold the workspaces being built. */
export function stagingPath(root: string): string {
  return path.join(statePath(root), names.staging)
}

/** `<root>/.vmspace/trash`: workspaces (and templates) being removed. */
export function trashPath(root: string): string {
  return path.join(statePath(root), names.trash)
}

/** The lease file of workspace `name` (`<root>/.vmspace/leases/<x>/<name>`), which holds its record. */
export function leasePath(root: string, name: string): string {
  return native.leasePath(root, name)
}

/** The lease shard directory that holds the lease files of workspaces with the id `id`, whatever their prefix. */
export function leaseShardPath(root: string, id: string): string {
  return native.leaseShardPath(root, id)
}

/** `<root>/.vmspace/templates`. */
export function templatesPath(root: string): string {
  return path.join(statePath(root), names.templates)
}

/** The tree of template `id`, what its workspaces are cloned from. */
export function templateTreePath(root: string, id: string): string {
  return path.join(templatesPath(root), id, names.tree)
}

/** The template.json (its record) of template `id`. */
export function templateMetaPath(root: string, id: string): string {
  return path.join(templatesPath(root), id, names.templateMeta)
}

/** The link of template name `name` (`templates/names/<name>`), as errors show it. */
export function templateNamePath(root: string, name: string): string {
  return path.join(templatesPath(root), names.names, name)
}

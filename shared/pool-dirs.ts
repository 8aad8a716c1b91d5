/**
 * The pool's own entries that the vmspace command (cli/) and the demo (demo/) look at from outside the library, as
 * docs/pool-on-disk.md documents them (`vmspace-pool 1`), relative to a pool's root. The library builds its paths
 * from the core's names (lib/layout.ts, native/core/layout.h); these tools read the documented format instead, on
 * purpose: the CLI tells a pool from another directory before it opens one, and the demo's checks of what dispose
 * and sweep leave behind must not take the code they check at its word about where to look.
 */
import * as path from 'node:path'

export const POOL_DIRS = {
  /** The pool's own directory: its presence (with `version`) is what makes a directory a pool. */
  state: '.vmspace',
  /** The layout's version file. */
  version: path.join('.vmspace', 'version'),
  /** Builds, in the shards s0 ... s7. */
  staging: path.join('.vmspace', 'staging'),
  /** Workspaces being removed. */
  trash: path.join('.vmspace', 'trash'),
  /** Lease files, in the shards 0 ... f. */
  leases: path.join('.vmspace', 'leases'),
} as const

/** A spare lease file's name starts so (a pool's own, removed by its close()). */
export const SPARE_PREFIX = '.spare-'

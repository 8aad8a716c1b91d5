/**
 * A pool's gauges for monitoring (docs/metrics.md): its workspaces by state, the entries of its staging shards and
 * trash, its file system's space and this process's warm reserve, read from the pool when asked.
 */
import * as fsp from 'node:fs/promises'
import * as path from 'node:path'
import { invalidType } from './args.js'
import { STAGING_SHARD, stagingPath, trashPath } from './layout.js'
import type { Pool } from './pool.js'
import type { WarmStats } from './types.js'

/** A pool's figures at one moment ({@link poolGauges}). Counts; bytes. */
export interface PoolGauges {
  /** The pool's root directory. */
  root: string
  /**
   * Workspaces by state: published with a held lease (`live`) or without (`free`: reclaimable by a sweep),
   * entries being built in the staging shards (warm reserve entries included) and entries in the trash.
   */
  workspaces: {
    /** Published, lease held by a process. */
    live: number
    /** Published, lease held by no process: a sweep reclaims it. */
    free: number
    /** Being built in the staging shards (warm reserve entries included). */
    staging: number
    /** In the trash, being removed. */
    trash: number
  }
  /** Published workspaces whose record could not be read (their `error` in Pool.list()). */
  unreadable: number
  /** Published workspaces allocated with a `quota`. */
  quota: number
  /** The pool file system's space (statfs(2)): free (f_bfree), available to unprivileged users (f_bavail), size. */
  fs: {
    /** Free bytes (f_bfree × f_bsize). */
    freeBytes: number
    /** Bytes available to unprivileged users (f_bavail × f_bsize). */
    availableBytes: number
    /** The file system's size in bytes (f_blocks × f_bsize). */
    sizeBytes: number
  }
  /** This process's warm reserve of that pool (Pool.warmStats()), or undefined without one. */
  warm?: Pick<WarmStats, 'ready' | 'hits' | 'misses' | 'stale' | 'built' | 'buildFailures'> & {
    /** The reserve's size (WarmStats.count). */
    size: number
  }
}

async function entriesIn(dir: string): Promise<number> {
  try {
    return (await fsp.readdir(dir)).length
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return 0
    throw e
  }
}

/**
 * Reads a pool's gauges: one Pool.list() (each workspace's record and a lease probe; no tree is walked, whatever the
 * pool holds), a readdir of each staging shard and of the trash, one statfs(2). Throws as Pool.list()
 * (`ERR_POOL_CLOSED` once the pool is closed) and the errno of the readdir or statfs.
 */
export async function poolGauges(pool: Pool): Promise<PoolGauges> {
  if (!pool || typeof (pool as Partial<Pool>).list !== 'function') throw invalidType('pool', 'a Pool', pool)
  const list = await pool.list()
  const stagingDir = stagingPath(pool.root)
  const shards = (await fsp.readdir(stagingDir)).filter((n) => STAGING_SHARD.test(n))
  const staging = (await Promise.all(shards.map((s) => entriesIn(path.join(stagingDir, s))))).reduce((a, b) => a + b, 0)
  const trash = await entriesIn(trashPath(pool.root))
  const sfs = await fsp.statfs(pool.root)
  const live = list.filter((w) => w.live).length
  const g: PoolGauges = {
    root: pool.root,
    workspaces: { live, free: list.length - live, staging, trash },
    unreadable: list.filter((w) => w.error !== undefined).length,
    quota: list.filter((w) => w.quota !== undefined).length,
    fs: { freeBytes: sfs.bfree * sfs.bsize, availableBytes: sfs.bavail * sfs.bsize, sizeBytes: sfs.blocks * sfs.bsize },
  }
  const w = pool.warmStats()
  if (w) g.warm = { size: w.count, ready: w.ready, hits: w.hits, misses: w.misses, stale: w.stale, built: w.built, buildFailures: w.buildFailures }
  return g
}

/** @internal Gauges of every pool, a pool that cannot be read (closed, its directory gone) as `undefined`. */
export async function readPools(pools: Iterable<Pool>): Promise<[string, PoolGauges | undefined][]> {
  return Promise.all(
    [...pools].map(async (p): Promise<[string, PoolGauges | undefined]> => {
      try {
        return [p.root, await poolGauges(p)]
      } catch {
        return [p.root, undefined]
      }
    }),
  )
}

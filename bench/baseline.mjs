// `--baseline DIR`: an earlier version of vmspace (a checkout with its dist/ and build/ built), timed in the same
// run as this one (bench/run.mjs, bench/throughput.mjs). The earlier versions made pools in formats 1–3
// (`openPool(root, { format })`), 1 by default; format 3 was their fastest, and this version's one layout keeps what
// made it fast, so the baseline's pools are format 3: against its default, the comparison would credit this
// version with what format 3 already had. A baseline that no longer takes `format` (one layout, as this version)
// is opened as it is; the label says which was measured.
import { createRequire } from 'node:module'
import * as path from 'node:path'

const require = createRequire(import.meta.url)

/** The earlier version's package, or undefined without `dir`. */
export function loadBaseline(dir) {
  return dir ? require(path.join(path.resolve(dir), 'dist', 'index.js')) : undefined
}

/** A pool of the earlier version at `root`, format 3 where it has formats. */
export async function openBaselinePool(lib, root) {
  try {
    return await lib.openPool(root, { format: 3 })
  } catch (e) {
    if (e.code !== 'ERR_INVALID_ARG_VALUE' || !/format/.test(e.message)) throw e
    return lib.openPool(root)
  }
}

/** How rows name the earlier version's pool: "baseline (format 3)", or "baseline" for one without formats. */
export function baselineLabel(pool) {
  return pool.format === undefined ? 'baseline' : `baseline (format ${pool.format})`
}

/** The label of the pool `openBaselinePool` makes at `root`, for a process that only names it (children time it). */
export async function nameBaselinePool(lib, root) {
  const pool = await openBaselinePool(lib, root)
  await pool.close()
  return baselineLabel(pool)
}

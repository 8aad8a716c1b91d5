/**
 * Phase 3, checks: that every worker finished, that each workspace passed its isolation checks and was disposed,
 * that no two shared a path or id, that the base (or template tree) is unchanged, and, after the chaos phase,
 * that nothing is left in the pool.
 */
import type { Demo, Made } from './context.js'
import { describe } from './protocol.js'
import type { RunResult } from './run.js'
import type { Setup } from './setup.js'
import { entriesText, poolEntries, sha256, status, treeManifest, type Manifest } from './util.js'

export interface Checked {
  /** What the killed workers never finished: theirs to leave behind, checked by the sweep of the chaos phase. */
  orphaned: Made[]
  /** The rest: what must have been made, checked and disposed. */
  lived: Made[]
  checked: Made[]
  isolated: Made[]
  disposed: Made[]
  distinctPaths: number
  distinctIds: number
  hashAfter: string
  treeAfter?: Manifest
  /** The original template (where the workers cloned a copy of it) is unchanged too. */
  originalSame: boolean
}

/** Workers that died early or failed (those killed by --chaos are reported by the chaos phase). */
export function checkWorkers(demo: Demo): void {
  for (const w of demo.workers) {
    if (w.chaosKilled && !w.fatal) continue // reported in the chaos rows
    if (w.exited && (!w.finished || w.exitText || w.fatal)) {
      let text = `worker ${w.index} (pid ${w.child.pid}) ${w.exitText ?? 'exited'} before finishing`
      if (w.finished && w.exitText) text = `worker ${w.index} (pid ${w.child.pid}) ${w.exitText}`
      if (!w.finished)
        text +=
          `, holding ${w.live.size} workspace(s) it had reported and any it was still allocating: they stay in the ` +
          `pool with their leases free, for a sweep to reclaim`
      if (w.fatal) text += `:\n    ${w.fatal.split('\n').join('\n    ')}`
      else if (w.stderr.trim()) text += `; its last output:\n    ${w.stderr.trim().split('\n').slice(-10).join('\n    ')}`
      demo.failures.push(text)
    }
  }
  if (demo.interrupted) demo.failures.push('interrupted')
}

export async function checkWorkspaces(demo: Demo, s: Setup, r: RunResult): Promise<Checked> {
  const { failures } = demo
  const total = demo.opts.vms
  const { records, failed } = r
  const killedIndexes = new Set(demo.workers.filter((w) => w.chaosKilled).map((w) => w.index))
  const orphaned = records.filter((m) => killedIndexes.has(m.worker) && !m.checked)
  const lived = records.filter((m) => !orphaned.includes(m))
  const checked = lived.filter((m) => m.checked)
  const isolated = checked.filter((m) => m.checked!.marker && m.checked!.markerFile && m.checked!.contents)
  const disposed = checked.filter((m) => m.checked!.disposed)
  const distinctPaths = new Set(records.map((m) => m.path)).size
  const distinctIds = new Set(records.map((m) => m.id)).size
  if (failed.length) {
    const shown = [...new Set(failed.map((f) => `${f.stage}: ${f.error}`))].slice(0, 3)
    failures.push(`${failed.length} allocate(s) failed, e.g.:\n    ${shown.join('\n    ')}`)
  }
  if (demo.opts.quota !== undefined) {
    const q = r.runaway
    if (!q) failures.push('--quota: the runaway writer never reported')
    else if (q.code !== 'EDQUOT')
      failures.push(`--quota: the runaway writer in ${q.id} met ${q.code ?? 'no refusal'} after ${q.bytes} bytes, not EDQUOT`)
    else if (q.bytes > demo.opts.quota) failures.push(`--quota: the runaway writer wrote ${q.bytes} bytes, more than the quota (${demo.opts.quota})`)
  }
  if (lived.length < total)
    failures.push(`only ${lived.length} of ${total} workspaces were made${r.crashSeen || demo.interrupted ? ' (the workers were stopped early)' : ''}`)
  if (isolated.length < lived.length) {
    const bad = checked.filter((m) => !isolated.includes(m)).slice(0, 3)
    failures.push(
      `${lived.length - isolated.length} workspace(s) failed the isolation checks or were never checked` +
        (bad.length ? `, e.g.:\n    ${bad.map((m) => `${m.name}: ${m.checked!.problems.join('; ')}`).join('\n    ')}` : ''),
    )
  }
  if (disposed.length < lived.length) failures.push(`${lived.length - disposed.length} workspace(s) were not disposed cleanly`)
  if (distinctPaths < records.length || distinctIds < records.length)
    failures.push(`workspaces shared paths or ids: ${distinctPaths} distinct paths, ${distinctIds} distinct ids for ${records.length} workspaces`)

  const c: Checked = { orphaned, lived, checked, isolated, disposed, distinctPaths, distinctIds, hashAfter: '', originalSame: true }
  await checkSources(demo, s, c)
  return c
}

/** The base (sha256) or the template tree (full manifest, and its original where a copy was used) is unchanged. */
async function checkSources(demo: Demo, s: Setup, c: Checked): Promise<void> {
  const { failures } = demo
  if (s.base) {
    status('hashing the base again')
    c.hashAfter = await sha256(s.base.path)
    if (c.hashAfter !== s.hashBefore) failures.push(`the base changed: sha256 ${s.hashBefore} before, ${c.hashAfter} after`)
  }
  const tree = s.tree
  if (tree) {
    status('hashing the template tree again')
    const after = await treeManifest(tree.spec.dir, { contents: true })
    c.treeAfter = after
    if (after.digest !== tree.before.digest)
      failures.push(
        `the template ${tree.spec.dir} changed: ${tree.before.entries} entries (${tree.before.digest.slice(0, 16)}...) before, ` +
          `${after.entries} (${after.digest.slice(0, 16)}...) after`,
      )
    if (tree.originalBefore) {
      const originalAfter = await treeManifest(tree.original, { contents: true })
      c.originalSame = originalAfter.digest === tree.originalBefore.digest
      if (!c.originalSame) failures.push(`the template ${tree.original} changed during the run`)
    }
  }
}

/**
 * Disposes the base's workspace and closes the pool; whatever the run added to the pool and left there is a
 * failure, which a sweep then tries to reclaim. Returns the entries left (before that sweep).
 */
export async function checkLeftovers(demo: Demo, s: Setup): Promise<string[]> {
  const { pool, root, before, baseWs, ownRoot } = s
  const leftovers = (await pool.list()).filter((ws) => ws.name !== baseWs?.name)
  if (baseWs) await baseWs.dispose()
  const left = (await poolEntries(root)).filter((e) => !before.has(e))
  if (left.length) {
    let text =
      `${entriesText(left.length)} left in the pool after dispose: ` +
      `${left.slice(0, 5).join(', ')}${left.length > 5 ? ', ...' : ''}` +
      (leftovers.length ? ` (${leftovers.filter((l) => !l.live).length} workspace(s) without a live lease)` : '')
    // What a dead process left has its leases free: a sweep reclaims it (and never touches a live one). In a
    // pool of our own nobody else can be building, so staging entries need no grace period.
    try {
      const r = await pool.sweep(ownRoot ? { graceMs: 0 } : {})
      const after = (await poolEntries(root)).filter((e) => !before.has(e)).length
      const from = (k: string) => r.reclaimed.filter((e) => e.from === k).length
      text +=
        `; pool.sweep() then reclaimed ${r.reclaimed.length} (published ${from('published')}, staging ` +
        `${from('staging')}, trash ${from('trash')}; ${r.leasesRemoved} lease file(s)), ${after} entries left`
    } catch (e) {
      text += `; pool.sweep() failed: ${describe(e)}`
    }
    demo.failures.push(text)
  }
  await pool.close()
  if (before.size) demo.notes.push(`${entriesText(before.size)} that were in ${root} before the run are not counted.`)
  return left
}

/**
 * Phase 4, chaos (--chaos): what the SIGKILLed workers left behind, worked out from their reports (allocations
 * not reported disposed), the pids in the metadata of what they published but could not report, and the staging
 * entries of builds they were in; one `pool.sweep({ graceMs: 0 })` must reclaim exactly that set.
 */
import * as path from 'node:path'
import type { Checked } from './checks.js'
import type { Demo, WorkerState } from './context.js'
import type { Setup } from './setup.js'
import { POOL_DIRS } from '../shared/pool-dirs.js'
import { entriesText, poolEntries, status } from './util.js'

type OrphanKind = 'reported' | 'unreported' | 'mid-dispose' | 'staging'

/** Names of the published, trash and staging entries the pool holds beyond what was there before the run. */
async function leftBehind(root: string, before: Set<string>) {
  const entries = (await poolEntries(root)).filter((e) => !before.has(e))
  const names = (dir: string) => entries.filter((e) => path.dirname(e) === dir).map((e) => path.basename(e))
  return {
    published: names('.'),
    trash: names(POOL_DIRS.trash),
    staging: entries.filter((e) => e.startsWith(POOL_DIRS.staging + path.sep)).map((e) => path.basename(e)),
  }
}

/** name -> why it is an orphan, and problems: entries no killed worker can have left, workspaces lost. */
async function expectedOrphans(s: Setup, c: Checked, killed: WorkerState[]) {
  const killedPids = new Set(killed.map((w) => w.child.pid))
  const orphanNames = new Map(c.orphaned.map((r) => [r.name, r]))
  const left = await leftBehind(s.root, s.before)
  const infos = new Map((await s.pool.list()).map((i) => [i.name, i]))
  const expected = new Map<string, OrphanKind>()
  const problems: string[] = []
  for (const name of left.published) {
    if (name === s.baseWs?.name) continue
    const info = infos.get(name)
    const r = orphanNames.get(name)
    if (info?.live) problems.push(`${name} is live after every worker exited`)
    if (r) expected.set(name, r.disposing ? 'mid-dispose' : 'reported')
    else if (info?.pid !== undefined && killedPids.has(info.pid)) expected.set(name, 'unreported')
    else problems.push(`${name} is in the pool but no killed worker made it (pid ${info?.pid ?? 'unknown'})`)
  }
  for (const name of left.trash) {
    if (orphanNames.get(name)?.disposing) expected.set(name, 'mid-dispose')
    else problems.push(`${name} is in trash but no killed worker was disposing it`)
  }
  // Every worker is dead: a staging entry is a build a killed worker was in (a live one rolls back on failure).
  for (const name of left.staging) expected.set(name, 'staging')
  // A workspace a killed worker reported and never started to dispose must still be there: its owner is dead.
  for (const r of c.orphaned) if (!r.disposing && !left.published.includes(r.name)) problems.push(`${r.name} was lost: reported held, not in the pool`)
  return { expected, problems }
}

/** Sweeps, compares what it reclaimed with the expected orphans, and returns the summary's chaos rows. */
export async function chaos(demo: Demo, s: Setup, c: Checked): Promise<[string, string][]> {
  const { failures } = demo
  const killed = demo.workers.filter((w) => w.chaosKilled)
  const { expected, problems } = await expectedOrphans(s, c, killed)

  status(`sweeping what the ${killed.length} killed worker(s) left: pool.sweep({ graceMs: 0 })`)
  const report = await s.pool.sweep({ graceMs: 0 })
  const reclaimed = new Set(report.reclaimed.map((e) => e.name))
  const preexisting = [...reclaimed].filter((n) => [n, path.join(POOL_DIRS.trash, n), path.join(POOL_DIRS.staging, n)].some((e) => s.before.has(e)))
  for (const n of preexisting) reclaimed.delete(n)
  const missing = [...expected.keys()].filter((n) => !reclaimed.has(n))
  const extra = [...reclaimed].filter((n) => !expected.has(n))
  const exact = missing.length === 0 && extra.length === 0
  if (!exact)
    failures.push(
      `the sweep did not reclaim exactly the orphans: ${missing.length} not reclaimed (${missing.slice(0, 3).join(', ')}), ` +
        `${extra.length} reclaimed that were no orphans (${extra.slice(0, 3).join(', ')})`,
    )
  for (const f of report.failed) failures.push(`sweep could not remove ${f.name} (${f.from}): ${f.code}`)
  if (report.live !== (s.baseWs ? 1 : 0) && s.ownRoot) problems.push(`sweep counted ${report.live} live workspace(s)`)
  for (const p of problems) failures.push(`chaos: ${p}`)
  if (preexisting.length) demo.notes.push(`the sweep also reclaimed ${entriesText(preexisting.length)} from before the run.`)

  const kinds = (k: OrphanKind) => [...expected.values()].filter((v) => v === k).length
  const from = (k: string) => report.reclaimed.filter((e) => e.from === k && reclaimed.has(e.name)).length
  const replacements = demo.workers.filter((w) => w.replaces !== undefined)
  return [
    [
      'chaos',
      `SIGKILLed ${killed.length} of ${demo.opts.workers} workers (after ${killed.map((w) => w.allocated).join(', ')} ` +
        `allocations); ${replacements.length} replacement(s) made their remaining ` +
        `${replacements.reduce((n, w) => n + w.count, 0)} workspaces`,
    ],
    [
      'orphans / reclaimed by sweep',
      `${expected.size} / ${reclaimed.size} (${exact ? 'exact match' : `MISMATCH: ${missing.length} missing, ${extra.length} extra`})`,
    ],
    [
      'orphans by kind',
      `${kinds('reported')} reported held, ${kinds('unreported')} published unreported, ${kinds('mid-dispose')} ` +
        `mid-dispose, ${kinds('staging')} half-built (staging)`,
    ],
    [
      'sweep reclaimed from',
      `published ${from('published')}, trash ${from('trash')}, staging ${from('staging')}; ` +
        `${report.leasesRemoved} lease file(s) without a workspace; ${report.live} live left alone`,
    ],
  ]
}

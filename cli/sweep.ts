/** `vmspace sweep ROOT [--dry-run] [--grace MS]`: Pool.sweep() and its report, for people and for timers. */
import { openPool, type SweepEntry } from 'vmspace'
import { EXIT_FAILED, EXIT_OK, errorJson, humanBytes, poolRoot, printJson } from './common.js'

export async function sweep(rootArg: string, opts: { dryRun?: boolean; grace?: number; json?: boolean }): Promise<number> {
  const root = poolRoot(rootArg)
  const dryRun = opts.dryRun ?? false
  const graceMs = opts.grace ?? 60_000
  const pool = await openPool(root, { create: false })
  let report
  try {
    report = await pool.sweep({ dryRun, graceMs })
  } finally {
    await pool.close()
  }
  // `bytes` is null where the sweep measured nothing (the --json rule: null where unknown): in a dry run, which
  // removes nothing, and for a failed entry; Pool.sweep() reports 0 there (SweepEntry.bytes).
  const entry = (e: SweepEntry, measured: boolean) => ({ id: e.id, name: e.name, from: e.from, bytes: measured ? e.bytes : null })
  const failed = report.failed.map((f) => ({ ...entry(f, false), ...errorJson(f.error) }))
  const bytesFreed = report.reclaimed.reduce((n, e) => n + e.bytes, 0)
  if (opts.json) {
    printJson({
      root,
      dryRun,
      graceMs,
      reclaimed: report.reclaimed.map((e) => entry(e, !dryRun)),
      bytesFreed: dryRun ? null : bytesFreed,
      live: report.live,
      failed,
      leasesRemoved: report.leasesRemoved,
      foreign: report.foreign,
    })
  } else {
    const verb = dryRun ? 'would reclaim' : 'reclaimed'
    for (const e of report.reclaimed) process.stdout.write(`${verb} ${e.name} (${e.from}${dryRun ? '' : `, ${humanBytes(e.bytes)}`})\n`)
    for (const f of failed) process.stdout.write(`failed ${f.name} (${f.from}): ${f.message}\n`)
    for (const p of report.foreign) process.stdout.write(`left ${p}: named like a workspace, but vmspace did not make it (no lease file)\n`)
    process.stdout.write(
      `${root}: ${report.reclaimed.length} ${dryRun ? "to reclaim" : "reclaimed"}${dryRun ? '' : ` (${humanBytes(bytesFreed)} freed)`}, ` +
        `${report.live} live left alone, ${failed.length} failed, ${report.leasesRemoved} lease file(s) ` +
        `${dryRun ? 'without a workspace' : 'removed'}, ${report.foreign.length} foreign left alone\n`,
    )
  }
  return failed.length ? EXIT_FAILED : EXIT_OK
}

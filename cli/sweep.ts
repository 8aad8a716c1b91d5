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
  const entry = (e: SweepEntry) => ({ id: e.id, name: e.name, from: e.from, bytes: e.bytes })
  const failed = report.failed.map((f) => ({ ...entry(f), ...errorJson(f.error) }))
  const bytesFreed = report.reclaimed.reduce((n, e) => n + e.bytes, 0)
  if (opts.json) {
    printJson({ root, dryRun, graceMs, reclaimed: report.reclaimed.map(entry), bytesFreed, live: report.live, failed, metadataRemoved: report.metadataRemoved })
  } else {
    const verb = dryRun ? 'would reclaim' : 'reclaimed'
    for (const e of report.reclaimed) process.stdout.write(`${verb} ${e.name} (${e.from}${dryRun ? '' : `, ${humanBytes(e.bytes)}`})\n`)
    for (const f of failed) process.stdout.write(`failed ${f.name} (${f.from}): ${f.message}\n`)
    process.stdout.write(
      `${root}: ${report.reclaimed.length} ${dryRun ? "to reclaim" : "reclaimed"}${dryRun ? '' : ` (${humanBytes(bytesFreed)} freed)`}, ` +
        `${report.live} live left alone, ${failed.length} failed, ${report.metadataRemoved} metadata file(s) ` +
        `${dryRun ? 'without a workspace' : 'removed'}\n`,
    )
  }
  return failed.length ? EXIT_FAILED : EXIT_OK
}

/** Phase 5, report: notes on how the clones were made, and the summary table with every failure below it. */
import type { Checked } from './checks.js'
import type { Demo } from './context.js'
import { MARKER_FILE, MARKER_OFFSET, TREE_MARKER } from './protocol.js'
import { methodsText, type RunResult } from './run.js'
import type { Setup } from './setup.js'
import { humanBytes, ms, percentile } from './util.js'

/** A note when clones fell back to copies: where reflink would have shared extents instead. */
function cloneNotes(demo: Demo, s: Setup, r: RunResult): void {
  const reflinks = r.methodCount.reflink ?? 0
  const copies = r.methodCount.copy ?? 0
  const what = s.tree ? "the template's files" : "the base's data (holes kept)"
  if (copies > 0 && reflinks === 0)
    demo.notes.push(
      `${s.root} is on ${s.rootFs}, which cannot share extents (reflink): every clone fell back to a copy of ` +
        `${what}. On XFS (mkfs.xfs -m reflink=1) or btrfs each clone is a reflink: try --root there.`,
    )
  else if (copies > 0) demo.notes.push(`${copies} clone(s) fell back to a copy although ${reflinks} were reflinks.`)
}

function spread(values: number[], show: (n: number) => string): string {
  if (values.length === 0) return '-'
  const lo = Math.min(...values)
  const hi = Math.max(...values)
  return lo === hi ? show(lo) : `${show(lo)} to ${show(hi)}`
}

function rows(demo: Demo, s: Setup, r: RunResult, c: Checked, chaosRows: [string, string][], left: string[]): [string, string][] {
  const { tree, base } = s
  const { records, latencies: lat } = r
  const { lived, orphaned, isolated } = c
  const total = demo.opts.vms
  const killed = demo.workers.filter((w) => w.chaosKilled)
  const fileClones = demo.workers.reduce(
    (acc, w) => ({ reflink: acc.reflink + (w.stats?.clones.reflink ?? 0), copy: acc.copy + (w.stats?.clones.copy ?? 0) }),
    { reflink: 0, copy: 0 },
  )
  const made = `${lived.length} of ${total}${orphaned.length ? ` (+ ${orphaned.length} unfinished by killed workers)` : ''}`
  const out: [string, string][] = [
    ['workspaces', `${made} (${demo.workers.length} workers, at most ${demo.opts.live} live each)`],
    ['workspaces/s', r.wall > 0 ? (lived.length / r.wall).toFixed(1) : '-'],
    ['allocate p50 (ms)', ms(percentile(lat, 50))],
    ['allocate p99 (ms)', ms(percentile(lat, 99))],
    [tree ? 'clone methods (per workspace)' : 'clone methods', methodsText(r.methodCount)],
  ]
  if (tree) {
    out.push(
      ['files / bytes per workspace', `${spread(records.map((m) => m.files), String)} files / ${spread(records.map((m) => m.bytes), humanBytes)}`],
      [
        'file clones (reflink / copy)',
        `${fileClones.reflink} / ${fileClones.copy} (the workers' pool.stats()${killed.length ? `, the ${killed.length} killed not counted` : ''})`,
      ],
      ['bytes cloned', `${humanBytes(r.bytes)} in ${records.reduce((n, m) => n + m.files, 0)} files`],
      [
        'isolation checks passed',
        `${isolated.length}/${lived.length} (own ${TREE_MARKER} only${tree.spec.probe ? `, own marker in its clone of ${tree.spec.probe}` : ''}, tree = template)`,
      ],
    )
  } else {
    out.push(
      ['bytes cloned', `${humanBytes(r.bytes)} (${humanBytes(base!.size)} each, ${humanBytes(base!.allocated)} of it data)`],
      ['isolation checks passed', `${isolated.length}/${lived.length} (own marker only, at offset ${MARKER_OFFSET} and in ${MARKER_FILE})`],
    )
  }
  if (demo.opts.quota !== undefined) {
    const q = r.runaway
    out.push([
      'quota',
      `${humanBytes(demo.opts.quota)} per workspace; runaway writer in ${q ? `${q.id.slice(0, 8)}...: ${q.code ?? 'never refused'} after ${humanBytes(q.bytes)}` : '-: never reported'}`,
    ])
  }
  out.push(['distinct paths / ids', `${c.distinctPaths}/${records.length} / ${c.distinctIds}/${records.length}`])
  if (tree)
    out.push([
      'template unchanged',
      `${c.treeAfter?.digest === tree.before.digest && c.originalSame ? 'yes' : 'NO'} (listing, modes, sizes, times, contents: ` +
        `${tree.before.digest.slice(0, 16)}...${tree.originalBefore ? `; the original ${tree.original} too` : ''})`,
    ])
  else out.push(['base sha256 unchanged', `${c.hashAfter === s.hashBefore ? 'yes' : 'NO'} (${c.hashAfter.slice(0, 16)}...)`])
  out.push(['disposed', `${c.disposed.length}/${lived.length}`], ...chaosRows, ['entries left in pool', `${left.length}`])
  const n = demo.failures.length
  out.push(['result', n ? `FAILED (${n} problem${n === 1 ? '' : 's'})` : 'all checks passed'])
  return out
}

/** Prints the summary to stdout: headline, the table, notes, failures. */
export function report(demo: Demo, s: Setup, r: RunResult, c: Checked, chaosRows: [string, string][], left: string[]): void {
  cloneNotes(demo, s, r)
  const table = rows(demo, s, r, c, chaosRows, left)
  const { tree, base, base0 } = s
  const total = demo.opts.vms
  const out: string[] = []
  out.push('')
  out.push(`vmspace demo: ${c.lived.length < total ? `${c.lived.length} of ${total}` : total} workspaces in ${r.wall.toFixed(1)} s`)
  out.push(`  pool      ${s.root} (${s.rootFs}${s.ownRoot ? ', removed at the end' : ''})`)
  if (tree?.image)
    out.push(`  image     ${tree.original}: template ${tree.image.name ?? tree.image.id}, ${tree.spec.entries} entries, ${tree.spec.files} files, ${humanBytes(tree.spec.bytes)}`)
  else if (tree)
    out.push(`  template  ${tree.original}: ${tree.spec.entries} entries, ${tree.spec.files} files, ${humanBytes(tree.spec.bytes)}`)
  else out.push(`  base      ${base0!.path}: ${base!.what}, ${humanBytes(base!.size)}, ${humanBytes(base!.allocated)} data`)
  const w1 = Math.max(...table.map((row) => row[0].length))
  const w2 = Math.max(...table.map((row) => row[1].length))
  const line = `+-${'-'.repeat(w1)}-+-${'-'.repeat(w2)}-+`
  out.push(line)
  for (const [k, v] of table) out.push(`| ${k.padEnd(w1)} | ${v.padEnd(w2)} |`)
  out.push(line)
  for (const note of demo.notes) out.push(`note: ${note}`)
  for (const f of demo.failures) out.push(`FAILED: ${f}`)
  process.stdout.write(out.join('\n') + '\n')
}

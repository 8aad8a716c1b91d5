/**
 * `--fork N`: one parent workspace with the base as ROOTFS (or the template tree), its own marker
 * written, committed and forked into N children (`pool.fork`). Each child writes its id into its image and a marker
 * file; then every child must read back only its own, the parent its own, and the base must be unchanged. The
 * time per child (the whole fork divided by N) is reported.
 */
import * as fsp from 'node:fs/promises'
import * as path from 'node:path'
import { performance } from 'node:perf_hooks'
import type { Workspace } from 'vmspace'
import type { Demo } from './context.js'
import { MARKER_FILE, MARKER_LEN, MARKER_OFFSET, ROOTFS, TREE_MARKER } from './protocol.js'
import type { Setup } from './setup.js'
import { ms, readAt, sha256, status, writeAt } from './util.js'

function marker(text: string): Buffer {
  const b = Buffer.alloc(MARKER_LEN)
  b.write(text)
  return b
}

export async function forkPhase(demo: Demo, s: Setup, count: number): Promise<void> {
  const { pool } = s
  const image = s.tree ? undefined : ROOTFS
  const parent = await pool.allocate(s.tree ? { template: s.tree.spec.dir } : { template: { [ROOTFS]: s.base!.path } })
  const kids: Workspace[] = []
  try {
    if (image) await writeAt(path.join(parent.path, image), marker(`parent ${parent.id}`), MARKER_OFFSET)
    await fsp.writeFile(path.join(parent.path, s.tree ? TREE_MARKER : MARKER_FILE), `parent ${parent.id}`)
    status(`forking ${count} children of ${parent.id}`)
    const started = performance.now()
    kids.push(...(await pool.fork(parent, count, { onProgress: (p) => p.done === p.count && status(`forked ${p.count}`) })))
    const elapsed = performance.now() - started
    const method = kids[0]?.template[0]?.method ?? '-'
    for (const k of kids) {
      if (image) await writeAt(path.join(k.path, image), marker(k.id), MARKER_OFFSET)
      await fsp.writeFile(path.join(k.path, s.tree ? TREE_MARKER : MARKER_FILE), k.id)
    }
    // Isolation: every child holds its own marker only, the parent its own, no two share a path.
    let bad = 0
    for (const k of kids) {
      const own = image ? (await readAt(path.join(k.path, image), MARKER_LEN, MARKER_OFFSET)).equals(marker(k.id)) : true
      const file = await fsp.readFile(path.join(k.path, s.tree ? TREE_MARKER : MARKER_FILE), 'utf8')
      if (!own || file !== k.id) bad++
    }
    if (bad) demo.failures.push(`${bad} of ${count} forked children do not hold exactly their own marker`)
    if (image && !(await readAt(path.join(parent.path, image), MARKER_LEN, MARKER_OFFSET)).equals(marker(`parent ${parent.id}`)))
      demo.failures.push('the parent lost its marker: a child wrote into it')
    if (new Set(kids.map((k) => k.path)).size !== kids.length) demo.failures.push('two forked children share a path')
    if (s.base && (await sha256(s.base.path)) !== s.hashBefore) demo.failures.push('the base changed during the fork')
    process.stdout.write(
      `fork: ${count} children of one parent in ${ms(elapsed)} ms: ${ms(elapsed / count)} ms per child ` +
        `(commit + ${count} allocates from the template, ${method}) on ${s.rootFs}; isolation ${bad ? 'FAILED' : 'ok'}\n`,
    )
  } finally {
    for (const k of kids) await k.dispose()
    await parent.dispose()
  }
}

// Templates on btrfs: a subvolume snapshot against the reflink walk, for commit, allocate({ from })
// and fork, on a tree of `files` files (10,000 and 10 by default, to see where each wins). Run by bench/run.mjs
// (`npm run bench -- --only templates-btrfs`) on a loop-mounted btrfs of its own.
//   commit:   snapshot = commit of a subvolume workspace (BTRFS_IOC_SNAP_CREATE_V2, read-only);
//             walk     = commit of a plain-directory workspace (reflink walk into a new subvolume, then read-only).
//   allocate: snapshot = allocate({ from }) of a subvolume template (a writable snapshot);
//             walk     = allocate({ template: <the same tree outside the pool> }): the reflink walk of it, which is
//                        what allocate({ from }) did before templates were subvolumes.
//   fork:     snapshot = fork(ws, n) of a subvolume workspace (one read-only snapshot, n writable ones), per child;
//             walk     = n × allocate({ template: <the same tree outside the pool> }), a reflink walk per child.
import * as fs from 'node:fs'
import * as path from 'node:path'

const ms = (t0) => Number(process.hrtime.bigint() - t0) / 1e6
const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b)
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2
}

/** `files` files of 100 bytes, 100 per directory. */
function makeTree(dir, files) {
  for (let i = 0; i < files; i++) {
    const d = path.join(dir, `d${Math.floor(i / 100)}`)
    if (i % 100 === 0) fs.mkdirSync(d, { recursive: true })
    fs.writeFileSync(path.join(d, `f${i}`), `file ${i} `.padEnd(100, 'x'))
  }
}

export async function benchTemplatesBtrfs({ vmspace, dir, load, sizes = [10_000, 10], rounds = 5, children = 8 }) {
  const rows = []
  for (const files of sizes) {
    const pool = await vmspace.openPool(path.join(dir, `pool-${files}`))
    // The source: a plain-directory workspace with the tree, its template (a walk into a subvolume), and a
    // workspace allocated from that template (a subvolume: what a snapshot commit starts from).
    const plain = await pool.allocate()
    makeTree(plain.path, files)
    const base = await pool.commit(plain, { name: 'base' })
    const sub = await pool.allocate({ from: 'base' })
    // The same tree outside the pool, for the walks (a template inside the pool is refused: a guest's tree).
    const hostTree = path.join(dir, `tree-${files}`)
    fs.mkdirSync(hostTree)
    makeTree(hostTree, files)
    if (sub.template[0].method !== 'snapshot') throw new Error(`allocate({ from }) on btrfs: ${sub.template[0].method}`)
    const s = { commitSnap: [], commitWalk: [], allocSnap: [], allocWalk: [], forkSnap: [], forkWalk: [] }
    // The variants alternate within each round, so that load coming and going falls on both alike.
    for (let r = 0; r < rounds; r++) {
      let t0 = process.hrtime.bigint()
      const ts = await pool.commit(sub)
      s.commitSnap.push(ms(t0))
      if (ts.clone.method !== 'snapshot') throw new Error(`commit of a subvolume: ${ts.clone.method}`)
      t0 = process.hrtime.bigint()
      const tw = await pool.commit(plain)
      s.commitWalk.push(ms(t0))
      if (tw.clone.method !== 'reflink') throw new Error(`commit of a directory: ${tw.clone.method}`)
      t0 = process.hrtime.bigint()
      const a = await pool.allocate({ from: base.id })
      s.allocSnap.push(ms(t0))
      t0 = process.hrtime.bigint()
      const b = await pool.allocate({ template: hostTree })
      s.allocWalk.push(ms(t0))
      if (b.template[0].method !== 'reflink') throw new Error(`allocate({ template }): ${b.template[0].method}`)
      t0 = process.hrtime.bigint()
      const kids = await pool.fork(sub, children)
      s.forkSnap.push(ms(t0) / children)
      t0 = process.hrtime.bigint()
      const walked = await Promise.all(Array.from({ length: children }, () => pool.allocate({ template: hostTree })))
      s.forkWalk.push(ms(t0) / children)
      for (const w of [a, b, ...kids, ...walked]) await w.dispose()
      for (const t of [ts, tw]) await pool.removeTemplate(t.id)
    }
    const row = (op, snap, walk) =>
      rows.push({
        files,
        operation: op,
        'snapshot ms': median(snap).toFixed(2),
        'reflink walk ms': median(walk).toFixed(2),
        'walk / snapshot': (median(walk) / median(snap)).toFixed(1),
        faster: median(snap) <= median(walk) ? 'snapshot' : 'walk',
      })
    row('commit', s.commitSnap, s.commitWalk)
    row('allocate({ from })', s.allocSnap, s.allocWalk)
    row(`fork, per child (${children} children)`, s.forkSnap, s.forkWalk)
    for (const w of [plain, sub]) await w.dispose()
    await pool.removeTemplate(base.id)
    await pool.close()
  }
  console.log(`\ntemplates on btrfs (loop): subvolume snapshot vs reflink walk (medians of ${rounds} rounds); ${load()}`)
  console.table(rows)
}

/**
 * Faults of depth and limits: bounded resources for any tree a guest can make, every call settles
 * under RLIMIT_AS / RLIMIT_NPROC / RLIMIT_NOFILE, and the first errno is the one reported. Each case runs in a
 * child (test/fixtures/faults-child.cjs) that sets its own limits with prlimit(1), so that the limit, the RSS it
 * measures (ru_maxrss growth over the call) and the uid are its own.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, onTestFinished, test } from 'vitest'
import { removeTree } from '../lib/index.js'
import { emptyPoolState, faultsChild, fixtures, freshDir, GiB, MiB, mounts, needs, poolState, runCommand, spinCpus, unprivilegedChildren } from './helpers.js'

const run = faultsChild

const DEPTH = 100_000
const AS_LIMIT = 3 * GiB
const RSS_BUDGET_KIB = (64 * MiB) / 1024

/** Depth, link count and size of every regular file below `dir`, by find(1) (fts: fd-relative, any depth). */
function filesBelow(dir: string): string[] {
  return runCommand('find', [dir, '-type', 'f', '-printf', '%d %n %s\n']).stdout.toString().trim().split('\n')
}

/** freshDir for trees deeper than fs.rmSync can recurse: removed by rm(1) (fts: fd-relative, any depth). */
function deepDir(): string {
  const dir = fs.mkdtempSync(path.join(mounts.xfs!, 'vmspace-deep-'))
  onTestFinished(() => {
    runCommand('rm', ['-rf', '--one-file-system', dir])
  })
  return dir
}

describe.skipIf(!mounts.xfs)(`a chain of directories ${DEPTH} deep ${needs('a loop-mounted XFS', mounts.missing.xfs)}`, () => {
  test(
    `clone() under a 3 GiB address-space limit recreates it (a hard-link pair at the bottom, far past PATH_MAX, stays a pair) with under 64 MiB of RSS growth, and removing both leaves nothing`,
    { timeout: 240_000 },
    async () => {
      const dir = deepDir()
      const src = path.join(dir, 'chain')
      const dst = path.join(dir, 'copy')
      expect((await run({ op: 'build', dir, depth: DEPTH, links: true })).event).toBe('result')

      const cloned = await run({ op: 'clone', src, dst, limits: { as: AS_LIMIT } })
      console.log(`clone of a chain ${DEPTH} deep: ru_maxrss grew ${cloned.maxrssGrowthKiB} KiB`)
      expect(cloned).toMatchObject({ event: 'result', dirs: DEPTH, files: 1, hardlinks: 1 })
      expect(cloned.maxrssGrowthKiB).toBeLessThan(RSS_BUDGET_KIB)
      expect(filesBelow(dst)).toEqual([`${DEPTH + 1} 2 6`, `${DEPTH + 1} 2 6`])

      for (const target of [dst, src]) {
        const removed = await run({ op: 'remove', target, limits: { as: AS_LIMIT } })
        console.log(`removal of a chain ${DEPTH} deep: ru_maxrss grew ${removed.maxrssGrowthKiB} KiB`)
        expect(removed.event).toBe('result')
        expect(removed.maxrssGrowthKiB).toBeLessThan(RSS_BUDGET_KIB)
      }
      expect(fs.readdirSync(dir)).toEqual([])
    },
  )

  test(
    `a workspace holding it (allocate({ template })) is disposed and swept under a 3 GiB address-space limit with under 64 MiB of RSS growth; the pool is left empty`,
    { timeout: 240_000 },
    async () => {
      const dir = deepDir()
      const pool = path.join(dir, 'pool')
      expect((await run({ op: 'build', dir, depth: DEPTH })).event).toBe('result')
      const r = await run({ op: 'dispose', src: path.join(dir, 'chain'), pool, limits: { as: AS_LIMIT } })
      console.log(`allocate + dispose + sweep of a chain ${DEPTH} deep: ru_maxrss grew ${r.maxrssGrowthKiB} KiB`)
      expect(r).toMatchObject({ event: 'result', entries: ['.vmspace'] })
      expect(r.maxrssGrowthKiB).toBeLessThan(RSS_BUDGET_KIB)
      expect(poolState(pool)).toEqual(emptyPoolState)
      expect((await run({ op: 'remove', target: path.join(dir, 'chain') })).event).toBe('result')
      expect(fs.readdirSync(dir)).toEqual(['pool'])
    },
  )
})

/** A tree wide and deep at once: 4 levels of 4 subdirectories with 3 files each, and a chain of 100 below. */
function wideDeepTree(dir: string): string {
  const src = path.join(dir, 'src')
  const fill = (d: string, level: number) => {
    fs.mkdirSync(d, { recursive: true })
    for (let f = 0; f < 3; f++) fs.writeFileSync(path.join(d, `f${f}`), `${d}:${f}`)
    if (level < 4) for (let s = 0; s < 4; s++) fill(path.join(d, `s${s}`), level + 1)
  }
  fill(src, 0)
  let d = path.join(src, 's0')
  for (let i = 0; i < 100; i++) d = path.join(d, 'c')
  fs.mkdirSync(d, { recursive: true })
  fs.writeFileSync(path.join(d, 'bottom'), 'bottom')
  runCommand('chmod', ['-R', 'a+rX', src])
  return src
}

/** The snapshot without the root's own entry (a workspace root keeps the pool's mode, not the template's). */
function withoutRoot(s: unknown): Record<string, string> {
  const { '.': _root, ...rest } = s as Record<string, string>
  return rest
}

describe.skipIf(!unprivilegedChildren)(
  `no thread can be started (RLIMIT_NPROC 1, as uid 65534) ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`,
  () => {
    function writableDir(): string {
      const dir = freshDir()
      fs.chownSync(dir, 65534, 65534)
      return dir
    }

    test('clone(dir, dst) walks on the calling thread alone and resolves with the exact tree', { timeout: 60_000 }, async () => {
      const dir = writableDir()
      const src = wideDeepTree(dir)
      const r = await run({ op: 'clone', src, dst: path.join(dir, 'dst'), snapshot: true, nobody: true, limits: { nproc: 1 } })
      expect(r.event, JSON.stringify(r)).toBe('result')
      expect(r.snapshot).toEqual(r.source)
      expect(fs.readdirSync(dir).sort()).toEqual(['dst', 'src'])
    })

    test('allocate({ template: dir }) resolves with the exact tree, and its dispose leaves the pool empty', { timeout: 60_000 }, async () => {
      const dir = writableDir()
      const src = wideDeepTree(dir)
      const pool = path.join(dir, 'pool')
      const r = await run({ op: 'dispose', src, pool, snapshot: true, nobody: true, limits: { nproc: 1 } })
      expect(r.event, JSON.stringify(r)).toBe('result')
      expect(withoutRoot(r.snapshot)).toEqual(withoutRoot(r.source))
      expect(r.entries).toEqual(['.vmspace'])
      expect(poolState(pool)).toEqual(emptyPoolState)
    })
  },
)

describe('a low RLIMIT_NOFILE', () => {
  // A tree whose directories hold many subdirectories fills the walk's hand-off queue, whose fds no thread can page
  // out: with ~40 fds free the clone must still complete (a queue sized for a roomy fd limit failed with EMFILE).
  test('40 free fds: clone() of 20 directories of 30 subdirectories each is exact', { timeout: 60_000 }, async () => {
    const dir = freshDir()
    const src = path.join(dir, 'src')
    for (let g = 0; g < 20; g++)
      for (let d = 0; d < 30; d++) {
        fs.mkdirSync(path.join(src, `g${g}`, `d${d}`), { recursive: true })
        fs.writeFileSync(path.join(src, `g${g}`, `d${d}`, 'f'), `${g}/${d}`)
      }
    const r = await run({ op: 'clone', src, dst: path.join(dir, 'dst'), snapshot: true, limits: { nofileHeadroom: 40 } })
    expect(r.event, JSON.stringify(r)).toBe('result')
    expect(r.snapshot).toEqual(r.source)
    expect(fs.readdirSync(dir).sort()).toEqual(['dst', 'src'])
  })

  // The walk raises its thread limit when its threads wait for a CPU (native/core/tree.cc, CpuWait), but not with
  // few fds: four threads' open frames failed with EMFILE at `ulimit -n 64` where two never did.
  test('44 free fds, one busy loop per CPU: clone() of 300 small directories and a chain 120 deep is exact, 5 times', { timeout: 120_000 }, async () => {
    const dir = freshDir()
    const src = path.join(dir, 'src')
    for (let i = 1; i <= 300; i++) {
      const d = path.join(src, `a${i % 7}`, `d${i}`)
      fs.mkdirSync(path.join(d, 'e'), { recursive: true })
      for (let f = 1; f <= 3; f++) fs.writeFileSync(path.join(d, `f${f}`), `f${i}-${f}`)
      fs.writeFileSync(path.join(d, 'e', 'g'), `x${i}`)
    }
    let deep = path.join(src, 'deep')
    for (let k = 1; k <= 120; k++) deep = path.join(deep, `l${k}`)
    fs.mkdirSync(deep, { recursive: true })
    fs.writeFileSync(path.join(deep, 'b'), 'bottom')
    const spinners = spinCpus()
    onTestFinished(() => {
      for (const p of spinners) p.kill('SIGKILL')
    })
    for (let round = 0; round < 5; round++) {
      const dst = path.join(dir, `dst${round}`)
      const r = await run({ op: 'clone', src, dst, snapshot: true, limits: { nofileHeadroom: 44 } })
      expect(r.event, JSON.stringify(r)).toBe('result')
      expect(r.snapshot).toEqual(r.source)
    }
    expect(fs.readdirSync(dir).sort()).toEqual(['dst0', 'dst1', 'dst2', 'dst3', 'dst4', 'src'])
  })

  // Headroom: fds free above the highest one open when the call starts.
  for (const headroom of [2, 4, 8, 16, 64]) {
    test(`${headroom} free fds: clone() of a wide and deep tree is exact or rejects EMFILE, and leaves nothing else`, { timeout: 60_000 }, async () => {
      const dir = freshDir()
      const src = wideDeepTree(dir)
      const r = await run({ op: 'clone', src, dst: path.join(dir, 'dst'), snapshot: true, limits: { nofileHeadroom: headroom } })
      console.log(`clone with ${headroom} free fds: ${r.event === 'result' ? 'exact' : JSON.stringify(r.error)}`)
      if (r.event === 'result') {
        expect(r.snapshot).toEqual(r.source)
        expect(fs.readdirSync(dir).sort()).toEqual(['dst', 'src'])
      } else {
        expect(r).toMatchObject({ event: 'failed', error: { code: 'EMFILE' } })
        expect(fs.readdirSync(dir)).toEqual(['src'])
      }
    })

    test(`${headroom} free fds: allocate({ template }) and dispose of a wide and deep tree are exact or reject EMFILE, and leave nothing`, { timeout: 60_000 }, async () => {
      const dir = freshDir()
      const src = wideDeepTree(dir)
      const pool = path.join(dir, 'pool')
      fs.mkdirSync(pool)
      const r = await run({ op: 'dispose', src, pool, snapshot: true, limits: { nofileHeadroom: headroom } })
      console.log(`allocate + dispose with ${headroom} free fds: ${r.event === 'result' ? 'exact' : JSON.stringify(r.error)}`)
      if (r.event === 'result') {
        expect(withoutRoot(r.snapshot)).toEqual(withoutRoot(r.source))
        expect(r.entries).toEqual(['.vmspace'])
      } else {
        expect(r).toMatchObject({ event: 'failed', error: { code: 'EMFILE' } })
      }
      if (fs.existsSync(path.join(pool, '.vmspace'))) expect(poolState(pool)).toEqual(emptyPoolState)
    })
  }
})

describe('many allocations at once under a low fd limit', () => {
  // 20 builds from a template tree at once, in a process of 40 fds (Node takes about 20 of them): some fail with
  // EMFILE at any step of their build, and each failure must take back everything it made.
  test('40 free fds at most: 20 allocate({ template }) at once all settle, and no entry, build or lease file is left (6 rounds)', { timeout: 120_000 }, () => {
    const dir = freshDir()
    const template = path.join(dir, 'template')
    for (const sub of ['a', 'a/b']) {
      fs.mkdirSync(path.join(template, sub), { recursive: true })
      for (let i = 0; i < 30; i++) fs.writeFileSync(path.join(template, sub, `f${i}`), `${sub} ${i}`)
    }
    for (let round = 0; round < 6; round++) {
      const root = path.join(dir, `pool${round}`)
      const child = path.join(fixtures, 'emfile-allocate-child.cjs')
      const r = runCommand('bash', ['-c', `ulimit -n 40 && exec "${process.execPath}" "${child}" "${root}" "${template}"`])
      const out = JSON.parse(r.stdout) as { settled: Record<string, number>; count: number; left: string[] }
      expect(out.count).toBe(20)
      expect(Object.keys(out.settled).every((k) => k === 'ok' || k === 'EMFILE'), JSON.stringify(out.settled)).toBe(true)
      expect(out.left, `round ${round}`).toEqual([])
    }
  })
})

describe.skipIf(!unprivilegedChildren)(
  `truthful errors ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`,
  () => {
    test('removeTree as uid 65534 of a tree holding another user\'s directory rejects with the unlinkat\'s EACCES, not the fallback fchmod\'s EPERM', { timeout: 60_000 }, async () => {
      const dir = freshDir()
      const tree = path.join(dir, 'tree')
      fs.mkdirSync(path.join(tree, 'other'), { recursive: true })
      fs.writeFileSync(path.join(tree, 'other', 'f'), 'root owns the directory this is in')
      fs.writeFileSync(path.join(tree, 'mine'), 'mine')
      fs.chmodSync(path.join(tree, 'other'), 0o755)
      fs.chownSync(dir, 65534, 65534)
      fs.chownSync(tree, 65534, 65534)
      fs.chownSync(path.join(tree, 'mine'), 65534, 65534)
      const r = await run({ op: 'remove', target: tree, nobody: true })
      expect(r).toEqual({
        event: 'failed',
        error: { code: 'EACCES', errno: -13, syscall: 'unlinkat', path: path.join(tree, 'other', 'f') },
      })
      expect(fs.readFileSync(path.join(tree, 'other', 'f'), 'utf8')).toBe('root owns the directory this is in')
    })
  },
)

describe.skipIf(!mounts.xfs)(`an error deep in a tree ${needs('a loop-mounted XFS', mounts.missing.xfs)}`, () => {
  const NAME = 'd'.repeat(255)
  const LEVELS = 64 // a path of 16 KiB: four times what a message shows

  /**
   * Runs the shell command `then` in the bottom directory of the chain below `top`, made where missing, reached by
   * one relative chdir per level (python3: a shell's cd tracks the whole path, and refuses it past PATH_MAX).
   */
  function atBottom(top: string, then: string): void {
    const script = [
      'import os, subprocess, sys',
      'os.chdir(sys.argv[1])',
      `for _ in range(${LEVELS}):`,
      '    os.makedirs(sys.argv[2], exist_ok=True)',
      '    os.chdir(sys.argv[2])',
      'sys.exit(subprocess.run(["sh", "-c", sys.argv[3]]).returncode)',
    ].join('\n')
    const r = runCommand('python3', ['-c', script, top, NAME, then])
    expect(r.status, r.stderr).toBe(0)
  }

  test('has a message of at most 4 KiB of its path (head … tail), and its whole path in `path`', async () => {
    const top = path.join(deepDir(), 'tree')
    fs.mkdirSync(top)
    // An immutable file at the bottom: unlinkat(2) refuses it with EPERM, even to root.
    atBottom(top, 'echo x > f && chattr +i f')
    onTestFinished(() => atBottom(top, 'chattr -i f'))
    const full = top + `/${NAME}`.repeat(LEVELS) + '/f'
    const err = await removeTree(top).then(
      () => expect.fail('expected a rejection'),
      (e: unknown) => e as { code: string; syscall: string; path: string; message: string },
    )
    expect(err).toMatchObject({ code: 'EPERM', syscall: 'unlinkat' })
    expect(err.path).toBe(full)
    const prefix = `EPERM: operation not permitted, unlinkat '`
    expect(err.message).toBe(`${prefix}${full.slice(0, 2048)}…${full.slice(full.length - 2048)}'`)
  })
})

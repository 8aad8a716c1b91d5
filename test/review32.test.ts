/**
 * Review of the house cleanup (behaviour unchanged): what a cold read of the diff, a hostile guest and a careless
 * caller found. Each test states the behaviour as it was before the cleanup and must hold after it.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { spawn, spawnSync } from 'node:child_process'
import { once } from 'node:events'
import { describe, expect, onTestFinished, test } from 'vitest'
import { metricsText, openPool, poolGauges, type Pool, type Workspace } from '../lib/index.js'
import { faultsChild, freshDir, ls, mounts, needs, outsideTree, poolState, runCommand, repoRoot, snapshotTree, unprivilegedChildren } from './helpers.js'

const run = faultsChild

describe.skipIf(!unprivilegedChildren)(
  `removal by a user who is not a directory's owner ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`,
  () => {
    /** dir/tree owned by 65534 holding `other/f`, `other` root's with `mode`. */
    function treeWithOthersDir(mode: number): { dir: string; tree: string } {
      const dir = freshDir()
      const tree = path.join(dir, 'tree')
      fs.mkdirSync(path.join(tree, 'other'), { recursive: true })
      fs.writeFileSync(path.join(tree, 'other', 'f'), 'in root\'s directory')
      fs.chmodSync(path.join(tree, 'other'), mode)
      fs.chownSync(dir, 65534, 65534)
      fs.chownSync(tree, 65534, 65534)
      return { dir, tree }
    }

    test("removeTree as uid 65534 takes another user's directory that others may write (0557): the failed fchmod fallback is no error", { timeout: 60_000 }, async () => {
      const { dir, tree } = treeWithOthersDir(0o557)
      const r = await run({ op: 'remove', target: tree, nobody: true })
      expect(r.event, JSON.stringify(r)).toBe('result')
      expect(fs.readdirSync(dir)).toEqual([])
    })

    test("removeTree as uid 65534 of another user's 0555 directory rejects with the unlinkat's EACCES, not the fallback fchmod's EPERM", { timeout: 60_000 }, async () => {
      const { tree } = treeWithOthersDir(0o555)
      const r = await run({ op: 'remove', target: tree, nobody: true })
      expect(r).toEqual({
        event: 'failed',
        error: { code: 'EACCES', errno: -13, syscall: 'unlinkat', path: path.join(tree, 'other', 'f') },
      })
      expect(fs.readFileSync(path.join(tree, 'other', 'f'), 'utf8')).toBe('in root\'s directory')
    })
  },
)

describe.skipIf(!mounts.xfs)(`a guest moving its tree about during a commit ${needs('a loop-mounted XFS', mounts.missing.xfs)}`, () => {
  const DEPTH = 40 // past the 16 frames a clone thread keeps open: the climb back reopens through ".."

  /** The guest's tree: a chain `d/d/...`, at each level `w0`..`w3` with a file, a link out of the workspace. */
  function guestTree(top: string, outside: string): void {
    let dir = top
    for (let i = 0; i < DEPTH; i++) {
      for (let w = 0; w < 4; w++) {
        fs.mkdirSync(path.join(dir, `w${w}`))
        fs.writeFileSync(path.join(dir, `w${w}`, 'f'), `guest ${i}/${w}`)
      }
      fs.symlinkSync(outside, path.join(dir, 'out'))
      dir = path.join(dir, 'd')
      fs.mkdirSync(dir)
    }
  }

  /**
   * A guest process that, until killed, swaps chain directories for a symlink to `outside` and back and moves
   * subtrees between levels and a chain's lower part up to the top and back, at depths past the open frames.
   */
  function moverLoop(top: string, outside: string): ReturnType<typeof spawn> {
    const script = [
      'import os, random, sys',
      'top, outside, depth = sys.argv[1], sys.argv[2], int(sys.argv[3])',
      'at = lambda k: os.path.join(top, *(["d"] * k))',
      'while True:',
      '    k = random.randrange(1, depth - 1)',
      '    d = os.path.join(at(k), "d")',
      '    try:',
      '        os.rename(d, d + ".x"); os.symlink(outside, d); os.unlink(d); os.rename(d + ".x", d)',
      '        j = random.randrange(k + 1, depth)',
      '        os.rename(os.path.join(at(k), "w1"), os.path.join(at(j), "w1moved"))',
      '        os.rename(os.path.join(at(j), "w1moved"), os.path.join(at(k), "w1"))',
      '        os.rename(d, os.path.join(top, "moved")); os.rename(os.path.join(top, "moved"), d)',
      '    except OSError:',
      '        pass',
    ].join('\n')
    return spawn('python3', ['-c', script, top, outside, String(DEPTH)], { stdio: 'ignore' })
  }

  /** Every file below `tree` is a guest's (no byte read from outside) and every link the guest's link out. */
  function guestFilesOnly(tree: string, outside: string): void {
    for (const [rel, desc] of Object.entries(snapshotTree(tree))) {
      if (desc.includes(' -> ')) expect(desc.endsWith(` -> ${outside}`), rel).toBe(true)
      else if (desc.includes('sha256=')) expect(fs.readFileSync(path.join(tree, rel), 'utf8'), rel).toMatch(/^guest \d+\/\d$/)
    }
  }

  /**
   * Runs `round` `rounds` times on a workspace holding guestTree while moverLoop moves it about; each outcome is
   * what `round` returns, or a rejection's code (which it must have). Then: nothing outside changed, no template
   * build, staging or trash entry is left, and the workspace is disposed.
   */
  async function underMovingGuest(
    rounds: number,
    round: (pool: Pool, ws: Workspace, outside: string, dir: string, i: number) => Promise<string>,
  ): Promise<{ outcomes: string[]; pool: Pool; dir: string }> {
    const dir = freshDir(mounts.xfs!)
    const pool = await openPool(path.join(dir, 'pool'))
    onTestFinished(() => pool.close())
    const outside = outsideTree(dir)
    const before = snapshotTree(outside)
    const ws = await pool.allocate()
    guestTree(ws.path, outside)
    const mover = moverLoop(ws.path, outside)
    const outcomes: string[] = []
    try {
      for (let i = 0; i < rounds; i++) {
        try {
          outcomes.push(await round(pool, ws, outside, dir, i))
        } catch (e) {
          const code = (e as { code?: unknown }).code
          expect(typeof code, String(e)).toBe('string')
          outcomes.push(code as string)
        }
      }
    } finally {
      mover.kill('SIGKILL')
      await once(mover, 'exit')
    }
    console.log(`under a moving tree: ${outcomes.join(' ')}`)
    expect(snapshotTree(outside)).toEqual(before)
    expect(ls(path.join(dir, 'pool', '.vmspace', 'templates', 'staging'))).toEqual([])
    expect(poolState(path.join(dir, 'pool'))).toMatchObject({ staging: [], trash: [], visible: [ws.name] })
    await ws.dispose()
    return { outcomes, pool, dir }
  }

  test('every commit is an exact tree of guest files (nothing read from outside) or rejects with a code; nothing is left, nothing outside changes', { timeout: 120_000 }, async () => {
    const made: string[] = []
    const { pool } = await underMovingGuest(30, async (pool, ws, outside) => {
      const t = await pool.commit(ws)
      guestFilesOnly(t.path, outside)
      made.push(t.id)
      return 'commit'
    })
    expect((await pool.templates()).map((t) => t.id).sort()).toEqual([...made].sort())
  })

  test('fork, checkpoint and copyOut of it meanwhile: guest files only or a coded rejection; nothing left, nothing outside changes', { timeout: 120_000 }, async () => {
    const { dir } = await underMovingGuest(24, async (pool, ws, outside, dir, i) => {
      if (i % 3 === 0) {
        const [child] = await pool.fork(ws, 1)
        guestFilesOnly(child.path, outside)
        await child.dispose()
        return 'fork'
      }
      if (i % 3 === 1) {
        guestFilesOnly((await pool.checkpoint(ws)).path, outside)
        return 'checkpoint'
      }
      const dest = path.join(dir, `out${i}`)
      try {
        await ws.copyOut('d', dest)
      } catch (e) {
        expect(fs.existsSync(dest)).toBe(false)
        throw e
      }
      guestFilesOnly(dest, outside)
      return 'copyOut'
    })
    expect(ls(dir).filter((n) => n.startsWith('.vmspace-tmp-'))).toEqual([])
  })
})

describe.skipIf(!mounts.xfs)(`a chain 10,000 deep with links out at a low RLIMIT_NOFILE ${needs('a loop-mounted XFS', mounts.missing.xfs)}`, () => {
  for (const headroom of [1, 6, 16]) {
    test(`${headroom} free fds: clone() is exact or rejects EMFILE and leaves nothing; allocate({ template }) + dispose + sweep leave the pool empty`, { timeout: 120_000 }, async () => {
      const dir = freshDir(mounts.xfs!)
      const outside = outsideTree(dir)
      const before = snapshotTree(outside)
      expect((await run({ op: 'build', dir, depth: 10_000, links: true })).event).toBe('result')
      const src = path.join(dir, 'chain')
      fs.symlinkSync(outside, path.join(src, 'out'))
      fs.symlinkSync(path.join(outside, 'keep.txt'), path.join(src, 'd', 'd', 'outf'))
      const r = await run({ op: 'clone', src, dst: path.join(dir, 'dst'), limits: { nofileHeadroom: headroom } })
      console.log(`clone of a chain 10,000 deep with ${headroom} free fds: ${JSON.stringify(r.event === 'result' ? r : r.error)}`)
      if (r.event === 'result') {
        expect(r).toMatchObject({ dirs: 10_000, files: 1, hardlinks: 1 })
        expect(fs.readlinkSync(path.join(dir, 'dst', 'out'))).toBe(outside)
        expect(ls(dir)).toEqual(['chain', 'dst', 'outside'])
      } else {
        expect(r).toMatchObject({ event: 'failed', error: { code: 'EMFILE' } })
        expect(ls(dir)).toEqual(['chain', 'outside'])
      }
      const pool = path.join(dir, 'pool')
      const d = await run({ op: 'dispose', src, pool, limits: { nofileHeadroom: headroom } })
      console.log(`allocate + dispose + sweep with ${headroom} free fds: ${JSON.stringify(d.event === 'result' ? d.entries : d.error)}`)
      if (d.event === 'result') expect(d.entries).toEqual(['.vmspace'])
      else expect(d).toMatchObject({ event: 'failed', error: { code: 'EMFILE' } })
      if (fs.existsSync(path.join(pool, '.vmspace'))) expect(poolState(pool)).toEqual({ visible: [], staging: [], trash: [], leases: [] })
      expect(snapshotTree(outside)).toEqual(before)
      runCommand('rm', ['-rf', '--one-file-system', path.join(dir, 'chain'), path.join(dir, 'dst')])
    })
  }
})

describe('Pool.leasePath with what a careless caller passes', () => {
  test('junk is refused with the argument error of its kind; a workspace name of any prefix gives its lease file; a closed pool still answers', async () => {
    const dir = freshDir()
    const pool = await openPool(path.join(dir, 'pool'))
    const id = 'a'.repeat(31) + '7'
    for (const junk of [undefined, null, 42, { toString: () => `vm-${id}` }, [`vm-${id}`]])
      expect(() => pool.leasePath(junk as string), String(junk)).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARG_TYPE' }))
    for (const junk of ['', id, `-${id}`, `vm-${id.toUpperCase()}`, `vm-${id.slice(1)}`, `../vm-${id}`, `a/vm-${id}`, `vm-${id}\0`, `vm-${id}/`, `.vm-${id}`, `${'p'.repeat(223)}-${id}`])
      expect(() => pool.leasePath(junk), JSON.stringify(junk)).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARG_VALUE' }))
    expect(pool.leasePath(`vm-${id}`)).toBe(path.join(pool.root, '.vmspace', 'leases', 'a', `vm-${id}`))
    await pool.close()
    expect(pool.leasePath(`other_prefix-${id}`)).toBe(path.join(pool.root, '.vmspace', 'leases', 'a', `other_prefix-${id}`))
  })
})

describe('an entry Pool.list() reports whose name is outside openPool\'s prefix rule', () => {
  /** A pool holding `x.y-<id>` with its (empty) lease file, as a hand-made or foreign entry: listed by the core. */
  async function poolWithDottedEntry(): Promise<{ root: string; id: string; name: string }> {
    const pool = await openPool(path.join(freshDir(), 'pool'))
    const id = 'b'.repeat(32)
    const name = `x.y-${id}`
    fs.mkdirSync(path.join(pool.root, name))
    fs.writeFileSync(path.join(pool.root, '.vmspace', 'leases', 'b', name), '')
    expect((await pool.list()).map((w) => w.name)).toEqual([name])
    await pool.close()
    return { root: pool.root, id, name }
  }

  test('Pool.leasePath answers for every name list() gives', async () => {
    const { root, name } = await poolWithDottedEntry()
    await using pool = await openPool(root)
    for (const w of await pool.list()) expect(pool.leasePath(w.name)).toBe(path.join(root, '.vmspace', 'leases', 'b', name))
  })

  test('vmspace inspect ROOT ID shows it (its error, its lease file), as before the cleanup, instead of failing on Pool.leasePath', async () => {
    const { root, id, name } = await poolWithDottedEntry()
    const r = spawnSync(process.execPath, [path.join(repoRoot, 'dist', 'cli', 'vmspace.js'), 'inspect', '--json', root, id], { encoding: 'utf8' })
    expect(r.stderr).not.toMatch(/ERR_INVALID_ARG/)
    expect(JSON.parse(r.stdout)).toMatchObject({ id, name, metadataPath: path.join(root, '.vmspace', 'leases', 'b', name) })
  })
})

describe('pool metrics of a pool whose own directories are gone', () => {
  test('no trash: 0 in the trash; no staging: poolGauges rejects ENOENT naming it and metricsText shows vmspace_pool_up 0', async () => {
    await using pool = await openPool(path.join(freshDir(), 'pool'))
    fs.rmSync(path.join(pool.root, '.vmspace', 'trash'), { recursive: true })
    expect((await poolGauges(pool)).workspaces).toEqual({ live: 0, free: 0, staging: 0, trash: 0 })
    fs.rmSync(path.join(pool.root, '.vmspace', 'staging'), { recursive: true })
    await expect(poolGauges(pool)).rejects.toMatchObject({ code: 'ENOENT', path: path.join(pool.root, '.vmspace', 'staging') })
    expect(await metricsText({ pools: [pool] })).toContain(`vmspace_pool_up{root=${JSON.stringify(pool.root)}} 0`)
  })
})

describe('the vmspace command with junk ids and names', () => {
  const bin = path.join(repoRoot, 'dist', 'cli', 'vmspace.js')
  const cli = (args: string[]) => spawnSync(process.execPath, [bin, ...args], { encoding: 'utf8' })

  test('each is a usage error (exit 2, one line naming the argument) or not found (exit 1), and the pool is unchanged', async () => {
    const root = path.join(freshDir(), 'pool')
    await (await openPool(root)).close()
    const before = snapshotTree(root)
    const id = 'a'.repeat(32)
    const usage: string[][] = [
      ['inspect', root, '../../etc'], ['inspect', root, ''], ['inspect', root, id.toUpperCase()],
      ['checkpoint', root, 'xyz'], ['checkpoint', root, `../${id}`],
      ['rollback', root, id, '../x'], ['rollback', root, 'x', id],
      ['template', 'rm', root, '../x'], ['template', 'rm', root, ''],
      ['ls', path.join(root, '.vmspace')],
    ]
    for (const args of usage) {
      const r = cli(args)
      expect([r.status, r.stderr.trim().split('\n').length], args.join(' ')).toEqual([2, 1])
    }
    for (const args of [['inspect', root, id], ['inspect', root, `vm-${id}`], ['checkpoint', root, id], ['rollback', root, id, id], ['template', 'rm', root, id]])
      expect(cli(args).status, args.join(' ')).toBe(1)
    expect(snapshotTree(root)).toEqual(before)
  })
})

describe.skipIf(!mounts.xfs)(`a workspace holding a chain 10,000 deep ${needs('a loop-mounted XFS', mounts.missing.xfs)}`, () => {
  /** Depth, link count and size of every regular file below `dir`, and its directory count, by find(1) (fts: any depth). */
  const shape = (dir: string) => runCommand('find', [dir, '-printf', '%y %d %n %s\n']).stdout.toString().split('\n').filter((l) => l !== '').sort()

  test('checkpoint copies it exactly, a rollback to it after the chain is cut restores it, and dispose + sweep leave the pool empty', { timeout: 120_000 }, async () => {
    const dir = freshDir(mounts.xfs!)
    const root = path.join(dir, 'pool')
    await using pool = await openPool(root)
    const ws = await pool.allocate()
    expect((await run({ op: 'build', dir: ws.path, depth: 10_000, links: true })).event).toBe('result')
    const before = shape(ws.path)
    const cp = await pool.checkpoint(ws)
    expect(shape(cp.path)).toEqual(before)
    runCommand('rm', ['-rf', path.join(ws.path, 'chain', 'd', 'd')])
    expect(shape(ws.path)).not.toEqual(before)
    await ws.rollback(cp)
    expect(shape(ws.path)).toEqual(before)
    await ws.dispose()
    await pool.removeTemplate(cp.id)
    await pool.sweep()
    expect(poolState(root)).toEqual({ visible: [], staging: [], trash: [], leases: [] })
  })
})

/**
 * Workspace names (DESIGN.md, first rule): a drawn name that exists anywhere — the root, staging, or a lease file — is
 * never adopted; a fresh name is drawn instead, at most 16 tries, then ERR_NAME_EXHAUSTED.
 * Collisions are forced with the native test seam setTestIds (the next ids randomId() returns, process-wide).
 */
// First: the test build of the addon, with its seams, for this whole process.
import { testHooks as native } from './native-hooks.js'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterEach, describe, expect, test } from 'vitest'
import { openPool, VmspaceError } from '../lib/index.js'
import { freshDir, leasePath, poolState, randomId, snapshotTree } from './helpers.js'

afterEach(() => native.setTestIds([]))

async function freshPool() {
  return openPool(path.join(freshDir(), 'pool'))
}

/** A directory `dir` holding a file, as something else's entry. */
function plantDir(dir: string): void {
  fs.mkdirSync(dir)
  fs.writeFileSync(path.join(dir, 'keep.txt'), `not yours: ${dir}`)
}


/** A random id whose lease shard (its first hex digit) is not `id`'s. */
function idInAnotherShard(id: string): string {
  for (;;) {
    const other = randomId()
    if (other[0] !== id[0]) return other
  }
}

describe('a drawn name that exists is never adopted', () => {
  /**
   * Plants a directory at `at(root, taken)` in a fresh pool and allocates with `taken` drawn first: the next id is
   * used, after one retry, and the planted entry is untouched.
   */
  async function allocatePastPlanted(at: (root: string, taken: string) => string) {
    const pool = await freshPool()
    const taken = randomId()
    const next = idInAnotherShard(taken) // its own lease file must not land in the directory compared below
    const planted = at(pool.root, taken)
    plantDir(planted)
    const before = snapshotTree(planted)
    native.setTestIds([taken, next])
    const ws = await pool.allocate()
    expect(ws.id).toBe(next)
    expect(snapshotTree(planted)).toEqual(before)
    expect(pool.stats().nameRetries).toBe(1)
    return { pool, taken, planted, before, ws }
  }

  test('an existing <root>/vm-<id> is skipped: the next id is used, the existing entry and its file are untouched', async () => {
    const { pool, taken, planted, before, ws } = await allocatePastPlanted((root, id) => path.join(root, `vm-${id}`))
    expect(poolState(pool.root)).toEqual({ visible: [`vm-${taken}`, ws.name].sort(), staging: [], trash: [], leases: [`${ws.id[0]}/${ws.name}`] })
    await ws.dispose()
    expect(snapshotTree(planted)).toEqual(before)
  })

  test('an existing .vmspace/staging/s<i>/vm-<id> is skipped and left untouched (a build from a template)', async () => {
    const pool = await freshPool()
    const taken = randomId()
    const next = idInAnotherShard(taken) // its own lease file must not land in the directory compared below
    const template = freshDir()
    fs.writeFileSync(path.join(template, 'a.txt'), 'a')
    // In every shard: a build uses the shard of its thread.
    for (let i = 0; i < 8; i++) plantDir(path.join(pool.root, '.vmspace', 'staging', `s${i}`, `vm-${taken}`))
    const before = snapshotTree(path.join(pool.root, '.vmspace', 'staging'))
    native.setTestIds([taken, next])
    const ws = await pool.allocate({ template })
    expect(ws.id).toBe(next)
    expect(pool.stats().nameRetries).toBe(1)
    expect(snapshotTree(path.join(pool.root, '.vmspace', 'staging'))).toEqual(before)
    expect(poolState(pool.root).leases).toEqual([`${ws.id[0]}/${ws.name}`])
    await ws.dispose()
  })

  test('an existing lease file .vmspace/leases/<x>/vm-<id> is skipped and left byte-identical', async () => {
    const pool = await freshPool()
    const taken = randomId()
    const next = idInAnotherShard(taken) // its own lease file must not land in the directory compared below
    const planted = leasePath(pool.root, `vm-${taken}`)
    fs.writeFileSync(planted, '{"someone":"else"}\n')
    const before = snapshotTree(path.dirname(planted))
    native.setTestIds([taken, next])
    const ws = await pool.allocate()
    expect(ws.id).toBe(next)
    expect(pool.stats().nameRetries).toBe(1)
    expect(poolState(pool.root)).toMatchObject({ visible: [ws.name], staging: [], trash: [] })
    await ws.dispose()
    expect(snapshotTree(path.dirname(planted))).toEqual(before)
  })

  test('a name drawn again after a collision at publish is skipped when its lease file exists', async () => {
    // The first name collides in the root only when publishing (a build from a template); the name drawn next has a
    // lease file (another allocate is building it). Claiming it would make two workspaces of one name.
    const pool = await freshPool()
    const template = freshDir()
    fs.writeFileSync(path.join(template, 'a.txt'), 'a')
    const [inRoot, leased] = [randomId(), randomId()]
    const next = idInAnotherShard(leased) // its own lease file must not land in the directory compared below
    plantDir(path.join(pool.root, `vm-${inRoot}`))
    const planted = leasePath(pool.root, `vm-${leased}`)
    fs.writeFileSync(planted, 'another build')
    const before = snapshotTree(path.dirname(planted))
    native.setTestIds([inRoot, leased, next])
    const ws = await pool.allocate({ template })
    expect(ws.id).toBe(next)
    expect(pool.stats().nameRetries).toBe(2)
    expect(snapshotTree(path.dirname(planted))).toEqual(before)
    await ws.dispose()
  })

  test('15 collisions in a row still succeed with the 16th name drawn', async () => {
    const pool = await freshPool()
    const ids = Array.from({ length: 16 }, randomId)
    for (const id of ids.slice(0, 15)) plantDir(path.join(pool.root, `vm-${id}`))
    native.setTestIds(ids)
    const ws = await pool.allocate()
    expect(ws.id).toBe(ids[15])
    expect(pool.stats().nameRetries).toBe(15)
    await ws.dispose()
  })
})

describe('ERR_NAME_EXHAUSTED', () => {
  test('16 colliding names in a row (root and lease files) reject, leaving nothing new anywhere', async () => {
    const pool = await freshPool()
    const ids = Array.from({ length: 16 }, randomId)
    ids.slice(0, 10).forEach((id) => plantDir(path.join(pool.root, `vm-${id}`)))
    ids.slice(10).forEach((id) => fs.writeFileSync(leasePath(pool.root, `vm-${id}`), `{"id":"${id}"}`))
    const before = snapshotTree(pool.root)
    native.setTestIds(ids)
    const err = await pool.allocate().catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ERR_NAME_EXHAUSTED' })
    expect(snapshotTree(pool.root)).toEqual(before)
    expect(pool.stats()).toMatchObject({ allocated: 0, failed: 1 })
  })

  test('16 names colliding in the root alone reject the same way', async () => {
    const pool = await freshPool()
    const ids = Array.from({ length: 16 }, randomId)
    ids.forEach((id) => plantDir(path.join(pool.root, `vm-${id}`)))
    const before = snapshotTree(pool.root)
    native.setTestIds(ids)
    await expect(pool.allocate()).rejects.toMatchObject({ code: 'ERR_NAME_EXHAUSTED' })
    expect(snapshotTree(pool.root)).toEqual(before)
  })
})

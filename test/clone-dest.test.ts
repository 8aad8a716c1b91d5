/**
 * Clone destinations: an existing one is EEXIST and untouched unless `overwrite` (then replaced atomically);
 * inside a workspace the destination is resolved beneath it without following any symlink, so nothing planted
 * there can redirect a write outside (DESIGN.md, "Clone engine").
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { clone, openPool, VmspaceError } from '../lib/index.js'
import { freshDir, snapshotTree, tempLeftovers, writeRandomFile } from './helpers.js'

async function setup() {
  const dir = freshDir()
  const src = path.join(dir, 'src.img')
  const data = writeRandomFile(src, 128 * 1024)
  const pool = await openPool(path.join(dir, 'pool'))
  const ws = await pool.allocate()
  return { dir, src, data, pool, ws }
}

describe('clone onto an existing destination', () => {
  test('clone() rejects with EEXIST and leaves the destination untouched', async () => {
    const dir = freshDir()
    const src = path.join(dir, 'src.img')
    const dst = path.join(dir, 'dst.img')
    writeRandomFile(src, 64 * 1024)
    fs.writeFileSync(dst, 'precious')
    const before = snapshotTree(dir)
    const err = await clone(src, dst).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'EEXIST', errno: -17, syscall: 'linkat', path: src, dest: dst })
    expect(snapshotTree(dir)).toEqual(before)
  })

  test('clone() with overwrite: true replaces it, leaving no temp file', async () => {
    const dir = freshDir()
    const src = path.join(dir, 'src.img')
    const dst = path.join(dir, 'dst.img')
    const data = writeRandomFile(src, 64 * 1024)
    fs.writeFileSync(dst, 'old')
    await clone(src, dst, { overwrite: true })
    expect(fs.readFileSync(dst).equals(data)).toBe(true)
    expect(fs.readdirSync(dir).sort()).toEqual(['dst.img', 'src.img'])
  })

  test('Workspace.clone rejects with EEXIST and leaves the destination untouched', async () => {
    const { src, ws } = await setup()
    fs.writeFileSync(path.join(ws.path, 'disk.img'), 'precious')
    const before = snapshotTree(ws.path)
    const err = await ws.clone(src, 'disk.img').catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'EEXIST', errno: -17, path: src, dest: path.join(ws.path, 'disk.img') })
    expect(snapshotTree(ws.path)).toEqual(before)
    await ws.dispose()
  })

  test('Workspace.clone with overwrite: true replaces it, leaving no temp file', async () => {
    const { src, data, ws } = await setup()
    fs.writeFileSync(path.join(ws.path, 'disk.img'), 'old')
    await ws.clone(src, 'disk.img', { overwrite: true })
    expect(fs.readFileSync(path.join(ws.path, 'disk.img')).equals(data)).toBe(true)
    expect(fs.readdirSync(ws.path)).toEqual(['disk.img'])
    await ws.dispose()
  })
})

describe('Workspace.clone never writes outside the workspace', () => {
  test('a destination whose parent is a planted symlink to an outside directory fails (ENOTDIR/ELOOP); nothing is written outside', async () => {
    const { dir, src, ws } = await setup()
    const outside = path.join(dir, 'outside')
    fs.mkdirSync(outside)
    fs.symlinkSync(outside, path.join(ws.path, 'evil'))
    const err = await ws.clone(src, 'evil/x').catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(['ENOTDIR', 'ELOOP']).toContain((err as VmspaceError).code)
    expect(fs.readdirSync(outside)).toEqual([])
    expect(fs.readdirSync(ws.path)).toEqual(['evil'])
    await ws.dispose()
  })

  test('a planted symlink deeper on the way is refused the same way', async () => {
    const { dir, src, ws } = await setup()
    const outside = path.join(dir, 'outside')
    fs.mkdirSync(outside)
    fs.mkdirSync(path.join(ws.path, 'sub'))
    fs.symlinkSync(outside, path.join(ws.path, 'sub', 'evil'))
    const err = await ws.clone(src, 'sub/evil/x').catch((e: unknown) => e)
    expect(['ENOTDIR', 'ELOOP']).toContain((err as VmspaceError).code)
    expect(fs.readdirSync(outside)).toEqual([])
    expect(tempLeftovers(path.join(ws.path, 'sub'))).toEqual([])
    await ws.dispose()
  })

  test('a destination that is a planted symlink to an outside file is EEXIST; the outside file is untouched', async () => {
    const { dir, src, ws } = await setup()
    const victim = path.join(dir, 'victim.txt')
    fs.writeFileSync(victim, 'outside data')
    const link = path.join(ws.path, 'disk.img')
    fs.symlinkSync(victim, link)
    await expect(ws.clone(src, 'disk.img')).rejects.toMatchObject({ code: 'EEXIST' })
    expect(fs.readFileSync(victim, 'utf8')).toBe('outside data')
    expect(fs.readlinkSync(link)).toBe(victim)
    await ws.dispose()
  })

  test('with overwrite: true the planted symlink itself is replaced; the outside file is untouched', async () => {
    const { dir, src, data, ws } = await setup()
    const victim = path.join(dir, 'victim.txt')
    fs.writeFileSync(victim, 'outside data')
    const link = path.join(ws.path, 'disk.img')
    fs.symlinkSync(victim, link)
    await ws.clone(src, 'disk.img', { overwrite: true })
    expect(fs.lstatSync(link).isFile()).toBe(true)
    expect(fs.readFileSync(link).equals(data)).toBe(true)
    expect(fs.readFileSync(victim, 'utf8')).toBe('outside data')
    await ws.dispose()
  })

  test('a destination whose parent directory is missing is ENOENT (parents are not made)', async () => {
    const { src, ws } = await setup()
    await expect(ws.clone(src, 'missing/disk.img')).rejects.toMatchObject({ code: 'ENOENT' })
    expect(fs.readdirSync(ws.path)).toEqual([])
    await ws.dispose()
  })

  test('after dispose, Workspace.clone rejects with ERR_DISPOSED', async () => {
    const { src, ws } = await setup()
    await ws.dispose()
    await expect(ws.clone(src, 'disk.img')).rejects.toMatchObject({ code: 'ERR_DISPOSED' })
  })
})

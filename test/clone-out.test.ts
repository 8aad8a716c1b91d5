/**
 * Copying out of a workspace (ws.copyOut): the source is a guest's, so it is resolved beneath the workspace with no
 * symlink followed, and nothing of the host a guest points at is ever copied (docs/lifecycle.md, "Copying out").
 */
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { openPool } from '../lib/index.js'
import { freshDir, mounts, needs, writeRandomFile } from './helpers.js'

async function setup() {
  const dir = freshDir()
  const pool = await openPool(path.join(dir, 'pool'))
  const ws = await pool.allocate()
  const out = path.join(dir, 'out')
  fs.mkdirSync(out)
  // A host file the guest should never reach.
  const secret = path.join(dir, 'secret')
  fs.writeFileSync(secret, 'host secret\n')
  return { dir, pool, ws, out, secret }
}

describe('ws.copyOut', () => {
  test('a file and a tree come out with their exact bytes; a symlink in the tree is recreated, never followed', async () => {
    const { pool, ws, out, secret } = await setup()
    const data = writeRandomFile(path.join(ws.path, 'result.bin'), 96 * 1024)
    fs.mkdirSync(path.join(ws.path, 'logs'))
    fs.writeFileSync(path.join(ws.path, 'logs', 'run.log'), 'ok\n')
    fs.symlinkSync(secret, path.join(ws.path, 'logs', 'link'))
    const file = await ws.copyOut('result.bin', path.join(out, 'result.bin'))
    expect(file).toMatchObject({ kind: 'file', files: 1, bytes: data.length, path: path.join(out, 'result.bin') })
    expect(fs.readFileSync(path.join(out, 'result.bin')).equals(data)).toBe(true)
    const tree = await ws.copyOut('logs', path.join(out, 'logs'))
    expect(tree).toMatchObject({ kind: 'tree', files: 1, symlinks: 1 })
    expect(fs.readFileSync(path.join(out, 'logs', 'run.log'), 'utf8')).toBe('ok\n')
    expect(fs.readlinkSync(path.join(out, 'logs', 'link'))).toBe(secret)
    await ws.dispose()
    await pool.close()
  })

  test('a guest symlink to a host file as the source is ELOOP; nothing is written at dest', async () => {
    const { pool, ws, out, secret } = await setup()
    fs.symlinkSync(secret, path.join(ws.path, 'output.txt'))
    const dest = path.join(out, 'output.txt')
    await expect(ws.copyOut('output.txt', dest)).rejects.toMatchObject({
      code: 'ELOOP', syscall: 'open', path: path.join(ws.path, 'output.txt'), dest,
    })
    expect(fs.readdirSync(out)).toEqual([])
    await ws.dispose()
    await pool.close()
  })

  test('a guest symlink to a host directory in the middle of the path is ENOTDIR; nothing is written at dest', async () => {
    const { dir, pool, ws, out } = await setup()
    fs.symlinkSync(dir, path.join(ws.path, 'results'))
    const dest = path.join(out, 'copy')
    await expect(ws.copyOut('results/secret', dest)).rejects.toMatchObject({ code: 'ENOTDIR', path: path.join(ws.path, 'results') })
    expect(fs.readdirSync(out)).toEqual([])
    await ws.dispose()
    await pool.close()
  })

  test('a source that is not normalised and relative is ERR_INVALID_ARG_VALUE before anything is opened', async () => {
    const { pool, ws, out } = await setup()
    for (const source of ['../secret', '/etc/shadow', 'a/../../secret', ''])
      await expect(ws.copyOut(source, path.join(out, 'x'))).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
    await expect(ws.copyOut('x', path.join(out, 'x'), { follow: true } as object)).rejects.toMatchObject({ code: 'ERR_INVALID_ARG_VALUE' })
    expect(fs.readdirSync(out)).toEqual([])
    await ws.dispose()
    await pool.close()
  })

  test('after dispose copyOut is ERR_DISPOSED', async () => {
    const { pool, ws, out } = await setup()
    await ws.dispose()
    await expect(ws.copyOut('x', path.join(out, 'x'))).rejects.toMatchObject({ code: 'ERR_DISPOSED' })
    await pool.close()
  })
})

describe.skipIf(!mounts.root)(`ws.copyOut of a guest's device node ${needs('root (mknod)', !mounts.root && 'not running as root')}`, () => {
  test('a block device node the guest made is ERR_SOURCE_TYPE, never opened; nothing is written at dest', async () => {
    const { pool, ws, out } = await setup()
    const rootDev = fs.statSync('/').dev
    const made = spawnMknod(path.join(ws.path, 'disk'), rootDev)
    expect(made).toBe(0)
    await expect(ws.copyOut('disk', path.join(out, 'disk'))).rejects.toMatchObject({ code: 'ERR_SOURCE_TYPE', path: path.join(ws.path, 'disk') })
    expect(fs.readdirSync(out)).toEqual([])
    await ws.dispose()
    await pool.close()
  })
})

/** mknod(1) of a block device node with the device number `dev` (as fs.Stats gives it); its exit status. */
function spawnMknod(p: string, dev: number): number | null {
  const major = (dev >> 8) & 0xfff
  const minor = (dev & 0xff) | ((dev >> 12) & 0xfff00)
  return spawnSync('mknod', [p, 'b', String(major), String(minor)]).status
}

/**
 * Checkpoints and rollback with real sandboxes (docs/checkpoints.md): a crun container whose root file system is
 * the workspace, and a QEMU guest whose ext4 disk is a file in it. What the sandbox saw before the checkpoint is
 * what a new sandbox sees after the rollback, byte for byte; a rollback while the sandbox still holds the lease is
 * refused and changes nothing.
 *
 * Needs root, crun and busybox-static for the container (VMSPACE_REQUIRE_CRUN=1 turns their absence into a
 * failure), and QEMU, a guest kernel and busybox-static for the guest (VMSPACE_REQUIRE_BOOT=1); each part is
 * skipped with the reason printed otherwise.
 */
import { createHash, randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterEach, describe, expect, test } from 'vitest'
import { openPool, type Pool, type Workspace } from '../lib/index.js'
import { busybox, containerId, crunMissing, crunSync, requireCrun, writeBundleConfig } from './crun-helpers.js'
import { emptyPoolState, freshDir, mounts, needs, poolState, sha256File } from './helpers.js'
import { bootTools, Guests } from './qemu-helpers.js'

const containerMissing = crunMissing()
const { tools, missing: bootMissing } = bootTools()
if (containerMissing) console.log(`checkpoint-runtime.test.ts: the container part skipped: ${containerMissing}`)
if (bootMissing) console.log(`checkpoint-runtime.test.ts: the guest part skipped: ${bootMissing}`)

/** A pool on the loop-mounted XFS (reflink clones) where the setup made one, else on the scratch file system. */
async function runtimePool(label: string): Promise<{ pool: Pool; root: string; dir: string }> {
  const dir = freshDir(mounts.xfs ?? mounts.scratch, label)
  const root = path.join(dir, 'pool')
  return { pool: await openPool(root), root, dir }
}

/** Each entry below `dir` (relative, sorted) with its kind, mode and, for files, sha256; a symlink's target. Inodes left out. */
function treeHashes(dir: string): Record<string, string> {
  const out: Record<string, string> = {}
  for (const rel of (fs.readdirSync(dir, { recursive: true }) as string[]).sort()) {
    const abs = path.join(dir, rel)
    const st = fs.lstatSync(abs)
    const mode = (st.mode & 0o7777).toString(8)
    if (st.isFile()) out[rel] = `file ${mode} ${createHash('sha256').update(fs.readFileSync(abs)).digest('hex')}`
    else if (st.isSymbolicLink()) out[rel] = `symlink -> ${fs.readlinkSync(abs)}`
    else out[rel] = `${st.isDirectory() ? 'dir' : 'other'} ${mode}`
  }
  return out
}

describe.skipIf(containerMissing !== undefined)(`rolling back a crun container's workspace ${needs('root, crun and busybox-static', containerMissing)}`, () => {
  const containers: string[] = []
  afterEach(() => {
    for (const id of containers.splice(0)) crunSync(['delete', '--force', id])
  })

  /** Runs `script` in a new container (a bundle of its own in `dir`) whose root is the workspace; returns its stdout. */
  function runIn(ws: Workspace, dir: string, script: string): string {
    const bundle = fs.mkdtempSync(path.join(dir, 'bundle-'))
    writeBundleConfig(bundle, ws.path, script)
    const id = containerId()
    containers.push(id)
    const r = crunSync(['run', '--bundle', bundle, id])
    expect(r.stderr).toBe('')
    expect(r.status).toBe(0)
    return r.stdout
  }

  test('files a container wrote and deleted after the checkpoint are undone: a new container sees exactly the checkpoint`s tree', async () => {
    const { pool, root, dir } = await runtimePool('cp-crun')
    try {
      const ws = await pool.allocate()
      fs.mkdirSync(path.join(ws.path, 'bin'))
      fs.copyFileSync(busybox!, path.join(ws.path, 'bin', 'busybox'))
      fs.chmodSync(path.join(ws.path, 'bin', 'busybox'), 0o755)
      for (const applet of ['sh', 'mkdir', 'rm', 'ln', 'find', 'sort', 'sha256sum', 'xargs']) fs.symlinkSync('busybox', path.join(ws.path, 'bin', applet))
      // What the container sees of /data: every entry, and every file's sha256.
      const listing = 'cd /data && find . | sort && find . -type f | sort | xargs sha256sum'

      runIn(ws, dir, 'mkdir -p /data/sub && echo one > /data/a.txt && echo two > /data/sub/b.txt && ln -s a.txt /data/link')
      const seen = runIn(ws, dir, listing)
      const sha = (text: string) => createHash('sha256').update(text).digest('hex')
      expect(seen).toBe(`.\n./a.txt\n./link\n./sub\n./sub/b.txt\n${sha('one\n')}  ./a.txt\n${sha('two\n')}  ./sub/b.txt\n`)
      const before = treeHashes(path.join(ws.path, 'data'))
      const cp = await ws.checkpoint()

      runIn(ws, dir, 'echo changed > /data/a.txt && rm -r /data/sub && echo three > /data/c.txt')
      expect(runIn(ws, dir, listing)).not.toBe(seen)

      const r = await ws.rollback(cp)
      expect(r).toEqual({ checkpoint: cp.id, removed: true })
      expect(runIn(ws, dir, listing)).toBe(seen)
      expect(treeHashes(path.join(ws.path, 'data'))).toEqual(before)

      await ws.dispose()
      await pool.removeTemplate(cp.id)
      expect(poolState(root)).toEqual(emptyPoolState)
    } finally {
      await pool.close()
    }
  })
})

describe.skipIf(bootMissing !== undefined)(`rolling back a QEMU guest's workspace ${needs('QEMU, a guest kernel and busybox-static', bootMissing)}`, () => {
  test(
    'a guest boots again after a rollback and reads the file as it was at the checkpoint; while QEMU holds the lease the rollback is refused',
    async () => {
      const { pool, root, dir } = await runtimePool('cp-qemu')
      const guests = await Guests.open(tools!, dir)
      try {
        const ws = await guests.workspace(pool)
        const [kept, later] = [`kept-${randomBytes(8).toString('hex')}`, `later-${randomBytes(8).toString('hex')}`]
        const disk = path.join(ws.path, 'rootfs.ext4')

        const first = await guests.start(ws)
        let cpId: string
        try {
          await first.answer('ready')
          first.type(`write ${kept}`)
          await first.answer(`write ${kept}`)
          // Stopped, QEMU writes nothing to the disk while the checkpoint clones it.
          await first.qmp('stop')
          const cp = await ws.checkpoint()
          cpId = cp.id
          await first.qmp('cont')
          first.type(`write ${later}`)
          await first.answer(`write ${later}`)
          first.type('read')
          await first.answer(`read ${later}`)
          await first.qmp('stop')
          const hash = await sha256File(disk)
          await expect(ws.rollback(cp)).rejects.toMatchObject({ code: 'ERR_LEASE_HELD' })
          expect(await sha256File(disk)).toBe(hash)
        } finally {
          await first.quit()
        }

        expect(await ws.rollback(cpId)).toEqual({ checkpoint: cpId, removed: true })
        const second = await guests.start(ws)
        try {
          await second.answer('ready')
          second.type('read')
          await second.answer(`read ${kept}`)
        } finally {
          await second.quit()
        }

        await ws.dispose()
        await pool.removeTemplate(cpId)
        expect(poolState(root)).toEqual(emptyPoolState)
      } finally {
        await pool.close()
      }
    },
    300_000,
  )
})

if (containerMissing !== undefined && requireCrun)
  test('crun and busybox-static are installed (required by VMSPACE_REQUIRE_CRUN=1)', () => {
    expect.fail(containerMissing)
  })
if (bootMissing !== undefined && process.env.VMSPACE_REQUIRE_BOOT === '1')
  test('QEMU, a guest kernel and busybox-static are installed (required by VMSPACE_REQUIRE_BOOT=1)', () => {
    expect.fail(bootMissing)
  })

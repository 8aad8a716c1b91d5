/**
 * The restore contract of docs/restore.md, run with QEMU: a template guest is saved (its migration stream written
 * into its workspace), committed, and restored twice, each child by its own QEMU started in its own workspace with
 * the template's command line and relative file names. Each child types its own marker into its disk; the markers
 * and the template's disk are then checked byte for byte.
 *
 * Needs qemu-system-x86, linux-image-amd64, busybox-static and e2fsprogs (as test/boot.test.ts; CI sets
 * VMSPACE_REQUIRE_BOOT=1, which turns their absence into a failure). KVM when a probe guest boots under it, else TCG.
 */
import { randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { fsckClean } from '../demo/boot/checks.js'
import { runOk } from '../demo/boot/tools.js'
import { openPool } from '../lib/index.js'
import { emptyPoolState, eventually, freshDir, ls, mounts, needs, poolState, sha256File } from './helpers.js'
import { bootTools, Guests } from './qemu-helpers.js'

const { tools, missing } = bootTools()
if (missing) console.log(`restore.test.ts: skipped: ${missing}`)

/** What /data.txt holds in the ext4 image `disk`, read by debugfs from outside. */
async function dataFile(disk: string): Promise<string> {
  return runOk(tools!.debugfs, ['-R', 'cat /data.txt', disk])
}

/** Whether the raw bytes of `file` contain `text` anywhere (data blocks, journal, free space alike). */
function holds(file: string, text: string): boolean {
  return fs.readFileSync(file).includes(Buffer.from(text))
}

describe.skipIf(missing !== undefined)(`restoring a saved QEMU guest in children of its workspace ${needs('QEMU, a guest kernel and busybox-static', missing)}`, () => {
  test(
    'two children restored from one shared migration stream each write their own disk; the template`s disk is unchanged',
    async () => {
      const dir = freshDir(mounts.xfs ?? mounts.scratch, 'restore')
      const guests = await Guests.open(tools!, dir)
      const root = path.join(dir, 'pool')
      const pool = await openPool(root)
      try {
        // The template guest: kernel, initramfs and disk in its workspace, booted to its console loop, then saved.
        const parent = await guests.workspace(pool)
        const saved = await guests.start(parent)
        try {
          await saved.answer('ready')
          await saved.qmp('stop')
          // `completed` can come before QEMU has closed the stream: the name appears only once cat has all of it.
          await saved.qmp('migrate', { uri: 'exec:cat > state.part && mv state.part state' })
          expect(await saved.until('query-migrate', 'status', ['setup', 'active'])).toBe('completed')
        } finally {
          await saved.quit()
        }
        await eventually(() => fs.existsSync(path.join(parent.path, 'state')))
        const parentHash = await sha256File(path.join(parent.path, 'rootfs.ext4'))
        const share = ['state', 'vmlinuz', 'initrd']
        const sizes = share.map((f) => fs.statSync(path.join(parent.path, f)).size)
        const t = await pool.commit(parent, { share })
        expect(t.shared).toEqual(share.map((p, i) => ({ path: p, bytes: sizes[i] })))
        await parent.dispose()
        const templateDisk = path.join(t.path, 'rootfs.ext4')
        expect(await sha256File(templateDisk)).toBe(parentHash)

        // Two children, each restored by its own QEMU in its own workspace: the same command line, -incoming.
        const markers = [`marker-${randomBytes(8).toString('hex')}`, `marker-${randomBytes(8).toString('hex')}`]
        const children = await Promise.all(markers.map(() => pool.allocate({ from: t.id })))
        await Promise.all(
          children.map(async (child, i) => {
            const m = await guests.start(child, ['-incoming', 'exec:cat state'])
            try {
              // A stream saved from a stopped guest restores stopped: QEMU leaves `inmigrate` for `paused`.
              expect(await m.until('query-status', 'status', ['inmigrate'])).toBe('paused')
              await m.qmp('cont')
              m.type(`write ${markers[i]}`)
              await m.answer(`write ${markers[i]}`)
              m.type('ro')
              await m.answer('ro done')
            } finally {
              await m.quit()
            }
          }),
        )

        // The read-only artifacts are one inode in every child (and the template's shared/), never a copy.
        for (const f of share) {
          const [a, b] = children.map((c) => fs.statSync(path.join(c.path, f)))
          expect([a!.ino, a!.mode & 0o7777, a!.nlink]).toEqual([b!.ino, 0o444, 3])
        }
        for (const [i, child] of children.entries()) {
          const disk = path.join(child.path, 'rootfs.ext4')
          expect(await fsckClean(tools!, disk)).toEqual({ clean: true, detail: 'exit 0' })
          expect(await dataFile(disk)).toBe(`${markers[i]}\n`)
          expect(holds(disk, markers[i]!)).toBe(true)
          expect(holds(disk, markers[1 - i]!)).toBe(false)
        }
        expect(markers.some((m) => holds(templateDisk, m))).toBe(false)
        expect(await sha256File(templateDisk)).toBe(parentHash)

        for (const child of children) await child.dispose()
        await pool.removeTemplate(t.id)
        expect(poolState(root)).toEqual(emptyPoolState)
        expect(ls(path.join(root, '.vmspace', 'templates')).filter((n) => /^[0-9a-f]{32}$/.test(n))).toEqual([])
      } finally {
        await pool.close()
      }
    },
    300_000,
  )
})

if (missing !== undefined && process.env.VMSPACE_REQUIRE_BOOT === '1')
  test('QEMU, a guest kernel and busybox-static are installed (required by VMSPACE_REQUIRE_BOOT=1)', () => {
    expect.fail(missing)
  })

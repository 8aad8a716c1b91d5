/**
 * Imported images run: a container started by crun on a workspace allocated from an image imported as a tree, and a
 * QEMU guest booting its workspace's clone of an image imported as `rootfs.ext4`, each reading a file of the
 * image's top layer (and not one a higher layer whited out). The images are built here with umoci from a static
 * busybox, in three layers.
 *
 * Needs root, umoci and skopeo; the container crun (Debian: crun, busybox-static), the guest QEMU, a guest kernel
 * and busybox-static (as test/boot.test.ts). Each part is skipped with the reason printed where its tools are
 * missing; VMSPACE_REQUIRE_CRUN=1 and VMSPACE_REQUIRE_BOOT=1 (CI) turn that into a failure.
 */
import { randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterEach, describe, expect, test } from 'vitest'
import { guestImages } from '../demo/boot/image.js'
import { chooseAccel, GuestVm } from '../demo/boot/qemu.js'
import { runBootDemo } from '../demo/boot/run.js'
import { findBootTools, type BootTools } from '../demo/boot/tools.js'
import { openPool, type Pool } from '../lib/index.js'
import { busybox, containerId, crunMissing, crunSync, requireCrun, writeBundleConfig } from './crun-helpers.js'
import { freshDir, mounts, needs } from './helpers.js'
import { buildImage, ociToolsMissing, type LayerSpec } from './oci-helpers.js'

const ociMissing = ociToolsMissing()
const containerMissing: string | undefined = ociMissing || crunMissing()
let bootTools: BootTools | undefined
let bootMissing: string | undefined = ociMissing || undefined
if (!bootMissing)
  try {
    bootTools = findBootTools()
  } catch (e) {
    bootMissing = (e as Error).message
  }
if (containerMissing) console.log(`image-runtime.test.ts: the container part skipped: ${containerMissing}`)
if (bootMissing) console.log(`image-runtime.test.ts: the boot part skipped: ${bootMissing}`)

/** The guest's /init: prints the top layer's file on the console, then powers off (QEMU reports the power-off). */
const GUEST_INIT = `#!/bin/busybox sh
/bin/busybox echo "vmspace-image-top: $(/bin/busybox cat /etc/top.txt)"
/bin/busybox echo "vmspace-image-gone: $(/bin/busybox ls /etc/lower.txt 2>&1)"
/bin/busybox poweroff -f
`

/**
 * Three layers: busybox with its applets (and the guest's /init and the directories the initramfs needs); two files
 * of /etc; the top layer rewrites one of them with `top` and removes the other (a whiteout).
 */
function runtimeLayers(top: string, busybox: string): LayerSpec[] {
  const applets = ['sh', 'cat', 'ls', 'echo']
  return [
    [
      { dir: 'bin' },
      { file: 'bin/busybox', data: fs.readFileSync(busybox), mode: 0o755 },
      ...applets.map((a) => ({ symlink: `bin/${a}`, target: 'busybox' })),
      { file: 'init', data: GUEST_INIT, mode: 0o755 },
      ...['dev', 'proc', 'sys', 'tmp'].map((d) => ({ dir: d })),
    ],
    [{ dir: 'etc' }, { file: 'etc/top.txt', data: 'the middle layer\n' }, { file: 'etc/lower.txt', data: 'whited out above\n' }],
    [{ remove: 'etc/top.txt' }, { file: 'etc/top.txt', data: `${top}\n`, mode: 0o644 }, { remove: 'etc/lower.txt' }],
  ]
}

/** A pool on the loop-mounted XFS (reflink clones) where the setup made one, else on the scratch file system. */
async function imagePool(): Promise<{ pool: Pool; dir: string }> {
  const dir = freshDir(mounts.xfs ?? mounts.scratch, 'image-run')
  const pool = await openPool(path.join(dir, 'pool'))
  return { pool, dir }
}

describe.skipIf(containerMissing !== undefined)(
  `a container on a workspace of an imported image ${needs('root, umoci, skopeo, crun and busybox-static', containerMissing)}`,
  () => {
    const containers: string[] = []
    afterEach(() => {
      for (const id of containers.splice(0)) crunSync(['delete', '--force', id])
    })

    test('crun runs busybox from the imported tree and prints the top layer`s file; the whited-out one is gone', async () => {
      const { pool, dir } = await imagePool()
      const top = `top layer ${randomBytes(8).toString('hex')}`
      const { layoutDir, ref } = buildImage(path.join(dir, 'oci'), runtimeLayers(top, busybox!), { ref: 'runtime' })
      try {
        const t = await pool.importImage(`oci:${layoutDir}:${ref}`)
        expect(t.image.format).toBe('tree')
        const ws = await pool.allocate({ from: t.id })
        const bundle = path.join(dir, 'bundle')
        fs.mkdirSync(bundle)
        writeBundleConfig(bundle, ws.path, 'cat /etc/top.txt; ls /etc/lower.txt 2>&1; echo "status $?"')
        const id = containerId()
        containers.push(id)
        const r = crunSync(['run', '--bundle', bundle, id])
        expect(r.stderr).toBe('')
        expect(r.stdout).toBe(`${top}\nls: /etc/lower.txt: No such file or directory\nstatus 1\n`)
        expect(r.status).toBe(0)
        await ws.dispose()
      } finally {
        await pool.close()
      }
    })
  },
)

describe.skipIf(bootMissing !== undefined)(`a guest booting an imported rootfs.ext4 ${needs('root, umoci, skopeo, QEMU, a guest kernel and busybox-static', bootMissing)}`, () => {
  test(
    'QEMU boots the workspace`s clone of the image`s rootfs.ext4 and the guest prints the top layer`s file; the template is unchanged',
    async () => {
      const tools = bootTools!
      const { pool, dir } = await imagePool()
      try {
        const top = `top layer ${randomBytes(8).toString('hex')}`
        const { layoutDir, ref } = buildImage(path.join(dir, 'oci'), runtimeLayers(top, tools.busybox), { ref: 'guest' })
        const t = await pool.importImage(`oci:${layoutDir}:${ref}`, { format: 'ext4', ext4: { headroomBytes: 16 << 20 } })
        expect(fs.readdirSync(t.path)).toEqual(['rootfs.ext4'])
        const before = fs.readFileSync(path.join(t.path, 'rootfs.ext4'))
        const ws = await pool.allocate({ from: t.id })
        const images = await guestImages(tools)
        const accel = (await chooseAccel(tools, images, dir)).accel
        const consoleLog = path.join(dir, 'console.log')
        const vm = new GuestVm({ tools, images, disk: path.join(ws.path, 'rootfs.ext4'), accel, consoleLog, leaseFd: ws.leaseFd, nice: 10, cmdline: '' })
        try {
          const off = await vm.waitPowerOff(600_000)
          expect(off, `${vm.stderr}\n${fs.readFileSync(consoleLog, 'utf8')}`).toEqual({ kind: 'poweroff' })
        } finally {
          await vm.quit()
        }
        const lines = fs.readFileSync(consoleLog, 'utf8').split(/\r?\n/)
        expect(lines).toContain(`vmspace-image-top: ${top}`)
        expect(lines).toContain('vmspace-image-gone: ls: /etc/lower.txt: No such file or directory')
        await ws.dispose()
        expect(fs.readFileSync(path.join(t.path, 'rootfs.ext4')).equals(before)).toBe(true)
      } finally {
        await pool.close()
      }
    },
    900_000,
  )

  test(
    'the boot demo boots VMs of an imported image (--image): each clone gets the demo`s init from the initramfs and passes every check',
    async () => {
      const root = freshDir(mounts.xfs ?? mounts.scratch, 'boot-image')
      const { layoutDir, ref } = buildImage(path.join(root, 'oci'), [[{ dir: 'etc' }, { file: 'etc/os-release', data: 'ID=vmspace-test\n' }]], { ref: 'tiny' })
      const lines: string[] = []
      const report = await runBootDemo({ boot: 2, parallel: 2, root, nice: 10, image: `oci:${layoutDir}:${ref}`, log: (l) => lines.push(l), timeoutMs: 600_000 })
      const failed = [...report.vms.flatMap((v) => v.checks.filter((c) => !c.ok).map((c) => `${v.name}: ${c.name}: ${c.detail}`)),
        ...report.runChecks.filter((c) => !c.ok).map((c) => `${c.name}: ${c.detail}`)]
      expect(failed, `${lines.join('\n')}\n${report.table}`).toEqual([])
      expect(lines).toContainEqual(expect.stringMatching(/^imported oci:.* as rootfs\.ext4 \(template tiny, 1 layer\(s\), 0 reused\)/))
      expect(report.vms.map((v) => v.outcome)).toEqual(['booted', 'booted'])
      expect(report.left).toBe(0)
      expect(report.ok).toBe(true)
    },
    900_000,
  )
})

if (containerMissing !== undefined && requireCrun)
  test('crun and busybox-static are installed (required by VMSPACE_REQUIRE_CRUN=1)', () => {
    expect.fail(containerMissing)
  })
if (bootMissing !== undefined && process.env.VMSPACE_REQUIRE_BOOT === '1')
  test('umoci, skopeo, QEMU, a guest kernel and busybox-static are installed (required by VMSPACE_REQUIRE_BOOT=1)', () => {
    expect.fail(bootMissing)
  })

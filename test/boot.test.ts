/**
 * The main job end to end on real VMs: two guests boot under QEMU in parallel, each from its own workspace's
 * clone of the base image, with the workspace's lease held by QEMU alone; afterwards every clone is checked and
 * a sweep alone reclaims the workspaces. Needs qemu-system-x86, linux-image-amd64 and busybox-static (CI installs
 * them and sets VMSPACE_REQUIRE_BOOT=1, which turns their absence into a failure); skipped with the reason
 * printed otherwise. On the loop-mounted XFS when the setup made one (reflink clones), else on ext4 (copies).
 */
import { describe, expect, test } from 'vitest'
import { runBootDemo } from '../demo/boot/run.js'
import { findBootTools } from '../demo/boot/tools.js'
import { freshDir, mounts, needs } from './helpers.js'

let missing: string | undefined
try {
  findBootTools()
} catch (e) {
  missing = (e as Error).message
}
const requireBoot = process.env.VMSPACE_REQUIRE_BOOT === '1'
if (missing) console.log(`boot.test.ts: skipped: ${missing}`)

describe.skipIf(missing !== undefined)(`booting guests on workspaces ${needs('QEMU, a guest kernel and busybox-static', missing)}`, () => {
  test(
    'two VMs boot in parallel, each writes only its own token into its own clone, and sweep() alone reclaims both',
    async () => {
      const root = freshDir(mounts.xfs ?? mounts.scratch, 'boot')
      const lines: string[] = []
      // nice 10: two TCG guests would otherwise take both cores from the suite's other files running beside.
      const report = await runBootDemo({ boot: 2, parallel: 2, root, nice: 10, log: (l) => lines.push(l), timeoutMs: 600_000 })
      const failed = [...report.vms.flatMap((v) => v.checks.filter((c) => !c.ok).map((c) => `${v.name}: ${c.name}: ${c.detail}`)),
        ...report.runChecks.filter((c) => !c.ok).map((c) => `${c.name}: ${c.detail}`)]
      expect(failed, `${lines.join('\n')}\n${report.table}`).toEqual([])
      expect(report.vms.map((v) => v.outcome)).toEqual(['booted', 'booted'])
      expect(report.vms.map((v) => v.method)).toEqual(mounts.xfs ? ['reflink', 'reflink'] : ['copy', 'copy'])
      for (const v of report.vms)
        expect(v.checks.map((c) => c.name)).toEqual([
          'lease held by QEMU alone after release()',
          'e2fsck -fn clean',
          'the guest wrote its own token',
          "no other VM's token in the clone",
          'base byte-identical (sha256)',
          'workspace reclaimed by sweep() alone (no dispose)',
        ])
      expect(report.left).toBe(0)
      expect(report.ok).toBe(true)
      expect(report.kept).toBe(false)
    },
    // TCG boots on a loaded 2-core machine take tens of seconds; the KVM probe adds at most 20 s once per host boot.
    900_000,
  )
})

if (missing !== undefined && requireBoot)
  test('QEMU, a guest kernel and busybox-static are installed (required by VMSPACE_REQUIRE_BOOT=1)', () => {
    expect.fail(missing)
  })

/**
 * `vmspace demo --boot N` / `npm run demo -- --boot N` [--parallel P] [--root DIR] [--chaos] [--accel auto|kvm|tcg]`: boots N real
 * guests under QEMU, each on its own vmspace workspace (see run.ts), and prints the summary table. Exit status 0
 * when every check passed and no workspace is left, 1 otherwise, 2 for bad arguments, 3 when this machine cannot
 * boot guests (the message names the packages to install).
 */
import * as os from 'node:os'
import * as path from 'node:path'
import { parseArgs } from 'node:util'
import { imageSourceProblem } from '../../shared/image-source.js'
import { statOrUndefined } from '../util.js'
import { runBootDemo, type BootDemoOptions } from './run.js'
import { BootUnavailableError } from './tools.js'

export { runBootDemo, formatTable } from './run.js'
export type { BootDemoOptions, BootReport, VmResult, Check } from './run.js'
export { BootUnavailableError, BOOT_PACKAGES, findBootTools } from './tools.js'

const USAGE = `usage: vmspace demo --boot N [options]   (npm run demo -- --boot N [options])

Boots N virtual machines (QEMU, a busybox guest), each on its own workspace whose lease QEMU holds,
checks every clone after its guest powers off, and lets sweep() reclaim the workspaces.

  --boot N         number of VMs (default 4)
  --parallel P     at most P VMs at once (default min(N, ${os.availableParallelism()} CPUs))
  --root DIR       make the run's pool under DIR, e.g. an XFS mount to see reflink (default ${os.tmpdir()});
                   a missing DIR is made when its parent exists
  --chaos          SIGKILL a share of the QEMU processes mid-boot
  --accel A        auto (default: KVM if a short probe boots a guest, else TCG), kvm or tcg
  --timeout S      per-VM limit in seconds from QEMU's start to the guest's power-off (default 300)
  --image SOURCE   boot an OCI image instead of the demo's busybox base: imported into the pool as
                   rootfs.ext4 (pool.importImage, as root); SOURCE is a layout directory, an
                   oci-archive or a docker-archive (or oci:DIR[:REF], ...). The initramfs puts the
                   demo's guest init and its busybox into each VM's clone
  --keep           keep the run directory (kept anyway when a check fails)
  -h, --help       this text

Needs (Debian 12): apt-get install --no-install-recommends qemu-system-x86 linux-image-amd64 busybox-static`

function positiveInt(name: string, value: string | undefined, fallback: number | undefined): number | undefined {
  if (value === undefined) return fallback
  const n = Number(value)
  if (!/^[0-9]+$/.test(value) || !Number.isSafeInteger(n) || n < 1) throw new RangeError(`--${name} takes a positive integer, got ${JSON.stringify(value)}`)
  return n
}

/**
 * `--root DIR` as the other demo takes it (demo/options.ts): resolved against the current directory; an existing
 * non-directory, or a missing DIR whose parent is missing too, is refused here (exit 2) rather than by mkdtemp later.
 */
function checkRoot(value: string): string {
  if (value.trim() === '') throw new RangeError('--root must name a directory')
  const root = path.resolve(value)
  const st = statOrUndefined(root)
  if (st && !st.isDirectory()) throw new RangeError(`--root ${root} exists and is not a directory`)
  if (!st && !statOrUndefined(path.dirname(root))?.isDirectory()) throw new RangeError(`--root ${root}: its parent directory does not exist`)
  return root
}

/** `--image SOURCE`: something that exists (which kind of image it is, importImage decides). */
function imageArg(value: string): string {
  const problem = value.trim() === '' ? 'must name an image' : imageSourceProblem(value)
  if (problem) throw new RangeError(`--image ${problem}`)
  return value
}

/** Parses the demo's arguments (strict: an unknown option is an error). */
export function parseBootArgs(argv: string[]): BootDemoOptions | 'help' {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    allowPositionals: false,
    options: {
      boot: { type: 'string' },
      parallel: { type: 'string' },
      root: { type: 'string' },
      chaos: { type: 'boolean' },
      accel: { type: 'string' },
      timeout: { type: 'string' },
      keep: { type: 'boolean' },
      image: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) return 'help'
  const accel = values.accel ?? 'auto'
  if (accel !== 'auto' && accel !== 'kvm' && accel !== 'tcg') throw new RangeError(`--accel takes auto, kvm or tcg, got ${JSON.stringify(accel)}`)
  return {
    boot: positiveInt('boot', values.boot, 4)!,
    parallel: positiveInt('parallel', values.parallel, undefined),
    root: values.root === undefined ? undefined : checkRoot(values.root),
    chaos: values.chaos ?? false,
    accel,
    timeoutMs: (positiveInt('timeout', values.timeout, 300) ?? 300) * 1000,
    keep: values.keep ?? false,
    ...(values.image === undefined ? {} : { image: imageArg(values.image) }),
  }
}

export async function main(argv: string[]): Promise<number> {
  let options: BootDemoOptions | 'help'
  try {
    options = parseBootArgs(argv)
  } catch (e) {
    // One line, as every vmspace usage error (node:util's parseArgs explains over several lines).
    console.error(`vmspace demo: ${(e as Error).message.replace(/\n/g, ' ')} (see vmspace demo --boot 1 --help)`)
    return 2
  }
  if (options === 'help') {
    console.log(USAGE)
    return 0
  }
  try {
    const report = await runBootDemo(options)
    console.log(`\nvmspace boot demo: ${options.boot} VMs${options.image ? ` of ${options.image}` : ''}${options.chaos ? ' with --chaos' : ''}\n${report.table}`)
    return report.ok ? 0 : 1
  } catch (e) {
    if (e instanceof BootUnavailableError) {
      console.error(e.message)
      return 3
    }
    throw e
  }
}

if (require.main === module) {
  main(process.argv.slice(2)).then(
    (code) => {
      process.exitCode = code
    },
    (e) => {
      console.error(e)
      process.exitCode = 1
    },
  )
}

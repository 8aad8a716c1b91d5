/** The demo's command line: its help text and options, checked before anything is made. */
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { parseArgs } from 'node:util'
import { CRASH_ENV, describe, MARKER_LEN, MARKER_OFFSET, ROOTFS, TREE_MARKER } from './protocol.js'
import { imageSourceProblem } from '../shared/image-source.js'
import { statOrUndefined } from './util.js'

export const HELP = `Usage: vmspace demo [options]      (npm run demo -- [options])

Shows what vmspace is for: worker processes share one pool and together make many
workspaces at once, each with a private copy-on-write clone of a real base image as
${ROOTFS}; each workspace gets its own marker, which is read back before dispose.
The run then checks that the base is unchanged (sha256), that no two workspaces
shared a path, and that nothing is left in the pool, and prints a summary.

Options:
  --vms N          workspaces to make in all (default 200)
  --workers N      worker processes (default 2 x CPUs = ${2 * os.availableParallelism()})
  --live N         workspaces each worker holds live at once (default 4)
  --root DIR       pool directory (default: a new directory under ${os.tmpdir()},
                   removed at the end: as root with mkfs.btrfs, the mount of an
                   image-backed pool (a sparse btrfs image beside it, unmounted,
                   detached and deleted at the end), so clones are reflinks on
                   any host; else a plain directory). Put a DIR you name on XFS
                   (mkfs.xfs -m reflink=1) or btrfs to see reflink clones; it is kept.
  --base FILE      base image to clone (default: an ext4 image of Node's own npm
                   package and headers, built once with mke2fs and cached in
                   ${os.tmpdir()}; the node executable where mke2fs is missing)
  --template-dir DIR
                   start every workspace from the directory tree DIR instead of
                   the base image (allocate({ template: DIR }): its contents
                   become the workspace's contents). Each workspace gets its own
                   marker file and its id written into its clone of one template
                   file; the tree must be the template's, and the template (its
                   listing, modes, sizes, times and file contents) must be
                   unchanged at the end. On another file system than the pool, DIR
                   is copied into the pool once and the workspaces clone the copy.
  --image SOURCE   start every workspace from an OCI image imported into the pool
                   (pool.importImage, as root): SOURCE is an image layout
                   directory, an oci-archive or a docker-archive (a path, or
                   oci:DIR[:REF], oci-archive:FILE[:REF], docker-archive:FILE[:REF];
                   skopeo copy docker://IMAGE oci:DIR:REF fetches one). Each
                   workspace is allocated from the image template
                   (allocate({ from })), gets its marker as with --template-dir,
                   and must hold the image's tree; the template must be
                   unchanged at the end. It stays in a pool you name (--root).
  --quota BYTES    give every workspace a disk quota of BYTES (suffix K, M, G:
                   binary units), enforced by the kernel (allocate({ quota })):
                   the pool must be on btrfs with quotas enabled (btrfs quota
                   enable MNT) or XFS/ext4 with project quotas, as root. The first
                   workspace of worker 0 then runs a runaway writer that writes
                   until the kernel refuses: it must get EDQUOT within BYTES, and
                   every other workspace must still finish.
  --chaos [N|P%]   SIGKILL N workers, or P% of them (default 25%, at least 1),
                   each after it has allocated some of its workspaces. For each
                   one killed, a replacement worker makes the rest of its share,
                   so --vms workspaces still complete. Then one
                   pool.sweep({ graceMs: 0 }) must reclaim exactly what the killed
                   workers left: the workspaces they reported and did not report
                   disposed, those they published but could not report (known by
                   the pid in their metadata), and the staging entries of builds
                   they were in. Use it only on a pool nobody else is using.
  --fork N         instead of the workers: one parent workspace, committed and
                   forked into N children (pool.fork); each child writes its own
                   marker, isolation is checked, the time per child reported
  --boot N         boot N real virtual machines under QEMU instead, each on its own
                   workspace whose lease QEMU holds (vmspace demo --boot 1 --help
                   lists that mode's options)
  -h, --help       show this help

Exit status: 0 all checks passed, 1 a check failed, 2 bad arguments,
128+signal when interrupted (130 for Ctrl-C).
Environment: ${CRASH_ENV}=N makes worker 0 kill itself (SIGKILL)
right after its N-th allocate, to show that a crashed worker fails the run.
`

export interface Options {
  vms: number
  workers: number
  live: number
  root?: string
  base?: string
  templateDir?: string
  /** --image: an OCI image SOURCE to import and allocate every workspace from. */
  image?: string
  /** --quota: bytes per workspace. */
  quota?: number
  /** --chaos: how many workers to kill, as a count or a percentage of --workers. */
  chaos?: { count: number } | { percent: number }
  /** --fork N: fork one parent into N children instead of running the workers. */
  fork?: number
}

export class UsageError extends Error {}

function positiveInt(name: string, value: string | undefined, fallback: number, max: number): number {
  if (value === undefined) return fallback
  if (!/^\s*\d+\s*$/.test(value)) throw new UsageError(`--${name} must be a positive integer, got ${JSON.stringify(value)}`)
  const n = Number(value)
  if (n < 1) throw new UsageError(`--${name} must be at least 1, got ${value.trim()}`)
  if (n > max) throw new UsageError(`--${name} must be at most ${max}, got ${value.trim()}`)
  return n
}

/** `--chaos` takes an optional value: `--chaos 3`, `--chaos 25%`, `--chaos=3`, or `--chaos` alone. */
function chaosArgs(argv: string[]): string[] {
  const out: string[] = []
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--') {
      out.push(...argv.slice(i))
      break
    }
    if (argv[i] !== '--chaos') out.push(argv[i])
    else if (i + 1 < argv.length && /^\s*\d+\s*%?\s*$/.test(argv[i + 1])) out.push(`--chaos=${argv[++i]}`)
    else out.push('--chaos=')
  }
  return out
}

/** --root DIR: absolute; a directory, or missing with an existing parent (made then, as openPool makes a pool). */
function rootOption(value: string): string {
  if (value.trim() === '') throw new UsageError('--root must name a directory')
  const root = path.resolve(value)
  const st = statOrUndefined(root)
  if (st && !st.isDirectory()) throw new UsageError(`--root ${root} exists and is not a directory`)
  if (!st && !statOrUndefined(path.dirname(root))?.isDirectory()) throw new UsageError(`--root ${root}: its parent directory does not exist`)
  return root
}

/** --base FILE: a readable regular file large enough to hold the demo's marker. */
function baseOption(value: string): string {
  if (value.trim() === '') throw new UsageError('--base must name a file')
  const base = path.resolve(value)
  const st = statOrUndefined(base)
  if (!st) throw new UsageError(`--base ${base} does not exist`)
  if (!st.isFile()) throw new UsageError(`--base ${base} is not a regular file`)
  if (st.size < MARKER_OFFSET + MARKER_LEN) throw new UsageError(`--base ${base} is too small (${st.size} bytes; at least ${MARKER_OFFSET + MARKER_LEN})`)
  try {
    fs.accessSync(base, fs.constants.R_OK)
  } catch {
    throw new UsageError(`--base ${base} is not readable`)
  }
  return base
}

/** --template-dir DIR: a readable directory that does not hold the demo's marker file name. */
function templateDirOption(value: string): string {
  if (value.trim() === '') throw new UsageError('--template-dir must name a directory')
  const dir = path.resolve(value)
  const st = statOrUndefined(dir)
  if (!st) throw new UsageError(`--template-dir ${dir} does not exist`)
  if (!st.isDirectory()) throw new UsageError(`--template-dir ${dir} is not a directory`)
  try {
    fs.accessSync(dir, fs.constants.R_OK | fs.constants.X_OK)
  } catch {
    throw new UsageError(`--template-dir ${dir} is not readable`)
  }
  if (statOrUndefined(path.join(dir, TREE_MARKER))) throw new UsageError(`--template-dir ${dir} holds ${TREE_MARKER}, the name of the demo's marker file`)
  return dir
}

/** --quota SIZE: bytes (`64M`, `1G`, `1048576`), at least 1 MiB. */
function quotaOption(value: string): number {
  const m = /^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$/i.exec(value)
  const n = m ? Number(m[1]) * 1024 ** 'BKMGT'.indexOf((m[2] || 'B').toUpperCase()) : NaN
  if (!m || !Number.isSafeInteger(n) || n < 1024 * 1024) throw new UsageError(`--quota must be a size of at least 1M (e.g. 64M, 1G), got ${JSON.stringify(value)}`)
  return n
}

/** --chaos [N|P%]: a count of workers to kill, or a percentage of them (25% when given alone). */
function chaosOption(value: string): NonNullable<Options['chaos']> {
  const c = value.trim()
  if (c === '') return { percent: 25 }
  if (c.endsWith('%')) return { percent: positiveInt('chaos', c.slice(0, -1), 25, 100) }
  return { count: positiveInt('chaos', c, 1, 256) }
}

export function parseOptions(argv: string[]): Options | 'help' {
  let parsed
  try {
    parsed = parseArgs({
      args: chaosArgs(argv),
      options: {
        vms: { type: 'string' },
        workers: { type: 'string' },
        live: { type: 'string' },
        root: { type: 'string' },
        base: { type: 'string' },
        'template-dir': { type: 'string' },
        image: { type: 'string' },
        chaos: { type: 'string' },
        fork: { type: 'string' },
        quota: { type: 'string' },
        help: { type: 'boolean', short: 'h' },
      },
      strict: true,
      allowPositionals: false,
    })
  } catch (e) {
    throw new UsageError(describe(e))
  }
  const v = parsed.values
  if (v.help) return 'help'
  const opts: Options = {
    vms: positiveInt('vms', v.vms, 200, 100_000),
    workers: positiveInt('workers', v.workers, 2 * os.availableParallelism(), 256),
    live: positiveInt('live', v.live, 4, 256),
  }
  if (v.root !== undefined) opts.root = rootOption(v.root)
  if (v.base !== undefined) opts.base = baseOption(v.base)
  if (v['template-dir'] !== undefined) {
    if (v['template-dir'].trim() !== '' && opts.base) throw new UsageError('--template-dir and --base exclude each other: a workspace starts from one of them')
    opts.templateDir = templateDirOption(v['template-dir'])
  }
  if (v.image !== undefined) {
    if (opts.base || opts.templateDir) throw new UsageError(`--image and --${opts.base ? 'base' : 'template-dir'} exclude each other: a workspace starts from one of them`)
    const problem = v.image.trim() === '' ? 'must name an image' : imageSourceProblem(v.image)
    if (problem) throw new UsageError(`--image ${problem}`)
    opts.image = v.image
  }
  if (v.quota !== undefined) opts.quota = quotaOption(v.quota)
  if (v.chaos !== undefined) opts.chaos = chaosOption(v.chaos)
  if (v.fork !== undefined) {
    if (opts.chaos) throw new UsageError('--fork and --chaos exclude each other')
    opts.fork = positiveInt('fork', v.fork, 1, 4096)
  }
  if (opts.workers > opts.vms) opts.workers = opts.vms
  return opts
}

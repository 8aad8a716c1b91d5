/**
 * vitest globalSetup: the real file systems the suites run on (DESIGN.md, "Platform": never a mock).
 *
 * One set per vitest worker, under `<fresh dir>/w<N>`:
 * - `scratch`: a fresh directory under os.tmpdir() (the machine's own ext4: no reflink).
 * - As root, with mkfs.xfs / mkfs.btrfs / mkfs.ext4 present: sparse 512 MiB images formatted as XFS
 *   (`-m reflink=1`) and btrfs, and a 64 MiB ext4 for ENOSPC, each loop-mounted beside it.
 *   What cannot be made is reported in `missing` (the reflink suites then skip, or fail under
 *   VMSPACE_REQUIRE_REFLINK=1).
 *
 * Teardown unmounts everything below that directory (tests' leftover bind mounts first, `umount -l` where a
 * plain umount fails) and deletes it; it also runs when the setup itself fails and, as a last resort, at exit.
 */
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import type { TestProject } from 'vitest/node'
import { fsTypeOf, removeScratch, type Mounts } from './mounts.js'

const repoRoot = path.resolve(__dirname, '..', '..')
const MiB = 1024 * 1024

let base: string | undefined

function cleanup(): void {
  if (base === undefined) return
  const dir = base
  base = undefined
  process.off('exit', cleanup)
  removeScratch(dir)
}

function commandExists(cmd: string): boolean {
  return spawnSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' }).status === 0
}

function run(cmd: string, args: string[]): void {
  const r = spawnSync(cmd, args, { encoding: 'utf8' })
  if (r.error) throw new Error(`${cmd}: ${r.error.message}`)
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')} exited ${r.status}: ${(r.stderr || r.stdout).trim()}`)
}

/** A sparse image of `size` bytes formatted by `mkfs`, loop-mounted at `<base>/<name>`. */
function makeLoopFs(dir: string, name: string, size: number, mkfs: string[]): string {
  const image = path.join(dir, `${name}.img`)
  const mountPoint = path.join(dir, name)
  try {
    const fd = fs.openSync(image, 'wx')
    fs.ftruncateSync(fd, size)
    fs.closeSync(fd)
    run(mkfs[0], [...mkfs.slice(1), image])
    fs.mkdirSync(mountPoint)
    // Another job taking a free loop device at the same moment makes mount fail once: try again.
    for (let attempt = 1; ; attempt++) {
      try {
        run('mount', ['-o', 'loop', image, mountPoint])
        break
      } catch (e) {
        if (attempt === 3) throw e
        spawnSync('sleep', ['0.5'])
      }
    }
    // mkdtemp directories below are 0700; the mount point itself is left open for tests running as another uid.
    fs.chmodSync(mountPoint, 0o755)
    return mountPoint
  } catch (e) {
    removeScratch(mountPoint)
    fs.rmSync(image, { force: true })
    throw e
  }
}

/** dist/ (what child processes and workers load) and the addon must exist and be newer than their sources. */
function checkBuild(): void {
  const stale: string[] = []
  const newest = (dir: string, re: RegExp): number => {
    let t = 0
    for (const e of fs.readdirSync(dir, { withFileTypes: true, recursive: true })) {
      if (e.isFile() && re.test(e.name)) t = Math.max(t, fs.statSync(path.join(e.parentPath, e.name)).mtimeMs)
    }
    return t
  }
  const addon = path.join(repoRoot, 'build', 'Release', 'vmspace.node')
  if (!fs.existsSync(addon)) stale.push('build/Release/vmspace.node is missing')
  else if (fs.statSync(addon).mtimeMs < newest(path.join(repoRoot, 'native'), /\.(cc|h)$/))
    stale.push('build/Release/vmspace.node is older than native/')
  // The test build with the seams (test/hooks-env.ts), unless the run is pointed at another one (the sanitizer run).
  const hooked = path.join(repoRoot, 'build-cmake', 'Release', 'vmspace.node')
  if (!process.env.VMSPACE_PREBUILD && fs.existsSync(hooked) &&
      fs.statSync(hooked).mtimeMs < newest(path.join(repoRoot, 'native'), /\.(cc|h)$/))
    stale.push('build-cmake/Release/vmspace.node (the test build) is older than native/: npm run build:test-addon')
  // The modules the package entry loads (lib/index.ts and what it imports, transitively).
  const seen = new Set<string>()
  const visit = (name: string) => {
    if (seen.has(name)) return
    seen.add(name)
    const src = path.join(repoRoot, 'lib', `${name}.ts`)
    const out = path.join(repoRoot, 'dist', `${name}.js`)
    if (!fs.existsSync(out)) stale.push(`dist/${name}.js is missing`)
    else if (fs.existsSync(src) && fs.statSync(out).mtimeMs < fs.statSync(src).mtimeMs)
      stale.push(`dist/${name}.js is older than lib/${name}.ts`)
    if (!fs.existsSync(src)) return
    for (const m of fs.readFileSync(src, 'utf8').matchAll(/from '\.\/([\w-]+)\.js'/g)) visit(m[1])
  }
  visit('index')
  if (stale.length)
    throw new Error(
      `vmspace tests load the built package in child processes and workers; run \`npm run build\` first (${stale.join('; ')})`,
    )
}

/** One worker's file systems: a scratch dir and the loop mounts, under `dir`. */
function mountSet(dir: string, root: boolean): Mounts {
  fs.mkdirSync(dir, { mode: 0o755 })
  fs.chmodSync(dir, 0o755)
  const scratch = path.join(dir, 'scratch')
  fs.mkdirSync(scratch, { mode: 0o755 })
  fs.chmodSync(scratch, 0o755)
  const mounts: Mounts = { scratch, scratchFsType: fsTypeOf(scratch), xfs: null, btrfs: null, small: null, missing: {}, root }
  const wanted = [
    { key: 'xfs', size: 512 * MiB, mkfs: ['mkfs.xfs', '-q', '-f', '-m', 'reflink=1'] },
    { key: 'btrfs', size: 512 * MiB, mkfs: ['mkfs.btrfs', '-q', '-f'] },
    { key: 'small', size: 64 * MiB, mkfs: ['mkfs.ext4', '-q', '-F', '-m', '0'] },
  ] as const
  for (const w of wanted) {
    if (!root) mounts.missing[w.key] = 'not running as root (loop mounts need root)'
    else if (!commandExists(w.mkfs[0])) mounts.missing[w.key] = `${w.mkfs[0]} is not installed`
    else {
      try {
        mounts[w.key] = makeLoopFs(dir, w.key, w.size, [...w.mkfs])
      } catch (e) {
        mounts.missing[w.key] = (e as Error).message
      }
    }
  }
  return mounts
}

/**
 * A set of file systems per worker (vitest's `maxWorkers`; a test file finds its own through VITEST_POOL_ID, see
 * test/helpers.ts): files that run at the same time share no loop mount, so one file filling the small ext4 or
 * timing a sweep on XFS never sees another file's work there.
 */
export function setup(project: TestProject): void {
  checkBuild()
  base = fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-test-'))
  process.on('exit', cleanup)
  try {
    fs.chmodSync(base, 0o755)
    const root = process.getuid?.() === 0
    const workers = Math.max(1, project.vitest.config.maxWorkers)
    const sets = Array.from({ length: workers }, (_, i) => mountSet(path.join(base!, `w${i + 1}`), root))
    project.provide('mounts', sets)
  } catch (e) {
    cleanup()
    throw e
  }
}

export function teardown(): void {
  cleanup()
}

/**
 * Containers under crun for the suites that run one on a workspace (test/sandbox.test.ts, test/image-runtime.test.ts):
 * the crun command line and environment, a bundle with a static busybox, and why containers cannot run here.
 */
import { spawnSync } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { isStaticElf, which } from '../demo/boot/tools.js'
import { mounts } from './helpers.js'
import { removeScratch } from './setup/mounts.js'

export const requireCrun = process.env.VMSPACE_REQUIRE_CRUN === '1'
export const BUSYBOX_APPLETS = ['sh', 'ls', 'cat', 'readlink', 'chmod', 'sleep']
const CGROUP2_SUPER_MAGIC = 0x63677270

/** crun and the host's sanitizer runtime do not mix: CI's sanitizer run preloads it for the addon, not for crun. */
export const crunEnv: NodeJS.ProcessEnv = Object.fromEntries(
  Object.entries(process.env).filter(([k]) => !['LD_PRELOAD', 'ASAN_OPTIONS', 'UBSAN_OPTIONS'].includes(k)),
)

/**
 * The command line of `crun <args>`. Cgroups are not what these tests are about, so crun makes none
 * (`--cgroup-manager=disabled`: nothing left in the host's cgroup tree by a killed test). crun 1.8 refuses a host
 * whose /sys/fs/cgroup is a v1/v2 hybrid ("cgroups in hybrid mode not supported") even then; there it runs in a
 * mount namespace of its own with the unified hierarchy mounted at /sys/fs/cgroup, which changes nothing outside.
 * `exec` keeps crun's pid the child's pid (the SIGKILL test kills crun itself).
 */
export function crunCommand(args: string[]): [string, string[]] {
  const crunArgs = ['--cgroup-manager=disabled', ...args]
  if (fs.statfsSync('/sys/fs/cgroup').type === CGROUP2_SUPER_MAGIC) return ['crun', crunArgs]
  return ['unshare', ['--mount', '--propagation', 'private', 'sh', '-c', 'mount -t cgroup2 none /sys/fs/cgroup && exec "$0" "$@"', 'crun', ...crunArgs]]
}

export function crunSync(args: string[]) {
  const [cmd, argv] = crunCommand(args)
  const r = spawnSync(cmd, argv, { encoding: 'utf8', env: crunEnv })
  if (r.error) throw r.error
  return { status: r.status, stdout: r.stdout, stderr: r.stderr }
}

/** A static busybox of the host: the only program of the containers' root file systems. */
export const busybox = ['/bin/busybox', '/usr/bin/busybox'].find((p) => isStaticElf(p))

/**
 * A container bundle in `dir`: `rootfs/` holding busybox and its applets, `config.json` from `crun spec` with the
 * process, the terminal and the root made ours; capabilities, namespaces and mounts stay crun's defaults.
 */
export function makeBundle(dir: string, script: string): string {
  const rootfs = path.join(dir, 'rootfs')
  fs.mkdirSync(path.join(rootfs, 'bin'), { recursive: true })
  fs.copyFileSync(busybox!, path.join(rootfs, 'bin', 'busybox'))
  fs.chmodSync(path.join(rootfs, 'bin', 'busybox'), 0o755)
  for (const applet of BUSYBOX_APPLETS) fs.symlinkSync('busybox', path.join(rootfs, 'bin', applet))
  writeBundleConfig(dir, 'rootfs', script)
  return rootfs
}

/**
 * `config.json` in `dir` from `crun spec`, with the process (`/bin/sh -c script`), the terminal and the root
 * (`rootfs`: relative to `dir`, or absolute) made ours; capabilities, namespaces and mounts stay crun's defaults.
 */
export function writeBundleConfig(dir: string, rootfs: string, script: string): void {
  const spec = spawnSync('crun', ['spec'], { cwd: dir, encoding: 'utf8', env: crunEnv })
  if (spec.status !== 0) throw new Error(`crun spec exited ${spec.status}: ${spec.stderr}`)
  const config = JSON.parse(fs.readFileSync(path.join(dir, 'config.json'), 'utf8'))
  config.process.args = ['/bin/sh', '-c', script]
  config.process.terminal = false
  config.root = { path: rootfs, readonly: false }
  fs.writeFileSync(path.join(dir, 'config.json'), JSON.stringify(config, null, 2))
}

/** Why containers cannot run here, or undefined: root, crun, a static busybox, and one container that ran `true`. */
export function crunMissing(): string | undefined {
  if (process.getuid?.() !== 0) return 'not root (containers need namespaces and mounts)'
  if (!which('crun')) return 'crun is not installed (Debian: apt-get install crun)'
  if (!busybox) return 'no static busybox at /bin/busybox (Debian: apt-get install busybox-static)'
  const dir = fs.mkdtempSync(path.join(mounts.scratch, 'vmspace-crun-probe-'))
  const id = containerId()
  try {
    makeBundle(dir, 'true')
    const r = crunSync(['run', '--bundle', dir, id])
    if (r.status !== 0) return `crun cannot run a container here: exit ${r.status}: ${r.stderr.trim()}`
    return undefined
  } catch (e) {
    return `crun cannot run a container here: ${(e as Error).message}`
  } finally {
    crunSync(['delete', '--force', id])
    removeScratch(dir)
  }
}

export function containerId(): string {
  return `vmspace-test-${randomBytes(6).toString('hex')}`
}

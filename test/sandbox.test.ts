/**
 * Workspaces as the root file systems of real containers (crun), each container given its workspace's lease at fd 3
 * (`crun run --preserve-fds 1`), as a sidecar hands it to the sandbox it starts (DESIGN.md, "lease handoff").
 *
 * What a holder of a lease may do with it: keep its own workspace alive, nothing else. The fd reaches no directory
 * (`/proc/self/fd/3/..` and names below it fail: a directory fd leaked into a container reaches the host, the class
 * of runc's CVE-2024-21626), and the lease file cannot be written, truncated or chmod-ed from a container with
 * crun's default capabilities (neither CAP_DAC_OVERRIDE nor CAP_FOWNER). While a container holds the lease, neither
 * dispose nor sweep nor adopt takes its workspace; once the container is gone, SIGKILLed crun included, one sweep
 * reclaims it.
 *
 * Needs root, crun and a static busybox (Debian: crun, busybox-static); skipped with the reason printed otherwise.
 * CI installs them and sets VMSPACE_REQUIRE_CRUN=1, which turns their absence into a failure. On the scratch file
 * system (ext4 on the dev machines) and on the loop-mounted XFS.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { afterEach, describe, expect, test } from 'vitest'
import { openPool, VmspaceError, type Pool, type Workspace } from '../lib/index.js'
import { emptyPoolState, eventually, freshDir, mounts, needs, openFdTargets, poolState, requireMount } from './helpers.js'
import { containerId, crunCommand, crunEnv, crunMissing, crunSync, makeBundle, requireCrun } from './crun-helpers.js'

/** Containers started by the current test: deleted (`crun delete --force`) after it, whatever happened. */
const started = new Set<Container>()

/**
 * `crun run` of the bundle in `dir` as a child of this process, the lease at fd 3 of crun and (preserved) of the
 * container's process. Stdin is a pipe the test writes lines to; stdout and stderr are collected.
 */
class Container {
  readonly id = containerId()
  readonly proc: ChildProcess
  /** crun's exit. The container's processes may still hold its stdout (crun SIGKILLed): see `closed`. */
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>
  /** crun's exit once every process of the container has closed its stdout and stderr: all output read. */
  readonly closed: Promise<{ code: number | null; signal: NodeJS.Signals | null }>
  stdout = ''
  stderr = ''
  #done = false

  constructor(dir: string, leaseFd: number) {
    const [cmd, argv] = crunCommand(['run', '--bundle', dir, '--preserve-fds', '1', this.id])
    this.proc = spawn(cmd, argv, { stdio: ['pipe', 'pipe', 'pipe', leaseFd], env: crunEnv })
    started.add(this)
    this.proc.stdout!.setEncoding('utf8').on('data', (s: string) => (this.stdout += s))
    this.proc.stderr!.setEncoding('utf8').on('data', (s: string) => (this.stderr += s))
    this.proc.stdin!.on('error', () => {})
    this.exited = new Promise((resolve) =>
      this.proc.once('exit', (code, signal) => {
        this.#done = true
        resolve({ code, signal })
      }),
    )
    this.closed = new Promise((resolve) => this.proc.once('close', (code, signal) => resolve({ code, signal })))
  }

  /** Waits until the container's stdout holds `text` (fails at once when crun exits first). */
  async waitFor(text: string): Promise<void> {
    await eventually(() => {
      if (this.stdout.includes(text)) return true
      if (this.#done) throw new Error(`crun exited before the container wrote ${JSON.stringify(text)}; stdout: ${this.stdout}; stderr: ${this.stderr}`)
      return false
    })
  }

  send(line: string): void {
    this.proc.stdin!.write(line + '\n')
  }

  /** The pid of the container's first process (on the host), from `crun state`. */
  pid(): number {
    const r = crunSync(['state', this.id])
    expect(r.status, r.stderr).toBe(0)
    return (JSON.parse(r.stdout) as { pid: number }).pid
  }

  async remove(): Promise<void> {
    crunSync(['delete', '--force', this.id])
    if (!this.#done) {
      this.proc.kill('SIGKILL')
      await this.exited
    }
  }
}

async function errorOf(p: Promise<unknown>): Promise<VmspaceError> {
  const e = await p.then(
    () => expect.fail('expected a rejection'),
    (e: unknown) => e,
  )
  expect(e).toBeInstanceOf(VmspaceError)
  return e as VmspaceError
}

/** A workspace whose tree is a container bundle running `script`, with `marker` (random hex) at the rootfs's /marker. */
async function sandbox(pool: Pool, script: string): Promise<{ ws: Workspace; rootfs: string; marker: string }> {
  const ws = await pool.allocate()
  const rootfs = makeBundle(ws.path, script)
  const marker = randomBytes(16).toString('hex')
  fs.writeFileSync(path.join(rootfs, 'marker'), marker)
  return { ws, rootfs, marker }
}

/**
 * Splits the output of the escape script into its attempts: each is "== <name>", what it printed, then
 * "== <name> status <n>". Gives each attempt's status and the text after the last ": " of its last line (the
 * errno text of busybox's messages; '' when it printed nothing), and the raw output for the failure message.
 */
function attemptsOf(stdout: string): Record<string, { failed: boolean; error: string; status: number; output: string }> {
  const out: Record<string, { failed: boolean; error: string; status: number; output: string }> = {}
  const re = /^== (.+)\n([\s\S]*?)^== \1 status (\d+)$/gm
  for (let m = re.exec(stdout); m; m = re.exec(stdout)) {
    const lines = m[2].trimEnd().split('\n')
    const last = lines[lines.length - 1]
    const status = Number(m[3])
    const colon = last.lastIndexOf(': ')
    out[m[1]] = { failed: status !== 0, error: colon < 0 ? last : last.slice(colon + 2), status, output: m[2] }
  }
  return out
}

const missing = crunMissing()
if (missing) console.log(`sandbox.test.ts: skipped: ${missing}`)

const fileSystems: [string, string | null, string | undefined][] = [
  [`${mounts.scratchFsType} (the scratch directory)`, mounts.scratch, undefined],
  ['loop-mounted XFS', mounts.xfs, mounts.missing.xfs],
]

describe.skipIf(missing !== undefined)(`workspaces as container root file systems under crun ${needs('root, crun and busybox-static', missing)}`, () => {
  afterEach(async () => {
    for (const c of started) await c.remove()
    started.clear()
  })

  describe.each(fileSystems)('on %s', (label, base, why) => {
    requireMount(label, base, why)

    test.skipIf(base === null)('a container given the lease at fd 3 reaches nothing through it: no directory, no host file, no other workspace, no write to the lease', async () => {
      const dir = freshDir(base!, 'sandbox')
      const pool = await openPool(path.join(dir, 'pool'))
      // A file of the host outside the pool, and another workspace (another sandbox's rootfs) with a marker.
      const hostFile = path.join(dir, 'host.txt')
      fs.writeFileSync(hostFile, 'host bytes\n')
      const other = await pool.allocate()
      const otherMarker = path.join(other.path, 'marker')
      fs.writeFileSync(otherMarker, randomBytes(16).toString('hex'))
      const hostEtc = ['/etc/hostname', '/etc/os-release'].find((f) => fs.existsSync(f))!
      const before = { host: fs.readFileSync(hostFile), other: fs.readFileSync(otherMarker), etc: fs.readFileSync(hostEtc) }

      // Up from the lease to / whatever its depth (".." at / stays at /), then down to an absolute host path.
      const up = '/proc/self/fd/3' + '/..'.repeat(pool.root.split('/').length + 8)
      const attempts: [string, string][] = [
        ['list the directory above the lease', 'ls /proc/self/fd/3/..'],
        ['read a name below the lease', 'cat /proc/self/fd/3/config.json'],
        ['read a host file (/etc) through /', `cat ${up}${hostEtc}`],
        ['read the marker of another workspace, pool-relative', `cat /proc/self/fd/3/../${other.name}/marker`],
        ['read the marker of another workspace through /', `cat ${up}${otherMarker}`],
        ['write the marker of another workspace through /', `echo pwned >> ${up}${otherMarker}`],
        ['write a host file through /', `echo pwned >> ${up}${hostFile}`],
        ['the lease is a directory', '[ -d /proc/self/fd/3 ]'],
        ['append to the lease', 'echo x >> /proc/self/fd/3'],
        ['chmod 666 the lease', 'chmod 666 /proc/self/fd/3'],
        ['truncate the lease', ': > /proc/self/fd/3'],
      ]
      const script = [
        'echo "lease: $(readlink /proc/self/fd/3)"',
        // $(...) drops the output's trailing newlines: each attempt's block ends with one whatever it printed.
        ...attempts.map(([name, cmd]) => `out=$(sh -c '${cmd.replace(/'/g, `'\\''`)}' 2>&1); st=$?; printf '== %s\\n%s\\n== %s status %s\\n' '${name}' "$out" '${name}' $st`),
        'echo done',
      ].join('\n')
      const { ws } = await sandbox(pool, script)
      const leaseMode = fs.fstatSync(ws.leaseFd).mode
      const wsMode = fs.statSync(ws.path).mode

      const c = new Container(ws.path, ws.leaseFd)
      expect(await c.closed, c.stderr).toEqual({ code: 0, signal: null })
      expect(c.stdout).toMatch(/\ndone\n$/)

      const got = attemptsOf(c.stdout)
      const summary = Object.fromEntries(Object.entries(got).map(([name, a]) => [name, { failed: a.failed, error: a.error }]))
      const notADirectory = { failed: true, error: 'Not a directory' }
      expect(summary, c.stdout).toEqual({
        'list the directory above the lease': notADirectory,
        'read a name below the lease': notADirectory,
        'read a host file (/etc) through /': notADirectory,
        'read the marker of another workspace, pool-relative': notADirectory,
        'read the marker of another workspace through /': notADirectory,
        // busybox sh names ENOTDIR of a redirection's directory so.
        'write the marker of another workspace through /': { failed: true, error: 'nonexistent directory' },
        'write a host file through /': { failed: true, error: 'nonexistent directory' },
        // `[ -d ]` of a regular file: false, and nothing printed.
        'the lease is a directory': { failed: true, error: '' },
        // Reopening the lease for writing checks its mode: read-only, and no CAP_DAC_OVERRIDE in the container.
        'append to the lease': { failed: true, error: 'Permission denied' },
        // The lease file is not root's (the pool is), and the container has no CAP_FOWNER.
        'chmod 666 the lease': { failed: true, error: 'Operation not permitted' },
        'truncate the lease': { failed: true, error: 'Permission denied' },
      })
      expect(c.stdout).not.toContain(before.other.toString())
      expect({ host: fs.readFileSync(hostFile), other: fs.readFileSync(otherMarker), etc: fs.readFileSync(hostEtc) }).toEqual(before)
      expect(fs.fstatSync(ws.leaseFd).mode).toBe(leaseMode)
      expect(fs.statSync(ws.path).mode).toBe(wsMode)
    })

    test.skipIf(base === null)('while a container holds the lease, dispose() rejects ERR_LEASE_HELD and removes nothing, sweep and adopt leave it; after it exits one sweep reclaims it', async () => {
      const pool = await openPool(path.join(freshDir(base!, 'sandbox'), 'pool'))
      // The container checks its root file system whenever the test sends a line, and exits on "exit".
      const script = 'echo ready; while read line && [ "$line" != exit ]; do cat /marker 2>&1; ls /bin/busybox 2>&1; echo " checked $?"; done'
      const { ws, rootfs, marker } = await sandbox(pool, script)
      const c = new Container(ws.path, ws.leaseFd)
      await c.waitFor('ready\n')

      const err = await errorOf(ws.dispose())
      expect(err.code).toBe('ERR_LEASE_HELD')
      expect(fs.readFileSync(path.join(rootfs, 'marker'), 'utf8')).toBe(marker)
      c.send('check')
      await c.waitFor(' checked ')
      expect(c.stdout).toBe(`ready\n${marker}/bin/busybox\n checked 0\n`)

      for (const options of [{}, { graceMs: 0 }])
        expect(await pool.sweep(options)).toEqual({ reclaimed: [], live: 1, failed: [], leasesRemoved: 0, foreign: [] })
      expect((await errorOf(pool.adopt(ws.id))).code).toBe('ERR_LEASE_HELD')
      expect(await pool.list()).toEqual([expect.objectContaining({ id: ws.id, live: true })])
      c.send('check')
      await c.waitFor(`checked 0\n${marker}/bin/busybox\n checked `)
      expect(c.stdout).toBe(`ready\n${marker}/bin/busybox\n checked 0\n${marker}/bin/busybox\n checked 0\n`)

      c.send('exit')
      expect(await c.closed, c.stderr).toEqual({ code: 0, signal: null })
      const report = await pool.sweep()
      expect(report.failed).toEqual([])
      expect(report.reclaimed.map((e) => [e.id, e.from])).toEqual([[ws.id, 'published']])
      expect(fs.existsSync(ws.path)).toBe(false)
      expect(poolState(pool.root)).toEqual(emptyPoolState)
      expect(await pool.sweep()).toEqual({ reclaimed: [], live: 0, failed: [], leasesRemoved: 0, foreign: [] })
    })

    test.skipIf(base === null)('crun SIGKILLed while its container runs: the container keeps the lease and its rootfs through a sweep; once it is deleted, one sweep reclaims it', async () => {
      const pool = await openPool(path.join(freshDir(base!, 'sandbox'), 'pool'))
      const { ws, rootfs, marker } = await sandbox(pool, 'echo ready; exec sleep 100000')
      const lease = fs.readlinkSync(`/proc/self/fd/${ws.leaseFd}`)
      const c = new Container(ws.path, ws.leaseFd)
      await c.waitFor('ready\n')
      const pid = c.pid()
      expect(openFdTargets(pid).get(3)).toBe(lease)
      // The sidecar lets go, as in the lifecycle: from now on the container alone keeps the workspace.
      await ws.release()

      c.proc.kill('SIGKILL')
      expect(await c.exited).toEqual({ code: null, signal: 'SIGKILL' })
      expect(openFdTargets(pid).get(3)).toBe(lease)
      for (const options of [{}, { graceMs: 0 }])
        expect(await pool.sweep(options)).toEqual({ reclaimed: [], live: 1, failed: [], leasesRemoved: 0, foreign: [] })
      expect(fs.statSync(path.join(rootfs, 'bin', 'busybox')).isFile()).toBe(true)
      const exec = crunSync(['exec', c.id, '/bin/cat', '/marker'])
      expect(exec, exec.stderr).toMatchObject({ status: 0, stdout: marker })

      const del = crunSync(['delete', '--force', c.id])
      expect(del.status, del.stderr).toBe(0)
      // The container's last process closes its fds as it dies; the lease is free from then on.
      await eventually(async () => (await pool.list()).every((e) => !e.live))
      const report = await pool.sweep()
      expect(report.failed).toEqual([])
      expect(report.reclaimed.map((e) => [e.id, e.from])).toEqual([[ws.id, 'published']])
      expect(fs.existsSync(ws.path)).toBe(false)
      expect(poolState(pool.root)).toEqual(emptyPoolState)
    })
  })
})

if (missing !== undefined && requireCrun)
  test('root, crun and a static busybox can run a container (required by VMSPACE_REQUIRE_CRUN=1)', () => {
    expect.fail(missing)
  })

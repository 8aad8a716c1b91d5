/**
 * Metrics (docs/metrics.md): the counters fed from the tracing channels, a pool's gauges, prom-client registration
 * in a sidecar-shaped process, `vmspace metrics` (stdout, --output, --listen, bad input), every output checked by
 * `promtool check metrics`, and a real Prometheus server scraping a pool under load through its HTTP API.
 * Prometheus and promtool come from Debian's `prometheus` package; CI installs it and sets
 * VMSPACE_REQUIRE_PROMETHEUS=1, which turns their absence into a failure.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process'
import * as dc from 'node:diagnostics_channel'
import * as fs from 'node:fs'
import * as http from 'node:http'
import * as net from 'node:net'
import * as os from 'node:os'
import * as path from 'node:path'
import * as readline from 'node:readline'
import { Registry } from 'prom-client'
import { describe, expect, onTestFinished, test } from 'vitest'
import { lockFile, metricsText, openPool, poolGauges, registerPrometheus, startMetrics, type Pool, type Workspace } from '../lib/index.js'
import { freshDir, killOnFinish, mounts, needs, repoRoot, requireMount, writeRandomFile } from './helpers.js'

const bin = path.join(repoRoot, 'dist', 'cli', 'vmspace.js')
const requirePrometheus = process.env.VMSPACE_REQUIRE_PROMETHEUS === '1'
const which = (cmd: string) => spawnSync('sh', ['-c', `command -v ${cmd}`], { encoding: 'utf8' }).stdout.trim() || null
const promtool = which('promtool') ?? (fs.existsSync('/usr/bin/promtool') ? '/usr/bin/promtool' : null)
const prometheus = which('prometheus') ?? (fs.existsSync('/usr/bin/prometheus') ? '/usr/bin/prometheus' : null)
const missing = promtool && prometheus ? undefined : 'prometheus/promtool not installed (apt-get install prometheus)'

/** `promtool check metrics` accepts the text: exit 0 and no lint finding. */
function checkMetrics(text: string): void {
  if (!promtool) {
    if (requirePrometheus) expect.fail('promtool is missing (required by VMSPACE_REQUIRE_PROMETHEUS=1)')
    return
  }
  const r = spawnSync(promtool, ['check', 'metrics'], { input: text, encoding: 'utf8' })
  expect(r.stdout + r.stderr, text).toBe('')
  expect(r.status).toBe(0)
}

/** The value of one series in a text exposition (undefined when absent). */
function sample(text: string, series: string): number | undefined {
  const line = text.split('\n').find((l) => l.startsWith(series + ' '))
  return line === undefined ? undefined : Number(line.slice(series.length + 1))
}

async function pool(dir = freshDir()): Promise<Pool> {
  const p = await openPool(path.join(dir, 'pool'))
  onTestFinished(() => p.close())
  return p
}

function vmspace(args: string[]): { status: number | null; stdout: string; stderr: string } {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: 'utf8' })
  return { status: r.status, stdout: r.stdout, stderr: r.stderr }
}

/** A usage error: exit 2, nothing on stdout, one line on stderr naming the command. */
function usage(args: string[]): string {
  const r = vmspace(args)
  expect(r.status, r.stderr).toBe(2)
  expect(r.stdout).toBe('')
  expect(r.stderr.trimEnd().split('\n')).toHaveLength(1)
  expect(r.stderr.startsWith('vmspace metrics: ')).toBe(true)
  return r.stderr
}

const channelsListened = () =>
  ['allocate', 'clone', 'dispose', 'sweep', 'lock'].some((op) => {
    const c = dc.tracingChannel(`vmspace:${op}`) as unknown as Record<string, dc.Channel>
    return ['start', 'end', 'asyncStart', 'asyncEnd', 'error'].some((e) => c[e].hasSubscribers)
  })

describe('startMetrics', () => {
  test('counts calls, failures by code, bytes and files by method; close() leaves no subscriber', async () => {
    expect(channelsListened()).toBe(false)
    const dir = freshDir()
    const p = await pool(dir)
    const m = startMetrics()
    expect(channelsListened()).toBe(true)
    const src = path.join(dir, 'src.bin')
    writeRandomFile(src, 10_000)
    const ws = await p.allocate()
    const r = await ws.clone(src, 'a.bin')
    await expect(ws.clone(path.join(dir, 'missing'), 'b')).rejects.toMatchObject({ code: 'ENOENT' })
    const lock = await lockFile(path.join(dir, 'l'))
    await expect(lockFile(path.join(dir, 'l'), { wait: false })).rejects.toMatchObject({ code: 'ERR_LOCK_REENTRANT' })
    await lock.release()
    await ws.dispose()
    await p.sweep({ graceMs: 0 })
    m.close()
    expect(channelsListened()).toBe(false)
    await (await p.allocate()).dispose() // not counted: after close()
    const s = m.snapshot()
    expect(s.operations.allocate).toMatchObject({ count: 1, errors: {} })
    expect(s.operations.clone).toMatchObject({ count: 2, errors: { ENOENT: 1 } })
    expect(s.operations.lock).toMatchObject({ count: 2, errors: { ERR_LOCK_REENTRANT: 1 } })
    expect(s.operations.dispose.count).toBe(1)
    expect(s.operations.sweep.count).toBe(1)
    expect(s.operations.clone.buckets.reduce((a, b) => a + b, 0)).toBe(2)
    expect(s.cloned.clone[r.method as 'copy' | 'reflink']).toEqual({ files: 1, bytes: 10_000 })
    expect(r.method).toBe(mounts.scratchFsType === 'xfs' || mounts.scratchFsType === 'btrfs' ? 'reflink' : 'copy')
    expect(m.closed).toBe(true)
  })

  test('strict options: an unknown key is ERR_INVALID_ARG_VALUE naming it; nothing is subscribed', () => {
    expect(() => startMetrics({ onOperaton: () => {} } as never)).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARG_VALUE', message: expect.stringContaining('options.onOperaton') }))
    expect(() => startMetrics({ onOperation: 1 } as never)).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARG_TYPE' }))
    expect(channelsListened()).toBe(false)
  })
})

describe('poolGauges and metricsText', () => {
  test('workspaces by state equal what is held and released; the text passes promtool check metrics', async () => {
    const p = await pool()
    const held = [await p.allocate(), await p.allocate(), await p.allocate()]
    await (await p.allocate()).release({ force: true })
    const g = await poolGauges(p)
    expect(g.workspaces).toEqual({ live: 3, free: 1, staging: 0, trash: 0 })
    expect(g).toMatchObject({ root: p.root, unreadable: 0, quota: 0 })
    const sfs = fs.statfsSync(p.root)
    expect(g.fs.sizeBytes).toBe(sfs.blocks * sfs.bsize)
    const m = startMetrics()
    onTestFinished(() => m.close())
    await held.pop()!.dispose()
    const text = await metricsText({ metrics: m, pools: [p] })
    checkMetrics(text)
    const root = JSON.stringify(p.root)
    expect(sample(text, `vmspace_pool_workspaces{root=${root},state="live"}`)).toBe(2)
    expect(sample(text, `vmspace_pool_workspaces{root=${root},state="free"}`)).toBe(1)
    expect(sample(text, `vmspace_pool_up{root=${root}}`)).toBe(1)
    expect(sample(text, 'vmspace_operations_total{operation="dispose"}')).toBe(1)
    await p.close()
    const closed = await metricsText({ pools: [p] })
    checkMetrics(closed)
    expect(sample(closed, `vmspace_pool_up{root=${root}}`)).toBe(0)
  })
})

describe('registerPrometheus in a sidecar-shaped process', () => {
  test("registers into the caller's registry, counts the sidecar's calls, reads gauges per scrape; close() unregisters", async () => {
    const dir = freshDir()
    const p = await pool(dir)
    const registry = new Registry()
    const reg = registerPrometheus(registry, { pools: [p] })
    onTestFinished(() => reg.close())
    const src = path.join(dir, 'src.bin')
    writeRandomFile(src, 4096)
    const ws = await p.allocate()
    const r = await ws.clone(src)
    let text = await registry.metrics()
    checkMetrics(text)
    const root = JSON.stringify(p.root)
    expect(sample(text, 'vmspace_operations_total{operation="allocate"}')).toBe(1)
    expect(sample(text, `vmspace_cloned_files_total{operation="clone",method="${r.method}"}`)).toBe(1)
    expect(sample(text, `vmspace_cloned_bytes_total{operation="clone",method="${r.method}"}`)).toBe(4096)
    expect(sample(text, `vmspace_pool_workspaces{root=${root},state="live"}`)).toBe(1)
    await ws.dispose()
    text = await registry.metrics()
    expect(sample(text, `vmspace_pool_workspaces{root=${root},state="live"}`)).toBe(0)
    expect(sample(text, 'vmspace_operation_duration_seconds_count{operation="dispose"}')).toBe(1)
    // A second registration of the same names fails and leaves the first as it was.
    expect(() => registerPrometheus(registry)).toThrow(/already been registered/)
    reg.close()
    expect(registry.getMetricsAsArray()).toEqual([])
    expect(channelsListened()).toBe(false)
  })

  test('bad arguments: ERR_INVALID_ARG_TYPE / ERR_INVALID_ARG_VALUE, nothing registered', () => {
    const registry = new Registry()
    expect(() => registerPrometheus({} as never)).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARG_TYPE' }))
    expect(() => registerPrometheus(registry, { pool: [] } as never)).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARG_VALUE' }))
    expect(() => registerPrometheus(registry, { pools: 1 } as never)).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARG_TYPE' }))
    expect(registry.getMetricsAsArray()).toEqual([])
  })
})

describe('vmspace metrics', () => {
  test('prints the gauges (promtool-clean); --output writes the same text atomically, no temp file left', async () => {
    const dir = freshDir()
    const p = await pool(dir)
    const held = [await p.allocate(), await p.allocate()]
    const r = vmspace(['metrics', p.root])
    expect(r.status, r.stderr).toBe(0)
    checkMetrics(r.stdout)
    expect(sample(r.stdout, `vmspace_pool_workspaces{root=${JSON.stringify(p.root)},state="live"}`)).toBe(held.length)
    const out = path.join(dir, 'out')
    fs.mkdirSync(out)
    fs.writeFileSync(path.join(out, 'vmspace.prom'), 'old\n')
    expect(vmspace(['metrics', p.root, '--output', path.join(out, 'vmspace.prom')])).toMatchObject({ status: 0, stdout: '', stderr: '' })
    expect(fs.readdirSync(out)).toEqual(['vmspace.prom'])
    // The same text but for the free space, which other tests on the file system change meanwhile.
    const written = fs.readFileSync(path.join(out, 'vmspace.prom'), 'utf8')
    checkMetrics(written)
    const steady = (text: string) => text.split('\n').filter((l) => !/^vmspace_pool_fs_(free|avail)_bytes/.test(l))
    expect(steady(written)).toEqual(steady(r.stdout))
  })

  test('bad input: not a pool, an unwritable --output, a port in use, a bad --listen: one line, exit 2, nothing written', async () => {
    const dir = freshDir()
    const p = await pool(dir)
    expect(usage(['metrics', dir])).toMatch(/is not a vmspace pool/)
    fs.writeFileSync(path.join(dir, 'file'), '')
    expect(usage(['metrics', p.root, '--output', path.join(dir, 'file', 'x.prom')])).toMatch(/not a directory/)
    expect(usage(['metrics', p.root, '--output', dir])).toMatch(/is a directory/)
    // /proc takes no new file, even from root.
    expect(usage(['metrics', p.root, '--output', '/proc/vmspace-metrics.prom'])).toMatch(/ENOENT|EACCES/)
    expect(fs.existsSync('/proc/vmspace-metrics.prom')).toBe(false)
    const busy = net.createServer()
    await new Promise<void>((resolve) => busy.listen(0, '127.0.0.1', resolve))
    onTestFinished(() => new Promise<void>((resolve) => busy.close(() => resolve())))
    const port = (busy.address() as net.AddressInfo).port
    expect(usage(['metrics', p.root, '--listen', `127.0.0.1:${port}`])).toMatch(/EADDRINUSE/)
    expect(usage(['metrics', p.root, '--listen', 'nohost:99999'])).toMatch(/--listen must be/)
    expect(usage(['metrics', p.root, '--listen', '0', '--output', path.join(dir, 'x')])).toMatch(/exclude each other/)
    expect(fs.readdirSync(dir).sort()).toEqual(['file', 'pool'])
  })
})

// ---- A real Prometheus ----

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = net.createServer()
    s.once('error', reject)
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address() as net.AddressInfo
      s.close(() => resolve(port))
    })
  })
}

/** A child killed (SIGKILL) when the test ends, and waited for. */
function child(cmd: string, args: string[]): ChildProcess {
  const c = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'] })
  killOnFinish(c.pid!)
  const exited = new Promise<void>((resolve) => c.once('exit', () => resolve()))
  onTestFinished(async () => {
    c.kill('SIGKILL')
    await exited
  })
  return c
}

/** `vmspace metrics ROOT --listen 127.0.0.1:0` and the port it printed. */
async function listenCli(root: string): Promise<number> {
  const c = child(process.execPath, [bin, 'metrics', root, '--listen', '127.0.0.1:0'])
  const lines = readline.createInterface({ input: c.stdout! })
  for await (const line of lines) {
    const m = /^vmspace metrics: serving http:\/\/127\.0\.0\.1:(\d+)\/metrics/.exec(line)
    if (m) return Number(m[1])
  }
  throw new Error('vmspace metrics --listen printed no address')
}

/** The test process's own /metrics, served from its prom-client registry, as a sidecar serves it. */
async function serveRegistry(registry: Registry): Promise<number> {
  const server = http.createServer((_req, res) => {
    registry.metrics().then(
      (text) => res.writeHead(200, { 'content-type': registry.contentType }).end(text),
      (e: Error) => res.writeHead(500).end(e.message),
    )
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  onTestFinished(() => new Promise<void>((resolve) => (server.closeAllConnections(), server.close(() => resolve()))))
  return (server.address() as net.AddressInfo).port
}

async function startPrometheus(targets: { job: string; port: number }[]): Promise<number> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-prometheus-'))
  onTestFinished(() => fs.rmSync(dir, { recursive: true, force: true }))
  const jobs = targets.map((t) => `  - job_name: ${t.job}\n    static_configs:\n      - targets: ['127.0.0.1:${t.port}']`).join('\n')
  fs.writeFileSync(path.join(dir, 'prometheus.yml'), `global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n${jobs}\n`)
  const r = spawnSync(promtool!, ['check', 'config', path.join(dir, 'prometheus.yml')], { encoding: 'utf8' })
  expect(r.status, r.stdout + r.stderr).toBe(0)
  const port = await freePort()
  const c = child(prometheus!, [
    `--config.file=${path.join(dir, 'prometheus.yml')}`,
    `--storage.tsdb.path=${path.join(dir, 'data')}`,
    `--web.listen-address=127.0.0.1:${port}`,
  ])
  c.stderr!.resume()
  c.stdout!.resume()
  return port
}

/** The value of the one series `query` selects, once Prometheus has it and `ok(value)` holds; waits up to 120 s. */
async function promValue(port: number, query: string, ok: (v: number) => boolean): Promise<number> {
  let last: unknown
  for (let i = 0; i < 480; i++) {
    try {
      const res = await fetch(`http://127.0.0.1:${port}/api/v1/query?query=${encodeURIComponent(query)}`)
      last = await res.json()
      const result = (last as { data?: { result?: { value: [number, string] }[] } }).data?.result ?? []
      if (result.length === 1 && ok(Number(result[0].value[1]))) return Number(result[0].value[1])
    } catch (e) {
      last = e // not listening yet
    }
    await new Promise((resolve) => setTimeout(resolve, 250))
  }
  throw new Error(`${query}: no series satisfying the check; last answer ${JSON.stringify(last)}`)
}

test('vmspace metrics --listen: GET and HEAD /metrics are 200, another method 405 with Allow, another path 404', async () => {
  const p = await pool(freshDir())
  const port = await listenCli(p.root)
  const url = `http://127.0.0.1:${port}`
  const get = await fetch(`${url}/metrics`)
  expect(get.status).toBe(200)
  expect(await get.text()).toMatch(/^# HELP vmspace_/m)
  const head = await fetch(`${url}/metrics`, { method: 'HEAD' })
  expect([head.status, await head.text()]).toEqual([200, ''])
  const post = await fetch(`${url}/metrics`, { method: 'POST', body: 'x' })
  expect([post.status, post.headers.get('allow')]).toEqual([405, 'GET, HEAD'])
  await post.text()
  const other = await fetch(`${url}/other`)
  expect(other.status).toBe(404)
  await other.text()
})

const fileSystems = [
  { label: 'ext4', base: mounts.scratchFsType === 'ext4' ? mounts.scratch : null, method: 'copy', why: `scratch is ${mounts.scratchFsType}` },
  { label: 'XFS', base: mounts.xfs, method: 'reflink', why: mounts.missing.xfs },
] as const

describe.skipIf(missing !== undefined && !requirePrometheus)(`a real Prometheus scraping vmspace ${needs('the prometheus package', missing)}`, () => {
  test('prometheus and promtool are installed (required by VMSPACE_REQUIRE_PROMETHEUS=1)', () => {
    expect(missing).toBeUndefined()
  })
  requireMount('XFS', mounts.xfs, mounts.missing.xfs)

  describe.each(fileSystems)('on $label', ({ base, method }) => {
    test.skipIf(base === null || missing !== undefined)(`live workspaces equal what the test holds; the ${method} clone counter rises`, async () => {
      const dir = freshDir(base!)
      const p = await pool(dir)
      const registry = new Registry()
      const reg = registerPrometheus(registry, { pools: [p] })
      onTestFinished(() => reg.close())
      const promPort = await startPrometheus([
        { job: 'cli', port: await listenCli(p.root) },
        { job: 'sidecar', port: await serveRegistry(registry) },
      ])
      const live = `vmspace_pool_workspaces{job="cli",state="live"}`
      const cloned = `vmspace_cloned_files_total{job="sidecar",operation="clone",method="${method}"}`
      expect(await promValue(promPort, live, (v) => v === 0)).toBe(0)
      const before = await promValue(promPort, cloned, () => true)
      const src = path.join(dir, 'image.bin')
      writeRandomFile(src, 1024 * 1024)
      const held: Workspace[] = []
      for (let i = 0; i < 5; i++) {
        const ws = await p.allocate()
        await ws.clone(src)
        held.push(ws)
      }
      expect(await promValue(promPort, live, (v) => v === held.length)).toBe(5)
      expect(await promValue(promPort, cloned, (v) => v >= before + 5)).toBe(before + 5)
      await held.pop()!.dispose()
      await held.pop()!.dispose()
      expect(await promValue(promPort, live, (v) => v === held.length)).toBe(3)
      expect(await promValue(promPort, 'vmspace_operations_total{job="sidecar",operation="dispose"}', (v) => v === 2)).toBe(2)
      expect(await promValue(promPort, 'up{job="cli"}', () => true)).toBe(1)
      for (const ws of held) await ws.dispose()
    })
  })
})

/**
 * Phase 2, run: worker processes (demo/worker.ts, forked) share the pool and together make --vms workspaces;
 * this side counts what they report, kills the --chaos victims, starts their replacements, and stops everything
 * when a worker dies early or nothing is heard for STALL_MS.
 */
import { fork } from 'node:child_process'
import * as path from 'node:path'
import { performance } from 'node:perf_hooks'
import { setTimeout as sleep } from 'node:timers/promises'
import type { Demo, Made, WorkerState } from './context.js'
import { Progress } from './progress.js'
import { CRASH_ENV, describe, ROLE_ENV, STALL_MS, type FromWorker, type ToWorker } from './protocol.js'
import type { Setup } from './setup.js'
import { percentile, status } from './util.js'

export interface RunResult {
  /** Every allocation a worker reported, in the order reported. */
  records: Made[]
  /** allocate latencies (ms), sorted. */
  latencies: number[]
  /** allocate calls that failed. */
  failed: { worker: number; stage: string; error: string }[]
  /** Workspaces by the method of their (first) template clone. */
  methodCount: Record<string, number>
  /** Logical bytes cloned. */
  bytes: number
  /** Seconds from the common start until every worker exited. */
  wall: number
  /** The workers were stopped early (one died, or nothing was heard for STALL_MS). */
  crashSeen: boolean
  /** --quota: what the runaway writer met (the errno name, null when it was never refused) and wrote. */
  runaway?: { id: string; code: string | null; bytes: number }
}

/** "reflink 12 / copy 0". */
export function methodsText(methodCount: Record<string, number>): string {
  return Object.entries(methodCount)
    .map(([k, v]) => `${k} ${v}`)
    .join(' / ')
}

export async function runWorkers(demo: Demo, s: Setup): Promise<RunResult> {
  return new WorkerRun(demo, s).run()
}

class WorkerRun {
  readonly #byKey = new Map<string, Made>() // worker:id -> its record
  readonly #victims = new Set<number>()
  readonly #crashAfter = Number(process.env[CRASH_ENV] ?? 0) || 0
  readonly result: RunResult = { records: [], latencies: [], failed: [], methodCount: { reflink: 0, copy: 0 }, bytes: 0, wall: 0, crashSeen: false }
  #done = 0
  #lastHeard = performance.now()
  #wakeUp: () => void = () => {}
  #started = false
  #stopping = false

  constructor(
    readonly demo: Demo,
    readonly s: Setup,
  ) {
    // --chaos: the victims among the first workers, each killed once it has reported between a quarter and a half
    // of its share of allocations (at least one), with the rest of its workspaces in whatever state they are.
    const { chaos, workers: nWorkers } = demo.opts
    if (chaos) {
      const n = 'count' in chaos ? Math.min(chaos.count, nWorkers) : Math.max(1, Math.round((nWorkers * chaos.percent) / 100))
      const order = Array.from({ length: nWorkers }, (_, i) => i).sort(() => Math.random() - 0.5)
      for (const i of order.slice(0, Math.min(n, nWorkers))) this.#victims.add(i)
    }
  }

  async run(): Promise<RunResult> {
    const { demo, s } = this
    const { vms: total, workers: nWorkers, live } = demo.opts
    const chaosText = this.#victims.size ? `, SIGKILL for ${this.#victims.size} of them mid-run` : ''
    status(`starting ${nWorkers} workers for ${total} workspaces (at most ${live} live per worker${chaosText}) in ${s.root} (${s.rootFs})`)
    for (let i = 0; i < nWorkers; i++) this.#startWorker(Math.floor(total / nWorkers) + (i < total % nWorkers ? 1 : 0))
    demo.phase = 'run'

    await this.#waitFor(() => demo.workers.every((w) => w.ready || w.exited))
    if (demo.interrupted) this.#stopAll()
    const progress = new Progress(total, () => ({
      p50: percentile([...this.result.latencies].sort((a, b) => a - b), 50),
      methods: methodsText(this.result.methodCount),
    }))
    demo.progress = progress
    const t0 = performance.now()
    this.#lastHeard = t0
    this.#started = true
    demo.sendAll({ t: 'go' })
    await this.#waitFor(() => demo.workers.every((w) => w.exited))
    this.result.wall = (performance.now() - t0) / 1000
    progress.update(this.#done)
    progress.stop()
    this.result.latencies.sort((a, b) => a - b)
    return this.result
  }

  #startWorker(count: number, replaces?: number): WorkerState {
    const { demo, s } = this
    const index = demo.workers.length
    const child = fork(path.join(__dirname, 'worker.js'), [], {
      env: { ...process.env, [ROLE_ENV]: 'worker' },
      stdio: ['ignore', 'pipe', 'pipe', 'ipc'],
      serialization: 'json',
    })
    const w: WorkerState = {
      index,
      child,
      count,
      ready: false,
      finished: false,
      exited: false,
      stderr: '',
      live: new Set(),
      allocated: 0,
      completed: 0,
      replaces,
    }
    if (replaces === undefined && this.#victims.has(index)) {
      const lo = Math.max(1, Math.ceil(count / 4))
      const hi = Math.max(lo, Math.ceil(count / 2))
      w.killAt = lo + Math.floor(Math.random() * (hi - lo + 1))
    }
    demo.workers.push(w)
    const keepTail = (chunk: Buffer) => {
      w.stderr = (w.stderr + chunk.toString()).slice(-4000)
    }
    child.stdout!.on('data', keepTail)
    child.stderr!.on('data', keepTail)
    child.on('error', (e) => {
      w.fatal ??= `could not run: ${describe(e)}`
    })
    child.on('message', (m: FromWorker) => {
      this.#lastHeard = performance.now()
      this.#onMessage(w, m)
      this.#wakeUp()
    })
    // 'close', not 'exit': it comes after the IPC channel has delivered everything the worker sent.
    child.on('close', (code, signal) => {
      w.exited = true
      if (signal) w.exitText = `killed by ${signal}`
      else if (code !== 0) w.exitText = `exited with code ${code}`
      // A worker killed by --chaos: a fresh one makes the rest of its share (the workspaces it did not finish).
      if (w.chaosKilled && signal === 'SIGKILL' && !this.#stopping && !demo.interrupted && w.count - w.completed > 0)
        this.#startWorker(w.count - w.completed, w.index)
      this.#wakeUp()
    })
    child.send(
      {
        t: 'start',
        config: {
          index,
          root: s.root,
          base: s.base?.path ?? '',
          baseSize: s.base?.size ?? 0,
          tree: s.tree?.spec,
          count,
          live: demo.opts.live,
          crashAfter: index === 0 ? this.#crashAfter : 0,
          quota: demo.opts.quota ?? 0,
          runaway: index === 0 && demo.opts.quota !== undefined,
        },
      } satisfies ToWorker,
      () => {},
    )
    return w
  }

  #onMessage(w: WorkerState, m: FromWorker): void {
    const r = this.result
    const interrupted = this.demo.interrupted
    switch (m.t) {
      case 'ready':
        w.ready = true
        // A replacement starts as soon as it is ready; the first workers wait for the common start.
        if (this.#started && w.child.connected) w.child.send({ t: this.#stopping || interrupted ? 'stop' : 'go' } satisfies ToWorker, () => {})
        break
      case 'allocated': {
        const made: Made = { id: m.id, name: m.name, path: m.path, ms: m.ms, method: m.method, bytes: m.bytes, files: m.files, worker: w.index }
        r.records.push(made)
        this.#byKey.set(`${w.index}:${m.id}`, made)
        w.live.add(m.id)
        w.allocated++
        r.latencies.push(m.ms)
        r.methodCount[m.method] = (r.methodCount[m.method] ?? 0) + 1
        r.bytes += m.bytes
        if (w.killAt !== undefined && w.allocated === w.killAt && !w.exited && !w.finished && !this.#stopping && !interrupted) {
          w.chaosKilled = true
          w.child.kill('SIGKILL')
        }
        break
      }
      case 'runaway':
        r.runaway = { id: m.id, code: m.code, bytes: m.bytes }
        break
      case 'disposing': {
        const made = this.#byKey.get(`${w.index}:${m.id}`)
        if (made) made.disposing = true
        break
      }
      case 'checked': {
        w.live.delete(m.id)
        w.completed++
        const made = this.#byKey.get(`${w.index}:${m.id}`)
        if (made) made.checked = m
        this.demo.progress?.update(++this.#done)
        break
      }
      case 'failed':
        r.failed.push({ worker: w.index, stage: m.stage, error: m.error })
        w.completed++
        this.demo.progress?.update(++this.#done)
        break
      case 'finished':
        w.finished = true
        w.stats = m.stats
        break
      case 'fatal':
        w.fatal = m.error
        break
    }
  }

  /** A worker that died early (not by --chaos) or reported a fatal error. */
  #broken(): WorkerState | undefined {
    return this.demo.workers.find((w) => (!w.chaosKilled && w.exited && (!w.finished || w.exitText)) || w.fatal)
  }

  #stopAll(): void {
    this.#stopping = true
    this.demo.sendAll({ t: 'stop' })
  }

  /** Waits until `cond` holds; fails the run when a worker dies early or nothing is heard for STALL_MS. */
  async #waitFor(cond: () => boolean): Promise<void> {
    for (;;) {
      if (!this.result.crashSeen && this.#broken()) {
        this.result.crashSeen = true
        this.#stopAll() // the others dispose what they hold and stop
      }
      if (cond()) return
      if (performance.now() - this.#lastHeard > STALL_MS) {
        this.demo.failures.push(`no worker reported anything for ${STALL_MS / 1000} s: killed them`)
        this.result.crashSeen = true
        this.#stopping = true
        this.demo.killAll()
        await this.#waitForExit()
        return
      }
      await new Promise<void>((r) => {
        this.#wakeUp = r
        setTimeout(r, 1000).unref()
      })
    }
  }

  async #waitForExit(): Promise<void> {
    const workers = this.demo.workers
    const deadline = Date.now() + 10_000
    while (workers.some((w) => !w.exited) && Date.now() < deadline) await sleep(50)
    this.demo.killAll()
    while (workers.some((w) => !w.exited)) await sleep(50)
  }
}

/**
 * The state the demo's phases share (setup, run, checks, chaos, report; see main.ts): options, clean-up steps,
 * failures and notes for the summary, the workers, and how an interrupt is handled in each phase.
 */
import type { ChildProcess } from 'node:child_process'
import * as os from 'node:os'
import type { PoolStats } from 'vmspace'
import type { Options } from './options.js'
import type { Progress } from './progress.js'
import type { FromWorker, ToWorker } from './protocol.js'
import { Cleanup, status } from './util.js'

export interface WorkerState {
  index: number
  child: ChildProcess
  count: number
  ready: boolean
  finished: boolean
  exited: boolean
  exitText?: string
  stats?: PoolStats
  fatal?: string
  stderr: string
  live: Set<string>
  /** Allocations it reported. */
  allocated: number
  /** Workspaces it finished: checked (disposed) or failed to allocate. */
  completed: number
  /** --chaos: SIGKILL it when it reports this many allocations. */
  killAt?: number
  /** --chaos: killed on purpose (its exit is no failure; a replacement makes the rest of its share). */
  chaosKilled?: boolean
  /** The worker this one replaces (--chaos). */
  replaces?: number
}

export interface Made {
  id: string
  name: string
  path: string
  ms: number
  method: string
  bytes: number
  files: number
  worker: number
  /** It reported that it started to dispose this one. */
  disposing?: boolean
  checked?: Extract<FromWorker, { t: 'checked' }>
}


export class Demo {
  readonly cleanup = new Cleanup()
  /** Problems found; any makes the run fail (exit 1). */
  readonly failures: string[] = []
  readonly notes: string[] = []
  phase: 'setup' | 'run' | 'report' = 'setup'
  interrupted = false
  interruptCode = 130
  workers: WorkerState[] = []
  progress: Progress | undefined

  constructor(readonly opts: Options) {}

  sendAll(m: ToWorker): void {
    for (const w of this.workers) if (!w.exited && w.child.connected) w.child.send(m, () => {})
  }

  killAll(): void {
    for (const w of this.workers) if (!w.exited) w.child.kill('SIGKILL')
  }

  /**
   * Interrupts: before the workers run, clean up and leave; while they run, stop them gracefully (they dispose
   * what they hold) and report; a second interrupt kills them.
   */
  onSignal(sig: NodeJS.Signals): void {
    const code = 128 + (os.constants.signals[sig] ?? 2)
    if (this.phase === 'run' && !this.interrupted) {
      this.interrupted = true
      this.interruptCode = code
      this.progress?.stop()
      status(`${sig}: stopping the workers (they dispose what they hold); again to kill them`)
      this.sendAll({ t: 'stop' })
      return
    }
    if (this.phase === 'report' && !this.interrupted) {
      this.interrupted = true
      this.interruptCode = code
      return
    }
    this.progress?.stop()
    this.killAll()
    status(`${sig}: cleaning up`)
    void this.cleanup.run().finally(() => process.exit(code))
  }
}

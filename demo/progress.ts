/** The run's progress: a bar on a terminal (cli-progress), one plain line per tenth otherwise. */
import { performance } from 'node:perf_hooks'
import { Presets, SingleBar } from 'cli-progress'
import { ms, status } from './util.js'

export class Progress {
  #bar: SingleBar | undefined
  #total: number
  #lastPlain = -1
  #lastDraw = 0
  #start = performance.now()
  /** `details` is called only when a line is drawn: at most 10 times a second, or once a tenth without a TTY. */
  constructor(
    total: number,
    readonly details: () => { p50: number; methods: string },
  ) {
    this.#total = total
    if (process.stderr.isTTY) {
      this.#bar = new SingleBar(
        {
          format: 'demo {bar} {value}/{total} | {rate}/s | allocate p50 {p50} ms | {methods} | {duration_formatted}',
          barsize: 24,
          hideCursor: true,
          stream: process.stderr,
          fps: 10,
        },
        Presets.shades_classic,
      )
      this.#bar.start(total, 0, { rate: '0.0', p50: '-', methods: '' })
    }
  }
  update(done: number) {
    const now = performance.now()
    const rate = () => (now > this.#start ? ((done * 1000) / (now - this.#start)).toFixed(1) : '0.0')
    if (this.#bar) {
      if (now - this.#lastDraw < 100 && done < this.#total) {
        this.#bar.update(done)
        return
      }
      this.#lastDraw = now
      const d = this.details()
      this.#bar.update(done, { rate: rate(), p50: ms(d.p50), methods: d.methods })
      return
    }
    // Plain lines when stderr is not a terminal: one per tenth, and the last.
    const step = Math.max(1, Math.ceil(this.#total / 10))
    const bucket = done >= this.#total ? Infinity : Math.floor(done / step)
    if (bucket > this.#lastPlain && (done > 0 || this.#total === 0)) {
      this.#lastPlain = bucket
      const d = this.details()
      status(`${done}/${this.#total} workspaces, ${rate()}/s, allocate p50 ${ms(d.p50)} ms, ${d.methods}`)
    }
  }
  stop() {
    this.#bar?.stop()
    this.#bar = undefined
  }
}

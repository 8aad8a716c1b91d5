/** Progress towards a total of bytes on stderr, for the long-running commands (clone, image import). */
import { Presets, SingleBar } from 'cli-progress'
import { humanBytes } from './common.js'

/**
 * Progress towards a total of bytes on stderr: a bar (cli-progress) when stderr is a terminal, else one plain line
 * per tenth of the total (`vmspace <label>: 40% 1.5 MiB of 3.75 MiB, <detail>`), so that a log gets ten lines at
 * most. The total may arrive with the first update (an image's is known once its manifest is read).
 */
export class ByteProgress {
  #bar: SingleBar | undefined
  #lastTenth = 0
  #stopped = false
  constructor(readonly label: string) {}

  update(bytes: number, total: number, detail = ''): void {
    if (this.#stopped || total <= 0) return
    const values = { done: humanBytes(bytes), all: humanBytes(total), detail: detail ? ` | ${detail}` : '' }
    if (process.stderr.isTTY) {
      if (!this.#bar) {
        this.#bar = new SingleBar(
          { format: `${this.label} {bar} {percentage}% | {done} of {all}{detail} | {duration_formatted}`, barsize: 30, hideCursor: true, stream: process.stderr, fps: 10 },
          Presets.shades_classic,
        )
        this.#bar.start(total, 0, values)
      }
      this.#bar.setTotal(total)
      this.#bar.update(Math.min(bytes, total), values)
      return
    }
    const tenth = Math.min(10, Math.floor((bytes * 10) / total))
    if (tenth > this.#lastTenth) {
      this.#lastTenth = tenth
      process.stderr.write(`vmspace ${this.label}: ${tenth * 10}% ${values.done} of ${values.all}${detail ? `, ${detail}` : ''}\n`)
    }
  }

  stop(): void {
    this.#stopped = true
    this.#bar?.stop()
    this.#bar = undefined
  }
}

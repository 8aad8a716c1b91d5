/**
 * One guest under QEMU: started with its workspace's lease fd inherited (so the workspace lives exactly as long as
 * the QEMU process), watched over QMP on stdio, and stopped. QEMU runs with `-no-shutdown`: when the guest powers
 * off, QEMU reports SHUTDOWN and stays alive (paused), so the host checks the clone while the lease still holds it,
 * and only then quits QEMU, which drops the lease. A sweep therefore never races the checks.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as fsp from 'node:fs/promises'
import * as os from 'node:os'
import * as path from 'node:path'
import * as readline from 'node:readline'
import { clone } from 'vmspace'
import { readGuestRecord } from './checks.js'
import type { GuestImages } from './image.js'
import type { BootTools } from './tools.js'

export type Accel = 'kvm' | 'tcg'

export interface VmOptions {
  tools: BootTools
  images: GuestImages
  /** The VM's raw ext4 disk (its workspace's clone of the base). */
  disk: string
  /** Words appended to the kernel command line, e.g. `vmspace.id=… vmspace.token=…`. */
  cmdline: string
  accel: Accel
  /** The serial console is written here. */
  consoleLog: string
  /** Inherited by QEMU as its fd 3 (spawn's stdio), e.g. a workspace's leaseFd. */
  leaseFd?: number
  /** Guest memory in MiB. Default 256. */
  memoryMiB?: number
  /** Scheduling priority (nice, 0..19) of the QEMU process. Default 0. */
  nice?: number
}

/** How a wait for the guest ended. */
export type PowerOff =
  | { kind: 'poweroff' }
  /** SHUTDOWN for another reason than the guest's power-off (a reset after a panic, with -no-reboot). */
  | { kind: 'shutdown'; reason: string }
  | { kind: 'exit'; code: number | null; signal: NodeJS.Signals | null }
  | { kind: 'timeout' }

export class GuestVm {
  readonly process: ChildProcess
  /** Settles when the QEMU process has exited (never rejects). */
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>
  #shutdown: Promise<PowerOff>
  #stderr = ''

  constructor(opts: VmOptions) {
    for (const p of [opts.disk, opts.consoleLog, opts.images.kernel, opts.images.initramfs])
      if (p.includes(',')) throw new Error(`QEMU option values cannot hold a comma: ${p}`)
    const args = [
      '-nodefaults', '-no-user-config', '-display', 'none',
      '-accel', opts.accel,
      '-m', String(opts.memoryMiB ?? 256), '-smp', '1',
      '-kernel', opts.images.kernel,
      '-initrd', opts.images.initramfs,
      // no_timer_check: on a loaded host, TCG runs the guest so slowly that the kernel's IO-APIC timer check
      // fails and it panics ("IO-APIC + timer doesn't work!"); the check proves nothing about an emulated timer.
      '-append', `console=ttyS0 panic=-1 quiet no_timer_check ${opts.cmdline}`,
      '-drive', `file=${opts.disk},if=virtio,format=raw`,
      '-serial', `file:${opts.consoleLog}`,
      '-qmp', 'stdio',
      '-no-reboot', '-no-shutdown',
    ]
    const stdio: ('pipe' | number)[] = ['pipe', 'pipe', 'pipe']
    if (opts.leaseFd !== undefined) stdio.push(opts.leaseFd)
    // Not detached: if the demo dies, QEMU stays in its process group and gets the terminal's signals with it.
    // A lower priority lets a test suite's other processes run beside TCG guests that would take every core.
    // nice(1) execs QEMU in the same process, before QEMU starts any thread, so every thread inherits it.
    this.process = opts.nice
      ? spawn('nice', ['-n', String(opts.nice), opts.tools.qemu, ...args], { stdio })
      : spawn(opts.tools.qemu, args, { stdio })
    const child = this.process
    child.stderr!.on('data', (b: Buffer) => {
      if (this.#stderr.length < 16384) this.#stderr += b.toString()
    })
    this.exited = new Promise((resolve) => {
      child.on('exit', (code, signal) => resolve({ code, signal }))
      // spawn failing (ENOENT) gives 'error' and no 'exit'.
      child.on('error', (e) => {
        this.#stderr += String(e)
        resolve({ code: null, signal: null })
      })
    })
    child.stdin!.on('error', () => {}) // EPIPE after QEMU exited: the exit is what counts
    this.#shutdown = new Promise((resolve) => {
      const lines = readline.createInterface({ input: child.stdout! })
      lines.on('line', (line) => {
        let msg: { QMP?: unknown; event?: string; data?: { guest?: boolean; reason?: string } }
        try {
          msg = JSON.parse(line)
        } catch {
          return
        }
        if (msg.QMP) child.stdin!.write('{"execute":"qmp_capabilities"}\n')
        else if (msg.event === 'SHUTDOWN') {
          const reason = msg.data?.reason ?? 'unknown'
          resolve(reason === 'guest-shutdown' ? { kind: 'poweroff' } : { kind: 'shutdown', reason })
        }
      })
      void this.exited.then((r) => resolve({ kind: 'exit', ...r }))
    })
  }

  get pid(): number | undefined {
    return this.process.pid
  }

  /** What QEMU printed on stderr (start-up errors), at most 16 KiB. */
  get stderr(): string {
    return this.#stderr
  }

  /** Waits until the guest powers off, QEMU exits, or `timeoutMs` passes. */
  waitPowerOff(timeoutMs: number): Promise<PowerOff> {
    let timer: NodeJS.Timeout | undefined
    const timeout = new Promise<PowerOff>((resolve) => {
      timer = setTimeout(() => resolve({ kind: 'timeout' }), timeoutMs)
    })
    return Promise.race([this.#shutdown, timeout]).finally(() => clearTimeout(timer))
  }

  /** Asks QEMU to quit (QMP), falls back to SIGKILL after `graceMs`; resolves when it has exited. */
  async quit(graceMs = 10_000): Promise<void> {
    this.process.stdin!.write('{"execute":"quit"}\n')
    const timer = setTimeout(() => this.kill(), graceMs)
    await this.exited
    clearTimeout(timer)
  }

  /** SIGKILL (the chaos option; a hung guest). The lease drops when the kernel has torn the process down. */
  kill(): void {
    if (this.process.exitCode === null && this.process.signalCode === null) this.process.kill('SIGKILL')
  }
}

export interface AccelChoice {
  accel: Accel
  /** Why this accelerator: the probe's outcome, or what ruled KVM out. */
  why: string
}

/**
 * 'kvm' when /dev/kvm opens read-write and a probe guest boots under KVM and writes its token within
 * `timeoutMs`; otherwise 'tcg'. Nested KVM may spin in the host kernel and never boot, so the probe is bounded.
 * The outcome is cached per host boot (boot_id), kernel and QEMU binary in the OS temp directory.
 */
export async function chooseAccel(tools: BootTools, images: GuestImages, workDir: string, timeoutMs = 20_000): Promise<AccelChoice> {
  try {
    fs.closeSync(fs.openSync('/dev/kvm', fs.constants.O_RDWR))
  } catch (e) {
    return { accel: 'tcg', why: `TCG: /dev/kvm unusable (${(e as NodeJS.ErrnoException).code})` }
  }
  const bootId = readTrimmed('/proc/sys/kernel/random/boot_id') ?? 'unknown'
  const q = fs.statSync(tools.qemu)
  const cacheFile = path.join(
    os.tmpdir(),
    `vmspace-boot-accel-${bootId}-${tools.kernel.release}-${q.ino}-${Math.trunc(q.mtimeMs)}.json`,
  )
  try {
    const cached = JSON.parse(fs.readFileSync(cacheFile, 'utf8')) as AccelChoice
    if (cached.accel === 'kvm' || cached.accel === 'tcg') return { ...cached, why: `${cached.why} (probed earlier this host boot)` }
  } catch {
    // no probe yet this boot
  }
  const choice = await probeKvm(tools, images, workDir, timeoutMs)
  fs.writeFileSync(cacheFile, JSON.stringify(choice))
  return choice
}

async function probeKvm(tools: BootTools, images: GuestImages, workDir: string, timeoutMs: number): Promise<AccelChoice> {
  const dir = await fsp.mkdtemp(path.join(workDir, 'kvm-probe-'))
  try {
    const disk = path.join(dir, 'rootfs.ext4')
    await clone(images.rootfs, disk)
    const token = randomBytes(16).toString('hex')
    const vm = new GuestVm({
      tools, images, disk, accel: 'kvm', consoleLog: path.join(dir, 'console.log'),
      cmdline: `vmspace.id=kvm-probe vmspace.token=${token}`,
    })
    const t0 = performance.now()
    const r = await vm.waitPowerOff(timeoutMs)
    const ms = performance.now() - t0
    if (r.kind === 'poweroff') await vm.quit()
    else vm.kill()
    await vm.exited
    if (r.kind !== 'poweroff') {
      const what = r.kind === 'timeout' ? `no power-off within ${timeoutMs / 1000} s` : r.kind === 'exit' ? `QEMU exited: ${vm.stderr.trim().split('\n').pop() ?? ''}` : `SHUTDOWN ${r.reason}`
      return { accel: 'tcg', why: `TCG: a KVM probe guest did not boot (${what})` }
    }
    const record = await readGuestRecord(tools, disk)
    if (!record?.includes(token)) return { accel: 'tcg', why: 'TCG: a KVM probe guest powered off without writing its token' }
    return { accel: 'kvm', why: `KVM: a probe guest booted in ${(ms / 1000).toFixed(1)} s` }
  } finally {
    await fsp.rm(dir, { recursive: true, force: true })
  }
}

function readTrimmed(file: string): string | undefined {
  try {
    return fs.readFileSync(file, 'utf8').trim()
  } catch {
    return undefined
  }
}

/**
 * Guests under QEMU for the suites that restore or roll back real VMs (test/restore.test.ts,
 * test/checkpoint-runtime.test.ts): a small ext4 root file system whose /init obeys lines typed on its serial
 * console, and a QEMU process driven over QMP (stdio) with that console on a Unix socket.
 *
 * The guest boots with the boot demo's kernel and initramfs (demo/boot/image.ts), which mount /dev/vda and run its
 * /init. Console commands, one a line: `write TEXT` (TEXT into /data.txt, synced), `read` (prints /data.txt),
 * `ro` (remounts / read-only, so the host reads a clean file system). Each answers one line
 * `vmspace-guest: <command> <result>`.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import * as fsp from 'node:fs/promises'
import * as net from 'node:net'
import * as path from 'node:path'
import * as readline from 'node:readline'
import { guestImages, type GuestImages } from '../demo/boot/image.js'
import { chooseAccel, type Accel } from '../demo/boot/qemu.js'
import { findBootTools, runOk, type BootTools } from '../demo/boot/tools.js'
import type { Pool, Workspace } from '../lib/index.js'

/** The tools booting a guest needs, or why they are missing (findBootTools' message: the packages to install). */
export function bootTools(): { tools?: BootTools; missing?: string } {
  try {
    return { tools: findBootTools() }
  } catch (e) {
    return { missing: (e as Error).message }
  }
}

const GUEST_INIT = `#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -o remount,rw / || echo "vmspace-guest: cannot mount / read-write"
echo "vmspace-guest: ready"
while read -r cmd arg; do
  case "$cmd" in
    write) echo "$arg" > /data.txt && $B sync && echo "vmspace-guest: write $arg" ;;
    read) echo "vmspace-guest: read $($B cat /data.txt 2>&1)" ;;
    ro) $B sync && $B mount -o remount,ro / && echo "vmspace-guest: ro done" ;;
  esac
done
`

/** The guest's root file system size (bytes). */
const DISK_BYTES = 32 * 1024 * 1024

/** Makes `disk`, a raw ext4 image holding busybox and the console-driven /init; `stage` is an empty scratch directory. */
async function makeGuestDisk(tools: BootTools, stage: string, disk: string): Promise<void> {
  for (const d of ['bin', 'proc', 'sys', 'dev', 'tmp']) await fsp.mkdir(path.join(stage, d))
  await fsp.copyFile(tools.busybox, path.join(stage, 'bin', 'busybox'))
  await fsp.chmod(path.join(stage, 'bin', 'busybox'), 0o755)
  await fsp.writeFile(path.join(stage, 'init'), GUEST_INIT, { mode: 0o755 })
  await runOk(tools.mke2fs, ['-q', '-F', '-t', 'ext4', '-d', stage, disk, `${DISK_BYTES / 1024}k`])
}

/**
 * QEMU's arguments for the guest, with relative file names (QEMU resolves them from its working directory, the
 * workspace): the kernel `vmlinuz`, the initramfs `initrd` and the disk `rootfs.ext4`. The same list starts the
 * guest and every restore of it (a migration stream fits only the machine it came from).
 */
export function guestArgs(accel: Accel): string[] {
  return [
    '-nodefaults', '-no-user-config', '-display', 'none', '-accel', accel, '-m', '128', '-smp', '1',
    '-kernel', 'vmlinuz', '-initrd', 'initrd',
    // no_timer_check: under TCG on a loaded host the kernel's IO-APIC timer check fails and it panics.
    '-append', 'console=ttyS0 panic=-1 quiet no_timer_check',
    '-drive', 'file=rootfs.ext4,if=virtio,format=raw',
    '-no-reboot', '-no-shutdown',
  ]
}

/** A test's guests: the cached kernel and initramfs, the accelerator, and a directory for console sockets. */
export class Guests {
  private constructor(
    readonly tools: BootTools,
    readonly images: GuestImages,
    readonly accel: Accel,
    readonly dir: string,
  ) {}

  /** Builds (or finds cached) the guest images and chooses KVM or TCG; `dir` is the test's own scratch directory. */
  static async open(tools: BootTools, dir: string): Promise<Guests> {
    const images = await guestImages(tools)
    return new Guests(tools, images, (await chooseAccel(tools, images, dir)).accel, dir)
  }

  /** A new workspace of `pool` holding the guest: `vmlinuz`, `initrd` and a fresh `rootfs.ext4`. */
  async workspace(pool: Pool): Promise<Workspace> {
    const ws = await pool.allocate()
    await ws.clone(this.images.kernel, 'vmlinuz')
    await ws.clone(this.images.initramfs, 'initrd')
    const stage = await fsp.mkdtemp(path.join(this.dir, 'stage-'))
    await makeGuestDisk(this.tools, stage, path.join(ws.path, 'rootfs.ext4'))
    return ws
  }

  /** Starts QEMU in `ws` (its working directory) with guestArgs and `extra`, handing it `ws.leaseFd`. */
  start(ws: Workspace, extra: string[] = []): Promise<Machine> {
    const socket = path.join(this.dir, `console-${randomBytes(4).toString('hex')}.sock`)
    return Machine.start({ qemu: this.tools.qemu, args: [...guestArgs(this.accel), ...extra], cwd: ws.path, socket, leaseFd: ws.leaseFd, nice: 10 })
  }
}

export interface MachineOptions {
  qemu: string
  /** The machine (guestArgs, perhaps with `-incoming`); the console and QMP are added here. */
  args: string[]
  /** QEMU's working directory: the workspace its relative file names resolve in. */
  cwd: string
  /** The console's Unix socket (at most 107 bytes): outside the workspace, which holds only the guest's files. */
  socket: string
  /** Inherited as QEMU's fd 3 (a workspace's leaseFd). */
  leaseFd?: number
  /** Nice value of the QEMU process (0..19). */
  nice?: number
}

interface QmpReply {
  return?: unknown
  error?: { class: string; desc: string }
  id?: number
}

/** One QEMU process: QMP commands, the console's lines, quit. */
export class Machine {
  readonly process: ChildProcess
  /** Settles when QEMU has exited (never rejects). */
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>
  #console = ''
  #consoleWaiters: (() => void)[] = []
  #replies = new Map<number, (r: QmpReply) => void>()
  #nextId = 1
  #stderr = ''
  #socket: net.Socket | undefined
  #greeted: Promise<void>
  #greet: () => void = () => {}

  private constructor(opts: MachineOptions) {
    // wait=on: QEMU starts the guest only once the host is connected, so no console line is lost.
    const args = [...opts.args, '-chardev', `socket,id=con,path=${opts.socket},server=on,wait=on`, '-serial', 'chardev:con', '-qmp', 'stdio']
    const stdio: ('pipe' | number)[] = ['pipe', 'pipe', 'pipe']
    if (opts.leaseFd !== undefined) stdio.push(opts.leaseFd)
    this.process = opts.nice
      ? spawn('nice', ['-n', String(opts.nice), opts.qemu, ...args], { cwd: opts.cwd, stdio })
      : spawn(opts.qemu, args, { cwd: opts.cwd, stdio })
    const child = this.process
    this.#greeted = new Promise((resolve) => (this.#greet = resolve))
    child.stderr!.on('data', (b: Buffer) => (this.#stderr += b.toString()))
    child.stdin!.on('error', () => {}) // EPIPE after QEMU exited: the exit is what counts
    this.exited = new Promise((resolve) => {
      child.on('exit', (code, signal) => resolve({ code, signal }))
      child.on('error', (e) => {
        this.#stderr += String(e)
        resolve({ code: null, signal: null })
      })
    })
    readline.createInterface({ input: child.stdout! }).on('line', (line) => {
      let msg: QmpReply & { QMP?: unknown }
      try {
        msg = JSON.parse(line)
      } catch {
        return
      }
      if (msg.QMP) this.#greet()
      else if (msg.id !== undefined) this.#replies.get(msg.id)?.(msg)
    })
    void this.exited.then(() => {
      for (const reply of this.#replies.values()) reply({ error: { class: 'exited', desc: `QEMU exited: ${this.#stderr.trim()}` } })
      this.#greet()
      this.#notifyConsole()
    })
  }

  /** Starts QEMU and connects to its console (QEMU waits for that connection before it runs anything). */
  static async start(opts: MachineOptions): Promise<Machine> {
    const m = new Machine(opts)
    for (let i = 0; ; i++) {
      try {
        m.#socket = await connect(opts.socket)
        break
      } catch (e) {
        if (i >= 600 || m.process.exitCode !== null) {
          m.kill()
          throw new Error(`cannot connect to QEMU's console ${opts.socket}: ${String(e)}; QEMU: ${m.#stderr.trim()}`)
        }
        await new Promise((r) => setTimeout(r, 50))
      }
    }
    m.#socket.on('data', (b: Buffer) => {
      m.#console += b.toString('latin1')
      m.#notifyConsole()
    })
    m.#socket.on('error', () => {})
    await m.#greeted
    await m.qmp('qmp_capabilities')
    return m
  }

  /** Everything the guest printed so far. */
  get console(): string {
    return this.#console
  }

  get stderr(): string {
    return this.#stderr
  }

  /** Runs a QMP command; rejects with QMP's error (or QEMU's exit). */
  qmp(execute: string, args?: object): Promise<unknown> {
    const id = this.#nextId++
    return new Promise((resolve, reject) => {
      this.#replies.set(id, (r) => {
        this.#replies.delete(id)
        if (r.error) reject(new Error(`QMP ${execute}: ${r.error.class}: ${r.error.desc}`))
        else resolve(r.return)
      })
      this.process.stdin!.write(JSON.stringify({ execute, arguments: args, id }) + '\n')
    })
  }

  /** Polls `query`'s `field` until it leaves the values in `passing`; returns the value it reached. */
  async until(query: string, field: string, passing: string[], timeoutMs = 300_000): Promise<string> {
    for (const t0 = Date.now(); ; ) {
      const value = String(((await this.qmp(query)) as Record<string, unknown>)[field])
      if (!passing.includes(value)) return value
      if (Date.now() - t0 > timeoutMs) throw new Error(`${query}: still ${field}=${value} after ${timeoutMs} ms`)
      await new Promise((r) => setTimeout(r, 100))
    }
  }

  /** Waits until the console holds a line `vmspace-guest: <answer>`; throws when QEMU exits first or the time runs out. */
  async answer(answer: string, timeoutMs = 300_000): Promise<void> {
    const line = `vmspace-guest: ${answer}`
    const seen = () => this.#console.split(/\r?\n/).includes(line)
    const deadline = Date.now() + timeoutMs
    while (!seen()) {
      if (this.process.exitCode !== null || this.process.signalCode !== null || Date.now() > deadline)
        throw new Error(`no "${line}" on the console; it holds:\n${this.#console}\nQEMU: ${this.#stderr.trim()}`)
      await new Promise<void>((r) => {
        const timer = setTimeout(r, 1000)
        this.#consoleWaiters.push(() => (clearTimeout(timer), r()))
      })
    }
  }

  /** Types one line on the guest's console. */
  type(line: string): void {
    this.#socket!.write(`${line}\n`)
  }

  /** QMP `quit`, SIGKILL after `graceMs`; resolves when QEMU has exited. */
  async quit(graceMs = 10_000): Promise<void> {
    if (this.process.exitCode !== null || this.process.signalCode !== null) return
    this.process.stdin!.write('{"execute":"quit"}\n')
    const timer = setTimeout(() => this.kill(), graceMs)
    await this.exited
    clearTimeout(timer)
    this.#socket?.destroy()
  }

  kill(): void {
    if (this.process.exitCode === null && this.process.signalCode === null) this.process.kill('SIGKILL')
    this.#socket?.destroy()
  }

  #notifyConsole(): void {
    for (const w of this.#consoleWaiters.splice(0)) w()
  }
}

function connect(socket: string): Promise<net.Socket> {
  return new Promise((resolve, reject) => {
    const s = net.connect(socket)
    s.once('connect', () => resolve(s))
    s.once('error', reject)
  })
}

/**
 * Kernel answers on demand, for the fault suites: test/fixtures/seccomp/inject.c (built here with the system `cc`
 * into a temp dir, once per test file) runs node under a seccomp filter that makes one system call, optionally
 * only for one argument value, answer a chosen errno or 0. The child (fault-child.cjs) runs vmspace steps and
 * reports each outcome; everything else, node itself included, runs unchanged on real file systems.
 */
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { afterAll } from 'vitest'
import { fixtures } from './helpers.js'

/** ioctl_ficlone(2): _IOW(0x94, 9, int). */
export const FICLONE = 0x40049409
/** open(2)'s __O_TMPFILE bit (O_TMPFILE is it | O_DIRECTORY), x86-64 and aarch64. */
export const O_TMPFILE_BIT = 0o20000000
/** renameat2(2) flags. */
export const RENAME_NOREPLACE = 1

let built: string | undefined
let buildError: string | undefined

/** Why inject cannot run here (no `cc`, a compile error), or undefined when it can. */
export function injectMissing(): string | undefined {
  injectBinary()
  return buildError
}

function injectBinary(): string | undefined {
  if (built || buildError) return built
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmspace-inject-'))
  afterAll(() => fs.rmSync(dir, { recursive: true, force: true }))
  const out = path.join(dir, 'inject')
  const r = spawnSync('cc', ['-O2', '-Wall', '-o', out, path.join(fixtures, 'seccomp', 'inject.c')], { encoding: 'utf8' })
  if (r.error || r.status !== 0) buildError = `cc failed: ${r.error?.message ?? r.stderr.trim()}`
  else built = out
  return built
}

export interface Injection {
  syscall: 'copy_file_range' | 'ioctl' | 'renameat2' | 'read' | 'pread64' | 'write' | 'pwrite64' | 'linkat' | 'openat'
  /** An errno name, or '0' for a call that "succeeds" doing nothing. */
  answer: string
  /** Only when (argument `index` & mask) === value (low 32 bits). */
  arg?: { index: number; mask: number; value: number }
}

export type StepOutcome =
  | { ok: true; result: any }
  | { ok: false; code: string; errno?: number; syscall?: string; path?: string; dest?: string; causeCode?: string; message: string }

/** Runs fault-child.cjs with `steps` under `injection`; the outcome of each step. */
export function runInjected(injection: Injection, steps: object[]): StepOutcome[] {
  const bin = injectBinary()
  if (!bin) throw new Error(buildError)
  const match = injection.arg ? [injection.arg.index, injection.arg.mask, injection.arg.value].map(String) : []
  const r = spawnSync(
    bin,
    [injection.syscall, injection.answer, ...match, '--', process.execPath, path.join(fixtures, 'seccomp', 'fault-child.cjs'), JSON.stringify(steps)],
    { encoding: 'utf8', timeout: 50_000 },
  )
  if (r.error) throw r.error
  const line = r.stdout.trim().split('\n').pop() ?? ''
  if (r.status !== 0 || !line.startsWith('['))
    throw new Error(`fault child exited ${r.status} (${r.signal ?? ''}): ${r.stderr.trim() || r.stdout.trim()}`)
  return JSON.parse(line) as StepOutcome[]
}

/**
 * The README's "Use" example, run as written (its first ```ts block): the lifecycle it teaches must be one that
 * keeps a sandbox's files while the sandbox runs. Allocate, hand the lease to the VM process, let go of the owner's
 * handle; the VM process still has its files after the owner's last call, and once it exits a sweep leaves nothing.
 *
 * What the example names is given to it here: every absolute path in a string literal is moved under a fresh
 * directory (the `openPool` root is left to the example to make; every other path is a file of random bytes, a
 * template source), and the command it spawns is test/fixtures/readme-vm.cjs, which checks the workspace once the
 * example has let go of the lease. The example is transpiled (TypeScript's transpileModule) and run by node as an
 * ES module from the repository, where `'vmspace'` resolves to this package (dist/, `npm run build:ts`).
 */
import { spawn } from 'node:child_process'
import { createHash, randomBytes } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import * as ts from 'typescript'
import { describe, expect, test } from 'vitest'
import { openPool } from '../lib/index.js'
import { emptyPoolState, eventually, fixtures, freshDir, killOnFinish, poolState, repoRoot } from './helpers.js'

/** The first ```ts block under the README's "## Use" heading (before the next "## " heading). */
function useExample(): string {
  const readme = fs.readFileSync(path.join(repoRoot, 'README.md'), 'utf8')
  const section = readme.split(/^## /m).find((s) => s.startsWith('Use\n'))
  if (section === undefined) throw new Error('README.md has no "## Use" section')
  const block = /^```ts\n([\s\S]*?)^```/m.exec(section)
  if (block === null) throw new Error('the "## Use" section of README.md has no ```ts block')
  return block[1]
}

interface Prepared {
  /** The example with its paths moved under `host`. */
  code: string
  /** The pool root it opens. */
  root: string
  /** Template sources made for it: path as the README names it -> sha256 of the bytes written. */
  sources: Record<string, string>
  /** The command it spawns, as the README names it. */
  command: string
}

function prepare(code: string, host: string): Prepared {
  const pool = /openPool\(\s*(['"])(\/[^'"]*)\1/.exec(code)
  if (pool === null) throw new Error(`the example opens no pool by an absolute path:\n${code}`)
  const spawned = /spawn\(\s*(['"])([^'"/]+)\1/.exec(code)
  if (spawned === null) throw new Error(`the example spawns no command by name (the VM process the lease is handed to):\n${code}`)
  const sources: Record<string, string> = {}
  const moved = code.replace(/(['"])(\/[^'"\s]*)\1/g, (_, quote: string, p: string) => {
    const there = path.join(host, p)
    if (p !== pool[2] && !(p in sources)) {
      fs.mkdirSync(path.dirname(there), { recursive: true })
      const bytes = randomBytes(64 * 1024)
      fs.writeFileSync(there, bytes)
      sources[p] = createHash('sha256').update(bytes).digest('hex')
    }
    return quote + there + quote
  })
  return { code: moved, root: path.join(host, pool[2]), sources, command: spawned[2] }
}

type Report = { event: 'started'; pid: number; lease: string | null } | { event: 'checked'; ownerLetGo: boolean; files: Record<string, string> | null; error: string | null }

function readReport(file: string): Report[] {
  if (!fs.existsSync(file)) return []
  return fs
    .readFileSync(file, 'utf8')
    .split('\n')
    .filter(Boolean)
    .map((l) => JSON.parse(l) as Report)
}

/** Runs the prepared example (TypeScript, transpiled) as an ES module with `env` added: its exit and its output. */
async function runExample(ex: Prepared, env: Record<string, string | undefined>) {
  const js = ts.transpileModule(ex.code, { compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022 } }).outputText
  const proc = spawn(process.execPath, ['--input-type=module', '-e', js], { cwd: repoRoot, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] })
  let output = ''
  proc.stdout.setEncoding('utf8').on('data', (s: string) => (output += s))
  proc.stderr.setEncoding('utf8').on('data', (s: string) => (output += s))
  const exit = await new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => proc.once('exit', (code, signal) => resolve({ code, signal })))
  return { exit, output }
}

describe("the README's Use example", () => {
  test('runs as written: exits 0, its VM process still has every file of its workspace after the owner let go of the lease, and a sweep afterwards leaves no workspace', async () => {
    const dir = freshDir()
    const host = path.join(dir, 'host')
    const ex = prepare(useExample(), host)
    const bin = path.join(dir, 'bin')
    fs.mkdirSync(bin)
    // exec: the stand-in is the spawned process itself, with the fds it was given.
    fs.writeFileSync(path.join(bin, ex.command), `#!/bin/sh\nexec '${process.execPath}' '${path.join(fixtures, 'readme-vm.cjs')}' "$@"\n`, { mode: 0o755 })
    const reportFile = path.join(dir, 'vm-report.jsonl')

    const { exit, output } = await runExample(ex, { PATH: `${bin}:${process.env.PATH}`, VMSPACE_README_REPORT: reportFile, VMSPACE_README_POOL: ex.root })
    expect(exit, `${output}\n--- the example as run:\n${ex.code}`).toEqual({ code: 0, signal: null })

    // The VM process may outlive the example (spawned detached); it reports once the example let go of the lease.
    await eventually(() => readReport(reportFile).some((m) => m.event === 'checked'))
    const [started, checked] = readReport(reportFile)
    expect(started).toMatchObject({ event: 'started', lease: expect.any(String) })
    const { pid } = started as { pid: number }
    killOnFinish(pid)
    expect(checked).toMatchObject({ event: 'checked', ownerLetGo: true })
    // Every template source is in the workspace, byte for byte, when the VM process looks after the owner's call.
    const { files, error } = checked as { files: Record<string, string> | null; error: string | null }
    const found = Object.fromEntries(Object.entries(ex.sources).map(([p, hash]) => [p, Object.keys(files ?? {}).find((n) => files![n] === hash) ?? null]))
    expect({ found, error }, JSON.stringify(checked)).toEqual({ found: Object.fromEntries(Object.keys(ex.sources).map((p) => [p, expect.any(String)])), error: null })

    const pool = await openPool(ex.root, { create: false })
    // Whatever the example did after its child exited (a sweep, an adopt and dispose, nothing), no lease is held now.
    await eventually(async () => (await pool.list()).every((e) => !e.live))
    const report = await pool.sweep()
    expect(report.failed).toEqual([])
    expect(await pool.list()).toEqual([])
    expect(poolState(ex.root)).toEqual(emptyPoolState)
  })

  test('a VM that fails to start (its command is not installed: spawn ENOENT) is no unhandled rejection: exit 0; release() finds no holder, its workspace is disposed', async () => {
    const dir = freshDir()
    const ex = prepare(useExample(), path.join(dir, 'host'))
    const { exit, output } = await runExample(ex, { PATH: path.join(dir, 'nothing-here') })
    expect(exit, output).toEqual({ code: 0, signal: null })
    expect(output).toBe('0 reclaimed\n')
    expect(poolState(ex.root)).toEqual(emptyPoolState)
  })
})

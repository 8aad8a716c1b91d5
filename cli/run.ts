/**
 * `vmspace run --pool ROOT [--from TEMPLATE] [--template [DEST=]PATH]… [--meta JSON] [--reflink MODE] -- CMD ARGS…`: a workspace for the life of one
 * command. The command runs in the workspace with the lease as its fd 3, so the workspace stays live while it (or
 * anything it passed fd 3 to) runs, even if this process is killed; it is disposed when the command exits.
 */
import { spawn } from 'node:child_process'
import * as fs from 'node:fs'
import * as os from 'node:os'
import * as path from 'node:path'
import { openPool, type JsonObject, type Pool, type Reflink, type Workspace } from 'vmspace'
import { EXIT_RUN_FAILED, errorText, interruptible, poolRootOrNew, UsageError } from './common.js'

/** fd number of the lease in the command's process. */
export const LEASE_FD = 3
/** The metadata limit of Pool.allocate (AllocateOptions.meta). */
const MAX_META_BYTES = 64 * 1024
/** Signals passed on to the command; it decides how to end, and its status becomes ours. */
const FORWARDED = ['SIGINT', 'SIGTERM', 'SIGHUP'] as const

export interface RunOptions {
  pool: string
  template: string[]
  /** A template of the pool (id or name): allocate({ from }). */
  from?: string
  meta?: string
  reflink?: Reflink
}

/** `[DEST=]PATH` values as allocate's template map; every source must exist, every DEST stay beneath the workspace. */
function templates(values: string[]): Record<string, string> | undefined {
  if (values.length === 0) return undefined
  const map: Record<string, string> = {}
  for (const value of values) {
    const eq = value.indexOf('=')
    // An empty PATH would resolve to the current directory, an empty DEST read "=x" as a relative path "=x": both
    // are mistakes, refused (a file whose name starts with "=" is given as ./=x).
    if (eq === 0) throw new UsageError(`--template ${value}: DEST before '=' is empty`)
    const given = eq > 0 ? value.slice(eq + 1) : value
    if (given === '') throw new UsageError(`--template ${value}: PATH is empty`)
    const source = path.resolve(given)
    const dest = eq > 0 ? value.slice(0, eq) : path.basename(source)
    const normal = path.posix.normalize(dest).replace(/\/+$/, '')
    if (dest.includes('\0') || path.posix.isAbsolute(dest) || normal === '.' || normal === '..' || normal.startsWith('../'))
      throw new UsageError(`--template ${value}: DEST must be a relative path beneath the workspace`)
    if (normal in map) throw new UsageError(`--template ${value}: ${normal} is given twice`)
    try {
      fs.statSync(source)
    } catch (e) {
      throw new UsageError(`--template ${value}: ${source}: ${(e as NodeJS.ErrnoException).code === 'ENOENT' ? 'no such file or directory' : errorText(e)}`)
    }
    map[normal] = source
  }
  return map
}

function metaObject(text: string | undefined): JsonObject | undefined {
  if (text === undefined) return undefined
  let meta: unknown
  try {
    meta = JSON.parse(text)
  } catch (e) {
    throw new UsageError(`--meta must be a JSON object: ${errorText(e)}`)
  }
  if (typeof meta !== 'object' || meta === null || Array.isArray(meta)) throw new UsageError('--meta must be a JSON object')
  if (Buffer.byteLength(JSON.stringify(meta)) > MAX_META_BYTES) throw new UsageError(`--meta is more than ${MAX_META_BYTES} bytes of JSON`)
  return meta as JsonObject
}

/** The command's exit status, as a shell gives it: its code, or 128 + the signal that killed it. */
function statusOf(code: number | null, signal: NodeJS.Signals | null): number {
  if (code !== null) return code
  return 128 + (signal ? (os.constants.signals[signal] ?? 0) : 0)
}

/** Runs `cmd` in the workspace; resolves to its status, or 127/126 when it cannot be started (as sh does). */
function runIn(ws: Workspace, root: string, cmd: string[]): Promise<number> {
  return new Promise((resolve) => {
    const child = spawn(cmd[0], cmd.slice(1), {
      cwd: ws.path,
      env: { ...process.env, VMSPACE_PATH: ws.path, VMSPACE_ID: ws.id, VMSPACE_NAME: ws.name, VMSPACE_POOL: root, VMSPACE_LEASE_FD: String(LEASE_FD) },
      stdio: ['inherit', 'inherit', 'inherit', ws.leaseFd],
    })
    const forward = (sig: NodeJS.Signals) => {
      if (child.exitCode === null && child.signalCode === null) child.kill(sig)
    }
    for (const sig of FORWARDED) process.on(sig, forward)
    const done = (status: number) => {
      for (const sig of FORWARDED) process.off(sig, forward)
      resolve(status)
    }
    child.once('error', (e: NodeJS.ErrnoException) => {
      // Only a failed spawn comes without an exit (ENOENT: no such command, EACCES: not executable).
      if (child.pid !== undefined) return
      process.stderr.write(`vmspace run: ${cmd[0]}: ${errorText(e)}\n`)
      done(e.code === 'ENOENT' ? 127 : 126)
    })
    child.once('exit', (code, signal) => done(statusOf(code, signal)))
  })
}

export async function run(cmd: string[], opts: RunOptions): Promise<number> {
  // Every argument is checked before the pool is opened (or made).
  const root = poolRootOrNew('--pool', opts.pool)
  const template = templates(opts.template)
  const meta = metaObject(opts.meta)

  // Until the command runs, an interrupt rolls the allocation back (the AbortSignal) and exits 128+signal.
  let pool!: Pool
  const ws = await interruptible(
    async (signal) => {
      pool = await openPool(root, { ...(opts.reflink ? { reflink: opts.reflink } : {}) })
      try {
        return await pool.allocate({ template, from: opts.from, meta, signal })
      } catch (e) {
        await pool.close()
        throw e
      }
    },
    () => {},
  )
  if (typeof ws === 'number') return ws

  // The command handles its own signals (forwarded); ours are ignored until the workspace is disposed.
  const ignore = () => {}
  for (const sig of FORWARDED) process.on(sig, ignore)
  try {
    const status = await runIn(ws, root, cmd)
    try {
      await ws.dispose()
    } catch (e) {
      // A pool root found inside is left whole by every removal: no sweep finishes that one (docs/pool-on-disk.md).
      const after = (e as { code?: string }).code === 'ERR_POOL_NESTED' ? 'see "A pool inside a pool" in docs/pool-on-disk.md' : 'a sweep finishes it'
      process.stderr.write(`vmspace run: dispose of ${ws.name} failed (${after}): ${errorText(e)}\n`)
      return status === 0 ? EXIT_RUN_FAILED : status
    }
    return status
  } finally {
    await pool.close()
    for (const sig of FORWARDED) process.off(sig, ignore)
  }
}

/**
 * `vmspace demo` (`npm run demo`): what vmspace is for, on real input.
 *
 * Worker processes (demo/worker.ts, forked) share one pool and together make --vms workspaces, each with a
 * private clone of a real base image as `rootfs.ext4`. Every worker writes its workspace's id into its own clones,
 * reads it back before dispose, and reports latency, clone method and check results over IPC. The parent then
 * checks that the base is unchanged (sha256), that no two workspaces shared a path, and that disposing left
 * nothing in the pool, and prints a summary. Exit status: 0 when every check passed, 1 when any failed, 2 for
 * bad arguments, 128+signal when interrupted.
 *
 * --template-dir DIR starts every workspace from a directory tree instead (`allocate({ template: DIR })`): each
 * worker writes its id into its clone of one template file and into a marker file, checks that its tree is the
 * template's, and the parent checks that the template (listing, modes, sizes, times, contents) is unchanged.
 *
 * --chaos SIGKILLs some workers mid-run (each after some allocations); replacement workers make the rest of their
 * share, and one `pool.sweep({ graceMs: 0 })` must reclaim exactly what the killed workers left (chaos.ts).
 *
 * The phases, one module each: setup.ts, run.ts, checks.ts, chaos.ts, report.ts. Uses only vmspace's public API,
 * Node built-ins and cli-progress.
 */
import * as fs from 'node:fs'
import { chaos } from './chaos.js'
import { checkLeftovers, checkWorkers, checkWorkspaces } from './checks.js'
import { Demo } from './context.js'
import { HELP, parseOptions, UsageError, type Options } from './options.js'
import { describeWithStack } from './protocol.js'
import { report } from './report.js'
import { runWorkers } from './run.js'
import { setup } from './setup.js'
import { forkPhase } from './fork.js'

/** Runs the demo with `argv` (its options, without the command); resolves to the exit status. */
export async function main(argv: string[]): Promise<number> {
  // `--boot N`: real guests under QEMU instead of worker processes (demo/boot/), with its own options.
  if (argv.some((a) => a === '--boot' || a.startsWith('--boot='))) return (await import('./boot/main.js')).main(argv)
  let opts: Options | 'help'
  try {
    opts = parseOptions(argv)
  } catch (e) {
    if (!(e instanceof UsageError)) throw e
    process.stderr.write(`vmspace demo: ${e.message.replace(/\n/g, ' ')} (see vmspace demo --help)\n`)
    return 2
  }
  if (opts === 'help') {
    process.stdout.write(HELP)
    return 0
  }
  const demo = new Demo(opts)
  const onSignal = (sig: NodeJS.Signals) => demo.onSignal(sig)
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.on(sig, onSignal)
  // A closed pipe (vmspace demo | head) must not stop the run before it has cleaned up.
  for (const stream of [process.stdout, process.stderr]) stream.on('error', () => {})
  try {
    const s = await setup(demo)
    if (opts.fork !== undefined) {
      // One parent forked into N children instead of the workers (fork.ts).
      await forkPhase(demo, s, opts.fork)
      await checkLeftovers(demo, s)
      for (const f of demo.failures) process.stderr.write(`vmspace demo: FAILED: ${f}\n`)
      const errors = await demo.cleanup.run()
      for (const e of errors) process.stderr.write(`vmspace demo: cleanup: ${e}\n`)
      if (demo.interrupted) return demo.interruptCode
      return demo.failures.length || errors.length ? 1 : 0
    }
    const r = await runWorkers(demo, s)
    demo.phase = 'report'
    checkWorkers(demo)
    const c = await checkWorkspaces(demo, s, r)
    const chaosRows = opts.chaos ? await chaos(demo, s, c) : []
    const left = await checkLeftovers(demo, s)
    report(demo, s, r, c, chaosRows, left)

    const errors = await demo.cleanup.run()
    for (const e of errors) process.stderr.write(`vmspace demo: cleanup: ${e}\n`)
    if (s.ownRoot && fs.existsSync(s.root)) {
      process.stderr.write(`vmspace demo: could not remove ${s.root}\n`)
      return 1
    }
    if (demo.interrupted) return demo.interruptCode
    return demo.failures.length || errors.length ? 1 : 0
  } catch (e) {
    demo.progress?.stop()
    demo.killAll()
    const errors = await demo.cleanup.run()
    if (demo.interrupted) return demo.interruptCode
    process.stderr.write(`vmspace demo: ${describeWithStack(e)}\n`)
    for (const c of errors) process.stderr.write(`vmspace demo: cleanup: ${c}\n`)
    return 1
  } finally {
    for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.off(sig, onSignal)
  }
}

if (require.main === module)
  main(process.argv.slice(2)).then(
    (code) => {
      process.exitCode = code
    },
    (e) => {
      process.stderr.write(`vmspace demo: ${describeWithStack(e)}\n`)
      process.exitCode = 1
    },
  )

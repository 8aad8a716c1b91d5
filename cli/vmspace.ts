#!/usr/bin/env node
/**
 * The `vmspace` command (package.json `bin`): a thin layer over the library's public API (imported by the
 * package's own name) with commander for arguments. Exit codes: 0 done, 1 some entries (or the operation)
 * failed, 2 bad arguments (one line on stderr, nothing touched); `run` exits with its command's status, or 125
 * when vmspace itself failed (bad arguments included).
 */
import { Command, CommanderError, InvalidArgumentError, Option } from 'commander'
import { EXIT_FAILED, EXIT_RUN_FAILED, EXIT_USAGE, errorText, nonNegativeInt, parseDuration, parseSize, UsageError } from './common.js'
import type { CheckpointFlags } from './checkpoint.js'
import type { ImportFlags } from './image.js'
import { collectShare, templateArg, type CommitFlags, type ForkFlags } from './template.js'

const program = new Command('vmspace')

/**
 * commander throws its parse errors (exitOverride) instead of printing them: main() prints each as one line
 * naming the command, and decides the exit status.
 */
function configure(cmd: Command): Command {
  return cmd
    .exitOverride()
    .showSuggestionAfterError(false)
    .configureOutput({ outputError: () => {} })
}

/** A commander argument parser from one of ours: UsageError becomes commander's invalid-argument error. */
function parser<T>(fn: (value: string) => T) {
  return (value: string): T => {
    try {
      return fn(value)
    } catch (e) {
      throw new InvalidArgumentError(errorText(e))
    }
  }
}

const parseSizeArg = (value: string): number => {
  const n = parseSize('--size')(value)
  // openPool's own rule for options.image.size, checked here so that a bad --size is a usage error (exit 2).
  if (n < 128 * 1024 * 1024 || n % 4096 !== 0) throw new UsageError(`--size must be at least 128M and a multiple of 4K, got ${JSON.stringify(value)}`)
  return n
}

/** `--platform os/arch[/variant]`, as an image index's platform names it (e.g. linux/arm64/v8). */
const platformArg = (value: string): string => {
  if (!/^[a-z0-9_]+\/[a-z0-9_]+(\/[a-z0-9_]+)?$/.test(value)) throw new UsageError(`--platform must be OS/ARCH[/VARIANT] (e.g. linux/amd64), got ${JSON.stringify(value)}`)
  return value
}

const reflinkOption = () => new Option('--reflink <mode>', 'reflink: share extents, else copy (auto), or fail (always), or always copy (never)').choices(['always', 'auto', 'never'])

/** Runs an action and records its exit status; a lazy import keeps each command's dependencies off the others' path. */
let status = 0
function action<A extends unknown[]>(fn: (...args: A) => Promise<number>) {
  return async (...args: A) => {
    status = await fn(...args)
  }
}

configure(program)
  .description(
    'Private per-VM workspace directories: ls, inspect, sweep, metrics; run, commit, fork, checkpoint, rollback, template (rm, prune); ' +
      'image (import, ls, inspect, rm); clone, probe; mount, unmount (image-backed pools); demo.',
  )
  .enablePositionalOptions()
  .version((require('../../package.json') as { version: string }).version, '-V, --version')
  .addHelpText(
    'after',
    '\nExit status: 0 done, 1 some entries failed, 2 bad arguments (nothing touched); run: the status of CMD, or 125 when\n' +
      'vmspace failed (126: CMD not executable, 127: not found).\n' +
      '--json prints one JSON document on stdout (see docs/cli.md).',
  )

program
  .command('ls')
  .description('list the workspaces of a pool: id, live/free, age, pid, host, template method, allocated bytes, meta')
  .argument('<root>', 'pool directory')
  .option('--json', 'JSON output')
  .action(action(async (root: string, o: { json?: boolean }) => (await import('./ls.js')).ls(root, o)))

program
  .command('inspect')
  .description('everything the pool knows about one workspace')
  .argument('<root>', 'pool directory')
  .argument('<id>', 'workspace id (32 hex characters) or name')
  .option('--json', 'JSON output')
  .action(action(async (root: string, id: string, o: { json?: boolean }) => (await import('./ls.js')).inspect(root, id, o)))

program
  .command('sweep')
  .description('reclaim what no live process holds: free workspaces, trash, dead builds, stray metadata')
  .argument('<root>', 'pool directory')
  .option('--dry-run', 'report what would be reclaimed, touch nothing')
  .option('--grace <ms>', 'leave staging entries and metadata younger than this alone (default 60000)', parser(nonNegativeInt('--grace', 2 ** 31 - 1)))
  .option('--json', 'JSON output')
  .action(action(async (root: string, o: { dryRun?: boolean; grace?: number; json?: boolean }) => (await import('./sweep.js')).sweep(root, o)))

program
  .command('metrics')
  .description("the pool's gauges in the Prometheus text format: on stdout, into FILE atomically (textfile collector), or served at /metrics")
  .argument('<root>', 'pool directory')
  .option('--output <file>', 'write FILE atomically (a temp file in its directory, renamed over it)')
  .option('--listen <[host:]port>', 'serve GET /metrics at HOST:PORT until SIGINT/SIGTERM (host default 127.0.0.1)')
  .action(action(async (root: string, o: { output?: string; listen?: string }) => (await import('./metrics.js')).metrics(root, o)))

program
  .command('commit')
  .description("commit a workspace's current contents as a template in the pool (pause writers first)")
  .argument('<root>', 'pool directory')
  .argument('<id>', 'workspace id (32 hex characters) or name')
  .option('--name <name>', 'template name (1-128 of [A-Za-z0-9._-]); an existing one fails unless --replace')
  .option('--replace', 'swap an existing name to the new template atomically')
  .option('--meta <json>', 'a JSON object kept in the template metadata')
  .option('--keep-devices', "carry the workspace's device nodes (a guest's are left out by default)")
  .option('--keep-set-id', 'carry set-id bits and file capabilities (dropped by default)')
  .option('--share <path>', 'a read-only file every child holds as one inode (repeat per file; docs/templates.md)', collectShare)
  .option('--json', 'JSON output (the template)')
  .action(action(async (root: string, id: string, o: CommitFlags) => (await import('./template.js')).commit(root, id, o)))

program
  .command('fork')
  .description('N new workspaces from the current contents of one; left with free leases for pool.adopt()')
  .argument('<root>', 'pool directory')
  .argument('<id>', 'workspace id (32 hex characters) or name')
  .argument('<n>', 'number of children (1-4096)', parser(nonNegativeInt('N', 4096, 1)))
  .option('--meta <json>', 'a JSON object kept in every child\'s metadata')
  .option('--keep-devices', "carry the workspace's device nodes (a guest's are left out by default)")
  .option('--keep-set-id', 'carry set-id bits and file capabilities (dropped by default)')
  .option('--share <path>', 'a read-only file every child holds as one inode (repeat per file)', collectShare)
  .option('--json', 'JSON output')
  .action(action(async (root: string, id: string, n: number, o: ForkFlags) => (await import('./template.js')).fork(root, id, n, o)))

program
  .command('checkpoint')
  .description("checkpoint a workspace: its current tree as an unnamed template that rollback puts back (pause writers first)")
  .argument('<root>', 'pool directory')
  .argument('<id>', 'workspace id (32 hex characters) or name')
  .option('--keep-newest <n>', "keep the workspace's newest N checkpoints (this one counts), remove the rest", parser(nonNegativeInt('--keep-newest', 2 ** 31 - 1, 1)))
  .option('--max-age <duration>', "remove the workspace's checkpoints older than this (ms, or 30s, 90m, 12h, 7d); never the new one", parser(parseDuration('--max-age')))
  .option('--share <path>', 'a workspace-relative regular file the checkpoint shares read-only (repeatable)', (v: string, all: string[] = []) => [...all, v])
  .option('--meta <json>', 'a JSON object kept in the checkpoint metadata')
  .option('--json', 'JSON output (the checkpoint)')
  .action(action(async (root: string, id: string, o: CheckpointFlags) => (await import('./checkpoint.js')).checkpoint(root, id, o)))

program
  .command('rollback')
  .description("put a workspace's tree back to one of its checkpoints, atomically, under the same id, path and lease (stop its VM or container first)")
  .argument('<root>', 'pool directory')
  .argument('<id>', 'workspace id (32 hex characters) or name')
  .argument('<checkpoint>', 'checkpoint id (32 hex characters)')
  .option('--json', 'JSON output')
  .action(action(async (root: string, id: string, cp: string, o: { json?: boolean }) => (await import('./checkpoint.js')).rollback(root, id, cp, o)))

const template = program.command('template').description('remove templates of a pool: one (rm), or stale versions (prune)')

template
  .command('rm')
  .description('remove a template: its name at once, its tree once no allocate reads it (workspaces made from it stay)')
  .argument('<root>', 'pool directory')
  .argument('<template>', 'template id (32 hex characters) or name', parser(templateArg('TEMPLATE')))
  .option('--json', 'JSON output')
  .action(action(async (root: string, ref: string, o: { json?: boolean }) => (await import('./template.js')).templateRm(root, ref, o)))

template
  .command('prune')
  .description('remove stale templates: outside the newest N of their name, and/or unused for a while')
  .argument('<root>', 'pool directory')
  .option('--keep-newest <n>', 'keep the newest N of each name (the current one always counts first)', parser(nonNegativeInt('--keep-newest', 2 ** 31 - 1)))
  .option('--unused-for <duration>', 'remove those not allocated from or committed for this long (ms, or 30s, 90m, 12h, 7d); current ones too', parser(parseDuration('--unused-for')))
  .option('--name <name>', 'only templates of this name', parser(templateArg('--name')))
  .option('--dry-run', 'report what would be removed, remove nothing')
  .option('--json', 'JSON output')
  .action(action(async (root: string, o: import('./template.js').PruneArgs) => (await import('./template.js')).templatePrune(root, o)))

const image = program.command('image').description('OCI images as templates of a pool: import, ls, inspect, rm (docs/images.md)')

image
  .command('import')
  .description('import an OCI image (layout dir, oci-archive or docker-archive) as a template; layers shared with earlier imports are reused (root only)')
  .argument('<root>', 'pool directory (made if missing)')
  .argument('<source>', 'a path, or oci:DIR[:REF], oci-archive:FILE[:REF], docker-archive:FILE[:REF]')
  .option('--ref <ref>', 'the tag in the layout or archive (needed where there are several)')
  .option('--platform <os/arch[/variant]>', "the manifest of an index to take (default: the host's linux/ARCH)", parser(platformArg))
  .addOption(new Option('--format <format>', 'tree: the rootfs as a directory; ext4: a rootfs.ext4 image file a VMM boots').choices(['tree', 'ext4']))
  .option('--name <name>', 'template name (default: the ref); an existing one fails unless --replace', parser(templateArg('--name')))
  .option('--replace', 'swap an existing name to the new template atomically')
  .option('--ext4-headroom <bytes>', 'free space in rootfs.ext4 beyond what the tree needs, e.g. 256M (K, M, G, T: binary units)', parser(parseSize('--ext4-headroom')))
  .option('--json', 'JSON output (the image template)')
  .action(action(async (root: string, source: string, o: ImportFlags) => (await import('./image.js')).imageImport(root, source, o)))

image
  .command('ls')
  .description('list the image templates of a pool: name, id, format, platform, layers, age, manifest digest')
  .argument('<root>', 'pool directory')
  .option('--json', 'JSON output')
  .action(action(async (root: string, o: { json?: boolean }) => (await import('./image.js')).imageLs(root, o)))

image
  .command('inspect')
  .description('one image template as JSON: its digest, platform, format, config (Env, Entrypoint, Cmd, ...) and layers')
  .argument('<root>', 'pool directory')
  .argument('<image>', 'image template id (32 hex characters) or name', parser(templateArg('IMAGE')))
  .action(action(async (root: string, ref: string) => (await import('./image.js')).imageInspect(root, ref)))

image
  .command('rm')
  .description('remove an image template, then the layer templates no other image uses (workspaces made from it stay)')
  .argument('<root>', 'pool directory')
  .argument('<image>', 'image template id (32 hex characters) or name', parser(templateArg('IMAGE')))
  .option('--json', 'JSON output')
  .action(action(async (root: string, ref: string, o: { json?: boolean }) => (await import('./image.js')).imageRm(root, ref, o)))

program
  .command('run')
  .description('allocate a workspace, run CMD in it holding the lease (fd 3), dispose it when CMD exits')
  .requiredOption('--pool <root>', 'pool directory (made if missing)')
  .option('--from <template>', "start from a template of the pool (id or name; see vmspace commit)", parser(templateArg('--from')))
  .option('--template <[dest=]path>', 'clone PATH into the workspace as DEST (default: its basename); repeatable', (v: string, prev: string[]) => [...prev, v], [] as string[])
  .option('--meta <json>', 'a JSON object kept in the workspace metadata')
  .addOption(reflinkOption())
  .passThroughOptions()
  .argument('<cmd...>', 'the command and its arguments (after --)')
  .action(action(async (cmd: string[], o: { pool: string; from?: string; template: string[]; meta?: string; reflink?: 'always' | 'auto' | 'never' }) => (await import('./run.js')).run(cmd, o)))

program
  .command('clone')
  .description('clone a file or a directory tree (reflink where possible), with progress')
  .argument('<src>', 'a regular file or a directory')
  .argument('<dst>', 'the new path (its parent must exist)')
  .addOption(reflinkOption().default('auto'))
  .option('--overwrite', 'replace DST atomically if it exists')
  .option('--json', 'JSON output (the clone result)')
  .action(action(async (src: string, dst: string, o: { reflink?: 'always' | 'auto' | 'never'; overwrite?: boolean; json?: boolean }) => (await import('./clone.js')).clone(src, dst, o)))

program
  .command('probe')
  .description('the file system under DIR and whether reflink, renameat2, flock, birth times and holes work there')
  .argument('<dir>', 'an existing directory (a temporary directory is made in it and removed)')
  .option('--json', 'JSON output')
  .action(action(async (dir: string, o: { json?: boolean }) => (await import('./probe.js')).probe(dir, o)))

program
  .command('mount')
  .description('an image-backed pool: make IMAGE (sparse, btrfs) if missing, loop-mount it at ROOT with direct I/O, open the pool (root only)')
  .argument('<root>', 'pool directory (the mount point; made if missing)')
  .requiredOption('--image <path>', 'the image file (made if missing; an existing one must be a vmspace image)')
  .option('--size <bytes>', 'size of an image made here, e.g. 8G (suffix K, M, G, T: binary units; at least 128M); needed only to make one', parser(parseSizeArg))
  .option('--json', 'JSON output')
  .action(action(async (root: string, o: { image: string; size?: number; json?: boolean }) => (await import('./mount.js')).mount(root, o)))

program
  .command('unmount')
  .description('unmount an image-backed pool and detach its loop device (the image file is kept; root only)')
  .argument('<root>', 'the pool directory vmspace mount mounted')
  .option('--json', 'JSON output')
  .action(action(async (root: string, o: { json?: boolean }) => (await import('./mount.js')).unmount(root, o)))

program
  .command('demo')
  .description("the demo: many workspaces at once from worker processes, checked and summarised (vmspace demo --help)")
  .helpOption(false)
  .allowUnknownOption()
  .passThroughOptions()
  .argument('[options...]', 'the demo options')
  .action(action(async (args: string[]) => (await import('../demo/main.js')).main(args)))

for (const cmd of program.commands) for (const c of [cmd, ...cmd.commands]) configure(c)

async function main(): Promise<number> {
  // commander answers `help <unknown>` (`help help`, `help --help` too) with the whole help on stderr: the help asked
  // for goes to stdout, and an unknown command is one line, as everywhere else.
  const [first, second] = process.argv.slice(2)
  if (first === 'help' && (second === 'help' || second?.startsWith('-'))) {
    program.outputHelp()
    return 0
  }
  if (first === 'help' && second !== undefined && !program.commands.some((c) => c.name() === second)) {
    process.stderr.write(`vmspace: unknown command '${second}' (see vmspace --help)\n`)
    return EXIT_USAGE
  }
  try {
    await program.parseAsync(process.argv)
    return status
  } catch (e) {
    // The command is the first argument (the program's own options, -h and -V, take no value).
    const sub = program.commands.find((c) => c.name() === process.argv[2])
    const leaf = sub?.commands.find((c) => c.name() === process.argv[3])
    const prefix = ['vmspace', sub?.name(), leaf?.name()].filter(Boolean).join(' ')
    // run's own failures must not read as its command's status (which may be 1 or 2 too).
    const [usageStatus, failedStatus] = sub?.name() === 'run' ? [EXIT_RUN_FAILED, EXIT_RUN_FAILED] : [EXIT_USAGE, EXIT_FAILED]
    if (e instanceof CommanderError) {
      // --help and --version end in a CommanderError too, with exit code 0.
      if (e.exitCode === 0) return 0
      // No command: commander has printed the help to stderr already; nothing more to say.
      if (e.code === 'commander.help') return EXIT_USAGE
      process.stderr.write(`${prefix}: ${e.message.replace(/^error: /, '').split('\n')[0]} (see ${prefix} --help)\n`)
      return usageStatus
    }
    if (e instanceof UsageError) {
      process.stderr.write(`${prefix}: ${e.message}\n`)
      return usageStatus
    }
    process.stderr.write(`${prefix}: ${errorText(e)}\n`)
    return failedStatus
  }
}

/**
 * A reader that went away (`vmspace ls | head -1`) is not a failure: the rest of that stream's output is dropped
 * (a destroyed stream ignores later writes) and the command finishes as it would, so that `run` still waits for
 * its CMD and disposes. Any other write error stays fatal.
 */
for (const stream of [process.stdout, process.stderr])
  stream.on('error', (e: NodeJS.ErrnoException) => {
    if (e.code !== 'EPIPE') throw e
  })

// main() settles with an exit status: it catches every error itself.
void main().then((code) => {
  process.exitCode = code
})

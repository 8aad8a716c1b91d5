// The package as its users load it: by name, with `import` and with `require`, with types for both.
import { execFileSync, spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { fixtures, freshDir, repoRoot } from './helpers.js'

const run = (args: string[]) => execFileSync(process.execPath, args, { cwd: repoRoot, encoding: 'utf8' }).trim()

describe('the package', () => {
  test('loads with require by name and exposes the API', () => {
    const out = run(['-e', "const v = require('vmspace'); console.log(typeof v.openPool, typeof v.clone, typeof v.lockFile, typeof v.VmspaceError)"])
    expect(out).toBe('function function function function')
  })

  test('loads with import by name, sharing one module instance with require', () => {
    const out = run([
      '--input-type=module',
      '-e',
      "import { openPool, VmspaceError } from 'vmspace'; import { createRequire } from 'node:module'; const req = createRequire(import.meta.url); console.log(typeof openPool, VmspaceError === req('vmspace').VmspaceError)",
    ])
    expect(out).toBe('function true')
  })

  test('types check for ES module and CommonJS consumers', () => {
    const tsc = path.join(repoRoot, 'node_modules', 'typescript', 'bin', 'tsc')
    const files = ['consumer.mts', 'consumer.cts'].map((f) => path.join(fixtures, 'types', f))
    const out = execFileSync(
      process.execPath,
      [tsc, '--noEmit', '--strict', '--module', 'nodenext', '--moduleResolution', 'nodenext', '--target', 'es2022',
        '--lib', 'es2022,esnext.disposable', '--types', 'node', '--skipLibCheck', ...files],
      { cwd: repoRoot, encoding: 'utf8' },
    )
    expect(out).toBe('')
  })

  test('import has a default export (the API) and a namespace without __esModule; both match require', () => {
    const out = run([
      '--input-type=module',
      '-e',
      "import * as ns from 'vmspace'; import vm from 'vmspace'; import { createRequire } from 'node:module'; const cjs = createRequire(import.meta.url)('vmspace'); " +
        "const named = Object.keys(ns).filter((k) => k !== 'default').sort(); const cjsNamed = Object.keys(cjs).filter((k) => k !== 'default').sort(); " +
        "console.log(JSON.stringify({ esModule: '__esModule' in ns, named: named.join() === cjsNamed.join(), dflt: vm === cjs.default && Object.keys(vm).sort().join() === named.join(), same: named.every((k) => vm[k] === cjs[k] && ns[k] === cjs[k]) }))",
    ])
    expect(JSON.parse(out)).toEqual({ esModule: false, named: true, dflt: true, same: true })
  })

  test("require's default is the same API object, for TypeScript's CommonJS output of `import vm from 'vmspace'`", () => {
    const out = run(['-e', "const v = require('vmspace'); console.log(Object.keys(v.default).every((k) => v.default[k] === v[k]), Object.keys(v.default).sort().join())"])
    const api = ['AbortError', 'FileLock', 'Pool', 'VmspaceError', 'Workspace', 'clone', 'durationBuckets', 'exchange', 'lockFile', 'metricsText', 'openPool', 'poolGauges', 'probeQuota', 'registerPrometheus', 'removeTree', 'renameNoReplace', 'startMetrics', 'unmountImage', 'updateJsonFile']
    expect(out).toBe(`true ${api.join()}`)
  })

  test('the published types hide internals and constructors, and type the error codes', () => {
    const tsc = path.join(repoRoot, 'node_modules', 'typescript', 'bin', 'tsc')
    const out = execFileSync(
      process.execPath,
      [tsc, '--noEmit', '--strict', '--module', 'nodenext', '--moduleResolution', 'nodenext', '--target', 'es2022',
        '--lib', 'es2022,esnext.disposable', '--types', 'node', '--skipLibCheck', path.join(fixtures, 'types', 'surface.mts')],
      { cwd: repoRoot, encoding: 'utf8' },
    )
    expect(out).toBe('')
  })

  test('the source maps carry their sources (lib/ is not published)', () => {
    for (const f of ['index.js.map', 'pool.js.map', 'esm.mjs.map']) {
      const map = JSON.parse(fs.readFileSync(path.join(repoRoot, 'dist', f), 'utf8')) as { sources: string[]; sourcesContent?: string[] }
      expect(map.sourcesContent?.length).toBe(map.sources.length)
      expect(map.sourcesContent!.every((s) => s.length > 0)).toBe(true)
    }
  })
})

describe('packing and installing', () => {
  /** A PATH with node, npm and sh only (no compiler, make or python3), as in a node:*-slim image. */
  function noCompilerPath(): string {
    const bin = path.join(freshDir(), 'bin')
    fs.mkdirSync(bin)
    for (const t of ['node', 'npm', 'sh']) fs.symlinkSync(execFileSync('sh', ['-c', `command -v ${t}`], { encoding: 'utf8' }).trim(), path.join(bin, t))
    return bin
  }

  test('npm pack refuses without both prebuilt binaries, naming the missing one and the way round', () => {
    const pkg = freshDir()
    fs.mkdirSync(path.join(pkg, 'scripts'))
    fs.copyFileSync(path.join(repoRoot, 'scripts', 'prepack.cjs'), path.join(pkg, 'scripts', 'prepack.cjs'))
    const prepack = (env: Record<string, string> = {}) =>
      spawnSync(process.execPath, [path.join(pkg, 'scripts', 'prepack.cjs')], { env: { ...process.env, VMSPACE_PACK_WITHOUT_PREBUILDS: '', ...env }, encoding: 'utf8' })
    const refusal = (missing: string) =>
      `vmspace: refusing to pack without the prebuilt binaries for ${missing} (no prebuilds/${missing.split(' ')[0]}/*.node).\n` +
      '  Build them first: npm run build:prebuilds (as root; see CONTRIBUTING.md, "Prebuilds").\n' +
      '  For a local tarball that is not published: VMSPACE_PACK_WITHOUT_PREBUILDS=1 npm pack\n'
    expect(prepack()).toMatchObject({ status: 1, stdout: '', stderr: refusal('linux-x64 and linux-arm64') })
    fs.mkdirSync(path.join(pkg, 'prebuilds', 'linux-x64'), { recursive: true })
    fs.writeFileSync(path.join(pkg, 'prebuilds', 'linux-x64', 'vmspace.glibc.node'), '')
    expect(prepack()).toMatchObject({ status: 1, stdout: '', stderr: refusal('linux-arm64') })
    expect(prepack({ VMSPACE_PACK_WITHOUT_PREBUILDS: '1' })).toMatchObject({ status: 0, stdout: '', stderr: '' })
    fs.mkdirSync(path.join(pkg, 'prebuilds', 'linux-arm64'))
    fs.writeFileSync(path.join(pkg, 'prebuilds', 'linux-arm64', 'vmspace.glibc.node'), '')
    expect(prepack()).toMatchObject({ status: 0, stdout: '', stderr: '' })
  })

  test('an install script that finds no prebuild and no compiler fails with what to install and `npm rebuild vmspace`', () => {
    // The package as the tarball unpacks it (package.json, binding.gyp, native/, the script), no build and no
    // prebuilds; its dependencies are the checkout's. npm runs the install script as it does at install time.
    const pkg = path.join(freshDir(), 'vmspace')
    fs.mkdirSync(path.join(pkg, 'scripts'), { recursive: true })
    for (const f of ['package.json', 'binding.gyp', 'scripts/install-failed.cjs']) fs.copyFileSync(path.join(repoRoot, f), path.join(pkg, f))
    fs.cpSync(path.join(repoRoot, 'native'), path.join(pkg, 'native'), { recursive: true })
    fs.symlinkSync(path.join(repoRoot, 'node_modules'), path.join(pkg, 'node_modules'))
    const r = spawnSync('npm', ['run', 'install'], { cwd: pkg, env: { ...process.env, PATH: noCompilerPath() }, encoding: 'utf8' })
    expect(r.status).toBe(1)
    const glibc = (process.report.getReport() as { header: { glibcVersionRuntime?: string } }).header.glibcVersionRuntime
    expect(r.stderr).toContain(
      `\nvmspace: no prebuilt binary fits this machine (linux-${process.arch}, glibc ${glibc}) and the build from source failed (node-gyp's output above says why).\n` +
        'Two ways out:\n' +
        '  - install a C++17 compiler, make and python3, then run `npm rebuild vmspace`:\n' +
        '      Debian/Ubuntu:  apt-get install g++ make python3\n' +
        '      Alpine:         apk add build-base python3 linux-headers\n' +
        '      Fedora/RHEL:    dnf install gcc-c++ make python3\n' +
        '  - or install on linux-x64 or linux-arm64 with glibc >= 2.28, where a prebuilt binary ships (no compiler needed).\n',
    )
    expect(fs.existsSync(path.join(pkg, 'build', 'Release'))).toBe(false)
  })
})

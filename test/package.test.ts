// The package as its users load it: by name, with `import` and with `require`, with types for both.
import { execFileSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { fixtures, repoRoot } from './helpers.js'

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
    const out = run(['-e', "const v = require('vmspace'); console.log(Object.keys(v.default).every((k) => v.default[k] === v[k]), Object.keys(v.default).length)"])
    expect(out).toBe('true 13')
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

/**
 * The native calls' contract (lib/binding.ts, native/binding/): options objects read by name, a wrong type is a
 * TypeError naming the call and the key and changes nothing; enums travel as their names; the calls of every VM
 * (allocatePlain, dispose, clonePathBeneath) are positional and check each argument; the release addon has no test
 * seams.
 */
import { spawnSync } from 'node:child_process'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { native } from '../lib/binding.js'
import { emptyPoolState, freshDir, poolState, repoRoot } from './helpers.js'

describe('native options objects', () => {
  test('a wrong type is a TypeError naming the call and the key', () => {
    const root = path.join(freshDir(), 'pool')
    const call = () =>
      native.openPool({ root: 7 as unknown as string, create: true, nonEmpty: false, projectIdFirst: 0, projectIdLast: 0 })
    expect(call).toThrow(TypeError)
    expect(call).toThrow("vmspace binding: openPool: option 'root' must be a string")
    expect(fs.existsSync(root)).toBe(false)
  })

  test('an enum is one of its names; a number (the old code) is refused and nothing is made', () => {
    const dir = freshDir()
    const src = path.join(dir, 'src')
    fs.writeFileSync(src, 'x')
    const dst = path.join(dir, 'dst')
    const call = (reflink: unknown) => () => native.clonePath({ src, dst, reflink: reflink as 'auto' })
    expect(call(0)).toThrow("vmspace binding: clonePath: option 'reflink' must be one of 'always', 'auto', 'never'")
    expect(call('sometimes')).toThrow(TypeError)
    expect(() => native.clonePath({ src, dst, writeback: 2 as unknown as 'wait' })).toThrow(
      "vmspace binding: clonePath: option 'writeback' must be one of 'none', 'start', 'wait'",
    )
    expect(fs.readdirSync(dir)).toEqual(['src'])
  })

  test('a positional call where an options object is expected is a TypeError', () => {
    const call = () => (native.replaceJsonFile as unknown as (...a: unknown[]) => unknown)('/tmp/x', '{}', false)
    expect(call).toThrow('vmspace binding: replaceJsonFile: argument 0 must be an options object')
  })
})

describe('positional native calls', () => {
  test('allocatePlain, dispose and clonePathBeneath refuse a wrong argument with a TypeError; nothing is made', async () => {
    const root = path.join(freshDir(), 'pool')
    const { handle } = await native.openPool({ root, create: true, nonEmpty: false, projectIdFirst: 0, projectIdLast: 0 })
    const any = (f: unknown) => f as (...a: unknown[]) => unknown
    expect(() => any(native.allocatePlain)(handle, 'vm', 0o700, '"format":1', 'yes')).toThrow('vmspace binding: argument 4 must be a boolean')
    for (const mode of [0o17777, -1, NaN, Infinity, 448.5, '448'])
      expect(() => any(native.allocatePlain)(handle, 'vm', mode, '"format":1', false)).toThrow('vmspace binding: allocatePlain: argument 2 must be an integer from 0 to 4095')
    expect(() => any(native.allocatePlain)(handle, 'vm', 0o700, { format: 1 }, false)).toThrow(TypeError)
    for (const fd of [-1, 2 ** 40, NaN, 3.5])
      expect(() => any(native.dispose)(handle, 'vm-x', fd, -1, true)).toThrow('vmspace binding: dispose: argument 2 must be an integer from 0 to 2147483647')
    for (const fd of [-2, 2 ** 40, NaN, 3.5])
      expect(() => any(native.dispose)(handle, 'vm-x', 0, fd, true)).toThrow('vmspace binding: dispose: argument 3 must be an integer from -1 to 2147483647')
    // fd 0 (or any fd that is not a lease of this thread) is never closed by a dispose.
    expect(() => any(native.dispose)(handle, 'vm-x', 0, -1, true)).toThrow('vmspace binding: dispose: not a lease of this thread')
    expect(() => any(native.openHandover)(handle, 'vm-x', 0)).toThrow('vmspace binding: openHandover: not a lease of this thread')
    expect(fs.readlinkSync('/proc/self/fd/0')).toBeTruthy()
    const src = path.join(freshDir(), 'src')
    fs.writeFileSync(src, 'x')
    const clone = (reflink: unknown, writeback: unknown) => () => any(native.clonePathBeneath)(handle, 'vm-x', root, src, 'f', reflink, false, false, writeback, undefined)
    for (const bad of [3, -1, NaN, -0.5, 1.9, 'auto'])
      expect(clone(bad, 0)).toThrow('vmspace binding: clonePathBeneath: argument 5 must be an integer from 0 to 2')
    expect(clone(1, 3)).toThrow('vmspace binding: clonePathBeneath: argument 8 must be an integer from 0 to 2')
    expect(poolState(root)).toEqual(emptyPoolState)
    expect(fs.existsSync(path.join(root, 'f'))).toBe(false)
    await native.closePool(handle)
  })
})

describe('test seams', () => {
  test('the release addon (node-gyp, build/Release) has none', () => {
    const release = { exports: {} as Record<string, unknown> }
    process.dlopen(release, path.join(repoRoot, 'build', 'Release', 'vmspace.node'))
    expect(typeof release.exports.openPool).toBe('function')
    expect(release.exports.setTestIds).toBeUndefined()
    expect(release.exports.setSweepFaultsForTest).toBeUndefined()
  })
})

describe('loading', () => {
  test('where no binary loads, the error names vmspace, the platform, the reason and both ways out', () => {
    // node-gyp-build looks only in VMSPACE_PREBUILD (and beside node), as in an install that has no binary.
    const empty = freshDir()
    const probe = "try { require('vmspace'); console.log('loaded') } catch (e) { console.log(JSON.stringify({ code: e.code, message: e.message, cause: e.cause.message })) }"
    const r = spawnSync(process.execPath, ['-e', probe], { cwd: repoRoot, env: { ...process.env, VMSPACE_PREBUILD: empty }, encoding: 'utf8' })
    expect(r.stderr).toBe('')
    const got = JSON.parse(r.stdout) as { code: string; message: string; cause: string }
    const glibc = (process.report.getReport() as { header: { glibcVersionRuntime?: string } }).header.glibcVersionRuntime
    const reason = got.cause.split('\n')[0]
    expect(reason).toMatch(/^No native build was found for platform=linux arch=/)
    expect(got.code).toBe('ERR_VMSPACE_NO_BINARY')
    expect(got.message).toBe(
      `vmspace: no native binary could be loaded on this machine (linux-${process.arch}, glibc ${glibc}, Node ${process.versions.node}).\n` +
        `  Reason: ${reason}\n` +
        '  Two ways out:\n' +
        '  - build it from source: install a C++17 compiler, make and python3 (Debian/Ubuntu: apt-get install g++ make\n' +
        '    python3; Alpine: apk add build-base python3 linux-headers), then run `npm rebuild vmspace`;\n' +
        '  - or run where a prebuilt binary ships: linux-x64 or linux-arm64 with glibc >= 2.28.',
    )
    expect(fs.readdirSync(empty)).toEqual([])
  })
})

/**
 * The native calls' contract (lib/binding.ts, native/binding/): options objects read by name, a wrong type is a
 * TypeError naming the call and the key and changes nothing; enums travel as their names; the release addon has
 * no test seams.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { native } from '../lib/binding.js'
import { freshDir, repoRoot } from './helpers.js'

describe('native options objects', () => {
  test('a wrong type is a TypeError naming the call and the key', () => {
    const root = path.join(freshDir(), 'pool')
    const call = () =>
      native.openPool({ root: 7 as unknown as string, create: true, format: 1, projectIdFirst: 0, projectIdLast: 0 })
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

describe('test seams', () => {
  test('the release addon (node-gyp, build/Release) has none', () => {
    const release = { exports: {} as Record<string, unknown> }
    process.dlopen(release, path.join(repoRoot, 'build', 'Release', 'vmspace.node'))
    expect(typeof release.exports.openPool).toBe('function')
    expect(release.exports.setTestIds).toBeUndefined()
    expect(release.exports.setSweepFaultsForTest).toBeUndefined()
  })
})

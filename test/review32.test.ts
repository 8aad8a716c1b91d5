/**
 * Review of the house cleanup (behaviour unchanged): what a cold read of the diff, a hostile guest and a careless
 * caller found. Each test states the behaviour as it was before the cleanup and must hold after it.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { Child, fixtures, freshDir, needs, unprivilegedChildren } from './helpers.js'

type Message = Record<string, unknown>

/** One op of test/fixtures/faults-child.cjs in a child of its own (limits, uid). */
async function run(req: object): Promise<Message> {
  const child = new Child(path.join(fixtures, 'faults-child.cjs'), [JSON.stringify(req)])
  child.proc.stdin!.end()
  const m = await child.next()
  const exit = await child.exited
  expect(m.event, `${JSON.stringify(m)}; stderr: ${child.stderr}`).not.toBe('error')
  expect(exit.code, child.stderr).toBe(0)
  return m
}

describe.skipIf(!unprivilegedChildren)(
  `removal by a user who is not a directory's owner ${needs('root, and the checkout reachable by uid 65534', !unprivilegedChildren && 'not available here')}`,
  () => {
    /** dir/tree owned by 65534 holding `other/f`, `other` root's with `mode`. */
    function treeWithOthersDir(mode: number): { dir: string; tree: string } {
      const dir = freshDir()
      const tree = path.join(dir, 'tree')
      fs.mkdirSync(path.join(tree, 'other'), { recursive: true })
      fs.writeFileSync(path.join(tree, 'other', 'f'), 'in root\'s directory')
      fs.chmodSync(path.join(tree, 'other'), mode)
      fs.chownSync(dir, 65534, 65534)
      fs.chownSync(tree, 65534, 65534)
      return { dir, tree }
    }

    test("removeTree as uid 65534 takes another user's directory that others may write (0557): the failed fchmod fallback is no error", { timeout: 60_000 }, async () => {
      const { dir, tree } = treeWithOthersDir(0o557)
      const r = await run({ op: 'remove', target: tree, nobody: true })
      expect(r.event, JSON.stringify(r)).toBe('result')
      expect(fs.readdirSync(dir)).toEqual([])
    })

    test("removeTree as uid 65534 of another user's 0555 directory rejects with the unlinkat's EACCES, not the fallback fchmod's EPERM", { timeout: 60_000 }, async () => {
      const { tree } = treeWithOthersDir(0o555)
      const r = await run({ op: 'remove', target: tree, nobody: true })
      expect(r).toEqual({
        event: 'failed',
        error: { code: 'EACCES', errno: -13, syscall: 'unlinkat', path: path.join(tree, 'other', 'f') },
      })
      expect(fs.readFileSync(path.join(tree, 'other', 'f'), 'utf8')).toBe('in root\'s directory')
    })
  },
)

// errno names come from Node's table in lib/errors.ts (the addon reports numbers: glibc's strerrorname_np is not
// portable); they match what glibc names them, shared numbers included.
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { errnoName, VmspaceError } from '../lib/errors.js'
import { removeTree } from '../lib/index.js'
import { freshDir } from './helpers.js'

describe('errno names', () => {
  test('POSIX and Linux-only numbers get glibc names; where two names share a number, glibc picks', () => {
    const names = [2, 11, 13, 17, 18, 28, 35, 39, 95, 117, 121, 122, 125, 126].map((n) => [n, errnoName(n)])
    expect(names).toEqual([
      [2, 'ENOENT'], [11, 'EAGAIN'], [13, 'EACCES'], [17, 'EEXIST'], [18, 'EXDEV'], [28, 'ENOSPC'], [35, 'EDEADLK'],
      [39, 'ENOTEMPTY'], [95, 'EOPNOTSUPP'], [117, 'EUCLEAN'], [121, 'EREMOTEIO'], [122, 'EDQUOT'], [125, 'ECANCELED'],
      [126, 'ENOKEY'],
    ])
  })

  test('a number nobody names is EUNKNOWN', () => {
    expect(errnoName(4095)).toBe('EUNKNOWN')
  })

  test("a system error from the addon carries the name, Node's negative errno and the libc's description", async () => {
    const missing = path.join(freshDir(), 'missing')
    const err = await removeTree(missing).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(VmspaceError)
    expect(err).toMatchObject({ code: 'ENOENT', errno: -2, syscall: 'rmdir', path: missing })
    expect((err as Error).message).toBe(`ENOENT: no such file or directory, rmdir '${missing}'`)
  })
})

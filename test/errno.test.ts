// errno names come from Node's table in lib/errors.ts (the addon reports numbers: glibc's strerrorname_np is not
// portable); they match what glibc names them, shared numbers included.
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { errnoError, errnoName, VmspaceError } from '../lib/errors.js'
import { errorJson } from '../cli/common.js'
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

  test('an error made from a bare errno names EDQUOT and ENOSPC, with the description libc gives (libuv has none for EDQUOT)', () => {
    expect(errnoError(122, 'write', '/q/f')).toMatchObject({ code: 'EDQUOT', errno: -122, syscall: 'write', path: '/q/f' })
    expect(errnoError(122, 'write', '/q/f').message).toBe("EDQUOT: disk quota exceeded, write '/q/f'")
    expect(errnoError(28, 'write', '/q/f')).toMatchObject({ code: 'ENOSPC', errno: -28 })
    expect(errnoError(28, 'write', '/q/f').message).toBe("ENOSPC: no space left on device, write '/q/f'")
    expect(errnoError(117, 'openat').message).toBe('EUCLEAN: structure needs cleaning, openat')
  })

  test("the CLI's --json error fields name a Node error that libuv calls UNKNOWN by its errno (EDQUOT); other codes pass as they are", () => {
    // What Node's fs throws for EDQUOT: libuv has no UV_EDQUOT.
    const quota = Object.assign(new Error("UNKNOWN: unknown error, write"), { code: 'UNKNOWN', errno: -122, syscall: 'write' })
    expect(errorJson(quota)).toEqual({ code: 'EDQUOT', message: 'EDQUOT: unknown error, write' })
    const full = Object.assign(new Error("ENOSPC: no space left on device, write"), { code: 'ENOSPC', errno: -28, syscall: 'write' })
    expect(errorJson(full)).toEqual({ code: 'ENOSPC', message: 'ENOSPC: no space left on device, write' })
    const unnamed = Object.assign(new Error('UNKNOWN: unknown error, read'), { code: 'UNKNOWN', errno: -4095 })
    expect(errorJson(unnamed)).toEqual({ code: 'UNKNOWN', message: 'UNKNOWN: unknown error, read' })
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

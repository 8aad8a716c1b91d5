/**
 * File systems without renameat2(RENAME_NOREPLACE) (FUSE without rename2, some network file
 * systems), played by a seccomp filter that answers EINVAL or ENOSYS to renameat2 with that flag
 * (inject-helpers.ts). Files publish by link + unlink, which never replaces; a directory (a workspace, a tree
 * clone) has no such path and fails with ERR_RENAME_NOREPLACE_UNSUPPORTED, changing nothing.
 */
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import { describe, expect, test } from 'vitest'
import { emptyPoolState, freshDir, ls, mounts, needs, poolState, tempLeftovers, writeRandomFile } from './helpers.js'
import { injectMissing, O_TMPFILE_BIT, RENAME_NOREPLACE, runInjected, type Injection } from './inject-helpers.js'

const noInject = injectMissing()
/** renameat2(2)'s RENAME_EXCHANGE flag. */
const RENAME_EXCHANGE = 2

for (const answer of ['EINVAL', 'ENOSYS'] as const) {
  // glibc's renameat2() turns the kernel's ENOSYS for a call with flags into EINVAL (sysdeps/unix/sysv/linux/
  // renameat2.c), so the errno vmspace sees, and reports as the cause, is EINVAL for both answers.
  const cause = 'EINVAL'
  const noReplace: Injection = {
    syscall: 'renameat2',
    answer,
    arg: { index: 4, mask: RENAME_NOREPLACE, value: RENAME_NOREPLACE },
  }

  describe.skipIf(noInject !== undefined)(
    `renameat2(RENAME_NOREPLACE) answering ${answer} ${needs('cc', noInject)}`,
    () => {
      // .vmspace/ is built under .vmspace.init-<hex> and renamed into place: without RENAME_NOREPLACE by rename(2),
      // which never replaces a non-empty .vmspace/ either.
      test('openPool makes a pool: its .vmspace/ is renamed into place whole, no temp or probe file is left', () => {
        const root = path.join(freshDir(mounts.scratch), 'pool')
        const [r] = runInjected(noReplace, [{ op: 'openPool', root }])
        expect(r).toEqual({ ok: true, result: { opened: true } })
        expect(ls(root)).toEqual(['.vmspace'])
        expect(fs.readFileSync(path.join(root, '.vmspace', 'version'), 'utf8')).toBe('vmspace-pool 1\n')
        expect(ls(path.join(root, '.vmspace'))).toEqual(['cache', 'leases', 'staging', 'trash', 'version'])
        expect(ls(path.join(root, '.vmspace', 'staging'))).toEqual(Array.from({ length: 8 }, (_, i) => `s${i}`))
        expect(ls(path.join(root, '.vmspace', 'leases'))).toEqual([...'0123456789abcdef'])
        expect(poolState(root)).toEqual(emptyPoolState)
      })

      test('clone() of a file publishes it by link + unlink: the bytes, no temp file', () => {
        const d = freshDir(mounts.scratch)
        const data = writeRandomFile(path.join(d, 'base.img'), 1024 * 1024 + 3)
        const [r] = runInjected(noReplace, [{ op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'out.img') }])
        expect(r).toMatchObject({ ok: true, result: { kind: 'file', bytes: data.length } })
        expect(fs.readFileSync(path.join(d, 'out.img')).equals(data)).toBe(true)
        expect(fs.statSync(path.join(d, 'out.img')).nlink).toBe(1)
        expect(tempLeftovers(d)).toEqual([])
      })

      // A file clone is an unnamed file (O_TMPFILE) named by linkat(2), which never replaces: no renameat2 at all.
      test('clone() of a file onto an existing name: EEXIST from linkat, the existing file untouched, no temp file', () => {
        const d = freshDir(mounts.scratch)
        writeRandomFile(path.join(d, 'base.img'), 64 * 1024)
        fs.writeFileSync(path.join(d, 'taken'), 'keep me')
        const before = fs.statSync(path.join(d, 'taken'))
        const [r] = runInjected(noReplace, [{ op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'taken') }])
        expect(r).toMatchObject({ ok: false, code: 'EEXIST', syscall: 'linkat', dest: path.join(d, 'taken') })
        expect(fs.readFileSync(path.join(d, 'taken'), 'utf8')).toBe('keep me')
        expect(fs.statSync(path.join(d, 'taken')).ino).toBe(before.ino)
        expect(ls(d)).toEqual(['base.img', 'taken'])
      })

      test('renameNoReplace() of a file moves it by link + unlink; onto an existing name EEXIST, both untouched', () => {
        const d = freshDir(mounts.scratch)
        fs.writeFileSync(path.join(d, 'a'), 'a')
        fs.writeFileSync(path.join(d, 'taken'), 'keep me')
        const [moved, refused] = runInjected(noReplace, [
          { op: 'renameNoReplace', from: path.join(d, 'a'), to: path.join(d, 'b') },
          { op: 'renameNoReplace', from: path.join(d, 'b'), to: path.join(d, 'taken') },
        ])
        expect(moved).toEqual({ ok: true, result: { renamed: true } })
        expect(refused).toMatchObject({ ok: false, code: 'EEXIST', syscall: 'link', path: path.join(d, 'b') })
        expect(ls(d)).toEqual(['b', 'taken'])
        expect(fs.readFileSync(path.join(d, 'b'), 'utf8')).toBe('a')
        expect(fs.readFileSync(path.join(d, 'taken'), 'utf8')).toBe('keep me')
      })

      test(`renameNoReplace() of a directory fails with renameat2's ${cause} and moves nothing`, () => {
        const d = freshDir(mounts.scratch)
        fs.mkdirSync(path.join(d, 'dir'))
        const [r] = runInjected(noReplace, [{ op: 'renameNoReplace', from: path.join(d, 'dir'), to: path.join(d, 'moved') }])
        expect(r).toMatchObject({ ok: false, code: cause, syscall: 'renameat2' })
        expect(ls(d)).toEqual(['dir'])
      })

      test('clone() with overwrite: true replaces by rename(2), as it does everywhere', () => {
        const d = freshDir(mounts.scratch)
        const data = writeRandomFile(path.join(d, 'base.img'), 4096)
        fs.writeFileSync(path.join(d, 'taken'), 'old')
        const [r] = runInjected(noReplace, [
          { op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'taken'), options: { overwrite: true } },
        ])
        expect(r.ok).toBe(true)
        expect(fs.readFileSync(path.join(d, 'taken')).equals(data)).toBe(true)
        expect(ls(d)).toEqual(['base.img', 'taken'])
      })

      test(`clone() of a tree: ERR_RENAME_NOREPLACE_UNSUPPORTED (cause ${cause}); no destination, no temp tree`, () => {
        const d = freshDir(mounts.scratch)
        fs.mkdirSync(path.join(d, 'src', 'sub'), { recursive: true })
        fs.writeFileSync(path.join(d, 'src', 'sub', 'f'), 'f')
        const [r] = runInjected(noReplace, [{ op: 'clone', source: path.join(d, 'src'), dest: path.join(d, 'dst') }])
        expect(r).toMatchObject({
          ok: false,
          code: 'ERR_RENAME_NOREPLACE_UNSUPPORTED',
          causeCode: cause,
          syscall: 'renameat2',
          dest: path.join(d, 'dst'),
        })
        expect(ls(d)).toEqual(['src'])
      })

      test(`allocate(): ERR_RENAME_NOREPLACE_UNSUPPORTED (cause ${cause}) before anything is made`, () => {
        const d = freshDir(mounts.scratch)
        writeRandomFile(path.join(d, 'base.img'), 4096)
        const root = path.join(d, 'pool')
        const [r] = runInjected(noReplace, [{ op: 'allocate', root, template: { 'rootfs.img': path.join(d, 'base.img') } }])
        expect(r).toMatchObject({ ok: false, code: 'ERR_RENAME_NOREPLACE_UNSUPPORTED', causeCode: cause, path: root })
        expect(poolState(root)).toEqual(emptyPoolState)
      })
    },
  )
}

describe.skipIf(noInject !== undefined)(`a pool opened where RENAME_NOREPLACE works ${needs('cc', noInject)}`, () => {
  test('allocates as before, and the open leaves no probe file behind', () => {
    const d = freshDir(mounts.scratch)
    const data = writeRandomFile(path.join(d, 'base.img'), 4096)
    const root = path.join(d, 'pool')
    // An answer for calls allocate never makes (renameat2 with RENAME_EXCHANGE): the filter is there, renameat2
    // with RENAME_NOREPLACE passes it untouched. (Not linkat: an allocate links its lease file with it.)
    const [r] = runInjected(
      { syscall: 'renameat2', answer: 'EPERM', arg: { index: 4, mask: RENAME_EXCHANGE, value: RENAME_EXCHANGE } },
      [{ op: 'allocate', root, template: { 'rootfs.img': path.join(d, 'base.img') } }],
    )
    expect(r).toMatchObject({ ok: true, result: { files: { 'rootfs.img': createHash('sha256').update(data).digest('hex') } } })
    expect(ls(root)).toEqual(['.vmspace'])
    expect(ls(path.join(root, '.vmspace'))).toEqual(['cache', 'leases', 'staging', 'trash', 'version'])
    expect(poolState(root)).toEqual(emptyPoolState)
  })
})

// A lease file is made unnamed (O_TMPFILE), locked, given its record and linked under its name; where the file system
// refuses O_TMPFILE, or the link (EPERM: no hard links; ENOENT: no /proc and no CAP_DAC_READ_SEARCH), it is made under
// a hidden .tmp-<hex>-<name> and renamed into place (RENAME_NOREPLACE).
describe.skipIf(noInject !== undefined)(`lease files where O_TMPFILE or linkat is refused ${needs('cc', noInject)}`, () => {
  const refusals: [string, Injection][] = [
    ['open(O_TMPFILE) answering EOPNOTSUPP', { syscall: 'openat', answer: 'EOPNOTSUPP', arg: { index: 2, mask: O_TMPFILE_BIT, value: O_TMPFILE_BIT } }],
    ['open(O_TMPFILE) answering EISDIR', { syscall: 'openat', answer: 'EISDIR', arg: { index: 2, mask: O_TMPFILE_BIT, value: O_TMPFILE_BIT } }],
    ['linkat answering EPERM', { syscall: 'linkat', answer: 'EPERM' }],
    ['linkat answering ENOENT', { syscall: 'linkat', answer: 'ENOENT' }],
  ]
  for (const [what, injection] of refusals) {
    test(`${what}: allocate (empty, and from a template) leases through a named temp file; disposed, nothing is left`, () => {
      const d = freshDir(mounts.scratch)
      const data = writeRandomFile(path.join(d, 'base.img'), 4096)
      const root = path.join(d, 'pool')
      const [empty, templated] = runInjected(
        injection,
        [
          { op: 'allocate', root },
          { op: 'allocate', root, template: { 'rootfs.img': path.join(d, 'base.img') } },
        ],
      )
      expect(empty).toMatchObject({ ok: true, result: { template: [], files: {} } })
      expect(templated).toMatchObject({ ok: true, result: { files: { 'rootfs.img': createHash('sha256').update(data).digest('hex') } } })
      expect(poolState(root)).toEqual(emptyPoolState)
      // No temp lease file, and no spare (the pool was closed): every lease shard is empty.
      const leases = path.join(root, '.vmspace', 'leases')
      expect(ls(leases).flatMap((shard) => ls(path.join(leases, shard)))).toEqual([])
    })
  }
})

// A file clone without overwrite is an unnamed file (O_TMPFILE) named by linkat(2). Where the file system refuses
// O_TMPFILE (EOPNOTSUPP; EISDIR from kernels before 3.11) or the link (EPERM: no hard links; ENOENT: no /proc and
// no CAP_DAC_READ_SEARCH), it is a named temp file published by renameat2(RENAME_NOREPLACE), as before.
describe.skipIf(noInject !== undefined)(`unnamed clone files refused ${needs('cc', noInject)}`, () => {
  const refusals: Array<[string, Injection]> = [
    ['open(O_TMPFILE) answering EOPNOTSUPP', { syscall: 'openat', answer: 'EOPNOTSUPP', arg: { index: 2, mask: O_TMPFILE_BIT, value: O_TMPFILE_BIT } }],
    ['open(O_TMPFILE) answering EISDIR', { syscall: 'openat', answer: 'EISDIR', arg: { index: 2, mask: O_TMPFILE_BIT, value: O_TMPFILE_BIT } }],
    ['linkat answering EPERM', { syscall: 'linkat', answer: 'EPERM' }],
    ['linkat answering ENOENT', { syscall: 'linkat', answer: 'ENOENT' }],
  ]
  for (const [what, injection] of refusals) {
    test(`${what}: clone() publishes through a named temp file: the bytes and mode, EEXIST from renameat2, no temp file`, () => {
      const d = freshDir(mounts.scratch)
      const data = writeRandomFile(path.join(d, 'base.img'), 256 * 1024 + 5)
      fs.chmodSync(path.join(d, 'base.img'), 0o640)
      fs.writeFileSync(path.join(d, 'taken'), 'keep me')
      const [first, second, refused] = runInjected(injection, [
        { op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'one.img') },
        { op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'two.img') },
        { op: 'clone', source: path.join(d, 'base.img'), dest: path.join(d, 'taken') },
      ])
      expect(first).toMatchObject({ ok: true, result: { kind: 'file', bytes: data.length } })
      expect(second).toMatchObject({ ok: true, result: { kind: 'file', bytes: data.length } })
      expect(refused).toMatchObject({ ok: false, code: 'EEXIST', syscall: 'renameat2', dest: path.join(d, 'taken') })
      for (const f of ['one.img', 'two.img']) {
        expect(fs.readFileSync(path.join(d, f)).equals(data)).toBe(true)
        expect(fs.statSync(path.join(d, f)).mode & 0o7777).toBe(0o640)
      }
      expect(fs.readFileSync(path.join(d, 'taken'), 'utf8')).toBe('keep me')
      expect(ls(d)).toEqual(['base.img', 'one.img', 'taken', 'two.img'])
      expect(tempLeftovers(d)).toEqual([])
    })
  }
})

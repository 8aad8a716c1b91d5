/**
 * A cold review of importImage: hostile images (layers, indexes, archives) and careless callers. Each test states
 * the behaviour that must hold; a canary outside the pool keeps its hash throughout.
 */
import { spawnSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import * as fs from 'node:fs'
import * as path from 'node:path'
import * as zlib from 'node:zlib'
import { afterAll, describe, expect, test } from 'vitest'
import { openPool, type VmspaceError } from '../lib/index.js'
import { freshDir, mounts, needs, stagingEntries } from './helpers.js'
import { hostArchitecture, makeTar, MEDIA, ociToolsMissing, rawLayerImage, setIndexRef, tarEntry, writeBlob, type Descriptor } from './oci-helpers.js'

const missing = ociToolsMissing()

function errorOf(p: Promise<unknown>): Promise<VmspaceError> {
  return p.then(
    () => {
      throw new Error('expected a rejection')
    },
    (e: VmspaceError) => e,
  )
}

const canaryDir = fs.mkdtempSync(path.join(mounts.scratch, 'vmspace-canary-'))
const canary = path.join(canaryDir, 'passwd')
fs.writeFileSync(canary, 'root:x:0:0:canary\n')
const hash = () => createHash('sha256').update(fs.readFileSync(canary)).digest('hex')
const canaryBefore = hash()

afterAll(() => {
  expect(hash()).toBe(canaryBefore)
  expect(fs.readdirSync(canaryDir)).toEqual(['passwd'])
})

function nothingStaged(root: string) {
  const t = path.join(root, '.vmspace', 'templates')
  expect(stagingEntries(root)).toEqual([])
  expect(fs.existsSync(path.join(t, 'staging')) ? fs.readdirSync(path.join(t, 'staging')) : []).toEqual([])
}

describe.skipIf(!!missing)(`review: hostile images ${needs('umoci, skopeo, root', missing)}`, () => {
  test('an index whose entries fan out to one nested index is read once per document: no hang', async () => {
    const dir = freshDir(mounts.scratch, 'fan')
    // A manifest for a platform the host is not: every candidate is read, none fits.
    const raw = rawLayerImage(dir, [makeTar([{ name: 'f', data: 'x' }])], { platform: { os: 'linux', architecture: 'nosuch' } })
    let inner: Descriptor = { ...raw.manifest, platform: undefined }
    delete inner.platform
    for (let level = 0; level < 4; level++) {
      const doc = { schemaVersion: 2, mediaType: MEDIA.index, manifests: Array.from({ length: 60 }, () => inner) }
      inner = writeBlob(dir, MEDIA.index, JSON.stringify(doc))
    }
    fs.writeFileSync(path.join(dir, 'index.json'), JSON.stringify({ schemaVersion: 2, manifests: [] }))
    setIndexRef(dir, 'fan', inner)
    const pool = await openPool(freshDir())
    const e = await errorOf(pool.importImage(`oci:${dir}:fan`))
    expect(e.code).toBe('ERR_OCI_PLATFORM')
    nothingStaged(pool.root)
    await pool.close()
  }, 60_000)

  test('an oci-archive whose PAX size is negative is ERR_OCI_INVALID naming the PAX size', async () => {
    const dir = freshDir(mounts.scratch, 'pax')
    // -1536 takes the reader back to the PAX header itself: a loop until the member count runs out.
    const tar = Buffer.concat([tarEntry({ name: 'oci-layout', data: '', pax: { size: '-1536' } }), Buffer.alloc(1024)])
    const file = path.join(dir, 'a.tar')
    fs.writeFileSync(file, tar)
    const pool = await openPool(freshDir())
    const e = await errorOf(pool.importImage(`oci-archive:${file}`, { name: 'x' }))
    expect(e.code).toBe('ERR_OCI_INVALID')
    expect(e.message).toMatch(/PAX size/)
    await pool.close()
  }, 60_000)
})

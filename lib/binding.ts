/** The native addon (native/binding.cc), loaded once per thread; its functions take checked arguments only. */
import * as path from 'node:path'

/** reflink option as the binding takes it. */
export const enum ReflinkCode {
  Always = 0,
  Auto = 1,
  Never = 2,
}

export interface NativeCloneResult {
  method: 'reflink' | 'copy'
  bytes: number
}

export interface NativeListEntry {
  name: string
  live: boolean
  metaText?: string
  metaError?: unknown
}

export interface NativeAllocateResult {
  id: string
  name: string
  leaseFd: number
  retries: number
  clones: (NativeCloneResult & { dest: string })[]
}

export type PoolHandle = { readonly __brand: 'PoolHandle' }

export interface Native {
  openPool(root: string, create: boolean): Promise<{ handle: PoolHandle; bootId: string }>
  closePool(handle: PoolHandle): Promise<void>
  allocate(
    handle: PoolHandle,
    prefix: string,
    mode: number,
    entries: [dest: string, source: string][],
    infoJson: string,
    reflink: ReflinkCode,
    overwrite: boolean,
    durable: boolean,
  ): Promise<NativeAllocateResult>
  dispose(handle: PoolHandle, name: string, leaseFd: number): Promise<void>
  list(handle: PoolHandle): Promise<NativeListEntry[]>
  cloneFile(src: string, dst: string, reflink: ReflinkCode, overwrite: boolean, durable: boolean): Promise<NativeCloneResult>
  cloneBeneath(
    baseFd: number,
    basePath: string,
    src: string,
    rel: string,
    reflink: ReflinkCode,
    overwrite: boolean,
    durable: boolean,
  ): Promise<NativeCloneResult>
  removeTree(path: string): Promise<void>
  renameNoReplace(from: string, to: string): Promise<void>
  exchange(a: string, b: string): Promise<void>
  setTestIds(ids: string[]): void
}

// lib/ and dist/ are both one level below the package root, where binding.gyp and build/ live.
// node-gyp-build picks build/Release (or a prebuild) for this platform and Node-API version.
export const native: Native = (require('node-gyp-build') as (dir: string) => Native)(path.join(__dirname, '..'))

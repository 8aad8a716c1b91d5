/**
 * The native test seams (setTestIds, setSweepFaultsForTest), present in test builds only. Import this first in a
 * test file that uses them: it makes the whole process load the test build (test/hooks-env.ts), since a seam is
 * process-wide state of the addon that the code under test must share. Throws (the file fails, never skips) when
 * the loaded addon has no seams.
 */
import './hooks-env.js'
import { native, type Native, type NativeTestHooks } from '../lib/binding.js'

const loaded = native as Native & Partial<NativeTestHooks>
if (typeof loaded.setTestIds !== 'function' || typeof loaded.setSweepFaultsForTest !== 'function')
  throw new Error(`the addon loaded (VMSPACE_PREBUILD=${process.env.VMSPACE_PREBUILD}) has no test hooks: build it with -DVMSPACE_TEST_HOOKS`)

export const testHooks: NativeTestHooks = loaded as NativeTestHooks

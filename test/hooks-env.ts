/**
 * Points this test process (and the children it spawns) at the test build of the addon, the one with the native
 * test seams (VMSPACE_TEST_HOOKS): build-cmake, which `npm test` builds first (`npm run build:test-addon`). The
 * release addon (build/Release, the prebuilds) has no seams. Imported by test/native-hooks.ts before anything
 * loads lib/binding; an existing VMSPACE_PREBUILD (the sanitizer run: build-asan) is kept.
 */
import * as fs from 'node:fs'
import * as path from 'node:path'

if (!process.env.VMSPACE_PREBUILD) {
  const cmakeDir = path.resolve(__dirname, '..', 'build-cmake')
  if (!fs.existsSync(path.join(cmakeDir, 'Release', 'vmspace.node')))
    throw new Error(`the test build of the addon is missing (${cmakeDir}/Release/vmspace.node): run \`npm run build:test-addon\``)
  // node-gyp-build loads <VMSPACE_PREBUILD>/build/Release/*.node (as the sanitizer run in .ci/run does).
  const addonDir = path.join(cmakeDir, 'addon')
  fs.mkdirSync(path.join(addonDir, 'build'), { recursive: true })
  const link = path.join(addonDir, 'build', 'Release')
  if (!fs.existsSync(link)) fs.symlinkSync('../../Release', link)
  process.env.VMSPACE_PREBUILD = addonDir
}

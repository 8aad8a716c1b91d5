import { defineConfig } from 'vitest/config'

export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    // Makes (as root) loop-mounted XFS/btrfs/small ext4 file systems and an ext4 scratch dir; see the file.
    globalSetup: ['test/setup/global-setup.ts'],
    // Test files run in separate processes: the native test seam (setTestIds) is process-wide.
    pool: 'forks',
    // Generous limits only against hangs (a loaded 2-core machine has taken over 60 s for the heaviest race tests);
    // no test asserts on timing.
    testTimeout: 300_000,
    hookTimeout: 300_000,
    teardownTimeout: 60_000,
  },
})

import { defineConfig } from 'vitest/config'

export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    // Makes (as root) loop-mounted XFS/btrfs/small ext4 file systems and an ext4 scratch dir; see the file.
    globalSetup: ['test/setup/global-setup.ts'],
    // Test files run in separate processes: the native test seam (setTestIds) is process-wide.
    pool: 'forks',
    // Two files at a time, each on file systems of its own (test/setup/global-setup.ts): most of a file's time is
    // spent waiting on child processes, the kernel and the disk, so two overlap well on two CPUs.
    maxWorkers: 2,
    // Generous limits only against hangs (a loaded 2-core machine has taken over 60 s for the heaviest race tests);
    // no test asserts on timing.
    testTimeout: 300_000,
    hookTimeout: 300_000,
    teardownTimeout: 60_000,
  },
})

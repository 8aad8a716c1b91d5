// ESLint (flat config) for the TypeScript of lib/, cli/, demo/, shared/ and test/ (and the test fixtures' CommonJS):
// `npx eslint` (checked in .ci/run). Correctness rules only: formatting is left to a formatter, so no stylistic
// rule is on here.
import js from '@eslint/js'
import globals from 'globals'
import tseslint from 'typescript-eslint'

export default tseslint.config(
  { ignores: ['dist/**', 'build*/**', 'prebuilds/**', 'node_modules/**', 'bench/**', 'scripts/**', 'docs/api/**'] },
  js.configs.recommended,
  // typescript-eslint's recommended set: unsafe declarations, unused names, `any` leaks, namespace misuse.
  ...tseslint.configs.recommended,
  {
    files: ['**/*.ts', '**/*.mts', '**/*.cts'],
    languageOptions: {
      // Type information for the promise rules below; test/tsconfig.json takes in every file linted here.
      parserOptions: { project: ['./test/tsconfig.json'], tsconfigRootDir: import.meta.dirname },
    },
    rules: {
      // TypeScript itself reports undefined names (and knows Node's globals from @types/node); ESLint's
      // no-undef does not know types and only repeats it wrongly (typescript-eslint's advice).
      'no-undef': 'off',
      // Every async call settles visibly: a promise nobody awaits or catches loses its rejection.
      '@typescript-eslint/no-floating-promises': 'error',
      // An async function where a void callback is expected (event handlers, forEach) drops its rejection.
      '@typescript-eslint/no-misused-promises': 'error',
      // `_`-prefixed names are deliberately unused (a key omitted by destructuring, a callback's parameter).
      '@typescript-eslint/no-unused-vars': [
        'error',
        { argsIgnorePattern: '^_', varsIgnorePattern: '^_', caughtErrors: 'none' },
      ],
      // The addon is loaded at run time by node-gyp-build (lib/binding.ts), package.json is read at run time
      // outside rootDir (the CLI's --version), and `import x = require()` is how a CommonJS consumer imports
      // (test/fixtures/types/consumer.cts); any other require should be an import.
      '@typescript-eslint/no-require-imports': [
        'error',
        { allow: ['^node-gyp-build$', '/package\\.json$'], allowAsImport: true },
      ],
    },
  },
  {
    // Tests read the CLI's --json output and the fixtures' messages as untyped JSON.
    files: ['test/**'],
    rules: { '@typescript-eslint/no-explicit-any': 'off' },
  },
  {
    // The child processes the tests fork are plain CommonJS for Node.
    files: ['**/*.cjs'],
    languageOptions: { sourceType: 'commonjs', globals: globals.node },
    rules: { '@typescript-eslint/no-require-imports': 'off' },
  },
)

// The ES module entry: re-exports the CommonJS build, so `import` and `require` share one module instance
// (one addon load, one set of classes for instanceof).
export * from './index.js'

// The job in a worker thread (the addon loads once per thread). Usage: node worker.cjs
'use strict'
const { Worker, isMainThread, parentPort } = require('node:worker_threads')

if (isMainThread) {
  const w = new Worker(__filename)
  w.on('message', (binary) => console.log(`ok worker ${binary}`))
  w.on('error', (e) => {
    console.error(e)
    process.exit(1)
  })
  w.on('exit', (code) => {
    if (code !== 0) process.exit(code || 1)
  })
} else {
  require('./consumer.cjs')
    .job(require('vmspace'), 'worker')
    .then((binary) => parentPort.postMessage(binary))
}

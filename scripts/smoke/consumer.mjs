// The job through `import` (the package's ESM entry). Usage: node consumer.mjs
import * as vmspace from 'vmspace'
import { createRequire } from 'node:module'

const { job } = createRequire(import.meta.url)('./consumer.cjs')
console.log(`ok import ${await job(vmspace, 'import')}`)

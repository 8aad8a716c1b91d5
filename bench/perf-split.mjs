#!/usr/bin/env node
// Where a profile's CPU goes, per allocate+dispose pair: reads `perf script` of a `perf record -g -F FREQ` run
// (bench/throughput.mjs --profile, or bench/syscalls.cc with THREADS) on stdin and attributes each sample to the
// system call it is in (its outermost __x64_sys_/__do_sys_ frame), else to the kernel (scheduling, interrupts:
// "kernel, no syscall"), else to where user space was (node and V8, the JIT's code, libc/libstdc++, vmspace.node).
//   perf record -F 2999 -g -o p.data -- node --perf-basic-prof bench/throughput.mjs --dir DIR --profile vmspace
//   perf script -i p.data | node bench/perf-split.mjs --freq 2999 --pairs N   (N: the pairs the run printed)
import * as readline from 'node:readline'
import { parseArgs } from 'node:util'

const { values: args } = parseArgs({ options: { freq: { type: 'string' }, pairs: { type: 'string' } } })
const freq = Number(args.freq)
const pairs = Number(args.pairs)
if (!(freq > 0 && pairs > 0)) throw new Error('--freq (perf record -F) and --pairs (pairs done) are required')

function category(frames) {
  let syscall
  for (const f of frames) {
    const m = /(?:__x64_sys_|__do_sys_)(\w+)/.exec(f)
    if (m) syscall = m[1] // the outermost one: frames run from the leaf out
  }
  if (syscall) return `syscall ${syscall}`
  const leaf = frames[0] ?? ''
  if (leaf.includes('[kernel')) return 'kernel, no syscall'
  if (leaf.includes('vmspace.node')) return 'user: vmspace.node'
  if (/libc\.so|libstdc\+\+/.test(leaf)) return 'user: libc, libstdc++'
  if (/perf-\d+\.map|\[JIT\]/.test(leaf)) return 'user: JIT (JS)'
  if (/\/node\)|\(.*\/node\b/.test(leaf)) return 'user: node, V8'
  return 'user: other'
}

const counts = new Map()
let total = 0
let frames = null
const flush = () => {
  if (frames === null) return
  const c = category(frames)
  counts.set(c, (counts.get(c) ?? 0) + 1)
  total++
  frames = null
}
for await (const line of readline.createInterface({ input: process.stdin })) {
  if (!line.trim()) flush()
  else if (!/^\s/.test(line)) {
    flush()
    frames = []
  } else frames?.push(line.trim())
}
flush()
const usPerSample = 1e6 / freq / pairs
console.log(`${total} samples, ${(total * usPerSample).toFixed(1)} µs of CPU per pair`)
for (const [c, n] of [...counts].sort((a, b) => b[1] - a[1]))
  console.log(`${(n * usPerSample).toFixed(2).padStart(8)} µs  ${((100 * n) / total).toFixed(1).padStart(5)} %  ${c}`)

#!/usr/bin/env node
// The longest functions of the TypeScript in the given directories (default lib/ cli/ demo/), in lines from the
// first to the last line of the declaration: `node scripts/function-sizes.mjs [dir...] [--top N]`. For the C++,
// clang-tidy measures the same (issue 11):
//   clang-tidy -p build-cmake --checks='-*,readability-function-size' \
//     --config='{CheckOptions: {readability-function-size.LineThreshold: 60}}' native/binding/*.cc native/core/*.cc
import fs from 'node:fs'
import path from 'node:path'
import ts from 'typescript'

const args = process.argv.slice(2)
const topAt = args.indexOf('--top')
const top = topAt >= 0 ? Number(args.splice(topAt, 2)[1]) : 15
const dirs = args.length ? args : ['lib', 'cli', 'demo']
const sizes = []
for (const dir of dirs) {
  for (const name of fs.readdirSync(dir, { recursive: true })) {
    const file = path.join(dir, String(name))
    if (!/\.m?ts$/.test(file) || file.endsWith('.d.ts')) continue
    const src = ts.createSourceFile(file, fs.readFileSync(file, 'utf8'), ts.ScriptTarget.Latest, true)
    const visit = (node, owner) => {
      if (ts.isFunctionLike(node) && 'body' in node && node.body) {
        const first = src.getLineAndCharacterOfPosition(node.getStart(src)).line
        const last = src.getLineAndCharacterOfPosition(node.getEnd()).line
        const named = node.name?.getText(src) ?? (owner ? `${owner} (arrow)` : '(anonymous)')
        sizes.push({ lines: last - first + 1, where: `${file}:${first + 1}`, name: named })
      }
      const nextOwner = ts.isVariableDeclaration(node) || ts.isPropertyAssignment(node) ? node.name.getText(src) : owner
      ts.forEachChild(node, (child) => visit(child, nextOwner))
    }
    visit(src, undefined)
  }
}
sizes.sort((a, b) => b.lines - a.lines)
for (const s of sizes.slice(0, top)) console.log(`${String(s.lines).padStart(5)}  ${s.name}  ${s.where}`)

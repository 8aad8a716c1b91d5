#!/usr/bin/env node
// The longest functions of the TypeScript and C++ in the given directories (default lib/ cli/ demo/), in lines
// from the first to the last line of the declaration: `node scripts/function-sizes.mjs [dir...] [--top N]`, e.g.
// `node scripts/function-sizes.mjs native/core --top 10`. The C++ is measured by braces (cxxSizes below: a
// function's body is a `{` after `)` in namespace or class scope; lambdas count in the function that holds them);
// clang-tidy measures the same, slower, with the compile commands:
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

// C++ by braces, comments and literals skipped: a `{` whose header (the text since the last `;`, `{` or `}`)
// holds a `(` and is no control statement opens a function when it stands in namespace, class or file scope.
function cxxSizes(file, text) {
  const code = text.replace(/\/\/[^\n]*|\/\*[\s\S]*?\*\/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'/g,
    (m) => m.replace(/[^\n]/g, ' ')).replace(/^[ \t]*#.*$/gm, '')  // and preprocessor lines
  const scopes = []  // per open brace: 'fn' | 'other' | 'scope'
  let header = '', line = 1, fnStart = 0, fnName = ''
  for (const ch of code) {
    if (ch === '\n') line++
    if (ch === '{') {
      const inFn = scopes.includes('fn')
      const h = header.replace(/\s+/g, ' ').trim()
      const isFn = !inFn && /\)[^()]*$|\)\s*:[\s\S]*$/.test(h) && h.includes('(') &&
        !/^(if|for|while|switch|catch|do|else)\b/.test(h) && !/^(namespace|class|struct|enum|union)\b/.test(h) &&
        !/=\s*$/.test(h)
      if (isFn) {
        const head = h.slice(0, h.indexOf('('))
        fnName = (head.match(/[~\w:]+(?:operator\S*)?\s*$/) || ['?'])[0].trim()
        fnStart = line - (header.match(/\n/g) || []).length + (header.match(/^\s*\n*/)[0].match(/\n/g) || []).length
        scopes.push('fn')
      } else {
        scopes.push(inFn ? 'other' : 'scope')
      }
      header = ''
    } else if (ch === '}') {
      const kind = scopes.pop()
      if (kind === 'fn') sizes.push({ lines: line - fnStart + 1, where: `${file}:${fnStart}`, name: fnName })
      header = ''
    } else if (ch === ';') {
      header = ''
    } else {
      header += ch
    }
  }
}
for (const dir of dirs) {
  for (const name of fs.readdirSync(dir, { recursive: true })) {
    const file = path.join(dir, String(name))
    if (/\.(cc|cpp|h|hpp)$/.test(file)) {
      cxxSizes(file, fs.readFileSync(file, 'utf8'))
      continue
    }
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

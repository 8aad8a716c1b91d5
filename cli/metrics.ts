/**
 * `vmspace metrics ROOT [--output FILE | --listen HOST:PORT]`: the pool's gauges (poolGauges(): workspaces by
 * state, quota'd workspaces, file system space; no tree is walked) in the Prometheus text format. On stdout; into
 * FILE atomically, for node_exporter's textfile collector (which may read the file at any moment); or served at
 * `/metrics` until SIGINT/SIGTERM. Counters of calls live in the process that makes them (the sidecar:
 * registerPrometheus()), not here.
 */
import * as fs from 'node:fs'
import * as http from 'node:http'
import * as net from 'node:net'
import * as path from 'node:path'
import { metricsText, openPool, poolGauges, type Pool } from 'vmspace'
import { EXIT_OK, errorText, poolRoot, UsageError } from './common.js'

/** The content type of the text exposition format, version 0.0.4. */
const CONTENT_TYPE = 'text/plain; version=0.0.4; charset=utf-8'

/** `HOST:PORT`, `[v6]:PORT` or `PORT` (host 127.0.0.1): a scrape port is never opened to every interface by default. */
export function listenAddress(value: string): { host: string; port: number } {
  const m = /^(?:\[([0-9A-Fa-f:.]+)\]:|([^:[\]]+):)?(\d{1,5})$/.exec(value.trim())
  const port = m ? Number(m[3]) : NaN
  if (!m || port > 65535) throw new UsageError(`--listen must be HOST:PORT or PORT (port 0-65535), got ${JSON.stringify(value)}`)
  return { host: m[1] ?? m[2] ?? '127.0.0.1', port }
}

/**
 * The text written to a temp file in FILE's directory and renamed over FILE, so that a reader sees the old file or
 * the new one, never a part; the temp file is removed on every failure.
 */
function writeAtomically(file: string, text: string): void {
  const dir = path.dirname(file)
  const tmp = path.join(dir, `.${path.basename(file)}.${process.pid}.${Date.now()}.tmp`)
  let fd: number
  try {
    fd = fs.openSync(tmp, fs.constants.O_WRONLY | fs.constants.O_CREAT | fs.constants.O_EXCL, 0o644) // libuv adds O_CLOEXEC
  } catch (e) {
    throw new UsageError(`--output ${file}: ${errorText(e)}`)
  }
  try {
    try {
      fs.writeFileSync(fd, text)
      fs.fsyncSync(fd)
    } finally {
      fs.closeSync(fd)
    }
    fs.renameSync(tmp, file)
  } catch (e) {
    fs.rmSync(tmp, { force: true })
    throw new UsageError(`--output ${file}: ${errorText(e)}`)
  }
}

/** Checks --output before the pool is read: an existing directory to write in, FILE not a directory. */
function outputPath(arg: string): string {
  const file = path.resolve(arg)
  let st: fs.Stats | undefined
  try {
    st = fs.statSync(path.dirname(file))
  } catch (e) {
    throw new UsageError(`--output ${file}: ${errorText(e)}`)
  }
  if (!st.isDirectory()) throw new UsageError(`--output ${file}: ${path.dirname(file)} is not a directory`)
  if (fs.statSync(file, { throwIfNoEntry: false })?.isDirectory()) throw new UsageError(`--output ${file} is a directory`)
  return file
}

/** Listens, or rejects with a usage error (EADDRINUSE, EACCES, EADDRNOTAVAIL) before anything is served. */
function listen(server: http.Server, host: string, port: number): Promise<net.AddressInfo> {
  return new Promise((resolve, reject) => {
    const onError = (e: Error) => reject(new UsageError(`--listen ${host}:${port}: ${errorText(e)}`))
    server.once('error', onError)
    server.listen({ host, port }, () => {
      server.off('error', onError)
      resolve(server.address() as net.AddressInfo)
    })
  })
}

async function serve(pool: Pool, address: { host: string; port: number }): Promise<number> {
  const server = http.createServer((req, res) => {
    const url = new URL(req.url ?? '/', 'http://x')
    if (url.pathname !== '/metrics') {
      res.writeHead(404, { 'content-type': 'text/plain' }).end('vmspace metrics: only GET /metrics\n')
      return
    }
    // RFC 9110 15.5.6: a known resource and a method it does not support is 405, with the methods it does in Allow.
    if (req.method !== 'GET' && req.method !== 'HEAD') {
      res.writeHead(405, { 'content-type': 'text/plain', allow: 'GET, HEAD' }).end('vmspace metrics: only GET /metrics\n')
      return
    }
    poolGauges(pool).then((g) => metricsText({ gauges: [g] })).then(
      (text) => res.writeHead(200, { 'content-type': CONTENT_TYPE }).end(req.method === 'HEAD' ? undefined : text),
      (e: unknown) => res.writeHead(500, { 'content-type': 'text/plain' }).end(`${errorText(e)}\n`),
    )
  })
  const bound = await listen(server, address.host, address.port)
  const shown = bound.family === 'IPv6' ? `[${bound.address}]` : bound.address
  // The one line a supervisor (or a test) reads for the port when PORT was 0.
  process.stdout.write(`vmspace metrics: serving http://${shown}:${bound.port}/metrics for ${pool.root}\n`)
  await new Promise<void>((resolve) => {
    const stop = () => {
      process.off('SIGINT', stop)
      process.off('SIGTERM', stop)
      server.close(() => resolve())
      server.closeAllConnections()
    }
    process.on('SIGINT', stop)
    process.on('SIGTERM', stop)
  })
  return EXIT_OK
}

export async function metrics(rootArg: string, opts: { output?: string; listen?: string }): Promise<number> {
  const root = poolRoot(rootArg)
  if (opts.output !== undefined && opts.listen !== undefined) throw new UsageError('--output and --listen exclude each other')
  const file = opts.output === undefined ? undefined : outputPath(opts.output)
  const address = opts.listen === undefined ? undefined : listenAddress(opts.listen)
  const pool = await openPool(root, { create: false })
  try {
    if (address) return await serve(pool, address)
    const text = await metricsText({ gauges: [await poolGauges(pool)] })
    if (file) writeAtomically(file, text)
    else process.stdout.write(text)
    return EXIT_OK
  } finally {
    await pool.close()
  }
}

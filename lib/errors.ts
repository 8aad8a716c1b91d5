/**
 * Errors. Every failure of a file-system operation is a {@link VmspaceError} with the shape of Node's own fs
 * errors (`code`, negative `errno`, `syscall`, `path`, `dest`); vmspace's own conditions carry a stable `ERR_…`
 * code and the errno behind them as `cause`. Bad arguments are `TypeError`/`RangeError` with Node's codes
 * `ERR_INVALID_ARG_TYPE`/`ERR_INVALID_ARG_VALUE`, thrown before any system call.
 */
import * as os from 'node:os'
import * as util from 'node:util'

/** Codes of vmspace's own conditions (system errors use the errno name: `'EEXIST'`, `'ENOSPC'`, …). */
export type VmspaceErrorCode =
  | 'ERR_REFLINK_UNSUPPORTED' // reflink: 'always' and the file systems cannot share extents (cause: the errno)
  | 'ERR_RENAME_NOREPLACE_UNSUPPORTED' // the file system refuses renameat2(RENAME_NOREPLACE), which publishing a directory needs (cause: EINVAL/ENOSYS)
  | 'ERR_NAME_EXHAUSTED' // 16 workspace names drawn in a row existed already
  | 'ERR_DISPOSED' // the workspace was disposed (or its dispose failed)
  | 'ERR_POOL_CLOSED' // the pool was closed
  | 'ERR_POOL_FORMAT' // .vmspace/ is not this layout (another version, or its version file or a directory of its own missing)
  | 'ERR_POOL_NOT_EMPTY' // openPool would make a pool in a directory holding other entries (see PoolOptions.nonEmpty)
  | 'ERR_POOL_UNSAFE' // another user could write a directory of the pool or above it (see `uid`, `gid`, `mode`)
  | 'ERR_POOL_NESTED' // openPool inside another pool; a workspace's removal met a pool's root (left whole)
  | 'ERR_INTERNAL' // an unexpected C++ exception: in the sweep entry it met, or the call's error
  | 'ERR_CORRUPT_METADATA' // a workspace's record does not parse (reported per entry by list())
  | 'ERR_LEASE_HELD' // another process holds the workspace's lease (adopt; dispose after a hand-over)
  | 'ERR_LEASE_NOT_HANDED_OVER' // release() while no other process holds the lease (never handed over, or dropped); the lease is kept
  | 'ERR_LOCK_HELD' // lockFile with wait: false, and the lock is held
  | 'ERR_LOCK_TIMEOUT' // lockFile's timeoutMs passed before the lock was granted
  | 'ERR_LOCK_REENTRANT' // lockFile/updateJsonFile inside a critical section of a lock it would wait for: it would wait on itself (cause: EDEADLK); nothing done
  | 'ERR_TEMPLATE_NOT_FOUND' // allocate({ from }), template(), removeTemplate(): no template of that id or name
  | 'ERR_QUOTA_UNSUPPORTED' // allocate({ quota }) where the kernel cannot enforce it (cause: the errno; see probeQuota); nothing made
  | 'ERR_PROJECT_IDS_EXHAUSTED' // no free project id in 64 draws from the pool's projectIds range; nothing made
  | 'ERR_CORRUPT_INDEX' // updateJsonFile: the file does not parse, or is not of the declared type; nothing written
  | 'ERR_SOURCE_CHANGED' // a clone's source (size, mtime, ctime or inode) changed while it was cloned, or a tree's entry went after the walk saw it; nothing published (path: the source)
  | 'ERR_SOURCE_TYPE' // a clone's source is neither a regular file nor a directory (a fifo, socket, device); nothing made
  | 'ERR_IMAGE_NOT_PERMITTED' // an image-backed pool without CAP_SYS_ADMIN (cause: EPERM); nothing made
  | 'ERR_IMAGE_TOOL_MISSING' // a tool an image-backed pool needs is not installed (the message names its package)
  | 'ERR_IMAGE_TOOL_FAILED' // losetup, mount, mkfs.btrfs or blkid failed (the message has its first line of stderr)
  | 'ERR_IMAGE_FOREIGN' // the image path holds a file that is not a file system image vmspace made; left untouched
  | 'ERR_IMAGE_ROOT_MOUNTED' // the pool root is already the mount of something other than the image
  | 'ERR_IMAGE_IN_USE' // the image is already mounted at another path (the message names it); nothing made
  | 'ERR_IMAGE_NOT_MOUNTED' // unmountImage: the root is not the mount of a vmspace image; openPool without image: it is the image's unmounted mount point
  | 'ERR_OCI_INVALID' // importImage: the source is not an OCI layout, oci-archive or docker-archive, or its index, manifest or config is malformed
  | 'ERR_OCI_REF' // importImage: the ref is not in the source, or none given where it has several (the message lists them)
  | 'ERR_OCI_PLATFORM' // importImage: no manifest for the platform (the message lists those there)
  | 'ERR_OCI_BLOB_MISSING' // importImage: a blob the manifest names is not in the source
  | 'ERR_OCI_DIGEST_MISMATCH' // importImage: a blob's digest or size, or a layer's diffID, is not its descriptor's (blob, expected, actual); nothing published
  | 'ERR_OCI_MEDIA_TYPE' // importImage: a layer media type or compression not supported
  | 'ERR_LAYER_UNSAFE' // an image layer's entry reaches outside the layer's root or the OCI spec does not allow it (.., absolute names, a hard link out or to a missing entry, a malformed whiteout); path: the entry; nothing published
  | 'ERR_LAYER_INVALID' // an image layer is not a tar the applier reads (bad checksum, truncated, GNU sparse, an unknown entry type, a number out of range); path: the entry; nothing published
  | 'ERR_OCI_NOT_PERMITTED' // an image import needs root: refused up front when not root, or chown, mknod or a security.* xattr was refused (cause: EPERM); nothing published
  | 'ERR_SHARE_UNSUPPORTED' // allocate of a template with shared files where a hard link cannot reach the workspace: a btrfs quota (a subvolume), another project id; a checkpoint with share of a quota workspace (cause: EXDEV; path: the shared path); nothing made

/**
 * Codes of system errors: the errno names Node knows on Linux (`os.constants.errno`), the Linux errnos a file system
 * can return that its table lacks (`'EUCLEAN'`, `'ENOKEY'`, … on the architectures with asm-generic numbering), and
 * `'EUNKNOWN'` for a number neither names.
 */
export type SystemErrorCode =
  | 'E2BIG' | 'EACCES' | 'EADDRINUSE' | 'EADDRNOTAVAIL' | 'EAFNOSUPPORT' | 'EAGAIN' | 'EALREADY' | 'EBADF'
  | 'EBADMSG' | 'EBUSY' | 'ECANCELED' | 'ECHILD' | 'ECONNABORTED' | 'ECONNREFUSED' | 'ECONNRESET' | 'EDEADLK'
  | 'EDESTADDRREQ' | 'EDOM' | 'EDQUOT' | 'EEXIST' | 'EFAULT' | 'EFBIG' | 'EHOSTUNREACH' | 'EIDRM' | 'EILSEQ'
  | 'EINPROGRESS' | 'EINTR' | 'EINVAL' | 'EIO' | 'EISCONN' | 'EISDIR' | 'ELOOP' | 'EMFILE' | 'EMLINK' | 'EMSGSIZE'
  | 'EMULTIHOP' | 'ENAMETOOLONG' | 'ENETDOWN' | 'ENETRESET' | 'ENETUNREACH' | 'ENFILE' | 'ENOBUFS' | 'ENODATA'
  | 'ENODEV' | 'ENOENT' | 'ENOEXEC' | 'ENOLCK' | 'ENOLINK' | 'ENOMEM' | 'ENOMSG' | 'ENOPROTOOPT' | 'ENOSPC' | 'ENOSR'
  | 'ENOSTR' | 'ENOSYS' | 'ENOTCONN' | 'ENOTDIR' | 'ENOTEMPTY' | 'ENOTSOCK' | 'ENOTSUP' | 'ENOTTY' | 'ENXIO'
  | 'EOPNOTSUPP' | 'EOVERFLOW' | 'EPERM' | 'EPIPE' | 'EPROTO' | 'EPROTONOSUPPORT' | 'EPROTOTYPE' | 'ERANGE' | 'EROFS'
  | 'ESPIPE' | 'ESRCH' | 'ESTALE' | 'ETIME' | 'ETIMEDOUT' | 'ETXTBSY' | 'EWOULDBLOCK' | 'EXDEV'
  | 'ENOTBLK' | 'EBADE' | 'EBADR' | 'EXFULL' | 'EREMOTE' | 'EBADFD' | 'EUCLEAN' | 'EREMOTEIO' | 'ENOMEDIUM'
  | 'EMEDIUMTYPE' | 'ENOKEY' | 'EKEYEXPIRED' | 'EKEYREVOKED' | 'EKEYREJECTED' | 'EOWNERDEAD' | 'ENOTRECOVERABLE'
  | 'EUNKNOWN'

/**
 * The fields the native binding rejects with (see native/binding/common.cc, errorObject): `code` for vmspace's own
 * conditions, `errno` (negative) for a system error, or both; the errno's name is added here.
 */
interface NativeError {
  code?: string
  errno?: number
  description?: string
  syscall?: string
  path?: string
  dest?: string
  detail?: string
  uid?: number
  gid?: number
  mode?: number
}

/** A failed file-system operation, shaped like Node's fs errors (see the module comment). */
export class VmspaceError extends Error {
  /** errno name (`'ENOENT'`, …) or a vmspace code (`'ERR_…'`). */
  declare readonly code: VmspaceErrorCode | SystemErrorCode
  /** Negative errno, as in Node's fs errors; absent for conditions without one. */
  declare readonly errno?: number
  /** The system call that failed (`'openat'`, `'renameat2'`, …). */
  declare readonly syscall?: string
  /** The path the error is about. */
  declare readonly path?: string
  /** The second path of a two-path operation (a clone's or rename's destination). */
  declare readonly dest?: string
  /** `ERR_POOL_UNSAFE`: owner, group and permission bits (`st_mode & 0o7777`) of the entry at `path`. */
  declare readonly uid?: number
  /** `ERR_POOL_UNSAFE`: the group of the entry at `path`. */
  declare readonly gid?: number
  /** `ERR_POOL_UNSAFE`: the permission bits (`st_mode & 0o7777`) of the entry at `path`. */
  declare readonly mode?: number
  /** `ERR_OCI_DIGEST_MISMATCH`: the blob (its digest, or its name in the source) whose check failed. */
  declare readonly blob?: string
  /** `ERR_OCI_DIGEST_MISMATCH`: the digest (or size, as a decimal string) its descriptor gives. */
  declare readonly expected?: string
  /** `ERR_OCI_DIGEST_MISMATCH`: the digest (or size) read. */
  declare readonly actual?: string

  constructor(
    message: string,
    fields: {
      code: string
      errno?: number
      syscall?: string
      path?: string
      dest?: string
      cause?: unknown
      uid?: number
      gid?: number
      mode?: number
      blob?: string
      expected?: string
      actual?: string
    },
  ) {
    super(message, fields.cause === undefined ? undefined : { cause: fields.cause })
    this.name = 'VmspaceError'
    this.code = fields.code as VmspaceError['code']
    if (fields.errno !== undefined) this.errno = fields.errno
    if (fields.syscall !== undefined) this.syscall = fields.syscall
    if (fields.path !== undefined) this.path = fields.path
    if (fields.dest !== undefined) this.dest = fields.dest
    if (fields.uid !== undefined) this.uid = fields.uid
    if (fields.gid !== undefined) this.gid = fields.gid
    if (fields.mode !== undefined) this.mode = fields.mode
    if (fields.blob !== undefined) this.blob = fields.blob
    if (fields.expected !== undefined) this.expected = fields.expected
    if (fields.actual !== undefined) this.actual = fields.actual
  }
}

function isNativeError(e: unknown): e is NativeError {
  if (typeof e !== 'object' || e === null || e instanceof Error) return false
  const { code, errno } = e as NativeError
  return typeof code === 'string' || typeof errno === 'number'
}

// errno number -> name, from Node's table rather than the addon (glibc's strerrorname_np is 2.32+ and absent from
// musl). Where two names share a number, glibc's choice wins, so codes stay what they were (EAGAIN, EOPNOTSUPP).
const errnoNames = new Map<number, string>()
for (const [name, n] of Object.entries(os.constants.errno)) {
  if (!errnoNames.has(n) || name === 'EAGAIN' || name === 'EOPNOTSUPP' || name === 'EDEADLK') errnoNames.set(n, name)
}
// Linux errnos a file system can return that Node's POSIX table lacks, numbered as in asm-generic/errno.h (which
// these architectures use; MIPS, SPARC and Alpha number them otherwise).
if (['x64', 'arm64', 'arm', 'ia32', 'riscv64', 's390x', 'ppc64', 'loong64'].includes(process.arch)) {
  const linux: [number, string][] = [
    [15, 'ENOTBLK'], [52, 'EBADE'], [53, 'EBADR'], [54, 'EXFULL'], [66, 'EREMOTE'], [77, 'EBADFD'],
    [117, 'EUCLEAN'], [121, 'EREMOTEIO'], [123, 'ENOMEDIUM'], [124, 'EMEDIUMTYPE'], [126, 'ENOKEY'],
    [127, 'EKEYEXPIRED'], [128, 'EKEYREVOKED'], [129, 'EKEYREJECTED'], [130, 'EOWNERDEAD'], [131, 'ENOTRECOVERABLE'],
  ]
  for (const [n, name] of linux) if (!errnoNames.has(n)) errnoNames.set(n, name)
}

// Descriptions (glibc's strerror, lower-cased as libuv's) of the errnos that libuv's table lacks, so that an error
// made here from a bare number reads as one from the addon. EDQUOT matters most: libuv has no UV_EDQUOT, so Node
// itself reports a quota hit as code 'UNKNOWN' ("Unknown system error -122").
const missingDescriptions: Record<string, string> = {
  EDQUOT: 'disk quota exceeded', ENOTBLK: 'block device required', EBADE: 'invalid exchange',
  EBADR: 'invalid request descriptor', EXFULL: 'exchange full', EREMOTE: 'object is remote',
  EBADFD: 'file descriptor in bad state', EUCLEAN: 'structure needs cleaning', EREMOTEIO: 'remote I/O error',
  ENOMEDIUM: 'no medium found', EMEDIUMTYPE: 'wrong medium type', ENOKEY: 'required key not available',
  EKEYEXPIRED: 'key has expired', EKEYREVOKED: 'key has been revoked', EKEYREJECTED: 'key was rejected by service',
  EOWNERDEAD: 'owner died', ENOTRECOVERABLE: 'state not recoverable',
}

/** The description of a positive errno: libuv's, else glibc's for the Linux errnos libuv lacks, else 'unknown error'. */
function errnoDescription(errno: number): string {
  return util.getSystemErrorMap().get(-errno)?.[1] ?? missingDescriptions[errnoName(errno)] ?? 'unknown error'
}

/** The name of a positive errno (`'ENOENT'`), or `'EUNKNOWN'` for a number Node does not name. */
export function errnoName(errno: number): string {
  return errnoNames.get(errno) ?? 'EUNKNOWN'
}

// The most of a path a message shows, in UTF-16 units (native/core/error.h bounds its texts alike, in bytes).
const MESSAGE_PATH_MAX = 4096

/**
 * `p` as a message shows it: whole up to MESSAGE_PATH_MAX, else its head and tail around an ellipsis. A walk's path
 * has no bound (a guest's tree 20,000 directories deep of 255-byte names is 5 MB), and a message is copied into
 * every log line and stack; the error's `path` and `dest` keep the whole path.
 */
function shownPath(p: string): string {
  if (p.length <= MESSAGE_PATH_MAX) return p
  const half = MESSAGE_PATH_MAX / 2
  let head = half
  let tail = p.length - half
  // Never split a surrogate pair: a cut between its halves would leave a lone surrogate in the message.
  if (isLowSurrogate(p.charCodeAt(head))) head--
  if (isLowSurrogate(p.charCodeAt(tail))) tail++
  return `${p.slice(0, head)}…${p.slice(tail)}`
}

const isLowSurrogate = (c: number) => c >= 0xdc00 && c <= 0xdfff

function where(e: { syscall?: string; path?: string; dest?: string }): string {
  let s = e.syscall ? `, ${e.syscall}` : ''
  if (e.path !== undefined) s += ` '${shownPath(e.path)}'`
  if (e.dest !== undefined) s += ` -> '${shownPath(e.dest)}'`
  return s
}

/**
 * Turns what the binding rejected with into a VmspaceError. Called inside the public async function that awaited
 * the native call, so the error's stack shows the caller's `await` chain rather than the addon's internals.
 */
export function fromNative(e: unknown): unknown {
  if (!isNativeError(e)) return e
  const { errno, syscall, path, dest } = e
  const errnoCode = errno !== undefined ? errnoName(-errno) : 'EUNKNOWN'
  const code = e.code ?? errnoCode
  if (code.startsWith('ERR_')) {
    const cause =
      errno !== undefined
        ? new VmspaceError(`${errnoCode}: ${e.description?.toLowerCase()}${where(e)}`, {
            code: errnoCode,
            errno,
            syscall,
            path,
            dest,
          })
        : undefined
    const { uid, gid, mode } = e
    return new VmspaceError(`${code}: ${e.detail ?? code}${where(e)}`, { code, errno, syscall, path, dest, cause, uid, gid, mode })
  }
  return new VmspaceError(`${code}: ${(e.description ?? 'unknown error').toLowerCase()}${where(e)}`, {
    code,
    errno,
    syscall,
    path,
    dest,
  })
}

/** Awaits a native promise and converts its rejection (see fromNative). */
export async function call<T>(p: Promise<T>): Promise<T> {
  try {
    return await p
  } catch (e) {
    throw fromNative(e)
  }
}

export function vmspaceError(
  code: VmspaceErrorCode,
  message: string,
  fields: { path?: string; cause?: unknown; syscall?: string } = {},
) {
  return new VmspaceError(`${code}: ${message}`, { code, ...fields })
}

/** A system error from a bare errno (positive), shaped like the binding's. */
export function errnoError(errno: number, syscall: string, path?: string): VmspaceError {
  return fromNative({ errno: -errno, description: errnoDescription(errno), syscall, path }) as VmspaceError
}

/**
 * `e` with the path `from` (or a path beneath it) named as `to` instead, in `path`, `dest`, the message and the
 * cause's: an entry that was internal when the call failed (a staging entry) named where the caller looks for it.
 */
export function renamedPaths(e: unknown, from: string, to: string): unknown {
  if (!(e instanceof VmspaceError)) return e
  const swap = (p: string | undefined) => (p !== undefined && (p === from || p.startsWith(from + '/')) ? to + p.slice(from.length) : p)
  const text = (t: string | undefined) => t?.split(`'${from}`).join(`'${to}`)
  const fields = { path: swap(e.path), dest: swap(e.dest), message: text(e.message), stack: text(e.stack) }
  for (const [key, value] of Object.entries(fields))
    if (value !== undefined) Object.defineProperty(e, key, { value, enumerable: key === 'path' || key === 'dest', writable: true, configurable: true })
  renamedPaths(e.cause, from, to)
  return e
}

/** The error an aborted operation rejects with, as Node's own APIs do (`name: 'AbortError'`, `code: 'ABORT_ERR'`). */
export class AbortError extends Error {
  /** Always `'ABORT_ERR'`, as Node's own AbortError. */
  readonly code = 'ABORT_ERR'
  constructor(cause?: unknown) {
    super('The operation was aborted', cause === undefined ? undefined : { cause })
    this.name = 'AbortError'
  }
}

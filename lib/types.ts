/**
 * The public data shapes: options objects, results and records that cross files of lib/ and the API. Declarations
 * only: no code, and no import but of types from leaf modules, so that every implementation file can import these
 * without an import circle (lib/index.ts re-exports them). Each union a shape uses (clone method, sweep source,
 * template cache use) is defined here once.
 * @module
 */
import type { VmspaceError } from './errors.js'

// ---- Pools and workspaces ----

/** A value JSON can hold (what `JSON.parse` returns). */
export type JsonValue = string | number | boolean | null | JsonValue[] | { [key: string]: JsonValue }

/** A JSON object: workspace metadata (`meta`) and the like. */
export type JsonObject = { [key: string]: JsonValue }

/** Options of {@link openPool}. */
export interface PoolOptions {
  /**
   * Make the pool when `root` is not one yet: the directory (and its parents) when missing, and `.vmspace/`,
   * built whole under a temp name and renamed into place, so concurrent first calls make one pool. Default true.
   */
  create?: boolean
  /**
   * Make the pool in a directory that already holds other entries. Default false: such a directory is refused
   * with `ERR_POOL_NOT_EMPTY` (nothing made), so that a typo never turns a directory of other files into a pool.
   * Entries that are not vmspace's are never touched: a sweep reports ones named like workspaces in `foreign`.
   */
  nonEmpty?: boolean
  /** Workspace names are `${prefix}-${id}`: 1–64 of `[A-Za-z0-9_-]`, starting with a letter or digit. Default `'vm'`. */
  prefix?: string
  /** Default reflink mode of template clones (see CloneOptions.reflink). Default `'auto'`. */
  reflink?: Reflink
  /** fsync clones, metadata and directories before a workspace is published. Default false. */
  durable?: boolean
  /**
   * A group id whose members share the pool. By default openPool refuses (`ERR_POOL_UNSAFE`) a pool directory, or
   * a directory or symlink on the path to it, that a user other than this process's (or root) owns or could
   * write; a sticky directory above the pool (as /tmp) is fine. With `sharedGroup`, an entry whose group is this
   * gid may be owned by any user and be group-writable, and the directories openPool makes get this group and
   * mode 0o2770. Default: none.
   */
  sharedGroup?: number
  /**
   * A warm reserve (docs/warm.md): `count` workspaces of `template` built ahead of time, so that an
   * allocate() of that template only publishes one. Default: none.
   */
  warm?: WarmOptions
  /**
   * Free-space floor in bytes: allocate() refuses with `ENOSPC` (syscall `'statvfs'`, nothing made) while the
   * pool's file system has fewer bytes available to unprivileged users (f_bavail) than this. Default 0 (none).
   */
  minFreeBytes?: number
  /**
   * The project ids (XFS/ext4 project quotas) this pool's quota'd workspaces may take, `[first, last]`: keep it
   * clear of the ids the host uses (/etc/projid), and give pools on one file system ranges of their own. Default
   * `[0x40000000, 0x4fffffff]`.
   */
  projectIds?: [number, number]
  /**
   * An image-backed pool (docs/image-pool.md): `root` is the mount of a btrfs made in the file
   * `image.path` ({@link ImageOptions}), made and mounted by this call where it is not yet (sparse file, loop
   * device with direct I/O, mount at `root`); an existing mount of that image is just opened. Needs root.
   * Throws, besides openPool's own errors, `ERR_IMAGE_NOT_PERMITTED`, `ERR_IMAGE_TOOL_MISSING`,
   * `ERR_IMAGE_FOREIGN`, `ERR_IMAGE_ROOT_MOUNTED`, `ERR_IMAGE_IN_USE` (mounted at another path),
   * `ERR_IMAGE_TOOL_FAILED`, `ENOSPC` (nothing made); see
   * DESIGN.md, "The image-backed pool".
   */
  image?: ImageOptions
  /**
   * The template cache (docs/templates-cache.md): a single-file template source on another file system than the
   * pool (allocate's `template` entries, Workspace.clone) is copied once into `.vmspace/cache/`, keyed by its
   * version (device, inode, size, mtime, ctime), and every later clone of that version is a reflink of the copy
   * (CloneResult `cache`). Only where the pool's file system reflinks (XFS `reflink=1`, btrfs): on ext4 a cache would
   * only add a copy, and none is made. `false` turns it off (every such allocate copies the source). `maxBytes`:
   * what {@link Pool.sweep} keeps, in allocated bytes of the cached copies, least recently used reclaimed first
   * (copies whose source is gone or changed are reclaimed whatever the budget). Default `{ maxBytes: 8 GiB }`.
   */
  templateCache?: false | TemplateCacheOptions
}

/**
 * A warm reserve ({@link PoolOptions.warm}): `count` workspaces built ahead from `template`, leased by this process,
 * so that an allocate() of that template only publishes one (metadata write and one rename). Entries are ordinary
 * staging entries with lease files: a sweep reclaims them once their process is gone. An entry whose template
 * sources changed since it was built is never handed out.
 */
export interface WarmOptions {
  /** As AllocateOptions.template. allocate() calls with this template (a map's entries in any order) and `mode`
   * are served from the reserve; any other allocate() builds its workspace as without a reserve. */
  template: string | Record<string, string>
  /** Workspaces kept built: 1–64. */
  count: number
  /** As AllocateOptions.mode. Default 0o700. */
  mode?: number
}

/** Options of {@link Pool.allocate}. */
export interface AllocateOptions {
  /**
   * What the workspace starts with, cloned (reflink where possible) before the workspace appears: a directory
   * whose contents become the workspace's contents, or a map from workspace-relative paths to source files or
   * directories (`{ 'rootfs.ext4': '/images/base.ext4' }`; missing parent directories are made).
   */
  template?: string | Record<string, string>
  /**
   * The id or name of a committed template (Pool.commit) whose tree becomes the workspace's contents,
   * before `template` entries. `ERR_TEMPLATE_NOT_FOUND` for none (nothing made); `ERR_CORRUPT_METADATA` (with
   * `path`) when its template.json does not parse (nothing left). A replace or removal of the template meanwhile
   * waits for this clone: the workspace gets the whole old tree or the whole new one.
   */
  from?: string
  /**
   * A JSON object kept in the workspace's record (at most 64 KiB serialised), returned by list() exactly as given:
   * a value JSON would change (a Date, `undefined`, NaN, ±Infinity, -0, a Map, a class instance, a function, an array
   * hole) is `ERR_INVALID_ARG_VALUE` naming where it is, e.g. `options.meta["when"]`.
   */
  meta?: JsonObject
  /** Mode of the workspace directory, less the process umask as with mkdir(2). Default 0o700. */
  mode?: number
  /**
   * Aborting rolls back: a template clone stops between entries, whatever was built is removed, and the call
   * rejects with an AbortError (also when the abort comes just after the workspace was published).
   */
  signal?: AbortSignal
  /**
   * For template files that are copied (no reflink): start their writeback as they are copied, `'start'`, or
   * also wait for it, `'wait'` (see CloneOptions.writeback). Default `'none'`. A workspace from the warm reserve
   * is always written back already.
   */
  writeback?: Writeback
  /**
   * A limit of the workspace's own, enforced by the kernel (writes past it fail with `EDQUOT`); see
   * {@link QuotaOptions}. On btrfs the workspace is a subvolume with a qgroup limit (quotas must be enabled:
   * `btrfs quota enable`); on XFS/ext4 with project quotas it gets a project id inherited by everything inside.
   * Elsewhere, or without CAP_SYS_ADMIN, allocate fails with `ERR_QUOTA_UNSUPPORTED` and makes nothing (see
   * probeQuota()). `inodes` on btrfs: `ERR_QUOTA_UNSUPPORTED`.
   */
  quota?: QuotaOptions
}

/** Options of {@link Pool.list}. */
export interface ListOptions {
  /** Add each workspace's `usage` (a walk of its tree per workspace: see Workspace.usage()). Default false. */
  usage?: boolean
  /** Stops the usage walks: the call rejects with an AbortError. */
  signal?: AbortSignal
}

/** The pool's totals (`pool.usage()`). Bytes throughout. */
export interface PoolUsage {
  /** Published workspaces counted. */
  workspaces: number
  /** Sum of the workspaces' {@link WorkspaceUsage.allocatedBytes}. */
  allocatedBytes: number
  /** Sum of the workspaces' {@link WorkspaceUsage.exclusiveBytes}. */
  exclusiveBytes: number
  /** Sum of the workspaces' {@link WorkspaceUsage.sharedBytes}. */
  sharedBytes: number
  /** Regular files in all workspaces. */
  files: number
  /** Directories in all workspaces. */
  dirs: number
  /** Of the pool's file system (statvfs): available to unprivileged users, free, total. */
  availableBytes: number
  /** Free bytes of the pool's file system (statvfs f_bfree), including those reserved for root. */
  freeBytes: number
  /** Size of the pool's file system in bytes. */
  totalBytes: number
  /** Whether workspace quotas can be enforced on the pool's file system. */
  quota: QuotaSupport
}

/** One source of a workspace's template, as its record names it ({@link WorkspaceInfo.template}). */
export interface TemplateSource {
  /** Workspace-relative destination; '' for a directory template whose contents are the workspace's. */
  dest: string
  /** Absolute path of the source file or directory. */
  source: string
  /** A regular file or a directory tree. */
  kind: CloneKind
  /** Identity of the source when it was cloned (decimal strings: they can exceed 2^53). */
  dev: string
  /** The source's inode number (decimal string). */
  ino: string
  /** The source's size in bytes (a tree: its directory's st_size). */
  size: number
  /** The source's modification time in ns since the epoch (decimal string). */
  mtimeNs: string
  /** How its data arrived in the workspace. */
  method: CloneMethod
}

/** A published workspace as {@link Pool.list} finds it (and {@link Workspace.info} after adopt). */
export interface WorkspaceInfo {
  /** 32 lowercase hex characters (the whole name when it does not have the `<prefix>-<id>` shape). */
  id: string
  /** The directory's name in the pool root. */
  name: string
  /** Absolute path of the workspace directory. */
  path: string
  /** True while some process holds the lease (judged by F_OFD_GETLK on its lease file, which takes no lock). */
  live: boolean
  /** ms since the epoch. */
  createdAt?: number
  /** The `meta` given to allocate(). */
  meta?: JsonObject
  /** What the template cloned into it, with each source's identity at that time. */
  template?: TemplateSource[]
  /** The template it was allocated from (`allocate({ from })`). */
  templateId?: string
  /** Process id of the allocating process. */
  pid?: number
  /** Effective user id of the allocating process (geteuid(2)): in a pool several users share, whose it is. */
  uid?: number
  /** Host name of the allocating machine. */
  hostname?: string
  /** Boot id (/proc/sys/kernel/random/boot_id) of the allocating machine's boot: a pid is only meaningful within it. */
  bootId?: string
  /**
   * Set (`ERR_CORRUPT_METADATA`, or the errno of reading it) when the workspace's record (its lease file's xattr) cannot be read or parsed; or, with
   * `syscall: 'fcntl(F_OFD_GETLK)'` (or `'open'` of the lease file), when the lease probe failed with an unexpected errno (`live` is then true: undecided
   * entries are never reported reclaimable).
   */
  error?: VmspaceError
  /** The quota asked for at allocate. */
  quota?: QuotaOptions
  /** list({ usage: true }) only (absent for a workspace disposed during the walk; `error` set where the walk failed). */
  usage?: WorkspaceUsage
}

/** Options of the pool's template cache ({@link PoolOptions.templateCache}). */
export interface TemplateCacheOptions {
  /** What a sweep keeps of the cache: allocated bytes of its copies (an integer ≥ 0). Default 8 GiB (8 * 2 ** 30). */
  maxBytes?: number
}

/** Options of {@link Pool.sweep}. */
export interface SweepOptions {
  /** Report what would be reclaimed without touching anything (`bytes` are then 0). Default false. */
  dryRun?: boolean
  /**
   * What has no lease is left alone while younger than this (ms, by birth time): half-built templates, temp files
   * of a write or a pool being made. Workspaces need none: a build's lease is held from before its directory
   * exists, so none in progress is ever taken. Default 60000.
   */
  graceMs?: number
}

/** One entry a sweep reclaimed (or failed to). */
export interface SweepEntry {
  /** The workspace's id (the whole name for an entry without the `<prefix>-<id>` shape). */
  id: string
  /** The entry's directory name. */
  name: string
  /**
   * Where it was found: a published workspace whose owner is gone, a dead build, or trash; a retired template
   * no one reads (`'template'`, name `template-<id>`) or a commit whose process died (`'template-staging'`);
   * `'lease'` for a failure on a lease file whose workspace was gone; `'template-cache'` a cached copy of a template
   * source (name: its key, `<dev>-<ino>-<size>-<mtime>-<ctime>`) whose source is gone or changed, or beyond the
   * cache's budget ({@link PoolOptions.templateCache}).
   */
  from: SweepSource
  /**
   * Space the file system got back, in bytes: the allocated blocks of what was removed less the extents it shared
   * with other files (FIEMAP_EXTENT_SHARED: reflinked template data stays allocated). Where the tree could not be
   * read for that, its allocated blocks. 0 with `dryRun` (nothing is removed) and for an entry in `failed`.
   */
  bytes: number
}

/** An entry whose handling failed in a sweep ({@link SweepReport.failed}). */
export interface SweepFailure extends SweepEntry {
  /** `error.code`. */
  code: VmspaceError['code']
  /** Why the entry failed. */
  error: VmspaceError
}

/** What {@link Pool.sweep} did. */
export interface SweepReport {
  /** Entries removed (with `dryRun`: that would be removed). */
  reclaimed: SweepEntry[]
  /** Published workspaces left alone because a process holds their lease. */
  live: number
  /**
   * Entries whose handling failed, one each; the sweep goes on with the others. `EBUSY` (a mount inside) and
   * any other errno of the removal, `ENOMEM` (also a C++ allocation failure), `ERR_INTERNAL`; `error.syscall`
   * `'fcntl(F_OFD_GETLK)'` when the lease probe failed (the entry's liveness is then unknown: it is neither
   * counted `live` nor touched). What is left stays for a later sweep. An entry that a concurrent dispose,
   * allocate or sweep finished meanwhile is not a failure (it is in no list).
   */
  failed: SweepFailure[]
  /**
   * Lease files removed because their workspace was gone (a build or dispose that died between two steps). The
   * spare lease files of a process that died (`leases/<x>/.spare-<hex>`, docs/pool-on-disk.md) are removed too,
   * and not counted: they never belonged to a workspace.
   */
  leasesRemoved: number
  /**
   * Paths of entries in the root, staging or trash named like workspaces but without a lease file: vmspace did
   * not make them (or no longer owns them), so they are left as they are.
   */
  foreign: string[]
}

/** Where a swept entry was found ({@link SweepEntry.from}). */
export type SweepSource = 'published' | 'staging' | 'trash' | 'lease' | 'template' | 'template-staging' | 'template-cache'

/** Counters of {@link Pool.stats}. */
export interface PoolStats {
  /** Workspaces allocated. */
  allocated: number
  /** Workspaces disposed. */
  disposed: number
  /** allocate calls that failed (and rolled back). */
  failed: number
  /** Names drawn again because the one drawn existed. */
  nameRetries: number
  /** Regular files cloned into workspaces (templates and Workspace.clone) by how their data arrived. */
  clones: {
    /** Files whose extents are shared with their source. */
    reflink: number
    /** Files whose data was copied. */
    copy: number
  }
  /** Their logical bytes. */
  bytesCloned: number
}

// ---- Clones ----

/** How a clone gets its data: see {@link CloneOptions.reflink}. */
export type Reflink = 'always' | 'auto' | 'never'

/**
 * Writeback of a copied clone's data (a reflink shares extents and writes none): `'none'` leaves the pages dirty
 * (the first fsync pays for them), `'start'` queues their writeback (sync_file_range(2) SYNC_FILE_RANGE_WRITE)
 * without waiting, `'wait'` waits until it is done.
 */
export type Writeback = 'none' | 'start' | 'wait'

/** Running totals passed to {@link CloneOptions.onProgress}. */
export interface CloneProgressEvent {
  /** Regular files done so far. */
  files: number
  /**
   * Bytes cloned so far: of the files done (logical size, holes included), and of a file being copied the bytes
   * written so far (a reflink's all at once), so that one big file reports too.
   */
  bytes: number
}

/** Options of {@link clone}, {@link Workspace.clone} (and, for `reflink`, of templates). */
export interface CloneOptions {
  /**
   * `'auto'` (default): reflink (ioctl(FICLONE), ioctl_ficlone(2)) where the file system shares extents, otherwise a
   * copy that keeps holes (SEEK_DATA/SEEK_HOLE). `'always'`: reflink or fail with `ERR_REFLINK_UNSUPPORTED`,
   * leaving nothing behind (for a tree on another file system, before anything is written). `'never'`: always
   * copy, with read/write, so that no extent is shared even on XFS/btrfs.
   */
  reflink?: Reflink
  /**
   * Replace an existing destination atomically instead of failing with `EEXIST`: rename(2) for a file; for a tree,
   * renameat2(RENAME_EXCHANGE) and then removal of the old tree. Default false.
   */
  overwrite?: boolean
  /** fsync each new file before it is published and the directory after. Default false. */
  durable?: boolean
  /**
   * What a copy (never a reflink, whose data is the source's) does about the dirty page cache it leaves: a copied
   * 256 MiB image is 256 MiB to write back, and the first `fsync` after the clone (the VM's) pays for all of it.
   * `'start'` queues that writeback as each file is copied (sync_file_range(2) `SYNC_FILE_RANGE_WRITE`), without
   * waiting for it, so that the disk works on it while the caller goes on; `'wait'` also waits until it is
   * written back (`SYNC_FILE_RANGE_WAIT_BEFORE|WRITE|WAIT_AFTER`; data only: unlike `durable`, no fsync of
   * metadata or the device cache). Default `'none'`. Errors of sync_file_range (`EIO`, `ENOSPC`) fail the clone.
   */
  writeback?: Writeback
  /**
   * Called with running totals at most every 100 ms while a clone runs, a single file's as a tree's (a copy reports
   * its bytes per chunk of at most 64 MiB; none is made while the totals are unchanged). An exception it throws (or,
   * for an async callback, a rejection that comes while the clone runs) cancels the clone like an abort: the call
   * rejects with that exception and what was built is removed, a temp file included (unless the clone had already
   * completed, then the destination stays complete). A rejection after the call has settled is ignored.
   */
  onProgress?: (p: CloneProgressEvent) => void
  /**
   * Cancels between entries of a tree and between chunks of a file's copy (1 MiB read/write, at most 64 MiB
   * copy_file_range); what was built is removed and the call rejects with an AbortError.
   */
  signal?: AbortSignal
}

/**
 * Where a file's data came from when the pool's template cache served it ({@link CloneResult.cache}): `'hit'` a
 * reflink of a copy made before (by this or another process), `'miss'` a reflink of the copy this clone made first
 * (the one copy of that version of the source).
 */
export type TemplateCacheUse = 'hit' | 'miss'

/** What a clone made. */
export interface CloneResult {
  /** A regular file or a directory tree. */
  kind: CloneKind
  /** How the data arrived: shared extents, a copy, (trees) both, or (templates on btrfs) a subvolume
   * snapshot, which walks nothing: its counts are 0. A tree without regular files is `'copy'`, on any file system
   * and whatever `reflink` asked for: it says what happened, and no extent was shared (its entries were made anew,
   * as a copy makes them). */
  method: CloneMethod
  /** Absolute path of the destination. */
  path: string
  /** Regular files (hard links counted once). */
  files: number
  /** Logical size in bytes of the regular files (holes included). */
  bytes: number
  /** Regular files whose extents are shared with the source / that were copied. */
  reflinked: number
  /** Regular files whose data was copied. */
  copied: number
  /**
   * A single file from another file system than the pool, cloned into a workspace (allocate's `template` entries,
   * Workspace.clone): served by the pool's template cache, `method` `'reflink'` (docs/templates-cache.md). Absent
   * where the cache did not serve it (same file system: a reflink from the source itself; trees; ext4 pools;
   * `reflink` other than `'auto'`; the standalone clone()).
   */
  cache?: TemplateCacheUse
  /** Trees: entries recreated by kind. */
  dirs?: number
  /** Trees: symlinks recreated. */
  symlinks?: number
  /** Trees: hard links recreated (links to a file cloned once). */
  hardlinks?: number
  /** Trees: fifos recreated. */
  fifos?: number
  /** Trees: device nodes recreated. */
  devices?: number
  /**
   * Trees: entries not recreated: sockets always, device nodes where mknod(2) is not permitted or not asked for (a
   * guest's tree: commit and fork without `keepDevices`, copyOut).
   */
  skipped?: {
    /** Sockets (never recreated: a socket is a live endpoint, not data). */
    sockets: number
    /** Device nodes mknod(2) refused (`EPERM` without CAP_MKNOD), or left out of a guest's tree (no `keepDevices`). */
    devices: number
  }
}

/** What a clone's source is: a regular file or a directory tree. */
export type CloneKind = 'file' | 'tree'

/** How a clone's data arrived (`'copy'`: the fallback where no reflink was possible). */
export type CloneMethod = 'reflink' | 'copy' | 'mixed' | 'snapshot'

// ---- Quotas and space ----

/** A workspace's own limit (`allocate({ quota })`), enforced by the kernel: writes past it fail with `EDQUOT`. */
export interface QuotaOptions {
  /**
   * Bytes the workspace may cost. btrfs: the exclusive bytes of its subvolume's qgroup (extents shared with the
   * template by reflink are not charged until rewritten). XFS/ext4 project quota: every block charged to its
   * project (reflinked blocks count in full there), rounded up to 1 KiB.
   */
  bytes?: number
  /** Files and directories the workspace may hold (project quotas only; btrfs has no inode limit: refused). */
  inodes?: number
}

/** Whether a directory's file system can enforce a workspace quota (`probeQuota`, `pool.usage().quota`). */
export interface QuotaSupport {
  /** Whether `allocate({ quota })` can be enforced on this file system (else it fails ERR_QUOTA_UNSUPPORTED). */
  supported: boolean
  /** `'btrfs-qgroup'`: a subvolume per workspace with a qgroup limit; `'project'`: an XFS/ext4 project id. */
  backend: 'btrfs-qgroup' | 'project' | 'none'
  /** Whether `quota.inodes` can be enforced. */
  inodes: boolean
  /** What is used, or why it cannot be (e.g. "btrfs quotas (qgroups) are not enabled …"). */
  detail: string
  /** The errno behind a refusal: `ENOTCONN` (btrfs quotas off), `EPERM` (no CAP_SYS_ADMIN), `ESRCH` (project
   * quota not on), `ENOSYS` (no quota support, or no quotactl_fd before Linux 5.14), `EOPNOTSUPP` (other file
   * systems). Absent when supported. */
  code?: string
}

/** Space accounting of one workspace (`ws.usage()`, `pool.list({ usage: true })`). Bytes throughout. */
export interface WorkspaceUsage {
  /** st_blocks × 512 of every entry (hard links once). */
  allocatedBytes: number
  /** Data extents no other file references (what removing the workspace frees); not yet written-back data too. */
  exclusiveBytes: number
  /**
   * Data extents also referenced elsewhere (FIEMAP_EXTENT_SHARED: reflinks of the template, snapshots), and the
   * data of files with links outside the workspace (a template's shared files: `st_nlink` above the links found).
   */
  sharedBytes: number
  /** Sum of the regular files' sizes. */
  logicalBytes: number
  /** Regular files below the workspace directory. */
  files: number
  /** Directories below the workspace directory. */
  dirs: number
  /** Symlinks, fifos, sockets, device nodes. */
  others: number
  /**
   * The kernel's view of the workspace's quota, where one is set: `limitBytes`/`usedBytes` (btrfs: exclusive
   * bytes of the qgroup, updated at each transaction commit; project: blocks charged), `limitInodes`/`usedInodes`
   * (project quotas; 0 on btrfs). 0 as a limit: none.
   */
  quota?: {
    /** The byte limit (0: none). */
    limitBytes: number
    /** Bytes the kernel charges to the workspace. */
    usedBytes: number
    /** The inode limit (0: none). */
    limitInodes: number
    /** Inodes the kernel charges to the workspace. */
    usedInodes: number
  }
}

// ---- Image-backed pools ----

/** The image of an image-backed pool ({@link PoolOptions.image}). */
export interface ImageOptions {
  /** The image file on the host (resolved against the cwd). Its directory must exist. */
  path: string
  /**
   * Size in bytes of an image made here (a sparse file: host blocks are taken as the pool's file system writes
   * them, and given back as it frees them). At least 128 MiB (134217728), a multiple of 4096, and no more
   * than the host file system has available. Ignored when the image exists; needed only to make one (without it,
   * a missing image is `ERR_INVALID_ARG_TYPE` naming `options.image.size`, nothing made).
   */
  size?: number
}

// ---- The warm reserve ----

/** What a pool's warm reserve has done since the pool was opened ({@link Pool.warmStats}). Counts; times in ms. */
export interface WarmStats {
  /** The reserve's size (`count`). */
  count: number
  /** Entries built, written back and waiting to be handed out. */
  ready: number
  /** allocate() calls served from the reserve. */
  hits: number
  /** allocate() calls of the reserve's template that found it empty and built their workspace themselves. */
  misses: number
  /** Entries found stale at hand-out (a template source changed since they were built) and removed. */
  stale: number
  /** Entries built since the pool was opened. */
  built: number
  /** Builds that failed (e.g. the template was removed, `ENOENT`; changed while it was cloned, `ERR_SOURCE_CHANGED`). */
  buildFailures: number
  /** Wall-clock ms the successful builds took, together: `built / buildMs * 1000` is the refill rate per second. */
  buildMs: number
  /** The error of the last failed build, until a build succeeds. */
  lastError?: VmspaceError
}

// ---- Templates ----

/** The space a template holds, measured at commit. Bytes. */
export interface TemplateUsage {
  /** st_blocks × 512 over the template's tree at commit (hard links once): the space the template holds. */
  allocatedBytes: number
  /** Regular files, and their logical bytes. */
  files: number
  /** Logical bytes of the regular files (sum of their sizes). */
  bytes: number
}

/**
 * A committed template (`pool.commit`, `pool.templates()`, `pool.template()`): a read-only tree in the pool that
 * `allocate({ from })` and `fork()` clone into new workspaces.
 */
export interface Template {
  /** 32 lowercase hex characters (128 random bits). */
  id: string
  /** The name it was committed under (null: unnamed). */
  name: string | null
  /** Whether the name resolves to this template now (false once replaced or removed). */
  current: boolean
  /** Absolute path of the committed tree (read-only: no write bits). Clone it, never write it. */
  path: string
  /** ms since the epoch. */
  createdAt?: number
  /** The template the committed workspace was allocated from (its id), or null. */
  parent: string | null
  /** The JSON object given to commit() as `meta`. */
  meta?: JsonObject
  /** How the tree arrived from the workspace: 'snapshot' is a read-only btrfs subvolume snapshot (no walk). */
  method?: CloneMethod
  /** btrfs: the tree is a read-only subvolume (kept modes; allocate and fork snapshot it). Absent elsewhere. */
  subvolume?: true
  /** What the template holds (at commit); absent when a snapshot made it (nothing was walked to measure). */
  usage?: TemplateUsage
  /** ms since the epoch of the last allocate from it (its commit until then). */
  lastUsedAt: number | null
  /** Replaced or removed while an allocate read it: removed by its last reader, or by a sweep. */
  retired: boolean
  /** `ERR_CORRUPT_METADATA` (with `path`), or the errno of reading template.json: the template cannot be used. */
  error?: VmspaceError
  /** A layer template (importImage): the layer applied onto its parent's tree. Absent for other templates. */
  layer?: LayerRecord
  /** An image template (importImage): the image it holds. Absent for other templates. */
  image?: ImageRecord
  /** A checkpoint (Workspace.checkpoint): the workspace it was made of and its retention. Absent for other templates. */
  checkpoint?: CheckpointRecord
  /** Its shared files (commit's `share`), index n being `shared/<n>`; absent when the template shares nothing. */
  shared?: SharedFile[]
}

/** A file every workspace made from the template holds as a hard link of one read-only inode. */
export interface SharedFile {
  /** Workspace-relative, as given to commit's `share`. */
  path: string
  /** Its size in bytes. */
  bytes: number
}

/** A layer template's record: the layer applied onto the parent layer template's tree (docs/images.md). */
export interface LayerRecord {
  /** The chain of diffIDs up to this layer (image-spec config.md, ChainID): `sha256:<hex>`. */
  chainId: string
  /** The digest of the layer's uncompressed tar: `sha256:<hex>`. */
  diffId: string
  /** The digest of the layer's blob as the source held it (compressed). */
  digest: string
  /** The blob's media type. */
  mediaType: string
  /** The blob's size in bytes. */
  size: number
}

/** An image template's record (template.json's `image`). */
export interface ImageRecord {
  /** The manifest's digest; for a docker-archive, its image config's digest (the image ID `docker save` names). */
  digest: string
  /** The ref the image was chosen by (the index's `org.opencontainers.image.ref.name`, a RepoTag), or null. */
  ref: string | null
  /** `os/architecture[/variant]` of the image. */
  platform: string
  /** 'tree': the template is the image's root file system; 'ext4': it holds `rootfs.ext4`, made from it. */
  format: 'tree' | 'ext4'
  /** The image config's `config` object (Env, Entrypoint, Cmd, User, WorkingDir, Labels, …) as the image gives it. */
  config: JsonObject
  /** The image's layers, lowest first. */
  layers: ImageRecordLayer[]
}

/** One layer as an image template's record keeps it. */
export interface ImageRecordLayer {
  /** The blob's digest (compressed): `sha256:<hex>`. */
  digest: string
  /** The digest of the uncompressed tar: `sha256:<hex>`. */
  diffId: string
  /** The layer template's key: the chain of diffIDs up to this layer (image-spec config.md, ChainID). */
  chainId: string
  /** The blob's size in bytes. */
  size: number
}

/** One layer of an imported image, as {@link Pool.importImage} reports it. */
export interface ImageLayer {
  /** The blob's digest (compressed). */
  digest: string
  /** The digest of the uncompressed tar. */
  diffId: string
  /** The layer template's key: the chain of diffIDs up to this layer. */
  chainId: string
  /** The blob's size in bytes. */
  size: number
  /** Whether the pool had the layer template already (nothing of the blob read). */
  reused: boolean
  /** Bytes of the blob this call read (0 when reused). */
  bytes: number
}

/** An image template: a {@link Template} (usable by allocate({ from }), fork, removeTemplate) with its image. */
export interface ImageTemplate extends Template {
  /** The image: its record, each layer as this call saw it. */
  image: ImageTemplateImage
}

/** {@link ImageTemplate.image}: the image's record with each layer's `reused` and `bytes`. */
export interface ImageTemplateImage extends Omit<ImageRecord, 'layers'> {
  /** The image's layers, lowest first. */
  layers: ImageLayer[]
}

/** What {@link Pool.removeImage} removed. */
export interface RemovedImage {
  /** The ids of the templates removed: the image template's first, then the layer templates no other image lists. */
  removed: string[]
}

/** Options of {@link Pool.importImage}. */
export interface ImportImageOptions {
  /** The image's ref in the source (its index's `org.opencontainers.image.ref.name`, a docker-archive's RepoTag);
   * required where the source holds several. Default: the one image there (or the ref in `oci:DIR:REF`). */
  ref?: string
  /** `os/architecture[/variant]`. Default: the host's (`linux/amd64`, `linux/arm64`, `linux/arm/v7`, …). */
  platform?: string
  /** The template's name. Default: the ref with every character outside `[A-Za-z0-9._-]` made `-` (alpine:3.20 → alpine-3.20). */
  name?: string
  /** 'tree' (default): the template is the root file system; 'ext4': it holds `rootfs.ext4` made from it. */
  format?: 'tree' | 'ext4'
  /** Replace a template of that name that holds another image (default false: `EEXIST`). */
  replace?: boolean
  /** With format 'ext4'. */
  ext4?: {
    /** Free space in the file system beyond what the tree takes, in bytes (default 128 MiB). */
    headroomBytes?: number
  }
  /** Abort the import: rejects with an AbortError; what it was building is removed at once. */
  signal?: AbortSignal
  /** Called as layer blobs are read: `bytes` read of `totalBytes` (the blobs not in the pool already). */
  onProgress?: (p: { bytes: number; totalBytes: number }) => void
}

/** What {@link Pool.commit} returns: the new template, how it was cloned, and what it replaced. */
export interface CommitResult extends Template {
  /** How the workspace's tree was cloned. */
  clone: CloneResult
  /** With `replace: true`: the template the name pointed to before, and whether it is gone already (false:
   * allocates were reading it; the last of them, or a sweep, removes it). */
  replaced?: {
    /** The replaced template's id. */
    id: string
    /** Whether it was removed at once (false: still being read; its last reader or a sweep removes it). */
    removed: boolean
  }
}

/** Options of {@link Pool.pruneTemplates}: which templates to remove. */
export interface PruneOptions {
  /** Keep the newest N templates (by createdAt) of each name; older ones of that name are removed. */
  keepNewest?: number
  /** Remove templates not used (allocated from, or committed) for this long, in ms. */
  unusedForMs?: number
  /** Only templates of this name. */
  name?: string
  /** Report, remove nothing. */
  dryRun?: boolean
}

// ---- checkpoints (lib/checkpoint.ts; docs/checkpoints.md) ----

/** Options of {@link Workspace.checkpoint} and {@link Pool.checkpoint}. */
export interface CheckpointOptions {
  /** A JSON object kept in the checkpoint's record (`Template.meta`). */
  meta?: JsonObject
  /** Workspace-relative regular files the checkpoint shares read-only (as commit()'s `share`). */
  share?: string[]
  /** As commit()'s: the guest's device nodes are carried only when true. Default false. */
  keepDevices?: boolean
  /** As commit()'s: set-id bits and security.capability are carried only when true. Default false. */
  keepSetId?: boolean
  /** Integer ≥ 1: keep this workspace's newest N checkpoints (this one counts), remove the rest. */
  keepNewest?: number
  /** Integer ≥ 1, in ms: remove this workspace's checkpoints older than this (never the new one). */
  maxAgeMs?: number
  /** Abort the checkpoint: rejects with an AbortError, nothing is left. */
  signal?: AbortSignal
  /** Called as the tree is cloned, with the files and bytes done so far. */
  onProgress?: (p: CloneProgressEvent) => void
}

/** template.json's `checkpoint`: whose checkpoint it is, and the retention it was made with. */
export interface CheckpointRecord {
  /** The workspace's id. */
  workspace: string
  /** The `keepNewest` it was made with (a sweep applies the newest checkpoint's). */
  keepNewest?: number
  /** The `maxAgeMs` it was made with (a sweep applies the newest checkpoint's). */
  maxAgeMs?: number
}

/** A workspace's checkpoint: an unnamed template (allocate({ from: id }) and removeTemplate(id) take it). */
export interface Checkpoint extends Template {
  checkpoint: CheckpointRecord
  /** Bytes of its tree that no other file shares now (FIEMAP): what removing it would give back. */
  exclusiveBytes: number
}

/** What a rollback did. */
export interface RollbackResult {
  /** The checkpoint's id. */
  checkpoint: string
  /** The old tree was removed now; false: it is left in the pool's trash (a mount inside, say) for a sweep. */
  removed: boolean
}

/** Pool.commit's options. */
export interface CommitOptions {
  /** The template's name: 1–128 of `[A-Za-z0-9._-]`, not 32 hex characters. Default: none (found by its id). */
  name?: string
  /** A JSON object kept in the template's record (`Template.meta`). */
  meta?: JsonObject
  /** With `name`: swap the name to the new template atomically and retire the old one. Default false (`EEXIST`). */
  replace?: boolean
  /** Abort the commit: rejects with an AbortError, nothing is left. */
  signal?: AbortSignal
  /** Called as the tree is cloned, with the files and bytes done so far. */
  onProgress?: (p: { files: number; bytes: number }) => void
  /**
   * Carry the workspace's device nodes into the template. Default false: a guest's device node (its host's disk,
   * say) is not made, and counted in `clone.skipped.devices` (docs/templates.md, "What a guest's tree may carry").
   */
  keepDevices?: boolean
  /** Carry set-user-ID/set-group-ID bits (of anything but directories) and security.capability. Default false. */
  keepSetId?: boolean
  /**
   * Files every workspace made from the template holds as a hard link of one read-only inode (`Template.shared`):
   * 1–64 workspace-relative paths of regular files, as given (no empty, `.` or `..` component; docs/templates.md,
   * "Shared files"). A file the workspace's template shared that is still that inode stays shared unnamed.
   */
  share?: string[]
}

/** Pool.fork's options. */
export interface ForkOptions {
  /** A JSON object kept in every child's record (`WorkspaceInfo.meta`). */
  meta?: JsonObject
  /** Every child's directory mode, as allocate()'s `mode`. */
  mode?: number
  /** Abort the fork: rejects with an AbortError; every child made is disposed. */
  signal?: AbortSignal
  /** Called after each child is made: `done` of `count`. */
  onProgress?: (p: { done: number; count: number }) => void
  /** As commit()'s: the guest's device nodes are carried only when true. Default false. */
  keepDevices?: boolean
  /** As commit()'s: set-id bits and security.capability are carried only when true. Default false. */
  keepSetId?: boolean
  /** As commit()'s: files every child holds as a hard link of one read-only inode. */
  share?: string[]
}

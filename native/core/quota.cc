#include "quota.h"

#include <fcntl.h>
#include <linux/btrfs.h>
#include <linux/dqblk_xfs.h>
#include <linux/fs.h>
#include <linux/quota.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "btrfs_subvol.h"
#include "error.h"
#include "fd.h"
#include "fs_kind.h"
#include "io.h"
#include "process.h"

#ifndef SYS_quotactl_fd
#define SYS_quotactl_fd 443  // Linux 5.14; the same number on every architecture (the unified syscall table)
#endif

namespace vmspace {
namespace {

constexpr int kMaxClaimTries = 64;

// quotactl_fd(2): the quotactl of the file system holding `fd` (man 2 quotactl_fd; no glibc wrapper).
int quotactlFd(int fd, int cmd, uint32_t id, void* addr) {
  return static_cast<int>(syscall(SYS_quotactl_fd, fd, static_cast<unsigned>(cmd), id, addr));
}

// /sys/fs/btrfs/<fsid> of the btrfs holding `fd` ("" when FS_INFO fails).
std::string btrfsSysfsDir(int fd) {
  struct btrfs_ioctl_fs_info_args info;
  memset(&info, 0, sizeof info);
  if (ioctl(fd, BTRFS_IOC_FS_INFO, &info) != 0) return {};
  char uuid[37];
  const unsigned char* u = info.fsid;
  // The buffer holds the 36 characters and the NUL: snprintf cannot truncate.
  (void)snprintf(uuid, sizeof uuid, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                 u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  return std::string("/sys/fs/btrfs/") + uuid;
}

uint64_t readSysfsNumber(const std::string& file, bool* ok) {
  std::string text;
  // sysfs files report st_size 4096 whatever they hold.
  if (readRegularFileAt(AT_FDCWD, file.c_str(), O_NOFOLLOW, 8192, &text) != 0 || text.empty()) {
    *ok = false;
    return 0;
  }
  return strtoull(text.c_str(), nullptr, 10);
}

[[noreturn]] void unsupported(const std::string& detail, int cause, const char* syscall, const std::string& path) {
  throwCode("ERR_QUOTA_UNSUPPORTED", detail, cause, syscall, path);
}

// Limits of project `id` (0: none); QIF_DQBLKSIZE (1 KiB) blocks, rounded up.
int setProjectLimits(int fd, uint32_t id, const QuotaLimits& limits) {
  struct if_dqblk q;
  memset(&q, 0, sizeof q);
  q.dqb_bhardlimit = (limits.bytes + QIF_DQBLKSIZE - 1) / QIF_DQBLKSIZE;
  q.dqb_ihardlimit = limits.inodes;
  q.dqb_valid = QIF_LIMITS;
  return quotactlFd(fd, QCMD(Q_SETQUOTA, PRJQUOTA), id, &q) == 0 ? 0 : errno;
}

// Claims a project id of `range` for workspace `name`: a file named for the id, made O_EXCL in `claimDirFd`, is
// the claim between the processes sharing the pool; an id some file on the file system is already charged to
// (a host's project, another pool's) is passed over. Returns the id.
uint32_t claimProjectId(int claimDirFd, int fsFd, const ProjectIdRange& range, const std::string& name,
                        const std::string& shown) {
  uint64_t span = uint64_t{range.last} - range.first + 1;
  for (int i = 0; i < kMaxClaimTries; i++) {
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, 0) != sizeof r) throwErrno(errno ? errno : EIO, "getrandom");
    uint32_t id = static_cast<uint32_t>(range.first + r % span);
    std::string file = std::to_string(id);
    UniqueFd fd(openat(claimDirFd, file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd) {
      if (errno == EEXIST) continue;
      throwErrno(errno, "open", shown + "/" + file);
    }
    if (int err = writeAll(fd.get(), name + "\n")) {
      unlinkat(claimDirFd, file.c_str(), 0);
      throwErrno(err, "write", shown + "/" + file);
    }
    struct if_dqblk q;
    memset(&q, 0, sizeof q);
    // ENOENT/ESRCH: no dquot for the id (XFS), i.e. nothing charged to it.
    if (quotactlFd(fsFd, QCMD(Q_GETQUOTA, PRJQUOTA), id, &q) == 0 && (q.dqb_curspace || q.dqb_curinodes)) {
      unlinkat(claimDirFd, file.c_str(), 0);
      continue;
    }
    return id;
  }
  throwCode("ERR_PROJECT_IDS_EXHAUSTED",
            "no free project id found in " + std::to_string(kMaxClaimTries) + " draws from " +
                std::to_string(range.first) + "-" + std::to_string(range.last),
            EEXIST, "open", shown);
}

}  // namespace

namespace {

// probeQuota on btrfs: qgroups enabled, and CAP_SYS_ADMIN to set their limits.
QuotaSupport probeBtrfsQuota(int dirFd) {
  QuotaSupport s;
  s.backend = QuotaBackend::Btrfs;
  std::string dir = btrfsSysfsDir(dirFd);
  bool ok = true;
  // The qgroups directory exists only while quotas are enabled (fs/btrfs/sysfs.c, Linux 5.9); `enabled` is 6.x.
  struct stat st;
  if (dir.empty() || stat((dir + "/qgroups").c_str(), &st) != 0) ok = false;
  if (ok && stat((dir + "/qgroups/enabled").c_str(), &st) == 0)
    ok = readSysfsNumber(dir + "/qgroups/enabled", &ok) != 0 && ok;
  if (!ok) {
    s.err = ENOTCONN;  // what BTRFS_IOC_QGROUP_LIMIT answers without quotas (btrfs_limit_qgroup)
    s.detail = "btrfs quotas (qgroups) are not enabled on this file system: run `btrfs quota enable <mount point>`";
  } else if (!hasCapSysAdmin()) {
    s.err = EPERM;
    s.detail = "setting a btrfs qgroup limit needs CAP_SYS_ADMIN";
  } else {
    s.err = 0;
    s.detail = "btrfs subvolume per workspace with a qgroup limit on its exclusive bytes";
  }
  return s;
}

// probeQuota on XFS or ext4 (`kind`): project quotas accounted and enforced, and CAP_SYS_ADMIN to set limits.
QuotaSupport probeProjectQuota(int dirFd, FsKind kind) {
  QuotaSupport s;
  s.backend = QuotaBackend::Project;
  s.inodes = true;
  const char* fs = fsKindName(kind);
  struct fs_quota_statv sv;
  memset(&sv, 0, sizeof sv);
  sv.qs_version = FS_QSTATV_VERSION1;
  if (quotactlFd(dirFd, QCMD(Q_XGETQSTATV, PRJQUOTA), 0, &sv) != 0) {
    s.err = errno;
    s.detail = std::string(fs) + " project quotas cannot be used here: quotactl_fd(Q_XGETQSTATV) failed" +
               (errno == ENOSYS ? " (no quotactl_fd before Linux 5.14, or no quota support in this kernel)" : "");
    return s;
  }
  if (!(sv.qs_flags & FS_QUOTA_PDQ_ACCT) || !(sv.qs_flags & FS_QUOTA_PDQ_ENFD)) {
    s.err = ESRCH;
    s.detail = std::string(fs) + " project quotas are not " + (sv.qs_flags & FS_QUOTA_PDQ_ACCT ? "enforced" : "on") +
               " (mount with -o prjquota" + (kind == FsKind::Ext4 ? "; the file system needs -O project,quota" : "") +
               ")";
    return s;
  }
  if (!hasCapSysAdmin()) {
    s.err = EPERM;
    s.detail = "setting project quota limits needs CAP_SYS_ADMIN";
    return s;
  }
  s.err = 0;
  s.detail = std::string(fs) + " project quota per workspace (project id inherited by everything made inside)";
  return s;
}

}  // namespace

QuotaSupport probeQuota(int dirFd) {
  QuotaSupport s;
  unsigned long magic = 0;
  FsKind kind = fsKindOf(dirFd, &magic);
  if (kind == FsKind::Unknown) {
    s.err = errno;
    s.detail = "statfs failed";
    return s;
  }
  if (kind == FsKind::Btrfs) return probeBtrfsQuota(dirFd);
  if (hasProjectQuotas(kind)) return probeProjectQuota(dirFd, kind);
  char hex[32];
  (void)snprintf(hex, sizeof hex, "0x%lx", magic);  // at most 18 characters: never truncated
  s.err = EOPNOTSUPP;
  s.detail = std::string("this file system (magic ") + hex +
             ") has no per-directory quota vmspace can set (btrfs with quotas, XFS/ext4 with project quotas)";
  return s;
}

QuotaSupport probeQuotaAt(const std::string& path) {
  UniqueFd fd(open(path.c_str(), kDirPathFlags));
  if (!fd) throwErrno(errno, "open", path);
  return probeQuota(fd.get());
}

int enableBtrfsQuota(const std::string& path, bool simple) {
  // BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA (Linux 6.7, include/uapi/linux/btrfs.h); older headers lack the name.
  constexpr __u64 kEnableSimpleQuota = 4;
  UniqueFd fd(open(path.c_str(), kDirPathFlags));
  if (!fd) throwErrno(errno, "open", path);
  struct btrfs_ioctl_quota_ctl_args args;
  memset(&args, 0, sizeof args);
  args.cmd = simple ? kEnableSimpleQuota : BTRFS_QUOTA_CTL_ENABLE;
  return ioctl(fd.get(), BTRFS_IOC_QUOTA_CTL, &args) == 0 ? 0 : errno;
}

QuotaRef applyQuota(int wsFd, const std::string& shown, const QuotaSupport& support, const QuotaLimits& limits,
                    int claimDirFd, const ProjectIdRange& range, const std::string& name) {
  QuotaRef ref;
  if (support.backend == QuotaBackend::Btrfs) {
    if (limits.inodes)
      unsupported("btrfs qgroups limit bytes, not inodes: quota.inodes cannot be set here", EINVAL,
                  "ioctl(BTRFS_IOC_QGROUP_LIMIT)", shown);
    struct stat st;
    if (fstat(wsFd, &st) != 0) throwErrno(errno, "fstat", shown);
    if (st.st_ino != kBtrfsFirstFreeObjectId)
      throwErrno(EINVAL, "ioctl(BTRFS_IOC_INO_LOOKUP)", shown);  // not a subvolume
    if (int err = subvolumeIdOf(wsFd, &ref.subvolId)) throwErrno(err, "ioctl(BTRFS_IOC_INO_LOOKUP)", shown);
    struct btrfs_ioctl_qgroup_limit_args args;
    memset(&args, 0, sizeof args);
    args.qgroupid = ref.subvolId;  // level 0: the subvolume's own qgroup, made with it while quotas are enabled
    // Exclusive bytes: what this workspace alone costs. Extents shared with the template (reflinks) are not
    // charged until the guest rewrites them; referenced bytes would charge the whole template at once.
    args.lim.flags = BTRFS_QGROUP_LIMIT_MAX_EXCL;
    args.lim.max_excl = limits.bytes;
    if (ioctl(wsFd, BTRFS_IOC_QGROUP_LIMIT, &args) != 0) {
      int err = errno;
      if (err == ENOTCONN)
        unsupported(
            "btrfs quotas (qgroups) are not enabled on the pool's file system: run `btrfs quota enable <mount point>`",
            err, "ioctl(BTRFS_IOC_QGROUP_LIMIT)", shown);
      if (err == EPERM)
        unsupported("setting a btrfs qgroup limit needs CAP_SYS_ADMIN", err, "ioctl(BTRFS_IOC_QGROUP_LIMIT)", shown);
      throwErrno(err, "ioctl(BTRFS_IOC_QGROUP_LIMIT)", shown);
    }
    return ref;
  }
  if (support.backend != QuotaBackend::Project || support.err)
    unsupported(support.detail, support.err ? support.err : EOPNOTSUPP, "quotactl_fd", shown);
  if (claimDirFd < 0) throwErrno(EBADF, "open", shown);
  ref.projectId = claimProjectId(claimDirFd, wsFd, range, name, shown);
  try {
    // The project id and the inherit flag go on the empty directory first: everything made inside afterwards
    // (clones, the guest's files) gets the id (FS_XFLAG_PROJINHERIT, man 2 ioctl_xfs_fsgetxattr).
    struct fsxattr fa;
    memset(&fa, 0, sizeof fa);
    if (ioctl(wsFd, FS_IOC_FSGETXATTR, &fa) != 0) throwErrno(errno, "ioctl(FS_IOC_FSGETXATTR)", shown);
    fa.fsx_projid = ref.projectId;
    fa.fsx_xflags |= FS_XFLAG_PROJINHERIT;
    if (ioctl(wsFd, FS_IOC_FSSETXATTR, &fa) != 0) {
      int err = errno;
      if (err == EOPNOTSUPP || err == ENOTTY)
        unsupported("the file system cannot set project ids (ext4 needs -O project)", err, "ioctl(FS_IOC_FSSETXATTR)",
                    shown);
      throwErrno(err, "ioctl(FS_IOC_FSSETXATTR)", shown);
    }
    if (int err = setProjectLimits(wsFd, ref.projectId, limits)) {
      if (err == ENOSYS || err == ESRCH || err == EPERM)
        unsupported(support.detail, err, "quotactl_fd(Q_SETQUOTA)", shown);
      throwErrno(err, "quotactl_fd(Q_SETQUOTA)", shown);
    }
  } catch (...) {
    unlinkat(claimDirFd, std::to_string(ref.projectId).c_str(), 0);
    throw;
  }
  return ref;
}

void renameProjectClaim(int claimDirFd, uint32_t id, const std::string& name) {
  if (claimDirFd < 0) return;
  UniqueFd fd(openat(claimDirFd, std::to_string(id).c_str(), O_WRONLY | O_TRUNC | O_NOFOLLOW | O_CLOEXEC));
  if (fd) writeAll(fd.get(), name + "\n");
}

QuotaRef quotaRefOf(int parentFd, const std::string& name, const ProjectIdRange& range, bool projects) {
  QuotaRef ref;
  // One fstatat for a workspace without a quota (the common case, on every dispose): a subvolume root is
  // inode 256, and project ids are looked for only where the pool has claimed some.
  struct stat st;
  if (fstatat(parentFd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode)) return ref;
  if (st.st_ino != kBtrfsFirstFreeObjectId && !projects) return ref;
  UniqueFd fd(openat(parentFd, name.c_str(), kDirFlags));
  if (!fd) return ref;
  FsKind kind = fsKindOf(fd.get());
  if (kind == FsKind::Unknown || fstat(fd.get(), &st) != 0) return ref;
  if (kind == FsKind::Btrfs) {
    if (st.st_ino == kBtrfsFirstFreeObjectId) subvolumeIdOf(fd.get(), &ref.subvolId);
  } else if (projects && hasProjectQuotas(kind)) {
    struct fsxattr fa;
    memset(&fa, 0, sizeof fa);
    if (ioctl(fd.get(), FS_IOC_FSGETXATTR, &fa) == 0 && fa.fsx_projid >= range.first && fa.fsx_projid <= range.last)
      ref.projectId = fa.fsx_projid;
  }
  return ref;
}

void releaseQuota(int fsFd, const QuotaRef& ref, int claimDirFd, const std::string& name) {
  if (ref.subvolId) {
    // Older kernels keep a deleted subvolume's qgroup until it is removed; newer ones refuse (EBUSY) while the
    // cleaner has not dropped the subvolume yet, and remove it themselves afterwards.
    struct btrfs_ioctl_qgroup_create_args args;
    memset(&args, 0, sizeof args);
    args.create = 0;
    args.qgroupid = ref.subvolId;
    ioctl(fsFd, BTRFS_IOC_QGROUP_CREATE, &args);
  }
  if (ref.projectId && claimDirFd >= 0) {
    std::string file = std::to_string(ref.projectId), owner;
    if (readRegularFileAt(claimDirFd, file.c_str(), O_NOFOLLOW, 4096, &owner) != 0 || owner != name + "\n") return;
    // Limits back to none before the id is free again: the next claimant sets its own.
    setProjectLimits(fsFd, ref.projectId, QuotaLimits{});
    unlinkat(claimDirFd, file.c_str(), 0);
  }
}

QuotaUsage quotaUsageOf(int wsFd, const QuotaRef& ref) {
  QuotaUsage u;
  if (ref.subvolId) {
    std::string dir = btrfsSysfsDir(wsFd);
    if (dir.empty()) return u;
    std::string q = dir + "/qgroups/0_" + std::to_string(ref.subvolId) + "/";
    bool ok = true;
    u.usedBytes = readSysfsNumber(q + "exclusive", &ok);
    u.limitBytes = readSysfsNumber(q + "max_exclusive", &ok);
    u.set = ok;
    return u;
  }
  if (ref.projectId) {
    struct if_dqblk q;
    memset(&q, 0, sizeof q);
    if (quotactlFd(wsFd, QCMD(Q_GETQUOTA, PRJQUOTA), ref.projectId, &q) != 0) return u;
    u.set = true;
    u.limitBytes = q.dqb_bhardlimit * QIF_DQBLKSIZE;
    u.limitInodes = q.dqb_ihardlimit;
    u.usedBytes = q.dqb_curspace;
    u.usedInodes = q.dqb_curinodes;
  }
  return u;
}

FsSpace fsSpace(int fd, const std::string& shown) {
  struct statvfs sv;
  if (fstatvfs(fd, &sv) != 0) throwErrno(errno, "statvfs", shown);
  FsSpace s;
  s.available = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
  s.free = static_cast<uint64_t>(sv.f_bfree) * sv.f_frsize;
  s.total = static_cast<uint64_t>(sv.f_blocks) * sv.f_frsize;
  return s;
}

}  // namespace vmspace

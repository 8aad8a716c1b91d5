// A template's commit (TemplateStore::commit): the tree built in staging (a btrfs snapshot, or a tree clone into a
// subvolume or a directory), its write bits stripped into the mode list, template.json written, then published
// under its id and named, and the template a replace displaced removed. What a failure undoes is undone here.
#include "template.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>
#include <utility>

#include "btrfs_subvol.h"
#include "error.h"
#include "fd.h"
#include "fs_kind.h"
#include "io.h"
#include "json_members.h"
#include "layout.h"
#include "names.h"
#include "pool.h"
#include "remove.h"
#include "rename.h"
#include "template_commit.h"
#include "template_modes.h"
#include "test_pause.h"
#include "tree.h"

namespace vmspace {
namespace {

// A new file `name` in the private directory `dirFd` with exactly `data` and `mode`.
void writeNewFile(int dirFd, const char* name, const std::string& data, mode_t mode, bool durable,
                  const std::string& shown) {
  UniqueFd fd(openat(dirFd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600));
  if (!fd) throwErrno(errno, "open", shown);
  if (int err = writeAll(fd.get(), data)) throwErrno(err, "write", shown);
  if (fchmod(fd.get(), mode) != 0) throwErrno(errno, "fchmod", shown);
  if (durable && fsync(fd.get()) != 0) throwErrno(errno, "fsync", shown);
}

// Snapshots the workspace at `sourcePath` (`readOnly` or writable) to tree/ below `leaseFd` when it is a subvolume
// (quota workspaces and workspaces allocated from a subvolume template are) with no subvolume inside (a snapshot would
// leave those out). False where it is not, or where the kernel refuses the snapshot (EPERM: a source owned by
// another user; EXDEV: another file system): the caller walks instead. Throws any other errno.
bool snapshotWorkspace(const std::string& sourcePath, int leaseFd, bool readOnly) {
  UniqueFd src(open(sourcePath.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOCTTY));
  if (!src) throwErrno(errno, "open", sourcePath);
  bool nested = true;
  if (!isSubvolumeRoot(src.get()) || hasChildSubvolumes(src.get(), &nested) != 0 || nested) return false;
  int err = snapshotSubvolume(src.get(), leaseFd, layout::kTree, readOnly);
  if (err == 0) return true;
  if (err == EPERM || err == EACCES || err == EXDEV || err == ENOTTY || err == EINVAL || err == EOPNOTSUPP)
    return false;
  throwErrno(err, "ioctl(BTRFS_IOC_SNAP_CREATE_V2)", sourcePath);
}

}  // namespace

bool isSubvolumeFs(int fd) { return fsKindOf(fd) == FsKind::Btrfs; }

TemplateCommit::TemplateCommit(TemplateStore& store, CommitRequest req)
    : store_(store), req_(std::move(req)), nameShown_(store.subPath(layout::kNames, req_.name)) {
  opts_ = req_.clone;
  opts_.overwrite = false;
}

CommitResult TemplateCommit::run() {
  checkName();
  openShares();
  UniqueFd lease = claimLease();
  try {
    makeTree(lease.get());
    if (!shares_.empty()) shareBytes_ = writeSharedFiles(lease.get(), stagingPath_, shares_, opts_);
  } catch (...) {
    cleanUp();
    throw;
  }
  finish(std::move(lease));
  return std::move(res_);
}

void TemplateCommit::checkName() {
  if (!req_.name.empty() && !req_.replace && entryExists(store_.namesFd_.get(), req_.name))
    throwErrno(EEXIST, "symlink", nameShown_);
}

void TemplateCommit::finish(UniqueFd lease) {
  try {
    UniqueFd tree(openat(lease.get(), layout::kTree, kDirFlags));
    if (!tree) throwErrno(errno, "open", stagingPath_ + "/tree");
    writeModes(lease.get(), tree.get());
    writeMeta(lease.get(), tree.get());
    publish(lease.get());
    if (!req_.layerKey.empty() && !claimLayerLink(lease.get())) return;
    if (!req_.name.empty() && req_.replace) swapName();
    lease.reset();
  } catch (...) {
    cleanUp();
    throw;
  }
  // Replaced by another commit while we held the lease (its removal could not lock it): now that the lease is
  // dropped, removed here, as a last reader would, unless someone reads it (then that reader, or a sweep, does).
  try {
    if (entryExists(store_.retiredFd_.get(), res_.id)) store_.removeIfFree(res_.id, -1);
  } catch (const Error&) {
    // Left retired: a sweep removes it.
  }
  if (!res_.replacedId.empty()) removeReplaced();
}

bool TemplateCommit::claimLayerLink(int leaseFd) {
  const int layersFd = store_.layersFd_.get();
  const std::string& key = req_.layerKey;
  const std::string shown = store_.subPath(layout::kLayers, key);
  for (int tries = 0;; tries++) {
    if (symlinkat(res_.id.c_str(), layersFd, key.c_str()) == 0) return true;
    if (errno != EEXIST || tries == kMaxNameTries) throwErrno(errno, "symlink", shown);
    // A link whose template is gone or retired counts as absent: replaced under the names lock, which every
    // replacement of a stale link takes (a fresh claim needs none: symlinkat never replaces).
    UniqueFd namesLock = store_.lockNames();
    std::string live = store_.liveLayer(key);
    if (!live.empty()) {
      // Another build of the same chain published first: ours goes, theirs is the answer.
      store_.removeIfFree(res_.id, leaseFd);
      published_ = false;
      res_.id = live;
      res_.existing = true;
      res_.allocatedBytes = 0;
      int err = readRegularFileAt(store_.fd_.get(), (live + "/" + layout::kTemplateMeta).c_str(), O_NOFOLLOW, 16 << 20,
                                  &res_.record);
      if (err) throwErrno(err, "open", store_.path(live) + "/" + layout::kTemplateMeta);
      return false;
    }
    if (unlinkat(layersFd, key.c_str(), 0) != 0 && errno != ENOENT) throwErrno(errno, "unlink", shown);
  }
}

void TemplateCommit::openShares() {
  if (req_.share.empty() && req_.parentId.empty()) return;
  UniqueFd ws(open(req_.sourcePath.c_str(), kDirPathFlags));
  if (!ws) throwErrno(errno, "open", req_.sourcePath);
  UniqueFd parent;
  if (isHexId(req_.parentId)) {
    parent.reset(openat(store_.fd_.get(), req_.parentId.c_str(), kDirFlags));
    if (!parent && errno != ENOENT) throwErrno(errno, "open", store_.path(req_.parentId));
  }
  shares_ = openShareSources(ws.get(), req_.sourcePath, req_.share, parent.get(), store_.path(req_.parentId));
  for (const ShareSource& s : shares_) sharePaths_.push_back(s.path);
  if (!sharePaths_.empty()) opts_.skipFiles = &sharePaths_;
}

// A fresh id in staging, leased: flock(LOCK_EX) on its directory, which a sweep honours. A sweep with graceMs 0
// may take the lease between our mkdir and flock and remove the entry: then the entry is no longer the one we
// locked (checked by device and inode) and a new id is claimed, so a build never works in a swept entry.
UniqueFd TemplateCommit::claimLease() {
  for (int tries = 0;; tries++) {
    claimId();
    stagingPath_ = store_.subPath(layout::kTemplateStaging, res_.id);
    UniqueFd lease(openat(store_.stagingFd_.get(), res_.id.c_str(), kDirFlags));
    if (!lease && errno != ENOENT) throwErrno(errno, "open", stagingPath_);
    if (lease) {
      if (flock(lease.get(), LOCK_EX) != 0) throwErrno(errno, "flock", stagingPath_);
      struct stat own;
      if (fstat(lease.get(), &own) != 0) throwErrno(errno, "fstat", stagingPath_);
      if (sameEntry(store_.stagingFd_.get(), res_.id, own)) return lease;
    }
    if (tries + 1 == kMaxNameTries) throwErrno(ENOENT, "open", stagingPath_);
  }
}

// The exclusive mkdir in staging claims a fresh id.
void TemplateCommit::claimId() {
  for (int tries = 0;; tries++) {
    if (tries == kMaxNameTries)
      throwCode("ERR_NAME_EXHAUSTED", "every template id drawn existed already", EEXIST, "mkdir",
                store_.subPath(layout::kTemplateStaging));
    res_.id = randomId();
    if (mkdirat(store_.stagingFd_.get(), res_.id.c_str(), 0700) == 0) break;
    if (errno != EEXIST) throwErrno(errno, "mkdir", store_.subPath(layout::kTemplateStaging, res_.id));
  }
}

// tree/ below the lease. On btrfs (reflink not 'never') the tree is a read-only subvolume (see template.h): a
// snapshot of a workspace that is a subvolume, else a subvolume the walk fills and that is then made read-only.
void TemplateCommit::makeTree(int leaseFd) {
  const bool subvolume = opts_.reflink != Reflink::Never && isSubvolumeFs(leaseFd);
  // A snapshot would carry the shared files in the tree: with them, the walk that leaves them out.
  if (subvolume && shares_.empty()) snapshotTree(leaseFd);
  if (!res_.clone.snapshot) {
    // A subvolume where one can be made (any user may: BTRFS_IOC_SUBVOL_CREATE needs only write access to
    // staging); where it is refused, a plain directory, whose template is then read-only by its modes only.
    bool sub = subvolume && makeWorkspaceDir(leaseFd, layout::kTree, 0700, true) == 0;
    if (!sub && mkdirat(leaseFd, layout::kTree, 0700) != 0)
      throwErrno(errno, "mkdir", stagingPath_ + "/" + layout::kTree);
    UniqueFd tree(openat(leaseFd, layout::kTree, kDirFlags));
    if (!tree) throwErrno(errno, "open", stagingPath_ + "/tree");
    res_.clone = cloneTreeInto(req_.sourcePath, tree.get(), stagingPath_ + "/tree", opts_, req_.progress);
    res_.readOnlySubvolume = sub;
  }
  res_.clone.tree = true;
  res_.readOnlySubvolume = res_.readOnlySubvolume || res_.clone.snapshot;
}

// tree/ as a snapshot of the workspace, where it is a subvolume (snapshotWorkspace). A snapshot carries every
// device node and set-id bit as it is: unless the caller keeps them both, it is made writable, what the tree clone
// would not make is taken out (dropGuestPrivileges), and then it is made read-only.
void TemplateCommit::snapshotTree(int leaseFd) {
  const bool filter = !opts_.keepDevices || !opts_.keepSetId;
  res_.clone.snapshot = snapshotWorkspace(req_.sourcePath, leaseFd, !filter);
  if (!res_.clone.snapshot || !filter) return;
  const std::string shown = stagingPath_ + "/tree";
  UniqueFd tree(openat(leaseFd, layout::kTree, kDirFlags));
  if (!tree) throwErrno(errno, "open", shown);
  dropGuestPrivileges(tree.get(), shown, opts_.keepDevices, opts_.keepSetId, &res_.clone.skippedDevices);
  if (int err = setSubvolumeReadOnly(tree.get(), true)) throwErrno(err, "ioctl(BTRFS_IOC_SUBVOL_SETFLAGS)", shown);
}

// The mode list (stripWriteBits), read-only once written.
void TemplateCommit::writeModes(int leaseFd, int treeFd) {
  const std::string modesShown = stagingPath_ + "/modes";
  ModesFile closer = openModesFile(leaseFd, O_WRONLY | O_CREAT | O_EXCL, "w", modesShown);
  FILE* f = closer.get();
  // A read-only subvolume keeps its modes (the flag refuses every write, root's included): the mode list
  // stays empty, and a walk is made only where one made the tree already (to measure it).
  if (!res_.clone.snapshot || changedAfterSnapshot_)
    stripWriteBits(treeFd, stagingPath_ + "/tree", f, &res_.allocatedBytes, !res_.readOnlySubvolume);
  if (fflush(f) != 0) throwErrno(errno, "write", modesShown);
  if (fchmod(fileno(f), 0444) != 0) throwErrno(errno, "fchmod", modesShown);
  if (opts_.durable && fsync(fileno(f)) != 0) throwErrno(errno, "fsync", modesShown);
  FILE* done = closer.release();
  if (fclose(done) != 0) throwErrno(errno, "close", modesShown);
}

// template.json and the last-used file, then the tree made read-only.
void TemplateCommit::writeMeta(int leaseFd, int treeFd) {
  // The caller's members, then those known here: the id, the name, how it was cloned, its usage.
  JsonMembers members = req_.info;
  std::string name;
  if (req_.name.empty())
    name = "null";
  else
    appendJsonString(&name, req_.name);
  members.emplace_back("id", "\"" + res_.id + "\"");
  members.emplace_back("name", std::move(name));
  members.emplace_back("method", std::string("\"") + methodName(res_.clone, req_.clone.reflink) + "\"");
  if (res_.readOnlySubvolume) members.emplace_back("subvolume", "true");
  // A snapshot does not walk the tree, so it is not measured: no usage (what it shares is the workspace's).
  if (!res_.clone.snapshot || changedAfterSnapshot_)
    members.emplace_back("usage", "{\"allocatedBytes\":" + std::to_string(res_.allocatedBytes) +
                                      ",\"files\":" + std::to_string(res_.clone.files) +
                                      ",\"bytes\":" + std::to_string(res_.clone.bytes) + "}");
  std::string shared = writeSharedPaths(leaseFd);
  if (!shared.empty()) members.emplace_back("shared", std::move(shared));
  std::string json = jsonObject(members) + "\n";
  writeNewFile(leaseFd, layout::kTemplateMeta, json, 0444, opts_.durable, stagingPath_ + "/" + layout::kTemplateMeta);
  res_.record = json;
  writeNewFile(leaseFd, layout::kUsed, "", 0644, false, stagingPath_ + "/" + layout::kUsed);
  if (opts_.durable && (fsync(treeFd) != 0 || fsync(leaseFd) != 0)) throwErrno(errno, "fsync", stagingPath_);
  // Read-only last (a snapshot was made so): the tree cannot change from here on, whoever holds it.
  if (res_.readOnlySubvolume && (!res_.clone.snapshot || changedAfterSnapshot_)) {
    if (int err = setSubvolumeReadOnly(treeFd, true))
      throwErrno(err, "ioctl(BTRFS_IOC_SUBVOL_SETFLAGS)", stagingPath_ + "/tree");
  }
}

std::string TemplateCommit::writeSharedPaths(int leaseFd) {
  if (shares_.empty()) return "";
  std::string json = "[", list;
  for (size_t i = 0; i < shares_.size(); i++) {
    if (i) json += ",";
    json += "{\"path\":";
    appendJsonString(&json, shares_[i].path);
    json += ",\"bytes\":" + std::to_string(shareBytes_[i]) + "}";
    list += shares_[i].path;
    list.push_back('\0');
  }
  writeNewFile(leaseFd, layout::kSharedPaths, list, 0444, opts_.durable, stagingPath_ + "/" + layout::kSharedPaths);
  return json + "]";
}

// Publish. Without replace the name is claimed first (symlinkat never replaces: EEXIST, nothing changed),
// so a name never points at a template another commit of the same name published.
void TemplateCommit::publish(int leaseFd) {
  testPausePoint("commit:before-publish");
  if (!req_.name.empty() && !req_.replace) {
    if (symlinkat(res_.id.c_str(), store_.namesFd_.get(), req_.name.c_str()) != 0)
      throwErrno(errno, "symlink", nameShown_);
    named_ = true;
  }
  if (renameat2(store_.stagingFd_.get(), res_.id.c_str(), store_.fd_.get(), res_.id.c_str(), RENAME_NOREPLACE) != 0)
    throwErrno(errno, "renameat2", stagingPath_, store_.path(res_.id));
  published_ = true;
  // 0555 only once published: moving a directory to another parent needs write permission on it (the kernel
  // rewrites its ".."; vfs_rename), which an owner without CAP_DAC_OVERRIDE lacks on a 0555 one (EACCES).
  if (fchmod(leaseFd, 0555) != 0) throwErrno(errno, "fchmod", store_.path(res_.id));
  if (opts_.durable && fsync(store_.fd_.get()) != 0) throwErrno(errno, "fsync", store_.dir_);
}

// Replace: the name's new target is swapped in with RENAME_EXCHANGE: a reader resolving it sees the old template
// or the new one, never no name. The swapped-out link tells which template was replaced.
void TemplateCommit::swapName() {
  const int namesFd = store_.namesFd_.get();
  // Named after the new id, whose directory the commit holds LOCK_EX on until the swap is done: a sweep leaves
  // the link while that lock is held, whatever graceMs (TemplateStore::sweep).
  std::string tmp = "." + req_.name + layout::kSwapInfix + res_.id;
  if (symlinkat(res_.id.c_str(), namesFd, tmp.c_str()) != 0)
    throwErrno(errno, "symlink", store_.subPath(layout::kNames, tmp));
  UniqueFd namesLock;
  try {
    namesLock = store_.lockNames();
  } catch (const Error&) {
    unlinkat(namesFd, tmp.c_str(), 0);
    throw;
  }
  for (;;) {
    if (renameat2(namesFd, tmp.c_str(), namesFd, req_.name.c_str(), RENAME_EXCHANGE) == 0) {
      named_ = true;
      std::string old;
      if (readLink(namesFd, tmp, &old) && isHexId(old) && old != res_.id) res_.replacedId = old;
      unlinkat(namesFd, tmp.c_str(), 0);  // ours; a leftover is swept as a temp name
      return;
    }
    if (errno == ENOENT) {  // no such name yet: claim it as a plain commit would
      if (renameat2(namesFd, tmp.c_str(), namesFd, req_.name.c_str(), RENAME_NOREPLACE) == 0) {
        named_ = true;
        return;
      }
      if (errno == EEXIST) continue;  // claimed meanwhile: swap with that one
    }
    int err = errno;
    unlinkat(namesFd, tmp.c_str(), 0);
    throwErrno(err, "renameat2", store_.subPath(layout::kNames, tmp), nameShown_);
  }
}

void TemplateCommit::cleanUp() {
  try {
    std::string target;
    UniqueFd namesLock = named_ && !req_.replace ? store_.lockNames() : UniqueFd();
    if (named_ && !req_.replace && readLink(store_.namesFd_.get(), req_.name, &target) && target == res_.id)
      unlinkat(store_.namesFd_.get(), req_.name.c_str(), 0);
    if (published_)
      store_.removeIfFree(res_.id, -1);  // never named: no reader can hold it
    else
      removeTemplateDir(store_.stagingFd_.get(), res_.id, stagingPath_);
  } catch (...) {
    // Left for a sweep; the original error is the one to report.
  }
}

// The new template is published and named: the commit has succeeded whatever happens to the old one here.
// Marked before the removal is tried, so that a reader holding it removes it when it is done. Where the
// marker cannot be made (EMFILE, ENOSPC), the old template stays as an unnamed one (replacedRemoved false;
// removeTemplate or pruneTemplates removes it).
void TemplateCommit::removeReplaced() {
  try {
    UniqueFd marker(
        openat(store_.retiredFd_.get(), res_.replacedId.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY, 0600));
    if (marker) {
      marker.reset();
      res_.replacedRemoved = store_.removeIfFree(res_.replacedId, -1);
    }
  } catch (const Error&) {
    res_.replacedRemoved = false;  // left in trash or retired: a sweep finishes it
  }
}

CommitResult TemplateStore::commit(const CommitRequest& req) { return TemplateCommit(*this, req).run(); }

}  // namespace vmspace

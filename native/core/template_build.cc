// A template build (template_build.h): the commit's phases (template_commit.h) around a tree the caller changes.
#include "template_build.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <utility>

#include "btrfs_subvol.h"
#include "error.h"
#include "fd.h"
#include "layout.h"
#include "quota.h"
#include "tree.h"

namespace vmspace {
namespace {

CommitRequest commitRequestOf(const BuildRequest& b) {
  CommitRequest c;
  c.clone.reflink = b.reflink;
  c.clone.durable = b.durable;
  // A layer's tree is the image's: its devices, set-id bits and capabilities are what the image says.
  c.clone.keepDevices = true;
  c.clone.keepSetId = true;
  c.progress = b.progress;
  return c;
}

}  // namespace

TemplateBuild::TemplateBuild(TemplateStore& store, const BuildRequest& request)
    : TemplateCommit(store, commitRequestOf(request)) {}

std::unique_ptr<TemplateBuild> TemplateBuild::start(TemplateStore& store, const BuildRequest& request) {
  std::unique_ptr<TemplateBuild> b(new TemplateBuild(store, request));
  TemplateReader parent;
  // Held (LOCK_SH) before anything is made: an unknown parent leaves nothing, and its removal waits for the clone.
  if (!request.parent.empty()) parent = store.acquire(request.parent);
  b->lease_ = b->claimLease();
  try {
    b->makeTreeFrom(parent);
    b->tree_.reset(openat(b->lease_.get(), layout::kTree, kDirFlags));
    if (!b->tree_) throwErrno(errno, "open", b->treePath());
  } catch (...) {
    store.release(parent);
    b->cleanUp();
    b->lease_.reset();
    throw;
  }
  store.release(parent);
  return b;
}

void TemplateBuild::makeTreeFrom(TemplateReader& parent) {
  const int leaseFd = lease_.get();
  const std::string shown = treePath();
  const bool subvolume = opts_.reflink != Reflink::Never && isSubvolumeFs(leaseFd);
  if (parent.subvolume && subvolume) {
    int err = snapshotSubvolume(parent.subvolume.get(), leaseFd, layout::kTree, false);
    if (err == 0) {
      res_.clone.tree = res_.clone.snapshot = true;
      res_.readOnlySubvolume = changedAfterSnapshot_ = true;
    } else if (err != EPERM && err != EACCES && err != EXDEV && err != ENOTTY && err != EOPNOTSUPP) {
      throwErrno(err, "ioctl(BTRFS_IOC_SNAP_CREATE_V2)", shown);
    }
  }
  if (!res_.clone.snapshot) {
    bool sub = subvolume && makeWorkspaceDir(leaseFd, layout::kTree, 0700, true) == 0;
    if (!sub && mkdirat(leaseFd, layout::kTree, 0700) != 0) throwErrno(errno, "mkdir", shown);
    res_.readOnlySubvolume = sub;
    res_.clone.tree = true;
  }
  if (!parent.fd) return;
  UniqueFd tree(openat(leaseFd, layout::kTree, kDirFlags));
  if (!tree) throwErrno(errno, "open", shown);
  if (!res_.clone.snapshot) {
    bool sub = res_.readOnlySubvolume;
    res_.clone = cloneTreeInto(parent.treePath, tree.get(), shown, opts_, req_.progress);
    res_.clone.tree = true;
    res_.readOnlySubvolume = sub;
  }
  store_.restoreModes(parent, tree.get(), shown);
}

CommitResult TemplateBuild::publish(const PublishRequest& request) {
  if (!lease_) throwErrno(EBADF, "templateBuildPublish", stagingPath_);
  if (!request.layerKey.empty() && (!request.name.empty() || !isLayerKey(request.layerKey)))
    throwCode("ERR_INVALID_ARG_VALUE", "a layer key is a chain key ('sha256-<hex>') of an unnamed template", EINVAL,
              "symlink", store_.subPath(layout::kLayers, request.layerKey));
  req_.info = request.info;
  req_.layerKey = request.layerKey;
  req_.name = request.name;
  req_.replace = request.replace;
  nameShown_ = store_.subPath(layout::kNames, req_.name);
  tree_.reset();
  try {
    checkName();
  } catch (...) {
    abandon();
    throw;
  }
  finish(std::move(lease_));
  return std::move(res_);
}

void TemplateBuild::abandon() noexcept {
  if (!lease_) return;
  tree_.reset();
  cleanUp();  // removes the staging entry; what it cannot is left under a free lease for a sweep
  lease_.reset();
}

}  // namespace vmspace

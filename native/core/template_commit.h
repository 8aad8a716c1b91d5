// A template's commit in phases (template_commit.cc): what TemplateStore::commit runs from a workspace, and what a
// build (template_build.h) runs around its own tree. No N-API here.
#pragma once

#include <string>

#include "clone.h"
#include "fd.h"
#include "share.h"
#include "template.h"

namespace vmspace {

// Whether the directory `fd` is on btrfs (where a template's tree is a read-only subvolume).
bool isSubvolumeFs(int fd);

// One commit of a template (TemplateStore::commit): a function per phase. An id is claimed in staging and leased;
// the tree is made there (a snapshot, or a subvolume or directory the walk fills), its write bits stripped into the
// mode list, template.json written; then it is published under its id and named (claimed, or swapped in for
// replace) or given its layer link, and a template it replaced is removed. Any failure before the end removes what
// it made.
class TemplateCommit {
 public:
  TemplateCommit(TemplateStore& store, CommitRequest req);
  CommitResult run();

 protected:
  // A name taken already is refused before anything is built; the symlinkat in publish decides for real.
  void checkName();
  // The shared files opened in the workspace (share.h), before anything is made: a bad one leaves nothing.
  void openShares();
  UniqueFd claimLease();
  void claimId();
  void makeTree(int leaseFd);
  void snapshotTree(int leaseFd);
  // The lease's tree/ as built, to a published template: the mode list, template.json, the publish, its name or
  // layer link; the lease is dropped at the end. Any failure removes what was made (cleanUp) and is rethrown.
  void finish(UniqueFd lease);
  void writeModes(int leaseFd, int treeFd);
  void writeMeta(int leaseFd, int treeFd);
  // The "shared" member of template.json and the shared-paths file ("" and none without shared files).
  std::string writeSharedPaths(int leaseFd);
  void publish(int leaseFd);
  // Claims layers/<layerKey> for the published template. False when another build's live template holds it: this
  // one is then removed and res_ describes that one (existing).
  bool claimLayerLink(int leaseFd);
  void swapName();
  void cleanUp();
  void removeReplaced();

  TemplateStore& store_;
  CommitRequest req_;
  std::string nameShown_;
  CloneOptions opts_;
  CommitResult res_;
  std::string stagingPath_;
  bool named_ = false, published_ = false;  // what a failure undoes: the name claimed, the template published
  bool changedAfterSnapshot_ = false;       // a build's snapshot that the build then changed: walked and made read-only
  std::vector<ShareSource> shares_;         // the commit's shared files, in index order
  std::vector<std::string> sharePaths_;     // their paths: what the tree clone leaves out
  std::vector<uint64_t> shareBytes_;        // their sizes, as written
};

}  // namespace vmspace

// Templates: committed, read-only trees in the pool that workspaces are cloned from.
// Every name below is layout.h's.
//   <root>/.vmspace/templates/            made on first commit (the pool format stays 1: older vmspace ignore it)
//     staging/<id>/                       a commit being built; its directory fd holds flock(LOCK_EX)
//     <id>/                               a published template, mode 0555: tree/ (write bits removed; on
//                                         btrfs a read-only subvolume instead, modes kept, see DESIGN.md),
//                                         template.json (0444), modes (0444), used (mtime: last allocate);
//                                         with shared files (share.h): shared/<n> (0444 inodes, dir 0555) and
//                                         shared-paths (0444: each path, NUL-terminated, in index order)
//     names/<name> -> <id>                a symlink: the name's current template
//     layers/<algo>-<hex> -> <id>         a symlink: the layer template of that chain id (an image's layer, see
//                                         docs/images.md); one whose template is gone or retired counts as absent
//     retired/<id>                        a marker: the template was replaced or removed while it was read;
//                                         the last reader, or a sweep, removes it
// Readers (allocate) hold flock(LOCK_SH) on <id>/ while they clone it; removal takes flock(LOCK_EX) and moves
// the template into .vmspace/trash/ first, so a reader sees a whole template or none.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "clone.h"
#include "fd.h"
#include "json_members.h"
#include "layout.h"
#include "tree.h"

namespace vmspace {

struct SweepReport;

struct CommitRequest {
  std::string sourcePath;  // the workspace directory
  std::string name;        // "" for an unnamed template; checked by the caller: [A-Za-z0-9][A-Za-z0-9._-]{0,127}
  JsonMembers info;        // the caller's members of template.json (createdAt, parent, meta); id and usage are added
  bool replace = false;    // an existing name is swapped to the new template (RENAME_EXCHANGE) instead of EEXIST
  std::string layerKey;    // "" or a layer's chain key (isLayerKey): layers/<layerKey> is claimed (never with a name)
  std::vector<std::string> share;  // workspace-relative paths of regular files to share (share.h), checked by lib/
  std::string parentId;            // the workspace's template ("" none): its shared inodes stay shared (share.h)
  CloneOptions clone;
  CloneProgress* progress = nullptr;
};

struct CommitResult {
  std::string id;
  std::string record;  // template.json as written
  CloneSummary clone;
  uint64_t allocatedBytes = 0;     // st_blocks * 512 over the template's tree, hard links once
  std::string replacedId;          // with replace: the template the name pointed to before ("" when none)
  bool replacedRemoved = false;    // it was removed at once (no reader); else the last reader or a sweep does
  bool readOnlySubvolume = false;  // btrfs: tree/ is a read-only subvolume (snapshot, or a walk into one)
  bool existing = false;           // layerKey: another build's template held it; `id` is that one, ours removed
};

struct TemplateListing {
  std::string id;
  std::string currentName;  // the name whose symlink points here ("" when none: unnamed, replaced, removed)
  std::string record;       // template.json when recordErrno == 0
  int recordErrno = 0;
  int64_t lastUsedMs = 0;  // ms since the epoch of the last allocate from it (the mtime of `used`)
  bool retired = false;
};

// A template held for reading: LOCK_SH on its directory, checked to be published and not retired.
struct TemplateReader {
  UniqueFd fd;
  std::string id, treePath, record;
  int recordErrno = 0;
  UniqueFd subvolume;  // btrfs: tree/ opened when it is a subvolume root (allocate snapshots it), else empty
  std::vector<std::string> shared;  // the paths of its shared files (share.h), in index order
};

class TemplateStore {
 public:
  // Opens .vmspace/templates of the pool at `root` whose .vmspace is `stateFd`, making it (and its
  // subdirectories) when `create`; nullptr when it is missing and not made. `trashFd` is the pool's trash.
  static std::unique_ptr<TemplateStore> open(int stateFd, const std::string& root, int trashFd, bool create,
                                             long long sharedGid);

  // Builds the template in staging (tree clone, write bits removed, metadata), then publishes it: a name is
  // claimed with symlinkat (EEXIST: nothing changed), or with `replace` swapped by RENAME_EXCHANGE.
  CommitResult commit(const CommitRequest& request);

  // Resolves `idOrName` and holds the template for reading. ERR_TEMPLATE_NOT_FOUND when there is none.
  TemplateReader acquire(const std::string& idOrName);
  // Gives the write bits the template removed back to the clone of its tree in `wsFd` (a private build), and
  // stamps the template used. Throws the first errno.
  void restoreModes(const TemplateReader& reader, int wsFd, const std::string& wsPath);
  // Drops the read lock; a retired template that no one else reads is removed. Never throws.
  void release(TemplateReader& reader) noexcept;

  std::vector<TemplateListing> list();
  // Unnames the template and removes it, or marks it retired while readers hold it (false). ERR_TEMPLATE_NOT_FOUND.
  // With `unlessCurrent` (prune): a template a name points to, or that a commit or reader holds, is left as it is
  // (*kept true, false returned). `bytes` (optional): what the removal gave back, as a sweep counts it.
  bool remove(const std::string& idOrName, std::string* id, bool unlessCurrent = false, bool* kept = nullptr,
              uint64_t* bytes = nullptr);
  // Reclaims half-built commits older than `graceMs` whose builder is gone, retired templates no one reads, and
  // names whose template was never published. Never touches a published template that is not retired.
  void sweep(bool dryRun, int64_t graceMs, SweepReport& report);

  // The live layer template of chain key `layerKey` (layers/<layerKey> pointing at a published template that is not
  // retired), or "".
  std::string findLayer(const std::string& layerKey);

  // The id the name link names/<name> holds now, or "" when there is none (or it is not a template name's link):
  // what a caller that listed the templates compares to see whether a replace ran meanwhile. Throws other errnos.
  std::string nameTarget(const std::string& name);

  std::string path(const std::string& id) const { return dir_ + "/" + id; }
  // templates/<sub> (a layout.h name: kNames, kRetired, kLayers, kTemplateStaging), or an entry of it, as errors show
  // it.
  std::string subPath(const char* sub) const { return dir_ + "/" + sub; }
  std::string subPath(const char* sub, const std::string& name) const { return subPath(sub) + "/" + name; }

 private:
  friend class TemplateCommit;  // template_commit.cc: commit's phases
  friend class TemplateBuild;   // template_build.cc: a build around the same phases
  TemplateStore() = default;
  std::string resolve(const std::string& idOrName, bool* byName);
  // flock(LOCK_EX) on names/ (a fresh open): name links are checked and changed under it (readers take none).
  UniqueFd lockNames();
  bool named(const std::string& id);                   // whether a name points to `id`
  std::string liveLayer(const std::string& layerKey);  // findLayer, for a checked key
  // Unlinks every layers/ link pointing at `id`, or (`id` "") at a template gone or retired. The caller holds
  // lockNames (a stale link is replaced under it). Returns how many went.
  size_t dropLayerLinks(const std::string& id, bool dryRun = false);
  bool liveSwapLink(const std::string& name);  // a replace's `.<name>.new-<id>` link whose commit is live
  // Removes the published template `id` when flock(LOCK_EX|LOCK_NB) gets it (fd: open on it, or -1): moved
  // into the pool's trash, then removed, then its retired marker dropped. False while readers hold it.
  bool removeIfFree(const std::string& id, int fd, uint64_t* bytes = nullptr);

  std::string dir_;  // <root>/.vmspace/templates
  std::string trashDir_;
  long long sharedGid_ = -1;
  UniqueFd fd_, stagingFd_, namesFd_, retiredFd_, layersFd_;
  int trashFd_ = -1;  // the pool's, not owned
};

// Removes the template directory `name` below `parentFd` (staging, trash): its tree/ first when it is a read-only
// subvolume (destroyed at once, or made writable for the walk: dropReadOnlySubvolume), then the walk.
void removeTemplateDir(int parentFd, const std::string& name, const std::string& shown, uint64_t* bytes = nullptr);

// Whether `name` is a template name as the caller checks it (names/ entries of other shapes are ignored).
bool isTemplateName(const std::string& name);

// Whether `key` is a layer's chain key as layers/ spells it: `<algo>-<hex>`, algo [a-z0-9]{1,16}, hex
// [0-9a-f]{32,128} (a digest `sha256:<hex>` with its colon written '-').
bool isLayerKey(const std::string& key);

}  // namespace vmspace

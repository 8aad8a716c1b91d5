// A pool of workspaces under one root directory (DESIGN.md, "The pool on disk"):
//   <root>/.vmspace/{version, staging/, trash/, meta/<name>.json}, and <root>/<prefix>-<32 hex> per workspace.
// Thread-safe: a Pool's fds are opened once and only read by concurrent operations; close() is called by the
// owner once no operation is running.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "clone.h"
#include "fd.h"
#include "tree.h"

namespace vmspace {

constexpr int kMaxNameTries = 16;   // DESIGN.md: EEXIST -> fresh name, at most 16 tries, then ERR_NAME_EXHAUSTED
constexpr const char* kFormatVersion = "1";

struct TemplateEntry {
  std::string dest;    // workspace-relative, normalised (checked by the caller)
  std::string source;  // absolute path of a regular file or a directory
};

struct AllocateRequest {
  std::string prefix;    // checked by the caller: [a-z0-9][a-z0-9_-]*
  mode_t mode = 0700;    // of the workspace directory, less the umask (as mkdir(2))
  std::string templateDir;  // a directory whose contents become the workspace's contents (empty: none)
  std::vector<TemplateEntry> entries;  // and/or single sources cloned to workspace-relative paths
  CloneProgress* progress = nullptr;   // running totals, and cancel (ECANCELED, rolled back)
  std::string infoJson;  // a JSON object written into the metadata file (the name and template are added)
  CloneOptions clone;    // reflink and durable apply to every template entry; overwrite is ignored
};

struct ClonedEntry {
  std::string dest;  // "" for templateDir
  std::string source;
  CloneSummary result;
  SourceIdentity identity;
};

struct AllocateResult {
  std::string id, name;
  int leaseFd = -1;  // O_RDONLY|O_DIRECTORY|O_CLOEXEC fd of the workspace, holding flock(LOCK_EX): the lease
  int retries = 0;   // names drawn again because the one drawn existed
  std::vector<ClonedEntry> clones;
};

struct ListEntry {
  std::string name;
  bool live = false;
  std::string metaText;  // contents of meta/<name>.json when metaErrno == 0
  int metaErrno = 0;
};

class Pool {
 public:
  // Opens (with `create`, makes) the pool at `root`, an absolute path. Errors: the errno of the failing syscall;
  // ERR_POOL_FORMAT when .vmspace/version names another format; EXDEV when .vmspace is on another file system.
  static std::shared_ptr<Pool> open(const std::string& root, bool create);

  // Builds a workspace in staging, takes its lease, clones the template, writes metadata, publishes it.
  // Any failure removes everything it made and throws. ERR_NAME_EXHAUSTED after kMaxNameTries collisions.
  AllocateResult allocate(const AllocateRequest& request);

  // Moves workspace `name` into trash, removes it safely, drops its metadata, closes `leaseFd`. The lease fd is
  // closed on every path, so that a sweep can finish what a failed removal left in trash.
  void dispose(const std::string& name, int leaseFd);

  // Published workspaces (every <prefix>-<32 hex> directory of the root) with liveness and metadata text.
  std::vector<ListEntry> list();

  void close();
  const std::string& root() const { return root_; }

 private:
  Pool() = default;
  std::string path(const std::string& name) const { return root_ + "/" + name; }
  std::string metaPath(const std::string& name) const { return root_ + "/.vmspace/meta/" + name + ".json"; }
  // Writes meta/<name>.json atomically; false (nothing written) when it exists already.
  bool publishMeta(const std::string& name, const std::string& json, bool durable);

  std::string root_;
  UniqueFd rootFd_, stateFd_, stagingFd_, trashFd_, metaFd_;
};

// Reads /proc/sys/kernel/random/boot_id once (empty where it cannot be read).
const std::string& bootId();

}  // namespace vmspace

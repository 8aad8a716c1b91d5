// The pool's on-disk layout (docs/pool-on-disk.md), in one place: the name of every entry vmspace makes below a
// pool's root, and the paths errors show for them. Names are relative to their parent directory (what the core
// opens by fd); the path builders take the pool's root (an absolute path) and give what a user reads in an error.
//   <root>/.vmspace/          version, staging/s<i>/, trash/, leases/<x>/, cache/, templates/, projects/
//   <root>/<prefix>-<32 hex>  a published workspace (names.h, pool.h)
// No syscalls here.
#pragma once

#include <string>
#include <string_view>

namespace vmspace::layout {

// ---- the root ----
inline constexpr char kStateDir[] = ".vmspace";          // the pool's own directory
inline constexpr char kInitPrefix[] = ".vmspace.init-";  // a new pool's .vmspace/ while it is built (then renamed)

// ---- .vmspace/ ----
inline constexpr char kVersion[] = "version";             // holds kVersionText and a newline
inline constexpr char kVersionText[] = "vmspace-pool 1";  // the one layout: anything else is ERR_POOL_FORMAT
inline constexpr char kStaging[] = "staging";             // staging/s<i>/: workspaces being built, a shard per thread
inline constexpr char kTrash[] = "trash";                 // workspaces (and template-<id>) being removed
inline constexpr char kLeases[] = "leases";               // leases/<x>/<name>: lease files, <x> the id's first digit
inline constexpr char kCache[] = "cache";                 // single-file template sources of other file systems
inline constexpr char kTemplates[] = "templates";         // committed templates, made by the first commit
inline constexpr char kProjects[] = "projects";           // project id claims (XFS/ext4 quotas), made on first use
inline constexpr char kNoReplaceProbe[] = ".noreplace-probe-";  // an opener's RENAME_NOREPLACE probe file

// ---- leases/<x>/ and cache/: entries that are not a workspace's ----
inline constexpr char kSparePrefix[] = ".spare-";  // leases/<x>/.spare-<hex>: a kept lease file (pool.h, Spare)
inline constexpr char kTmpPrefix[] = ".tmp-";      // a file being made where there is no O_TMPFILE
inline constexpr char kLockPrefix[] = ".lock-";    // cache/.lock-<key>: the key's lock file

// ---- trash/ ----
inline constexpr char kTrashedTemplatePrefix[] = "template-";  // trash/template-<id>: a template being removed

// ---- templates/ ----
inline constexpr char kTemplateStaging[] = "staging";  // templates/staging/<id>: a commit being built
inline constexpr char kNames[] = "names";              // names/<name> -> <id>
inline constexpr char kRetired[] = "retired";          // retired/<id>: a marker, removed by the last reader
inline constexpr char kLayers[] = "layers";            // layers/<algo>-<hex> -> <id>
inline constexpr char kSwapInfix[] = ".new-";          // names/.<name>.new-<id>: a replace's link before its swap

// ---- templates/<id>/ (a checkpoint has no place of its own: it is an unnamed template whose template.json holds
// "checkpoint"; an image's layers are templates linked from layers/) ----
inline constexpr char kTree[] = "tree";                   // the template's files
inline constexpr char kTemplateMeta[] = "template.json";  // its record
inline constexpr char kModes[] = "modes";                 // the write bits removed from tree/ (template_modes.h)
inline constexpr char kUsed[] = "used";                   // mtime: the last allocate from it
inline constexpr char kShared[] = "shared";               // shared/<n>: inodes linked into every child (share.h)
inline constexpr char kSharedPaths[] = "shared-paths";    // the shared files' paths, in index order

// ---- outside the pool's own directories ----
// A file or tree clonePath builds in its destination's directory before it takes its name.
inline constexpr char kCloneTmpPrefix[] = ".vmspace-tmp-";

// Whether `name` starts with `prefix` (the sweep's matches of .spare-, .tmp-, template-, ...).
inline bool hasPrefix(std::string_view name, std::string_view prefix) {
  return name.substr(0, prefix.size()) == prefix;
}

// The names of staging shard `i` (s<i>) and lease shard `i` (its hex digit, 0 ... f).
std::string stagingShardName(int i);
std::string leaseShardName(int i);

// The lease shard of workspace `name` ("<prefix>-<32 hex>"): its id's first hex digit, spreading names over them.
std::string leaseShardOf(const std::string& name);
// The lease file of workspace `name` relative to leases/ ("<x>/<name>").
std::string leaseRel(const std::string& name);

// Paths of the pool at `root`, as errors show them.
std::string statePath(const std::string& root);                                 // <root>/.vmspace
std::string statePath(const std::string& root, std::string_view entry);         // <root>/.vmspace/<entry>
std::string stagingShardPath(const std::string& root, int shard);               // .vmspace/staging/s<i>
std::string trashPath(const std::string& root, const std::string& name);        // .vmspace/trash/<name>
std::string leaseShardPath(const std::string& root, const std::string& shard);  // .vmspace/leases/<x>
std::string leasePath(const std::string& root, const std::string& name);        // .vmspace/leases/<x>/<name>
std::string templatesPath(const std::string& root);                             // .vmspace/templates
std::string templateDir(const std::string& root, const std::string& id);        // .vmspace/templates/<id>
std::string templateMetaPath(const std::string& root, const std::string& id);   // <id>/template.json

}  // namespace vmspace::layout

// The template store (template.h): opening templates/, resolving names, readers' locks (acquire, release),
// listing, removal, pruning and the sweep of what dead commits and readers left. The commit is template_commit.cc's,
// the mode list template_modes.cc's.
#include "template.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "btrfs_subvol.h"
#include "error.h"
#include "fd.h"
#include "io.h"
#include "layout.h"
#include "names.h"
#include "remove.h"
#include "rename.h"
#include "share.h"
#include "sweep_report.h"
#include "trusted.h"

namespace vmspace {
namespace {

constexpr size_t kMaxTemplateMetaBytes = 16 << 20;
constexpr int kMaxResolveTries = 16;  // a name swapped or removed under a reader this often in a row: not found

[[noreturn]] void notFound(const std::string& idOrName, const std::string& shown) {
  throwCode("ERR_TEMPLATE_NOT_FOUND", "no template with the id or name '" + idOrName + "'", ENOENT, "open", shown);
}

}  // namespace

void removeTemplateDir(int parentFd, const std::string& name, const std::string& shown, uint64_t* bytes) {
  UniqueFd dir(openat(parentFd, name.c_str(), kDirFlags));
  if (dir) dropReadOnlySubvolume(dir.get(), layout::kTree);
  dir.reset();
  removeTreeNoFollow(parentFd, name, shown, bytes);
}

bool isTemplateName(const std::string& name) {
  if (name.empty() || name.size() > 128 || isHexId(name)) return false;
  for (size_t i = 0; i < name.size(); i++) {
    char c = name[i];
    bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    if (!alnum && (i == 0 || (c != '.' && c != '_' && c != '-'))) return false;
  }
  return true;
}

bool isLayerKey(const std::string& key) {
  size_t dash = key.find('-');
  if (dash == std::string::npos || dash == 0 || dash > 16) return false;
  for (size_t i = 0; i < dash; i++)
    if (!((key[i] >= 'a' && key[i] <= 'z') || (key[i] >= '0' && key[i] <= '9'))) return false;
  size_t hex = key.size() - dash - 1;
  if (hex < 32 || hex > 128) return false;
  for (size_t i = dash + 1; i < key.size(); i++)
    if (!((key[i] >= 'a' && key[i] <= 'f') || (key[i] >= '0' && key[i] <= '9'))) return false;
  return true;
}

std::unique_ptr<TemplateStore> TemplateStore::open(int stateFd, const std::string& root, int trashFd, bool create,
                                                   long long sharedGid) {
  std::unique_ptr<TemplateStore> s(new TemplateStore());
  s->dir_ = layout::templatesPath(root);
  s->trashDir_ = layout::statePath(root, layout::kTrash);
  s->trashFd_ = trashFd;
  s->sharedGid_ = sharedGid;
  // Checked as every directory of the pool (trusted.h), made with the mode of the pool's own: 0700, or 02770 in
  // the shared group.
  const Trust trust{geteuid(), sharedGid};
  const mode_t mode = sharedGid >= 0 ? 02770 : 0700;
  s->fd_ = openPoolDir(stateFd, layout::kTemplates, s->dir_, create, mode, trust);
  if (!s->fd_) return nullptr;
  // The subdirectories are made whenever they are missing: a pool whose templates/ an older build of this
  // code made (or a process killed between two mkdirs) is completed, never refused.
  s->stagingFd_ =
      openPoolDir(s->fd_.get(), layout::kTemplateStaging, s->subPath(layout::kTemplateStaging), true, mode, trust);
  s->namesFd_ = openPoolDir(s->fd_.get(), layout::kNames, s->subPath(layout::kNames), true, mode, trust);
  s->retiredFd_ = openPoolDir(s->fd_.get(), layout::kRetired, s->subPath(layout::kRetired), true, mode, trust);
  s->layersFd_ = openPoolDir(s->fd_.get(), layout::kLayers, s->subPath(layout::kLayers), true, mode, trust);
  return s;
}

std::string TemplateStore::resolve(const std::string& idOrName, bool* byName) {
  *byName = !isHexId(idOrName);
  if (!*byName) return idOrName;
  std::string shown = subPath(layout::kNames, idOrName);
  if (!isTemplateName(idOrName)) notFound(idOrName, shown);
  std::string id;
  if (!readLink(namesFd_.get(), idOrName, &id)) {
    if (errno == ENOENT || errno == EINVAL) notFound(idOrName, shown);  // EINVAL: not a symlink, not a name
    throwErrno(errno, "readlink", shown);
  }
  if (!isHexId(id)) notFound(idOrName, shown);
  return id;
}

TemplateReader TemplateStore::acquire(const std::string& idOrName) {
  for (int attempt = 0; attempt < kMaxResolveTries; attempt++) {
    bool byName;
    std::string id = resolve(idOrName, &byName);
    TemplateReader r;
    r.fd.reset(openat(fd_.get(), id.c_str(), kDirFlags));
    if (!r.fd) {
      if (errno != ENOENT && errno != ENOTDIR && errno != ELOOP) throwErrno(errno, "open", path(id));
      if (byName) continue;  // swapped or removed since the name was read: read it again
      notFound(idOrName, path(id));
    }
    // Blocks only while a removal holds LOCK_EX, which it takes after our open only to move the template away.
    if (flock(r.fd.get(), LOCK_SH) != 0) throwErrno(errno, "flock", path(id));
    struct stat own;
    if (fstat(r.fd.get(), &own) != 0) throwErrno(errno, "fstat", path(id));
    if (!sameEntry(fd_.get(), id, own) || entryExists(retiredFd_.get(), id)) {
      if (byName) continue;
      notFound(idOrName, path(id));
    }
    r.id = id;
    r.treePath = path(id) + "/" + layout::kTree;
    UniqueFd tree(openat(r.fd.get(), layout::kTree, kDirFlags));
    if (tree && isSubvolumeRoot(tree.get())) r.subvolume = std::move(tree);
    r.recordErrno = readRegularFileAt(r.fd.get(), layout::kTemplateMeta, O_NOFOLLOW, kMaxTemplateMetaBytes, &r.record);
    // A template whose metadata cannot be read is refused before anything is made (lib/ checks that it parses).
    if (r.recordErrno) throwErrno(r.recordErrno, "open", path(id) + "/" + layout::kTemplateMeta);
    r.shared = readSharedPaths(r.fd.get(), path(id) + "/" + layout::kSharedPaths);
    return r;
  }
  notFound(idOrName, subPath(layout::kNames, idOrName));
}

void TemplateStore::release(TemplateReader& reader) noexcept {
  if (!reader.fd) return;
  try {
    if (entryExists(retiredFd_.get(), reader.id)) removeIfFree(reader.id, reader.fd.get());
  } catch (...) {
    // Left retired: a sweep removes it.
  }
  reader.fd.reset();
}

bool TemplateStore::removeIfFree(const std::string& id, int fd, uint64_t* bytes) {
  UniqueFd own;
  if (fd < 0) {
    own.reset(openat(fd_.get(), id.c_str(), kDirFlags));
    if (!own) {
      if (errno != ENOENT) throwErrno(errno, "open", path(id));
      unlinkat(retiredFd_.get(), id.c_str(), 0);  // its template is gone already
      return true;
    }
    fd = own.get();
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) return false;
    throwErrno(errno, "flock", path(id));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) throwErrno(errno, "fstat", path(id));
  if (!sameEntry(fd_.get(), id, st)) return true;  // moved away by another removal meanwhile
  // Into the pool's trash first: the id is gone atomically, and a removal that fails partway is finished by
  // the sweep's trash pass, never left as a partial template.
  std::string trashName = layout::kTrashedTemplatePrefix + id;
  // The move to another parent needs write permission on the 0555 directory (see commit): given back first by
  // its owner. Refused (EPERM: another user's), the renameat2 below reports its EACCES.
  if (!(st.st_mode & S_IWUSR) && fchmod(fd, (st.st_mode & 07777) | S_IWUSR) != 0) {
    // deliberately ignored: see above
  }
  if (renameat2(fd_.get(), id.c_str(), trashFd_, trashName.c_str(), RENAME_NOREPLACE) != 0) {
    if (errno == ENOENT) return true;
    throwErrno(errno, "renameat2", path(id), trashDir_ + "/" + trashName);
  }
  unlinkat(retiredFd_.get(), id.c_str(), 0);
  removeTemplateDir(trashFd_, trashName, trashDir_ + "/" + trashName, bytes);
  return true;
}

std::vector<TemplateListing> TemplateStore::list() {
  std::unordered_map<std::string, std::string> names;  // id -> current name
  for (auto& entry : readNames(namesFd_.get(), subPath(layout::kNames))) {
    std::string id;
    if (isTemplateName(entry.first) && readLink(namesFd_.get(), entry.first, &id) && isHexId(id))
      names[id] = entry.first;
  }
  std::vector<TemplateListing> out;
  for (auto& entry : readNames(fd_.get(), dir_)) {
    if (!isHexId(entry.first)) continue;
    UniqueFd fd(openat(fd_.get(), entry.first.c_str(), kDirFlags));
    if (!fd) continue;  // removed meanwhile
    TemplateListing t;
    t.id = entry.first;
    auto it = names.find(t.id);
    if (it != names.end()) t.currentName = it->second;
    t.recordErrno = readRegularFileAt(fd.get(), layout::kTemplateMeta, O_NOFOLLOW, kMaxTemplateMetaBytes, &t.record);
    struct statx stx;
    if (statx(fd.get(), layout::kUsed, AT_SYMLINK_NOFOLLOW, STATX_MTIME, &stx) == 0)
      t.lastUsedMs = stx.stx_mtime.tv_sec * 1000 + stx.stx_mtime.tv_nsec / 1000000;
    t.retired = entryExists(retiredFd_.get(), t.id);
    out.push_back(std::move(t));
  }
  return out;
}

bool TemplateStore::named(const std::string& id) {
  for (auto& entry : readNames(namesFd_.get(), subPath(layout::kNames))) {
    std::string target;
    if (isTemplateName(entry.first) && readLink(namesFd_.get(), entry.first, &target) && target == id) return true;
  }
  return false;
}

bool TemplateStore::remove(const std::string& idOrName, std::string* idOut, bool unlessCurrent, bool* kept,
                           uint64_t* bytes) {
  bool byName;
  std::string id = resolve(idOrName, &byName);
  if (!entryExists(fd_.get(), id) || entryExists(retiredFd_.get(), id)) notFound(idOrName, path(id));
  *idOut = id;
  if (unlessCurrent) {
    // Prune: a template a name points to is kept. LOCK_EX first: a commit holds it from its publish until its
    // name is swapped in (a published template not named yet may be about to be current), readers hold LOCK_SH;
    // held, the template is kept for a later prune. Got, no name can come to point here any more.
    *kept = true;
    UniqueFd fd(openat(fd_.get(), id.c_str(), kDirFlags));
    if (!fd) {
      if (errno == ENOENT) notFound(idOrName, path(id));
      throwErrno(errno, "open", path(id));
    }
    if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK) return false;
      throwErrno(errno, "flock", path(id));
    }
    if (named(id)) return false;
    *kept = false;
    UniqueFd marker(openat(retiredFd_.get(), id.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY, 0600));
    if (!marker) throwErrno(errno, "open", subPath(layout::kRetired, id));
    marker.reset();
    {
      UniqueFd namesLock = lockNames();
      dropLayerLinks(id);
    }
    return removeIfFree(id, fd.get(), bytes);
  }
  // Retired first, so that a reader resolving the name meanwhile skips it; then every name pointing here goes.
  UniqueFd marker(openat(retiredFd_.get(), id.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY, 0600));
  if (!marker) throwErrno(errno, "open", subPath(layout::kRetired, id));
  marker.reset();
  UniqueFd namesLock = lockNames();  // a replace swapping a new template into the name between check and unlink
  for (auto& entry : readNames(namesFd_.get(), subPath(layout::kNames))) {
    std::string target;
    if (readLink(namesFd_.get(), entry.first, &target) && target == id &&
        unlinkat(namesFd_.get(), entry.first.c_str(), 0) != 0 && errno != ENOENT)
      throwErrno(errno, "unlink", subPath(layout::kNames, entry.first));
  }
  dropLayerLinks(id);
  return removeIfFree(id, -1, bytes);
}

std::string TemplateStore::findLayer(const std::string& layerKey) {
  if (!isLayerKey(layerKey))
    throwCode("ERR_INVALID_ARG_VALUE", "not a layer key: '" + layerKey + "'", EINVAL, "readlink",
              subPath(layout::kLayers, layerKey));
  return liveLayer(layerKey);
}

std::string TemplateStore::nameTarget(const std::string& name) {
  std::string id;
  if (!isTemplateName(name)) return "";
  if (!readLink(namesFd_.get(), name, &id)) {
    if (errno == ENOENT || errno == EINVAL) return "";  // EINVAL: not a symlink
    throwErrno(errno, "readlink", subPath(layout::kNames, name));
  }
  return id;
}

std::string TemplateStore::liveLayer(const std::string& layerKey) {
  std::string id;
  if (!readLink(layersFd_.get(), layerKey, &id)) {
    if (errno == ENOENT || errno == EINVAL) return "";
    throwErrno(errno, "readlink", subPath(layout::kLayers, layerKey));
  }
  if (!isHexId(id) || !entryExists(fd_.get(), id) || entryExists(retiredFd_.get(), id)) return "";
  return id;
}

size_t TemplateStore::dropLayerLinks(const std::string& id, bool dryRun) {
  size_t dropped = 0;
  for (auto& entry : readNames(layersFd_.get(), subPath(layout::kLayers))) {
    std::string target;
    if (!readLink(layersFd_.get(), entry.first, &target)) continue;
    bool drop = id.empty() ? !isLayerKey(entry.first) || liveLayer(entry.first).empty() : target == id;
    if (!drop) continue;
    if (!dryRun && unlinkat(layersFd_.get(), entry.first.c_str(), 0) != 0) {
      if (errno == ENOENT) continue;
      throwErrno(errno, "unlink", subPath(layout::kLayers, entry.first));
    }
    dropped++;
  }
  return dropped;
}

UniqueFd TemplateStore::lockNames() {
  // An open file description of our own: flock is per description, and namesFd_ is shared by this process's
  // threads, whose lock would not exclude one another.
  UniqueFd fd(openat(fd_.get(), layout::kNames, kDirFlags));
  if (!fd) throwErrno(errno, "open", subPath(layout::kNames));
  if (flock(fd.get(), LOCK_EX) != 0) throwErrno(errno, "flock", subPath(layout::kNames));
  return fd;
}

bool TemplateStore::liveSwapLink(const std::string& name) {
  size_t at = name.rfind(layout::kSwapInfix);
  if (name.empty() || name[0] != '.' || at == std::string::npos) return false;
  std::string id = name.substr(at + strlen(layout::kSwapInfix));
  if (!isHexId(id)) return false;
  UniqueFd fd(openat(fd_.get(), id.c_str(), kDirFlags));
  if (!fd) return false;
  // The committing process holds LOCK_EX on the template until its swap is done; readers hold LOCK_SH only.
  return flock(fd.get(), LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
}

void TemplateStore::sweep(bool dryRun, int64_t graceMs, SweepReport& report) {
  auto failed = [&](const std::string& name, const char* from, const Error& e) {
    report.failed.push_back({name, from, 0, e});
  };
  // Commits whose builder is gone: a free lease and past the grace period (a build locks its entry at once).
  for (auto& entry : readNames(stagingFd_.get(), subPath(layout::kTemplateStaging))) {
    const std::string& id = entry.first;
    std::string shown = subPath(layout::kTemplateStaging, id);
    try {
      if (ageMs(stagingFd_.get(), id) < graceMs) continue;
      UniqueFd fd(openat(stagingFd_.get(), id.c_str(), kDirFlags));
      if (!fd && errno == ENOENT) continue;
      if (fd && flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK) continue;
        throwErrno(errno, "flock", shown);
      }
      SweepEntry e{layout::kTrashedTemplatePrefix + id, "template-staging", 0, {}};
      if (!dryRun) removeTemplateDir(stagingFd_.get(), id, shown, &e.bytes);
      report.reclaimed.push_back(std::move(e));
    } catch (const Error& e) {
      if (!(e.code.empty() && e.err == ENOENT && e.path == shown))
        failed(layout::kTrashedTemplatePrefix + id, "template-staging", e);
    }
  }
  // Retired templates no reader holds any more (their last reader was killed before it could remove them).
  for (auto& entry : readNames(retiredFd_.get(), subPath(layout::kRetired))) {
    const std::string& id = entry.first;
    if (!isHexId(id)) continue;
    try {
      if (dryRun) {
        UniqueFd fd(openat(fd_.get(), id.c_str(), kDirFlags));
        if (fd && flock(fd.get(), LOCK_EX | LOCK_NB) == 0)
          report.reclaimed.push_back({layout::kTrashedTemplatePrefix + id, "template", 0, {}});
        continue;
      }
      SweepEntry e{layout::kTrashedTemplatePrefix + id, "template", 0, {}};
      if (entryExists(fd_.get(), id) && removeIfFree(id, -1, &e.bytes))
        report.reclaimed.push_back(std::move(e));
      else if (!entryExists(fd_.get(), id))
        unlinkat(retiredFd_.get(), id.c_str(), 0);
    } catch (const Error& e) {
      failed(layout::kTrashedTemplatePrefix + id, "template", e);
    }
  }
  // Layer links whose template is gone or retired (its removal by a last reader leaves the link).
  try {
    UniqueFd namesLock = lockNames();
    dropLayerLinks("", dryRun);
  } catch (const Error& e) {
    failed("layers", "template", e);
  }
  // Names of commits that died between claiming the name and publishing, and swap temp links of dead replaces.
  for (auto& entry : readNames(namesFd_.get(), subPath(layout::kNames))) {
    const std::string& name = entry.first;
    std::string target;
    bool temp = !isTemplateName(name);
    if (temp && liveSwapLink(name)) continue;  // a replace between its symlink and its swap
    // Checked and unlinked under the names lock: a replace cannot swap a live template into this name between
    // the check and the unlink (the unlink would drop the new link).
    UniqueFd namesLock;
    try {
      namesLock = lockNames();
    } catch (const Error& e) {
      failed(name, "template", e);
      continue;
    }
    if (!temp && readLink(namesFd_.get(), name, &target) && isHexId(target) &&
        (entryExists(stagingFd_.get(), target) || entryExists(fd_.get(), target)))
      continue;  // being built (staging is looked at first: a publish moves it from there) or published
    if (ageMs(namesFd_.get(), name) < graceMs) continue;
    if (!dryRun && unlinkat(namesFd_.get(), name.c_str(), 0) != 0) continue;  // left for a later sweep
  }
}

}  // namespace vmspace

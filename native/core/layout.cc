// The pool's on-disk layout (layout.h): shard names and the paths errors show.
#include "layout.h"

#include <string>
#include <string_view>

#include "names.h"

namespace vmspace::layout {

std::string stagingShardName(int i) { return "s" + std::to_string(i); }
std::string leaseShardName(int i) { return std::string(1, "0123456789abcdef"[i]); }

std::string leaseShardOf(const std::string& name) {
  // The id is the last kIdHexChars characters of the name.
  return std::string(1, name.size() >= kIdHexChars ? name[name.size() - kIdHexChars] : '0');
}

std::string leaseRel(const std::string& name) { return leaseShardOf(name) + "/" + name; }

std::string statePath(const std::string& root) { return root + "/" + kStateDir; }

std::string statePath(const std::string& root, std::string_view entry) {
  return statePath(root) + "/" + std::string(entry);
}

std::string stagingShardPath(const std::string& root, int shard) {
  return statePath(root, kStaging) + "/" + stagingShardName(shard);
}

std::string trashPath(const std::string& root, const std::string& name) { return statePath(root, kTrash) + "/" + name; }

std::string leaseShardPath(const std::string& root, const std::string& shard) {
  return statePath(root, kLeases) + "/" + shard;
}

std::string leasePath(const std::string& root, const std::string& name) {
  return statePath(root, kLeases) + "/" + leaseRel(name);
}

std::string templatesPath(const std::string& root) { return statePath(root, kTemplates); }

std::string templateDir(const std::string& root, const std::string& id) { return templatesPath(root) + "/" + id; }

std::string templateMetaPath(const std::string& root, const std::string& id) {
  return templateDir(root, id) + "/" + kTemplateMeta;
}

}  // namespace vmspace::layout

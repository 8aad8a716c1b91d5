// A template built in staging from a parent template (or from nothing), changed by its caller (an image layer
// applied: layer_apply.h), then published as a commit is (template_commit.h's phases). No N-API here.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "clone.h"
#include "fd.h"
#include "json_members.h"
#include "template.h"
#include "template_commit.h"

namespace vmspace {

struct BuildRequest {
  std::string parent;  // a template id or name whose tree is cloned first; "" for an empty tree
  Reflink reflink = Reflink::Auto;
  bool durable = false;
  CloneProgress* progress = nullptr;  // the parent's clone: bytes counted, cancel checked (ECANCELED)
};

struct PublishRequest {
  JsonMembers info;      // the caller's members of template.json; id, name, method and usage are added
  std::string layerKey;  // "" or the layers/ link to claim (isLayerKey); not with a name
  std::string name;      // "" or the template's name, as CommitRequest
  bool replace = false;
};

class TemplateBuild : TemplateCommit {
 public:
  // Claims and leases staging/<id>/ and makes tree/ in it: the parent's tree (held for reading meanwhile) as
  // allocate clones it (a writable btrfs snapshot, else a tree clone, its write bits given back), or an empty
  // directory (a subvolume on btrfs). ERR_TEMPLATE_NOT_FOUND for an unknown parent; any failure leaves nothing.
  static std::unique_ptr<TemplateBuild> start(TemplateStore& store, const BuildRequest& request);
  ~TemplateBuild() { abandon(); }

  const std::string& id() const { return res_.id; }
  std::string treePath() const { return stagingPath_ + "/tree"; }
  int treeFd() const { return tree_.get(); }

  // Publishes the build (TemplateCommit::finish). Once: a second call, or one after abandon, is EBADF.
  CommitResult publish(const PublishRequest& request);
  // Removes the staging entry (idempotent; never throws). Nothing is left but what a sweep reclaims.
  void abandon() noexcept;

  // Serialises the build's calls (an apply, publish, abandon) between the threads that make them.
  std::mutex& mutex() { return mu_; }
  // Whether publish or abandon ended the build.
  bool over() const { return !lease_; }

 private:
  TemplateBuild(TemplateStore& store, const BuildRequest& request);
  void makeTreeFrom(TemplateReader& parent);

  UniqueFd lease_, tree_;
  std::mutex mu_;
};

}  // namespace vmspace

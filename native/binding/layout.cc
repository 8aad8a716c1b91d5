// layout: the names of the pool's on-disk entries and the lease path rule (native/core/layout.h), so that lib/
// (lib/layout.ts) builds the paths it shows from the core's names instead of spelling them again.
#include "../core/layout.h"

#include "common.h"

namespace vmspace::binding {
namespace {

// leasePath(root, name) -> the lease file of workspace `name` (synchronous: string work, no syscall).
Napi::Value LeasePath(const Napi::CallbackInfo& info) {
  return Napi::String::New(info.Env(), vmspace::layout::leasePath(stringArg(info, 0), stringArg(info, 1)));
}

// leaseShardPath(root, name) -> the lease shard directory the lease file of `name` is in (synchronous).
Napi::Value LeaseShardPath(const Napi::CallbackInfo& info) {
  std::string root = stringArg(info, 0);
  return Napi::String::New(info.Env(),
                           vmspace::layout::leaseShardPath(root, vmspace::layout::leaseShardOf(stringArg(info, 1))));
}

}  // namespace

void initLayout(Napi::Env env, Napi::Object exports) {
  namespace l = vmspace::layout;
  Napi::Object names = Napi::Object::New(env);
  const std::pair<const char*, const char*> entries[] = {
      {"stateDir", l::kStateDir},         {"staging", l::kStaging}, {"trash", l::kTrash},
      {"templates", l::kTemplates},       {"names", l::kNames},     {"tree", l::kTree},
      {"templateMeta", l::kTemplateMeta},
  };
  for (auto [key, value] : entries) names.Set(key, value);
  names.Freeze();
  exports.Set("layout", names);
  exportFunction(env, exports, "leasePath", LeasePath);
  exportFunction(env, exports, "leaseShardPath", LeaseShardPath);
}

}  // namespace vmspace::binding

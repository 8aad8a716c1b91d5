// remove: a tree, without following symlinks (native/core/remove.h).
#include "../core/remove.h"

#include "common.h"

namespace vmspace::binding {

namespace {

Napi::Value RemoveTree(const Napi::CallbackInfo& info) {
  std::string path = stringArg(info, 0);
  return runVoid(info.Env(), [path] { vmspace::removeTreeNoFollow(path); });
}

}  // namespace

void initRemove(Napi::Env env, Napi::Object exports) { exportFunction(env, exports, "removeTree", RemoveTree); }

}  // namespace vmspace::binding

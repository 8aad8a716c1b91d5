// rename (publish): renameat2 NOREPLACE and EXCHANGE (native/core/rename.h).
#include "../core/rename.h"

#include "common.h"

namespace vmspace::binding {

namespace {

Napi::Value RenameNoReplace(const Napi::CallbackInfo& info) {
  std::string from = stringArg(info, 0), to = stringArg(info, 1);
  return runVoid(info.Env(), [from, to] { vmspace::renameNoReplace(from, to); });
}

Napi::Value Exchange(const Napi::CallbackInfo& info) {
  std::string a = stringArg(info, 0), b = stringArg(info, 1);
  return runVoid(info.Env(), [a, b] { vmspace::exchange(a, b); });
}

}  // namespace

void initRename(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "renameNoReplace", RenameNoReplace);
  exportFunction(env, exports, "exchange", Exchange);
}

}  // namespace vmspace::binding

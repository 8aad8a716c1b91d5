// Module init: one Instance per env and every capability's exports (common.h lists them).
#include "common.h"

namespace vmspace::binding {
namespace {

// Context-aware (NAPI_MODULE_INIT via NODE_API_MODULE): no process-wide JS state; loads in every worker thread.
Napi::Object Init(Napi::Env env, Napi::Object exports) {
  env.SetInstanceData(new Instance());  // deleted (its leases closed) when the env is torn down
  initPool(env, exports);
  initWarm(env, exports);
  initClone(env, exports);
  initRemove(env, exports);
  initRename(env, exports);
  initLock(env, exports);
  initJsonFile(env, exports);
  initTemplate(env, exports);
  initLayout(env, exports);
  initTemplateBuild(env, exports);
  initQuota(env, exports);
  initRollback(env, exports);
#ifdef VMSPACE_TEST_HOOKS
  initTestHooks(env, exports);  // test builds only
#endif
  return exports;
}

}  // namespace
}  // namespace vmspace::binding

using vmspace::binding::Init;  // NODE_API_MODULE wants an unqualified name
NODE_API_MODULE(vmspace, Init)

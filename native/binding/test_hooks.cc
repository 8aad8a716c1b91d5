// Test seams, compiled into test builds only (VMSPACE_TEST_HOOKS: the cmake-js builds of CMakeLists.txt, which
// `npm test` and the sanitizer run load); binding.gyp, the release addon and the prebuilds, leave this file out.
#ifdef VMSPACE_TEST_HOOKS
#include <vector>

#include "../core/names.h"

#include "common.h"

namespace vmspace::binding {

namespace {

// Test seam (see core/names.h): the next workspace ids drawn, process-wide.
Napi::Value SetTestIds(const Napi::CallbackInfo& info) {
  std::vector<std::string> ids;
  if (info[0].IsArray()) {
    Napi::Array a = info[0].As<Napi::Array>();
    for (uint32_t i = 0; i < a.Length(); i++) {
      Napi::Value v = a.Get(i);
      if (v.IsString()) ids.push_back(v.As<Napi::String>().Utf8Value());
    }
  }
  vmspace::setTestIds(std::move(ids));
  return info.Env().Undefined();
}

// Test seam (see core/pool.h): [name, probeErrno, probeStep?] entries, the faults of the next sweep entries of those
// names.
Napi::Value SetSweepFaultsForTest(const Napi::CallbackInfo& info) {
  std::vector<vmspace::SweepFault> faults;
  if (info[0].IsArray()) {
    Napi::Array a = info[0].As<Napi::Array>();
    for (uint32_t i = 0; i < a.Length(); i++) {
      Napi::Value v = a.Get(i);
      if (!v.IsArray()) continue;
      Napi::Array pair = v.As<Napi::Array>();
      if (pair.Length() < 2 || !pair.Get(0u).IsString() || !pair.Get(1u).IsNumber()) continue;
      vmspace::SweepFault f{pair.Get(0u).As<Napi::String>().Utf8Value(), pair.Get(1u).As<Napi::Number>().Int32Value()};
      if (pair.Length() > 2 && pair.Get(2u).IsString()) f.probeStep = pair.Get(2u).As<Napi::String>().Utf8Value();
      faults.push_back(std::move(f));
    }
  }
  vmspace::setSweepFaultsForTest(std::move(faults));
  return info.Env().Undefined();
}

}  // namespace

void initTestHooks(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "setTestIds", SetTestIds);
  exportFunction(env, exports, "setSweepFaultsForTest", SetSweepFaultsForTest);
}

}  // namespace vmspace::binding

#endif  // VMSPACE_TEST_HOOKS

// The warm reserve (native/core/warm.h); lib/warm.ts keeps the entries and decides when to build.
#include <mutex>

#include "../core/warm.h"

#include "common.h"

namespace vmspace::binding {

namespace {

using WarmRef = std::shared_ptr<vmspace::WarmEntry>;

WarmRef warmArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsExternal()) throw Napi::TypeError::New(info.Env(), "vmspace binding: not a warm entry handle");
  return *info[i].As<Napi::External<WarmRef>>().Data();
}

// warmBuild(pool, {prefix, mode, templateDir, entries, reflink, durable}): a handle of a staged entry. The
// handle owns the entry's lease: an entry neither taken nor discarded is closed (left to a sweep) when the handle
// is collected or the env ends.
Napi::Value WarmBuild(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  vmspace::AllocateRequest req = workspaceRequestOf(Options(info, 1, "warmBuild"));
  auto entry = std::make_shared<vmspace::WarmEntry>();
  return Work<WarmRef>::StartHandle(
      info.Env(),
      [pool, req, entry] {
        vmspace::buildWarm(*pool, req, entry.get());
        return entry;
      },
      [](Napi::Env env, WarmRef& e) -> Napi::Value {
        return Napi::External<WarmRef>::New(env, new WarmRef(e), [](Napi::Env, WarmRef* ref) { delete ref; });
      });
}

// warmTake(pool, entry, info): allocate's result, or null when the entry was stale (removed) or used.
Napi::Value WarmTake(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  WarmRef entry = warmArg(info, 1);
  vmspace::JsonMembers members = jsonMembersOf(info.Env(), info[2], "warmTake: info");
  struct Taken {
    bool ok = false;
    vmspace::AllocateResult result;
  };
  vmspace::Reflink reflink = vmspace::Reflink::Auto;
  {
    std::lock_guard<std::mutex> lock(entry->mu);  // the build is done (lib awaits it), so this never waits
    reflink = entry->request.clone.reflink;
  }
  return Work<Taken>::Start(
      info.Env(),
      [pool, entry, members] {
        Taken t;
        t.ok = vmspace::takeWarm(*pool, entry.get(), members, &t.result);
        return t;
      },
      [reflink](Napi::Env env, Taken& t) -> Napi::Value {
        if (!t.ok) return env.Null();
        return allocateResultObject(env, t.result, reflink);
      },
      [](Taken& t) { dropAllocateResult(t.result); });
}

Napi::Value WarmDiscard(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  WarmRef entry = warmArg(info, 1);
  return runVoid(info.Env(), [pool, entry] { vmspace::discardWarm(*pool, entry.get()); });
}

}  // namespace

void initWarm(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "warmBuild", WarmBuild);
  exportFunction(env, exports, "warmTake", WarmTake);
  exportFunction(env, exports, "warmDiscard", WarmDiscard);
}

}  // namespace vmspace::binding

// rollback: a workspace's tree put back to one of its checkpoints, and the exclusive bytes of checkpoints
// (native/core/rollback.h).
#include "../core/rollback.h"

#include "common.h"

namespace vmspace::binding {
namespace {

// rollback(pool, {name, leaseFd, checkpoint, durable, progress}) -> {removed, bytes}
Napi::Value Rollback(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  Options o(info, 1, "rollback");
  vmspace::RollbackRequest req;
  req.name = o.string("name");
  req.leaseFd = o.int32("leaseFd");
  req.checkpoint = o.string("checkpoint");
  req.durable = o.boolean("durable");
  ProgressRef progress = progressOf(o);
  req.progress = progress.get();
  return Work<vmspace::RollbackOutcome>::Start(
      info.Env(), [pool, req, progress] { return vmspace::rollbackWorkspace(*pool, req); },
      [](Napi::Env env, vmspace::RollbackOutcome& r) -> Napi::Value {
        Napi::Object o = Napi::Object::New(env);
        o.Set("removed", r.removed);
        o.Set("bytes", static_cast<double>(r.bytes));
        return o;
      });
}

// templateExclusiveBytes(pool, ids, progress?) -> bytes per id (-1: no such template any more)
Napi::Value TemplateExclusiveBytes(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  std::vector<std::string> ids;
  if (!info[1].IsArray()) throw Napi::TypeError::New(info.Env(), "templateExclusiveBytes: ids must be an array");
  Napi::Array a = info[1].As<Napi::Array>();
  for (uint32_t i = 0; i < a.Length(); i++) ids.push_back(a.Get(i).ToString().Utf8Value());
  ProgressRef progress = progressArg(info, 2);  // its cancel flag only
  return Work<std::vector<int64_t>>::Start(
      info.Env(),
      [pool, ids, progress] {
        std::vector<int64_t> out;
        out.reserve(ids.size());
        for (const std::string& id : ids)
          out.push_back(vmspace::templateExclusiveBytes(*pool, id, progress ? &progress->cancel : nullptr));
        return out;
      },
      [](Napi::Env env, std::vector<int64_t>& bytes) -> Napi::Value {
        Napi::Array out = Napi::Array::New(env, bytes.size());
        for (size_t i = 0; i < bytes.size(); i++) out.Set(static_cast<uint32_t>(i), static_cast<double>(bytes[i]));
        return out;
      });
}

}  // namespace

void initRollback(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "rollback", Rollback);
  exportFunction(env, exports, "templateExclusiveBytes", TemplateExclusiveBytes);
}

}  // namespace vmspace::binding

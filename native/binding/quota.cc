// quota and space accounting (native/core/quota.h, usage.h).
#include "../core/quota.h"
#include "../core/usage.h"

#include "common.h"

namespace vmspace::binding {

namespace {

Napi::Object quotaSupportObject(Napi::Env env, const vmspace::QuotaSupport& s) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("supported", s.err == 0);
  o.Set("backend", s.backend == vmspace::QuotaBackend::Btrfs     ? "btrfs-qgroup"
                   : s.backend == vmspace::QuotaBackend::Project ? "project"
                                                                 : "none");
  o.Set("inodes", s.inodes);
  o.Set("detail", s.detail);
  if (s.err) o.Set("errno", s.err);  // named on the JS side (errnoName): no glibc-only strerrorname_np here
  return o;
}

Napi::Value ProbeQuota(const Napi::CallbackInfo& info) {
  std::string path = stringArg(info, 0);
  return Work<vmspace::QuotaSupport>::Start(
      info.Env(), [path] { return vmspace::probeQuotaAt(path); },
      [](Napi::Env env, vmspace::QuotaSupport& s) -> Napi::Value { return quotaSupportObject(env, s); });
}

// Resolves to 0 or the errno of the ioctl; rejects with the errno of opening the directory.
Napi::Value EnableBtrfsQuota(const Napi::CallbackInfo& info) {
  std::string path = stringArg(info, 0);
  bool simple = boolArg(info, 1);
  return Work<int>::Start(
      info.Env(), [path, simple] { return vmspace::enableBtrfsQuota(path, simple); },
      [](Napi::Env env, int& err) -> Napi::Value { return Napi::Number::New(env, err); });
}

Napi::Value PoolSpace(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  struct Space {
    vmspace::FsSpace space;
    vmspace::QuotaSupport quota;
  };
  return Work<Space>::Start(
      info.Env(),
      [pool] {
        return Space{pool->space(), pool->quotaSupport()};
      },
      [](Napi::Env env, Space& s) -> Napi::Value {
        Napi::Object o = Napi::Object::New(env);
        o.Set("availableBytes", static_cast<double>(s.space.available));
        o.Set("freeBytes", static_cast<double>(s.space.free));
        o.Set("totalBytes", static_cast<double>(s.space.total));
        o.Set("quota", quotaSupportObject(env, s.quota));
        return o;
      });
}

Napi::Value Usage(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  std::string name = stringArg(info, 1);
  ProgressRef progress = progressArg(info, 2);  // its cancel flag only
  return Work<vmspace::UsageReport>::Start(
      info.Env(), [pool, name, progress] { return pool->usage(name, progress ? &progress->cancel : nullptr); },
      [](Napi::Env env, vmspace::UsageReport& r) -> Napi::Value {
        Napi::Object o = Napi::Object::New(env);
        o.Set("allocatedBytes", static_cast<double>(r.allocatedBytes));
        o.Set("exclusiveBytes", static_cast<double>(r.exclusiveBytes));
        o.Set("sharedBytes", static_cast<double>(r.sharedBytes));
        o.Set("logicalBytes", static_cast<double>(r.logicalBytes));
        o.Set("files", static_cast<double>(r.files));
        o.Set("dirs", static_cast<double>(r.dirs));
        o.Set("others", static_cast<double>(r.others));
        if (r.quota.set) {
          Napi::Object q = Napi::Object::New(env);
          q.Set("limitBytes", static_cast<double>(r.quota.limitBytes));
          q.Set("usedBytes", static_cast<double>(r.quota.usedBytes));
          q.Set("limitInodes", static_cast<double>(r.quota.limitInodes));
          q.Set("usedInodes", static_cast<double>(r.quota.usedInodes));
          o.Set("quota", q);
        }
        return o;
      });
}

}  // namespace

void initQuota(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "probeQuota", ProbeQuota);
  exportFunction(env, exports, "poolSpace", PoolSpace);
  exportFunction(env, exports, "enableBtrfsQuota", EnableBtrfsQuota);
  exportFunction(env, exports, "usage", Usage);
}

}  // namespace vmspace::binding

// The binding's shared helpers (common.h).
#include <unistd.h>

#include "common.h"

namespace vmspace::binding {

namespace {

struct Unit {};
Napi::Value undefinedOf(Napi::Env env, Unit&) { return env.Undefined(); }

}  // namespace

Napi::Object errorObject(Napi::Env env, const Error& e) {
  Napi::Object o = Napi::Object::New(env);
  // An errno's name (a system error's code, a vmspace condition's cause) is added by lib/errors.ts from Node's
  // table: glibc's strerrorname_np is 2.32+ only and musl has none.
  if (!e.code.empty() || !e.err) o.Set("code", e.code.empty() ? "EUNKNOWN" : e.code);
  if (e.err) o.Set("errno", -e.err);
  if (e.err) o.Set("description", vmspace::errnoDescription(e.err));
  if (!e.syscall.empty()) o.Set("syscall", e.syscall);
  if (!e.path.empty()) o.Set("path", e.path);
  if (!e.dest.empty()) o.Set("dest", e.dest);
  if (!e.detail.empty()) o.Set("detail", e.detail);
  if (e.uid >= 0) o.Set("uid", static_cast<double>(e.uid));
  if (e.gid >= 0) o.Set("gid", static_cast<double>(e.gid));
  if (e.mode >= 0) o.Set("mode", e.mode);
  return o;
}

// An operation with no result: resolves with undefined.
Napi::Promise runVoid(Napi::Env env, std::function<void()> fn) {
  return Work<Unit>::Start(
      env,
      [fn = std::move(fn)] {
        fn();
        return Unit{};
      },
      undefinedOf);
}

std::string stringArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsString()) throw Napi::TypeError::New(info.Env(), "vmspace binding: argument " + std::to_string(i) + " must be a string");
  return info[i].As<Napi::String>().Utf8Value();
}

int64_t intArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsNumber()) throw Napi::TypeError::New(info.Env(), "vmspace binding: argument " + std::to_string(i) + " must be a number");
  return info[i].As<Napi::Number>().Int64Value();
}

std::shared_ptr<vmspace::Pool> poolArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsExternal()) throw Napi::TypeError::New(info.Env(), "vmspace binding: not a pool handle");
  return info[i].As<Napi::External<PoolRef>>().Data()->pool;
}

Napi::Promise closeFd(Napi::Env env, int fd) {
  return runVoid(env, [fd] { ::close(fd); });
}

}  // namespace vmspace::binding

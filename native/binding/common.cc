// The binding's shared helpers (common.h).
#include <unistd.h>

#include <cmath>
#include <cstdint>

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

Options::Options(const Napi::CallbackInfo& info, size_t i, const char* call) : env_(info.Env()), call_(call) {
  if (!info[i].IsObject())
    throw Napi::TypeError::New(env_, std::string("vmspace binding: ") + call_ + ": argument " + std::to_string(i) +
                                         " must be an options object");
  object_ = info[i].As<Napi::Object>();
}

Napi::String propertyKey(Napi::Env env, const char* key) {
  Instance& inst = instance(env);
  auto it = inst.keys.find(key);
  if (it != inst.keys.end()) return inst.keyStore.Value().Get(it->second).As<Napi::String>();
  if (inst.keyStore.IsEmpty()) inst.keyStore = Napi::Persistent(Napi::Object(Napi::Array::New(env)));
  Napi::String s = Napi::String::New(env, key);
  auto index = static_cast<uint32_t>(inst.keys.size());
  inst.keyStore.Value().Set(index, s);
  inst.keys.emplace(key, index);
  return s;
}

Napi::Value Options::get(const char* key) const { return object_.Get(propertyKey(env_, key)); }

Napi::TypeError Options::wrongType(const char* key, const char* what) const {
  return Napi::TypeError::New(env_,
                              std::string("vmspace binding: ") + call_ + ": option '" + key + "' must be " + what);
}

std::string Options::string(const char* key) const {
  Napi::Value v = get(key);
  if (!v.IsString()) throw wrongType(key, "a string");
  return v.As<Napi::String>().Utf8Value();
}

std::string Options::stringOr(const char* key, std::string fallback) const {
  return get(key).IsUndefined() ? std::move(fallback) : string(key);
}

bool Options::boolean(const char* key) const {
  Napi::Value v = get(key);
  if (!v.IsBoolean()) throw wrongType(key, "a boolean");
  return v.As<Napi::Boolean>().Value();
}

bool Options::booleanOr(const char* key, bool fallback) const {
  return get(key).IsUndefined() ? fallback : boolean(key);
}

int64_t Options::int64(const char* key) const {
  Napi::Value v = get(key);
  if (!v.IsNumber()) throw wrongType(key, "an integer");
  double d = v.As<Napi::Number>().DoubleValue();
  // 2^53: the largest integer a double holds exactly (Number.MAX_SAFE_INTEGER + 1)
  if (d != static_cast<double>(static_cast<int64_t>(d)) || d > 9007199254740992.0 || d < -9007199254740992.0)
    throw wrongType(key, "an integer");
  return static_cast<int64_t>(d);
}

int64_t Options::int64Or(const char* key, int64_t fallback) const {
  return get(key).IsUndefined() ? fallback : int64(key);
}

uint32_t Options::uint32(const char* key) const {
  int64_t v = int64(key);
  if (v < 0 || v > UINT32_MAX) throw wrongType(key, "an integer in 0..2^32-1");
  return static_cast<uint32_t>(v);
}

int32_t Options::int32(const char* key) const {
  int64_t v = int64(key);
  if (v < INT32_MIN || v > INT32_MAX) throw wrongType(key, "a 32-bit integer");
  return static_cast<int32_t>(v);
}

size_t Options::oneOf(const char* key, std::initializer_list<const char*> names, size_t fallback) const {
  Napi::Value v = get(key);
  if (v.IsUndefined()) return fallback;
  std::string expected;
  if (v.IsString()) {
    std::string s = v.As<Napi::String>().Utf8Value();
    size_t i = 0;
    for (const char* name : names) {
      if (s == name) return i;
      i++;
    }
  }
  for (const char* name : names) expected += (expected.empty() ? "'" : ", '") + std::string(name) + "'";
  throw wrongType(key, ("one of " + expected).c_str());
}

Napi::Array Options::array(const char* key) const {
  Napi::Value v = get(key);
  if (!v.IsArray()) throw wrongType(key, "an array");
  return v.As<Napi::Array>();
}

std::vector<std::string> Options::stringsOr(const char* key) const {
  std::vector<std::string> out;
  if (get(key).IsUndefined()) return out;
  Napi::Array a = array(key);
  for (uint32_t i = 0; i < a.Length(); i++) {
    Napi::Value v = a.Get(i);
    if (!v.IsString()) throw wrongType(key, "an array of strings");
    out.push_back(v.As<Napi::String>().Utf8Value());
  }
  return out;
}

vmspace::JsonMembers jsonMembersOf(Napi::Env env, Napi::Value v, const std::string& what) {
  // One string (lib/binding.ts, jsonMembers): a pair per member would cost five N-API calls each on every
  // allocate.
  if (!v.IsString())
    throw Napi::TypeError::New(env, "vmspace binding: " + what + " must be a string of JSON object members");
  return {{std::string(), v.As<Napi::String>().Utf8Value()}};
}

vmspace::JsonMembers Options::members(const char* key) const {
  return jsonMembersOf(env_, get(key), std::string(call_) + ": option '" + key + "'");
}

std::string stringArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsString())
    throw Napi::TypeError::New(info.Env(), "vmspace binding: argument " + std::to_string(i) + " must be a string");
  return info[i].As<Napi::String>().Utf8Value();
}

int64_t intArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsNumber())
    throw Napi::TypeError::New(info.Env(), "vmspace binding: argument " + std::to_string(i) + " must be a number");
  return info[i].As<Napi::Number>().Int64Value();
}

int64_t integerArg(const Napi::CallbackInfo& info, size_t i, int64_t min, int64_t max, const char* call) {
  double v = info[i].IsNumber() ? info[i].As<Napi::Number>().DoubleValue() : std::nan("");
  if (!(v >= static_cast<double>(min) && v <= static_cast<double>(max) && v == std::trunc(v)))
    throw Napi::TypeError::New(info.Env(), std::string("vmspace binding: ") + call + ": argument " + std::to_string(i) +
                                               " must be an integer from " + std::to_string(min) + " to " +
                                               std::to_string(max));
  return static_cast<int64_t>(v);
}

bool boolArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsBoolean())
    throw Napi::TypeError::New(info.Env(), "vmspace binding: argument " + std::to_string(i) + " must be a boolean");
  return info[i].As<Napi::Boolean>().Value();
}

std::shared_ptr<vmspace::Pool> poolArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsExternal()) throw Napi::TypeError::New(info.Env(), "vmspace binding: not a pool handle");
  return info[i].As<Napi::External<PoolRef>>().Data()->pool;
}

Napi::Promise closeFd(Napi::Env env, int fd) {
  return runVoid(env, [fd] { ::close(fd); });
}

}  // namespace vmspace::binding

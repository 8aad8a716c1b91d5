// What every file of the N-API binding shares: the one unit of work on the libuv pool (Work), the per-env state
// (Instance), the core Error as a JS object, and the readers of a call's options object. The binding converts JS
// values to core arguments and back; no file-system logic lives in native/binding/ (that is native/core/, which
// never includes N-API). One file per capability (docs/DESIGN.md, "Code map"); addon.cc registers them all.
#pragma once

#include <napi.h>

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../core/clone.h"
#include "../core/error.h"
#include "../core/pool.h"
#include "batch.h"

namespace vmspace {
struct CommitResult;  // ../core/template.h
}  // namespace vmspace

namespace vmspace::binding {

// The one error helper: a core Error as a plain object with Node's fs error fields; lib/errors.ts turns it into
// a VmspaceError where the caller's async stack is at hand.
Napi::Object errorObject(Napi::Env env, const Error& e);

// One operation on the libuv pool, alone on its own uv_queue_work: `exec` returns R on a pool thread, `toJs` makes
// the value on the JS thread, `drop` (optional) releases a result that could not be delivered to JS (the env torn
// down). A LambdaJob (batch.h) run by runAlone; calls that come many at once are batched instead (submitBatched).
template <typename R>
struct Work {
  static Napi::Promise Start(Napi::Env env, std::function<R()> exec, std::function<Napi::Value(Napi::Env, R&)> toJs,
                             std::function<void(R&)> drop = nullptr) {
    return runAlone(env, std::make_unique<LambdaJob<R>>(env, std::move(exec), std::move(toJs), std::move(drop)));
  }
  // As Start, for a value that `toJs` hands to a JS handle with a finalizer (Job::ownsHandle): an undelivered R
  // is destroyed with the job (R releases what it holds: a shared_ptr).
  static Napi::Promise StartHandle(Napi::Env env, std::function<R()> exec,
                                   std::function<Napi::Value(Napi::Env, R&)> toJs) {
    auto job = std::make_unique<LambdaJob<R>>(env, std::move(exec), std::move(toJs));
    job->setOwnsHandle();
    return runAlone(env, std::move(job));
  }
};

struct LockWaiter;  // lock.cc
class Batch;        // batch.cc

// Per-instance state (one per env: the main thread and each worker thread): the lease fds and lock fds this
// instance holds, and its lock waits still running. When the env ends (a worker thread exits, or the process),
// the fds are closed and the waits cancelled, so no workspace stays leased and no lock stays held by a thread
// that is gone. Touched on the env's JS thread only.
struct Instance {
  std::unordered_set<int> leases;
  std::unordered_set<int> locks;
  std::unordered_set<std::shared_ptr<LockWaiter>> waiters;
  std::shared_ptr<Batch> batch;  // made by the first batched call (batch.h)
  // propertyKey's strings: their index in `keyStore` (an array: Node-API before version 10 cannot reference a
  // string) by the address of the literal that names them (a bounded set: keys are literals).
  std::unordered_map<const char*, uint32_t> keys;
  Napi::ObjectReference keyStore;
  ~Instance();  // lock.cc (it cancels the waits and abandons the batch's calls)
};

inline Instance& instance(Napi::Env env) { return *env.GetInstanceData<Instance>(); }

// The property name `key` (a string literal: the cache is keyed by its address) as a V8 string made once per env.
// napi_get/set_named_property internalize their C string on every call, a large share of the JS thread's time with
// many allocate/dispose calls in flight (docs/DESIGN.md, "Measurements behind the code").
Napi::String propertyKey(Napi::Env env, const char* key);

// An operation with no result: resolves with undefined.
Napi::Promise runVoid(Napi::Env env, std::function<void()> fn);

// Closes an fd on the pool: the kernel drops its flock with the last fd of the open file description. Throws
// (nothing queued, the fd still open: the caller closes it) when no work can be queued.
Napi::Promise closeFd(Napi::Env env, int fd);

// ---- argument conversion (types were checked by lib/; a mismatch here is a TypeError, never a crash) ----

// One call's options object, read by name (as sharp and classic-level do): each getter throws a TypeError naming
// the call and the key when the value has the wrong type; the *Or getters return `fallback` for undefined.
class Options {
 public:
  // info[i] must be an object; `call` names the native function in errors.
  Options(const Napi::CallbackInfo& info, size_t i, const char* call);

  std::string string(const char* key) const;
  std::string stringOr(const char* key, std::string fallback) const;
  bool boolean(const char* key) const;
  bool booleanOr(const char* key, bool fallback) const;
  uint32_t uint32(const char* key) const;
  int32_t int32(const char* key) const;
  // An integer up to 2^53 (a JS safe integer): byte counts, milliseconds.
  int64_t int64(const char* key) const;
  int64_t int64Or(const char* key, int64_t fallback) const;
  // A string naming one of `names` (in order); its index. Enums travel as their names, parsed here once.
  size_t oneOf(const char* key, std::initializer_list<const char*> names, size_t fallback) const;
  Napi::Array array(const char* key) const;
  // An array of strings; empty for undefined.
  std::vector<std::string> stringsOr(const char* key) const;
  // A string of JSON object members, `"k":v,...`: the caller's members of a metadata record (core/json_members.h).
  vmspace::JsonMembers members(const char* key) const;
  Napi::Env env() const { return env_; }
  // A handle made by the binding (Napi::External<T>) or undefined (null).
  template <typename T>
  T* externalOr(const char* key) const {
    Napi::Value v = get(key);
    if (v.IsUndefined()) return nullptr;
    if (!v.IsExternal()) throw wrongType(key, "a handle");
    return v.As<Napi::External<T>>().Data();
  }

 private:
  Napi::Value get(const char* key) const;
  Napi::TypeError wrongType(const char* key, const char* what) const;
  Napi::Env env_;
  Napi::Object object_;
  const char* call_;  // a literal
};

std::string stringArg(const Napi::CallbackInfo& info, size_t i);
// A string of JSON object members (lib/binding.ts, jsonMembers); `what` names the value in the TypeError.
vmspace::JsonMembers jsonMembersOf(Napi::Env env, Napi::Value v, const std::string& what);
int64_t intArg(const Napi::CallbackInfo& info, size_t i);
// info[i] as an integer from `min` to `max`: a TypeError naming `call` and the argument for anything else (NaN,
// Infinity, a fraction, out of range), which intArg would truncate (the positional calls: allocatePlain, dispose,
// clonePathBeneath).
int64_t integerArg(const Napi::CallbackInfo& info, size_t i, int64_t min, int64_t max, const char* call);
bool boolArg(const Napi::CallbackInfo& info, size_t i);

struct PoolRef {
  std::shared_ptr<vmspace::Pool> pool;
};
std::shared_ptr<vmspace::Pool> poolArg(const Napi::CallbackInfo& info, size_t i);

// ---- shared between capabilities (defined in the file named) ----

using ProgressRef = std::shared_ptr<vmspace::CloneProgress>;
// clone.cc: the clone options, the optional progress/cancel handle, a clone's summary.
// reflink ('always' | 'auto' | 'never', default 'auto'), overwrite, durable, writeback ('none' | 'start' | 'wait').
vmspace::CloneOptions cloneOptionsOf(const Options& o);
ProgressRef progressArg(const Napi::CallbackInfo& info, size_t i);
ProgressRef progressOf(const Options& o);  // the key "progress"
Napi::Object summaryObject(Napi::Env env, const vmspace::CloneSummary& s, vmspace::Reflink reflink);
// A published template as commitTemplate and templateBuildPublish give it: {id, record, allocatedBytes} and, when
// a name was swapped, {replacedId, replacedRemoved}.
Napi::Object publishedObject(Napi::Env env, const vmspace::CommitResult& r);
// (pool, key) -> a promise of the id that `lookup` of the pool's template store answers for `key`, or null (the store
// answered "", or the pool has no templates yet): findLayer, templateNameTarget.
Napi::Value templateLookup(const Napi::CallbackInfo& info,
                           std::string (vmspace::TemplateStore::*lookup)(const std::string&));
// The same as an array: [kind, method, files, bytes, reflinked, copied] (a file the template cache served: and its
// cache, "hit" or "miss"), and for a tree dirs, symlinks, hardlinks,
// fifos, devices, skipped sockets, skipped devices (lib/clone.ts, cloneResultOf).
Napi::Array summaryArray(Napi::Env env, const vmspace::CloneSummary& s, vmspace::Reflink reflink);
// The result's `cache` ("hit", "miss"), nullptr where the template cache did not serve the clone.
const char* cacheName(vmspace::CacheUse use);
// pool.cc: allocate's request and result, which a warm entry shares.
// The workspace's shape: prefix, mode, templateDir, entries, reflink, durable (warmBuild takes these only);
// allocate adds info, progress, writeback, quotaBytes, quotaInodes, fromTemplate.
vmspace::AllocateRequest workspaceRequestOf(const Options& o);
Napi::Value allocateResultObject(Napi::Env env, vmspace::AllocateResult& r, vmspace::Reflink reflink);
void dropAllocateResult(vmspace::AllocateResult& r);

// Each capability's exports (addon.cc calls them all).
void initPool(Napi::Env env, Napi::Object exports);
void initWarm(Napi::Env env, Napi::Object exports);
void initClone(Napi::Env env, Napi::Object exports);
void initRemove(Napi::Env env, Napi::Object exports);
void initRename(Napi::Env env, Napi::Object exports);
void initLock(Napi::Env env, Napi::Object exports);
void initJsonFile(Napi::Env env, Napi::Object exports);
void initTemplate(Napi::Env env, Napi::Object exports);
void initLayout(Napi::Env env, Napi::Object exports);
void initTemplateBuild(Napi::Env env, Napi::Object exports);
void initQuota(Napi::Env env, Napi::Object exports);
void initRollback(Napi::Env env, Napi::Object exports);
#ifdef VMSPACE_TEST_HOOKS
void initTestHooks(Napi::Env env, Napi::Object exports);  // test_hooks.cc
#endif

// exports[name] = fn
inline void exportFunction(Napi::Env env, Napi::Object exports, const char* name, Napi::Function::Callback fn) {
  exports.Set(name, Napi::Function::New(env, fn, name));
}

}  // namespace vmspace::binding

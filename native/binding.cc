// The N-API binding: converts JS values to core arguments, runs each operation as one unit of work on the libuv
// thread pool, and converts the result (or the core's Error) back. Arguments arrive validated by lib/; the checks
// here only keep a wrong call from crashing the process. No file-system logic lives in this file.
#include <napi.h>

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_set>
#include <memory>
#include <string>
#include <utility>

#include "core/clone.h"
#include "core/error.h"
#include "core/lock.h"
#include "core/names.h"
#include "core/pool.h"
#include "core/quota.h"
#include "core/remove.h"
#include "core/rename.h"
#include "core/template.h"
#include "core/tree.h"
#include "core/warm.h"

namespace {

using vmspace::Error;

// The one error helper: a core Error as a plain object with Node's fs error fields; lib/errors.ts turns it into
// a VmspaceError where the caller's async stack is at hand.
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

// One operation on the libuv pool: Execute runs `exec` on a pool thread, OnOK resolves or rejects the promise on
// the JS thread. Lifecycle: created and queued on the JS thread -> Execute (pool) -> OnOK (JS) -> deleted by
// node-addon-api.
template <typename R>
class Work : public Napi::AsyncWorker {
 public:
  using Exec = std::function<R()>;
  using ToJs = std::function<Napi::Value(Napi::Env, R&)>;

  // Queues the work; `drop` (optional) is called with a result that could not be delivered to JS.
  static Napi::Promise Start(Napi::Env env, Exec exec, ToJs toJs, std::function<void(R&)> drop = nullptr) {
    auto* work = new Work(env, std::move(exec), std::move(toJs), std::move(drop));
    Napi::Promise promise = work->deferred_.Promise();
    work->Queue();
    return promise;
  }

 private:
  Work(Napi::Env env, Exec exec, ToJs toJs, std::function<void(R&)> drop)
      : Napi::AsyncWorker(env, "vmspace"), deferred_(Napi::Promise::Deferred::New(env)), exec_(std::move(exec)),
        toJs_(std::move(toJs)), drop_(std::move(drop)) {}

  // No V8 here: runs on a libuv pool thread. Every exception becomes the rejection (an exception escaping
  // Execute would be turned by node-addon-api into a callback error that nothing delivers: the promise would
  // never settle).
  void Execute() override {
    try {
      result_ = exec_();
    } catch (...) {
      try {
        error_ = std::make_unique<Error>(vmspace::currentError());
      } catch (...) {
        outOfMemory_ = true;  // not even the Error could be made
      }
    }
  }

  // On the JS thread, also while the env is being torn down (a worker thread ending with this work in flight):
  // then no JS can run, node-addon-api throws, and the result must still not leak. A toJs that hands an fd to
  // the instance sets it to -1 in the result; `drop` releases whatever is left.
  void OnOK() override {
    try {
      Napi::Env env = Env();
      Napi::HandleScope scope(env);
      if (outOfMemory_) {
        Error e;
        e.err = ENOMEM;
        e.syscall = "malloc";
        deferred_.Reject(errorObject(env, e));
        return;
      }
      if (error_) {
        deferred_.Reject(errorObject(env, *error_));
        return;
      }
      deferred_.Resolve(toJs_(env, result_));
    } catch (...) {
      if (!error_ && !outOfMemory_ && drop_) drop_(result_);
    }
  }

  Napi::Promise::Deferred deferred_;
  Exec exec_;
  ToJs toJs_;
  std::function<void(R&)> drop_;
  R result_{};
  std::unique_ptr<Error> error_;
  bool outOfMemory_ = false;
};

struct LockWaiter;

// Per-instance state (one per env: the main thread and each worker thread): the lease fds and lock fds this
// instance holds, and its lock waits still running. When the env ends (a worker thread exits, or the process),
// the fds are closed and the waits cancelled, so no workspace stays leased and no lock stays held by a thread
// that is gone. Touched on the env's JS thread only.
struct Instance {
  std::unordered_set<int> leases;
  std::unordered_set<int> locks;
  std::unordered_set<std::shared_ptr<LockWaiter>> waiters;
  ~Instance();
};

Instance& instance(Napi::Env env) { return *env.GetInstanceData<Instance>(); }

struct Unit {};
Napi::Value undefinedOf(Napi::Env env, Unit&) { return env.Undefined(); }

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

// ---- argument conversion (types were checked by lib/; a mismatch here is a TypeError, never a crash) ----

std::string stringArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsString()) throw Napi::TypeError::New(info.Env(), "vmspace binding: argument " + std::to_string(i) + " must be a string");
  return info[i].As<Napi::String>().Utf8Value();
}

int64_t intArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsNumber()) throw Napi::TypeError::New(info.Env(), "vmspace binding: argument " + std::to_string(i) + " must be a number");
  return info[i].As<Napi::Number>().Int64Value();
}

bool boolArg(const Napi::CallbackInfo& info, size_t i) { return info[i].ToBoolean().Value(); }

vmspace::CloneOptions cloneOptionsArg(const Napi::CallbackInfo& info, size_t i) {
  vmspace::CloneOptions o;
  int64_t reflink = intArg(info, i);
  o.reflink = reflink == 0 ? vmspace::Reflink::Always : reflink == 2 ? vmspace::Reflink::Never : vmspace::Reflink::Auto;
  o.overwrite = boolArg(info, i + 1);
  o.durable = boolArg(info, i + 2);
  return o;
}

// 0 none, 1 start, 2 wait (CloneOptions.writeback); missing: none.
vmspace::Writeback writebackArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsNumber()) return vmspace::Writeback::None;
  int64_t w = info[i].As<Napi::Number>().Int64Value();
  return w == 1 ? vmspace::Writeback::Start : w == 2 ? vmspace::Writeback::Wait : vmspace::Writeback::None;
}

struct PoolRef {
  std::shared_ptr<vmspace::Pool> pool;
};

std::shared_ptr<vmspace::Pool> poolArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsExternal()) throw Napi::TypeError::New(info.Env(), "vmspace binding: not a pool handle");
  return info[i].As<Napi::External<PoolRef>>().Data()->pool;
}

using ProgressRef = std::shared_ptr<vmspace::CloneProgress>;

// Optional progress/cancel handle made by NewProgress; shared with the worker so it outlives whichever ends last.
ProgressRef progressArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsExternal()) return nullptr;
  return *info[i].As<Napi::External<ProgressRef>>().Data();
}

Napi::Object summaryObject(Napi::Env env, const vmspace::CloneSummary& s, vmspace::Reflink reflink) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("kind", s.tree ? "tree" : "file");
  o.Set("method", vmspace::methodName(s, reflink));
  o.Set("files", static_cast<double>(s.files));
  o.Set("bytes", static_cast<double>(s.bytes));
  o.Set("reflinked", static_cast<double>(s.reflinked));
  o.Set("copied", static_cast<double>(s.copied));
  if (s.tree) {
    o.Set("dirs", static_cast<double>(s.dirs));
    o.Set("symlinks", static_cast<double>(s.symlinks));
    o.Set("hardlinks", static_cast<double>(s.hardlinks));
    o.Set("fifos", static_cast<double>(s.fifos));
    o.Set("devices", static_cast<double>(s.devices));
    Napi::Object skipped = Napi::Object::New(env);
    skipped.Set("sockets", static_cast<double>(s.skippedSockets));
    skipped.Set("devices", static_cast<double>(s.skippedDevices));
    o.Set("skipped", skipped);
  }
  return o;
}

// ---- entries ----

Napi::Value OpenPool(const Napi::CallbackInfo& info) {
  std::string root = stringArg(info, 0);
  bool create = boolArg(info, 1);
  int64_t sharedGid = intArg(info, 2);  // -1: none
  int format = static_cast<int>(intArg(info, 3));  // of a pool made here: 1 or 2
  // quota (issue 13): minFreeBytes, project id range
  uint64_t minFreeBytes = static_cast<uint64_t>(intArg(info, 4));
  vmspace::ProjectIdRange projectIds{static_cast<uint32_t>(intArg(info, 5)), static_cast<uint32_t>(intArg(info, 6))};
  return Work<std::shared_ptr<vmspace::Pool>>::Start(
      info.Env(),
      [root, create, sharedGid, format, minFreeBytes, projectIds] {
        auto pool = vmspace::Pool::open(root, create, sharedGid, format);
        pool->setSpaceConfig(minFreeBytes, projectIds);
        vmspace::bootId();  // read once, here on the pool thread
        return pool;
      },
      [](Napi::Env env, std::shared_ptr<vmspace::Pool>& pool) -> Napi::Value {
        Napi::Object o = Napi::Object::New(env);
        o.Set("handle", Napi::External<PoolRef>::New(env, new PoolRef{pool},
                                                     [](Napi::Env, PoolRef* ref) { delete ref; }));
        o.Set("bootId", vmspace::bootId());
        o.Set("format", pool->format());
        return o;
      });
}

Napi::Value ClosePool(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  return runVoid(info.Env(), [pool] { pool->close(); });
}

// (prefix, mode, templateDir, entries, infoJson, reflink, overwrite, durable, progress, writeback) from `first` on.
vmspace::AllocateRequest allocateRequestArg(const Napi::CallbackInfo& info, size_t first, ProgressRef* progress) {
  vmspace::AllocateRequest req;
  req.prefix = stringArg(info, first);
  req.mode = static_cast<mode_t>(intArg(info, first + 1));
  req.templateDir = stringArg(info, first + 2);
  if (!info[first + 3].IsArray()) throw Napi::TypeError::New(info.Env(), "vmspace binding: entries must be an array");
  Napi::Array entries = info[first + 3].As<Napi::Array>();
  for (uint32_t i = 0; i < entries.Length(); i++) {
    Napi::Value pair = entries.Get(i);
    if (!pair.IsArray()) throw Napi::TypeError::New(info.Env(), "vmspace binding: entry must be [dest, source]");
    Napi::Array p = pair.As<Napi::Array>();
    Napi::Value dest = p.Get(0u), source = p.Get(1u);
    if (!dest.IsString() || !source.IsString())
      throw Napi::TypeError::New(info.Env(), "vmspace binding: entry must be [dest, source]");
    req.entries.push_back({dest.As<Napi::String>().Utf8Value(), source.As<Napi::String>().Utf8Value()});
  }
  req.infoJson = stringArg(info, first + 4);
  req.clone = cloneOptionsArg(info, first + 5);  // reflink, (overwrite, ignored), durable
  *progress = progressArg(info, first + 8);
  req.progress = progress->get();
  req.clone.writeback = writebackArg(info, first + 9);
  // quota (issue 13): allocate only (a warm build has none); 0 or absent: none
  if (info[first + 10].IsNumber()) req.quota.bytes = static_cast<uint64_t>(intArg(info, first + 10));
  if (info[first + 11].IsNumber()) req.quota.inodes = static_cast<uint64_t>(intArg(info, first + 11));
  if (info.Length() > first + 12 && info[first + 12].IsString()) req.fromTemplate = stringArg(info, first + 12);  // issue 14
  return req;
}

Napi::Value allocateResultObject(Napi::Env env, vmspace::AllocateResult& r, vmspace::Reflink reflink) {
  int fd = std::exchange(r.leaseFd, -1);
  instance(env).leases.insert(fd);
  Napi::Object o = Napi::Object::New(env);
  o.Set("id", r.id);
  o.Set("name", r.name);
  o.Set("leaseFd", fd);
  o.Set("retries", r.retries);
  Napi::Array clones = Napi::Array::New(env, r.clones.size());
  for (size_t i = 0; i < r.clones.size(); i++) {
    Napi::Object c = summaryObject(env, r.clones[i].result, reflink);
    c.Set("dest", r.clones[i].dest);
    clones.Set(static_cast<uint32_t>(i), c);
  }
  o.Set("clones", clones);
  if (!r.templateId.empty()) {  // issue 14
    o.Set("templateId", r.templateId);
    o.Set("templateMeta", r.templateMeta);
  }
  return o;
}

void dropAllocateResult(vmspace::AllocateResult& r) {
  if (r.leaseFd >= 0) ::close(r.leaseFd);  // the workspace is then an orphan for a sweep
}

Napi::Value Allocate(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  ProgressRef progress;
  vmspace::AllocateRequest req = allocateRequestArg(info, 1, &progress);
  vmspace::Reflink reflink = req.clone.reflink;
  return Work<vmspace::AllocateResult>::Start(
      info.Env(), [pool, req, progress] { return pool->allocate(req); },
      [reflink](Napi::Env env, vmspace::AllocateResult& r) { return allocateResultObject(env, r, reflink); },
      dropAllocateResult);
}

// ---- the warm reserve (core/warm.h); lib/warm.ts keeps the entries and decides when to build ----

using WarmRef = std::shared_ptr<vmspace::WarmEntry>;

WarmRef warmArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsExternal()) throw Napi::TypeError::New(info.Env(), "vmspace binding: not a warm entry handle");
  return *info[i].As<Napi::External<WarmRef>>().Data();
}

// warmBuild(pool, ...allocate's arguments): a handle of a staged entry. The handle owns the entry's lease: an
// entry neither taken nor discarded is closed (left to a sweep) when the handle is collected or the env ends.
Napi::Value WarmBuild(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  ProgressRef progress;
  vmspace::AllocateRequest req = allocateRequestArg(info, 1, &progress);
  auto entry = std::make_shared<vmspace::WarmEntry>();
  return Work<WarmRef>::Start(
      info.Env(),
      [pool, req, progress, entry] {
        vmspace::buildWarm(*pool, req, entry.get());
        return entry;
      },
      [](Napi::Env env, WarmRef& e) -> Napi::Value {
        return Napi::External<WarmRef>::New(env, new WarmRef(e), [](Napi::Env, WarmRef* ref) { delete ref; });
      });
}

// warmTake(pool, entry, infoJson): allocate's result, or null when the entry was stale (removed) or used.
Napi::Value WarmTake(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  WarmRef entry = warmArg(info, 1);
  std::string infoJson = stringArg(info, 2);
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
      [pool, entry, infoJson] {
        Taken t;
        t.ok = vmspace::takeWarm(*pool, entry.get(), infoJson, &t.result);
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

Napi::Value Dispose(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  std::string name = stringArg(info, 1);
  int leaseFd = static_cast<int>(intArg(info, 2));
  instance(info.Env()).leases.erase(leaseFd);  // the core closes it on every path
  return runVoid(info.Env(), [pool, name, leaseFd] { pool->dispose(name, leaseFd); });
}

// A workspace's metadata on `o`: `metaText`, or `metaError` (the errno of reading its xattr or file, with that
// path); `metaXattr` when it is the xattr's (format 2).
void setMeta(Napi::Env env, Napi::Object& o, const vmspace::Pool& pool, const std::string& name, int metaErrno,
             const std::string& metaText, bool inXattr) {
  if (inXattr) o.Set("metaXattr", true);
  if (metaErrno == 0) {
    o.Set("metaText", metaText);
    return;
  }
  vmspace::Error e;
  e.err = metaErrno;
  e.syscall = inXattr ? "fgetxattr" : "open";
  e.path = inXattr ? pool.root() + "/" + name : pool.metaPath(name);
  o.Set("metaError", errorObject(env, e));
}

Napi::Value Adopt(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  std::string name = stringArg(info, 1);
  return Work<vmspace::AdoptResult>::Start(
      info.Env(), [pool, name] { return pool->adopt(name); },
      [pool, name](Napi::Env env, vmspace::AdoptResult& r) -> Napi::Value {
        int fd = std::exchange(r.leaseFd, -1);
        instance(env).leases.insert(fd);
        Napi::Object o = Napi::Object::New(env);
        o.Set("leaseFd", fd);
        setMeta(env, o, *pool, name, r.metaErrno, r.metaText, r.metaInXattr);
        return o;
      },
      [](vmspace::AdoptResult& r) {
        if (r.leaseFd >= 0) ::close(r.leaseFd);
      });
}

Napi::Value Sweep(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  bool dryRun = boolArg(info, 1);
  int64_t graceMs = intArg(info, 2);
  return Work<vmspace::SweepReport>::Start(
      info.Env(), [pool, dryRun, graceMs] { return pool->sweep(dryRun, graceMs); },
      [](Napi::Env env, vmspace::SweepReport& r) -> Napi::Value {
        auto entries = [&](const std::vector<vmspace::SweepEntry>& list, bool withError) {
          Napi::Array a = Napi::Array::New(env, list.size());
          for (size_t i = 0; i < list.size(); i++) {
            Napi::Object e = Napi::Object::New(env);
            e.Set("name", list[i].name);
            e.Set("from", list[i].from);
            e.Set("bytes", static_cast<double>(list[i].bytes));
            if (withError) e.Set("error", errorObject(env, list[i].error));
            a.Set(static_cast<uint32_t>(i), e);
          }
          return a;
        };
        Napi::Object o = Napi::Object::New(env);
        o.Set("reclaimed", entries(r.reclaimed, false));
        o.Set("failed", entries(r.failed, true));
        o.Set("live", static_cast<double>(r.live));
        o.Set("metaRemoved", static_cast<double>(r.metaRemoved));
        return o;
      });
}

Napi::Value List(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  return Work<std::vector<vmspace::ListEntry>>::Start(
      info.Env(), [pool] { return pool->list(); },
      [pool](Napi::Env env, std::vector<vmspace::ListEntry>& entries) -> Napi::Value {
        Napi::Array out = Napi::Array::New(env, entries.size());
        for (size_t i = 0; i < entries.size(); i++) {
          Napi::Object o = Napi::Object::New(env);
          o.Set("name", entries[i].name);
          o.Set("live", entries[i].live);
          setMeta(env, o, *pool, entries[i].name, entries[i].metaErrno, entries[i].metaText, entries[i].metaInXattr);
          if (entries[i].probeErrno) {
            vmspace::Error e;
            e.err = entries[i].probeErrno;
            e.syscall = entries[i].probeSyscall;
            e.path = pool->root() + "/" + entries[i].name;
            o.Set("probeError", errorObject(env, e));
          }
          out.Set(static_cast<uint32_t>(i), o);
        }
        return out;
      });
}

// ---- quotas and space accounting (issue 13) ----

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

Napi::Value PoolSpace(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  struct Space {
    vmspace::FsSpace space;
    vmspace::QuotaSupport quota;
  };
  return Work<Space>::Start(
      info.Env(), [pool] { return Space{pool->space(), pool->quotaSupport()}; },
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

Napi::Value ClonePath(const Napi::CallbackInfo& info) {
  std::string src = stringArg(info, 0), dst = stringArg(info, 1);
  vmspace::CloneOptions opts = cloneOptionsArg(info, 2);
  ProgressRef progress = progressArg(info, 5);
  opts.writeback = writebackArg(info, 6);
  return Work<vmspace::CloneSummary>::Start(
      info.Env(), [src, dst, opts, progress] { return vmspace::clonePath(src, dst, opts, progress.get()); },
      [opts](Napi::Env env, vmspace::CloneSummary& s) -> Napi::Value { return summaryObject(env, s, opts.reflink); });
}

Napi::Value ClonePathBeneath(const Napi::CallbackInfo& info) {
  int baseFd = static_cast<int>(intArg(info, 0));
  std::string basePath = stringArg(info, 1), src = stringArg(info, 2), rel = stringArg(info, 3);
  vmspace::CloneOptions opts = cloneOptionsArg(info, 4);
  ProgressRef progress = progressArg(info, 7);
  opts.writeback = writebackArg(info, 8);
  return Work<vmspace::CloneSummary>::Start(
      info.Env(),
      [baseFd, basePath, src, rel, opts, progress] {
        return vmspace::clonePathBeneath(src, baseFd, basePath, rel, opts, progress.get());
      },
      [opts](Napi::Env env, vmspace::CloneSummary& s) -> Napi::Value { return summaryObject(env, s, opts.reflink); });
}

Napi::Value NewProgress(const Napi::CallbackInfo& info) {
  return Napi::External<ProgressRef>::New(info.Env(), new ProgressRef(std::make_shared<vmspace::CloneProgress>()),
                                          [](Napi::Env, ProgressRef* ref) { delete ref; });
}

// [files, bytes] so far; cheap enough for a 100 ms timer on the JS thread (two relaxed atomic loads).
Napi::Value ReadProgress(const Napi::CallbackInfo& info) {
  ProgressRef p = progressArg(info, 0);
  Napi::Array out = Napi::Array::New(info.Env(), 2);
  out.Set(0u, static_cast<double>(p ? p->files.load(std::memory_order_relaxed) : 0));
  out.Set(1u, static_cast<double>(p ? p->bytes.load(std::memory_order_relaxed) : 0));
  return out;
}

Napi::Value CancelProgress(const Napi::CallbackInfo& info) {
  ProgressRef p = progressArg(info, 0);
  if (p) p->cancel.store(true, std::memory_order_relaxed);
  return info.Env().Undefined();
}

Napi::Value RemoveTree(const Napi::CallbackInfo& info) {
  std::string path = stringArg(info, 0);
  return runVoid(info.Env(), [path] { vmspace::removeTreeNoFollow(path); });
}

Napi::Value RenameNoReplace(const Napi::CallbackInfo& info) {
  std::string from = stringArg(info, 0), to = stringArg(info, 1);
  return runVoid(info.Env(), [from, to] { vmspace::renameNoReplace(from, to); });
}

Napi::Value Exchange(const Napi::CallbackInfo& info) {
  std::string a = stringArg(info, 0), b = stringArg(info, 1);
  return runVoid(info.Env(), [a, b] { vmspace::exchange(a, b); });
}

// ---- templates (issue 14; core/template.h) ----

// commitTemplate(pool, sourcePath, name, infoJson, replace, reflink, durable, progress)
Napi::Value CommitTemplate(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  vmspace::CommitRequest req;
  req.sourcePath = stringArg(info, 1);
  req.name = stringArg(info, 2);
  req.infoJson = stringArg(info, 3);
  req.replace = boolArg(info, 4);
  int64_t reflink = intArg(info, 5);
  req.clone.reflink = reflink == 0 ? vmspace::Reflink::Always : reflink == 2 ? vmspace::Reflink::Never : vmspace::Reflink::Auto;
  req.clone.durable = boolArg(info, 6);
  ProgressRef progress = progressArg(info, 7);
  req.progress = progress.get();
  return Work<vmspace::CommitResult>::Start(
      info.Env(), [pool, req, progress] { return pool->templates(true)->commit(req); },
      [reflink = req.clone.reflink](Napi::Env env, vmspace::CommitResult& r) -> Napi::Value {
        Napi::Object o = Napi::Object::New(env);
        o.Set("id", r.id);
        o.Set("metaText", r.metaText);
        o.Set("clone", summaryObject(env, r.clone, reflink));
        o.Set("allocatedBytes", static_cast<double>(r.allocatedBytes));
        if (!r.replacedId.empty()) {
          o.Set("replacedId", r.replacedId);
          o.Set("replacedRemoved", r.replacedRemoved);
        }
        return o;
      });
}

Napi::Value ListTemplates(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  return Work<std::vector<vmspace::TemplateListing>>::Start(
      info.Env(),
      [pool] {
        vmspace::TemplateStore* store = pool->templates(false);
        return store ? store->list() : std::vector<vmspace::TemplateListing>();
      },
      [pool](Napi::Env env, std::vector<vmspace::TemplateListing>& list) -> Napi::Value {
        Napi::Array out = Napi::Array::New(env, list.size());
        for (size_t i = 0; i < list.size(); i++) {
          const vmspace::TemplateListing& t = list[i];
          Napi::Object o = Napi::Object::New(env);
          o.Set("id", t.id);
          o.Set("currentName", t.currentName);
          o.Set("lastUsedMs", static_cast<double>(t.lastUsedMs));
          o.Set("retired", t.retired);
          o.Set("metaPath", pool->root() + "/.vmspace/templates/" + t.id + "/template.json");
          if (t.metaErrno == 0) {
            o.Set("metaText", t.metaText);
          } else {
            vmspace::Error e;
            e.err = t.metaErrno;
            e.syscall = "open";
            e.path = pool->root() + "/.vmspace/templates/" + t.id + "/template.json";
            o.Set("metaError", errorObject(env, e));
          }
          out.Set(static_cast<uint32_t>(i), o);
        }
        return out;
      });
}

Napi::Value RemoveTemplate(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  std::string idOrName = stringArg(info, 1);
  struct Removed {
    std::string id;
    bool removed = false;
  };
  return Work<Removed>::Start(
      info.Env(),
      [pool, idOrName] {
        Removed r;
        vmspace::TemplateStore* store = pool->templates(false);
        if (!store)
          vmspace::throwCode("ERR_TEMPLATE_NOT_FOUND", "no template with the id or name '" + idOrName + "'", ENOENT,
                             "open", pool->root() + "/.vmspace/templates");
        r.removed = store->remove(idOrName, &r.id);
        return r;
      },
      [](Napi::Env env, Removed& r) -> Napi::Value {
        Napi::Object o = Napi::Object::New(env);
        o.Set("id", r.id);
        o.Set("removed", r.removed);
        return o;
      });
}

// ---- locks ----

Napi::Value LockOpen(const Napi::CallbackInfo& info) {
  std::string path = stringArg(info, 0);
  bool shared = boolArg(info, 1);
  struct Opened {
    int fd = -1;
    bool acquired = false;
  };
  return Work<Opened>::Start(
      info.Env(),
      [path, shared] {
        Opened o;
        o.fd = vmspace::lockOpen(path, shared, &o.acquired);
        return o;
      },
      [](Napi::Env env, Opened& o) -> Napi::Value {
        int fd = std::exchange(o.fd, -1);
        instance(env).locks.insert(fd);
        Napi::Object r = Napi::Object::New(env);
        r.Set("fd", fd);
        r.Set("acquired", o.acquired);
        return r;
      },
      [](Opened& o) {
        if (o.fd >= 0) ::close(o.fd);
      });
}

// A lock wait runs on a thread of its own, never on the libuv pool: a blocking flock would hold a pool thread
// for as long as the holder keeps the lock, and UV_THREADPOOL_SIZE (4 by default) such waits would freeze every
// fs call of the process (node-pty runs its blocking waits on their own threads for the same reason).
struct LockWaitDone;
void lockWaitCallJs(Napi::Env env, Napi::Function cb, LockWaiter* waiter, LockWaitDone* done);
using LockWaitTsfn = Napi::TypedThreadSafeFunction<LockWaiter, LockWaitDone, lockWaitCallJs>;

struct LockWaiter {
  int fd;  // the wait's own until its callback: replaced when the file at `path` was (lockFollowPath)
  std::string path;
  bool shared;
  pthread_t thread{};
  std::mutex mu;
  bool done = false;       // guarded by mu: once set, the thread may be gone and must not be signalled
  bool tsfnGone = false;   // guarded by mu: the env tore the callback down (a worker thread ended)
  std::atomic<bool> cancelled{false};
  LockWaitTsfn tsfn;
};
using WaiterRef = std::shared_ptr<LockWaiter>;

struct LockWaitDone {
  WaiterRef waiter;
  int err;
  const char* syscall;  // of err: "flock", or the fstat/stat/open of lockFollowPath
};

// On the JS thread, or with a null env while the env is torn down (the wait's result is then dropped, and so is
// the lock it may have got: nobody is left to release it).
void lockWaitCallJs(Napi::Env env, Napi::Function cb, LockWaiter*, LockWaitDone* d) {
  std::unique_ptr<LockWaitDone> done(d);
  if (env == nullptr || cb.IsEmpty()) {
    ::close(done->waiter->fd);
    return;
  }
  // The fd goes back to the instance (held, or to be released by lib) before JS sees it.
  Instance& inst = instance(env);
  inst.waiters.erase(done->waiter);
  inst.locks.insert(done->waiter->fd);
  cb.Call({Napi::Number::New(env, done->err), Napi::Number::New(env, done->waiter->fd),
           Napi::String::New(env, done->syscall)});
}

// Interrupts a waiting thread (see LockCancel); a no-op once the thread is done.
void cancelWaiter(LockWaiter& w) {
  w.cancelled.store(true);
  int sig = vmspace::lockCancelSignal();
  std::lock_guard<std::mutex> lock(w.mu);
  if (!w.done && sig) pthread_kill(w.thread, sig);
}

Instance::~Instance() {
  for (int fd : leases) ::close(fd);
  for (int fd : locks) ::close(fd);
  // A wait still running closes its own fd when it finds the env gone (its callback can no longer be made).
  for (auto& w : waiters) cancelWaiter(*w);
}

// lockWait(fd, path, shared, callback(errno, fd, syscall)): callback gets 0 once the lock is held on the file at
// `path`, ECANCELED after lockCancel, or the errno of `syscall`; with the fd it ends with, which the caller
// releases (a new one when the file was replaced during the wait). Returns the handle for lockCancel.
Napi::Value LockWait(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  auto waiter = std::make_shared<LockWaiter>();
  waiter->fd = static_cast<int>(intArg(info, 0));
  waiter->path = stringArg(info, 1);
  waiter->shared = boolArg(info, 2);
  if (!info[3].IsFunction()) throw Napi::TypeError::New(env, "vmspace binding: callback must be a function");
  // Node frees a thread-safe function when its env is torn down, even while a thread still holds it; the
  // finalizer tells the thread (under mu) not to touch it any more.
  waiter->tsfn = LockWaitTsfn::New(
      env, info[3].As<Napi::Function>(), "vmspace lock wait", 0, 1, waiter.get(),
      [](Napi::Env, WaiterRef* ref, LockWaiter*) {
        {
          std::lock_guard<std::mutex> lock((*ref)->mu);
          (*ref)->tsfnGone = true;
        }
        delete ref;
      },
      new WaiterRef(waiter));
  instance(env).locks.erase(waiter->fd);  // the wait owns it until its callback runs
  instance(env).waiters.insert(waiter);
  int sig = vmspace::lockCancelSignal();  // installed here, on the JS thread, before any cancel can be sent
  // The result's allocation is made here, on the JS thread, where a bad_alloc becomes a JS exception: on the
  // detached wait thread it would end the process (std::terminate).
  auto* done = new LockWaitDone{waiter, 0, "flock"};
  auto wait = [waiter, sig, done] {
    // No V8 here: runs on the wait's own thread.
    int err;
    const char* syscall = "flock";
    for (;;) {
      if (waiter->cancelled.load()) {
        err = ECANCELED;
        break;
      }
      if (sig) {
        err = vmspace::lockWaitBlocking(waiter->fd, waiter->shared);
        if (err == EINTR) continue;  // a cancel (or another signal): check the flag again
      } else {
        // No signal to interrupt a blocking wait with: poll without blocking instead.
        err = vmspace::lockTry(waiter->fd, waiter->shared);
        if (err == EWOULDBLOCK) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          continue;
        }
      }
      if (err != 0) break;
      // Granted: on the file at the path, or on one deleted meanwhile (then wait again on the new one).
      err = vmspace::lockFollowPath(waiter->path, &waiter->fd, &syscall);
      if (err != EAGAIN) break;
      syscall = "flock";
    }
    std::lock_guard<std::mutex> lock(waiter->mu);
    waiter->done = true;
    if (waiter->tsfnGone) {
      ::close(waiter->fd);  // the env is gone: drop the lock (if we got it) here
      delete done;
      return;
    }
    done->err = err;
    done->syscall = syscall;
    if (waiter->tsfn.BlockingCall(done) != napi_ok) {
      ::close(waiter->fd);
      delete done;
    }
    waiter->tsfn.Release();
  };
  std::thread t;
  try {
    t = std::thread(wait);
  } catch (const std::system_error& e) {
    // No thread (EAGAIN: RLIMIT_NPROC or the kernel's thread limit): the fd goes back to the caller, who closes it.
    delete done;
    instance(env).waiters.erase(waiter);
    instance(env).locks.insert(waiter->fd);
    waiter->tsfn.Release();
    Napi::Error err = Napi::Error::New(env, std::string("vmspace: no thread for the lock wait: ") + e.what());
    err.Set("errno", Napi::Number::New(env, e.code().value()));
    throw err;
  }
  waiter->thread = t.native_handle();
  t.detach();
  return Napi::External<WaiterRef>::New(env, new WaiterRef(waiter), [](Napi::Env, WaiterRef* w) { delete w; });
}

// Interrupts a wait. The signal can land just before the thread enters flock, so the caller repeats this until
// the callback has run (lib/lock.ts does, every 10 ms).
Napi::Value LockCancel(const Napi::CallbackInfo& info) {
  if (info[0].IsExternal()) cancelWaiter(**info[0].As<Napi::External<WaiterRef>>().Data());
  return info.Env().Undefined();
}

// Closes an fd on the pool: the kernel drops its flock with the last fd of the open file description.
Napi::Promise closeFd(Napi::Env env, int fd) {
  return runVoid(env, [fd] { ::close(fd); });
}

// Closes a workspace's lease fd without removing the workspace (Workspace.release).
Napi::Value ReleaseLease(const Napi::CallbackInfo& info) {
  int fd = static_cast<int>(intArg(info, 0));
  if (instance(info.Env()).leases.erase(fd) == 0)
    throw Napi::Error::New(info.Env(), "vmspace binding: not a lease of this thread");
  return closeFd(info.Env(), fd);
}

Napi::Value LockRelease(const Napi::CallbackInfo& info) {
  int fd = static_cast<int>(intArg(info, 0));
  instance(info.Env()).locks.erase(fd);
  return closeFd(info.Env(), fd);
}

struct MaybeText {
  bool exists = false;
  std::string bytes;
};

// The index file's bytes as a Buffer (undefined when missing): UTF-8 is checked in JS, where invalid input is an
// error rather than a replacement character.
Napi::Value ReadIndex(const Napi::CallbackInfo& info) {
  std::string path = stringArg(info, 0);
  return Work<MaybeText>::Start(
      info.Env(),
      [path] {
        MaybeText t;
        t.exists = vmspace::readWholeFile(path, &t.bytes);
        return t;
      },
      [](Napi::Env env, MaybeText& t) -> Napi::Value {
        if (!t.exists) return env.Undefined();
        return Napi::Buffer<char>::Copy(env, t.bytes.data(), t.bytes.size());
      });
}

Napi::Value WriteIndex(const Napi::CallbackInfo& info) {
  std::string path = stringArg(info, 0), text = stringArg(info, 1);
  bool durable = boolArg(info, 2);
  return runVoid(info.Env(), [path, text, durable] { vmspace::replaceFile(path, text, durable); });
}

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

// Test seam (see core/pool.h): [name, flockErrno] pairs, the faults of the next sweep entries of those names.
Napi::Value SetSweepFaultsForTest(const Napi::CallbackInfo& info) {
  std::vector<vmspace::SweepFault> faults;
  if (info[0].IsArray()) {
    Napi::Array a = info[0].As<Napi::Array>();
    for (uint32_t i = 0; i < a.Length(); i++) {
      Napi::Value v = a.Get(i);
      if (!v.IsArray()) continue;
      Napi::Array pair = v.As<Napi::Array>();
      if (pair.Length() != 2 || !pair.Get(0u).IsString() || !pair.Get(1u).IsNumber()) continue;
      faults.push_back({pair.Get(0u).As<Napi::String>().Utf8Value(), pair.Get(1u).As<Napi::Number>().Int32Value()});
    }
  }
  vmspace::setSweepFaultsForTest(std::move(faults));
  return info.Env().Undefined();
}

// Context-aware (NAPI_MODULE_INIT via NODE_API_MODULE): no process-wide JS state; loads in every worker thread.
Napi::Object Init(Napi::Env env, Napi::Object exports) {
  env.SetInstanceData(new Instance());  // deleted (its leases closed) when the env is torn down
  exports.Set("releaseLease", Napi::Function::New(env, ReleaseLease, "releaseLease"));
  exports.Set("openPool", Napi::Function::New(env, OpenPool, "openPool"));
  exports.Set("closePool", Napi::Function::New(env, ClosePool, "closePool"));
  exports.Set("allocate", Napi::Function::New(env, Allocate, "allocate"));
  exports.Set("dispose", Napi::Function::New(env, Dispose, "dispose"));
  exports.Set("warmBuild", Napi::Function::New(env, WarmBuild, "warmBuild"));
  exports.Set("warmTake", Napi::Function::New(env, WarmTake, "warmTake"));
  exports.Set("warmDiscard", Napi::Function::New(env, WarmDiscard, "warmDiscard"));
  exports.Set("list", Napi::Function::New(env, List, "list"));
  exports.Set("adopt", Napi::Function::New(env, Adopt, "adopt"));
  exports.Set("sweep", Napi::Function::New(env, Sweep, "sweep"));
  exports.Set("clonePath", Napi::Function::New(env, ClonePath, "clonePath"));
  exports.Set("commitTemplate", Napi::Function::New(env, CommitTemplate, "commitTemplate"));  // issue 14
  exports.Set("listTemplates", Napi::Function::New(env, ListTemplates, "listTemplates"));
  exports.Set("removeTemplate", Napi::Function::New(env, RemoveTemplate, "removeTemplate"));
  exports.Set("probeQuota", Napi::Function::New(env, ProbeQuota, "probeQuota"));
  exports.Set("poolSpace", Napi::Function::New(env, PoolSpace, "poolSpace"));
  exports.Set("usage", Napi::Function::New(env, Usage, "usage"));
  exports.Set("clonePathBeneath", Napi::Function::New(env, ClonePathBeneath, "clonePathBeneath"));
  exports.Set("newProgress", Napi::Function::New(env, NewProgress, "newProgress"));
  exports.Set("readProgress", Napi::Function::New(env, ReadProgress, "readProgress"));
  exports.Set("cancelProgress", Napi::Function::New(env, CancelProgress, "cancelProgress"));
  exports.Set("removeTree", Napi::Function::New(env, RemoveTree, "removeTree"));
  exports.Set("renameNoReplace", Napi::Function::New(env, RenameNoReplace, "renameNoReplace"));
  exports.Set("exchange", Napi::Function::New(env, Exchange, "exchange"));
  exports.Set("lockOpen", Napi::Function::New(env, LockOpen, "lockOpen"));
  exports.Set("lockWait", Napi::Function::New(env, LockWait, "lockWait"));
  exports.Set("lockCancel", Napi::Function::New(env, LockCancel, "lockCancel"));
  exports.Set("lockRelease", Napi::Function::New(env, LockRelease, "lockRelease"));
  exports.Set("readIndex", Napi::Function::New(env, ReadIndex, "readIndex"));
  exports.Set("writeIndex", Napi::Function::New(env, WriteIndex, "writeIndex"));
  exports.Set("setTestIds", Napi::Function::New(env, SetTestIds, "setTestIds"));
  exports.Set("setSweepFaultsForTest", Napi::Function::New(env, SetSweepFaultsForTest, "setSweepFaultsForTest"));
  return exports;
}

}  // namespace

NODE_API_MODULE(vmspace, Init)

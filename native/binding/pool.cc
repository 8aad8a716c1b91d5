// pool: open, allocate, dispose, list, adopt, sweep, release a lease (native/core/pool.h).
#include <unistd.h>

#include <cstdint>
#include <utility>

#include "../core/names.h"

#include "batch.h"
#include "common.h"

namespace vmspace::binding {

namespace {

// openPool({root, create, sharedGid, nonEmpty, minFreeBytes, projectIdFirst, projectIdLast, templateCache,
// templateCacheBytes})
Napi::Value OpenPool(const Napi::CallbackInfo& info) {
  Options o(info, 0, "openPool");
  std::string root = o.string("root");
  bool create = o.boolean("create");
  int64_t sharedGid = o.int64Or("sharedGid", -1);  // -1: none
  bool nonEmpty = o.boolean("nonEmpty");           // make a pool in a directory holding other entries
  // quota: minFreeBytes, project id range
  uint64_t minFreeBytes = static_cast<uint64_t>(o.int64Or("minFreeBytes", 0));
  vmspace::ProjectIdRange projectIds{o.uint32("projectIdFirst"), o.uint32("projectIdLast")};
  bool cache = o.booleanOr("templateCache", true);
  auto cacheBytes = static_cast<uint64_t>(o.int64Or("templateCacheBytes", vmspace::kDefaultCacheBytes));
  return Work<std::shared_ptr<vmspace::Pool>>::StartHandle(
      info.Env(),
      [root, create, sharedGid, nonEmpty, minFreeBytes, projectIds, cache, cacheBytes] {
        auto pool = vmspace::Pool::open(root, create, sharedGid, nonEmpty);
        pool->setSpaceConfig(minFreeBytes, projectIds);
        pool->setCacheConfig(cache, cacheBytes);
        vmspace::bootId();  // read once, here on the pool thread
        return pool;
      },
      [](Napi::Env env, std::shared_ptr<vmspace::Pool>& pool) -> Napi::Value {
        Napi::Object o = Napi::Object::New(env);
        o.Set("handle",
              Napi::External<PoolRef>::New(env, new PoolRef{pool}, [](Napi::Env, PoolRef* ref) { delete ref; }));
        o.Set("bootId", vmspace::bootId());
        return o;
      });
}

Napi::Value ClosePool(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  return runVoid(info.Env(), [pool] { pool->close(); });
}

// allocate(pool, {prefix, mode, templateDir, entries, reflink, durable, info, progress, writeback,
// quotaBytes, quotaInodes, fromTemplate})
Napi::Value Allocate(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  Options o(info, 1, "allocate");
  vmspace::AllocateRequest req = workspaceRequestOf(o);
  req.info = o.members("info");
  ProgressRef progress = progressOf(o);
  req.progress = progress.get();
  req.clone.writeback = cloneOptionsOf(o).writeback;
  // quota: allocate only (a warm build has none); 0: none
  req.quota.bytes = static_cast<uint64_t>(o.int64Or("quotaBytes", 0));
  req.quota.inodes = static_cast<uint64_t>(o.int64Or("quotaInodes", 0));
  req.fromTemplate = o.stringOr("fromTemplate", "");
  vmspace::Reflink reflink = req.clone.reflink;
  // Batched (batch.h): with many calls in flight, several are served per libuv hop.
  return submitBatched(info.Env(), std::make_unique<LambdaJob<vmspace::AllocateResult>>(
                                       info.Env(), [pool, req, progress] { return pool->allocate(req); },
                                       [reflink](Napi::Env env, vmspace::AllocateResult& r) {
                                         return allocateResultObject(env, r, reflink);
                                       },
                                       dropAllocateResult));
}

// allocatePlain(pool, prefix, mode, info, durable): allocate() of an empty workspace (no template, quota, progress
// or writeback), the common call. Its arguments are positional and it resolves to [name, leaseFd, retries]: an
// options object and a result object cost ~40 property lookups and stores per call, the largest share of the
// binding's time with many calls in flight (`perf`).
Napi::Value AllocatePlain(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  vmspace::AllocateRequest req;
  req.prefix = stringArg(info, 1);
  req.mode = static_cast<mode_t>(integerArg(info, 2, 0, 07777, "allocatePlain"));
  static const std::string what = "allocatePlain: argument 3";
  req.info = jsonMembersOf(info.Env(), info[3], what);
  req.clone.durable = boolArg(info, 4);
  return submitBatched(info.Env(), std::make_unique<LambdaJob<vmspace::AllocateResult>>(
                                       info.Env(), [pool, req = std::move(req)] { return pool->allocate(req); },
                                       [](Napi::Env env, vmspace::AllocateResult& r) -> Napi::Value {
                                         int fd = std::exchange(r.leaseFd, -1);
                                         instance(env).leases.insert(fd);
                                         Napi::Array a = Napi::Array::New(env, 3);
                                         a.Set(0u, r.name);
                                         a.Set(1u, fd);
                                         a.Set(2u, r.retries);
                                         return a;
                                       },
                                       dropAllocateResult));
}

// dispose(pool, name, leaseFd, handoverFd, claim): positional, as allocatePlain. handoverFd -1: none opened.
Napi::Value Dispose(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  std::string name = stringArg(info, 1);
  int leaseFd = static_cast<int>(integerArg(info, 2, 0, INT32_MAX, "dispose"));
  int handoverFd = static_cast<int>(integerArg(info, 3, -1, INT32_MAX, "dispose"));
  // Only leases this thread holds (as releaseLease): the call closes the fds, which must never be other ones.
  auto& leases = instance(info.Env()).leases;
  if (leases.count(leaseFd) == 0 || (handoverFd >= 0 && leases.count(handoverFd) == 0))
    throw Napi::TypeError::New(info.Env(), "vmspace binding: dispose: not a lease of this thread");
  vmspace::DisposeHints hints;
  hints.claim = boolArg(info, 4);
  struct Unit {};
  Napi::Promise promise = submitBatched(info.Env(), std::make_unique<LambdaJob<Unit>>(
                                                        info.Env(),
                                                        [pool, name, leaseFd, handoverFd, hints] {
                                                          pool->dispose(name, leaseFd, handoverFd, hints);
                                                          return Unit{};
                                                        },
                                                        [](Napi::Env env, Unit&) { return env.Undefined(); }, nullptr,
                                                        [leaseFd, handoverFd] {
                                                          ::close(leaseFd);
                                                          if (handoverFd >= 0) ::close(handoverFd);
                                                        }));
  // Only now that the call owns the fds (the core closes them on every path; so does a call never run): a throw
  // above (no promise or queue could be made) leaves the lease with the workspace. No lease can reuse the numbers
  // before this line: leases are added on this thread only.
  leases.erase(leaseFd);
  if (handoverFd >= 0) leases.erase(handoverFd);
  return promise;
}

// openHandover(pool, name, leaseFd): a new read-only description of the workspace's lease, holding the handover
// byte (Pool::openHandover), for a child process. Synchronous: an open, two fstat and an fcntl.
Napi::Value OpenHandover(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  std::string name = stringArg(info, 1);
  int leaseFd = static_cast<int>(integerArg(info, 2, 0, INT32_MAX, "openHandover"));
  auto& leases = instance(info.Env()).leases;
  if (leases.count(leaseFd) == 0)
    throw Napi::TypeError::New(info.Env(), "vmspace binding: openHandover: not a lease of this thread");
  int fd;
  try {
    fd = pool->openHandover(name, leaseFd);
  } catch (const vmspace::Error& e) {
    throw Napi::Error(info.Env(), errorObject(info.Env(), e));
  }
  leases.insert(fd);
  return Napi::Number::New(info.Env(), fd);
}

// leaseHandedOver(pool, name, leaseFd): whether another description holds the lease (Pool::leaseHandedOver), for
// release(). Synchronous: one fcntl(F_OFD_GETLK), which never waits.
Napi::Value LeaseHandedOver(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  std::string name = stringArg(info, 1);
  int leaseFd = static_cast<int>(integerArg(info, 2, 0, INT32_MAX, "leaseHandedOver"));
  if (instance(info.Env()).leases.count(leaseFd) == 0)
    throw Napi::TypeError::New(info.Env(), "vmspace binding: leaseHandedOver: not a lease of this thread");
  try {
    return Napi::Boolean::New(info.Env(), pool->leaseHandedOver(name, leaseFd));
  } catch (const vmspace::Error& e) {
    throw Napi::Error(info.Env(), errorObject(info.Env(), e));
  }
}

// A workspace's record on `o`: `record`, or `recordError` (the errno of reading its lease file, with that path).
void setRecord(Napi::Env env, Napi::Object& o, const vmspace::Pool& pool, const std::string& name, int recordErrno,
               const std::string& record) {
  if (recordErrno == 0) {
    o.Set("record", record);
    return;
  }
  vmspace::Error e;
  e.err = recordErrno;
  e.syscall = "fgetxattr";
  e.path = pool.leasePath(name);
  o.Set("recordError", errorObject(env, e));
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
        setRecord(env, o, *pool, name, r.recordErrno, r.record);
        return o;
      },
      [](vmspace::AdoptResult& r) {
        if (r.leaseFd >= 0) ::close(r.leaseFd);
      });
}

// sweep(pool, {dryRun, graceMs})
Napi::Value Sweep(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  Options o(info, 1, "sweep");
  bool dryRun = o.boolean("dryRun");
  int64_t graceMs = o.int64("graceMs");
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
        o.Set("leasesRemoved", static_cast<double>(r.leasesRemoved));
        Napi::Array foreign = Napi::Array::New(env, r.foreign.size());
        for (size_t i = 0; i < r.foreign.size(); i++) foreign.Set(static_cast<uint32_t>(i), r.foreign[i]);
        o.Set("foreign", foreign);
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
          setRecord(env, o, *pool, entries[i].name, entries[i].recordErrno, entries[i].record);
          if (entries[i].probeErrno) {
            vmspace::Error e;
            e.err = entries[i].probeErrno;
            e.syscall = entries[i].probeSyscall;
            e.path = pool->leasePath(entries[i].name);
            o.Set("probeError", errorObject(env, e));
          }
          out.Set(static_cast<uint32_t>(i), o);
        }
        return out;
      });
}

// Closes a workspace's lease fd (or its handover fd) without removing the workspace (Workspace.release).
Napi::Value ReleaseLease(const Napi::CallbackInfo& info) {
  int fd = static_cast<int>(intArg(info, 0));
  auto& leases = instance(info.Env()).leases;
  if (leases.count(fd) == 0) throw Napi::Error::New(info.Env(), "vmspace binding: not a lease of this thread");
  // Out of the env's set only once the close is queued, as dispose (erased first, a close that could not be
  // queued while a worker thread was terminated would leave the lease open for good). closeFd releases nothing
  // when it throws: then it is closed here.
  Napi::Promise promise;
  try {
    promise = closeFd(info.Env(), fd);
  } catch (...) {
    leases.erase(fd);
    ::close(fd);
    throw;
  }
  leases.erase(fd);
  return promise;
}

// The process or worker thread is exiting (lib/binding.ts, on 'exit'): batched calls not run yet are dropped unrun
// and the pool threads stop after the call each is running, instead of draining the queue before the exit.
Napi::Value StopBatch(const Napi::CallbackInfo& info) {
  closeBatch(instance(info.Env()).batch);
  return info.Env().Undefined();
}

}  // namespace

vmspace::AllocateRequest workspaceRequestOf(const Options& o) {
  vmspace::AllocateRequest req;
  req.prefix = o.string("prefix");
  req.mode = static_cast<mode_t>(o.uint32("mode"));
  req.templateDir = o.string("templateDir");
  Napi::Array entries = o.array("entries");
  for (uint32_t i = 0; i < entries.Length(); i++) {
    Napi::Value pair = entries.Get(i);
    Napi::Value dest, source;
    if (pair.IsArray()) dest = pair.As<Napi::Array>().Get(0u), source = pair.As<Napi::Array>().Get(1u);
    if (!pair.IsArray() || !dest.IsString() || !source.IsString())
      throw Napi::TypeError::New(o.env(), "vmspace binding: option 'entries' must hold [dest, source] string pairs");
    req.entries.push_back({dest.As<Napi::String>().Utf8Value(), source.As<Napi::String>().Utf8Value()});
  }
  vmspace::CloneOptions clone = cloneOptionsOf(o);
  req.clone.reflink = clone.reflink;
  req.clone.durable = clone.durable;
  req.clone.keepDevices = clone.keepDevices;
  req.clone.keepSetId = clone.keepSetId;
  return req;
}

Napi::Value allocateResultObject(Napi::Env env, vmspace::AllocateResult& r, vmspace::Reflink reflink) {
  int fd = std::exchange(r.leaseFd, -1);
  instance(env).leases.insert(fd);
  Napi::Object o = Napi::Object::New(env);
  o.Set(propertyKey(env, "id"), r.id);  // cached keys: this runs once per allocate
  o.Set(propertyKey(env, "name"), r.name);
  o.Set(propertyKey(env, "leaseFd"), fd);
  o.Set(propertyKey(env, "retries"), r.retries);
  Napi::Array clones = Napi::Array::New(env, r.clones.size());
  for (size_t i = 0; i < r.clones.size(); i++) {
    Napi::Object c = summaryObject(env, r.clones[i].result, reflink);
    c.Set("dest", r.clones[i].dest);
    clones.Set(static_cast<uint32_t>(i), c);
  }
  o.Set(propertyKey(env, "clones"), clones);
  if (!r.templateId.empty()) {
    o.Set("templateId", r.templateId);
    o.Set("templateRecord", r.templateRecord);
  }
  return o;
}

void dropAllocateResult(vmspace::AllocateResult& r) {
  if (r.leaseFd >= 0) ::close(r.leaseFd);  // the workspace is then an orphan for a sweep
}

void initPool(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "openPool", OpenPool);
  exportFunction(env, exports, "closePool", ClosePool);
  exportFunction(env, exports, "allocate", Allocate);
  exportFunction(env, exports, "allocatePlain", AllocatePlain);
  exportFunction(env, exports, "dispose", Dispose);
  exportFunction(env, exports, "list", List);
  exportFunction(env, exports, "adopt", Adopt);
  exportFunction(env, exports, "sweep", Sweep);
  exportFunction(env, exports, "releaseLease", ReleaseLease);
  exportFunction(env, exports, "openHandover", OpenHandover);
  exportFunction(env, exports, "leaseHandedOver", LeaseHandedOver);
  exportFunction(env, exports, "stopBatch", StopBatch);
}

}  // namespace vmspace::binding

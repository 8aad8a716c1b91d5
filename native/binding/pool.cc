// pool: open, allocate, dispose, list, adopt, sweep, release a lease (native/core/pool.h).
#include <unistd.h>

#include <utility>

#include "../core/names.h"

#include "common.h"

namespace vmspace::binding {

namespace {

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

// Closes a workspace's lease fd without removing the workspace (Workspace.release).
Napi::Value ReleaseLease(const Napi::CallbackInfo& info) {
  int fd = static_cast<int>(intArg(info, 0));
  if (instance(info.Env()).leases.erase(fd) == 0)
    throw Napi::Error::New(info.Env(), "vmspace binding: not a lease of this thread");
  return closeFd(info.Env(), fd);
}

}  // namespace

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

void initPool(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "openPool", OpenPool);
  exportFunction(env, exports, "closePool", ClosePool);
  exportFunction(env, exports, "allocate", Allocate);
  exportFunction(env, exports, "dispose", Dispose);
  exportFunction(env, exports, "list", List);
  exportFunction(env, exports, "adopt", Adopt);
  exportFunction(env, exports, "sweep", Sweep);
  exportFunction(env, exports, "releaseLease", ReleaseLease);
}

}  // namespace vmspace::binding

// clone: clonePath, clonePathBeneath, cloneOutBeneath and their progress/cancel handles (native/core/clone_path.h).
#include <cstdint>

#include "../core/clone_path.h"
#include "common.h"

namespace vmspace::binding {

namespace {

// clonePath({src, dst, reflink, overwrite, durable, writeback, progress})
Napi::Value ClonePath(const Napi::CallbackInfo& info) {
  Options o(info, 0, "clonePath");
  std::string src = o.string("src"), dst = o.string("dst");
  vmspace::CloneOptions opts = cloneOptionsOf(o);
  ProgressRef progress = progressOf(o);
  return Work<vmspace::CloneSummary>::Start(
      info.Env(), [src, dst, opts, progress] { return vmspace::clonePath(src, dst, opts, progress.get()); },
      [opts](Napi::Env env, vmspace::CloneSummary& s) -> Napi::Value { return summaryObject(env, s, opts.reflink); });
}

// clonePathBeneath(pool, name, basePath, src, rel, reflink, overwrite, durable, writeback, progress): into the
// published workspace `name` of `pool` (its directory opened here, O_NOFOLLOW); positional, the
// enums as their index in lib/clone.ts's reflinkValues and writebackValues, resolving to summaryArray: an options
// object and a result object would cost ~15 property reads and ~6 stores per Workspace.clone, a tenth of a 1 GiB
// reflink clone (docs/DESIGN.md, "Measurements behind the code").
Napi::Value ClonePathBeneath(const Napi::CallbackInfo& info) {
  static constexpr vmspace::Reflink reflinks[] = {vmspace::Reflink::Always, vmspace::Reflink::Auto,
                                                  vmspace::Reflink::Never};
  static constexpr vmspace::Writeback writebacks[] = {vmspace::Writeback::None, vmspace::Writeback::Start,
                                                      vmspace::Writeback::Wait};
  auto pool = poolArg(info, 0);
  std::string name = stringArg(info, 1);
  std::string basePath = stringArg(info, 2), src = stringArg(info, 3), rel = stringArg(info, 4);
  vmspace::CloneOptions opts;
  opts.reflink = reflinks[integerArg(info, 5, 0, 2, "clonePathBeneath")];
  opts.overwrite = boolArg(info, 6);
  opts.durable = boolArg(info, 7);
  opts.writeback = writebacks[integerArg(info, 8, 0, 2, "clonePathBeneath")];
  ProgressRef progress = progressArg(info, 9);
  return Work<vmspace::CloneSummary>::Start(
      info.Env(),
      [pool, name = std::move(name), basePath = std::move(basePath), src = std::move(src), rel = std::move(rel), opts,
       progress] {
        vmspace::UniqueFd base = pool->openWorkspaceDir(name);
        vmspace::CloneOptions withCache = opts;
        withCache.cache = pool->templateCache();  // a file from another file system: reflinked from its cached copy
        return vmspace::clonePathBeneath(src, base.get(), basePath, rel, withCache, progress.get());
      },
      [opts](Napi::Env env, vmspace::CloneSummary& s) -> Napi::Value { return summaryArray(env, s, opts.reflink); });
}

// cloneOutBeneath(pool, {name, basePath, rel, dst, reflink, overwrite, durable, writeback, progress}): `rel`
// resolved beneath the published workspace `name` of `pool` (its directory opened here, O_NOFOLLOW), cloned out
// to the absolute `dst` without the guest's device nodes, set-id bits and file capabilities.
Napi::Value CloneOutBeneath(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  Options o(info, 1, "cloneOutBeneath");
  std::string name = o.string("name"), basePath = o.string("basePath"), rel = o.string("rel"), dst = o.string("dst");
  vmspace::CloneOptions opts = cloneOptionsOf(o);
  // What comes out of a workspace is a guest's: no device node is made on the host, no set-id bit or file
  // capability is kept (docs/templates.md, "What a guest's tree may carry").
  opts.keepDevices = false;
  opts.keepSetId = false;
  ProgressRef progress = progressOf(o);
  return Work<vmspace::CloneSummary>::Start(
      info.Env(),
      [pool, name = std::move(name), basePath = std::move(basePath), rel = std::move(rel), dst = std::move(dst), opts,
       progress] {
        vmspace::UniqueFd base = pool->openWorkspaceDir(name);
        return vmspace::cloneOutBeneath(base.get(), basePath, rel, dst, opts, progress.get());
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

}  // namespace

vmspace::CloneOptions cloneOptionsOf(const Options& o) {
  static constexpr vmspace::Reflink reflinks[] = {vmspace::Reflink::Always, vmspace::Reflink::Auto,
                                                  vmspace::Reflink::Never};
  static constexpr vmspace::Writeback writebacks[] = {vmspace::Writeback::None, vmspace::Writeback::Start,
                                                      vmspace::Writeback::Wait};
  vmspace::CloneOptions c;
  c.reflink = reflinks[o.oneOf("reflink", {"always", "auto", "never"}, 1)];
  c.overwrite = o.booleanOr("overwrite", false);
  c.durable = o.booleanOr("durable", false);
  c.writeback = writebacks[o.oneOf("writeback", {"none", "start", "wait"}, 0)];
  c.keepDevices = o.booleanOr("keepDevices", true);
  c.keepSetId = o.booleanOr("keepSetId", true);
  return c;
}

ProgressRef progressOf(const Options& o) {
  ProgressRef* p = o.externalOr<ProgressRef>("progress");
  return p ? *p : nullptr;
}

// Optional progress/cancel handle made by NewProgress; shared with the worker so it outlives whichever ends last.
ProgressRef progressArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsExternal()) return nullptr;
  return *info[i].As<Napi::External<ProgressRef>>().Data();
}

Napi::Array summaryArray(Napi::Env env, const vmspace::CloneSummary& s, vmspace::Reflink reflink) {
  const char* cache = cacheName(s.cache);
  Napi::Array a = Napi::Array::New(env, s.tree ? 13 : cache ? 7 : 6);
  a.Set(0u, s.tree ? "tree" : "file");
  a.Set(1u, vmspace::methodName(s, reflink));
  const uint64_t counts[] = {s.files,     s.bytes, s.reflinked, s.copied,         s.dirs,          s.symlinks,
                             s.hardlinks, s.fifos, s.devices,   s.skippedSockets, s.skippedDevices};
  for (uint32_t i = 0; i < (s.tree ? 11u : 4u); i++) a.Set(i + 2, static_cast<double>(counts[i]));
  if (cache) a.Set(6u, cache);
  return a;
}

const char* cacheName(vmspace::CacheUse use) {
  switch (use) {
    case vmspace::CacheUse::Hit:
      return "hit";
    case vmspace::CacheUse::Miss:
      return "miss";
    default:
      return nullptr;
  }
}

Napi::Object summaryObject(Napi::Env env, const vmspace::CloneSummary& s, vmspace::Reflink reflink) {
  Napi::Object o = Napi::Object::New(env);  // keys made once per env (propertyKey): one per clone
  o.Set(propertyKey(env, "kind"), s.tree ? "tree" : "file");
  o.Set(propertyKey(env, "method"), vmspace::methodName(s, reflink));
  o.Set(propertyKey(env, "files"), static_cast<double>(s.files));
  o.Set(propertyKey(env, "bytes"), static_cast<double>(s.bytes));
  o.Set(propertyKey(env, "reflinked"), static_cast<double>(s.reflinked));
  o.Set(propertyKey(env, "copied"), static_cast<double>(s.copied));
  if (const char* cache = cacheName(s.cache)) o.Set(propertyKey(env, "cache"), cache);
  if (s.tree) {
    o.Set(propertyKey(env, "dirs"), static_cast<double>(s.dirs));
    o.Set(propertyKey(env, "symlinks"), static_cast<double>(s.symlinks));
    o.Set(propertyKey(env, "hardlinks"), static_cast<double>(s.hardlinks));
    o.Set(propertyKey(env, "fifos"), static_cast<double>(s.fifos));
    o.Set(propertyKey(env, "devices"), static_cast<double>(s.devices));
    Napi::Object skipped = Napi::Object::New(env);
    skipped.Set(propertyKey(env, "sockets"), static_cast<double>(s.skippedSockets));
    skipped.Set(propertyKey(env, "devices"), static_cast<double>(s.skippedDevices));
    o.Set(propertyKey(env, "skipped"), skipped);
  }
  return o;
}

void initClone(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "clonePath", ClonePath);
  exportFunction(env, exports, "clonePathBeneath", ClonePathBeneath);
  exportFunction(env, exports, "cloneOutBeneath", CloneOutBeneath);
  exportFunction(env, exports, "newProgress", NewProgress);
  exportFunction(env, exports, "readProgress", ReadProgress);
  exportFunction(env, exports, "cancelProgress", CancelProgress);
}

}  // namespace vmspace::binding

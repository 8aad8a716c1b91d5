// clone: clonePath, clonePathBeneath and their progress/cancel handles (native/core/clone.h).


#include "common.h"

namespace vmspace::binding {

namespace {

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

}  // namespace

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

void initClone(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "clonePath", ClonePath);
  exportFunction(env, exports, "clonePathBeneath", ClonePathBeneath);
  exportFunction(env, exports, "newProgress", NewProgress);
  exportFunction(env, exports, "readProgress", ReadProgress);
  exportFunction(env, exports, "cancelProgress", CancelProgress);
}

}  // namespace vmspace::binding

// Template builds and image layers: templateBuildStart/Publish/Abandon, layerApply, findLayer, pipe
// (native/core/template_build.h, native/core/layer_apply.h).
#include <fcntl.h>
#include <unistd.h>

#include <thread>

#include "../core/layer_apply.h"
#include "../core/template_build.h"
#include "common.h"

namespace vmspace::binding {

namespace {

// A build held by JS: the pool (whose template store the build works in) and the build. The handle's finalizer
// abandons a build neither published nor abandoned.
struct BuildState {
  std::shared_ptr<vmspace::Pool> pool;
  std::unique_ptr<vmspace::TemplateBuild> build;
};
using BuildRef = std::shared_ptr<BuildState>;

// Off the JS thread (removing a tree can take long); on the finalizer's own thread where none can be made.
void abandonLater(const BuildRef& state) {
  auto abandon = [state] {
    std::lock_guard<std::mutex> lock(state->build->mutex());
    state->build->abandon();
  };
  try {
    std::thread(abandon).detach();
  } catch (const std::system_error&) {
    abandon();
  }
}

BuildRef buildArg(const Napi::CallbackInfo& info, size_t i) {
  if (!info[i].IsExternal()) throw Napi::TypeError::New(info.Env(), "vmspace binding: not a template build handle");
  return *info[i].As<Napi::External<BuildRef>>().Data();
}

// The build for one call on a pool thread: EBUSY while another call uses it, EBADF once it is over.
std::unique_lock<std::mutex> lockBuild(BuildState& s, const char* call) {
  std::unique_lock<std::mutex> lock(s.build->mutex(), std::try_to_lock);
  if (!lock.owns_lock()) vmspace::throwErrno(EBUSY, call, s.build->treePath());
  if (s.build->over()) vmspace::throwErrno(EBADF, call, s.build->treePath());
  return lock;
}

// templateBuildStart(pool, {parent, reflink, durable, progress}) -> {build, id, treePath}
Napi::Value TemplateBuildStart(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  Options o(info, 1, "templateBuildStart");
  vmspace::BuildRequest req;
  req.parent = o.string("parent");
  vmspace::CloneOptions clone = cloneOptionsOf(o);
  req.reflink = clone.reflink;
  req.durable = clone.durable;
  ProgressRef progress = progressOf(o);
  req.progress = progress.get();
  return Work<BuildRef>::StartHandle(
      info.Env(),
      [pool, req, progress] {
        auto state = std::make_shared<BuildState>();
        state->pool = pool;
        state->build = vmspace::TemplateBuild::start(*pool->templates(true), req);
        return state;
      },
      [](Napi::Env env, BuildRef& state) -> Napi::Value {
        Napi::Object o = Napi::Object::New(env);
        o.Set("id", state->build->id());
        o.Set("treePath", state->build->treePath());
        o.Set("build", Napi::External<BuildRef>::New(env, new BuildRef(state), [](Napi::Env, BuildRef* ref) {
                // A call still using the build holds its lock: the abandon waits for it, off this thread.
                std::unique_lock<std::mutex> lock((*ref)->build->mutex(), std::try_to_lock);
                bool over = lock.owns_lock() && (*ref)->build->over();
                if (lock.owns_lock()) lock.unlock();
                if (!over) abandonLater(*ref);
                delete ref;
              }));
        return o;
      });
}

// layerApply(build, fd, {progress, durable}) -> {entries, bytes, whiteouts}; `fd` is closed by the call.
Napi::Value LayerApply(const Napi::CallbackInfo& info) {
  auto fd = std::make_shared<UniqueFd>(static_cast<int>(integerArg(info, 1, 0, INT32_MAX, "layerApply")));
  BuildRef state = buildArg(info, 0);
  Options o(info, 2, "layerApply");
  vmspace::LayerApplyOptions opts;
  opts.durable = o.booleanOr("durable", false);
  ProgressRef progress = progressOf(o);
  opts.progress = progress.get();
  opts.minFreeBytes = state->pool->minFreeBytes();
  return Work<vmspace::LayerApplyResult>::Start(
      info.Env(),
      [state, fd, opts, progress] {
        UniqueFd own = std::move(*fd);
        auto lock = lockBuild(*state, "layerApply");
        return vmspace::applyLayer(own.get(), state->build->treeFd(), state->build->treePath(), opts);
      },
      [](Napi::Env env, vmspace::LayerApplyResult& r) -> Napi::Value {
        Napi::Object o = Napi::Object::New(env);
        o.Set("entries", static_cast<double>(r.entries));
        o.Set("bytes", static_cast<double>(r.bytes));
        o.Set("whiteouts", static_cast<double>(r.whiteouts));
        return o;
      });
}

// templateBuildPublish(build, {info, layerKey, name, replace}) -> {id, existing, record, allocatedBytes, ...}
Napi::Value TemplateBuildPublish(const Napi::CallbackInfo& info) {
  BuildRef state = buildArg(info, 0);
  Options o(info, 1, "templateBuildPublish");
  vmspace::PublishRequest req;
  req.info = o.members("info");
  req.layerKey = o.stringOr("layerKey", "");
  req.name = o.stringOr("name", "");
  req.replace = o.booleanOr("replace", false);
  return Work<vmspace::CommitResult>::Start(
      info.Env(),
      [state, req] {
        auto lock = lockBuild(*state, "templateBuildPublish");
        return state->build->publish(req);
      },
      [](Napi::Env env, vmspace::CommitResult& r) -> Napi::Value {
        Napi::Object o = publishedObject(env, r);
        o.Set("existing", r.existing);
        return o;
      });
}

// templateBuildAbandon(build): waits for a call using the build to end (a layerApply: cancel it first).
Napi::Value TemplateBuildAbandon(const Napi::CallbackInfo& info) {
  BuildRef state = buildArg(info, 0);
  return runVoid(info.Env(), [state] {
    std::lock_guard<std::mutex> lock(state->build->mutex());
    state->build->abandon();
  });
}

// findLayer(pool, layerKey) -> id | null
Napi::Value FindLayer(const Napi::CallbackInfo& info) {
  return templateLookup(info, &vmspace::TemplateStore::findLayer);
}

// pipe() -> [readFd, writeFd], O_CLOEXEC.
Napi::Value Pipe(const Napi::CallbackInfo& info) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    vmspace::Error e;
    e.err = errno;
    e.syscall = "pipe2";
    throw Napi::Error(info.Env(), errorObject(info.Env(), e));
  }
  Napi::Array a = Napi::Array::New(info.Env(), 2);
  a.Set(0u, fds[0]);
  a.Set(1u, fds[1]);
  return a;
}

}  // namespace

void initTemplateBuild(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "templateBuildStart", TemplateBuildStart);
  exportFunction(env, exports, "templateBuildPublish", TemplateBuildPublish);
  exportFunction(env, exports, "templateBuildAbandon", TemplateBuildAbandon);
  exportFunction(env, exports, "layerApply", LayerApply);
  exportFunction(env, exports, "findLayer", FindLayer);
  exportFunction(env, exports, "pipe", Pipe);
}

}  // namespace vmspace::binding

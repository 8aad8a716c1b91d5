// template: commit, list, remove (native/core/template.h).
#include "../core/template.h"

#include "../core/layout.h"

#include "common.h"

namespace vmspace::binding {

Napi::Object publishedObject(Napi::Env env, const vmspace::CommitResult& r) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("id", r.id);
  o.Set("record", r.record);
  o.Set("allocatedBytes", static_cast<double>(r.allocatedBytes));
  if (!r.replacedId.empty()) {
    o.Set("replacedId", r.replacedId);
    o.Set("replacedRemoved", r.replacedRemoved);
  }
  return o;
}

namespace {

// commitTemplate(pool, {sourcePath, name, info, replace, reflink, durable, keepDevices, keepSetId, progress, share?,
// parent?}): share, the paths of the shared files (lib/ checked them); parent, the workspace's template id or ''.
Napi::Value CommitTemplate(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  Options o(info, 1, "commitTemplate");
  vmspace::CommitRequest req;
  req.sourcePath = o.string("sourcePath");
  req.name = o.string("name");
  req.info = o.members("info");
  req.replace = o.boolean("replace");
  req.share = o.stringsOr("share");
  req.parentId = o.stringOr("parent", "");
  vmspace::CloneOptions clone = cloneOptionsOf(o);
  req.clone.reflink = clone.reflink;
  req.clone.durable = clone.durable;
  req.clone.keepDevices = clone.keepDevices;
  req.clone.keepSetId = clone.keepSetId;
  ProgressRef progress = progressOf(o);
  req.progress = progress.get();
  return Work<vmspace::CommitResult>::Start(
      info.Env(), [pool, req, progress] { return pool->templates(true)->commit(req); },
      [reflink = req.clone.reflink](Napi::Env env, vmspace::CommitResult& r) -> Napi::Value {
        Napi::Object o = publishedObject(env, r);
        o.Set("clone", summaryObject(env, r.clone, reflink));
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
          o.Set("recordPath", vmspace::layout::templateMetaPath(pool->root(), t.id));
          if (t.recordErrno == 0) {
            o.Set("record", t.record);
          } else {
            vmspace::Error e;
            e.err = t.recordErrno;
            e.syscall = "open";
            e.path = vmspace::layout::templateMetaPath(pool->root(), t.id);
            o.Set("recordError", errorObject(env, e));
          }
          out.Set(static_cast<uint32_t>(i), o);
        }
        return out;
      });
}

Napi::Value RemoveTemplate(const Napi::CallbackInfo& info) {
  auto pool = poolArg(info, 0);
  std::string idOrName = stringArg(info, 1);
  bool unlessCurrent = info.Length() > 2 && info[2].IsBoolean() && info[2].As<Napi::Boolean>().Value();
  struct Removed {
    std::string id;
    bool removed = false, kept = false;
    uint64_t bytes = 0;
  };
  return Work<Removed>::Start(
      info.Env(),
      [pool, idOrName, unlessCurrent] {
        Removed r;
        vmspace::TemplateStore* store = pool->templates(false);
        if (!store)
          vmspace::throwCode("ERR_TEMPLATE_NOT_FOUND", "no template with the id or name '" + idOrName + "'", ENOENT,
                             "open", vmspace::layout::templatesPath(pool->root()));
        r.removed = store->remove(idOrName, &r.id, unlessCurrent, &r.kept, &r.bytes);
        return r;
      },
      [](Napi::Env env, Removed& r) -> Napi::Value {
        Napi::Object o = Napi::Object::New(env);
        o.Set("id", r.id);
        o.Set("removed", r.removed);
        o.Set("kept", r.kept);
        o.Set("bytes", static_cast<double>(r.bytes));
        return o;
      });
}

// templateNameTarget(pool, name) -> the id the name's link holds now, or null.
Napi::Value TemplateNameTarget(const Napi::CallbackInfo& info) {
  return templateLookup(info, &vmspace::TemplateStore::nameTarget);
}

}  // namespace

Napi::Value templateLookup(const Napi::CallbackInfo& info,
                           std::string (vmspace::TemplateStore::*lookup)(const std::string&)) {
  auto pool = poolArg(info, 0);
  std::string key = stringArg(info, 1);
  return Work<std::string>::Start(
      info.Env(),
      [pool, key, lookup] {
        vmspace::TemplateStore* store = pool->templates(false);
        return store ? (store->*lookup)(key) : std::string();
      },
      [](Napi::Env env, std::string& id) -> Napi::Value {
        return id.empty() ? env.Null() : Napi::String::New(env, id);
      });
}

void initTemplate(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "commitTemplate", CommitTemplate);
  exportFunction(env, exports, "listTemplates", ListTemplates);
  exportFunction(env, exports, "removeTemplate", RemoveTemplate);
  exportFunction(env, exports, "templateNameTarget", TemplateNameTarget);
}

}  // namespace vmspace::binding

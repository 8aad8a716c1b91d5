// A JSON file read whole and replaced atomically (updateJsonFile in lib/; native/core/lock.h for now).
#include "../core/lock.h"

#include "common.h"

namespace vmspace::binding {

namespace {

struct MaybeText {
  bool exists = false;
  std::string bytes;
};

// readJsonFile(path): the file's bytes as a Buffer (undefined when missing): UTF-8 is checked in JS, where
// invalid input is an error rather than a replacement character.
Napi::Value ReadJsonFile(const Napi::CallbackInfo& info) {
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

// replaceJsonFile({path, text, durable}): writes a temp file beside `path` and renames it over (core/lock.h).
Napi::Value ReplaceJsonFile(const Napi::CallbackInfo& info) {
  Options o(info, 0, "replaceJsonFile");
  std::string path = o.string("path"), text = o.string("text");
  bool durable = o.boolean("durable");
  return runVoid(info.Env(), [path, text, durable] { vmspace::replaceFile(path, text, durable); });
}

}  // namespace

void initJsonFile(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "readJsonFile", ReadJsonFile);
  exportFunction(env, exports, "replaceJsonFile", ReplaceJsonFile);
}

}  // namespace vmspace::binding

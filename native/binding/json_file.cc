// A JSON file read whole and replaced atomically (updateJsonFile in lib/; native/core/lock.h for now).
#include "../core/lock.h"

#include "common.h"

namespace vmspace::binding {

namespace {

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

}  // namespace

void initJsonFile(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "readIndex", ReadIndex);
  exportFunction(env, exports, "writeIndex", WriteIndex);
}

}  // namespace vmspace::binding

// A JSON file read whole and replaced atomically under the lock on its own inode (updateJsonFile in lib/;
// native/core/json_file.h).
#include "../core/json_file.h"

#include "common.h"

namespace vmspace::binding {

namespace {

// readLockedJsonFile(fd, path): the bytes of the file open at `fd` (the locked data file) as a Buffer: UTF-8 is
// checked in JS, where invalid input is an error rather than a replacement character.
Napi::Value ReadLockedJsonFile(const Napi::CallbackInfo& info) {
  int fd = static_cast<int>(intArg(info, 0));
  std::string path = stringArg(info, 1);
  return Work<std::string>::Start(
      info.Env(),
      [fd, path] {
        std::string bytes;
        vmspace::readLockedFile(fd, path, &bytes);
        return bytes;
      },
      [](Napi::Env env, std::string& bytes) -> Napi::Value {
        return Napi::Buffer<char>::Copy(env, bytes.data(), bytes.size());
      });
}

// replaceJsonFile({path, fd, text, durable}): true once `text` replaced the file locked on `fd`; false when the
// file at `path` is no longer that one (nothing written: start over). core/json_file.h, replaceFile.
Napi::Value ReplaceJsonFile(const Napi::CallbackInfo& info) {
  Options o(info, 0, "replaceJsonFile");
  std::string path = o.string("path"), text = o.string("text");
  int fd = o.int32("fd");
  bool durable = o.boolean("durable");
  return Work<bool>::Start(
      info.Env(), [path, fd, text, durable] { return vmspace::replaceFile(path, fd, text, durable); },
      [](Napi::Env env, bool& written) -> Napi::Value { return Napi::Boolean::New(env, written); });
}

// createJsonFile({path, text, durable}): true once `text` is published at `path`, where no file was; false when
// one appeared meanwhile (nothing written: start over). core/json_file.h, createFile.
Napi::Value CreateJsonFile(const Napi::CallbackInfo& info) {
  Options o(info, 0, "createJsonFile");
  std::string path = o.string("path"), text = o.string("text");
  bool durable = o.boolean("durable");
  return Work<bool>::Start(
      info.Env(), [path, text, durable] { return vmspace::createFile(path, text, durable); },
      [](Napi::Env env, bool& written) -> Napi::Value { return Napi::Boolean::New(env, written); });
}

}  // namespace

void initJsonFile(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "readLockedJsonFile", ReadLockedJsonFile);
  exportFunction(env, exports, "replaceJsonFile", ReplaceJsonFile);
  exportFunction(env, exports, "createJsonFile", CreateJsonFile);
}

}  // namespace vmspace::binding

{
  "targets": [
    {
      "target_name": "vmspace",
      "sources": [
        "native/binding/addon.cc",
        "native/binding/common.cc",
        "native/binding/batch.cc",
        "native/binding/pool.cc",
        "native/binding/warm.cc",
        "native/binding/clone.cc",
        "native/binding/remove.cc",
        "native/binding/rename.cc",
        "native/binding/lock.cc",
        "native/binding/json_file.cc",
        "native/binding/template.cc",
        "native/binding/quota.cc",
        "native/core/clone.cc",
        "native/core/names.cc",
        "native/core/pool.cc",
        "native/core/lease.cc",
        "native/core/warm.cc",
        "native/core/remove.cc",
        "native/core/rename.cc",
        "native/core/tree.cc",
        "native/core/walk_threads.cc",
        "native/core/lock.cc",
        "native/core/json_file.cc",
        "native/core/process.cc",
        "native/core/io.cc",
        "native/core/template.cc",
        "native/core/template_cache.cc",
        "native/core/quota.cc",
        "native/core/pool_quota.cc",
        "native/core/metadata.cc",
        "native/core/pool_publish.cc",
        "native/core/pool_sweep.cc",
        "native/core/trusted.cc",
        "native/core/usage.cc"
      ],
      "include_dirs": ["<!(node -p \"require('node-addon-api').include_dir\")"],
      "defines": ["NAPI_VERSION=8", "NAPI_CPP_EXCEPTIONS", "NODE_API_SWALLOW_UNTHROWABLE_EXCEPTIONS", "_GNU_SOURCE"],
      "cflags!": ["-fno-exceptions"],
      "cflags_cc!": ["-fno-exceptions", "-fno-rtti"],
      "cflags_cc": ["-std=c++17", "-fexceptions", "-Wall", "-Wextra", "-Wno-unused-parameter", "-O2"]
    }
  ]
}

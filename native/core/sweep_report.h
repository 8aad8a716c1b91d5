// What a sweep reports (Pool::sweep, and the template store's and the template cache's parts of it): each entry
// reclaimed or failed, the live count, and what was left as foreign.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "error.h"

namespace vmspace {

struct SweepEntry {
  std::string name;
  const char* from;    // "published", "staging", "trash", "lease" (a lease file whose workspace is gone),
                       // "template", "template-staging" or "template-cache" (a cached copy, template_cache.h)
  uint64_t bytes = 0;  // space the file system got back: allocated less shared extents; 0 in a dry run
  Error error;         // for failures
};

struct SweepReport {
  std::vector<SweepEntry> reclaimed;
  // Entries whose handling failed (any errno, or an exception such as std::bad_alloc), one each; the sweep goes
  // on with the others. Includes a lease probe that cannot decide (F_OFD_GETLK fails: syscall
  // "fcntl(F_OFD_GETLK)"). An entry that vanished meanwhile (a concurrent dispose, allocate or sweep
  // finished it: ENOENT at its name) is not a failure and is in no list.
  std::vector<SweepEntry> failed;
  uint64_t live = 0;           // published workspaces whose lease is held
  uint64_t leasesRemoved = 0;  // lease files whose workspace was gone (a build or dispose that died between steps);
                               // a dead process's spare lease files are removed without being counted
  // Entries of the root, staging or trash named like a workspace but without a lease file: not vmspace's, left
  // as they are (paths).
  std::vector<std::string> foreign;
};

}  // namespace vmspace

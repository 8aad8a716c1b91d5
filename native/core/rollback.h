// Rollback of a workspace to one of its checkpoints (docs/checkpoints.md): the checkpoint's tree is built as
// allocate({ from }) builds a workspace (a staging entry under a lease file of its own, the same mode, owner and
// quota as the workspace), swapped with the workspace's directory by renameat2(RENAME_EXCHANGE), and the old tree,
// now at the staging entry, moved into trash and removed as dispose removes. The workspace's name holds a whole
// tree at every instant: the old one until the exchange, the new one after; its id, path and lease stay.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "clone.h"

namespace vmspace {

class Pool;

struct RollbackRequest {
  std::string name;                   // the published workspace, "<prefix>-<32 hex>"
  int leaseFd = -1;                   // the caller's hold of its lease (byte 0), kept open
  std::string checkpoint;             // the template's id (checked by the caller to be this workspace's checkpoint)
  bool durable = false;               // fsync the exchanged directories before returning
  CloneProgress* progress = nullptr;  // the build's counters and cancel (ECANCELED before the exchange)
};

struct RollbackOutcome {
  bool removed = false;  // the old tree is gone; false: left in trash under a free lease, for a sweep
  uint64_t bytes = 0;    // what its removal gave back (as a sweep counts)
};

// Rolls workspace `req.name` back to `req.checkpoint`. ERR_LEASE_HELD (nothing changed) when another open file
// description than `req.leaseFd`'s holds the lease, checked before the build and again just before the exchange.
// Any failure before the exchange removes the build and leaves the workspace as it was; the old tree's removal
// never throws (RollbackOutcome::removed false).
RollbackOutcome rollbackWorkspace(Pool& pool, const RollbackRequest& req);

// The bytes of template `id`'s tree that no other file shares (FIEMAP, as UsageReport::exclusiveBytes), under its
// read lock; -1 when there is no such template (removed meanwhile).
int64_t templateExclusiveBytes(Pool& pool, const std::string& id, const std::atomic<bool>* cancel);

}  // namespace vmspace

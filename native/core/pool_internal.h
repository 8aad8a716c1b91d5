// What pool.cc, pool_publish.cc and pool_sweep.cc share and no other part of the core uses: the names of the
// pool's own entries.
#pragma once

#include <string>

namespace vmspace {

inline constexpr char kNoReplaceProbe[] = ".noreplace-probe-";  // the sweep removes ownerless ones
inline constexpr char kInitPrefix[] = ".vmspace.init-";         // a new pool's .vmspace/ while it is built

// The names of staging shard `i` (staging/s<i>) and lease shard `i` (leases/<hex digit>).
std::string shardName(int i);
std::string leaseShardName(int i);

}  // namespace vmspace

// A workspace's record: the JSON object in its lease file (the xattr kRecordXattr, or the file's contents where
// the file system refuses an xattr that big), written once at publish (or with the lease, for a plain workspace)
// and read by list and adopt. Its schema: the caller's members, given by lib/ as JSON text (createdAt, pid,
// hostname, bootId, meta, ...), then what the core adds here: `name`, `templateId` (when cloned from a
// template) and `template`, the identity of each source cloned into it. The core never parses it: lib/ does.
#pragma once

#include <string>
#include <vector>

#include "clone.h"
#include "json_members.h"

namespace vmspace {

// A source cloned into a workspace (pool.h: an allocate's template and entries), as its record names it.
struct ClonedEntry {
  std::string dest;  // "" for templateDir
  std::string source;
  CloneSummary result;
  SourceIdentity identity;
};

constexpr const char* kRecordXattr = "user.vmspace.record";

// The record of workspace `name`: the caller's members, then its name, its template and the identity (device,
// inode, size, mtime at clone time) of each source cloned into it, as one line of JSON.
std::string recordJson(const JsonMembers& info, const std::string& name, const std::string& templateId,
                       const std::vector<ClonedEntry>& clones, Reflink reflink);

// Replaces the record of lease `fd` (the xattr; where the file system refuses one this big, the file's contents).
// 0 or the errno.
int writeRecord(int fd, const std::string& record);
// Reads the record of lease `fd` into `out`: 0, or the errno (ENODATA: none).
int readRecord(int fd, std::string* out);

}  // namespace vmspace

// A workspace's record (metadata.h): built, written to its lease file, read back.
#include "metadata.h"

#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>

#include "io.h"

namespace vmspace {
namespace {

constexpr size_t kMaxRecordBytes = 16 << 20;

// The xattr refused by the file system, not failing: none at all (ENOTSUP), or not this big (E2BIG, ENOSPC,
// ERANGE: ext4 keeps a file's xattrs in one block). The record then goes to the file's contents.
bool xattrRefused(int err) { return err == ENOTSUP || err == E2BIG || err == ENOSPC || err == ERANGE; }

}  // namespace

std::string recordJson(const JsonMembers& info, const std::string& name, const std::string& templateId,
                       const std::vector<ClonedEntry>& clones, Reflink reflink) {
  JsonMembers members = info;
  std::string quoted;
  appendJsonString(&quoted, name);
  members.emplace_back("name", std::move(quoted));
  if (!templateId.empty()) members.emplace_back("templateId", "\"" + templateId + "\"");
  std::string json = "[";
  for (size_t i = 0; i < clones.size(); i++) {
    const ClonedEntry& c = clones[i];
    const SourceIdentity& id = c.identity;
    if (i) json += ",";
    json += "{\"dest\":";
    appendJsonString(&json, c.dest);
    json += ",\"source\":";
    appendJsonString(&json, c.source);
    json += std::string(",\"kind\":\"") + (c.result.tree ? "tree" : "file") + "\",\"dev\":\"" + std::to_string(id.dev) +
            "\",\"ino\":\"" + std::to_string(id.ino) + "\",\"size\":" + std::to_string(id.size) + ",\"mtimeNs\":\"" +
            std::to_string(id.mtimeSec * 1000000000LL + id.mtimeNsec) + "\",\"method\":\"" +
            methodName(c.result, reflink) + "\"}";
  }
  json += "]";
  members.emplace_back("template", std::move(json));
  return jsonObject(members) + "\n";
}

int writeRecord(int fd, const std::string& record) {
  if (fsetxattr(fd, kRecordXattr, record.data(), record.size(), 0) == 0) return 0;
  if (!xattrRefused(errno)) return errno;
  if (ftruncate(fd, 0) != 0) return errno;
  if (int err = pwriteAll(fd, record.data(), record.size(), 0)) return err;
  // A record that fit before must not shadow this one.
  if (fremovexattr(fd, kRecordXattr) != 0 && errno != ENODATA && errno != ENOTSUP) return errno;
  return 0;
}

int readRecord(int fd, std::string* out) {
  out->resize(512);
  for (;;) {
    ssize_t n = fgetxattr(fd, kRecordXattr, out->data(), out->size());
    if (n >= 0) {
      out->resize(static_cast<size_t>(n));
      return 0;
    }
    if (errno == ENODATA || errno == ENOTSUP) break;
    if (errno != ERANGE) return errno;
    // Bigger than the buffer: ask its size (it may change again before the next read: then loop).
    ssize_t need = fgetxattr(fd, kRecordXattr, nullptr, 0);
    if (need < 0) return errno;
    out->resize(static_cast<size_t>(need) + 1);
  }
  // No xattr: the record is the file's contents (written there where the xattr was refused), or there is none.
  out->clear();
  char buf[4096];
  for (off_t off = 0;;) {
    ssize_t n = pread(fd, buf, sizeof buf, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) break;
    if (out->size() + static_cast<size_t>(n) > kMaxRecordBytes) return EFBIG;
    out->append(buf, static_cast<size_t>(n));
    off += n;
  }
  return out->empty() ? ENODATA : 0;
}

}  // namespace vmspace

// A streaming tar reader over an fd (read(2) in a loop, no temp file): ustar, PAX (path, linkpath, size, uid, gid,
// mtime, SCHILY.xattr.*; global headers ignored), GNU long names and links ('L'/'K'). Everything else (GNU sparse,
// multi-volume, unknown types, numbers that are not octal or base-256, negative or out of range, a bad header
// checksum, a stream that ends early) is ERR_LAYER_INVALID naming the entry. Memory is bounded: a name or link
// is at most kTarNameMax bytes, a PAX header kTarPaxMax. No N-API here.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "clone.h"

namespace vmspace {

constexpr size_t kTarNameMax = 4096;           // PATH_MAX
constexpr size_t kTarPaxMax = 1 << 20;         // one PAX extended header, in bytes
constexpr uint64_t kTarEntryMax = 1ULL << 44;  // one entry's data, in bytes (16 TiB)

enum class TarType { File, Dir, Symlink, HardLink, CharDevice, BlockDevice, Fifo };

struct TarEntry {
  std::string name;      // as the archive spells it (PAX path, GNU long name, or ustar prefix/name)
  std::string linkName;  // symlink target or hard link target
  TarType type = TarType::File;
  uint64_t size = 0;  // data bytes that follow (a regular file's; 0 for every other type)
  uint32_t mode = 0;  // permission bits, set-id and sticky (& 07777)
  uint32_t uid = 0, gid = 0;
  int64_t mtimeSec = 0;
  long mtimeNsec = 0;
  uint32_t devMajor = 0, devMinor = 0;
  std::vector<std::pair<std::string, std::string>> xattrs;  // SCHILY.xattr.<name> = value
};

class TarReader {
 public:
  // Reads from `fd` (not owned). `progress` (optional): bytes read are added, cancel is checked (ECANCELED).
  TarReader(int fd, const std::string& shown, CloneProgress* progress);
  TarReader(const TarReader&) = delete;
  TarReader& operator=(const TarReader&) = delete;

  // The next entry's header (the previous entry's unread data skipped): true, or false at the end of the archive
  // (a zero block; the rest of the stream is read to its EOF).
  bool next(TarEntry* entry);
  // Up to `n` bytes of the current entry's data into `buf`; 0 once it is all read.
  size_t read(char* buf, size_t n);
  uint64_t bytesRead() const { return total_; }

  // Throws ERR_LAYER_INVALID for the entry `name` ("" before one is known).
  [[noreturn]] void invalid(const std::string& name, const std::string& why) const;

 private:
  // Exactly `n` bytes into `dst` (null: skipped); a short stream is ERR_LAYER_INVALID (truncated) for `name`.
  void readExactly(char* dst, size_t n, const std::string& name);
  // Fills the buffer with at least one more byte: false at EOF.
  bool fill();
  void skipPadding(uint64_t size, const std::string& name);
  void readHeaderBlock(unsigned char* block, const std::string& name);
  // Which fields a PAX header set (they win over the ustar header's).
  struct PaxSeen {
    bool path = false, linkPath = false, size = false, uid = false, gid = false, mtime = false;
  };
  void parsePax(const std::string& data, TarEntry* pending, PaxSeen* seen, const std::string& name);
  // After the first zero block: the second checked, the rest of the stream read to EOF.
  void endOfArchive(const std::string& name);
  // The ustar header's fields the PAX header did not set, the type and device numbers.
  void headerFields(const unsigned char* h, char type, const PaxSeen& seen, TarEntry* e);
  std::string readLongName(uint64_t size, const std::string& name);

  int fd_;
  std::string shown_;
  CloneProgress* progress_;
  std::vector<char> buf_;
  size_t pos_ = 0, end_ = 0;
  uint64_t total_ = 0;
  uint64_t remaining_ = 0, padding_ = 0;  // of the current entry's data
  std::string current_;                   // the current entry's name (errors)
};

}  // namespace vmspace

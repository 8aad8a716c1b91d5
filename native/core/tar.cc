// The streaming tar reader (tar.h). Formats: POSIX ustar and pax (IEEE 1003.1-2008, "pax Interchange Format"),
// GNU tar's long names ('L'/'K') and base-256 numbers; the header checksum as both define it.
#include "tar.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "error.h"

namespace vmspace {
namespace {

constexpr size_t kBlock = 512;
constexpr size_t kBufferBytes = 256 << 10;

// A NUL-terminated field of at most `n` bytes.
std::string field(const unsigned char* p, size_t n) {
  size_t len = strnlen(reinterpret_cast<const char*>(p), n);
  return std::string(reinterpret_cast<const char*>(p), len);
}

bool allZero(const unsigned char* p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i]) return false;
  return true;
}

// A numeric header field: octal digits (leading spaces or NULs, then digits, then only spaces or NULs), or GNU's
// base-256 (high bit of the first byte set; a negative value, 0xff first, is refused). False when malformed or
// over `max`.
bool parseNumber(const unsigned char* p, size_t n, uint64_t max, uint64_t* out) {
  uint64_t v = 0;
  if (p[0] & 0x80) {
    if (p[0] & 0x40) return false;  // negative
    v = p[0] & 0x3f;
    for (size_t i = 1; i < n; i++) {
      if (v > (max >> 8)) return false;
      v = (v << 8) | p[i];
    }
    *out = v;
    return v <= max;
  }
  size_t i = 0;
  while (i < n && (p[i] == ' ' || p[i] == 0)) i++;
  for (; i < n && p[i] >= '0' && p[i] <= '7'; i++) {
    if (v > (max >> 3)) return false;
    v = (v << 3) | static_cast<uint64_t>(p[i] - '0');
  }
  for (; i < n; i++)
    if (p[i] != ' ' && p[i] != 0) return false;
  *out = v;
  return v <= max;
}

// A PAX decimal: digits only, at most `max`.
bool parseDecimal(const std::string& s, uint64_t max, uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    if (v > (max - static_cast<uint64_t>(c - '0')) / 10) return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *out = v;
  return true;
}

// A PAX time: seconds, optionally a fraction (nanoseconds kept); negative times are refused.
bool parsePaxTime(const std::string& s, int64_t* sec, long* nsec) {
  size_t dot = s.find('.');
  uint64_t whole;
  if (!parseDecimal(s.substr(0, dot), INT64_MAX, &whole)) return false;
  long frac = 0;
  if (dot != std::string::npos) {
    std::string f = s.substr(dot + 1);
    if (f.empty()) return false;
    for (size_t i = 0; i < f.size(); i++) {
      if (f[i] < '0' || f[i] > '9') return false;
      if (i < 9) frac = frac * 10 + (f[i] - '0');
    }
    for (size_t i = f.size(); i < 9; i++) frac *= 10;
  }
  *sec = static_cast<int64_t>(whole);
  *nsec = frac;
  return true;
}

}  // namespace

TarReader::TarReader(int fd, const std::string& shown, CloneProgress* progress)
    : fd_(fd), shown_(shown), progress_(progress), buf_(kBufferBytes) {}

void TarReader::invalid(const std::string& name, const std::string& why) const {
  std::string what = name.empty() ? "the layer's tar stream" : "layer entry '" + name + "'";
  throwCode("ERR_LAYER_INVALID", what + ": " + why, EINVAL, "read", name.empty() ? shown_ : name);
}

bool TarReader::fill() {
  if (progress_ && progress_->cancel.load(std::memory_order_relaxed)) throwErrno(ECANCELED, "read", shown_);
  if (pos_ == end_) pos_ = end_ = 0;
  for (;;) {
    ssize_t n = ::read(fd_, buf_.data() + end_, buf_.size() - end_);
    if (n < 0) {
      if (errno == EINTR) continue;
      throwErrno(errno, "read", shown_);
    }
    // A cancel closes the pipe's write end too: the EOF it causes is the cancel, not a truncated stream.
    if (progress_ && progress_->cancel.load(std::memory_order_relaxed)) throwErrno(ECANCELED, "read", shown_);
    if (n == 0) return false;
    end_ += static_cast<size_t>(n);
    total_ += static_cast<uint64_t>(n);
    if (progress_) progress_->bytes.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    return true;
  }
}

void TarReader::readExactly(char* dst, size_t n, const std::string& name) {
  while (n > 0) {
    if (pos_ == end_ && !fill()) invalid(name, "the stream ends inside it (truncated)");
    size_t k = std::min(n, end_ - pos_);
    if (dst) {
      memcpy(dst, buf_.data() + pos_, k);
      dst += k;
    }
    pos_ += k;
    n -= k;
  }
}

size_t TarReader::read(char* buf, size_t n) {
  if (remaining_ == 0) return 0;
  if (pos_ == end_ && !fill()) invalid(current_, "the stream ends inside its data (truncated)");
  size_t k = std::min<uint64_t>(std::min(n, end_ - pos_), remaining_);
  memcpy(buf, buf_.data() + pos_, k);
  pos_ += k;
  remaining_ -= k;
  return k;
}

void TarReader::skipPadding(uint64_t size, const std::string& name) {
  readExactly(nullptr, static_cast<size_t>((kBlock - size % kBlock) % kBlock), name);
}

void TarReader::readHeaderBlock(unsigned char* block, const std::string& name) {
  readExactly(reinterpret_cast<char*>(block), kBlock, name);
}

std::string TarReader::readLongName(uint64_t size, const std::string& name) {
  if (size > kTarNameMax + 1) invalid(name, "a GNU long name over " + std::to_string(kTarNameMax) + " bytes");
  std::string s(static_cast<size_t>(size), '\0');
  readExactly(&s[0], s.size(), name);
  skipPadding(size, name);
  s.resize(strnlen(s.c_str(), s.size()));
  return s;
}

void TarReader::parsePax(const std::string& data, TarEntry* e, PaxSeen* seen, const std::string& name) {
  size_t at = 0;
  while (at < data.size()) {
    size_t sp = data.find(' ', at);
    uint64_t len;
    if (sp == std::string::npos || !parseDecimal(data.substr(at, sp - at), data.size() - at, &len) ||
        len < sp - at + 3 || data[at + len - 1] != '\n')
      invalid(name, "a malformed PAX record");
    std::string rec = data.substr(sp + 1, at + len - 1 - (sp + 1));
    at += len;
    size_t eq = rec.find('=');
    if (eq == std::string::npos || eq == 0) invalid(name, "a malformed PAX record");
    std::string key = rec.substr(0, eq), value = rec.substr(eq + 1);
    uint64_t n;
    if (key == "path" || key == "linkpath") {
      if (value.size() > kTarNameMax) invalid(name, "a PAX " + key + " over " + std::to_string(kTarNameMax) + " bytes");
      (key == "path" ? e->name : e->linkName) = value;
      (key == "path" ? seen->path : seen->linkPath) = !value.empty();
    } else if (key == "size") {
      if (!parseDecimal(value, kTarEntryMax, &n)) invalid(name, "a PAX size that is not a size in range");
      seen->size = true;
      e->size = n;
    } else if (key == "uid" || key == "gid") {
      if (!parseDecimal(value, UINT32_MAX - 1, &n)) invalid(name, "a PAX " + key + " that is not an id in range");
      (key == "uid" ? e->uid : e->gid) = static_cast<uint32_t>(n);
      (key == "uid" ? seen->uid : seen->gid) = true;
    } else if (key == "mtime") {
      if (!parsePaxTime(value, &e->mtimeSec, &e->mtimeNsec)) invalid(name, "a PAX mtime that is not a time in range");
      seen->mtime = true;
    } else if (key.compare(0, 13, "SCHILY.xattr.") == 0 && key.size() > 13) {
      e->xattrs.emplace_back(key.substr(13), value);
    } else if (key.compare(0, 11, "GNU.sparse.") == 0) {
      invalid(name, "a GNU sparse file, which is not supported");
    }
  }
}

bool TarReader::next(TarEntry* out) {
  readExactly(nullptr, static_cast<size_t>(remaining_ + padding_), current_);  // what the caller left unread
  remaining_ = padding_ = 0;
  TarEntry e;
  PaxSeen seen;
  std::string longName, longLink;
  bool hasPax = false;
  unsigned char h[kBlock];
  const std::string prev = current_;
  for (;;) {
    std::string where = seen.path ? e.name : longName;
    if (pos_ == end_ && !fill()) invalid(prev, "the stream ends without the archive's end blocks (truncated)");
    readHeaderBlock(h, where);
    if (allZero(h, kBlock)) {
      if (hasPax || !longName.empty() || !longLink.empty()) invalid(where, "an extended header without its entry");
      endOfArchive(where);
      return false;
    }
    std::string hname = field(h, 100);
    uint64_t sum, unsignedSum = 0;
    int64_t signedSum = 0;
    for (size_t i = 0; i < kBlock; i++) {
      unsigned char c = (i >= 148 && i < 156) ? ' ' : h[i];
      unsignedSum += c;
      signedSum += static_cast<signed char>(c);
    }
    if (!parseNumber(h + 148, 8, UINT32_MAX, &sum) || (sum != unsignedSum && static_cast<int64_t>(sum) != signedSum))
      invalid(hname, "a header whose checksum does not match (not a tar, or corrupt)");
    bool posix = memcmp(h + 257, "ustar\0", 6) == 0, gnu = memcmp(h + 257, "ustar  \0", 8) == 0;
    if (!posix && !gnu) invalid(hname, "a header without the ustar magic");
    char type = static_cast<char>(h[156]);
    uint64_t size;
    if (!parseNumber(h + 124, 12, kTarEntryMax, &size)) invalid(hname, "a size that is not a size in range");
    if (type == 'x' || type == 'g' || type == 'L' || type == 'K') {
      if (type == 'L' || type == 'K') {
        (type == 'L' ? longName : longLink) = readLongName(size, where);
        continue;
      }
      if (size > kTarPaxMax) invalid(where, "a PAX header over " + std::to_string(kTarPaxMax) + " bytes");
      std::string data(static_cast<size_t>(size), '\0');
      readExactly(&data[0], data.size(), where);
      skipPadding(size, where);
      if (type == 'x') {
        parsePax(data, &e, &seen, where);
        hasPax = true;
      }
      continue;  // a global header ('g') is ignored: its records do not describe this layer's entries
    }
    if (!seen.path) e.name = !longName.empty() ? longName : posix && h[345] ? field(h + 345, 155) + "/" + hname : hname;
    if (!seen.linkPath) e.linkName = !longLink.empty() ? longLink : field(h + 157, 100);
    if (!seen.size) e.size = size;
    headerFields(h, type, seen, &e);
    current_ = e.name;
    remaining_ = e.size;
    padding_ = (kBlock - e.size % kBlock) % kBlock;
    *out = std::move(e);
    return true;
  }
}

void TarReader::endOfArchive(const std::string& name) {
  // The second zero block (a stream that ends after the first is taken as tar readers take it); what follows is
  // the writer's padding to its record size, read to EOF so that the writer is never left blocked on the pipe.
  size_t seen = 0;
  unsigned char block[kBlock];
  while (seen < kBlock && (pos_ < end_ || fill())) {
    size_t k = std::min(kBlock - seen, end_ - pos_);
    memcpy(block + seen, buf_.data() + pos_, k);
    pos_ += k;
    seen += k;
  }
  if (!allZero(block, seen)) invalid(name, "data where the archive's second end block should be");
  while (fill()) pos_ = end_;
}

void TarReader::headerFields(const unsigned char* h, char type, const PaxSeen& seen, TarEntry* e) {
  const std::string& name = e->name;
  if (name.empty()) invalid(name, "an entry without a name");
  if (name.size() > kTarNameMax || e->linkName.size() > kTarNameMax)
    invalid(name, "a name or link over " + std::to_string(kTarNameMax) + " bytes");
  uint64_t n;
  if (!parseNumber(h + 100, 8, UINT32_MAX, &n)) invalid(name, "a mode that is not octal");
  e->mode = static_cast<uint32_t>(n & 07777);
  if (!seen.uid) {
    if (!parseNumber(h + 108, 8, UINT32_MAX - 1, &n)) invalid(name, "a uid that is not an id in range");
    e->uid = static_cast<uint32_t>(n);
  }
  if (!seen.gid) {
    if (!parseNumber(h + 116, 8, UINT32_MAX - 1, &n)) invalid(name, "a gid that is not an id in range");
    e->gid = static_cast<uint32_t>(n);
  }
  if (!seen.mtime) {
    if (!parseNumber(h + 136, 12, INT64_MAX, &n)) invalid(name, "an mtime that is not a time in range");
    e->mtimeSec = static_cast<int64_t>(n);
    e->mtimeNsec = 0;
  }
  switch (type) {
    case '0':
    case '\0':
    case '7':
      e->type = TarType::File;
      break;
    case '1':
      e->type = TarType::HardLink;
      break;
    case '2':
      e->type = TarType::Symlink;
      break;
    case '3':
      e->type = TarType::CharDevice;
      break;
    case '4':
      e->type = TarType::BlockDevice;
      break;
    case '5':
      e->type = TarType::Dir;
      break;
    case '6':
      e->type = TarType::Fifo;
      break;
    default: {
      std::string shown = type >= 0x21 && type < 0x7f ? std::string("'") + type + "'"
                                                      : std::to_string(static_cast<unsigned char>(type));
      invalid(name, "an entry of type " + shown + " (" +
                        (type == 'S'   ? "GNU sparse"
                         : type == 'M' ? "multi-volume"
                                       : "unknown") +
                        "), which is not supported");
    }
  }
  if (e->type == TarType::CharDevice || e->type == TarType::BlockDevice) {
    uint64_t major, minor;
    if (!parseNumber(h + 329, 8, UINT32_MAX, &major) || !parseNumber(h + 337, 8, UINT32_MAX, &minor))
      invalid(name, "device numbers that are not octal");
    e->devMajor = static_cast<uint32_t>(major);
    e->devMinor = static_cast<uint32_t>(minor);
  }
  // Only a regular file has data; every other type is its header alone, whatever its size field says (as Go's
  // archive/tar reads them).
  if (e->type != TarType::File) e->size = 0;
}

}  // namespace vmspace

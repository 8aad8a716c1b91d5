#include "process.h"

#include <fcntl.h>

#include <cstdlib>
#include <string>

#include "io.h"

namespace vmspace {
namespace {

constexpr int kCapSysAdmin = 21;  // CAP_SYS_ADMIN, linux/capability.h

// A field of /proc/self/status ("Umask", "CapEff"), or "" where it cannot be read.
std::string statusField(const char* field) {
  std::string text;
  if (readRegularFileAt(AT_FDCWD, "/proc/self/status", 0, 1 << 16, &text) != 0) return {};
  std::string key = std::string("\n") + field + ":";
  size_t at = text.find(key);
  if (at == std::string::npos) return {};
  at += key.size();
  while (at < text.size() && (text[at] == ' ' || text[at] == '\t')) at++;
  size_t end = text.find('\n', at);
  return text.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

}  // namespace

mode_t currentUmask() {
  std::string v = statusField("Umask");
  if (v.empty()) return 077;
  return static_cast<mode_t>(strtoul(v.c_str(), nullptr, 8) & 0777);
}

bool hasCapSysAdmin() {
  std::string v = statusField("CapEff");
  return !v.empty() && (strtoull(v.c_str(), nullptr, 16) >> kCapSysAdmin) & 1;
}

}  // namespace vmspace

// A metadata record as its members: the caller's (lib/ serialises each value with JSON.stringify) and the core's
// own (the drawn name, the template sources, a template's usage), serialised into one JSON object here, once,
// with no string surgery on either side.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace vmspace {

// [key, value as JSON text] in order; keys are plain identifiers chosen by vmspace (never escaped). A member with an
// empty key is a run of members already serialised, `"k":v,...` (what lib/ sends: one string per record).
using JsonMembers = std::vector<std::pair<std::string, std::string>>;

// Appends `s` as a JSON string: quotes, backslash and control characters escaped (RFC 8259 section 7); other
// bytes as they are (UTF-8 passes through).
inline void appendJsonString(std::string* out, const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  out->push_back('"');
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
    } else if (c < 0x20) {
      out->append("\\u00");
      out->push_back(kHex[c >> 4]);
      out->push_back(kHex[c & 15]);
    } else {
      out->push_back(static_cast<char>(c));
    }
  }
  out->push_back('"');
}

// {"key":value,...} (no newline).
inline std::string jsonObject(const JsonMembers& members) {
  std::string out = "{";
  for (const auto& [key, value] : members) {
    if (key.empty() && value.empty()) continue;
    if (out.size() > 1) out += ",";
    if (key.empty()) {
      out += value;
    } else {
      out += "\"" + key + "\":" + value;
    }
  }
  out += "}";
  return out;
}

}  // namespace vmspace

// A metadata record as its members: the caller's (lib/ serialises each value with JSON.stringify) and the core's
// own (the drawn name, the template sources, a template's usage), serialised into one JSON object here, once,
// with no string surgery on either side.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace vmspace {

// [key, value as JSON text] in order; keys are plain identifiers chosen by vmspace (never escaped).
using JsonMembers = std::vector<std::pair<std::string, std::string>>;

// {"key":value,...} (no newline).
inline std::string jsonObject(const JsonMembers& members) {
  std::string out = "{";
  for (const auto& [key, value] : members) {
    if (out.size() > 1) out += ",";
    out += "\"" + key + "\":" + value;
  }
  out += "}";
  return out;
}

}  // namespace vmspace

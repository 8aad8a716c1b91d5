#include "process.h"

#include <cstdio>

namespace vmspace {

mode_t currentUmask() {
  FILE* f = fopen("/proc/self/status", "re");
  if (!f) return 022;
  char line[256];
  unsigned mask = 022;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "Umask: %o", &mask) == 1) break;
  fclose(f);
  return static_cast<mode_t>(mask);
}

}  // namespace vmspace

#include "process.h"

#include <cstdio>

namespace vmspace {

mode_t currentUmask() {
  FILE* f = fopen("/proc/self/status", "re");
  if (!f) return 022;
  char line[256];
  unsigned mask = 022;
  while (fgets(line, sizeof line, f))
    // NOLINTNEXTLINE(cert-err34-c): the kernel writes 4 octal digits here; a line that does not match is skipped.
    if (sscanf(line, "Umask: %o", &mask) == 1) break;
  (void)fclose(f);  // read-only: nothing to flush or lose
  return static_cast<mode_t>(mask);
}

}  // namespace vmspace

// The mode list of a template (template_modes.cc): what a commit writes (template_commit.cc) and each allocate
// from the template replays (TemplateStore::restoreModes).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace vmspace {

// A template's mode list ("modes" in `dirFd`) as a stdio stream, closed by its owner; `flags` add to
// O_CLOEXEC|O_NOCTTY (0600 when created), `mode` is fdopen's.
using ModesFile = std::unique_ptr<FILE, int (*)(FILE*)>;
ModesFile openModesFile(int dirFd, int flags, const char* mode, const std::string& shown);

// Removes the write bits of every entry of the private tree `rootFd` but symlinks (whose mode means nothing),
// recording them in `manifest` (the mode list above), so that a clone can get them back (restoreModes). Adds the
// tree's allocated bytes (st_blocks * 512, hard links once) to *allocated. The walk is walk.h's (its fd budget, the
// climb checked by device and inode), and memory holds a name per level: any depth a clone handles, this handles.
// The tree is our own build in staging.
// With `strip` false (a read-only subvolume, whose modes stay) it only measures.
void stripWriteBits(int rootFd, const std::string& shown, FILE* manifest, uint64_t* allocated, bool strip);

// Takes out of the private tree `rootFd` (a writable snapshot of a guest's workspace, our own in staging) what a
// tree clone with CloneOptions keepDevices/keepSetId false would not have made: device nodes are unlinked (counted
// in *skippedDevices) unless `devices`; unless `setId`, set-id bits of anything but directories are cleared and
// security.capability removed (through /proc/self/fd: without /proc, ENOENT). Never follows a symlink.
void dropGuestPrivileges(int rootFd, const std::string& shown, bool devices, bool setId, uint64_t* skippedDevices);

}  // namespace vmspace

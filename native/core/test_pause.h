// Test seam: pause points where a test SIGKILLs a child process mid-operation (test/checkpoint.test.ts). In test
// builds (-DVMSPACE_TEST_HOOKS) a thread reaching the point named by the environment variable VMSPACE_TEST_PAUSE
// writes "vmspace-test-pause <phase>\n" to stderr and then waits for its death; elsewhere the call is empty.
#pragma once

namespace vmspace {

#ifdef VMSPACE_TEST_HOOKS
void testPausePoint(const char* phase);
#else
inline void testPausePoint(const char*) {}
#endif

}  // namespace vmspace

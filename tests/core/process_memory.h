// What tests of memory use need to know about their own process: its resident pages, and
// whether AddressSanitizer is on (its heap quarantines freed memory, so resident figures do not
// fall when memory is freed).
#pragma once

#include <cstdint>
#include <fstream>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define KVR_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVR_TEST_ASAN 1
#endif
#endif

namespace kvrouter::testing {

// Resident pages of this process (/proc/self/statm's second field).
inline int64_t ResidentPages() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident;
}

// Gives the C heap's free pages back to the kernel, so that a figure taken after it starts from
// what the process holds, not from what earlier tests left free.
inline void TrimHeap() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

// Bytes the C heap has handed out and not had back (its own mappings included), or -1 where
// that is not known (not glibc).
inline int64_t HeapBytesInUse() {
#ifdef __GLIBC__
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
#else
  return -1;
#endif
}

}  // namespace kvrouter::testing

#pragma once

#include <cstddef>
#include <cstdint>

namespace kvrouter {

// Starts loading the cache line at `p`. An asm statement on x86-64: GCC 12 deems
// __builtin_prefetch free of side effects, so a function that does nothing else (or a caller's
// loop helper) is found pure once compiled, and every call to it is deleted.
inline void PrefetchLine(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

// Starts loading every cache line of the `n` hashes at `p`: for an array about to be read in
// one sweep, so that its misses overlap instead of waiting for the hardware prefetcher to
// ramp up.
inline void PrefetchRange(const uint64_t* p, size_t n) {
  constexpr uintptr_t kLine = 64;
  const auto first = reinterpret_cast<uintptr_t>(p) & ~(kLine - 1);
  const auto end = reinterpret_cast<uintptr_t>(p + n);
  for (uintptr_t line = first; line < end; line += kLine) {
    PrefetchLine(reinterpret_cast<const void*>(line));
  }
}

}  // namespace kvrouter

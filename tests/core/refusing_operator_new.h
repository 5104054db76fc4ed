// operator new and delete for a test binary that refuses allocations on cue. Each such suite
// is a binary of its own (the others keep AddressSanitizer's checks of new against delete).
// Include this in exactly one file of the binary, which defines RefuseThisAllocation(): whether
// the allocation being made is the one to refuse (kvrouter::CountAllocationForTesting, under
// the binary's own conditions). A refused operator new throws std::bad_alloc; the nothrow
// forms return null.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

bool RefuseThisAllocation() noexcept;

namespace refusing_operator_new {

// The size of the allocation RefuseThisAllocation() is asked about, for suites that refuse
// only large ones.
inline thread_local std::size_t requested_bytes = 0;

inline void* AllocateOrNull(std::size_t n, std::size_t align) noexcept {
  requested_bytes = n;
  if (RefuseThisAllocation()) return nullptr;
  if (n == 0) n = 1;
  if (align <= alignof(std::max_align_t)) return std::malloc(n);
  void* p = nullptr;
  return posix_memalign(&p, align, n) == 0 ? p : nullptr;
}

inline void* AllocateOrThrow(std::size_t n, std::size_t align) {
  void* p = AllocateOrNull(n, align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace refusing_operator_new

void* operator new(std::size_t n) { return refusing_operator_new::AllocateOrThrow(n, 0); }
void* operator new[](std::size_t n) { return refusing_operator_new::AllocateOrThrow(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return refusing_operator_new::AllocateOrThrow(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return refusing_operator_new::AllocateOrThrow(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return refusing_operator_new::AllocateOrNull(n, 0);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return refusing_operator_new::AllocateOrNull(n, 0);
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return refusing_operator_new::AllocateOrNull(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return refusing_operator_new::AllocateOrNull(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

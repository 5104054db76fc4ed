#include "core/counting_allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVR_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define KVR_ASAN 1
#endif
#ifdef KVR_ASAN
#include <sanitizer/asan_interface.h>
#endif
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVR_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define KVR_TSAN 1
#endif

namespace kvrouter {
namespace {

size_t PageSize() noexcept {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

size_t MappedSize(size_t bytes) noexcept {
  const size_t page = PageSize();
  return (bytes + page - 1) / page * page;
}

void* MapArray(size_t bytes) {
  const size_t mapped = MappedSize(bytes);
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef KVR_ASAN
  // The heap's redzones do not exist here: an overrun into the rest of the last page is caught.
  ASAN_POISON_MEMORY_REGION(static_cast<char*>(p) + bytes, mapped - bytes);
#endif
  return p;
}

void UnmapArray(void* p, size_t bytes) noexcept {
  const size_t mapped = MappedSize(bytes);
#ifdef KVR_ASAN
  // The next mapping there may be anyone's. Only the slack was poisoned: unpoisoning the whole
  // range would write (and make resident) shadow for all of it.
  ASAN_UNPOISON_MEMORY_REGION(static_cast<char*>(p) + bytes, mapped - bytes);
#endif
  munmap(p, mapped);
}

void* RemapArray(void* p, size_t old_bytes, size_t new_bytes) {
#ifdef KVR_TSAN
  // ThreadSanitizer does not follow mremap (google/sanitizers#1099): moved pages would keep the
  // race-detection state of whatever was mapped at their new address before, and it would
  // report races that are not. Under it, a copy it sees instead.
  void* copy = MapArray(new_bytes);
  std::memcpy(copy, p, std::min(old_bytes, new_bytes));
  UnmapArray(p, old_bytes);
  return copy;
#else
  const size_t old_mapped = MappedSize(old_bytes), new_mapped = MappedSize(new_bytes);
#ifdef KVR_ASAN
  ASAN_UNPOISON_MEMORY_REGION(static_cast<char*>(p) + old_bytes, old_mapped - old_bytes);
#endif
  void* moved = mremap(p, old_mapped, new_mapped, MREMAP_MAYMOVE);
  if (moved == MAP_FAILED) {
#ifdef KVR_ASAN
    ASAN_POISON_MEMORY_REGION(static_cast<char*>(p) + old_bytes, old_mapped - old_bytes);
#endif
    throw std::bad_alloc();
  }
#ifdef KVR_ASAN
  ASAN_POISON_MEMORY_REGION(static_cast<char*>(moved) + new_bytes, new_mapped - new_bytes);
#endif
  return moved;
#endif
}

}  // namespace kvrouter

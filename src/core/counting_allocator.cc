#include "core/counting_allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cassert>
#include <cstdlib>
#include <cstring>
#include <new>

#if defined(__SANITIZE_ADDRESS__)
#define KVR_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVR_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define KVR_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVR_TSAN 1
#endif
#endif

namespace kvrouter {
namespace {

size_t PageSize() noexcept {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

#if defined(KVR_ASAN) || defined(KVR_TSAN)
// A larger array with the old one's bytes and zeros after them, the old one freed.
void* GrowByCopy(void* p, size_t old_bytes, size_t new_bytes) {
  void* copy = MapArray(new_bytes);
  std::memcpy(copy, p, old_bytes);
  UnmapArray(p, old_bytes);
  return copy;
}
#endif

}  // namespace

size_t MappedSize(size_t bytes) noexcept {
  const size_t page = PageSize();
  return (bytes + page - 1) / page * page;
}

#ifdef KVR_ASAN
// Under AddressSanitizer large arrays stay on its heap: a mapping has no redzone when its size
// is whole pages, and an unmapped address comes straight back to the next mapping, so overruns
// and uses after a growth would go unseen. The memory count is the same as mapped.
void* MapArray(size_t bytes) {
  constexpr size_t kAlign = 64;  // a cache line, as PositionTable's buckets need; pages are more
  const size_t size = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, size);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, size);
  return p;
}
void UnmapArray(void* p, size_t) noexcept { std::free(p); }
void* GrowArray(void* p, size_t old_bytes, size_t new_bytes) {
  assert(new_bytes >= old_bytes);
  return GrowByCopy(p, old_bytes, new_bytes);
}
#else
void* MapArray(size_t bytes) {
  void* p =
      mmap(nullptr, MappedSize(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}
void UnmapArray(void* p, size_t bytes) noexcept { munmap(p, MappedSize(bytes)); }
void* GrowArray(void* p, size_t old_bytes, size_t new_bytes) {
  assert(new_bytes >= old_bytes);
#ifdef KVR_TSAN
  // ThreadSanitizer does not follow mremap (google/sanitizers#1099): moved pages would keep the
  // race-detection state of whatever was mapped at their new address before, and it would
  // report races that are not. Under it, a copy it sees instead.
  return GrowByCopy(p, old_bytes, new_bytes);
#else
  void* moved = mremap(p, MappedSize(old_bytes), MappedSize(new_bytes), MREMAP_MAYMOVE);
  if (moved == MAP_FAILED) throw std::bad_alloc();
  return moved;
#endif
}
#endif

}  // namespace kvrouter

#include "core/counting_allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cassert>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_set>

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

// A larger array with the old one's bytes and zeros after them, the old one freed.
[[maybe_unused]] void* GrowByCopy(void* p, size_t old_bytes, size_t new_bytes) {
  void* copy = MapArray(new_bytes);
  std::memcpy(copy, p, old_bytes);
  UnmapArray(p, old_bytes);
  return copy;
}

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
void RefuseMappingsForTesting(bool) noexcept {}  // nothing is mapped here
#else
namespace {

// Arrays the kernel would not map, taken from the C heap instead. A process may hold 65,530
// mappings (vm.max_map_count) and every large array is one: an index of that many large
// per-rank tables would otherwise fail to grow. Rare, so a locked set; `heap_array_count` lets the
// common path skip the lock.
std::mutex heap_arrays_mutex;
std::unordered_set<void*>* heap_arrays = nullptr;  // never freed: arrays may outlive statics
std::atomic<size_t> heap_array_count{0};
std::atomic<bool> refuse_mappings{false};

void* Map(size_t bytes) noexcept {
  if (refuse_mappings.load(std::memory_order_relaxed)) return MAP_FAILED;
  return mmap(nullptr, MappedSize(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
              0);
}

void* HeapArray(size_t bytes) {
  constexpr size_t kAlign = 64;  // a cache line, as PositionTable's buckets need
  const size_t size = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, size);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, size);
  std::lock_guard lock(heap_arrays_mutex);
  try {
    if (heap_arrays == nullptr) heap_arrays = new std::unordered_set<void*>();
    heap_arrays->insert(p);
  } catch (...) {
    std::free(p);
    throw;
  }
  heap_array_count.fetch_add(1, std::memory_order_relaxed);
  return p;
}

// Whether `p` came from HeapArray; if so it is forgotten, as it is about to be freed.
bool ForgetHeapArray(void* p) noexcept {
  if (heap_array_count.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard lock(heap_arrays_mutex);
  if (heap_arrays->erase(p) == 0) return false;
  heap_array_count.fetch_sub(1, std::memory_order_relaxed);
  return true;
}

bool IsHeapArray(void* p) noexcept {
  if (heap_array_count.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard lock(heap_arrays_mutex);
  return heap_arrays->count(p) > 0;
}

}  // namespace

void* MapArray(size_t bytes) {
  void* p = Map(bytes);
  return p != MAP_FAILED ? p : HeapArray(bytes);
}
void UnmapArray(void* p, size_t bytes) noexcept {
  if (ForgetHeapArray(p)) {
    std::free(p);
  } else {
    munmap(p, MappedSize(bytes));
  }
}
void* GrowArray(void* p, size_t old_bytes, size_t new_bytes) {
  assert(new_bytes >= old_bytes);
#ifdef KVR_TSAN
  // ThreadSanitizer does not follow mremap (google/sanitizers#1099): moved pages would keep the
  // race-detection state of whatever was mapped at their new address before, and it would
  // report races that are not. Under it, a copy it sees instead.
  return GrowByCopy(p, old_bytes, new_bytes);
#else
  if (IsHeapArray(p) || refuse_mappings.load(std::memory_order_relaxed)) {
    return GrowByCopy(p, old_bytes, new_bytes);
  }
  void* moved = mremap(p, MappedSize(old_bytes), MappedSize(new_bytes), MREMAP_MAYMOVE);
  // Refused (a move needs a mapping too): a copy, in a mapping if one is left, else the heap.
  return moved != MAP_FAILED ? moved : GrowByCopy(p, old_bytes, new_bytes);
#endif
}

void RefuseMappingsForTesting(bool refuse) noexcept { refuse_mappings.store(refuse); }
#endif

}  // namespace kvrouter

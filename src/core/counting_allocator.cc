#include "core/counting_allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstdlib>
#include <cstring>
#include <fstream>
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

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; an older kernel refuses it (EINVAL), harmlessly
#endif

namespace kvrouter {
namespace {

size_t PageSize() noexcept {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// Zeros for `bytes` from the C heap, on a cache line as PositionTable's buckets need (a
// mapping's are on a page), or std::bad_alloc. Freed with std::free.
void* ZeroedHeapArray(size_t bytes) {
  constexpr size_t kAlign = 64;
  const size_t size = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, size);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, size);
  return p;
}

// A larger array with the old one's bytes and zeros after them, the old one freed.
void* GrowByCopy(void* p, size_t old_bytes, size_t new_bytes) {
  void* copy = MapArray(new_bytes);
  std::memcpy(copy, p, old_bytes);
  UnmapArray(p, old_bytes);
  return copy;
}

}  // namespace

namespace internal {
std::atomic<uint64_t> allocation_failure_countdown{0};
}  // namespace internal

uint64_t FailAllocationForTesting(uint64_t n) noexcept {
  return internal::allocation_failure_countdown.exchange(n);
}

bool CountAllocationForTesting() noexcept {
  std::atomic<uint64_t>& countdown = internal::allocation_failure_countdown;
  uint64_t n = countdown.load(std::memory_order_relaxed);
  while (n != 0 && !countdown.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) {
  }
  return n == 1;
}

size_t MappedSize(size_t bytes) noexcept {
  const size_t page = PageSize();
  return (bytes + page - 1) / page * page;
}

#ifdef KVR_ASAN
// Under AddressSanitizer large arrays stay on its heap: a mapping has no redzone when its size
// is whole pages, and an unmapped address comes straight back to the next mapping, so overruns
// and uses after a growth would go unseen. The memory count is the same as mapped.
void* MapArray(size_t bytes) { return ZeroedHeapArray(bytes); }
void UnmapArray(void* p, size_t) noexcept { std::free(p); }
void PopulateArray(void*, size_t, size_t) noexcept {}  // zeroed on the heap: present already
void* GrowArray(void* p, size_t old_bytes, size_t new_bytes) {
  assert(new_bytes >= old_bytes);
  return GrowByCopy(p, old_bytes, new_bytes);
}
void RefuseMappingsForTesting(bool) noexcept {}  // nothing is mapped here
void SetMappingBudgetForTesting(size_t) noexcept {}
size_t MappedArrays() noexcept { return 0; }
#else
namespace {

// Every mapped array is a mapping of the process, and the kernel allows vm.max_map_count of
// them (65,530 on Debian 12). At that limit it refuses brk too, so the C heap cannot stand in
// then; large arrays therefore stop being mapped at half the limit, leaving the other half to
// the rest of the process (libraries, thread stacks, the heap's own mappings), and past it come
// from the heap: an index of that many large tables keeps growing, with the heap's holes.
std::atomic<size_t> mapped_arrays{0};
std::atomic<size_t> mapping_budget{0};  // 0: the system's, read on first use
std::atomic<bool> refuse_mappings{false};

size_t SystemMappingBudget() {
  size_t limit = 65'530;
  std::ifstream("/proc/sys/vm/max_map_count") >> limit;
  return std::max<size_t>(limit / 2, 1);
}

size_t MappingBudget() {
  size_t budget = mapping_budget.load(std::memory_order_relaxed);
  if (budget == 0) {
    budget = SystemMappingBudget();
    mapping_budget.store(budget, std::memory_order_relaxed);
  }
  return budget;
}

// Arrays that came from the heap (past the budget, or refused by the kernel), so that they are
// freed, not unmapped. Rare, so a locked set; `heap_arrays` counts them so that the common
// path takes no lock. Never destroyed: arrays may be freed while the process exits.
std::atomic<size_t> heap_arrays{0};
struct HeapArraySet {
  std::mutex mutex;
  std::unordered_set<void*> arrays;
};
HeapArraySet& HeapArrays() {
  static HeapArraySet* set = new HeapArraySet();
  return *set;
}

void* Map(size_t bytes) noexcept {
  if (refuse_mappings.load(std::memory_order_relaxed) ||
      mapped_arrays.load(std::memory_order_relaxed) >= MappingBudget()) {
    return MAP_FAILED;
  }
  void* p =
      mmap(nullptr, MappedSize(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p != MAP_FAILED) mapped_arrays.fetch_add(1, std::memory_order_relaxed);
  return p;
}

void* Remap(void* p, size_t old_bytes, size_t new_bytes) noexcept {
  if (refuse_mappings.load(std::memory_order_relaxed)) return MAP_FAILED;
  return mremap(p, MappedSize(old_bytes), MappedSize(new_bytes), MREMAP_MAYMOVE);
}

void Unmap(void* p, size_t bytes) noexcept {
  if (munmap(p, MappedSize(bytes)) == 0) {
    mapped_arrays.fetch_sub(1, std::memory_order_relaxed);
  } else {
    // Unmapping the middle of a run of merged mappings needs a mapping more, refused at the
    // limit: the address range stays, its pages at least go back.
    madvise(p, MappedSize(bytes), MADV_DONTNEED);
  }
}

void* HeapArray(size_t bytes) {
  void* p = ZeroedHeapArray(bytes);
  HeapArraySet& set = HeapArrays();
  std::lock_guard lock(set.mutex);
  try {
    set.arrays.insert(p);
  } catch (...) {
    std::free(p);
    throw;
  }
  heap_arrays.fetch_add(1, std::memory_order_relaxed);
  return p;
}

// Whether `p` came from HeapArray; `forget`: it is about to be freed, so the set lets it go.
bool CameFromHeap(void* p, bool forget) noexcept {
  if (heap_arrays.load(std::memory_order_relaxed) == 0) return false;
  HeapArraySet& set = HeapArrays();
  std::lock_guard lock(set.mutex);
  const auto it = set.arrays.find(p);
  if (it == set.arrays.end()) return false;
  if (forget) {
    set.arrays.erase(it);
    heap_arrays.fetch_sub(1, std::memory_order_relaxed);
  }
  return true;
}

}  // namespace

void* MapArray(size_t bytes) {
  void* p = Map(bytes);
  return p != MAP_FAILED ? p : HeapArray(bytes);
}
void PopulateArray(void* p, size_t from_bytes, size_t to_bytes) noexcept {
  const size_t end = MappedSize(to_bytes);
  if (from_bytes >= end || CameFromHeap(p, /*forget=*/false)) return;
  (void)madvise(static_cast<char*>(p) + from_bytes, end - from_bytes, MADV_POPULATE_WRITE);
}
void UnmapArray(void* p, size_t bytes) noexcept {
  if (CameFromHeap(p, /*forget=*/true)) {
    std::free(p);
  } else {
    Unmap(p, bytes);
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
  if (CameFromHeap(p, /*forget=*/false)) return GrowByCopy(p, old_bytes, new_bytes);
  void* moved = Remap(p, old_bytes, new_bytes);
  // Refused (a move needs a mapping too): a copy, in a mapping if one is left, else the heap.
  return moved != MAP_FAILED ? moved : GrowByCopy(p, old_bytes, new_bytes);
#endif
}

void RefuseMappingsForTesting(bool refuse) noexcept { refuse_mappings.store(refuse); }
void SetMappingBudgetForTesting(size_t budget) noexcept { mapping_budget.store(budget); }
size_t MappedArrays() noexcept { return mapped_arrays.load(std::memory_order_relaxed); }
#endif

}  // namespace kvrouter

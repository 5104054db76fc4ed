// An allocator that adds every byte it hands out to a counter, so a container family (the
// index's nodes, child maps, member lists, per-worker tables) can report exactly how much memory
// it owns. The counter is not atomic: the owner updates it under its own writer lock.
//
// Arrays of kMappedBytes or more (by default: see kMapFrom) are mapped from the kernel and unmapped
// when freed, instead of coming from the C heap. The index's large arrays grow step by step (a
// worker's table by 1.5x at a time); in glibc's heap each step leaves the old array behind as a
// hole too small for the next, larger one, and the holes stay resident: the process held 845 MiB
// for a 250 MiB index after loading the Mooncake trace when tables grew by 1.25x (BENCHMARKS.md,
// "Resident memory"). Mapped, a freed array leaves the process at once, whatever the allocator's
// thresholds at the time.
#pragma once

#include <atomic>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>

namespace kvrouter {

// Arrays at least this large are mapped by default (glibc's own starting mmap threshold; it rises
// as mapped blocks are freed, which is what lets the holes above build up).
inline constexpr size_t kMappedBytes = size_t{128} << 10;

// Whole pages of zeros for `bytes`, or std::bad_alloc; MappedSize(bytes) is
// what they count as. UnmapArray gives them back. GrowArray makes a mapped array larger
// (`new_bytes` >= `old_bytes`), keeping its bytes, zeros after them; std::bad_alloc leaves it as
// it was. In a plain build the kernel moves the pages (mremap), copying nothing; under
// ThreadSanitizer it copies (see the .cc), and under AddressSanitizer large arrays come from its
// heap, so that its redzones and quarantine still watch them. Mapped arrays take at most half of
// the mappings the kernel allows a process (vm.max_map_count); past that, or when the kernel
// refuses one, an array comes from the C heap instead, 64-byte aligned and zeroed all the same,
// and a growth copies: std::bad_alloc only when the heap refuses too. Thread-safe.
void* MapArray(size_t bytes);
void UnmapArray(void* p, size_t bytes) noexcept;
void* GrowArray(void* p, size_t old_bytes, size_t new_bytes);
size_t MappedSize(size_t bytes) noexcept;
// Makes the pages of bytes [from_bytes, to_bytes) of a mapped array present and writable now,
// in one system call, for an owner that writes all of them soon (a hash table filled evenly):
// left to fault, each page costs two faults when first read and then written (the shared zero
// page, then a copy of it). `from_bytes` is whole pages. Nothing for an array from the heap
// (its pages were written when zeroed), nor on a kernel without MADV_POPULATE_WRITE (5.14).
void PopulateArray(void* p, size_t from_bytes, size_t to_bytes) noexcept;

// The arrays mapped now (0 under AddressSanitizer, where nothing is mapped).
size_t MappedArrays() noexcept;

// Tests. RefuseMappingsForTesting: while set, every mapping and every growth of one is refused
// as by the kernel at its limit. SetMappingBudgetForTesting: the mapped arrays allowed before
// the heap takes over (0: half of vm.max_map_count). Neither has an effect under
// AddressSanitizer. MappingsRefusedForTesting sets the first for its lifetime.
void RefuseMappingsForTesting(bool refuse) noexcept;
void SetMappingBudgetForTesting(size_t budget) noexcept;
class MappingsRefusedForTesting {
 public:
  MappingsRefusedForTesting() noexcept { RefuseMappingsForTesting(true); }
  ~MappingsRefusedForTesting() { RefuseMappingsForTesting(false); }
  MappingsRefusedForTesting(const MappingsRefusedForTesting&) = delete;
  MappingsRefusedForTesting& operator=(const MappingsRefusedForTesting&) = delete;
};

// Tests of what a refused allocation leaves behind. FailAllocationForTesting(n): the n-th
// allocation from now by a CountingAllocator (allocate or grow, 1: the next one) throws
// std::bad_alloc, as the heap's refusal does, and only that one; 0 disarms. Returns the count
// it replaces: 0 when the armed failure has happened (or none was armed). Works in every build.
// CountAllocationForTesting: counts one allocation against it, true for the one to fail (a
// test's own operator new can share the count so).
uint64_t FailAllocationForTesting(uint64_t n) noexcept;
bool CountAllocationForTesting() noexcept;

namespace internal {
// The armed count; 0 (not armed) costs an allocation one relaxed load.
extern std::atomic<uint64_t> allocation_failure_countdown;
inline void MaybeFailAllocationForTesting() {
  if (allocation_failure_countdown.load(std::memory_order_relaxed) != 0 &&
      CountAllocationForTesting()) {
    throw std::bad_alloc();
  }
}
}  // namespace internal

// kMapFrom: the size from which arrays are mapped, kMappedBytes unless an owner whose arrays
// grow step by step wants its smaller steps mapped too (PositionTable).
template <typename T, size_t kMapFrom = kMappedBytes>
class CountingAllocator {
 public:
  using value_type = T;
  template <typename U>
  struct rebind {
    using other = CountingAllocator<U, kMapFrom>;
  };

  explicit CountingAllocator(int64_t* counter) noexcept : counter_(counter) {}
  template <typename U>
  CountingAllocator(const CountingAllocator<U, kMapFrom>& other) noexcept
      : counter_(other.counter()) {}

  T* allocate(size_t n) {
    internal::MaybeFailAllocationForTesting();
    const size_t bytes = n * sizeof(T);
    if (bytes < kMapFrom) {
      T* p = std::allocator<T>{}.allocate(n);  // counted once given: the heap may refuse
      *counter_ += static_cast<int64_t>(bytes);
      return p;
    }
    T* p = static_cast<T*>(MapArray(bytes));
    *counter_ += static_cast<int64_t>(MappedSize(bytes));
    return p;
  }
  void deallocate(T* p, size_t n) noexcept {
    const size_t bytes = n * sizeof(T);
    if (bytes < kMapFrom) {
      *counter_ -= static_cast<int64_t>(bytes);
      std::allocator<T>{}.deallocate(p, n);
      return;
    }
    *counter_ -= static_cast<int64_t>(MappedSize(bytes));
    UnmapArray(p, bytes);
  }

  // A mapped array of `old_n` grown to `new_n` >= `old_n` (both mapped: see AllocatesZeroed),
  // contents kept, zeros after them; it may move.
  T* grow(T* p, size_t old_n, size_t new_n) {
    assert(AllocatesZeroed(old_n) && new_n >= old_n);
    internal::MaybeFailAllocationForTesting();
    T* moved = static_cast<T*>(GrowArray(p, old_n * sizeof(T), new_n * sizeof(T)));
    *counter_ += static_cast<int64_t>(MappedSize(new_n * sizeof(T))) -
                 static_cast<int64_t>(MappedSize(old_n * sizeof(T)));
    return moved;
  }

  // PopulateArray for elements [from_n, to_n) of a mapped array of `to_n`.
  static void populate(T* p, size_t from_n, size_t to_n) noexcept {
    if (AllocatesZeroed(to_n)) PopulateArray(p, MappedSize(from_n * sizeof(T)), to_n * sizeof(T));
  }

  // Whether allocate(n) returns zeroed memory (a mapped array does), so a caller that needs
  // zeros need not write them, touching every page before it is used.
  static bool AllocatesZeroed(size_t n) noexcept { return n * sizeof(T) >= kMapFrom; }

  int64_t* counter() const noexcept { return counter_; }

  template <typename U>
  friend bool operator==(const CountingAllocator& a,
                         const CountingAllocator<U, kMapFrom>& b) noexcept {
    return a.counter() == b.counter();
  }

 private:
  int64_t* counter_;
};

}  // namespace kvrouter

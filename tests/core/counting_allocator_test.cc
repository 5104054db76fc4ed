// CountingAllocator: small arrays from the heap, large ones mapped from the kernel; both counted
// exactly (mapped ones in whole pages), mapped ones zeroed, grown keeping their contents, and
// given back to the kernel when freed.
#include "core/counting_allocator.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "process_memory.h"

namespace kvrouter {
namespace {

using testing::ResidentPages;

TEST(CountingAllocatorTest, SmallArraysAreCountedByTheByte) {
  int64_t bytes = 0;
  CountingAllocator<uint64_t> alloc(&bytes);
  const size_t n = 100;
  ASSERT_FALSE(alloc.AllocatesZeroed(n));
  uint64_t* p = alloc.allocate(n);
  EXPECT_EQ(bytes, static_cast<int64_t>(n * sizeof(uint64_t)));
  alloc.deallocate(p, n);
  EXPECT_EQ(bytes, 0);
}

TEST(CountingAllocatorTest, LargeArraysAreMappedZeroedAndCountedInWholePages) {
  int64_t bytes = 0;
  CountingAllocator<uint64_t> alloc(&bytes);
  const size_t n = kMappedBytes / sizeof(uint64_t) + 3;  // not a whole number of pages
  ASSERT_TRUE(alloc.AllocatesZeroed(n));
  ASSERT_FALSE(alloc.AllocatesZeroed(n - 4));
  uint64_t* p = alloc.allocate(n);
  const auto page = static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  EXPECT_EQ(bytes, (static_cast<int64_t>(n * sizeof(uint64_t)) + page - 1) / page * page);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(p[i], 0u) << i;
  p[n - 1] = 7;  // the last element is the caller's
  alloc.deallocate(p, n);
  EXPECT_EQ(bytes, 0);
}

TEST(CountingAllocatorTest, GrowKeepsTheContentsAndZeroesTheRest) {
  int64_t bytes = 0;
  CountingAllocator<uint64_t> alloc(&bytes);
  const size_t small = kMappedBytes / sizeof(uint64_t) + 5, large = small * 5 / 2 + 1;
  uint64_t* p = alloc.allocate(small);
  for (size_t i = 0; i < small; ++i) p[i] = i + 1;
  p = alloc.grow(p, small, large);
  EXPECT_EQ(bytes, static_cast<int64_t>(MappedSize(large * sizeof(uint64_t))));
  for (size_t i = 0; i < small; ++i) ASSERT_EQ(p[i], i + 1) << i;
  for (size_t i = small; i < large; ++i) ASSERT_EQ(p[i], 0u) << i;
  alloc.deallocate(p, large);
  EXPECT_EQ(bytes, 0);
}

// Past vm.max_map_count the kernel refuses mappings: a large array then comes from the heap,
// zeroed, aligned and counted as a mapped one, grows by copying (into a mapping again once the
// kernel allows), and is freed where it came from.
TEST(CountingAllocatorTest, ArraysTheKernelWillNotMapComeFromTheHeap) {
  int64_t bytes = 0;
  CountingAllocator<uint64_t> alloc(&bytes);
  const size_t small = kMappedBytes / sizeof(uint64_t) + 5, large = small * 2, larger = large * 2;
  const int64_t heap_before = testing::HeapBytesInUse();
  uint64_t* p = nullptr;
  {
    MappingsRefusedForTesting refusing;
    p = alloc.allocate(small);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    EXPECT_EQ(bytes, static_cast<int64_t>(MappedSize(small * sizeof(uint64_t))));
    for (size_t i = 0; i < small; ++i) ASSERT_EQ(p[i], 0u) << i;
    for (size_t i = 0; i < small; ++i) p[i] = i + 1;
    p = alloc.grow(p, small, large);  // heap to heap
    for (size_t i = 0; i < small; ++i) ASSERT_EQ(p[i], i + 1) << i;
    for (size_t i = small; i < large; ++i) ASSERT_EQ(p[i], 0u) << i;
  }
  p = alloc.grow(p, large, larger);  // heap to a mapping
  for (size_t i = 0; i < small; ++i) ASSERT_EQ(p[i], i + 1) << i;
  for (size_t i = small; i < larger; ++i) ASSERT_EQ(p[i], 0u) << i;
  EXPECT_EQ(bytes, static_cast<int64_t>(MappedSize(larger * sizeof(uint64_t))));
  {
    MappingsRefusedForTesting refusing;
    p = alloc.grow(p, larger, larger + 1);  // a mapping to the heap
    for (size_t i = 0; i < small; ++i) ASSERT_EQ(p[i], i + 1) << i;
    uint64_t* q = alloc.allocate(small);
    alloc.deallocate(q, small);
  }
  alloc.deallocate(p, larger + 1);
  EXPECT_EQ(bytes, 0);
  if (heap_before >= 0) {  // every array from the heap went back to it
    EXPECT_LT(testing::HeapBytesInUse() - heap_before, static_cast<int64_t>(kMappedBytes));
  }
}

// An array the heap stands in for is zeroed like a mapping, even where the heap hands back
// memory it had before (small arrays here, so that they come from the heap's own chunks).
TEST(CountingAllocatorTest, AnArrayFromTheHeapIsZeroedLikeAMapping) {
  int64_t bytes = 0;
  CountingAllocator<uint64_t, 4096> alloc(&bytes);
  const size_t n = 1024;  // 8 KiB
  MappingsRefusedForTesting refusing;
  for (int round = 0; round < 4; ++round) {
    uint64_t* p = alloc.allocate(n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(p[i], 0u) << "round " << round << ", " << i;
    std::memset(p, 0xff, n * sizeof(uint64_t));  // what the next round may get back
    alloc.deallocate(p, n);
  }
  EXPECT_EQ(bytes, 0);
}

// Mapped arrays stop at the budget (half of vm.max_map_count), where the kernel would soon
// refuse brk as well as mmap; past it they come from the heap, and freeing them gives the
// budget back.
TEST(CountingAllocatorTest, MappedArraysStopAtTheBudget) {
#ifdef KVR_TEST_ASAN
  GTEST_SKIP() << "under AddressSanitizer nothing is mapped";
#endif
  struct Budget {
    explicit Budget(size_t n) { SetMappingBudgetForTesting(n); }
    ~Budget() { SetMappingBudgetForTesting(0); }
  } budget(MappedArrays() + 2);
  int64_t bytes = 0;
  CountingAllocator<uint64_t> alloc(&bytes);
  const size_t n = kMappedBytes / sizeof(uint64_t);
  const size_t mapped_before = MappedArrays();
  std::vector<uint64_t*> arrays;
  for (int i = 0; i < 5; ++i) arrays.push_back(alloc.allocate(n));
  EXPECT_EQ(MappedArrays(), mapped_before + 2);  // the other three from the heap
  for (uint64_t* p : arrays) {
    p[n - 1] = 1;
    alloc.deallocate(p, n);
  }
  EXPECT_EQ(MappedArrays(), mapped_before);
  EXPECT_EQ(bytes, 0);
}

// What mapping is for: a freed large array leaves the process at once. (From the C heap it
// would stay resident wherever it left a hole that later, larger arrays do not fit.)
TEST(CountingAllocatorTest, AFreedLargeArrayIsGivenBackToTheKernel) {
#ifdef KVR_TEST_ASAN
  GTEST_SKIP() << "under AddressSanitizer large arrays come from its heap, which quarantines them";
#endif
  int64_t bytes = 0;
  CountingAllocator<char> alloc(&bytes);
  const size_t n = size_t{64} << 20;
  const int64_t pages = static_cast<int64_t>(n / static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  char* p = alloc.allocate(n);
  std::memset(p, 1, n);  // resident now
  const int64_t with = ResidentPages();
  alloc.deallocate(p, n);
  const int64_t without = ResidentPages();
  EXPECT_GE(with - without, pages * 9 / 10) << "resident pages " << with << " -> " << without;
  EXPECT_EQ(bytes, 0);
}

// Populating makes a mapped array's pages present and writable at once (mincore sees them),
// from the page asked for to the end; the pages before stay as they were (never touched).
TEST(CountingAllocatorTest, PopulatedPagesArePresentFromTheFirstOneAsked) {
#ifdef KVR_TEST_ASAN
  GTEST_SKIP() << "under AddressSanitizer large arrays come from its heap, written when zeroed";
#endif
  int64_t bytes = 0;
  CountingAllocator<char> alloc(&bytes);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t pages = 64;
  char* p = alloc.allocate(pages * page);
  auto present = [&] {
    std::vector<unsigned char> in(pages);
    EXPECT_EQ(mincore(p, pages * page, in.data()), 0);
    size_t n = 0;
    for (unsigned char c : in) n += c & 1;
    return n;
  };
  ASSERT_EQ(present(), 0u) << "a fresh mapping holds no page";
  alloc.populate(p, 16 * page, pages * page);
  if (present() == 0) {
    alloc.deallocate(p, pages * page);
    GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE (Linux 5.14)";
  }
  EXPECT_EQ(present(), pages - 16);
  alloc.deallocate(p, pages * page);
}

// Under AddressSanitizer a large array stays on its heap (see counting_allocator.cc): an
// overrun is caught as for any other array.
TEST(CountingAllocatorTest, AnOverrunOfALargeArrayIsCaughtUnderAddressSanitizer) {
#ifndef KVR_TEST_ASAN
  GTEST_SKIP() << "only AddressSanitizer can see it";
#else
  int64_t bytes = 0;
  CountingAllocator<char> alloc(&bytes);
  const size_t n = kMappedBytes + 128;  // whole cache lines: no padding after it
  char* p = alloc.allocate(n);
  EXPECT_DEATH(
      {
        volatile char* v = p;
        v[n] = 1;
      },
      "AddressSanitizer");
  alloc.deallocate(p, n);
#endif
}

}  // namespace
}  // namespace kvrouter

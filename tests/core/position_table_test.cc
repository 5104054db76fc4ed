// PositionTable (the index's per-worker tables): against a std::unordered_map model under
// random inserts, updates and erases, through growth and shrinking; memory counted exactly.
#include "core/position_table.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <memory>
#include <new>
#include <optional>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/counting_allocator.h"
#include "process_memory.h"

namespace kvrouter {
namespace {

TEST(PositionTableTest, EmptyTableHoldsNothingAndOwnsNothing) {
  int64_t bytes = 0;
  PositionTable t(&bytes);
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.Get(42), 0u);
  EXPECT_FALSE(t.Contains(0));
  EXPECT_FALSE(t.Erase(42));
  t.Prefetch(42);  // harmless without buckets
  EXPECT_EQ(bytes, 0);
}

TEST(PositionTableTest, TryInsertRefusesAPresentKeyAndKeepsItsValue) {
  int64_t bytes = 0;
  PositionTable t(&bytes);
  EXPECT_TRUE(t.TryInsert(0, 7));  // key 0 is an ordinary key: emptiness is the value's
  EXPECT_FALSE(t.TryInsert(0, 9));
  EXPECT_EQ(t.Get(0), 7u);
  t.Update(0, 9);
  EXPECT_EQ(t.Get(0), 9u);
  t.Set(5, PositionTable::kValueMask);  // the widest value
  EXPECT_EQ(t.Get(5), PositionTable::kValueMask);
  EXPECT_EQ(t.size(), 2u);
  EXPECT_TRUE(t.Erase(0));
  EXPECT_TRUE(t.Erase(5));
  EXPECT_EQ(bytes, 0);  // an emptied table gives its buckets back
}

// Keys as engines make them (sequential, and random), values never 0.
TEST(PositionTableTest, MatchesAModelUnderRandomChurn) {
  int64_t bytes = 0;
  std::mt19937_64 rng(7);
  PositionTable t(&bytes);
  std::unordered_map<uint64_t, uint64_t> model;
  size_t peak = 0;
  for (int step = 0; step < 400'000; ++step) {
    // Grow for a while, then shrink, then grow again: every size class and both directions.
    const bool growing = (step / 100'000) % 2 == 0;
    const uint64_t key = (rng() % 3 == 0) ? rng() % 50'000 : rng();
    const uint64_t value = 1 + rng() % PositionTable::kValueMask;
    const int op = static_cast<int>(rng() % 10);
    if (op < (growing ? 6 : 2)) {
      const bool inserted = t.TryInsert(key, value);
      ASSERT_EQ(inserted, model.emplace(key, value).second) << "step " << step;
    } else if (op < 7) {
      ASSERT_EQ(t.Erase(key), model.erase(key) == 1) << "step " << step;
      if (!model.empty() && rng() % 2 == 0) {  // also erase a key certainly present
        const uint64_t present = model.begin()->first;
        ASSERT_TRUE(t.Erase(present));
        model.erase(present);
      }
    } else if (op < 9) {
      ASSERT_EQ(t.Get(key), model.count(key) ? model.at(key) : 0u) << "step " << step;
    } else if (model.count(key)) {
      t.Update(key, value);
      model[key] = value;
    }
    ASSERT_EQ(t.size(), model.size());
    peak = std::max(peak, model.size());
    if (step % 50'000 == 0 && !model.empty()) {
      // Load stays within the bounds the memory budget assumes, once past the small sizes.
      if (model.size() > 1000) {
        const double load = static_cast<double>(t.size()) / static_cast<double>(t.capacity());
        EXPECT_GT(load, 0.35) << "step " << step;
        EXPECT_LE(load, 0.9) << "step " << step;
      }
      size_t seen = 0;
      t.ForEach([&](uint64_t k, uint64_t v) {
        ++seen;
        EXPECT_EQ(model.at(k), v);
      });
      EXPECT_EQ(seen, model.size());
    }
  }
  EXPECT_GT(peak, 10'000u);
  for (const auto& [k, v] : model) ASSERT_EQ(t.Get(k), v);
  for (const auto& [k, v] : model) ASSERT_TRUE(t.Erase(k));
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(bytes, 0);
}

// Past PositionTable::kMapFromBytes a table is mapped and grows in place (PositionTable::Stretch):
// every entry must be found after each growth, the load stays in bounds, and the memory is whole
// pages.
TEST(PositionTableTest, AMappedTableGrowsInPlaceKeepingEveryEntry) {
  int64_t bytes = 0;
  std::mt19937_64 rng(11);
  PositionTable t(&bytes);
  std::vector<std::pair<uint64_t, uint64_t>> entries;
  size_t growths = 0;
  for (uint64_t i = 0; i < 300'000; ++i) {
    const uint64_t key = i % 2 ? rng() : i;  // random and sequential keys, as engines make
    const uint64_t value = 1 + rng() % PositionTable::kValueMask;
    const size_t capacity = t.capacity();
    ASSERT_TRUE(t.TryInsert(key, value));
    entries.emplace_back(key, value);
    if (t.capacity() != capacity && capacity * 16 >= PositionTable::kMapFromBytes) {
      ++growths;
      for (const auto& [k, v] : entries) ASSERT_EQ(t.Get(k), v) << "after a growth at " << i;
      EXPECT_LE(t.size() * 10, t.capacity() * 9);
      EXPECT_EQ(bytes, static_cast<int64_t>(MappedSize(t.capacity() * 16)));
    }
  }
  EXPECT_GE(growths, 5u);
  EXPECT_EQ(t.size(), entries.size());
  size_t seen = 0;
  t.ForEach([&](uint64_t, uint64_t) { ++seen; });
  EXPECT_EQ(seen, entries.size());  // no entry placed twice
  for (const auto& [k, v] : entries) ASSERT_TRUE(t.Erase(k));
  EXPECT_EQ(bytes, 0);
}

// A table the kernel will not map (past vm.max_map_count) grows in the heap instead, then in a
// mapping again once the kernel allows: every entry stays found, and every byte is given back.
TEST(PositionTableTest, GrowsWhenTheKernelRefusesMappings) {
  int64_t bytes = 0;
  std::mt19937_64 rng(17);
  PositionTable t(&bytes);
  std::vector<uint64_t> keys;
  for (const bool refuse : {true, false, true}) {
    std::optional<MappingsRefusedForTesting> refusing;
    if (refuse) refusing.emplace();
    for (int i = 0; i < 30'000; ++i) {
      keys.push_back(rng());
      ASSERT_TRUE(t.TryInsert(keys.back(), keys.size()));
    }
    for (size_t k = 0; k < keys.size(); ++k) ASSERT_EQ(t.Get(keys[k]), k + 1);
  }
  EXPECT_GE(t.capacity() * 16, 8 * kMappedBytes);
  for (uint64_t k : keys) ASSERT_TRUE(t.Erase(k));  // shrinking through both kinds of array
  EXPECT_EQ(bytes, 0);
}

// A table grows because it is nearly full, never because an insert gave up early: a walk that
// moved keys back and forth between the same two buckets made tables grow at loads of 0.6-0.8,
// leaving them a third larger than needed (docs/scale.md, "A slow path"). Below and above
// kMapFromBytes (a fresh array, then growth in place), with random and sequential keys.
TEST(PositionTableTest, GrowsOnlyWhenNearlyFull) {
  for (const bool sequential : {false, true}) {
    int64_t bytes = 0;
    std::mt19937_64 rng(5);
    PositionTable t(&bytes);
    size_t growths = 0;
    for (uint64_t i = 0; i < 400'000; ++i) {
      const size_t size = t.size(), capacity = t.capacity();
      ASSERT_TRUE(t.TryInsert(sequential ? i : rng(), i + 1));
      if (t.capacity() == capacity || size < 1000) continue;
      ++growths;
      const double load = static_cast<double>(size) / static_cast<double>(capacity);
      EXPECT_GE(load, 0.88) << "grew at size " << size << (sequential ? ", sequential" : "");
      const size_t buckets = capacity / 4;  // one growth, 1.5x, not a second one inside it
      EXPECT_EQ(t.capacity(), 4 * (buckets + buckets / 2 + 1)) << "grew at size " << size;
    }
    EXPECT_GE(growths, 8u);
  }
}

// Tables growing side by side, as the index's per-worker tables do, keep resident only what
// they own: each growth's old array leaves the process. Left in the C heap (tables mapped only
// from 128 KiB), an old array stayed behind as a hole wherever what was allocated after it (the
// index's nodes) kept it from joining its neighbours, and the next, larger steps did not fit it:
// 1,000 workers on the Mooncake trace kept 88 MiB of holes beside a 228 MiB index. Here 400
// tables grow in random turns to about 100 KiB each, a small long-lived block allocated after
// each batch of inserts (tables mapped from 128 KiB: about 35 % more resident than owned).
TEST(PositionTableTest, TablesGrowingSideBySideKeepNoOldArraysResident) {
#ifdef KVR_TEST_ASAN
  GTEST_SKIP() << "under AddressSanitizer mapped arrays come from its heap, which quarantines them";
#endif
  constexpr size_t kTables = 400, kEntries = 5'500, kBlockBytes = 256;
  int64_t bytes = 0;
  std::vector<std::unique_ptr<PositionTable>> tables;
  for (size_t t = 0; t < kTables; ++t) tables.push_back(std::make_unique<PositionTable>(&bytes));
  std::vector<std::unique_ptr<char[]>> blocks;
  testing::TrimHeap();  // free pages left by earlier tests in this process would absorb holes
  const int64_t pages_before = testing::ResidentPages();
  std::mt19937_64 rng(3);
  for (size_t inserted = 0; inserted < kTables * kEntries;) {
    PositionTable& table = *tables[rng() % kTables];
    for (size_t n = 1 + rng() % 64; n > 0; --n, ++inserted) {
      ASSERT_TRUE(table.TryInsert(rng(), n));
    }
    blocks.push_back(std::make_unique<char[]>(kBlockBytes));
    blocks.back()[0] = 1;
  }
  const int64_t owned = bytes + static_cast<int64_t>(blocks.size() * kBlockBytes);
  const int64_t resident = (testing::ResidentPages() - pages_before) * sysconf(_SC_PAGESIZE);
  // 15 % for the heap's own overhead and the holes of tables' steps under 32 KiB (3 %).
  EXPECT_LE(resident, owned + owned * 15 / 100)
      << "resident " << resident << " B, tables and blocks " << owned;
  EXPECT_GE(resident, owned / 2);  // the figure is this process's at all
}

TEST(PositionTableTest, MovesTransferOwnership) {
  int64_t bytes = 0;
  PositionTable a(&bytes);
  for (uint64_t k = 1; k <= 100; ++k) a.TryInsert(k, k);
  PositionTable b(std::move(a));
  EXPECT_EQ(b.size(), 100u);
  EXPECT_EQ(b.Get(50), 50u);
  PositionTable c(&bytes);
  c = std::move(b);
  EXPECT_EQ(c.Get(100), 100u);
  c.Clear();
  EXPECT_EQ(bytes, 0);
}

// ---- A refused allocation leaves the table as it was --------------------------------------

// Inverse of the table's key mix (splitmix64's finaliser), to make keys whose two buckets are
// chosen: the table does not expose its mix, so this copy must agree with it (checked below by
// what the keys do).
uint64_t UnXorShift(uint64_t y, int shift) {
  uint64_t x = y;
  for (int i = 0; i < 64 / shift + 1; ++i) x = y ^ (x >> shift);
  return x;
}
uint64_t InverseOdd(uint64_t c) {
  uint64_t inv = c;
  for (int i = 0; i < 6; ++i) inv *= 2 - c * inv;
  return inv;
}
uint64_t KeyMixingTo(uint64_t h) {
  uint64_t x = UnXorShift(h, 31);
  x *= InverseOdd(0x94d049bb133111ebull);
  x = UnXorShift(x, 27);
  x *= InverseOdd(0xbf58476d1ce4e5b9ull);
  x = UnXorShift(x, 30);
  return x - 0x9e3779b97f4a7c15ull;
}

// Keys whose two buckets are the first and the last while the table has fewer than 28 buckets:
// nine of them fill both and the ninth's walk cannot succeed, so the table must grow.
std::vector<uint64_t> KeysSharingTwoBuckets(int n) {
  std::vector<uint64_t> keys;
  for (uint64_t j = 1; j <= static_cast<uint64_t>(n); ++j) {
    const uint64_t lo = j << 24, hi = 0xffffffffull - (j << 24);
    keys.push_back(KeyMixingTo((hi << 32) | lo));
  }
  return keys;
}

TEST(PositionTableTest, AFailedWalkIsUndoneWhenTheHeapRefusesTheGrowth) {
  int64_t bytes = 0;
  PositionTable table(&bytes);
  const std::vector<uint64_t> keys = KeysSharingTwoBuckets(9);
  for (size_t k = 0; k < 8; ++k) ASSERT_TRUE(table.TryInsert(keys[k], 100 + k));
  const size_t capacity = table.capacity();
  ASSERT_LT(9 * 10, static_cast<int>(capacity) * 9) << "the ninth must not grow the table first";
  const int64_t held = bytes;
  FailAllocationForTesting(1);
  EXPECT_THROW(table.TryInsert(keys[8], 108), std::bad_alloc);  // only a walk's growth allocates
  EXPECT_EQ(FailAllocationForTesting(0), 0u);
  // Before the fix the walk had moved the eight about and lost one of them (the one it carried
  // when the growth failed), and counted the ninth.
  EXPECT_EQ(table.size(), 8u);
  EXPECT_EQ(table.capacity(), capacity);
  EXPECT_EQ(bytes, held);
  for (size_t k = 0; k < 8; ++k) EXPECT_EQ(table.Get(keys[k]), 100 + k) << k;
  EXPECT_FALSE(table.Contains(keys[8]));
  // With memory back the insert grows the table and goes in.
  ASSERT_TRUE(table.TryInsert(keys[8], 108));
  for (size_t k = 0; k < 9; ++k) EXPECT_EQ(table.Get(keys[k]), 100 + k) << k;
  EXPECT_GT(table.capacity(), capacity);
}

// Every growth and every shrink of a table, each with the heap refusing: an insert throws and
// changes nothing, an erase still erases (keeping its larger array).
TEST(PositionTableTest, GrowthsAndShrinksTheHeapRefusesChangeNothing) {
  int64_t bytes = 0;
  PositionTable table(&bytes);
  std::unordered_map<uint64_t, uint64_t> model;
  std::mt19937_64 rng(0x5afe);
  auto check = [&] {
    ASSERT_EQ(table.size(), model.size());
    for (const auto& [k, v] : model) ASSERT_EQ(table.Get(k), v);
  };
  size_t refused = 0;
  for (uint64_t i = 0; i < 6000; ++i) {
    const uint64_t key = rng() | 1;
    FailAllocationForTesting(1);
    try {
      ASSERT_TRUE(table.TryInsert(key, i + 1));
      model[key] = i + 1;
    } catch (const std::bad_alloc&) {
      ++refused;
      check();
      ASSERT_FALSE(table.Contains(key));
      FailAllocationForTesting(0);
      ASSERT_TRUE(table.TryInsert(key, i + 1));
      model[key] = i + 1;
    }
    FailAllocationForTesting(0);
  }
  check();
  EXPECT_GE(refused, 10u);  // every growth on the way to 6,000 entries
  const int64_t full = bytes;
  while (!model.empty()) {
    const uint64_t key = model.begin()->first;
    model.erase(model.begin());
    FailAllocationForTesting(1);
    ASSERT_TRUE(table.Erase(key));
    FailAllocationForTesting(0);
    if (model.size() % 500 == 0) check();
  }
  EXPECT_EQ(table.size(), 0u);
  EXPECT_LE(bytes, full);
  EXPECT_EQ(bytes, 0);  // the last erase releases the array, which allocates nothing
}

}  // namespace
}  // namespace kvrouter

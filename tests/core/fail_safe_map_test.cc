// FailSafeMap alone: it answers as std::unordered_map does through random inserts, overwrites,
// erases and erasures by predicate (colliding keys included, so that backward-shift deletion
// moves entries across the table's end), reserves, shrinks only when mostly empty, and looks
// string_view keys up by std::string. Refused allocations are exercised through the load
// tracker by allocation_failure_test.cc.
#include "core/fail_safe_map.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>

#include "core/id_hash.h"
#include "test_data.h"

namespace kvrouter {
namespace {

using testing::Rng;

// Few distinct hashes: long probe runs, wrapping around the end of a small table.
struct Clumped {
  size_t operator()(uint64_t key) const { return (key % 5) * 0x3000000000000003ull + 13; }
};

template <typename Map>
void CheckSame(const Map& map, const std::unordered_map<uint64_t, uint32_t>& want,
               uint64_t key_range) {
  ASSERT_EQ(map.size(), want.size());
  for (uint64_t k = 0; k < key_range; ++k) {
    const uint32_t* got = map.Find(k);
    auto it = want.find(k);
    if (it == want.end()) {
      ASSERT_EQ(got, nullptr) << "key " << k;
    } else {
      ASSERT_NE(got, nullptr) << "key " << k;
      ASSERT_EQ(*got, it->second) << "key " << k;
    }
  }
  size_t visited = 0;
  map.ForEach([&](uint64_t key, uint32_t value) {
    ++visited;
    ASSERT_EQ(want.at(key), value);
  });
  EXPECT_EQ(visited, want.size());
}

template <typename Map>
void RandomOperations(uint64_t seed, uint64_t key_range) {
  Map map;
  std::unordered_map<uint64_t, uint32_t> want;
  Rng rng(seed);
  for (int step = 0; step < 20000; ++step) {
    const uint64_t key = rng.Below(static_cast<uint32_t>(key_range));
    const uint32_t value = static_cast<uint32_t>(rng.Next());
    switch (rng.Below(40)) {
      case 0: {
        // Every key of one residue: runs of erasures, shifts across the end included.
        const uint64_t residue = rng.Below(3);
        size_t calls = 0;
        const size_t erased = map.EraseIf([&](uint64_t k, uint32_t) {
          ++calls;
          return k % 3 == residue;
        });
        EXPECT_EQ(erased,
                  std::erase_if(want, [&](const auto& e) { return e.first % 3 == residue; }));
        EXPECT_GE(calls, want.size() + erased);
        break;
      }
      default:
        if (rng.Below(3) < 2) {
          map.Set(key, value);
          want[key] = value;
        } else {
          EXPECT_EQ(map.Erase(key), want.erase(key) > 0);
        }
        break;
    }
    if (step % 997 == 0) CheckSame(map, want, key_range);
  }
  CheckSame(map, want, key_range);
  for (uint64_t k = 0; k < key_range; ++k) {
    EXPECT_EQ(map.Erase(k), want.erase(k) > 0);
  }
  EXPECT_TRUE(map.empty());
  CheckSame(map, want, key_range);
}

TEST(FailSafeMapTest, AnswersAsAnUnorderedMap) {
  RandomOperations<FailSafeMap<uint64_t, uint32_t>>(1, 50);
  RandomOperations<FailSafeMap<uint64_t, uint32_t>>(2, 5000);
}

TEST(FailSafeMapTest, AnswersAsAnUnorderedMapWhenHashesCollide) {
  RandomOperations<FailSafeMap<uint64_t, uint32_t, Clumped>>(3, 12);
  RandomOperations<FailSafeMap<uint64_t, uint32_t, Clumped>>(4, 200);
}

TEST(FailSafeMapTest, ReservedRoomTakesNewKeysWithoutGrowing) {
  FailSafeMap<uint64_t, uint32_t> map;
  EXPECT_EQ(map.capacity(), 0u);
  EXPECT_EQ(map.Find(uint64_t{7}), nullptr);
  EXPECT_FALSE(map.Erase(uint64_t{7}));
  map.Reserve(100);
  const size_t capacity = map.capacity();
  EXPECT_GE(capacity * 3 / 4, 100u);
  for (uint32_t k = 0; k < 100; ++k) map.Set(k, k);
  EXPECT_EQ(map.capacity(), capacity);
  // An erase, then a new key: still no growth, however full.
  EXPECT_TRUE(map.Erase(uint64_t{5}));
  map.Set(1000, 1);
  EXPECT_EQ(map.capacity(), capacity);
  EXPECT_EQ(*map.Find(uint64_t{1000}), 1u);
}

TEST(FailSafeMapTest, ShrinksOnlyWhenMostlyEmpty) {
  FailSafeMap<uint64_t, uint32_t> map;
  for (uint32_t k = 0; k < 4000; ++k) map.Set(k, k);
  const size_t full = map.capacity();
  EXPECT_FALSE(map.ShrinkIfMostlyEmpty(1024));
  for (uint32_t k = 0; k < 2900; ++k) map.Erase(k);
  EXPECT_FALSE(map.ShrinkIfMostlyEmpty(1024));  // 1,100 entries: more than 1/8 full
  EXPECT_EQ(map.capacity(), full);
  for (uint32_t k = 2900; k < 3990; ++k) map.Erase(k);
  EXPECT_TRUE(map.ShrinkIfMostlyEmpty(1024));
  EXPECT_LT(map.capacity(), full);
  EXPECT_EQ(map.size(), 10u);
  for (uint32_t k = 3990; k < 4000; ++k) EXPECT_EQ(*map.Find(k), k);
  EXPECT_FALSE(map.ShrinkIfMostlyEmpty(1024));  // already small
  for (uint32_t k = 3990; k < 4000; ++k) map.Erase(k);
  EXPECT_FALSE(map.ShrinkIfMostlyEmpty(1024));
}

TEST(FailSafeMapTest, LooksStringViewKeysUpByString) {
  const std::string a = "request-a", b = "request-b";
  FailSafeMap<std::string_view, int, IdHash> map;
  map.Set(a, 1);
  map.Set(b, 2);
  EXPECT_EQ(*map.Find(std::string("request-a")), 1);
  EXPECT_EQ(*map.Find(std::string_view("request-b")), 2);
  EXPECT_FALSE(map.Contains(std::string("request-c")));
  EXPECT_TRUE(map.Erase(std::string("request-a")));
  EXPECT_FALSE(map.Contains(a));
  EXPECT_EQ(map.size(), 1u);
}

}  // namespace
}  // namespace kvrouter

// Hybrid models' sliding-window groups in the index (core/sliding_windows.h): a rank's hit is
// where vLLM's KV-cache coordinator would resume, checked against a port of its rule over plain
// sets (the oracle below) on random histories, plus the cases a real Gemma-3 showed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "core/hashing.h"
#include "core/radix_index.h"
#include "core/types.h"
#include "test_data.h"

namespace kvrouter {
namespace {

using testing::ClearedWorker;
using testing::RemovedBlocks;
using testing::StoredBlocks;

// Short names: every test here is about them.
KvEvent SlidingStored(WorkerKey rank, int64_t group, uint32_t window_tokens,
                      std::vector<uint64_t> engine_hashes) {
  return testing::SlidingStoredBlocks(rank, group, window_tokens, std::move(engine_hashes));
}
KvEvent SlidingRemoved(WorkerKey rank, int64_t group, std::vector<uint64_t> engine_hashes) {
  return testing::SlidingRemovedBlocks(rank, group, std::move(engine_hashes));
}

uint32_t DeviceHit(const RadixIndex& index, WorkerKey rank, std::span<const uint64_t> prompt,
                   size_t computable = SIZE_MAX) {
  for (const WorkerMatch& m : index.FindMatches(prompt, computable)) {
    if (m.worker == rank) return m.device_blocks;
  }
  return 0;
}

constexpr WorkerKey kRank{7, 0};

// What a real Gemma-3 (window 64 tokens, blocks of 32: the two blocks before a hit point must be
// held) did: the sliding group keeps the last two blocks of a 4-block prompt only, so a later
// prompt sharing its first three blocks resumes from nothing, though full attention holds them.
TEST(SlidingWindowTest, APrefixCountsOnlyWhereTheWindowHoldsTheBlocksBeforeIt) {
  RadixIndex index({.block_size = 32});
  const std::vector<uint64_t> locals{11, 12, 13, 14};
  const std::vector<uint64_t> engine{101, 102, 103, 104};
  ASSERT_TRUE(index.Apply(StoredBlocks(kRank, std::nullopt, engine, locals)).ok());
  EXPECT_EQ(3u, DeviceHit(index, kRank, std::vector<uint64_t>{11, 12, 13, 99}));
  ASSERT_TRUE(index.Apply(SlidingStored(kRank, 0, 64, {103, 104})).ok());
  EXPECT_EQ("", index.CheckInvariants());
  // The whole prompt again: blocks 2 and 3 are held, the hit is whole.
  EXPECT_EQ(4u, DeviceHit(index, kRank, std::vector<uint64_t>{11, 12, 13, 14, 15}, 4));
  // Capped at the last token (a prompt of exactly four blocks): the search starts at 3, where
  // blocks 1 and 2 are not both held; none below either; the leading run is empty.
  EXPECT_EQ(0u, DeviceHit(index, kRank, locals, 3));
  // Three shared blocks: the same, and the rank is no match at all.
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{11, 12, 13, 99}).empty());
  // Without the cap the whole prompt is a hit, as for full attention.
  EXPECT_EQ(4u, DeviceHit(index, kRank, locals));
  // The window moves on: the group drops block 2 and holds 1 and 2's successor chain no more.
  ASSERT_TRUE(index.Apply(SlidingRemoved(kRank, 0, {103})).ok());
  EXPECT_EQ(0u, DeviceHit(index, kRank, std::vector<uint64_t>{11, 12, 13, 14, 15}, 4));
  // Full attention is untouched by the sliding group's removal.
  EXPECT_EQ(1u, index.Stats().sliding_blocks);
  EXPECT_EQ(4u, index.TreeSize(kRank));
}

// The leading run: with none of the window's runs found, the blocks held from the prompt's first
// one on are a hit, however few (vLLM keeps a request's first blocks in the window while it
// prefills).
TEST(SlidingWindowTest, TheLeadingRunIsAHitWhenNoRunIsLongEnough) {
  RadixIndex index({.block_size = 16});
  const std::vector<uint64_t> locals{1, 2, 3, 4, 5, 6};
  const std::vector<uint64_t> engine{201, 202, 203, 204, 205, 206};
  ASSERT_TRUE(index.Apply(StoredBlocks(kRank, std::nullopt, engine, locals)).ok());
  // Window 64 tokens: 4 blocks before a hit point.
  ASSERT_TRUE(index.Apply(SlidingStored(kRank, 0, 64, {201, 202, 204, 205})).ok());
  EXPECT_EQ(2u, DeviceHit(index, kRank, locals));
  ASSERT_TRUE(index.Apply(SlidingStored(kRank, 0, 64, {203})).ok());
  EXPECT_EQ(5u, DeviceHit(index, kRank, locals));  // blocks 1-4 before 5
  ASSERT_TRUE(index.Apply(SlidingRemoved(kRank, 0, {205})).ok());
  EXPECT_EQ(4u, DeviceHit(index, kRank, locals));  // blocks 0-3 before 4
}

// Groups of one window are looked up together (all must hold a block); a store that names a
// block the rank does not hold in full attention cannot be placed, and says so.
TEST(SlidingWindowTest, GroupsOfOneWindowMustAllHoldABlockAndUnplacedBlocksAreReported) {
  RadixIndex index({.block_size = 16});
  const std::vector<uint64_t> locals{1, 2, 3};
  const std::vector<uint64_t> engine{301, 302, 303};
  ASSERT_TRUE(index.Apply(StoredBlocks(kRank, std::nullopt, engine, locals)).ok());
  ASSERT_TRUE(index.Apply(SlidingStored(kRank, 0, 17, {302, 303})).ok());  // 1 block before
  EXPECT_EQ(3u, DeviceHit(index, kRank, locals));
  ASSERT_TRUE(index.Apply(SlidingStored(kRank, 4, 17, {302})).ok());
  EXPECT_EQ(2u, DeviceHit(index, kRank, locals));
  const ApplyResult unplaced = index.Apply(SlidingStored(kRank, 4, 17, {303, 999}));
  EXPECT_EQ(EventError::kBlockNotFound, unplaced.error);
  EXPECT_NE(std::string::npos, unplaced.message.find("1 of 2")) << unplaced.message;
  EXPECT_EQ(3u, DeviceHit(index, kRank, locals));  // 303 applied all the same
  const IndexStats stats = index.Stats();
  EXPECT_EQ(2u, stats.sliding_events[0][0]);
  EXPECT_EQ(1u, stats.sliding_events[0][static_cast<int>(EventError::kBlockNotFound)]);
  EXPECT_EQ(4u, stats.sliding_blocks);
  // While its groups are known, a rank whose windows hold nothing resumes from nothing.
  ASSERT_TRUE(index.Apply(SlidingRemoved(kRank, 0, {302, 303})).ok());
  ASSERT_TRUE(index.Apply(SlidingRemoved(kRank, 4, {302, 303})).ok());
  EXPECT_EQ(0u, index.Stats().sliding_blocks);
  EXPECT_EQ(0u, DeviceHit(index, kRank, locals));
  // A clear takes the groups too (an engine restarted with another configuration must not
  // keep the old one's): full attention alone again until a window speaks.
  ASSERT_TRUE(index.Apply(ClearedWorker(kRank)).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kRank, std::nullopt, engine, locals)).ok());
  EXPECT_EQ(3u, DeviceHit(index, kRank, locals));
  // Removing the rank forgets everything, and its memory goes with it.
  index.RemoveWorker(kRank.worker_id);
  EXPECT_EQ("", index.CheckInvariants());
  ASSERT_TRUE(index.Apply(StoredBlocks(kRank, std::nullopt, engine, locals)).ok());
  EXPECT_EQ(3u, DeviceHit(index, kRank, locals));
}

// A group counts once for a block however many engine hashes it names it by: two copies in one
// group are not the other group of the window holding it.
TEST(SlidingWindowTest, ABlockTwiceInOneGroupIsNotHeldByTheOtherGroups) {
  RadixIndex index({.block_size = 16});
  ASSERT_TRUE(index.Apply(StoredBlocks(kRank, std::nullopt, {401}, {1})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kRank, std::nullopt, {402}, {1})).ok());  // a second copy
  ASSERT_TRUE(index.Apply(SlidingStored(kRank, 0, 17, {401, 402})).ok());
  (void)index.Apply(SlidingStored(kRank, 1, 17, {999}));  // group 1 known, holding nothing
  const std::vector<uint64_t> prompt{1, 2};
  EXPECT_EQ(0u, DeviceHit(index, kRank, prompt));
  ASSERT_TRUE(index.Apply(SlidingRemoved(kRank, 0, {401})).ok());
  ASSERT_TRUE(index.Apply(SlidingStored(kRank, 1, 17, {401})).ok());
  EXPECT_EQ(1u, DeviceHit(index, kRank, prompt));  // group 0 still holds it as 402
  ASSERT_TRUE(index.Apply(SlidingRemoved(kRank, 0, {402})).ok());
  EXPECT_EQ(0u, DeviceHit(index, kRank, prompt));
  EXPECT_EQ("", index.CheckInvariants());
}

TEST(SlidingWindowTest, MalformedStoresChangeNothing) {
  RadixIndex index({.block_size = 16});
  ASSERT_TRUE(index.Apply(StoredBlocks(kRank, std::nullopt, {1}, {1})).ok());
  EXPECT_EQ(EventError::kInvalidBlock, index.Apply(SlidingStored(kRank, 0, 0, {1})).error);
  KvEvent mismatched = SlidingStored(kRank, 0, 32, {1});
  std::get<SlidingStoredEvent>(mismatched.data).sequence_hashes = {1, 2};
  EXPECT_EQ(EventError::kInvalidBlock, index.Apply(mismatched).error);
  EXPECT_EQ(EventError::kBlockNotFound, index.Apply(SlidingRemoved(kRank, 0, {1})).error);
  KvEvent on_host = SlidingStored(kRank, 0, 32, {1});
  on_host.tier = Tier::kHostPinned;  // only the device's windows limit a hit
  EXPECT_EQ(EventError::kInvalidBlock, index.Apply(on_host).error);
  EXPECT_EQ(1u, DeviceHit(index, kRank, std::vector<uint64_t>{1}));
  EXPECT_EQ(0u, index.Stats().sliding_blocks);
  ASSERT_TRUE(index.Apply(SlidingStored(kRank, 0, 32, {1})).ok());
  KvEvent removed_on_host = SlidingRemoved(kRank, 0, {1});
  removed_on_host.tier = Tier::kHostPinned;  // it would take the device's copy
  EXPECT_EQ(EventError::kInvalidBlock, index.Apply(removed_on_host).error);
  EXPECT_EQ(1u, index.Stats().sliding_blocks);
  EXPECT_EQ(1u, DeviceHit(index, kRank, std::vector<uint64_t>{1}));
}

// A rank's groups are bounded: garbage group indices cannot grow them without end.
TEST(SlidingWindowTest, ARankHasAtMostSixtyFourGroups) {
  RadixIndex index({.block_size = 16});
  ASSERT_TRUE(index.Apply(StoredBlocks(kRank, std::nullopt, {1}, {1})).ok());
  for (int64_t group = 0; group < 64; ++group) {
    ASSERT_TRUE(index.Apply(SlidingStored(kRank, group, 32, {1})).ok()) << group;
  }
  const ApplyResult refused = index.Apply(SlidingStored(kRank, 64, 32, {1}));
  EXPECT_EQ(EventError::kInvalidBlock, refused.error);
  EXPECT_NE(std::string::npos, refused.message.find("64 sliding-window groups already"))
      << refused.message;
  EXPECT_TRUE(index.Apply(SlidingStored(kRank, 63, 32, {1})).ok());  // a known one still applies
  EXPECT_EQ(64u, index.Stats().sliding_blocks);
  EXPECT_EQ("", index.CheckInvariants());
}

// ---- Random histories against vLLM's rule ------------------------------------------------------

// The oracle: every block named by its (prompt, depth) identity, what each rank holds as sets,
// and vLLM's KVCoordinator.find_longest_cache_hit over them (full attention, then each window's
// SlidingWindowManager rule until none lowers the hit), reported as the index reports it.
struct Oracle {
  uint32_t block_size;
  struct Rank {
    std::set<uint64_t> full;                      // engine hashes
    std::map<int64_t, uint32_t> windows;          // group -> window tokens
    std::map<int64_t, std::set<uint64_t>> slide;  // group -> engine hashes
  };
  std::map<WorkerKey, Rank> ranks;

  bool Holds(const Rank& r, uint32_t window, uint64_t engine) const {
    for (const auto& [group, w] : r.windows) {
      if (w != window) continue;
      auto it = r.slide.find(group);
      if (it == r.slide.end() || !it->second.contains(engine)) return false;
    }
    return true;
  }

  uint32_t Hit(WorkerKey key, std::span<const uint64_t> engine, size_t computable) const {
    auto it = ranks.find(key);
    if (it == ranks.end()) return 0;
    const Rank& r = it->second;
    uint32_t full = 0;
    while (full < engine.size() && r.full.contains(engine[full])) ++full;
    if (full == 0 || r.windows.empty()) return full;
    uint32_t hit = static_cast<uint32_t>(std::min<size_t>(full, computable));
    const uint32_t capped = hit;
    for (bool lowered = true; lowered;) {
      lowered = false;
      for (const auto& [group, window] : r.windows) {
        const uint32_t needed = std::max<uint32_t>(1, (window - 1 + block_size - 1) / block_size);
        uint32_t run = 0, found = UINT32_MAX;
        for (uint32_t i = hit; i-- > 0;) {
          run = Holds(r, window, engine[i]) ? run + 1 : 0;
          if (run == needed) {
            found = i + needed;
            break;
          }
        }
        const uint32_t next = found != UINT32_MAX ? found : run;
        if (next < hit) {
          hit = next;
          lowered = true;
        }
      }
    }
    return hit == capped ? full : hit;
  }
};

TEST(SlidingWindowTest, RandomHistoriesAgreeWithVllmsRule) {
  constexpr uint32_t kBlock = 4;
  std::mt19937_64 rng(20261206);
  // Prompts as local-hash paths sharing prefixes: each extends an earlier one at some depth.
  std::vector<std::vector<uint64_t>> prompts{{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}};
  for (int p = 1; p < 10; ++p) {
    const auto& base = prompts[rng() % prompts.size()];
    std::vector<uint64_t> prompt(base.begin(), base.begin() + rng() % base.size());
    while (prompt.size() < 12) prompt.push_back(100 * p + prompt.size());
    prompts.push_back(prompt);
  }
  // A block's engine hash follows from its prefix (as vLLM's does), so prompts sharing a prefix
  // share its engine hashes.
  auto engine_of = [](std::span<const uint64_t> prompt) {
    std::vector<uint64_t> engine = ComputeSequenceHashes(prompt);
    for (uint64_t& h : engine) h ^= 0x5a5a5a5a5a5a5a5aull;
    return engine;
  };
  const WorkerKey ranks[] = {{1, 0}, {1, 1}, {2, 0}};
  // 2, 2, 3 and 6 blocks before a hit point.
  const std::map<int64_t, uint32_t> windows{{0, 8}, {2, 8}, {3, 13}, {5, 24}};
  for (int round = 0; round < 30; ++round) {
    RadixIndex index({.block_size = kBlock, .shards = 2});
    Oracle oracle{.block_size = kBlock};
    for (int step = 0; step < 300; ++step) {
      const WorkerKey rank = ranks[rng() % 3];
      Oracle::Rank& r = oracle.ranks[rank];
      const auto& prompt = prompts[rng() % prompts.size()];
      const std::vector<uint64_t> engine = engine_of(prompt);
      const int op = static_cast<int>(rng() % 10);
      if (op < 3) {  // full attention stores a run continuing a block it holds (or the root)
        size_t from = rng() % prompt.size();
        while (from > 0 && !r.full.contains(engine[from - 1])) --from;
        const size_t to = from + 1 + rng() % (prompt.size() - from);
        std::optional<uint64_t> parent;
        if (from > 0) parent = engine[from - 1];
        ASSERT_TRUE(
            index
                .Apply(StoredBlocks(rank, parent, {engine.begin() + from, engine.begin() + to},
                                    {prompt.begin() + from, prompt.begin() + to}))
                .ok());
        r.full.insert(engine.begin() + from, engine.begin() + to);
      } else if (op < 4) {  // full attention evicts some blocks
        std::vector<uint64_t> gone;
        for (uint64_t h : engine) {
          if (r.full.contains(h) && rng() % 3 == 0) gone.push_back(h);
        }
        (void)index.Apply(RemovedBlocks(rank, gone));
        for (uint64_t h : gone) r.full.erase(h);
      } else if (op < 7) {  // a sliding group stores some blocks of a prompt
        auto group = windows.begin();
        std::advance(group, rng() % windows.size());
        std::vector<uint64_t> stored;
        for (uint64_t h : engine) {
          if (rng() % 2 == 0) stored.push_back(h);
        }
        (void)index.Apply(SlidingStored(rank, group->first, group->second, stored));
        r.windows[group->first] = group->second;
        for (uint64_t h : stored) {  // placed only where full attention holds them
          if (r.full.contains(h)) r.slide[group->first].insert(h);
        }
      } else if (op < 9) {  // a sliding group evicts some
        auto group = windows.begin();
        std::advance(group, rng() % windows.size());
        std::vector<uint64_t> gone;
        for (uint64_t h : r.slide[group->first]) {
          if (rng() % 2 == 0) gone.push_back(h);
        }
        (void)index.Apply(SlidingRemoved(rank, group->first, gone));
        for (uint64_t h : gone) r.slide[group->first].erase(h);
      } else {
        ASSERT_TRUE(index.Apply(ClearedWorker(rank)).ok());
        r = Oracle::Rank{};  // its groups too
      }
      ASSERT_EQ("", index.CheckInvariants()) << "round " << round << " step " << step;
      // Every rank against the oracle, on a prompt cut anywhere, with and without the cap.
      const auto& query = prompts[rng() % prompts.size()];
      const size_t length = 1 + rng() % query.size();
      const std::span<const uint64_t> locals(query.data(), length);
      const std::vector<uint64_t> engine_query = engine_of(locals);
      for (size_t computable : {SIZE_MAX, length, length - 1}) {
        for (const WorkerKey& k : ranks) {
          ASSERT_EQ(oracle.Hit(k, engine_query, computable),
                    DeviceHit(index, k, locals, computable))
              << "round " << round << " step " << step << " rank " << k.worker_id << "/"
              << k.dp_rank << " length " << length << " computable " << computable;
        }
      }
    }
    // A dump restores the same answers, and the same digest.
    RadixIndex restored({.block_size = kBlock});
    for (const KvEvent& e : index.DumpEvents()) ASSERT_TRUE(restored.Apply(e).ok());
    EXPECT_EQ(index.StateDigest(), restored.StateDigest());
    EXPECT_EQ("", restored.CheckInvariants());
    for (const auto& prompt : prompts) {
      for (const WorkerKey& k : ranks) {
        EXPECT_EQ(DeviceHit(index, k, prompt, prompt.size() - 1),
                  DeviceHit(restored, k, prompt, prompt.size() - 1));
      }
    }
    // Memory follows the blocks: with every rank gone, only what an empty index has is left.
    for (const WorkerKey& k : ranks) index.RemoveWorkerDpRank(k);
    EXPECT_EQ(0u, index.Stats().sliding_blocks);
    EXPECT_EQ(RadixIndex({.block_size = kBlock, .shards = 2}).Stats().allocated_bytes,
              index.Stats().allocated_bytes);
  }
}

}  // namespace
}  // namespace kvrouter

#include "core/active_sequences.h"

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "core/clock.h"
#include "core/hashing.h"

namespace kvrouter {
namespace {

constexpr uint32_t kBlockSize = 4;
constexpr WorkerKey kWorkerA{.worker_id = 1, .dp_rank = 0};
constexpr WorkerKey kWorkerB{.worker_id = 2, .dp_rank = 0};
constexpr WorkerKey kWorkerC{.worker_id = 3, .dp_rank = 0};

// Sequence hashes of a prompt whose tokens are `prefix` blocks of a shared pattern followed by
// blocks unique to `variant`.
std::vector<uint64_t> Chain(size_t shared_blocks, size_t own_blocks, uint32_t variant) {
  std::vector<uint32_t> tokens;
  for (size_t i = 0; i < shared_blocks * kBlockSize; ++i)
    tokens.push_back(static_cast<uint32_t>(i));
  for (size_t i = 0; i < own_blocks * kBlockSize; ++i) tokens.push_back(1'000'000 * variant + i);
  return ComputeSequenceHashes(ComputeLocalBlockHashes(tokens, kBlockSize));
}

class ActiveSequencesTest : public ::testing::Test {
 protected:
  ActiveSequencesTest() : active_(clock_) {
    active_.AddWorker(kWorkerA);
    active_.AddWorker(kWorkerB);
    active_.AddWorker(kWorkerC);
  }

  absl::Status Add(const std::string& id, WorkerKey worker, const std::vector<uint64_t>& blocks,
                   uint64_t prefill_tokens = 0) {
    return active_.AddRequest(SequenceRequest{
        .request_id = id, .worker = worker, .block_ids = blocks, .prefill_tokens = prefill_tokens});
  }

  std::vector<PotentialLoad> Potential(const std::vector<uint64_t>& chain, uint64_t prompt_tokens,
                                       uint64_t cached_on_a = 0) {
    std::vector<PotentialLoad> out;
    active_.PotentialLoads(
        PotentialLoadQuery{.block_ids = chain, .prompt_tokens = prompt_tokens},
        [&](size_t, WorkerKey w) { return w == kWorkerA ? cached_on_a : 0; }, out);
    return out;
  }

  ManualClock clock_;
  ActiveSequences active_;
};

TEST_F(ActiveSequencesTest, SharedPrefixBlocksAreCountedOncePerWorker) {
  const auto first = Chain(2, 1, 1);   // blocks s0 s1 x
  const auto second = Chain(2, 1, 2);  // blocks s0 s1 y
  ASSERT_TRUE(Add("r1", kWorkerA, first).ok());
  ASSERT_TRUE(Add("r2", kWorkerA, second).ok());
  ASSERT_TRUE(Add("r3", kWorkerA, first).ok());         // the very same prompt again
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 4u);  // s0 s1 x y
  EXPECT_EQ(active_.Load(kWorkerA).active_requests, 3u);

  // The same prompt on another worker is counted there again.
  ASSERT_TRUE(Add("r4", kWorkerB, first).ok());
  EXPECT_EQ(active_.Load(kWorkerB).active_blocks, 3u);

  EXPECT_TRUE(active_.Free("r1"));
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 4u);  // r3 still holds s0 s1 x
  EXPECT_TRUE(active_.Free("r3"));
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 3u);  // s0 s1 y
  EXPECT_TRUE(active_.Free("r2"));
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 0u);
  EXPECT_TRUE(active_.Free("r4"));
  EXPECT_EQ(active_.TotalActiveBlocks(), 0u);
  EXPECT_EQ(active_.DistinctBlockIds(), 0u);
}

TEST_F(ActiveSequencesTest, PrefixOfAnActivePromptAddsNoBlocks) {
  const auto whole = Chain(5, 0, 0);
  const std::vector<uint64_t> prefix(whole.begin(), whole.begin() + 2);
  ASSERT_TRUE(Add("long", kWorkerA, whole).ok());
  ASSERT_TRUE(Add("short", kWorkerA, prefix).ok());
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 5u);
  EXPECT_TRUE(active_.Free("long"));
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 2u);
  EXPECT_TRUE(active_.Free("short"));
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 0u);
}

TEST_F(ActiveSequencesTest, PrefillTokensCountUntilCompletedAndCompletionIsIdempotent) {
  ASSERT_TRUE(Add("r1", kWorkerA, Chain(1, 1, 1), 100).ok());
  ASSERT_TRUE(Add("r2", kWorkerA, Chain(1, 1, 2), 30).ok());
  EXPECT_EQ(active_.Load(kWorkerA).active_prefill_tokens, 130u);
  EXPECT_TRUE(active_.MarkPrefillCompleted("r1"));
  EXPECT_FALSE(active_.MarkPrefillCompleted("r1"));
  EXPECT_FALSE(active_.MarkPrefillCompleted("unknown"));
  EXPECT_EQ(active_.Load(kWorkerA).active_prefill_tokens, 30u);
  EXPECT_TRUE(active_.Free("r2"));  // frees its unfinished prefill too
  EXPECT_EQ(active_.Load(kWorkerA).active_prefill_tokens, 0u);
}

// A 10-token prompt (2 full blocks of 4, plus 2 tokens in a third) grows by one output block
// each time prompt + output crosses a multiple of 4 past 12: output 2 still fits the third
// block, output 3 needs a fourth, output 7 a fifth.
TEST_F(ActiveSequencesTest, OutputTokensAddUnsharedBlocksUntilFreed) {
  ASSERT_TRUE(active_
                  .AddRequest(SequenceRequest{.request_id = "r1",
                                              .worker = kWorkerA,
                                              .block_ids = Chain(2, 0, 1),
                                              .prompt_tokens = 10})
                  .ok());
  ASSERT_TRUE(Add("r2", kWorkerA, Chain(2, 0, 1)).ok());  // shares both prompt blocks
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 2u);
  EXPECT_FALSE(active_.SetOutputTokens("r1", 2, kBlockSize));
  EXPECT_TRUE(active_.SetOutputTokens("r1", 3, kBlockSize));
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 3u);
  EXPECT_FALSE(active_.SetOutputTokens("r1", 6, kBlockSize));  // same block count
  EXPECT_TRUE(active_.SetOutputTokens("r1", 7, kBlockSize));
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 4u);
  EXPECT_FALSE(active_.SetOutputTokens("unknown", 100, kBlockSize));
  // "Unknown" passed as UINT64_MAX must not wrap: a huge but finite count.
  EXPECT_TRUE(active_.SetOutputTokens("r1", UINT64_MAX, kBlockSize));
  EXPECT_GT(active_.Load(kWorkerA).active_blocks, 1'000'000'000u);
  EXPECT_TRUE(active_.SetOutputTokens("r1", 7, kBlockSize));
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 4u);
  const uint64_t digest = active_.StateDigest();
  EXPECT_TRUE(active_.Free("r1"));  // its output blocks go with it; the shared prefix stays
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 2u);
  EXPECT_NE(active_.StateDigest(), digest);
  EXPECT_TRUE(active_.Free("r2"));
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 0u);
}

TEST_F(ActiveSequencesTest, FreeIsIdempotentAndUnknownIdsAreNoError) {
  ASSERT_TRUE(Add("r1", kWorkerA, Chain(2, 0, 0), 8).ok());
  EXPECT_TRUE(active_.Free("r1"));
  EXPECT_FALSE(active_.Free("r1"));
  EXPECT_FALSE(active_.Free("never-seen"));
  EXPECT_FALSE(active_.MarkPrefillCompleted("r1"));
  EXPECT_EQ(active_.num_requests(), 0u);
  EXPECT_EQ(active_.Load(kWorkerA).active_requests, 0u);
}

TEST_F(ActiveSequencesTest, DuplicateRequestIdIsRejectedAndChangesNothing) {
  ASSERT_TRUE(Add("r1", kWorkerA, Chain(2, 0, 0), 8).ok());
  const absl::Status again = Add("r1", kWorkerB, Chain(3, 0, 0), 99);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(again.message().find("r1"), std::string_view::npos);
  EXPECT_EQ(active_.Load(kWorkerB).active_blocks, 0u);
  EXPECT_EQ(active_.Load(kWorkerB).active_prefill_tokens, 0u);
  EXPECT_EQ(active_.WorkerOf("r1"), kWorkerA);
}

TEST_F(ActiveSequencesTest, UnknownWorkerAndEmptyIdAreClearErrors) {
  EXPECT_EQ(Add("r1", WorkerKey{.worker_id = 99}, Chain(1, 0, 0)).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Add("", kWorkerA, Chain(1, 0, 0)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(active_.num_requests(), 0u);
}

TEST_F(ActiveSequencesTest, PromptShorterThanABlockHoldsNoBlocks) {
  ASSERT_TRUE(Add("tiny", kWorkerA, {}, 3).ok());
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 0u);
  EXPECT_EQ(active_.Load(kWorkerA).active_prefill_tokens, 3u);
  EXPECT_TRUE(active_.Free("tiny"));
}

TEST_F(ActiveSequencesTest, RequestsOlderThanTheExpiryAreDropped) {
  ASSERT_TRUE(Add("old", kWorkerA, Chain(2, 0, 0), 50).ok());
  clock_.AdvanceSeconds(200);
  ASSERT_TRUE(Add("young", kWorkerB, Chain(2, 0, 0), 20).ok());
  clock_.AdvanceSeconds(100);  // "old" is exactly 300 s old: not older than the expiry
  EXPECT_EQ(active_.ExpireStale(), 0u);
  clock_.AdvanceSeconds(1);
  EXPECT_EQ(active_.ExpireStale(), 1u);
  EXPECT_FALSE(active_.HasRequest("old"));
  EXPECT_TRUE(active_.HasRequest("young"));
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 0u);
  EXPECT_EQ(active_.Load(kWorkerA).active_prefill_tokens, 0u);
  EXPECT_FALSE(active_.Free("old"));  // a late free of an expired request is no error
}

// Adding a request expires nothing (its owner, the Router, expires and then admits whom that
// makes room for); MaybeExpire does, at most once per check interval.
TEST_F(ActiveSequencesTest, MaybeExpireDropsStaleOnesOncePerCheckInterval) {
  ASSERT_TRUE(Add("old", kWorkerA, Chain(2, 0, 0), 50).ok());
  clock_.AdvanceSeconds(301);
  ASSERT_TRUE(Add("new", kWorkerA, Chain(1, 0, 0), 10).ok());
  EXPECT_TRUE(active_.HasRequest("old"));
  EXPECT_EQ(active_.MaybeExpire(), 1u);
  EXPECT_FALSE(active_.HasRequest("old"));
  EXPECT_EQ(active_.Load(kWorkerA).active_prefill_tokens, 10u);
  EXPECT_EQ(active_.Load(kWorkerA).active_blocks, 1u);
  clock_.AdvanceSeconds(301);            // "new" is stale now, but the check interval (30 s) ...
  EXPECT_EQ(active_.MaybeExpire(), 1u);  // ... has passed since the last check, so it goes
  ASSERT_TRUE(Add("newer", kWorkerA, Chain(1, 0, 0), 10).ok());
  clock_.AdvanceSeconds(29);
  EXPECT_EQ(active_.MaybeExpire(), 0u);  // within the interval: no scan
}

// A decision joins the index's matches to the loads by AlignToRanks: once a rank has left, slot
// numbers and positions in the order of Loads() differ, and a reused slot moves a rank up.
TEST_F(ActiveSequencesTest, AlignToRanksFollowsTheOrderOfLoadsAcrossLeavingAndReuse) {
  struct Item {
    WorkerKey worker;
    int tag;
  };
  const auto key_of = [](const Item& item) { return item.worker; };
  const auto tags_in_load_order = [&](const std::vector<Item>& items) {
    std::vector<const Item*> aligned;
    active_.AlignToRanks(std::span<const Item>(items), key_of, aligned);
    const auto loads = active_.Loads();
    EXPECT_EQ(aligned.size(), loads.size());
    std::vector<std::pair<uint64_t, int>> tags;  // (rank's worker id, its item's tag or -1)
    for (size_t i = 0; i < loads.size() && i < aligned.size(); ++i) {
      if (aligned[i] != nullptr) {
        EXPECT_EQ(aligned[i]->worker, loads[i].worker);
      }
      tags.emplace_back(loads[i].worker.worker_id, aligned[i] ? aligned[i]->tag : -1);
    }
    return tags;
  };
  using Tags = std::vector<std::pair<uint64_t, int>>;
  const WorkerKey unknown{.worker_id = 99};
  const std::vector<Item> items{{kWorkerC, 30}, {unknown, 990}, {kWorkerA, 10}};
  EXPECT_EQ(tags_in_load_order(items), (Tags{{1, 10}, {2, -1}, {3, 30}}));

  active_.RemoveWorker(kWorkerA);  // its slot, the first, is free now
  EXPECT_EQ(tags_in_load_order(items), (Tags{{2, -1}, {3, 30}}));

  const WorkerKey d{.worker_id = 4};
  active_.AddWorker(d);  // takes the free first slot
  EXPECT_EQ(tags_in_load_order({{d, 40}, {kWorkerB, 20}, {kWorkerC, 30}}),
            (Tags{{4, 40}, {2, 20}, {3, 30}}));
}

TEST_F(ActiveSequencesTest, PotentialLoadCountsOnlyBlocksTheWorkerLacks) {
  const auto prompt = Chain(6, 0, 0);  // 6 blocks, 24 tokens
  ASSERT_TRUE(Add("a", kWorkerA, {prompt.begin(), prompt.begin() + 4}, 5).ok());
  ASSERT_TRUE(Add("b", kWorkerB, {prompt.begin(), prompt.begin() + 2}).ok());
  ASSERT_TRUE(Add("b2", kWorkerB, Chain(0, 3, 7)).ok());  // unrelated blocks

  const auto loads = Potential(prompt, 24, /*cached_on_a=*/16);
  ASSERT_EQ(loads.size(), 3u);
  absl::flat_hash_map<WorkerKey, PotentialLoad> by_worker;
  for (const auto& l : loads) by_worker[l.current.worker] = l;

  EXPECT_EQ(by_worker[kWorkerA].new_blocks, 2u);
  EXPECT_EQ(by_worker[kWorkerA].potential_decode_blocks, 4u + 2u);
  EXPECT_EQ(by_worker[kWorkerA].potential_prefill_tokens, 5u + (24u - 16u));
  EXPECT_EQ(by_worker[kWorkerB].new_blocks, 4u);
  EXPECT_EQ(by_worker[kWorkerB].potential_decode_blocks, 5u + 4u);
  EXPECT_EQ(by_worker[kWorkerB].potential_prefill_tokens, 24u);
  EXPECT_EQ(by_worker[kWorkerC].new_blocks, 6u);
  EXPECT_EQ(by_worker[kWorkerC].potential_decode_blocks, 6u);
}

TEST_F(ActiveSequencesTest, PotentialLoadWithRandomIdentitiesOrUntrackedPrefill) {
  const auto prompt = Chain(3, 0, 0);
  ASSERT_TRUE(Add("a", kWorkerA, prompt, 12).ok());
  std::vector<PotentialLoad> loads;
  active_.PotentialLoads(
      PotentialLoadQuery{.random_identities = true,
                         .num_blocks = 3,
                         .prompt_tokens = 12,
                         .track_prefill_tokens = false},
      [](size_t, WorkerKey) { return uint64_t{0}; }, loads);
  for (const auto& l : loads) {
    EXPECT_EQ(l.new_blocks, 3u) << "random identities are never shared";
    EXPECT_EQ(l.potential_prefill_tokens, l.current.active_prefill_tokens);
  }
}

// Found by replica_change_fuzzer: block ids from another replica are not necessarily sequence
// hashes (a buggy or hostile peer), so one id may follow two different prefixes. Matching a
// run by its last id then took [16, 13] for the run [X, 13], booked and released the wrong
// runs, and left blocks counted after every request was freed.
TEST_F(ActiveSequencesTest, ChainsThatAreNotPrefixHashesAreCountedRight) {
  ASSERT_TRUE(Add("a", kWorkerA, {11, 51539607552ULL, 13}).ok());
  ASSERT_TRUE(Add("b", kWorkerA, {11, 16, 13}).ok());
  ASSERT_TRUE(Add("c", kWorkerA, {11, 12}).ok());
  EXPECT_EQ(active_.TotalActiveBlocks(), 6u);  // 11, X, 13 | 16, 13 | 12
  EXPECT_EQ(active_.DistinctBlockIds(), 6u);
  for (const char* id : {"a", "b", "c"}) EXPECT_TRUE(active_.Free(id));
  EXPECT_EQ(active_.TotalActiveBlocks(), 0u);
  EXPECT_EQ(active_.DistinctBlockIds(), 0u);
}

TEST_F(ActiveSequencesTest, RemovingAWorkerDropsItsRequests) {
  ASSERT_TRUE(Add("a1", kWorkerA, Chain(2, 1, 1), 7).ok());
  ASSERT_TRUE(Add("a2", kWorkerA, Chain(2, 1, 2), 7).ok());
  ASSERT_TRUE(Add("b1", kWorkerB, Chain(2, 1, 1), 7).ok());
  EXPECT_EQ(active_.RemoveWorker(kWorkerA), 2u);
  EXPECT_FALSE(active_.HasWorker(kWorkerA));
  EXPECT_FALSE(active_.HasRequest("a1"));
  EXPECT_FALSE(active_.Free("a2"));
  EXPECT_TRUE(active_.HasRequest("b1"));
  EXPECT_EQ(active_.TotalActiveBlocks(), 3u);
  EXPECT_EQ(active_.RemoveWorker(kWorkerA), 0u);  // already gone: no error

  // A new worker reusing the slot starts empty.
  active_.AddWorker(WorkerKey{.worker_id = 9});
  EXPECT_EQ(active_.Load(WorkerKey{.worker_id = 9}).active_blocks, 0u);
  EXPECT_EQ(active_.Loads().size(), 3u);
}

TEST_F(ActiveSequencesTest, MemoryIsReclaimedAfterChurn) {
  for (int round = 0; round < 3; ++round) {
    for (uint32_t i = 0; i < 5000; ++i) {
      ASSERT_TRUE(
          Add("r" + std::to_string(i), i % 2 ? kWorkerA : kWorkerB, Chain(1, 8, i), 1).ok());
    }
    EXPECT_EQ(active_.DistinctBlockIds(), 1u + 5000u * 8u);
    for (uint32_t i = 0; i < 5000; ++i) EXPECT_TRUE(active_.Free("r" + std::to_string(i)));
    EXPECT_EQ(active_.num_requests(), 0u);
    EXPECT_EQ(active_.DistinctBlockIds(), 0u);
    EXPECT_EQ(active_.TotalActiveBlocks(), 0u);
  }
}

// Random bookings and frees of prompts drawn from a small tree of shared prefixes, checked
// against a brute-force model: distinct blocks per worker, and new blocks for a probe prompt.
TEST_F(ActiveSequencesTest, MatchesABruteForceModelUnderRandomChurn) {
  std::mt19937_64 rng(12345);
  const WorkerKey workers[] = {kWorkerA, kWorkerB, kWorkerC};
  std::vector<std::vector<uint64_t>> prompts;
  for (uint32_t shared = 0; shared <= 6; ++shared) {
    for (uint32_t own = 0; own <= 3; ++own)
      prompts.push_back(Chain(shared, own, shared * 10 + own));
  }
  struct Booked {
    WorkerKey worker;
    size_t prompt;
  };
  absl::flat_hash_map<std::string, Booked> live;
  auto brute_blocks = [&](WorkerKey w) {
    absl::flat_hash_set<uint64_t> held;
    for (const auto& [id, b] : live) {
      if (b.worker == w) held.insert(prompts[b.prompt].begin(), prompts[b.prompt].end());
    }
    return held;
  };
  for (int step = 0; step < 20000; ++step) {
    const std::string id = "r" + std::to_string(rng() % 60);
    if (live.contains(id)) {
      ASSERT_TRUE(active_.Free(id));
      live.erase(id);
    } else {
      const Booked b{workers[rng() % 3], rng() % prompts.size()};
      ASSERT_TRUE(Add(id, b.worker, prompts[b.prompt]).ok());
      live[id] = b;
    }
    if (step % 10 != 0) continue;
    absl::flat_hash_set<uint64_t> stored;
    for (const auto& [id, b] : live)
      stored.insert(prompts[b.prompt].begin(), prompts[b.prompt].end());
    ASSERT_EQ(active_.DistinctBlockIds(), stored.size()) << "step " << step;
    const auto& probe = prompts[rng() % prompts.size()];
    const auto loads = Potential(probe, probe.size() * kBlockSize);
    for (const auto& l : loads) {
      const auto held = brute_blocks(l.current.worker);
      ASSERT_EQ(l.current.active_blocks, held.size()) << "step " << step;
      size_t missing = 0;
      for (uint64_t h : probe) missing += held.contains(h) ? 0 : 1;
      ASSERT_EQ(l.new_blocks, missing) << "step " << step;
    }
  }
  for (const auto& [id, b] : live) ASSERT_TRUE(active_.Free(id));
  EXPECT_EQ(active_.TotalActiveBlocks(), 0u);
  EXPECT_EQ(active_.DistinctBlockIds(), 0u);
}

TEST(TrackingIdsTest, ChainOverLocalHashesLikeSequenceHashes) {
  const std::vector<uint64_t> local = {11, 22, 33, 44};
  std::vector<uint64_t> ids, prefix_ids, swapped_ids, other_ids;
  ComputeTrackingIdsInto(local, ids);
  ASSERT_EQ(ids.size(), 4u);
  // A prefix has the same identities as the longer prompt's leading blocks...
  ComputeTrackingIdsInto(std::vector<uint64_t>{11, 22}, prefix_ids);
  EXPECT_EQ(prefix_ids, (std::vector<uint64_t>{ids[0], ids[1]}));
  // ...while a block's identity depends on everything before it, order included.
  ComputeTrackingIdsInto(std::vector<uint64_t>{22, 11, 33, 44}, swapped_ids);
  ComputeTrackingIdsInto(std::vector<uint64_t>{11, 23, 33, 44}, other_ids);
  for (size_t i = 1; i < 4; ++i) {
    EXPECT_NE(ids[i], swapped_ids[i]);
    EXPECT_NE(ids[i], other_ids[i]);
  }
  EXPECT_EQ(ids[0], other_ids[0]);
  absl::flat_hash_set<uint64_t> distinct(ids.begin(), ids.end());
  EXPECT_EQ(distinct.size(), 4u);  // the same local hash at another depth is another block
  ComputeTrackingIdsInto({}, ids);
  EXPECT_TRUE(ids.empty());
}

}  // namespace
}  // namespace kvrouter

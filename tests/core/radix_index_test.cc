// Semantics of the radix-tree KV index (shared/reference/dynamo-router.md §2.1, §2.2, §2.6):
// dual keys, stored/removed/cleared events, tiers, errors, tree sizes and memory accounting.
#include "core/radix_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "core/hashing.h"
#include "core/types.h"
#include "index_model.h"
#include "test_data.h"

namespace kvrouter {
namespace {

using testing::ClearedWorker;
using testing::EventCount;
using testing::MatchesToString;
using testing::MatchOf;
using testing::RemovedBlocks;
using testing::StoredBlocks;
using testing::TierHits;

using Hits = std::array<uint32_t, 4>;

constexpr WorkerKey kW1{1, 0};
constexpr WorkerKey kW2{2, 0};
constexpr WorkerKey kW3{3, 0};
constexpr WorkerKey kW4{4, 0};

// Local hashes are small numbers, engine hashes are in the thousands, so that a mix-up of the two
// keys cannot go unnoticed.
constexpr uint64_t kA = 11, kB = 12, kC = 13, kD = 14, kE = 15, kF = 16, kG = 17, kX = 18;

// Device depth of `worker` for `query`, or -1 if the worker is not reported.
int DeviceDepth(const RadixIndex& index, const std::vector<uint64_t>& query, WorkerKey worker) {
  const auto m = MatchOf(index.FindMatches(query), worker);
  return m ? static_cast<int>(m->device_blocks) : -1;
}

KvEvent StoredTokens(WorkerKey worker, std::optional<uint64_t> parent,
                     std::vector<uint64_t> engine_hashes, std::vector<uint32_t> tokens,
                     Tier tier = Tier::kDevice) {
  StoredEvent stored;
  stored.parent_hash = parent;
  stored.block_hashes = std::move(engine_hashes);
  stored.token_ids = std::move(tokens);
  return KvEvent{.worker = worker, .tier = tier, .data = std::move(stored)};
}

std::vector<uint32_t> Iota(uint32_t first, uint32_t count) {
  std::vector<uint32_t> out(count);
  for (uint32_t i = 0; i < count; ++i) out[i] = first + i;
  return out;
}

// ---- Basics -------------------------------------------------------------------------------------

TEST(RadixIndexTest, EmptyIndexHoldsOnlyTheRoot) {
  RadixIndex index;
  EXPECT_EQ(index.block_size(), 16u);
  const IndexStats stats = index.Stats();
  EXPECT_EQ(stats.tree_blocks, 0u);
  EXPECT_EQ(stats.cached_blocks, 0u);
  EXPECT_EQ(stats.workers, 0u);
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{kA, kB}).empty());
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{}).empty());
  EXPECT_TRUE(index.Workers().empty());
  EXPECT_EQ(index.TreeSize(kW1), 0u);
  EXPECT_EQ(RadixIndex(RadixIndexOptions{.block_size = 4}).block_size(), 4u);
}

TEST(RadixIndexTest, StoredWithoutParentMatchesByLocalHash) {
  RadixIndex index;
  const ApplyResult r =
      index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002, 1003}, {kA, kB, kC}));
  EXPECT_TRUE(r.ok()) << r.message;
  EXPECT_TRUE(r.message.empty());

  auto matches = index.FindMatches(std::vector<uint64_t>{kA, kB, kC});
  ASSERT_EQ(matches.size(), 1u);
  EXPECT_EQ(matches[0].worker, kW1);
  EXPECT_EQ(TierHits(matches[0]), (Hits{3, 0, 0, 0}));
  EXPECT_EQ(matches[0].tree_size, 3u);

  EXPECT_EQ(DeviceDepth(index, {kA, kB}, kW1), 2);
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC, kD}, kW1), 3);
  EXPECT_EQ(DeviceDepth(index, {kA, kX, kC}, kW1), 1);
  // Matching starts at the root: a suffix of a stored path is no match, nor are engine hashes.
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{kB, kC}).empty());
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{1001, 1002, 1003}).empty());

  const IndexStats stats = index.Stats();
  EXPECT_EQ(stats.tree_blocks, 3u);
  EXPECT_EQ(stats.cached_blocks, 3u);
  EXPECT_EQ(stats.workers, 1u);
  EXPECT_EQ(EventCount(stats, EventKind::kStored, EventError::kNone), 1u);
  EXPECT_EQ(index.Workers(), std::vector<WorkerKey>{kW1});
}

TEST(RadixIndexTest, ParentIsFoundByEngineHash) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002}, {kA, kB})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1002, {1003}, {kC})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1003, {1004, 1005}, {kD, kE})).ok());
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC, kD, kE}, kW1), 5);
  EXPECT_EQ(index.TreeSize(kW1), 5u);
  EXPECT_EQ(index.Stats().tree_blocks, 5u);

  // A child under a middle block branches there.
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1002, {1013}, {kX})).ok());
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kX}, kW1), 3);
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC, kD, kE}, kW1), 5);
  EXPECT_EQ(index.Stats().tree_blocks, 6u);

  // A local hash is not a parent key.
  const ApplyResult r = index.Apply(StoredBlocks(kW1, kB, {1020}, {kF}));
  EXPECT_EQ(r.error, EventError::kParentBlockNotFound);
  EXPECT_EQ(index.TreeSize(kW1), 6u);
}

TEST(RadixIndexTest, WorkersWithDifferentEngineHashesShareNodes) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002, 1003}, {kA, kB, kC})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, std::nullopt, {2001}, {kA})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, 2001, {2002, 2003}, {kB, kC})).ok());
  EXPECT_EQ(index.Stats().tree_blocks, 3u);
  EXPECT_EQ(index.Stats().cached_blocks, 6u);
  EXPECT_EQ(MatchesToString(index.FindMatches(std::vector<uint64_t>{kA, kB, kC})),
            "1/0:d3,h0,s0,e0,t3;2/0:d3,h0,s0,e0,t3;");

  // Engine hashes are per worker: W1's hashes mean nothing for W2.
  EXPECT_EQ(index.Apply(RemovedBlocks(kW2, {1002})).error, EventError::kBlockNotFound);
  EXPECT_EQ(index.Apply(StoredBlocks(kW2, 1003, {2004}, {kD})).error,
            EventError::kParentBlockNotFound);
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC}, kW2), 3);

  ASSERT_TRUE(index.Apply(RemovedBlocks(kW2, {2002})).ok());
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC}, kW2), 1);
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC}, kW1), 3);
  EXPECT_EQ(index.Stats().tree_blocks, 3u);
}

TEST(RadixIndexTest, SameDpRankKeysAreDistinctWorkers) {
  RadixIndex index;
  const WorkerKey r0{7, 0}, r1{7, 1};
  ASSERT_TRUE(index.Apply(StoredBlocks(r0, std::nullopt, {1001, 1002}, {kA, kB})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(r1, std::nullopt, {1001}, {kA})).ok());
  EXPECT_EQ(MatchesToString(index.FindMatches(std::vector<uint64_t>{kA, kB})),
            "7/0:d2,h0,s0,e0,t2;7/1:d1,h0,s0,e0,t1;");
  // Rank 1 does not know rank 0's block 1002.
  EXPECT_EQ(index.Apply(StoredBlocks(r1, 1002, {1003}, {kC})).error,
            EventError::kParentBlockNotFound);
}

TEST(RadixIndexTest, FindMatchesClearsTheOutputVector) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001}, {kA})).ok());
  std::vector<WorkerMatch> out(5);
  index.FindMatches(std::vector<uint64_t>{kA}, out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].worker, kW1);
  index.FindMatches(std::vector<uint64_t>{kB}, out);
  EXPECT_TRUE(out.empty());
}

// ---- Token ids hashed by the index
// ----------------------------------------------------------------

TEST(RadixIndexTest, TokenIdsHashLikePrecomputedLocalHashes) {
  RadixIndex index(RadixIndexOptions{.block_size = 4});
  const std::vector<std::vector<uint64_t>> mm1 = {{}, {42, 7}};
  const std::vector<std::vector<uint64_t>> mm2 = {{9}};
  const std::vector<uint32_t> tokens1 = Iota(100, 12);      // 3 blocks
  const std::vector<uint32_t> tokens2_full = Iota(500, 4);  // 1 block

  // W1 sends token ids (with LoRA, namespace and multimodal hashes); W2 the same blocks hashed.
  KvEvent e1 = StoredTokens(kW1, std::nullopt, {1001, 1002, 1003}, tokens1);
  auto& s1 = std::get<StoredEvent>(e1.data);
  s1.lora_name = "adapter-a";
  s1.cache_namespace = "tenant-1";
  s1.block_mm_hashes = mm1;
  ASSERT_TRUE(index.Apply(e1).ok());
  KvEvent e2 = StoredTokens(kW1, 1003, {1004}, tokens2_full);
  auto& s2 = std::get<StoredEvent>(e2.data);
  s2.lora_name = "adapter-a";
  s2.cache_namespace = "tenant-1";
  s2.block_mm_hashes = mm2;
  ASSERT_TRUE(index.Apply(e2).ok());

  const auto local1 = ComputeLocalBlockHashes(
      tokens1, 4,
      {.lora_name = "adapter-a", .cache_namespace = "tenant-1", .block_mm_hashes = mm1});
  const auto local2 = ComputeLocalBlockHashes(
      tokens2_full, 4,
      {.lora_name = "adapter-a", .cache_namespace = "tenant-1", .block_mm_hashes = mm2});
  ASSERT_EQ(local1.size(), 3u);
  ASSERT_EQ(local2.size(), 1u);
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, std::nullopt, {2001, 2002, 2003}, local1)).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, 2003, {2004}, local2)).ok());

  std::vector<uint64_t> query = local1;
  query.push_back(local2[0]);
  EXPECT_EQ(MatchesToString(index.FindMatches(query)), "1/0:d4,h0,s0,e0,t4;2/0:d4,h0,s0,e0,t4;");
  EXPECT_EQ(index.Stats().tree_blocks, 4u);

  // Each option changes the hashes: without them the blocks are different.
  EXPECT_TRUE(index.FindMatches(ComputeLocalBlockHashes(tokens1, 4)).empty());
  EXPECT_TRUE(index
                  .FindMatches(ComputeLocalBlockHashes(
                      tokens1, 4, {.lora_name = "adapter-a", .block_mm_hashes = mm1}))
                  .empty());
  const auto no_mm = ComputeLocalBlockHashes(
      tokens1, 4, {.lora_name = "adapter-a", .cache_namespace = "tenant-1"});
  EXPECT_EQ(DeviceDepth(index, no_mm, kW1), 1);  // block 1 carries the multimodal hashes
}

TEST(RadixIndexTest, TokenIdsUseTheIndexBlockSize) {
  RadixIndex index(RadixIndexOptions{.block_size = 8});
  const std::vector<uint32_t> tokens = Iota(1, 16);
  ASSERT_TRUE(index.Apply(StoredTokens(kW1, std::nullopt, {1001, 1002}, tokens)).ok());
  EXPECT_EQ(DeviceDepth(index, ComputeLocalBlockHashes(tokens, 8), kW1), 2);
  EXPECT_TRUE(index.FindMatches(ComputeLocalBlockHashes(tokens, 16)).empty());
  EXPECT_TRUE(index.FindMatches(ComputeLocalBlockHashes(tokens, 4)).empty());
}

TEST(RadixIndexTest, EagleTokenIdsSingleBlock) {
  RadixIndex index(RadixIndexOptions{.block_size = 4});
  const std::vector<uint32_t> tokens = Iota(10, 5);  // one eagle block: 4 + 1 tokens
  KvEvent e = StoredTokens(kW1, std::nullopt, {1001}, tokens);
  std::get<StoredEvent>(e.data).eagle = true;
  ASSERT_TRUE(index.Apply(e).ok());
  const auto local = ComputeLocalBlockHashes(tokens, 4, {.eagle = true});
  ASSERT_EQ(local.size(), 1u);
  EXPECT_EQ(DeviceDepth(index, local, kW1), 1);
  EXPECT_TRUE(index.FindMatches(ComputeLocalBlockHashes(tokens, 4)).empty());
}

TEST(RadixIndexTest, EagleTokenIdsSeveralBlocks) {
  // Eagle blocks start every block_size tokens and see one token more (hashing.h): three blocks
  // of size 4 take 13 tokens.
  RadixIndex index(RadixIndexOptions{.block_size = 4});
  const std::vector<uint32_t> tokens = Iota(10, 13);
  KvEvent e = StoredTokens(kW1, std::nullopt, {1001, 1002, 1003}, tokens);
  std::get<StoredEvent>(e.data).eagle = true;
  const ApplyResult r = index.Apply(e);
  EXPECT_TRUE(r.ok()) << r.message;
  const auto local = ComputeLocalBlockHashes(tokens, 4, {.eagle = true});
  ASSERT_EQ(local.size(), 3u);
  EXPECT_EQ(DeviceDepth(index, local, kW1), 3);
}

// ---- Removed, cleared, remove worker
// ---------------------------------------------------------------

TEST(RadixIndexTest, RemovingAMiddleBlockDoesNotCascade) {
  RadixIndex index;
  ASSERT_TRUE(
      index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002, 1003, 1004}, {kA, kB, kC, kD}))
          .ok());
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1002})).ok());
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC, kD}, kW1), 1);  // depth stops at the gap
  EXPECT_EQ(index.TreeSize(kW1), 3u);                       // descendants still held
  EXPECT_EQ(index.Stats().cached_blocks, 3u);
  EXPECT_EQ(index.Stats().tree_blocks, 4u);  // the gap node keeps its children

  // The descendants are still known: they can be parents and can be removed.
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1004, {1005}, {kE})).ok());
  EXPECT_EQ(index.TreeSize(kW1), 4u);

  // Filling the gap again restores the whole depth.
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1001, {1002}, {kB})).ok());
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC, kD, kE}, kW1), 5);
  EXPECT_EQ(index.Stats().tree_blocks, 5u);

  // Removing the first block hides the worker from the prompt entirely.
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1001})).ok());
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC, kD, kE}, kW1), -1);
  EXPECT_EQ(index.TreeSize(kW1), 4u);
}

TEST(RadixIndexTest, NodesNoWorkerHoldsAreFreedAtOnce) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002, 1003}, {kA, kB, kC})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, std::nullopt, {2001, 2002}, {kA, kB})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, 2001, {2005}, {kX})).ok());
  EXPECT_EQ(index.Stats().tree_blocks, 4u);

  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1003})).ok());  // leaf only W1 holds
  EXPECT_EQ(index.Stats().tree_blocks, 3u);
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW2, {2005})).ok());
  EXPECT_EQ(index.Stats().tree_blocks, 2u);
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1001})).ok());  // W2 still holds A
  EXPECT_EQ(index.Stats().tree_blocks, 2u);
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW2, {2001, 2002})).ok());
  // A is held by nobody but B (held by W1) hangs below it.
  EXPECT_EQ(index.Stats().tree_blocks, 2u);
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{kA, kB}).empty());
  // Freeing B frees its empty ancestor A too.
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1002})).ok());
  EXPECT_EQ(index.Stats().tree_blocks, 0u);
  EXPECT_EQ(index.Stats().cached_blocks, 0u);
  EXPECT_EQ(index.TreeSize(kW1), 0u);
  EXPECT_EQ(index.TreeSize(kW2), 0u);
}

TEST(RadixIndexTest, ClearedClearsOnlyThePublishingDpRank) {
  RadixIndex index;
  const WorkerKey r0{1, 0}, r1{1, 1}, other{2, 0};
  ASSERT_TRUE(index.Apply(StoredBlocks(r0, std::nullopt, {1001, 1002}, {kA, kB})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(r1, std::nullopt, {1101}, {kC})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(r1, 1101, {1102}, {kD}, Tier::kHostPinned)).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(other, std::nullopt, {2001}, {kA})).ok());
  EXPECT_EQ(index.Stats().tree_blocks, 4u);

  const ApplyResult r = index.Apply(ClearedWorker(r1));
  EXPECT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(index.TreeSize(r0), 2u);
  EXPECT_EQ(index.TreeSize(r1), 0u);
  EXPECT_EQ(index.TreeSize(other), 1u);
  EXPECT_EQ(MatchesToString(index.FindMatches(std::vector<uint64_t>{kA, kB})),
            "1/0:d2,h0,s0,e0,t2;2/0:d1,h0,s0,e0,t1;");
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{kC, kD}).empty());
  EXPECT_EQ(index.Stats().tree_blocks, 2u);
  EXPECT_EQ(index.Stats().cached_blocks, 3u);
  EXPECT_EQ(EventCount(index.Stats(), EventKind::kCleared, EventError::kNone), 1u);

  // The ranks stay known, empty.
  const auto workers = index.Workers();
  EXPECT_EQ(std::set<WorkerKey>(workers.begin(), workers.end()),
            (std::set<WorkerKey>{r0, r1, other}));
  EXPECT_EQ(index.Stats().workers, 3u);

  // The cleared rank's old hashes are gone; it stores again from the root. The other rank
  // still continues its own.
  EXPECT_EQ(index.Apply(StoredBlocks(r1, 1101, {1103}, {kX})).error,
            EventError::kParentBlockNotFound);
  ASSERT_TRUE(index.Apply(StoredBlocks(r1, std::nullopt, {1101}, {kC})).ok());
  EXPECT_EQ(DeviceDepth(index, {kC, kD}, r1), 1);
  ASSERT_TRUE(index.Apply(StoredBlocks(r0, 1002, {1003}, {kX})).ok());
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kX}, r0), 3);
}

TEST(RadixIndexTest, RemoveWorkerAndRemoveWorkerDpRank) {
  RadixIndex index;
  const WorkerKey r0{1, 0}, r1{1, 1}, other{2, 0};
  ASSERT_TRUE(index.Apply(StoredBlocks(r0, std::nullopt, {1001, 1002}, {kA, kB})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(r1, std::nullopt, {1101, 1102, 1103}, {kA, kB, kC})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(other, std::nullopt, {2001}, {kA})).ok());

  EXPECT_EQ(index.RemoveWorkerDpRank(r1), 3u);
  EXPECT_EQ(index.TreeSize(r1), 0u);
  EXPECT_EQ(index.TreeSize(r0), 2u);
  EXPECT_EQ(index.Stats().tree_blocks, 2u);  // C was only r1's
  EXPECT_EQ(MatchesToString(index.FindMatches(std::vector<uint64_t>{kA, kB, kC})),
            "1/0:d2,h0,s0,e0,t2;2/0:d1,h0,s0,e0,t1;");
  auto workers = index.Workers();
  EXPECT_EQ(std::set<WorkerKey>(workers.begin(), workers.end()), (std::set<WorkerKey>{r0, other}));

  ASSERT_TRUE(index.Apply(StoredBlocks(r1, std::nullopt, {1101}, {kA})).ok());
  EXPECT_EQ(index.RemoveWorker(1), 3u);  // both ranks: 2 + 1 blocks
  workers = index.Workers();
  EXPECT_EQ(workers, std::vector<WorkerKey>{other});
  EXPECT_EQ(index.Stats().workers, 1u);
  EXPECT_EQ(index.Stats().tree_blocks, 1u);
  EXPECT_EQ(MatchesToString(index.FindMatches(std::vector<uint64_t>{kA, kB})),
            "2/0:d1,h0,s0,e0,t1;");
  EXPECT_EQ(index.RemoveWorker(1), 0u);
  EXPECT_EQ(index.RemoveWorker(99), 0u);
  EXPECT_EQ(index.RemoveWorkerDpRank({2, 5}), 0u);
  EXPECT_EQ(index.TreeSize(other), 1u);
}

TEST(RadixIndexTest, DuplicateStoreIsCountedAndHeldOnce) {
  RadixIndex index;
  const KvEvent e = StoredBlocks(kW1, std::nullopt, {1001, 1002}, {kA, kB});
  ASSERT_TRUE(index.Apply(e).ok());
  EXPECT_TRUE(index.Apply(e).ok());
  EXPECT_EQ(index.Stats().duplicate_stores, 2u);
  EXPECT_EQ(index.TreeSize(kW1), 2u);
  EXPECT_EQ(index.Stats().cached_blocks, 2u);
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1001, 1002})).ok());
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{kA, kB}).empty());
  EXPECT_EQ(index.Stats().tree_blocks, 0u);
}

TEST(RadixIndexTest, TwoEngineBlocksOfOneWorkerOnOneNodeAreCounted) {
  // Two engine blocks of the same worker can name the same prefix (the node keeps a count):
  // the worker holds the node until both are removed.
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001}, {kA})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1901}, {kA})).ok());
  EXPECT_EQ(index.TreeSize(kW1), 2u);
  EXPECT_EQ(index.Stats().tree_blocks, 1u);
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1001})).ok());
  EXPECT_EQ(DeviceDepth(index, {kA}, kW1), 1);
  EXPECT_EQ(index.Stats().tree_blocks, 1u);
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1901})).ok());
  EXPECT_EQ(DeviceDepth(index, {kA}, kW1), -1);
  EXPECT_EQ(index.Stats().tree_blocks, 0u);
}

// ---- Per-worker depths --------------------------------------------------------------------------

TEST(RadixIndexTest, WorkersSharingAPrefixGetTheirOwnDepths) {
  RadixIndex index;
  ASSERT_TRUE(
      index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002, 1003, 1004}, {kA, kB, kC, kD}))
          .ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, std::nullopt, {2001, 2002}, {kA, kB})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW3, std::nullopt, {3001, 3002, 3003}, {kA, kB, kX})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW4, std::nullopt, {4001}, {kA})).ok());
  EXPECT_EQ(index.Stats().tree_blocks, 5u);

  EXPECT_EQ(MatchesToString(index.FindMatches(std::vector<uint64_t>{kA, kB, kC, kD, kE})),
            "1/0:d4,h0,s0,e0,t4;2/0:d2,h0,s0,e0,t2;3/0:d2,h0,s0,e0,t3;4/0:d1,h0,s0,e0,t1;");
  EXPECT_EQ(MatchesToString(index.FindMatches(std::vector<uint64_t>{kA, kB, kX})),
            "1/0:d2,h0,s0,e0,t4;2/0:d2,h0,s0,e0,t2;3/0:d3,h0,s0,e0,t3;4/0:d1,h0,s0,e0,t1;");
  EXPECT_EQ(MatchesToString(index.FindMatches(std::vector<uint64_t>{kA})),
            "1/0:d1,h0,s0,e0,t4;2/0:d1,h0,s0,e0,t2;3/0:d1,h0,s0,e0,t3;4/0:d1,h0,s0,e0,t1;");
  EXPECT_EQ(index.TreeSize(kW1), 4u);
  EXPECT_EQ(index.TreeSize(kW3), 3u);
  EXPECT_EQ(index.Stats().cached_blocks, 10u);
}

TEST(RadixIndexTest, ChildWithoutItsParentDoesNotMatchPastTheParent) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002, 1003}, {kA, kB, kC})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, std::nullopt, {2001, 2002, 2003}, {kA, kB, kC})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW3, std::nullopt, {3001, 3002, 3003}, {kA, kB, kC})).ok());
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW2, {2001})).ok());  // holds B, C but not A
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW3, {3002})).ok());  // holds A, C but not B
  EXPECT_EQ(MatchesToString(index.FindMatches(std::vector<uint64_t>{kA, kB, kC})),
            "1/0:d3,h0,s0,e0,t3;3/0:d1,h0,s0,e0,t2;");
  EXPECT_EQ(index.TreeSize(kW2), 2u);
}

// ---- Tiers
// ----------------------------------------------------------------------------------------

TEST(RadixIndexTest, LowerTiersContinueAfterTheDevicePrefix) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002, 1003}, {kA, kB, kC})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1003, {1004, 1005}, {kD, kE}, Tier::kHostPinned)).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1005, {1006}, {kF}, Tier::kDisk)).ok());
  const std::vector<uint64_t> query = {kA, kB, kC, kD, kE, kF, kG};
  auto m = MatchOf(index.FindMatches(query), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{3, 2, 1, 0}));

  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1006, {1007}, {kG}, Tier::kExternal)).ok());
  m = MatchOf(index.FindMatches(query), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{3, 2, 1, 1}));
  EXPECT_EQ(m->tree_size, 7u);

  // Shorter queries cut the lower-tier runs.
  m = MatchOf(index.FindMatches(std::vector<uint64_t>{kA, kB, kC, kD}), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{3, 1, 0, 0}));
  m = MatchOf(index.FindMatches(std::vector<uint64_t>{kA, kB}), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{2, 0, 0, 0}));
}

TEST(RadixIndexTest, OffloadedBlocksCountOnLowerTiersOnceEvictedFromDevice) {
  RadixIndex index;
  const std::vector<uint64_t> engine = {1001, 1002, 1003, 1004, 1005, 1006};
  const std::vector<uint64_t> local = {kA, kB, kC, kD, kE, kF};
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, engine, local)).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1003, {1004, 1005}, {kD, kE}, Tier::kHostPinned)).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1005, {1006}, {kF}, Tier::kDisk)).ok());
  // Still all on the device: the device prefix covers everything.
  auto m = MatchOf(index.FindMatches(local), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{6, 0, 0, 0}));

  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1004, 1005, 1006})).ok());
  m = MatchOf(index.FindMatches(local), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{3, 2, 1, 0}));
  EXPECT_EQ(index.Stats().tree_blocks, 6u);

  // Disk eviction of the last block frees its node.
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1006}, Tier::kDisk)).ok());
  m = MatchOf(index.FindMatches(local), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{3, 2, 0, 0}));
  EXPECT_EQ(index.Stats().tree_blocks, 5u);
}

TEST(RadixIndexTest, WorkerOnlyOnLowerTiersFromTheRoot) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001}, {kA})).ok());
  ASSERT_TRUE(index
                  .Apply(StoredBlocks(kW2, std::nullopt, {2001, 2002, 2003}, {kA, kB, kC},
                                      Tier::kHostPinned))
                  .ok());
  ASSERT_TRUE(
      index.Apply(StoredBlocks(kW3, std::nullopt, {3001, 3002}, {kA, kB}, Tier::kDisk)).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW4, std::nullopt, {4001}, {kA}, Tier::kExternal)).ok());
  EXPECT_EQ(MatchesToString(index.FindMatches(std::vector<uint64_t>{kA, kB, kC, kD})),
            "1/0:d1,h0,s0,e0,t1;2/0:d0,h3,s0,e0,t3;3/0:d0,h0,s2,e0,t2;4/0:d0,h0,s0,e1,t1;");
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{kB, kC}).empty());
}

TEST(RadixIndexTest, LowerTierRunsAreContiguousAndTiersCanBeSkipped) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002}, {kA, kB})).ok());
  // No host blocks: disk continues right after the device prefix.
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1002, {1003}, {kC}, Tier::kDisk)).ok());
  auto m = MatchOf(index.FindMatches(std::vector<uint64_t>{kA, kB, kC, kD}), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{2, 0, 1, 0}));

  // W2: device A, B; host C, D, then C evicted from host: D alone is not contiguous.
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, std::nullopt, {2001, 2002}, {kA, kB})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, 2002, {2003, 2004}, {kC, kD}, Tier::kHostPinned)).ok());
  m = MatchOf(index.FindMatches(std::vector<uint64_t>{kA, kB, kC, kD}), kW2);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{2, 2, 0, 0}));
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW2, {2003}, Tier::kHostPinned)).ok());
  m = MatchOf(index.FindMatches(std::vector<uint64_t>{kA, kB, kC, kD}), kW2);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{2, 0, 0, 0}));
}

TEST(RadixIndexTest, SameEngineHashOnTwoTiers) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002}, {kA, kB})).ok());
  ASSERT_TRUE(
      index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002}, {kA, kB}, Tier::kHostPinned)).ok());
  const std::vector<uint64_t> query = {kA, kB};
  auto m = MatchOf(index.FindMatches(query), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{2, 0, 0, 0}));
  EXPECT_EQ(index.Stats().tree_blocks, 2u);

  // A removal names one tier: the other copy stays.
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1002})).ok());
  m = MatchOf(index.FindMatches(query), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{1, 1, 0, 0}));
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1001})).ok());
  m = MatchOf(index.FindMatches(query), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{0, 2, 0, 0}));
  EXPECT_EQ(index.Stats().tree_blocks, 2u);

  // Gone from the device already: unknown there.
  EXPECT_EQ(index.Apply(RemovedBlocks(kW1, {1001})).error, EventError::kBlockNotFound);
  // The host copy still serves as a parent.
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1002, {1003}, {kC})).ok());
  m = MatchOf(index.FindMatches(std::vector<uint64_t>{kA, kB, kC}), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{0, 2, 0, 0}));

  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1003})).ok());
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1001, 1002}, Tier::kHostPinned)).ok());
  EXPECT_TRUE(index.FindMatches(query).empty());
  EXPECT_EQ(index.Stats().tree_blocks, 0u);
  EXPECT_EQ(index.Stats().cached_blocks, 0u);
  EXPECT_EQ(index.TreeSize(kW1), 0u);
}

TEST(RadixIndexTest, RemovalOnATierThatDoesNotHoldTheBlock) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001}, {kA})).ok());
  EXPECT_EQ(index.Apply(RemovedBlocks(kW1, {1001}, Tier::kDisk)).error, EventError::kBlockNotFound);
  EXPECT_EQ(DeviceDepth(index, {kA}, kW1), 1);
  EXPECT_EQ(index.TreeSize(kW1), 1u);
}

TEST(RadixIndexTest, ClearedDropsEveryTier) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001}, {kA})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1001, {1002}, {kB}, Tier::kHostPinned)).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1002, {1003}, {kC}, Tier::kDisk)).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1003, {1004}, {kD}, Tier::kExternal)).ok());
  ASSERT_TRUE(index.Apply(ClearedWorker(kW1)).ok());
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{kA, kB, kC, kD}).empty());
  EXPECT_EQ(index.TreeSize(kW1), 0u);
  EXPECT_EQ(index.Stats().tree_blocks, 0u);
  EXPECT_EQ(index.Stats().cached_blocks, 0u);
}

TEST(RadixIndexTest, TierFromMediumMapping) {
  EXPECT_EQ(TierFromMedium("GPU"), Tier::kDevice);
  EXPECT_EQ(TierFromMedium("DEVICE"), Tier::kDevice);
  EXPECT_EQ(TierFromMedium("gpu"), Tier::kDevice);
  EXPECT_EQ(TierFromMedium("CPU_PINNED"), Tier::kHostPinned);
  EXPECT_EQ(TierFromMedium("cpu_pinned"), Tier::kHostPinned);
  EXPECT_EQ(TierFromMedium("CPU_TIER1"), Tier::kHostPinned);
  EXPECT_EQ(TierFromMedium("CPU_TIER2"), Tier::kDisk);
  EXPECT_EQ(TierFromMedium("Disk"), Tier::kDisk);
  EXPECT_EQ(TierFromMedium("NVME"), Tier::kDisk);
  EXPECT_EQ(TierFromMedium("EXTERNAL"), Tier::kExternal);
  EXPECT_EQ(TierFromMedium("network"), Tier::kExternal);
  EXPECT_EQ(TierFromMedium("REMOTE"), Tier::kExternal);
  EXPECT_EQ(TierFromMedium("Shared"), Tier::kExternal);
  EXPECT_EQ(TierFromMedium(""), Tier::kDevice);
  // vLLM's offloading connector ("CPU") and tiered offloading ("STORAGE", "SHARED_STORAGE").
  EXPECT_EQ(TierFromMedium("CPU"), Tier::kHostPinned);
  EXPECT_EQ(TierFromMedium("STORAGE"), Tier::kDisk);
  EXPECT_EQ(TierFromMedium("SHARED_STORAGE"), Tier::kExternal);
  EXPECT_EQ(TierFromMedium("tape"), Tier::kDevice);
  EXPECT_EQ(TierName(Tier::kHostPinned), "host_pinned");
}

// ---- Errors -------------------------------------------------------------------------------------

TEST(RadixIndexTest, MissingParentDropsTheWholeStoredEvent) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW2, std::nullopt, {999}, {kA})).ok());
  const auto before = index.Stats();
  // 999 is W2's block, not W1's.
  const ApplyResult r = index.Apply(StoredBlocks(kW1, 999, {1001, 1002}, {kB, kC}));
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.error, EventError::kParentBlockNotFound);
  EXPECT_FALSE(r.message.empty());
  const auto after = index.Stats();
  EXPECT_EQ(after.tree_blocks, before.tree_blocks);
  EXPECT_EQ(after.cached_blocks, before.cached_blocks);
  EXPECT_EQ(index.TreeSize(kW1), 0u);
  EXPECT_TRUE(index.FindMatches(std::vector<uint64_t>{kB, kC}).empty());
  EXPECT_EQ(EventCount(after, EventKind::kStored, EventError::kParentBlockNotFound), 1u);
  EXPECT_EQ(EventCount(after, EventKind::kStored, EventError::kNone), 1u);
  // The dropped blocks are unknown: they are no parents.
  EXPECT_EQ(index.Apply(StoredBlocks(kW1, 1002, {1003}, {kD})).error,
            EventError::kParentBlockNotFound);
  EXPECT_EQ(EventCount(index.Stats(), EventKind::kStored, EventError::kParentBlockNotFound), 2u);
}

TEST(RadixIndexTest, UnknownRemovedHashStillRemovesTheOthers) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002, 1003}, {kA, kB, kC})).ok());
  const ApplyResult r = index.Apply(RemovedBlocks(kW1, {1003, 4242, 1002}));
  EXPECT_EQ(r.error, EventError::kBlockNotFound);
  EXPECT_FALSE(r.message.empty());
  EXPECT_EQ(index.TreeSize(kW1), 1u);
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC}, kW1), 1);
  const auto stats = index.Stats();
  EXPECT_EQ(stats.tree_blocks, 1u);
  EXPECT_EQ(EventCount(stats, EventKind::kRemoved, EventError::kBlockNotFound), 1u);
  EXPECT_EQ(EventCount(stats, EventKind::kRemoved, EventError::kNone), 0u);
}

TEST(RadixIndexTest, RepeatedEngineHashIsAnInvalidBlockSequence) {
  RadixIndex index;
  // Repeats an earlier block of the same event: the two blocks before it are applied.
  ApplyResult r =
      index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002, 1001, 1004}, {kA, kB, kC, kD}));
  EXPECT_EQ(r.error, EventError::kInvalidBlockSequence);
  EXPECT_FALSE(r.message.empty());
  EXPECT_EQ(index.TreeSize(kW1), 2u);
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC, kD}, kW1), 2);
  EXPECT_EQ(index.Stats().tree_blocks, 2u);

  // Repeats its direct parent inside the event.
  r = index.Apply(StoredBlocks(kW2, std::nullopt, {2001, 2002, 2002}, {kA, kB, kC}));
  EXPECT_EQ(r.error, EventError::kInvalidBlockSequence);
  EXPECT_EQ(index.TreeSize(kW2), 2u);
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC}, kW2), 2);

  // Repeats the event's parent: nothing applied.
  r = index.Apply(StoredBlocks(kW3, std::nullopt, {3001}, {kA}));
  ASSERT_TRUE(r.ok());
  r = index.Apply(StoredBlocks(kW3, 3001, {3001, 3002}, {kB, kC}));
  EXPECT_EQ(r.error, EventError::kInvalidBlockSequence);
  EXPECT_EQ(index.TreeSize(kW3), 1u);
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC}, kW3), 1);
  EXPECT_EQ(index.Stats().tree_blocks, 2u);

  EXPECT_EQ(EventCount(index.Stats(), EventKind::kStored, EventError::kInvalidBlockSequence), 3u);
  EXPECT_EQ(EventCount(index.Stats(), EventKind::kStored, EventError::kNone), 1u);
}

TEST(RadixIndexTest, IncompleteTokenBlocksAreInvalid) {
  RadixIndex index(RadixIndexOptions{.block_size = 4});
  const std::vector<uint32_t> tokens = Iota(1, 10);  // 2 complete blocks, 3 block hashes
  const ApplyResult r = index.Apply(StoredTokens(kW1, std::nullopt, {1001, 1002, 1003}, tokens));
  EXPECT_EQ(r.error, EventError::kInvalidBlock);
  EXPECT_FALSE(r.message.empty());
  EXPECT_EQ(index.TreeSize(kW1), 2u);
  const auto local = ComputeLocalBlockHashes(tokens, 4);
  ASSERT_EQ(local.size(), 2u);
  EXPECT_EQ(DeviceDepth(index, local, kW1), 2);
  EXPECT_EQ(index.Stats().tree_blocks, 2u);
  EXPECT_EQ(index.Apply(StoredBlocks(kW1, 1003, {1004}, {kD})).error,
            EventError::kParentBlockNotFound);

  // No tokens and no local hashes at all: a copy of blocks the worker holds (below), and W2
  // holds none.
  EXPECT_EQ(index.Apply(StoredTokens(kW2, std::nullopt, {2001}, {})).error,
            EventError::kBlockNotFound);
  EXPECT_EQ(index.TreeSize(kW2), 0u);
  EXPECT_EQ(EventCount(index.Stats(), EventKind::kStored, EventError::kInvalidBlock), 1u);
  // With a parent but no tokens, nothing can be placed.
  EXPECT_EQ(index.Apply(StoredTokens(kW1, 1001, {1002}, {})).error, EventError::kInvalidBlock);
}

// vLLM's offloading connector names the blocks it copied to the CPU by engine hash alone (no
// tokens, no parent): they join the tier of the copy where the worker holds them. The copies
// come and go on their own tier; the device keeps its blocks throughout.
TEST(RadixIndexTest, StoreWithoutTokensCopiesHeldBlocksToItsTier) {
  RadixIndex index(RadixIndexOptions{.block_size = 4});
  const std::vector<uint32_t> tokens = Iota(1, 12);
  const auto local = ComputeLocalBlockHashes(tokens, 4);
  ASSERT_TRUE(index.Apply(StoredTokens(kW1, std::nullopt, {1001, 1002, 1003}, tokens)).ok());
  ASSERT_TRUE(
      index.Apply(StoredTokens(kW1, std::nullopt, {1001, 1002}, {}, Tier::kHostPinned)).ok());
  auto m = MatchOf(index.FindMatches(local), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{3, 0, 0, 0}));
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1001, 1002}, Tier::kHostPinned)).ok());
  m = MatchOf(index.FindMatches(local), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{3, 0, 0, 0}));
  EXPECT_EQ(index.TreeSize(kW1), 3u);

  // Copied again, then evicted from the device: the copies serve from the host tier.
  ASSERT_TRUE(
      index.Apply(StoredTokens(kW1, std::nullopt, {1001, 1002, 1003}, {}, Tier::kHostPinned)).ok());
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1002, 1003})).ok());
  m = MatchOf(index.FindMatches(local), kW1);
  ASSERT_TRUE(m);
  EXPECT_EQ(TierHits(*m), (Hits{1, 2, 0, 0}));
  // A hash the worker does not hold is reported; the others are still copied.
  EXPECT_EQ(index.Apply(StoredTokens(kW1, std::nullopt, {1001, 9999}, {}, Tier::kDisk)).error,
            EventError::kBlockNotFound);
  EXPECT_EQ(index.CheckInvariants(), "");
}

TEST(RadixIndexTest, ShortLocalHashListIsInvalid) {
  RadixIndex index;
  const ApplyResult r = index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002, 1003}, {kA, kB}));
  EXPECT_EQ(r.error, EventError::kInvalidBlock);
  EXPECT_EQ(index.TreeSize(kW1), 2u);
  EXPECT_EQ(DeviceDepth(index, {kA, kB, kC}, kW1), 2);
  EXPECT_EQ(EventCount(index.Stats(), EventKind::kStored, EventError::kInvalidBlock), 1u);
}

TEST(RadixIndexTest, ErrorsAreCountedPerKindAndReason) {
  RadixIndex index;
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, std::nullopt, {1001, 1002}, {kA, kB})).ok());
  ASSERT_TRUE(index.Apply(StoredBlocks(kW1, 1002, {1003}, {kC})).ok());
  EXPECT_FALSE(index.Apply(StoredBlocks(kW1, 5555, {1004}, {kD})).ok());
  EXPECT_FALSE(index.Apply(RemovedBlocks(kW1, {5555})).ok());
  EXPECT_FALSE(index.Apply(RemovedBlocks(kW1, {6666})).ok());
  ASSERT_TRUE(index.Apply(RemovedBlocks(kW1, {1003})).ok());
  ASSERT_TRUE(index.Apply(ClearedWorker(kW1)).ok());
  const IndexStats s = index.Stats();
  EXPECT_EQ(EventCount(s, EventKind::kStored, EventError::kNone), 2u);
  EXPECT_EQ(EventCount(s, EventKind::kStored, EventError::kParentBlockNotFound), 1u);
  EXPECT_EQ(EventCount(s, EventKind::kRemoved, EventError::kNone), 1u);
  EXPECT_EQ(EventCount(s, EventKind::kRemoved, EventError::kBlockNotFound), 2u);
  EXPECT_EQ(EventCount(s, EventKind::kCleared, EventError::kNone), 1u);
  uint64_t total = 0;
  for (const auto& per_kind : s.events) {
    for (uint64_t n : per_kind) total += n;
  }
  EXPECT_EQ(total, 7u);
}

TEST(RadixIndexTest, EventNames) {
  std::set<std::string> names;
  for (int e = 0; e < kNumEventErrors; ++e) {
    const auto name = EventErrorName(static_cast<EventError>(e));
    EXPECT_FALSE(name.empty());
    names.emplace(name);
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(kNumEventErrors));
  names.clear();
  for (int k = 0; k < kNumEventKinds; ++k) {
    const auto name = EventKindName(static_cast<EventKind>(k));
    EXPECT_FALSE(name.empty());
    names.emplace(name);
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(kNumEventKinds));
}

// ---- Memory -------------------------------------------------------------------------------------

TEST(RadixIndexTest, MemoryReturnsToItsStartWhenEverythingIsRemoved) {
  RadixIndex index;
  const IndexStats start = index.Stats();
  ASSERT_EQ(start.nodes, 1u);

  // 8 workers x 2 ranks, 4 stems of 6 blocks, each with a tail of 10 of its own.
  struct Held {
    WorkerKey worker;
    Tier tier;
    std::vector<uint64_t> engine;
  };
  std::vector<Held> held;
  for (uint64_t w = 0; w < 8; ++w) {
    for (uint32_t rank = 0; rank < 2; ++rank) {
      const WorkerKey worker{w + 100, rank};
      const uint64_t stem = w % 4;
      std::vector<uint64_t> local, engine;
      for (uint64_t i = 0; i < 16; ++i) {
        local.push_back(i < 6 ? stem * 1000 + i : (w * 2 + rank) * 100000 + i);
        engine.push_back(w * 1'000'000 + rank * 10000 + i);
      }
      ASSERT_TRUE(index.Apply(StoredBlocks(worker, std::nullopt, engine, local)).ok());
      held.push_back({worker, Tier::kDevice, engine});
      // Half of them also offloaded to the host, a few to disk.
      std::vector<uint64_t> host_engine(engine.begin() + 8, engine.end());
      std::vector<uint64_t> host_local(local.begin() + 8, local.end());
      ASSERT_TRUE(
          index.Apply(StoredBlocks(worker, engine[7], host_engine, host_local, Tier::kHostPinned))
              .ok());
      held.push_back({worker, Tier::kHostPinned, host_engine});
      ASSERT_TRUE(index
                      .Apply(StoredBlocks(worker, engine[15], {engine[15] + 5000}, {local[15] + 7},
                                          Tier::kDisk))
                      .ok());
      held.push_back({worker, Tier::kDisk, {engine[15] + 5000}});
    }
  }
  const IndexStats full = index.Stats();
  EXPECT_GT(full.nodes, start.nodes);
  EXPECT_GT(full.allocated_bytes, start.allocated_bytes);
  EXPECT_EQ(full.workers, 16u);

  // Remove in an order that leaves orphans for a while: every other block first.
  for (int pass = 0; pass < 2; ++pass) {
    for (const Held& h : held) {
      std::vector<uint64_t> part;
      for (size_t i = pass; i < h.engine.size(); i += 2) part.push_back(h.engine[i]);
      ASSERT_TRUE(index.Apply(RemovedBlocks(h.worker, part, h.tier)).ok());
    }
  }
  IndexStats empty = index.Stats();
  EXPECT_EQ(empty.tree_blocks, 0u);
  EXPECT_EQ(empty.cached_blocks, 0u);
  for (const Held& h : held) EXPECT_EQ(index.TreeSize(h.worker), 0u);

  for (uint64_t w = 0; w < 8; ++w) EXPECT_EQ(index.RemoveWorker(w + 100), 0u);
  empty = index.Stats();
  EXPECT_EQ(empty.workers, 0u);
  EXPECT_EQ(empty.tree_blocks, 0u);
  EXPECT_EQ(empty.allocated_bytes, start.allocated_bytes);
}

TEST(RadixIndexTest, MemoryReturnsToItsStartAfterClearAndRemoveWorker) {
  RadixIndex index;
  const IndexStats start = index.Stats();
  for (uint64_t w = 0; w < 20; ++w) {
    std::vector<uint64_t> local, engine;
    for (uint64_t i = 0; i < 50; ++i) {
      local.push_back(i < 10 ? i : w * 1000 + i);
      engine.push_back(w * 1000 + i + 7);
    }
    ASSERT_TRUE(index.Apply(StoredBlocks({w, 0}, std::nullopt, engine, local)).ok());
    ASSERT_TRUE(index.Apply(StoredBlocks({w, 1}, std::nullopt, engine, local, Tier::kDisk)).ok());
  }
  EXPECT_GT(index.Stats().allocated_bytes, start.allocated_bytes);
  for (uint64_t w = 0; w < 10; ++w) ASSERT_TRUE(index.Apply(ClearedWorker({w, 1})).ok());
  EXPECT_EQ(index.Stats().cached_blocks, 10u * 50u + 10u * 100u);  // rank 1 of 0-9 cleared
  for (uint64_t w = 0; w < 20; ++w) EXPECT_EQ(index.RemoveWorker(w), w < 10 ? 50u : 100u);
  const IndexStats end = index.Stats();
  EXPECT_EQ(end.tree_blocks, 0u);
  EXPECT_EQ(end.cached_blocks, 0u);
  EXPECT_EQ(end.workers, 0u);
  EXPECT_EQ(end.allocated_bytes, start.allocated_bytes);
}

// The documented rule an applier partitions its threads by (kvr_router_options.index_shards).
TEST(RadixIndexTest, WorkerShardIsItsIdModuloTheShards) {
  const RadixIndex one;
  EXPECT_EQ(one.shards(), 1u);
  EXPECT_EQ(one.ShardOf(12345), 0u);
  const RadixIndex four(RadixIndexOptions{.shards = 4});
  EXPECT_EQ(four.shards(), 4u);
  for (uint64_t w : {0u, 1u, 6u, 7u, 1000u}) EXPECT_EQ(four.ShardOf(w), w % 4) << w;
  EXPECT_EQ(RadixIndex(RadixIndexOptions{.shards = 0}).shards(), 1u);
  EXPECT_EQ(RadixIndex(RadixIndexOptions{.shards = 1000}).shards(), kMaxIndexShards);
}

// Found by index_model_fuzzer: a rank holding one prefix under two engine hashes (two store
// events for the same blocks) removes some of both in one event. The duplicate positions split a
// node inside a run of removed blocks, and the run's blocks past the split kept the rank as a
// member: a phantom cache hit. Every choice of 4 of the 6 hashes, in both orders.
TEST(RadixIndexTest, RemovingBlocksHeldUnderTwoEngineHashesSplitsRunsRight) {
  const std::vector<uint64_t> local = {11, 12, 13, 14};
  const std::vector<uint64_t> path = ComputeSequenceHashes(local);
  const std::vector<uint64_t> long_copy = {101, 102, 103, 104};  // blocks 0-3
  const std::vector<uint64_t> short_copy = {201, 202};           // blocks 0-1 again
  const std::vector<std::pair<uint64_t, size_t>> held = {{101, 0}, {102, 1}, {103, 2},
                                                         {104, 3}, {201, 0}, {202, 1}};
  const WorkerKey w{3, 0};
  for (uint32_t chosen = 0; chosen < 64; ++chosen) {
    if (std::popcount(chosen) != 4) continue;
    for (bool reversed : {false, true}) {
      RadixIndex index;
      testing::IndexModel model;
      for (size_t k = 0; k < path.size(); ++k) model.parent_of[path[k]] = k ? path[k - 1] : 0;
      ASSERT_TRUE(
          index.Apply(StoredBlocks(w, std::nullopt, long_copy, local, Tier::kExternal)).ok());
      ASSERT_TRUE(
          index.Apply(StoredBlocks(w, std::nullopt, short_copy, {11, 12}, Tier::kExternal)).ok());
      for (const auto& [engine, block] : held) model.Add(w, engine, path[block], Tier::kExternal);
      std::vector<uint64_t> removed;
      for (size_t i = 0; i < held.size(); ++i) {
        if ((chosen >> i) & 1) removed.push_back(held[i].first);
      }
      if (reversed) std::reverse(removed.begin(), removed.end());
      ASSERT_TRUE(index.Apply(RemovedBlocks(w, removed, Tier::kExternal)).ok());
      for (uint64_t engine : removed) ASSERT_TRUE(model.Remove(w, engine, Tier::kExternal));
      SCOPED_TRACE(::testing::PrintToString(removed));
      EXPECT_EQ(index.CheckInvariants(), "");
      EXPECT_EQ(MatchesToString(index.FindMatches(local)),
                MatchesToString(model.FindMatches(local)));
      const std::vector<uint64_t> prefix = {11, 12};
      EXPECT_EQ(MatchesToString(index.FindMatches(prefix)),
                MatchesToString(model.FindMatches(prefix)));
    }
  }
}

}  // namespace
}  // namespace kvrouter

// DumpEvents round trip and a model check of the radix index on a large random history: many
// workers and ranks, every tier, shared prefixes, removals that leave orphans (a worker holding a
// child but not its parent), clears, worker removals and rejected events.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/hashing.h"
#include "core/radix_index.h"
#include "core/types.h"
#include "index_model.h"
#include "test_data.h"

namespace kvrouter {
namespace {

using Model = testing::IndexModel;
using testing::ClearedWorker;
using testing::EventCount;
using testing::MatchesToString;
using testing::RemovedBlocks;
using testing::StoredBlocks;

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

struct Prompt {
  std::vector<uint64_t> local;
  std::vector<uint64_t> seq;
};

// Builds a random history into an index and a model.
class RandomHistory {
 public:
  explicit RandomHistory(uint64_t seed) : rng_(seed) {
    for (uint64_t id = 1; id <= 24; ++id) {
      workers_.push_back({id, 0});
      if (id % 3 == 0) workers_.push_back({id, 1});
      if (id % 8 == 0) workers_.push_back({id, 2});
    }
    // Prompts form a forest: 16 stems, then prompts branching off earlier prompts.
    for (int i = 0; i < 400; ++i) {
      std::vector<uint64_t> local;
      if (i >= 16) {
        const Prompt& base = prompts_[Uniform(prompts_.size())];
        local.assign(base.local.begin(), base.local.begin() + 1 + Uniform(base.local.size()));
      }
      const size_t extra = 1 + Uniform(i < 16 ? 8 : 10);
      for (size_t k = 0; k < extra; ++k) local.push_back(rng_());
      Prompt p{local, ComputeSequenceHashes(local)};
      for (size_t k = 0; k < p.seq.size(); ++k) model_.parent_of[p.seq[k]] = k ? p.seq[k - 1] : 0;
      prompts_.push_back(std::move(p));
    }
  }

  const std::vector<WorkerKey>& workers() const { return workers_; }
  const std::vector<Prompt>& prompts() const { return prompts_; }
  const Model& model() const { return model_; }
  uint64_t expected_errors() const { return expected_errors_; }

  size_t Uniform(size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }
  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  uint64_t Next() { return rng_(); }

  // Engine hash of `path` for one of two variants (two engine blocks naming one prefix).
  static uint64_t Engine(uint64_t path, int variant) { return Mix(path + variant * 0x9e37ULL); }

  Tier RandomTier() {
    const size_t r = Uniform(100);
    if (r < 65) return Tier::kDevice;
    if (r < 82) return Tier::kHostPinned;
    if (r < 94) return Tier::kDisk;
    return Tier::kExternal;
  }

  void Run(RadixIndex& index, int operations) {
    for (int op = 0; op < operations; ++op) {
      const size_t r = Uniform(1000);
      if (r < 600) {
        Store(index);
      } else if (r < 950) {
        Remove(index);
      } else if (r < 962) {
        const WorkerKey w = workers_[Uniform(workers_.size())];
        ASSERT_TRUE(index.Apply(ClearedWorker(w)).ok());
        model_.Clear(w);
      } else if (r < 966) {
        const WorkerKey w = workers_[Uniform(workers_.size())];
        size_t expected = 0;
        for (const auto& [k, rank] : model_.ranks) {
          if (k.worker_id == w.worker_id) expected += rank.blocks.size();
        }
        const size_t dropped = index.RemoveWorker(w.worker_id);
        if (!any_multi_tier_) {
          EXPECT_EQ(dropped, expected);
        }
        model_.RemoveWorker(w.worker_id);
      } else if (r < 970) {
        const WorkerKey w = workers_[Uniform(workers_.size())];
        index.RemoveWorkerDpRank(w);
        model_.ranks.erase(w);
      } else if (r < 985) {
        // A parent this worker does not hold: dropped whole.
        const WorkerKey w = workers_[Uniform(workers_.size())];
        const uint64_t parent = Next();
        ASSERT_FALSE(model_.PathOf(w, parent).has_value());
        EXPECT_EQ(index.Apply(StoredBlocks(w, parent, {Next()}, {Next()})).error,
                  EventError::kParentBlockNotFound);
        ++expected_errors_;
      } else {
        // An unknown hash among known ones: the known ones are still removed.
        RemoveWithUnknown(index);
      }
    }
  }

 private:
  void Store(RadixIndex& index) {
    const WorkerKey w = workers_[Uniform(workers_.size())];
    const Prompt& p = prompts_[Uniform(prompts_.size())];
    const Tier tier = RandomTier();
    // Start at the root, or right after a block of the prompt this worker holds (any tier).
    size_t start = 0;
    std::optional<uint64_t> parent;
    if (Chance(0.6)) {
      std::vector<std::pair<size_t, uint64_t>> candidates;
      for (size_t k = 0; k + 1 < p.seq.size(); ++k) {
        for (int v = 0; v < 2; ++v) {
          const uint64_t e = Engine(p.seq[k], v);
          if (model_.PathOf(w, e) == p.seq[k]) candidates.emplace_back(k, e);
        }
      }
      if (!candidates.empty()) {
        const auto& c = candidates[Uniform(candidates.size())];
        start = c.first + 1;
        parent = c.second;
      }
    }
    const size_t count = std::min(p.seq.size() - start, 1 + Uniform(8));
    const int variant = Chance(0.05) ? 1 : 0;
    std::vector<uint64_t> engine, local;
    for (size_t k = start; k < start + count; ++k) {
      engine.push_back(Engine(p.seq[k], variant));
      local.push_back(p.local[k]);
    }
    const ApplyResult r = index.Apply(StoredBlocks(w, parent, engine, local, tier));
    ASSERT_TRUE(r.ok()) << r.message;
    for (size_t k = 0; k < count; ++k) {
      const auto before = model_.PathOf(w, engine[k]);
      model_.Add(w, engine[k], p.seq[start + k], tier);
      const auto& e = model_.ranks[w].blocks[engine[k]];
      if (before && (e.tiers & (e.tiers - 1))) any_multi_tier_ = true;
    }
  }

  // Picks up to `max` engine hashes the worker holds on `tier`.
  std::vector<uint64_t> Held(WorkerKey w, Tier tier, size_t max) {
    std::vector<uint64_t> out;
    auto it = model_.ranks.find(w);
    if (it == model_.ranks.end()) return out;
    const uint8_t bit = uint8_t{1} << static_cast<int>(tier);
    for (const auto& [engine, e] : it->second.blocks) {
      if (e.tiers & bit) out.push_back(engine);
    }
    std::sort(out.begin(), out.end());  // unordered_map order is not reproducible
    std::shuffle(out.begin(), out.end(), rng_);
    if (out.size() > max) out.resize(max);
    return out;
  }

  void Remove(RadixIndex& index) {
    const WorkerKey w = workers_[Uniform(workers_.size())];
    const Tier tier = RandomTier();
    const std::vector<uint64_t> hashes = Held(w, tier, 1 + Uniform(4));
    if (hashes.empty()) return;
    const ApplyResult r = index.Apply(RemovedBlocks(w, hashes, tier));
    ASSERT_TRUE(r.ok()) << r.message;
    for (uint64_t h : hashes) ASSERT_TRUE(model_.Remove(w, h, tier));
  }

  void RemoveWithUnknown(RadixIndex& index) {
    const WorkerKey w = workers_[Uniform(workers_.size())];
    const Tier tier = RandomTier();
    std::vector<uint64_t> hashes = Held(w, tier, 3);
    const uint64_t unknown = Next();
    hashes.insert(hashes.begin() + Uniform(hashes.size() + 1), unknown);
    EXPECT_EQ(index.Apply(RemovedBlocks(w, hashes, tier)).error, EventError::kBlockNotFound);
    ++expected_errors_;
    for (uint64_t h : hashes) {
      if (h != unknown) {
        ASSERT_TRUE(model_.Remove(w, h, tier));
      }
    }
  }

  std::mt19937_64 rng_;
  std::vector<WorkerKey> workers_;
  std::vector<Prompt> prompts_;
  Model model_;
  uint64_t expected_errors_ = 0;
  bool any_multi_tier_ = false;
};

// Queries: prefixes of prompts, whole prompts, prompts with a changed block, random hashes.
std::vector<std::vector<uint64_t>> MakeQueries(RandomHistory& history, int count) {
  std::vector<std::vector<uint64_t>> queries;
  const auto& prompts = history.prompts();
  for (int i = 0; i < count; ++i) {
    const Prompt& p = prompts[history.Uniform(prompts.size())];
    std::vector<uint64_t> q = p.local;
    switch (i % 5) {
      case 0:
      case 1:
        q.resize(1 + history.Uniform(q.size()));
        break;
      case 2:
        q.push_back(history.Next());
        break;
      case 3:
        q[history.Uniform(q.size())] = history.Next();
        break;
      case 4:
        if (i % 10 == 4) {
          q.assign(1 + history.Uniform(6), 0);
          for (auto& h : q) h = history.Next();
        }
        break;
    }
    queries.push_back(std::move(q));
  }
  return queries;
}

uint64_t ErrorCount(const IndexStats& stats) {
  uint64_t errors = 0;
  for (int k = 0; k < kNumEventKinds; ++k) {
    for (int e = 1; e < kNumEventErrors; ++e) errors += stats.events[k][e];
  }
  return errors;
}

uint64_t EventTotal(const IndexStats& stats) {
  uint64_t total = 0;
  for (const auto& per_kind : stats.events) {
    for (uint64_t n : per_kind) total += n;
  }
  return total;
}

// A random history of events against the model, on an index split into `shards` trees.
void CheckRandomHistoryAgainstTheModel(uint32_t shards) {
  RadixIndex index(RadixIndexOptions{.shards = shards});
  ASSERT_EQ(index.shards(), shards);
  RandomHistory history(0x5eed1);
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    history.Run(index, 2000);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    const Model& model = history.model();
    // Shards each hold the prefixes their own workers share.
    if (shards == 1) {
      EXPECT_EQ(index.Stats().tree_blocks + 1, model.Nodes());
    }
    EXPECT_EQ(index.CheckInvariants(), "");
    EXPECT_EQ(ErrorCount(index.Stats()), history.expected_errors());
    for (const WorkerKey& w : history.workers()) {
      EXPECT_EQ(index.TreeSize(w), model.TreeSize(w)) << w.worker_id << "/" << w.dp_rank;
    }
    int mismatches = 0;
    for (const auto& q : MakeQueries(history, 2000)) {
      const std::string expected = MatchesToString(model.FindMatches(q));
      const std::string actual = MatchesToString(index.FindMatches(q));
      if (expected != actual && ++mismatches <= 5) {
        ADD_FAILURE() << "query of " << q.size() << " blocks\n  expected " << expected
                      << "\n  actual   " << actual;
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(RadixIndexDumpTest, RandomHistoryMatchesAModel) { CheckRandomHistoryAgainstTheModel(1); }

// Sharding changes where a worker's blocks live, never an answer: events, removals, errors,
// tree sizes and matches are those of the model.
TEST(RadixIndexDumpTest, ShardedIndexMatchesTheModel) { CheckRandomHistoryAgainstTheModel(3); }

TEST(RadixIndexDumpTest, DumpRebuildsAnIdenticalIndex) {
  RadixIndex original;
  RandomHistory history(0xd0e5);
  history.Run(original, 12000);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const IndexStats before = original.Stats();
  ASSERT_GT(before.cached_blocks, 1500u);
  ASSERT_GT(before.tree_blocks, 500u);

  // The history left orphans: some worker holds a block without its parent's.
  bool orphan = false;
  for (const auto& [w, rank] : history.model().ranks) {
    for (const auto& [path, counts] : rank.held) {
      const uint64_t parent = history.model().parent_of.at(path);
      if (parent != 0 && !rank.held.count(parent)) orphan = true;
    }
  }
  ASSERT_TRUE(orphan);

  const std::vector<KvEvent> dump = original.DumpEvents();
  ASSERT_FALSE(dump.empty());
  bool has_removals = false;
  for (size_t i = 0; i < dump.size(); ++i) {
    EXPECT_EQ(dump[i].event_id, i);
    has_removals |= std::holds_alternative<RemovedEvent>(dump[i].data);
  }
  EXPECT_TRUE(has_removals);  // orphans are rebuilt through temporary parents

  // Dumping does not change the index.
  EXPECT_EQ(original.Stats().tree_blocks, before.tree_blocks);
  EXPECT_EQ(EventTotal(original.Stats()), EventTotal(before));

  RadixIndex rebuilt;
  size_t failures = 0;
  for (const KvEvent& e : dump) {
    const ApplyResult r = rebuilt.Apply(e);
    if (!r.ok() && ++failures <= 5) ADD_FAILURE() << "event " << e.event_id << ": " << r.message;
  }
  EXPECT_EQ(failures, 0u);
  EXPECT_EQ(ErrorCount(rebuilt.Stats()), 0u);

  EXPECT_EQ(rebuilt.StateDigest(), original.StateDigest());
  const IndexStats after = rebuilt.Stats();
  EXPECT_EQ(after.tree_blocks, before.tree_blocks);
  EXPECT_LE(after.nodes, before.nodes);  // a rebuild starts from fresh runs: never more split
  EXPECT_EQ(rebuilt.CheckInvariants(), "");
  EXPECT_EQ(after.cached_blocks, before.cached_blocks);
  for (const WorkerKey& w : history.workers()) {
    EXPECT_EQ(rebuilt.TreeSize(w), original.TreeSize(w)) << w.worker_id << "/" << w.dp_rank;
  }
  int mismatches = 0;
  for (const auto& q : MakeQueries(history, 4000)) {
    const std::string expected = MatchesToString(original.FindMatches(q));
    const std::string actual = MatchesToString(rebuilt.FindMatches(q));
    if (expected != actual && ++mismatches <= 5) {
      ADD_FAILURE() << "query of " << q.size() << " blocks\n  original " << expected
                    << "\n  rebuilt  " << actual;
    }
  }
  EXPECT_EQ(mismatches, 0);

  // A dump of the rebuilt index rebuilds the same again.
  RadixIndex again;
  for (const KvEvent& e : rebuilt.DumpEvents()) EXPECT_TRUE(again.Apply(e).ok());
  EXPECT_EQ(again.StateDigest(), original.StateDigest());

  // A dump restores into any number of shards, and a sharded index's dump (one id sequence
  // over all its shards) back into one tree: the digest does not depend on the split.
  RadixIndex sharded(RadixIndexOptions{.shards = 4});
  for (const KvEvent& e : dump) EXPECT_TRUE(sharded.Apply(e).ok());
  EXPECT_EQ(sharded.StateDigest(), original.StateDigest());
  EXPECT_EQ(sharded.Stats().cached_blocks, before.cached_blocks);
  EXPECT_EQ(sharded.CheckInvariants(), "");
  for (const auto& q : MakeQueries(history, 1000)) {
    EXPECT_EQ(MatchesToString(sharded.FindMatches(q)), MatchesToString(original.FindMatches(q)));
  }
  const std::vector<KvEvent> sharded_dump = sharded.DumpEvents();
  RadixIndex unsharded;
  for (size_t i = 0; i < sharded_dump.size(); ++i) {
    EXPECT_EQ(sharded_dump[i].event_id, i);
    EXPECT_TRUE(unsharded.Apply(sharded_dump[i]).ok());
  }
  EXPECT_EQ(unsharded.StateDigest(), original.StateDigest());
}

TEST(RadixIndexDumpTest, DigestSeesEveryChange) {
  RadixIndex a, b;
  const WorkerKey w{1, 0};
  for (RadixIndex* index : {&a, &b}) {
    ASSERT_TRUE(index->Apply(StoredBlocks(w, std::nullopt, {101, 102}, {1, 2})).ok());
  }
  const uint64_t digest = a.StateDigest();
  EXPECT_EQ(b.StateDigest(), digest);
  // Another tier, another engine hash, another path, another rank: all change the digest.
  ASSERT_TRUE(b.Apply(StoredBlocks(w, 101, {102}, {2}, Tier::kHostPinned)).ok());
  EXPECT_NE(b.StateDigest(), digest);
  ASSERT_TRUE(b.Apply(RemovedBlocks(w, {102}, Tier::kHostPinned)).ok());
  EXPECT_EQ(b.StateDigest(), digest);
  ASSERT_TRUE(b.Apply(RemovedBlocks(w, {102})).ok());
  ASSERT_TRUE(b.Apply(StoredBlocks(w, 101, {103}, {2})).ok());
  EXPECT_NE(b.StateDigest(), digest);
  ASSERT_TRUE(b.Apply(RemovedBlocks(w, {103})).ok());
  ASSERT_TRUE(b.Apply(StoredBlocks(w, 101, {102}, {3})).ok());
  EXPECT_NE(b.StateDigest(), digest);
  ASSERT_TRUE(b.Apply(RemovedBlocks(w, {102})).ok());
  ASSERT_TRUE(b.Apply(StoredBlocks(w, 101, {102}, {2})).ok());
  EXPECT_EQ(b.StateDigest(), digest);
  ASSERT_TRUE(b.Apply(StoredBlocks({1, 1}, std::nullopt, {101}, {1})).ok());
  EXPECT_NE(b.StateDigest(), digest);
}

TEST(RadixIndexDumpTest, DumpOfAnOrphanRebuildsItWithoutItsParent) {
  RadixIndex original;
  const WorkerKey w1{1, 0}, w2{2, 0};
  ASSERT_TRUE(original.Apply(StoredBlocks(w1, std::nullopt, {101, 102, 103}, {1, 2, 3})).ok());
  ASSERT_TRUE(original.Apply(StoredBlocks(w2, std::nullopt, {201}, {1}, Tier::kDisk)).ok());
  ASSERT_TRUE(original.Apply(RemovedBlocks(w1, {102})).ok());

  RadixIndex rebuilt;
  for (const KvEvent& e : original.DumpEvents()) {
    const ApplyResult r = rebuilt.Apply(e);
    EXPECT_TRUE(r.ok()) << r.message;
  }
  EXPECT_EQ(rebuilt.StateDigest(), original.StateDigest());
  EXPECT_EQ(rebuilt.TreeSize(w1), 2u);
  EXPECT_EQ(rebuilt.Stats().tree_blocks, 3u);
  EXPECT_EQ(MatchesToString(rebuilt.FindMatches(std::vector<uint64_t>{1, 2, 3})),
            "1/0:d1,h0,s0,e0,t2;2/0:d0,h0,s1,e0,t1;");
  // The orphan is still a valid parent after the rebuild, and the gap can be refilled.
  ASSERT_TRUE(rebuilt.Apply(StoredBlocks(w1, 103, {104}, {4})).ok());
  ASSERT_TRUE(rebuilt.Apply(StoredBlocks(w1, 101, {102}, {2})).ok());
  EXPECT_EQ(MatchesToString(rebuilt.FindMatches(std::vector<uint64_t>{1, 2, 3, 4})),
            "1/0:d4,h0,s0,e0,t4;2/0:d0,h0,s1,e0,t1;");
}

// An orphan whose first block is held under two engine hashes on two tiers: its path is
// rebuilt with temporary blocks once per tier, and each tier's copy of them is removed again
// (the dump removed them from one tier only, and the rebuilt index held one block too many).
TEST(RadixIndexDumpTest, OrphanOnTwoTiersLeavesNoTemporaryBlock) {
  RadixIndex original;
  const WorkerKey w{1, 0};
  ASSERT_TRUE(original.Apply(StoredBlocks(w, std::nullopt, {101, 102}, {1, 2})).ok());
  ASSERT_TRUE(original.Apply(StoredBlocks(w, 101, {202}, {2}, Tier::kHostPinned)).ok());
  ASSERT_TRUE(original.Apply(RemovedBlocks(w, {101})).ok());
  ASSERT_EQ(original.TreeSize(w), 2u);  // 102 on the device, 202 on the host

  RadixIndex rebuilt;
  for (const KvEvent& e : original.DumpEvents()) {
    const ApplyResult r = rebuilt.Apply(e);
    EXPECT_TRUE(r.ok()) << r.message;
  }
  EXPECT_EQ(rebuilt.TreeSize(w), 2u);
  EXPECT_EQ(rebuilt.Stats().cached_blocks, original.Stats().cached_blocks);
  EXPECT_EQ(rebuilt.StateDigest(), original.StateDigest());
  EXPECT_EQ(rebuilt.CheckInvariants(), "");
}

TEST(RadixIndexDumpTest, EmptyIndexDumpsNothing) {
  RadixIndex index;
  EXPECT_TRUE(index.DumpEvents().empty());
  RadixIndex other;
  EXPECT_EQ(index.StateDigest(), other.StateDigest());
}

}  // namespace
}  // namespace kvrouter

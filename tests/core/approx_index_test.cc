// Approximate mode (shared/reference/dynamo-router.md §2.3): routing decisions recorded as cached
// blocks, per-block TTLs on a manual clock, and the size budget's pruning order.
#include "core/approx_index.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "core/clock.h"
#include "core/hashing.h"
#include "core/radix_index.h"
#include "test_data.h"

namespace kvrouter {
namespace {

using testing::MatchesToString;
using testing::MatchOf;

constexpr uint32_t kBlockSize = 4;

// A prompt's local and sequence hashes.
struct Prompt {
  std::vector<uint64_t> local;
  std::vector<uint64_t> seq;

  Prompt Prefix(size_t blocks) const {
    return Prompt{{local.begin(), local.begin() + blocks}, {seq.begin(), seq.begin() + blocks}};
  }
};

// `shared` blocks of a common stem (tokens 0, 1, 2, ...), then `own` blocks unique to `tag`.
Prompt MakePrompt(uint32_t shared, uint32_t own, uint32_t tag) {
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < shared * kBlockSize; ++i) tokens.push_back(i);
  for (uint32_t i = 0; i < own * kBlockSize; ++i) tokens.push_back(1'000'000 * (tag + 1) + i);
  Prompt p;
  p.local = ComputeLocalBlockHashes(tokens, kBlockSize);
  p.seq = ComputeSequenceHashes(p.local);
  return p;
}

ApproxIndexOptions Options() {
  ApproxIndexOptions o;
  o.block_size = kBlockSize;
  return o;
}

// Device depth of `worker` for `prompt`, or -1 if not reported.
int Depth(ApproxIndex& index, const Prompt& prompt, WorkerKey worker) {
  std::vector<WorkerMatch> out;
  index.FindMatches(prompt.local, out);
  const auto m = MatchOf(out, worker);
  if (!m) return -1;
  EXPECT_EQ(m->host_hits + m->disk_hits + m->external_hits, 0u);
  return static_cast<int>(m->device_blocks);
}

constexpr WorkerKey kW0{10, 0};
constexpr WorkerKey kW1{11, 0};
constexpr WorkerKey kW2{12, 0};

TEST(ApproxIndexTest, DefaultOptions) {
  const ApproxIndexOptions o;
  EXPECT_EQ(o.ttl_seconds, 120.0);
  EXPECT_EQ(o.max_blocks, uint64_t{1} << 20);
  EXPECT_EQ(o.prune_target_ratio, 0.8);
  EXPECT_EQ(o.block_size, 16u);
}

TEST(ApproxIndexTest, RecordedDecisionMatchesThePrompt) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  const Prompt p = MakePrompt(3, 5, 0);
  index.RecordRoutingDecision(kW0, p.local, p.seq);

  std::vector<WorkerMatch> out;
  index.FindMatches(p.local, out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].worker, kW0);
  EXPECT_EQ(out[0].device_blocks, 8u);
  EXPECT_EQ(out[0].tree_size, 8u);
  EXPECT_EQ(Depth(index, p.Prefix(2), kW0), 2);

  // Another prompt sharing the stem matches the stem only; sequence hashes are no match keys
  // beyond the first block (which equals its local hash).
  EXPECT_EQ(Depth(index, MakePrompt(3, 4, 1), kW0), 3);
  out.clear();
  index.FindMatches(p.seq, out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].device_blocks, 1u);

  const ApproxIndexStats s = index.Stats();
  EXPECT_EQ(s.tracked_blocks, 8u);
  EXPECT_EQ(s.expired_blocks, 0u);
  EXPECT_EQ(s.pruned_blocks, 0u);
  EXPECT_EQ(s.index.cached_blocks, 8u);
  EXPECT_EQ(s.index.tree_blocks, 8u);
  EXPECT_EQ(index.index().TreeSize(kW0), 8u);
  EXPECT_EQ(index.index().block_size(), kBlockSize);
}

TEST(ApproxIndexTest, WorkersSharingAPrefix) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  const Prompt a = MakePrompt(4, 2, 0);
  const Prompt b = MakePrompt(4, 6, 1);
  index.RecordRoutingDecision(kW0, a.local, a.seq);
  index.RecordRoutingDecision(kW1, b.local, b.seq);
  index.RecordRoutingDecision(kW2, b.local, b.seq);
  std::vector<WorkerMatch> out;
  index.FindMatches(b.local, out);
  EXPECT_EQ(MatchesToString(out),
            "10/0:d4,h0,s0,e0,t6;11/0:d10,h0,s0,e0,t10;12/0:d10,h0,s0,e0,t10;");
  EXPECT_EQ(index.Stats().tracked_blocks, 26u);
  EXPECT_EQ(index.Stats().index.tree_blocks, 12u);
}

TEST(ApproxIndexTest, RecordingAgainDoesNotCountTwice) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  const Prompt p = MakePrompt(2, 3, 0);
  index.RecordRoutingDecision(kW0, p.local, p.seq);
  index.RecordRoutingDecision(kW0, p.local, p.seq);
  index.RecordRoutingDecision(kW0, p.Prefix(2).local, p.Prefix(2).seq);
  EXPECT_EQ(index.Stats().tracked_blocks, 5u);
  EXPECT_EQ(index.index().TreeSize(kW0), 5u);
  EXPECT_EQ(Depth(index, p, kW0), 5);
}

TEST(ApproxIndexTest, EmptyDecisionIsHarmless) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  index.RecordRoutingDecision(kW0, {}, {});
  EXPECT_EQ(index.Stats().tracked_blocks, 0u);
  EXPECT_EQ(index.Stats().index.tree_blocks, 0u);
  std::vector<WorkerMatch> out;
  index.FindMatches(MakePrompt(1, 1, 0).local, out);
  EXPECT_TRUE(out.empty());
}

TEST(ApproxIndexTest, BlocksExpireAfterTheTtl) {
  ManualClock clock(SecondsToNanos(1000));
  ApproxIndex index(Options(), clock);
  const Prompt p = MakePrompt(2, 4, 0);
  index.RecordRoutingDecision(kW0, p.local, p.seq);

  clock.AdvanceSeconds(119.5);
  EXPECT_EQ(Depth(index, p, kW0), 6);
  EXPECT_EQ(index.Stats().tracked_blocks, 6u);

  clock.AdvanceSeconds(1.0);  // 120.5 s after the decision
  EXPECT_EQ(Depth(index, p, kW0), -1);
  const ApproxIndexStats s = index.Stats();
  EXPECT_EQ(s.tracked_blocks, 0u);
  EXPECT_EQ(s.expired_blocks, 6u);
  EXPECT_EQ(s.pruned_blocks, 0u);
  EXPECT_EQ(s.index.tree_blocks, 0u);  // index nodes freed
  EXPECT_EQ(s.index.cached_blocks, 0u);
  EXPECT_EQ(index.index().TreeSize(kW0), 0u);
}

TEST(ApproxIndexTest, RecordingAgainRefreshesTheTtl) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  const Prompt p = MakePrompt(1, 3, 0);
  index.RecordRoutingDecision(kW0, p.local, p.seq);
  clock.AdvanceSeconds(60);
  index.RecordRoutingDecision(kW0, p.local, p.seq);
  clock.AdvanceSeconds(110);  // 170 s after the first decision, 110 after the second
  EXPECT_EQ(Depth(index, p, kW0), 4);
  EXPECT_EQ(index.Stats().tracked_blocks, 4u);
  clock.AdvanceSeconds(10.5);  // 120.5 s after the second
  EXPECT_EQ(Depth(index, p, kW0), -1);
  EXPECT_EQ(index.Stats().tracked_blocks, 0u);
  EXPECT_EQ(index.Stats().expired_blocks, 4u);
}

TEST(ApproxIndexTest, OnlyTheRefreshedBlocksSurvive) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  const Prompt p = MakePrompt(2, 3, 0);
  index.RecordRoutingDecision(kW0, p.local, p.seq);
  clock.AdvanceSeconds(60);
  index.RecordRoutingDecision(kW0, p.Prefix(2).local, p.Prefix(2).seq);
  clock.AdvanceSeconds(61);  // first decision 121 s old, second 61 s
  EXPECT_EQ(Depth(index, p, kW0), 2);
  const ApproxIndexStats s = index.Stats();
  EXPECT_EQ(s.tracked_blocks, 2u);
  EXPECT_EQ(s.expired_blocks, 3u);
  EXPECT_EQ(s.index.tree_blocks, 2u);
}

TEST(ApproxIndexTest, TtlIsPerWorker) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  const Prompt p = MakePrompt(2, 2, 0);
  index.RecordRoutingDecision(kW0, p.local, p.seq);
  clock.AdvanceSeconds(60);
  index.RecordRoutingDecision(kW1, p.local, p.seq);
  clock.AdvanceSeconds(61);
  EXPECT_EQ(Depth(index, p, kW0), -1);
  EXPECT_EQ(Depth(index, p, kW1), 4);
  EXPECT_EQ(index.Stats().tracked_blocks, 4u);
  EXPECT_EQ(index.Stats().index.tree_blocks, 4u);
}

TEST(ApproxIndexTest, ExpireDueReclaimsWhileIdle) {
  ManualClock clock;
  ApproxIndexOptions o = Options();
  o.ttl_seconds = 5;
  ApproxIndex index(o, clock);
  const Prompt a = MakePrompt(2, 3, 0);
  const Prompt b = MakePrompt(2, 1, 1);
  index.RecordRoutingDecision(kW0, a.local, a.seq);
  clock.AdvanceSeconds(3);
  index.RecordRoutingDecision(kW1, b.local, b.seq);
  EXPECT_EQ(index.ExpireDue(), 0u);
  clock.AdvanceSeconds(2.5);  // a is 5.5 s old, b 2.5 s
  EXPECT_EQ(index.ExpireDue(), 5u);
  EXPECT_EQ(index.Stats().tracked_blocks, 3u);
  EXPECT_EQ(index.Stats().index.tree_blocks, 3u);
  EXPECT_EQ(index.ExpireDue(), 0u);
  clock.AdvanceSeconds(3);
  EXPECT_EQ(index.ExpireDue(), 3u);
  const ApproxIndexStats s = index.Stats();
  EXPECT_EQ(s.tracked_blocks, 0u);
  EXPECT_EQ(s.expired_blocks, 8u);
  EXPECT_EQ(s.index.tree_blocks, 0u);
}

TEST(ApproxIndexTest, SizeBudgetPrunesEarliestExpiryFirst) {
  ManualClock clock;
  ApproxIndexOptions o = Options();
  o.max_blocks = 100;
  o.prune_target_ratio = 0.8;
  ApproxIndex index(o, clock);
  const Prompt x = MakePrompt(0, 50, 0);
  const Prompt y = MakePrompt(0, 50, 1);
  const Prompt z = MakePrompt(0, 10, 2);
  index.RecordRoutingDecision(kW0, x.local, x.seq);
  clock.AdvanceSeconds(1);
  index.RecordRoutingDecision(kW1, y.local, y.seq);
  EXPECT_EQ(index.Stats().tracked_blocks, 100u);  // at the budget, not over it
  EXPECT_EQ(index.Stats().pruned_blocks, 0u);
  clock.AdvanceSeconds(1);
  index.RecordRoutingDecision(kW2, z.local, z.seq);  // 110 > 100: prune down to 80

  const ApproxIndexStats s = index.Stats();
  EXPECT_EQ(s.tracked_blocks, 80u);
  EXPECT_EQ(s.pruned_blocks, 30u);
  EXPECT_EQ(s.index.cached_blocks, 80u);
  // x expires first: its 30 deepest blocks go.
  EXPECT_EQ(Depth(index, x, kW0), 20);
  EXPECT_EQ(Depth(index, y, kW1), 50);
  EXPECT_EQ(Depth(index, z, kW2), 10);
  EXPECT_EQ(s.index.tree_blocks, 80u);

  // What is left expires as usual.
  clock.AdvanceSeconds(118.5);  // x 120.5 s old
  EXPECT_EQ(Depth(index, x, kW0), -1);
  EXPECT_EQ(Depth(index, y, kW1), 50);
  EXPECT_EQ(index.Stats().expired_blocks, 20u);
  clock.AdvanceSeconds(2);
  EXPECT_EQ(index.ExpireDue(), 60u);
  EXPECT_EQ(index.Stats().tracked_blocks, 0u);
  EXPECT_EQ(index.Stats().pruned_blocks, 30u);
  EXPECT_EQ(index.Stats().index.tree_blocks, 0u);
}

TEST(ApproxIndexTest, AmongEqualExpiriesTheDeepestBlocksArePrunedFirst) {
  ManualClock clock;
  ApproxIndexOptions o = Options();
  o.max_blocks = 100;
  o.prune_target_ratio = 0.8;
  ApproxIndex index(o, clock);
  // Two workers with a 10-block shared stem and 40 blocks each of their own, and a third with a
  // short prompt, all at the same instant: 110 entries with one expiry.
  const Prompt a = MakePrompt(10, 40, 0);
  const Prompt b = MakePrompt(10, 40, 1);
  const Prompt c = MakePrompt(0, 10, 2);
  index.RecordRoutingDecision(kW0, a.local, a.seq);
  index.RecordRoutingDecision(kW1, b.local, b.seq);
  index.RecordRoutingDecision(kW2, c.local, c.seq);

  // 30 entries go: block positions 49..35 of a and of b. The stems and c survive.
  EXPECT_EQ(index.Stats().tracked_blocks, 80u);
  EXPECT_EQ(index.Stats().pruned_blocks, 30u);
  EXPECT_EQ(Depth(index, a, kW0), 35);
  EXPECT_EQ(Depth(index, b, kW1), 35);
  EXPECT_EQ(Depth(index, c, kW2), 10);
  EXPECT_EQ(Depth(index, a.Prefix(10), kW1), 10);
  EXPECT_EQ(index.Stats().index.tree_blocks, 70u);
}

TEST(ApproxIndexTest, PruningTargetFollowsTheRatio) {
  ManualClock clock;
  ApproxIndexOptions o = Options();
  o.max_blocks = 40;
  o.prune_target_ratio = 0.5;
  ApproxIndex index(o, clock);
  for (uint32_t i = 0; i < 41; ++i) {
    const Prompt p = MakePrompt(0, 1, i);
    index.RecordRoutingDecision({100 + i, 0}, p.local, p.seq);
    clock.AdvanceSeconds(0.5);
  }
  EXPECT_EQ(index.Stats().tracked_blocks, 20u);
  EXPECT_EQ(index.Stats().pruned_blocks, 21u);
  // The oldest decisions went, the newest stayed.
  EXPECT_EQ(Depth(index, MakePrompt(0, 1, 0), {100, 0}), -1);
  EXPECT_EQ(Depth(index, MakePrompt(0, 1, 20), {120, 0}), -1);
  EXPECT_EQ(Depth(index, MakePrompt(0, 1, 21), {121, 0}), 1);
  EXPECT_EQ(Depth(index, MakePrompt(0, 1, 40), {140, 0}), 1);
}

// A prune of 20,000 blocks would stall the decision that triggers it; it is spread over the
// next decisions instead (256 blocks each here, 64-block prompts), while the budget is never
// exceeded by more than one prompt and the index reaches the target within a bounded number
// of decisions.
TEST(ApproxIndexTest, LargePrunesAreSpreadOverDecisions) {
  ManualClock clock;
  ApproxIndexOptions o = Options();
  o.max_blocks = 100'000;
  ApproxIndex index(o, clock);
  constexpr uint64_t kTarget = 80'000, kPromptBlocks = 64, kStep = 256;
  uint32_t tag = 0;
  auto record = [&] {
    const Prompt p = MakePrompt(0, kPromptBlocks, tag);
    index.RecordRoutingDecision({1000 + tag % 64, 0}, p.local, p.seq);
    ++tag;
    clock.AdvanceSeconds(0.001);
    return index.Stats().tracked_blocks;
  };
  uint64_t tracked = 0;
  while (index.Stats().pruned_blocks == 0) {
    tracked = record();
    ASSERT_LT(tag, 2000u);
  }
  // The decision that crossed the budget pruned one step, not down to the target.
  EXPECT_EQ(index.Stats().pruned_blocks, kStep);
  EXPECT_GT(tracked, kTarget);
  EXPECT_LE(tracked, o.max_blocks + kPromptBlocks);
  int decisions = 0;
  uint64_t pruned = index.Stats().pruned_blocks;
  while (tracked > kTarget) {
    tracked = record();
    ASSERT_LE(tracked, o.max_blocks + kPromptBlocks);
    ASSERT_LE(index.Stats().pruned_blocks - pruned, kStep);
    pruned = index.Stats().pruned_blocks;
    ASSERT_LT(++decisions, 200);
  }
  EXPECT_GE(decisions, 90);  // 20,000 blocks, 192 net per decision
  EXPECT_EQ(index.Stats().index.cached_blocks, tracked);
  // Pruning is over: the next decisions only add.
  EXPECT_EQ(record(), tracked + kPromptBlocks);
}

// Prompts that share a long stem cost the stem once, and a prompt recorded over and over (a
// hot system prompt) costs no memory per recording: the later decision supersedes the earlier.
TEST(ApproxIndexTest, RecordingTheSamePromptAgainKeepsMemoryBounded) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  for (uint32_t i = 0; i < 5000; ++i) {
    // The shared prompt plus a short tail of its own, on one of four workers.
    const Prompt p = MakePrompt(512, 8, 1000 + i);
    index.RecordRoutingDecision({i % 4, 0}, p.local, p.seq);
    clock.AdvanceSeconds(0.001);
  }
  ApproxIndexStats s = index.Stats();
  EXPECT_EQ(s.tracked_blocks, 4u * 512u + 5000u * 8u);
  EXPECT_EQ(s.decisions, 5000u);
  EXPECT_EQ(s.index.cached_blocks, s.tracked_blocks);

  const int64_t bytes = s.index.allocated_bytes;
  const Prompt hot = MakePrompt(512, 8, 0);
  for (uint32_t i = 0; i < 20000; ++i) {
    index.RecordRoutingDecision({i % 4, 0}, hot.local, hot.seq);
    clock.AdvanceSeconds(0.001);
  }
  s = index.Stats();
  EXPECT_EQ(s.tracked_blocks, 4u * 512u + 5000u * 8u + 4u * 8u);
  EXPECT_EQ(s.decisions, 5000u + 4u);
  EXPECT_LE(s.index.allocated_bytes, bytes + 4096);

  // The hot prompt lives as long as its latest decision; the first prompts' tails expire.
  clock.AdvanceSeconds(120 - 20 + 0.5);  // the first 5,000 decisions are over 120 s old
  index.ExpireDue();
  s = index.Stats();
  EXPECT_EQ(s.tracked_blocks, 4u * (512u + 8u));
  EXPECT_EQ(s.expired_blocks, 5000u * 8u);
  EXPECT_EQ(Depth(index, hot, {3, 0}), 520);
}

TEST(ApproxIndexTest, RemoveWorkerForgetsItsBlocks) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  const Prompt p = MakePrompt(2, 3, 0);
  const WorkerKey r0{20, 0}, r1{20, 1};
  index.RecordRoutingDecision(r0, p.local, p.seq);
  index.RecordRoutingDecision(r1, p.Prefix(3).local, p.Prefix(3).seq);
  index.RecordRoutingDecision(kW1, p.local, p.seq);
  EXPECT_EQ(index.Stats().tracked_blocks, 13u);

  EXPECT_EQ(index.RemoveWorkerDpRank(r1), 3u);
  EXPECT_EQ(Depth(index, p, r1), -1);
  EXPECT_EQ(Depth(index, p, r0), 5);
  EXPECT_EQ(index.Stats().tracked_blocks, 10u);

  index.RecordRoutingDecision(r1, p.Prefix(1).local, p.Prefix(1).seq);
  EXPECT_EQ(index.RemoveWorker(20), 6u);
  std::vector<WorkerMatch> out;
  index.FindMatches(p.local, out);
  EXPECT_EQ(MatchesToString(out), "11/0:d5,h0,s0,e0,t5;");
  EXPECT_EQ(index.Stats().tracked_blocks, 5u);
  EXPECT_EQ(index.RemoveWorker(20), 0u);

  // The forgotten blocks' timers do no harm when they come due.
  clock.AdvanceSeconds(121);
  EXPECT_EQ(index.ExpireDue(), 5u);
  const ApproxIndexStats s = index.Stats();
  EXPECT_EQ(s.tracked_blocks, 0u);
  EXPECT_EQ(s.index.tree_blocks, 0u);
  EXPECT_EQ(s.index.cached_blocks, 0u);
  EXPECT_EQ(s.expired_blocks, 5u);

  // A removed worker can be recorded again and expires on its own schedule.
  index.RecordRoutingDecision(r0, p.local, p.seq);
  EXPECT_EQ(Depth(index, p, r0), 5);
  clock.AdvanceSeconds(121);
  EXPECT_EQ(Depth(index, p, r0), -1);
  EXPECT_EQ(index.Stats().tracked_blocks, 0u);
}

TEST(ApproxIndexTest, RemovedWorkerRecordedAgainKeepsItsNewTtl) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  const Prompt p = MakePrompt(1, 2, 0);
  index.RecordRoutingDecision(kW0, p.local, p.seq);
  EXPECT_EQ(index.RemoveWorker(kW0.worker_id), 3u);
  clock.AdvanceSeconds(100);
  index.RecordRoutingDecision(kW0, p.local, p.seq);
  clock.AdvanceSeconds(21);  // the old decision's timers are due, the new one's are not
  EXPECT_EQ(Depth(index, p, kW0), 3);
  EXPECT_EQ(index.Stats().tracked_blocks, 3u);
  clock.AdvanceSeconds(100);
  EXPECT_EQ(Depth(index, p, kW0), -1);
}

// A decision whose path others' prompts split into many runs is still taken apart whole: the
// index drops at most 32 runs a call (so that expiry needs nothing from the heap) and the
// decision resumes where that stopped.
TEST(ApproxIndexTest, APathSplitIntoManyRunsExpiresWhole) {
  ManualClock clock;
  ApproxIndex index(Options(), clock);
  const Prompt stem = MakePrompt(80, 0, 0);
  index.RecordRoutingDecision(kW0, stem.local, stem.seq);
  clock.AdvanceSeconds(1);
  for (uint32_t at = 2; at <= 70; at += 2) {
    const Prompt branch = MakePrompt(at, 2, at);
    index.RecordRoutingDecision(kW1, branch.local, branch.seq);
  }
  EXPECT_EQ(index.Stats().index.nodes, 72u);  // the root, the stem in 36 runs, 35 branches
  EXPECT_EQ(index.CheckInvariants(), "");

  clock.AdvanceSeconds(119.5);  // W0's decision is due, W1's are not
  EXPECT_EQ(index.ExpireDue(), 80u);
  EXPECT_EQ(index.index().TreeSize(kW0), 0u);
  EXPECT_EQ(index.index().TreeSize(kW1), 140u);
  EXPECT_EQ(index.CheckInvariants(), "");

  clock.AdvanceSeconds(1);
  EXPECT_EQ(index.ExpireDue(), 140u);
  EXPECT_EQ(index.Stats().index.tree_blocks, 0u);
  EXPECT_EQ(index.CheckInvariants(), "");
}

}  // namespace
}  // namespace kvrouter

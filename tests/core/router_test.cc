#include "core/router.h"

#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <map>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/hashing.h"
#include "process_memory.h"

namespace kvrouter {
namespace {

constexpr uint32_t kBlockSize = 4;

// `blocks` complete blocks of tokens starting at `first`.
std::vector<uint32_t> Tokens(size_t blocks, uint32_t first = 0) {
  std::vector<uint32_t> tokens(blocks * kBlockSize);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = first + static_cast<uint32_t>(i);
  return tokens;
}

// A stored event telling that `worker` cached `tokens` (whole blocks) on `tier`, as one
// sequence from the root. Engine hashes are the sequence hashes, offset per tier.
KvEvent Stored(WorkerKey worker, const std::vector<uint32_t>& tokens, Tier tier = Tier::kDevice,
               std::string lora = "") {
  const auto local = ComputeLocalBlockHashes(tokens, kBlockSize, {.lora_name = lora});
  StoredEvent stored;
  stored.block_hashes = ComputeSequenceHashes(local);
  for (uint64_t& h : stored.block_hashes) h += static_cast<uint64_t>(tier);
  stored.token_ids = tokens;
  stored.lora_name = lora;
  return KvEvent{.worker = worker, .tier = tier, .event_id = 0, .data = stored};
}

WorkerConfig Worker(uint64_t id, uint64_t max_batched = 0, uint32_t dp_size = 1) {
  return WorkerConfig{.worker_id = id,
                      .dp_start = 0,
                      .dp_size = dp_size,
                      .total_kv_blocks = 10'000,
                      .max_num_batched_tokens = max_batched,
                      .block_size = kBlockSize};
}

RouteOptions Admit(std::string_view id) {
  return RouteOptions{.with_admission = true, .request_id = id};
}

class RouterTest : public ::testing::Test {
 protected:
  void Make(RouterOptions options = {}, int workers = 3) {
    options.block_size = kBlockSize;
    options.clock = &clock_;
    options.random_seed = 7;
    auto router = Router::Create(std::move(options));
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = std::move(*router);
    for (int i = 1; i <= workers; ++i) ASSERT_TRUE(router_->AddWorker(Worker(i)).ok());
  }

  WorkerLoad LoadOf(uint64_t worker) {
    for (const auto& load : router_->Loads()) {
      if (load.worker.worker_id == worker) return load;
    }
    return WorkerLoad{};
  }

  ManualClock clock_;
  std::unique_ptr<Router> router_;
};

TEST_F(RouterTest, CreateRejectsBadOptions) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(Router::Create(RouterOptions{.block_size = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  RouterOptions bad_weight;
  bad_weight.selection.overlap_score_credit = nan;
  EXPECT_EQ(Router::Create(bad_weight).status().code(), absl::StatusCode::kInvalidArgument);
  RouterOptions bad_threshold;
  bad_threshold.queue_threshold = -1;
  EXPECT_EQ(Router::Create(bad_threshold).status().code(), absl::StatusCode::kInvalidArgument);
  RouterOptions bad_ratio;
  bad_ratio.approx_prune_target_ratio = 0;
  EXPECT_EQ(Router::Create(bad_ratio).status().code(), absl::StatusCode::kInvalidArgument);
  RouterOptions bad_ttl;
  bad_ttl.approx_ttl_seconds = nan;
  EXPECT_EQ(Router::Create(bad_ttl).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RouterTest, RegistryErrorsAreClear) {
  Make();
  WorkerConfig wrong = Worker(9);
  wrong.block_size = 16;
  EXPECT_EQ(router_->AddWorker(wrong).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(router_->AddWorker(Worker(1)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(router_->UpdateWorker(Worker(9)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(router_->RemoveWorker(9).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(router_->Workers().size(), 3u);
}

// What a rank listener heard: "+" or "-", the worker, its ranks, "whole" for a worker removed.
struct HeardChanges {
  std::vector<std::string> changes;
  RankListener Listener() {
    return [this](const RankChange& change) {
      std::string heard = change.kind == RankChange::Kind::kAdded ? "+" : "-";
      heard += std::to_string(change.worker_id);
      for (const WorkerKey& rank : change.ranks) heard += " " + std::to_string(rank.dp_rank);
      if (change.whole_worker) heard += " whole";
      changes.push_back(heard);
    };
  }
};

TEST_F(RouterTest, RankListenersHearTheRegistrysChangesUntilRemoved) {
  Make({}, 0);
  HeardChanges heard, other;
  const uint64_t token = router_->AddRankListener(heard.Listener());
  const uint64_t other_token = router_->AddRankListener(other.Listener());
  EXPECT_NE(token, other_token);
  ASSERT_TRUE(router_->AddWorker(Worker(1, 0, 2)).ok());
  ASSERT_TRUE(router_->AddWorker(Worker(2)).ok());
  EXPECT_FALSE(router_->AddWorker(Worker(2)).ok());            // refused: nothing changed
  EXPECT_FALSE(router_->UpdateWorker(Worker(9, 0, 2)).ok());   // refused too (not registered)
  ASSERT_TRUE(router_->UpdateWorker(Worker(1, 0, 4)).ok());    // ranks 2 and 3 added
  ASSERT_TRUE(router_->UpdateWorker(Worker(1, 100, 4)).ok());  // capacity alone: nothing
  ASSERT_TRUE(router_->UpdateWorker(Worker(1, 0, 1)).ok());    // ranks 1 to 3 dropped
  ASSERT_TRUE(router_->RemoveWorker(2).ok());
  // Never registered, but the index may hold events for it: they go, and listeners hear it.
  EXPECT_EQ(router_->RemoveWorker(9).code(), absl::StatusCode::kNotFound);
  const std::vector<std::string> expected{"+1 0 1",   "+2 0",       "+1 2 3",
                                          "-1 1 2 3", "-2 0 whole", "-9 whole"};
  EXPECT_EQ(heard.changes, expected);
  EXPECT_EQ(other.changes, expected);
  router_->RemoveRankListener(token);
  router_->RemoveRankListener(token);  // again: nothing
  ASSERT_TRUE(router_->RemoveWorker(1).ok());
  EXPECT_EQ(heard.changes.size(), expected.size());
  EXPECT_EQ(other.changes.back(), "-1 0 whole");
}

// A listener must not throw; one that does (here for want of memory) keeps neither the router's
// change from being made nor the other listeners from hearing it.
TEST_F(RouterTest, AListenerThatThrowsMissesOnlyItsOwnChange) {
  Make({}, 0);
  HeardChanges heard;
  router_->AddRankListener([](const RankChange&) { throw std::bad_alloc(); });
  router_->AddRankListener(heard.Listener());
  ASSERT_TRUE(router_->AddWorker(Worker(1)).ok());
  ASSERT_TRUE(router_->RemoveWorker(1).ok());
  EXPECT_EQ(heard.changes, (std::vector<std::string>{"+1 0", "-1 0 whole"}));
  EXPECT_TRUE(router_->Workers().empty());
}

TEST_F(RouterTest, PrefersTheWorkerHoldingThePrefixAndExplainsWhy) {
  Make();
  const auto prompt = Tokens(8);
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 2}, prompt))->ok());
  auto decision = router_->FindBestMatch(prompt, {});
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->worker, (WorkerKey{.worker_id = 2}));
  EXPECT_EQ(decision->device_overlap_blocks, 8u);
  EXPECT_DOUBLE_EQ(decision->effective_overlap_blocks, 8.0);
  EXPECT_EQ(decision->cached_tokens, 32u);
  EXPECT_EQ(decision->prompt_blocks, 8u);
  EXPECT_FALSE(decision->booked);
  ASSERT_EQ(decision->candidates.size(), 3u);
  EXPECT_EQ(decision->candidates[decision->chosen].worker, decision->worker);
  // Idle workers: cost = max(0, 8 - credit) + 8 new blocks; worker 2 has credit 8.
  for (const CandidateCost& c : decision->candidates) {
    EXPECT_DOUBLE_EQ(c.cost, c.worker.worker_id == 2 ? 8.0 : 16.0);
  }
}

// Each candidate is priced with its own rank's overlap however the ranks were added and
// removed (slots reused, positions shifted).
TEST_F(RouterTest, CandidatesKeepTheirOwnOverlapAfterRanksLeaveAndJoin) {
  Make(RouterOptions{}, 4);
  const auto prompt = Tokens(8);
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 4}, prompt))->ok());
  const std::vector<uint32_t> half(prompt.begin(), prompt.begin() + 4 * kBlockSize);
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 3}, half))->ok());
  ASSERT_TRUE(router_->RemoveWorker(1).ok());
  for (int round = 0; round < 2; ++round) {
    auto decision = router_->FindBestMatch(prompt, {});
    ASSERT_TRUE(decision.ok()) << decision.status();
    EXPECT_EQ(decision->worker, (WorkerKey{.worker_id = 4}));
    EXPECT_EQ(decision->device_overlap_blocks, 8u);
    std::map<uint64_t, uint32_t> overlap;
    for (const CandidateCost& c : decision->candidates) {
      overlap[c.worker.worker_id] = c.overlap.device_blocks;
    }
    const std::map<uint64_t, uint32_t> expected =
        round == 0 ? std::map<uint64_t, uint32_t>{{2, 0}, {3, 4}, {4, 8}}
                   : std::map<uint64_t, uint32_t>{{2, 0}, {3, 4}, {4, 8}, {5, 0}};
    EXPECT_EQ(overlap, expected) << "round " << round;
    if (round == 0) {
      ASSERT_TRUE(router_->AddWorker(Worker(5)).ok());  // takes worker 1's slot
    }
  }
}

// A plan lives until it is committed or aborted, so it keeps the chosen candidate and what the
// commit needs, not every candidate and index match: about 200 KB per plan at 1,000 ranks.
TEST_F(RouterTest, PlansAtAThousandRanksKeepNeitherEveryCandidateNorTheMatches) {
  if (testing::HeapBytesInUse() < 0) GTEST_SKIP() << "needs glibc's mallinfo2";
  constexpr int kRanks = 1000, kPlans = 64;
  Make(RouterOptions{}, kRanks);
  const auto prompt = Tokens(16);
  for (uint64_t w = 1; w <= kRanks; ++w) {
    ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = w}, prompt))->ok());
  }
  std::vector<std::string> ids;
  for (int i = 0; i < kPlans; ++i) ids.push_back("plan-" + std::to_string(i));
  std::vector<WorkerKey> planned_on;
  const int64_t before = testing::HeapBytesInUse();
  for (const std::string& id : ids) {
    auto plan = router_->Plan(prompt, RouteOptions{.request_id = id});
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->candidates.size(), static_cast<size_t>(kRanks));
    planned_on.push_back(plan->worker);
  }
  const int64_t per_plan = (testing::HeapBytesInUse() - before) / kPlans;
  EXPECT_LT(per_plan, 16 * 1024) << "bytes kept per plan";

  auto again = router_->Plan(prompt, RouteOptions{.request_id = ids[0]});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->worker, planned_on[0]);
  ASSERT_EQ(again->candidates.size(), 1u);
  EXPECT_EQ(again->candidates[again->chosen].worker, planned_on[0]);
  EXPECT_EQ(again->candidates[again->chosen].overlap.device_blocks, 16u);
  for (const std::string& id : ids) EXPECT_TRUE(router_->Commit(id).ok());
  EXPECT_EQ(router_->active_requests(), static_cast<size_t>(kPlans));
}

TEST_F(RouterTest, LowerTierHitsCountWithTheirWeights) {
  Make();
  const auto prompt = Tokens(6);
  const std::vector<uint32_t> first_two(prompt.begin(), prompt.begin() + 2 * kBlockSize);
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 1}, first_two))->ok());
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 1}, prompt, Tier::kHostPinned))->ok());
  auto scores = router_->OverlapScores(prompt);
  ASSERT_TRUE(scores.ok());
  ASSERT_EQ(scores->size(), 1u);
  const OverlapScore& s = (*scores)[0];
  EXPECT_EQ(s.overlap.device_blocks, 2u);
  EXPECT_EQ(s.overlap.host_blocks, 4u);
  EXPECT_DOUBLE_EQ(s.effective_overlap_blocks, 2 + 0.75 * 4);
  EXPECT_EQ(s.cached_tokens, 20u);  // round(5 × 4)

  RouteOptions heavier_host;
  heavier_host.overrides.host_cache_hit_weight = 1.0;
  auto decision = router_->FindBestMatch(prompt, heavier_host);
  ASSERT_TRUE(decision.ok());
  EXPECT_EQ(decision->worker.worker_id, 1u);
  EXPECT_DOUBLE_EQ(decision->effective_overlap_blocks, 6.0);
  EXPECT_EQ(decision->cached_tokens, 24u);
}

TEST_F(RouterTest, OutputTokensGrowTheRanksLoadWhenTracked) {
  RouterOptions options;
  options.track_output_blocks = true;
  Make(options, 2);
  ASSERT_TRUE(router_->AddRequest("long", Tokens(2, 0), {1, 0}).ok());
  ASSERT_TRUE(router_->AddRequest("short", Tokens(2, 500), {2, 0}).ok());
  EXPECT_EQ(LoadOf(1).active_blocks, 2u);
  // 40 generated tokens: ceil((8 + 40) / 4) - ceil(8 / 4) = 10 output blocks on worker 1.
  EXPECT_TRUE(*router_->RecordOutputTokens("long", 40));
  EXPECT_EQ(LoadOf(1).active_blocks, 12u);
  EXPECT_FALSE(*router_->RecordOutputTokens("long", 40));
  EXPECT_FALSE(*router_->RecordOutputTokens("gone", 40));
  // A fresh prompt now goes to worker 2, whose requests hold fewer blocks.
  auto decision = router_->FindBestMatch(Tokens(2, 9000), {});
  ASSERT_TRUE(decision.ok());
  EXPECT_EQ(decision->worker.worker_id, 2u);
  EXPECT_TRUE(router_->Free("long"));
  EXPECT_EQ(LoadOf(1).active_blocks, 0u);
}

TEST_F(RouterTest, OutputTokensNeedTracking) {
  Make();
  ASSERT_TRUE(router_->AddRequest("r", Tokens(2, 0), {1, 0}).ok());
  EXPECT_EQ(router_->RecordOutputTokens("r", 40).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(RouterTest, PreviewChangesNothing) {
  Make();
  const auto prompt = Tokens(5);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(router_->FindBestMatch(prompt, {}).ok());
  EXPECT_EQ(router_->active_requests(), 0u);
  for (const auto& load : router_->Loads()) {
    EXPECT_EQ(load.active_blocks, 0u);
    EXPECT_EQ(load.active_prefill_tokens, 0u);
  }
}

TEST_F(RouterTest, AdmissionBooksUnderTheRequestIdAndFreeReleases) {
  Make();
  const auto prompt = Tokens(5);  // 20 tokens
  ASSERT_TRUE(
      router_
          ->ApplyEvent(Stored({.worker_id = 3}, {prompt.begin(), prompt.begin() + 2 * kBlockSize}))
          ->ok());
  auto decision = router_->FindBestMatch(prompt, Admit("req-1"));
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_TRUE(decision->booked);
  EXPECT_EQ(decision->worker.worker_id, 3u);
  EXPECT_EQ(router_->active_requests(), 1u);
  EXPECT_EQ(LoadOf(3).active_prefill_tokens, 20u - 8u);
  EXPECT_EQ(LoadOf(3).active_blocks, 5u);

  EXPECT_TRUE(router_->MarkPrefillCompleted("req-1"));
  EXPECT_FALSE(router_->MarkPrefillCompleted("req-1"));
  EXPECT_EQ(LoadOf(3).active_prefill_tokens, 0u);
  EXPECT_TRUE(router_->Free("req-1"));
  EXPECT_FALSE(router_->Free("req-1"));
  EXPECT_FALSE(router_->Free("never-booked"));
  EXPECT_EQ(LoadOf(3).active_blocks, 0u);
  EXPECT_EQ(router_->active_requests(), 0u);
}

// KVR_COST_PREDICTED_TTFT end to end: the prefill rate is learnt from the time between booking
// and MarkPrefillCompleted on the router's clock, and costs are seconds.
TEST_F(RouterTest, PredictedTtftLearnsThePrefillRateFromCompletions) {
  RouterOptions options;
  options.selection.cost_function = CostFunction::kPredictedTtft;
  Make(options, 2);
  EXPECT_EQ(LoadOf(1).prefill_tokens_per_second, 0) << "unknown before the first completion";
  const auto prompt = Tokens(100);  // 400 tokens, nothing cached
  // Each worker prefills 400 tokens in 0.1 s: 4,000 tokens/s.
  for (int i = 0; i < 8; ++i) {
    for (uint64_t worker : {1u, 2u}) {
      const std::string id = "warm-" + std::to_string(worker) + "-" + std::to_string(i);
      ASSERT_TRUE(router_->AddRequest(id, prompt, {.worker_id = worker}).ok());
      clock_.AdvanceSeconds(0.1);
      EXPECT_TRUE(router_->MarkPrefillCompleted(id));
      EXPECT_TRUE(router_->Free(id));
    }
  }
  EXPECT_NEAR(LoadOf(1).prefill_tokens_per_second, 4'000, 1e-6);
  EXPECT_EQ(LoadOf(2).prefill_tokens_per_second, LoadOf(1).prefill_tokens_per_second);
  // Worker 1 holds the next prompt's first 60 blocks (240 tokens) behind a 400-token backlog:
  //   worker 1: (400 + 160) / 4,000 + 3 · 160 / 4,000 = 0.26 s
  //   worker 2: 400 / 4,000 + 3 · 400 / 4,000 = 0.4 s
  const auto next = Tokens(100, 5'000);
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 1}, Tokens(60, 5'000)))->ok());
  ASSERT_TRUE(router_->AddRequest("backlog", Tokens(100, 9'000), {.worker_id = 1}).ok());
  auto decision = router_->FindBestMatch(next, RouteOptions{});
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->worker.worker_id, 1u);
  for (const CandidateCost& c : decision->candidates) {
    EXPECT_NEAR(c.cost, c.worker.worker_id == 1 ? 0.26 : 0.4, 1e-9);
    EXPECT_NEAR(c.predicted_ttft_seconds, c.worker.worker_id == 1 ? 0.14 : 0.1, 1e-9);
  }
  // The credit form, asked per request, prices blocks and avoids the backlog (and the blocks it
  // holds): worker 1 (400 + 400) / 4 - 60 + 100 + 40 = 280, worker 2 100 + 100 = 200.
  RouteOptions credit;
  credit.overrides.cost_function = CostFunction::kCredit;
  decision = router_->FindBestMatch(next, credit);
  ASSERT_TRUE(decision.ok());
  EXPECT_EQ(decision->worker.worker_id, 2u);
}

TEST_F(RouterTest, PredictedTtftRefusesARouterWithoutPrefillTracking) {
  RouterOptions options;
  options.selection.cost_function = CostFunction::kPredictedTtft;
  options.selection.track_prefill_tokens = false;
  options.block_size = kBlockSize;
  EXPECT_EQ(Router::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  RouterOptions negative_rate;
  negative_rate.prefill_tokens_per_second = -1;
  EXPECT_EQ(Router::Create(negative_rate).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RouterTest, AdmissionNeedsAUniqueRequestId) {
  Make();
  const auto prompt = Tokens(2);
  EXPECT_EQ(router_->FindBestMatch(prompt, Admit("")).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(router_->FindBestMatch(prompt, Admit("dup")).ok());
  const auto again = router_->FindBestMatch(prompt, Admit("dup"));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(router_->active_requests(), 1u);
  EXPECT_EQ(router_->AddRequest("dup", prompt, {.worker_id = 1}).code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(RouterTest, ConsecutiveIdenticalRequestsSpreadOverIdleWorkers) {
  Make();
  const auto prompt = Tokens(16);
  std::vector<int> per_worker(4, 0);
  for (int i = 0; i < 30; ++i) {
    auto d = router_->FindBestMatch(prompt, Admit("r" + std::to_string(i)));
    ASSERT_TRUE(d.ok());
    ++per_worker[d->worker.worker_id];
  }
  EXPECT_EQ(per_worker[1], 10);
  EXPECT_EQ(per_worker[2], 10);
  EXPECT_EQ(per_worker[3], 10);
}

TEST_F(RouterTest, OverridesChangeBookingAndSelection) {
  Make();
  const auto prompt = Tokens(4);
  RouteOptions untracked = Admit("no-prefill");
  untracked.overrides.track_prefill_tokens = false;
  auto d = router_->FindBestMatch(prompt, untracked);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(LoadOf(d->worker.worker_id).active_prefill_tokens, 0u);
  EXPECT_EQ(LoadOf(d->worker.worker_id).active_blocks, 4u);

  // Without assumed KV reuse, two identical prompts on one worker hold separate blocks.
  RouteOptions no_reuse;
  no_reuse.overrides.assume_kv_reuse = false;
  ASSERT_TRUE(router_->AddRequest("x1", prompt, {.worker_id = 2}, no_reuse).ok());
  ASSERT_TRUE(router_->AddRequest("x2", prompt, {.worker_id = 2}, no_reuse).ok());
  EXPECT_EQ(LoadOf(2).active_blocks, 8u);
  ASSERT_TRUE(router_->AddRequest("y1", prompt, {.worker_id = 3}).ok());
  ASSERT_TRUE(router_->AddRequest("y2", prompt, {.worker_id = 3}).ok());
  EXPECT_EQ(LoadOf(3).active_blocks, 4u);

  RouteOptions bad;
  bad.overrides.prefill_load_scale = -2;
  EXPECT_EQ(router_->FindBestMatch(prompt, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = {};
  bad.priority_jump = std::numeric_limits<double>::infinity();
  EXPECT_EQ(router_->FindBestMatch(prompt, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RouterTest, AddRequestBooksOnAWorkerChosenElsewhere) {
  Make();
  const auto prompt = Tokens(3);
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 1}, prompt))->ok());
  ASSERT_TRUE(router_->AddRequest("pinned", prompt, {.worker_id = 1}).ok());
  EXPECT_EQ(LoadOf(1).active_prefill_tokens, 0u);  // fully cached there
  EXPECT_EQ(LoadOf(1).active_blocks, 3u);
  ASSERT_TRUE(router_->AddRequest("pinned-2", prompt, {.worker_id = 2}).ok());
  EXPECT_EQ(LoadOf(2).active_prefill_tokens, 12u);
  EXPECT_EQ(router_->AddRequest("nowhere", prompt, {.worker_id = 1, .dp_rank = 5}).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(router_->AddRequest("", prompt, {.worker_id = 1}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RouterTest, AllowedWorkersRestrictTheChoice) {
  Make();
  const auto prompt = Tokens(4);
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 1}, prompt))->ok());
  const std::vector<uint64_t> allowed = {2, 3};
  RouteOptions options;
  options.allowed_worker_ids = allowed;
  auto d = router_->FindBestMatch(prompt, options);
  ASSERT_TRUE(d.ok());
  EXPECT_NE(d->worker.worker_id, 1u);
  EXPECT_EQ(d->candidates.size(), 2u);
  const std::vector<uint64_t> unknown = {42};
  options.allowed_worker_ids = unknown;
  EXPECT_EQ(router_->FindBestMatch(prompt, options).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(RouterTest, LoraNameSeparatesCaches) {
  Make();
  const auto prompt = Tokens(4);
  ASSERT_TRUE(
      router_->ApplyEvent(Stored({.worker_id = 2}, prompt, Tier::kDevice, "adapter-a"))->ok());
  RouteOptions a, b;
  a.prompt.lora_name = "adapter-a";
  b.prompt.lora_name = "adapter-b";
  EXPECT_EQ(router_->FindBestMatch(prompt, a)->device_overlap_blocks, 4u);
  EXPECT_EQ(router_->FindBestMatch(prompt, b)->device_overlap_blocks, 0u);
  EXPECT_EQ(router_->FindBestMatch(prompt, {})->device_overlap_blocks, 0u);
}

TEST_F(RouterTest, DataParallelRanksAreSeparateCandidates) {
  Make({}, 0);
  ASSERT_TRUE(router_->AddWorker(Worker(1, 0, 4)).ok());
  auto d = router_->FindBestMatch(Tokens(2), {});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->candidates.size(), 4u);
  // Shrinking the worker to 2 ranks drops the others, with their requests.
  ASSERT_TRUE(router_->AddRequest("on-rank-3", Tokens(2), {.worker_id = 1, .dp_rank = 3}).ok());
  ASSERT_TRUE(router_->UpdateWorker(Worker(1, 0, 2)).ok());
  EXPECT_EQ(router_->FindBestMatch(Tokens(2), {})->candidates.size(), 2u);
  EXPECT_EQ(router_->active_requests(), 0u);
}

TEST_F(RouterTest, RemovingAWorkerDropsItsRequestsAndIndexEntries) {
  Make();
  const auto prompt = Tokens(4);
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 2}, prompt))->ok());
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 3}, prompt))->ok());
  ASSERT_TRUE(router_->AddRequest("on-2", prompt, {.worker_id = 2}).ok());
  ASSERT_TRUE(router_->AddRequest("on-3", prompt, {.worker_id = 3}).ok());
  ASSERT_TRUE(router_->RemoveWorker(2).ok());

  EXPECT_EQ(router_->active_requests(), 1u);
  EXPECT_FALSE(router_->Free("on-2"));  // already dropped
  auto scores = router_->OverlapScores(prompt);
  ASSERT_TRUE(scores.ok());
  ASSERT_EQ(scores->size(), 1u);
  EXPECT_EQ((*scores)[0].worker.worker_id, 3u);
  for (const auto& load : router_->Loads()) EXPECT_NE(load.worker.worker_id, 2u);
  auto d = router_->FindBestMatch(prompt, {});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->candidates.size(), 2u);

  // Re-adding the worker starts it from nothing.
  ASSERT_TRUE(router_->AddWorker(Worker(2)).ok());
  EXPECT_EQ(LoadOf(2).active_blocks, 0u);
}

TEST_F(RouterTest, PotentialLoadsShowWhatANewRequestWouldAdd) {
  Make();
  const auto prompt = Tokens(6);
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 1}, prompt))->ok());
  ASSERT_TRUE(
      router_->AddRequest("a", {prompt.begin(), prompt.begin() + 8}, {.worker_id = 2}).ok());
  auto loads = router_->PotentialLoads(prompt);
  ASSERT_TRUE(loads.ok());
  ASSERT_EQ(loads->size(), 3u);
  for (const PotentialLoad& l : *loads) {
    switch (l.current.worker.worker_id) {
      case 1:  // all cached, nothing active
        EXPECT_EQ(l.potential_prefill_tokens, 0u);
        EXPECT_EQ(l.potential_decode_blocks, 6u);
        break;
      case 2:  // 8 tokens in flight; holds 2 of the 6 blocks
        EXPECT_EQ(l.potential_prefill_tokens, 8u + 24u);
        EXPECT_EQ(l.new_blocks, 4u);
        EXPECT_EQ(l.potential_decode_blocks, 6u);
        break;
      default:
        EXPECT_EQ(l.potential_prefill_tokens, 24u);
        EXPECT_EQ(l.potential_decode_blocks, 6u);
    }
  }
}

TEST_F(RouterTest, ExpiredRequestsReleaseTheirLoad) {
  Make();
  ASSERT_TRUE(router_->FindBestMatch(Tokens(3), Admit("lost")).ok());
  clock_.AdvanceSeconds(299);
  EXPECT_EQ(router_->ExpireStale(), 0u);
  clock_.AdvanceSeconds(2);
  EXPECT_EQ(router_->ExpireStale(), 1u);
  EXPECT_EQ(router_->active_requests(), 0u);
  for (const auto& load : router_->Loads()) EXPECT_EQ(load.active_blocks, 0u);
}

TEST_F(RouterTest, ApproximateModeRecordsBookedDecisionsOnly) {
  RouterOptions options;
  options.use_kv_events = false;
  Make(options);
  const auto prompt = Tokens(5);
  EXPECT_EQ(router_->ApplyEvent(Stored({.worker_id = 1}, prompt)).status().code(),
            absl::StatusCode::kFailedPrecondition);

  ASSERT_TRUE(router_->FindBestMatch(prompt, {}).ok());  // a preview records nothing
  EXPECT_TRUE(router_->OverlapScores(prompt)->empty());

  auto booked = router_->FindBestMatch(prompt, Admit("a"));
  ASSERT_TRUE(booked.ok());
  auto scores = router_->OverlapScores(prompt);
  ASSERT_EQ(scores->size(), 1u);
  EXPECT_EQ((*scores)[0].worker, booked->worker);
  EXPECT_EQ((*scores)[0].overlap.device_blocks, 5u);

  // Once the request is done, its recorded blocks still attract the same prompt.
  ASSERT_TRUE(router_->Free("a"));
  auto next = router_->FindBestMatch(prompt, {});
  EXPECT_EQ(next->worker, booked->worker);
  EXPECT_EQ(next->cached_tokens, 20u);

  // The recording expires with its TTL (120 s by default).
  clock_.AdvanceSeconds(121);
  EXPECT_TRUE(router_->OverlapScores(prompt)->empty());
}

TEST_F(RouterTest, IndexSnapshotsRoundTrip) {
  Make();
  const auto prompt = Tokens(6);
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 1}, prompt))->ok());
  ASSERT_TRUE(router_->ApplyEvent(Stored({.worker_id = 2}, Tokens(3), Tier::kHostPinned))->ok());
  EXPECT_EQ(router_->IndexStats().cached_blocks, 9u);
  const std::vector<KvEvent> dump = router_->DumpIndexEvents();

  RouterOptions options;
  options.block_size = kBlockSize;
  auto other = Router::Create(options);
  ASSERT_TRUE(other.ok());
  // Whatever the restored router held before is replaced.
  ASSERT_TRUE((*other)->ApplyEvent(Stored({.worker_id = 3}, Tokens(2, 500)))->ok());
  ASSERT_TRUE((*other)->RestoreIndex(dump).ok());
  EXPECT_EQ((*other)->IndexStats().cached_blocks, 9u);
  auto before = router_->OverlapScores(prompt);
  auto after = (*other)->OverlapScores(prompt);
  ASSERT_TRUE(before.ok() && after.ok());
  ASSERT_EQ(before->size(), after->size());
  for (size_t i = 0; i < before->size(); ++i) {
    EXPECT_EQ((*before)[i].worker, (*after)[i].worker);
    EXPECT_DOUBLE_EQ((*before)[i].effective_overlap_blocks, (*after)[i].effective_overlap_blocks);
  }
  EXPECT_TRUE((*other)->OverlapScores(Tokens(2, 500))->empty());

  // A bad event is reported, and the good ones around it still apply.
  std::vector<KvEvent> damaged = dump;
  StoredEvent orphan;
  orphan.parent_hash = 12345;  // unknown parent
  orphan.block_hashes = {1};
  orphan.token_ids = Tokens(1, 900);
  damaged.insert(damaged.begin(), KvEvent{.worker = {.worker_id = 4}, .data = orphan});
  const absl::Status status = (*other)->RestoreIndex(damaged);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("1 of"), std::string_view::npos) << status;
  EXPECT_EQ((*other)->IndexStats().cached_blocks, 9u);

  RouterOptions approx;
  approx.use_kv_events = false;
  auto approximate = Router::Create(approx);
  ASSERT_TRUE(approximate.ok());
  EXPECT_EQ((*approximate)->RestoreIndex(dump).code(), absl::StatusCode::kFailedPrecondition);
}

// ---------------------------------------------------------------------------------------------
TEST_F(RouterTest, DecisionLatencyTimesTheFirstCallThenEveryNth) {
  Make();  // the default: one call in 16
  const auto prompt = Tokens(4);
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(router_->Preview(prompt, {}).ok());
  EXPECT_EQ(router_->decision_latency().count, 3u);  // calls 0, 16 and 32
  EXPECT_EQ(Router::Create(RouterOptions{.decision_latency_sampling = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The decision-latency histogram: routes, plans and previews that decided, on the router's
// clock (here a manual one, so every call takes 0 ns and lands in the first bucket).
TEST_F(RouterTest, DecisionLatencyCountsEveryCallThatDecided) {
  Make(RouterOptions{.decision_latency_sampling = 1});
  const auto prompt = Tokens(4);
  ASSERT_TRUE(router_->FindBestMatch(prompt, {}).ok());
  ASSERT_TRUE(router_->FindBestMatch(prompt, Admit("a")).ok());
  ASSERT_TRUE(router_->Preview(prompt, {}).ok());
  ASSERT_TRUE(router_->Plan(prompt, Admit("p")).ok());
  // Failed calls are not measured: a duplicate request id, a pin to an unknown worker.
  EXPECT_FALSE(router_->FindBestMatch(prompt, Admit("a")).ok());
  const uint64_t unknown[] = {99};
  EXPECT_FALSE(router_->FindBestMatch(prompt, RouteOptions{.allowed_worker_ids = unknown}).ok());
  const LatencyHistogram::Snapshot latency = router_->decision_latency();
  EXPECT_EQ(latency.count, 4u);
  EXPECT_EQ(latency.at_most[0], 4u);
  EXPECT_EQ(latency.sum_nanos, 0u);
  EXPECT_EQ(router_->counters().decisions, 3u);  // previews are not decisions
}

// Admission queue

class RouterQueueTest : public RouterTest {
 protected:
  // The router may still hold callbacks into this fixture's members: destroy it first.
  void TearDown() override { router_.reset(); }

  // One worker; threshold 1.0 × 10 batched tokens: a worker with more than 10 prefill tokens in
  // flight is busy. Every prompt here is 12+ tokens, so one request in prefill makes it busy.
  void MakeQueued(QueuePolicy policy, uint32_t decision_latency_sampling = 16) {
    RouterOptions options;
    options.decision_latency_sampling = decision_latency_sampling;
    options.queue_threshold = 1.0;
    options.queue_policy = policy;
    Make(options, 0);
    ASSERT_TRUE(router_->AddWorker(Worker(1, /*max_batched=*/10)).ok());
  }

  // Submits without blocking; records the order in which requests are admitted.
  void Submit(const std::string& id, size_t blocks = 3, double priority = 0) {
    RouteOptions options = Admit(id);
    options.priority_jump = priority;
    router_->FindBestMatchAsync(Tokens(blocks, 1000 * static_cast<uint32_t>(id.size() + blocks)),
                                options, [this, id](absl::StatusOr<RouteDecision> d) {
                                  if (d.ok()) {
                                    admitted_.push_back(id);
                                    queued_[id] = d->queued;
                                  } else {
                                    failed_.emplace_back(id, d.status().code());
                                  }
                                });
  }

  std::vector<std::string> admitted_;
  std::map<std::string, bool> queued_;
  std::vector<std::pair<std::string, absl::StatusCode>> failed_;
};

TEST_F(RouterQueueTest, WaitsWhileEveryWorkerIsBusyAndAdmitsWhenPrefillCompletes) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("first");
  ASSERT_EQ(admitted_, std::vector<std::string>{"first"});
  EXPECT_FALSE(queued_["first"]);
  Submit("second", 4);
  EXPECT_EQ(admitted_.size(), 1u);
  EXPECT_EQ(router_->pending_count(), 1u);
  EXPECT_EQ(router_->pending_tokens(), 16u);
  EXPECT_EQ(router_->active_requests(), 1u);

  EXPECT_TRUE(router_->MarkPrefillCompleted("first"));
  EXPECT_EQ(admitted_, (std::vector<std::string>{"first", "second"}));
  EXPECT_TRUE(queued_["second"]);
  EXPECT_EQ(router_->pending_count(), 0u);
  EXPECT_EQ(router_->pending_tokens(), 0u);
  EXPECT_EQ(router_->active_requests(), 2u);
}

TEST_F(RouterQueueTest, DecisionLatencyLeavesOutTheTimeQueued) {
  MakeQueued(QueuePolicy::kFcfs, /*decision_latency_sampling=*/1);
  Submit("first");
  Submit("second", 4);
  clock_.AdvanceSeconds(2);  // "second" waits two seconds
  EXPECT_TRUE(router_->MarkPrefillCompleted("first"));
  ASSERT_EQ(admitted_, (std::vector<std::string>{"first", "second"}));
  const LatencyHistogram::Snapshot latency = router_->decision_latency();
  EXPECT_EQ(latency.count, 1u);  // "first" only
  EXPECT_EQ(latency.sum_nanos, 0u);
  EXPECT_EQ(router_->counters().decisions, 2u);
}

TEST_F(RouterQueueTest, FcfsAdmitsInArrivalOrder) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("busy");
  for (const char* id : {"a", "b", "c"}) {
    clock_.AdvanceSeconds(1);
    Submit(id);
  }
  for (const char* id : {"busy", "a", "b"}) ASSERT_TRUE(router_->MarkPrefillCompleted(id));
  EXPECT_EQ(admitted_, (std::vector<std::string>{"busy", "a", "b", "c"}));
}

TEST_F(RouterQueueTest, LcfsAdmitsTheLatestFirst) {
  MakeQueued(QueuePolicy::kLcfs);
  Submit("busy");
  for (const char* id : {"a", "b", "c"}) {
    clock_.AdvanceSeconds(1);
    Submit(id);
  }
  for (const char* id : {"busy", "c", "b"}) ASSERT_TRUE(router_->MarkPrefillCompleted(id));
  EXPECT_EQ(admitted_, (std::vector<std::string>{"busy", "c", "b", "a"}));
}

TEST_F(RouterQueueTest, WsptAdmitsTheShortestPromptFirst) {
  MakeQueued(QueuePolicy::kWspt);
  Submit("busy");
  Submit("long", 9);
  Submit("short", 3);
  Submit("medium", 5);
  for (const char* id : {"busy", "short", "medium"}) ASSERT_TRUE(router_->Free(id));
  EXPECT_EQ(admitted_, (std::vector<std::string>{"busy", "short", "medium", "long"}));
}

TEST_F(RouterQueueTest, AddingAWorkerAdmitsWaitingRequests) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("busy");
  Submit("waiting");
  EXPECT_EQ(router_->pending_count(), 1u);
  ASSERT_TRUE(router_->AddWorker(Worker(2, 10)).ok());
  EXPECT_EQ(admitted_, (std::vector<std::string>{"busy", "waiting"}));
  EXPECT_EQ(router_->Loads().size(), 2u);
}

TEST_F(RouterQueueTest, AllowedWorkersBypassTheQueue) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("busy");
  const std::vector<uint64_t> allowed = {1};
  RouteOptions options = Admit("external");
  options.allowed_worker_ids = allowed;
  auto d = router_->FindBestMatch(Tokens(3), options);
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->queued);
}

TEST_F(RouterQueueTest, PreviewsAreNeverQueued) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("busy");
  auto d = router_->FindBestMatch(Tokens(3), {});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(router_->pending_count(), 0u);
}

TEST_F(RouterQueueTest, CancelAndFreeTakeWaitingRequestsOut) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("busy");
  Submit("cancel-me");
  Submit("free-me");
  EXPECT_TRUE(router_->CancelPending("cancel-me"));
  EXPECT_FALSE(router_->CancelPending("cancel-me"));
  EXPECT_TRUE(router_->Free("free-me"));
  ASSERT_EQ(failed_.size(), 2u);
  EXPECT_EQ(failed_[0], std::make_pair(std::string("cancel-me"), absl::StatusCode::kCancelled));
  EXPECT_EQ(failed_[1], std::make_pair(std::string("free-me"), absl::StatusCode::kCancelled));
  EXPECT_EQ(router_->pending_count(), 0u);
  EXPECT_EQ(router_->pending_tokens(), 0u);
  // A waiting id may not be reused, but a cancelled one may.
  Submit("again");
  RouteOptions dup = Admit("again");
  EXPECT_EQ(router_->FindBestMatch(Tokens(3), dup).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(RouterQueueTest, BlockingCallTimesOut) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("busy");
  RouteOptions options = Admit("impatient");
  options.queue_timeout = std::chrono::milliseconds(20);
  auto d = router_->FindBestMatch(Tokens(3), options);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(router_->pending_count(), 0u);
  EXPECT_EQ(router_->active_requests(), 1u);
}

TEST_F(RouterQueueTest, BlockingCallIsCancelledByItsStopToken) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("busy");
  std::stop_source stop;
  std::optional<absl::StatusOr<RouteDecision>> result;
  std::thread caller([&] {
    RouteOptions options = Admit("waiter");
    options.stop_token = stop.get_token();
    result = router_->FindBestMatch(Tokens(3), options);
  });
  while (router_->pending_count() == 0) std::this_thread::yield();
  stop.request_stop();
  caller.join();
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(router_->pending_count(), 0u);
}

TEST_F(RouterQueueTest, BlockingCallReturnsWhenAdmitted) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("busy");
  std::optional<absl::StatusOr<RouteDecision>> result;
  std::thread caller([&] { result = router_->FindBestMatch(Tokens(3), Admit("waiter")); });
  while (router_->pending_count() == 0) std::this_thread::yield();
  EXPECT_TRUE(router_->Free("busy"));
  caller.join();
  ASSERT_TRUE(result.has_value() && result->ok());
  EXPECT_TRUE((*result)->queued);
  EXPECT_TRUE((*result)->booked);
}

TEST_F(RouterQueueTest, WaitingRequestsFailWhenNoWorkerIsLeft) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("busy");
  Submit("stranded");
  ASSERT_TRUE(router_->RemoveWorker(1).ok());
  ASSERT_EQ(failed_.size(), 1u);
  EXPECT_EQ(failed_[0].second, absl::StatusCode::kUnavailable);
  EXPECT_EQ(router_->pending_count(), 0u);
}

TEST_F(RouterQueueTest, DestroyingTheRouterCancelsWaitingCallbacks) {
  MakeQueued(QueuePolicy::kFcfs);
  Submit("busy");
  Submit("orphan");
  router_.reset();
  ASSERT_EQ(failed_.size(), 1u);
  EXPECT_EQ(failed_[0], std::make_pair(std::string("orphan"), absl::StatusCode::kCancelled));
}

}  // namespace
}  // namespace kvrouter

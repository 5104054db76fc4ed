#include "core/selector.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/random_source.h"

namespace kvrouter {
namespace {

constexpr WorkerKey kA{.worker_id = 1};
constexpr WorkerKey kB{.worker_id = 2};
constexpr WorkerKey kC{.worker_id = 3};
constexpr WorkerKey kD{.worker_id = 4};

// The worked example of dynamo-router.md §3.3, recomputed for the credit form
// (defaults: overlap_score_credit 1.0, prefill_load_scale 1.0, host weight 0.75).
// bs = 16, isl = 128 tokens = 8 blocks.
// Worker A: device 4 + 2 host-pinned blocks, no active prefill, 10 active blocks, none of the
// prompt's 8 blocks active.
//   effective overlap = 4 + 0.75·2 = 5.5 blocks → cached = round(5.5·16) = 88 tokens
//   credit            = 1.0·4 + 0.75·2 = 5.5 blocks
//   raw prefill       = (0 + 128) / 16 = 8 blocks
//   prefill cost      = 1.0·max(0, 8 − 5.5) = 2.5
//   decode blocks     = 10 + 8 = 18
//   cost              = 2.5 + 18 = 20.5
// Worker B: no overlap, 256 active prefill tokens, 4 active blocks.
//   credit = 0; raw prefill = (256 + 128) / 16 = 24; prefill cost = 24
//   decode blocks = 4 + 8 = 12; cost = 24 + 12 = 36
// A is chosen at temperature 0.
TEST(SelectorTest, WorkedExampleFromTheReference) {
  const std::vector<Candidate> candidates = {
      {.worker = kA,
       .overlap = {.device_blocks = 4, .host_blocks = 2},
       .active_prefill_tokens = 0,
       .active_blocks = 10,
       .new_blocks = 8},
      {.worker = kB, .active_prefill_tokens = 256, .active_blocks = 4, .new_blocks = 8},
  };
  SeededRandomSource random(1);
  auto selection =
      SelectWorker(SelectionInput{.prompt_tokens = 128, .block_size = 16, .candidates = candidates},
                   SelectorConfig{}, random);
  ASSERT_TRUE(selection.ok()) << selection.status();
  const CandidateCost& a = selection->costs[0];
  EXPECT_DOUBLE_EQ(a.effective_overlap_blocks, 5.5);
  EXPECT_EQ(a.cached_tokens, 88u);
  EXPECT_DOUBLE_EQ(a.credit, 5.5);
  EXPECT_DOUBLE_EQ(a.raw_prefill_blocks, 8.0);
  EXPECT_DOUBLE_EQ(a.prefill_cost, 2.5);
  EXPECT_EQ(a.decode_blocks, 18u);
  EXPECT_DOUBLE_EQ(a.cost, 20.5);
  EXPECT_EQ(a.potential_prefill_tokens, 128u - 88u);
  const CandidateCost& b = selection->costs[1];
  EXPECT_DOUBLE_EQ(b.raw_prefill_blocks, 24.0);
  EXPECT_DOUBLE_EQ(b.prefill_cost, 24.0);
  EXPECT_EQ(b.decode_blocks, 12u);
  EXPECT_DOUBLE_EQ(b.cost, 36.0);
  EXPECT_EQ(selection->winner().worker, kA);
  EXPECT_DOUBLE_EQ(a.probability, 1.0);
  EXPECT_DOUBLE_EQ(b.probability, 0.0);
}

// The credit form with every weight in play. bs = 16, isl = 160 tokens = 10 blocks,
// overlap_score_credit 0.5, prefill_load_scale 2.0, disk weight 0.25.
// Worker C: device 2, then 4 disk and 4 external blocks; 32 active prefill tokens, 0 active
// blocks, all 10 prompt blocks new.
//   effective = 2 + 0.25·(4 + 4) = 4 blocks → cached 64 tokens → potential prefill 32 + 96 = 128
//   credit    = 0.5·2 + 0.25·(4 + 4) = 1 + 2 = 3 blocks
//   raw       = (32 + 160) / 16 = 12 blocks
//   prefill   = 2.0·max(0, 12 − 3) = 18
//   decode    = 0 + 10 = 10
//   cost      = 28
TEST(SelectorTest, WorkedExampleWithScaleCreditAndLowerTiers) {
  const Candidate c{.worker = kC,
                    .overlap = {.device_blocks = 2, .disk_blocks = 4, .external_blocks = 4},
                    .active_prefill_tokens = 32,
                    .active_blocks = 0,
                    .new_blocks = 10};
  auto config = ApplyOverrides(
      SelectorConfig{}, SelectorOverrides{.overlap_score_credit = 0.5, .prefill_load_scale = 2.0});
  ASSERT_TRUE(config.ok());
  const CandidateCost cost = ScoreCandidate(c, 160, 16, *config, c.active_prefill_tokens);
  EXPECT_DOUBLE_EQ(cost.effective_overlap_blocks, 4.0);
  EXPECT_EQ(cost.cached_tokens, 64u);
  EXPECT_EQ(cost.potential_prefill_tokens, 128u);
  EXPECT_DOUBLE_EQ(cost.credit, 3.0);
  EXPECT_DOUBLE_EQ(cost.raw_prefill_blocks, 12.0);
  EXPECT_DOUBLE_EQ(cost.prefill_cost, 18.0);
  EXPECT_EQ(cost.decode_blocks, 10u);
  EXPECT_DOUBLE_EQ(cost.cost, 28.0);
}

TEST(SelectorTest, CreditBeyondThePrefillClampsAtZero) {
  // credit 3.0 × 8 device blocks = 24 > raw prefill 8: the prefill term is 0, not negative.
  const Candidate c{.worker = kA, .overlap = {.device_blocks = 8}, .active_blocks = 8};
  const CandidateCost cost =
      ScoreCandidate(c, 128, 16, SelectorConfig{.overlap_score_credit = 3.0}, 0);
  EXPECT_DOUBLE_EQ(cost.prefill_cost, 0.0);
  EXPECT_DOUBLE_EQ(cost.cost, 8.0);
}

TEST(SelectorTest, WithoutPrefillTrackingThePromptAddsNoPrefill) {
  // raw prefill = 64 / 16 = 4 (the prompt's 128 tokens are not counted); credit 1 → 3.
  const Candidate c{.worker = kA,
                    .overlap = {.device_blocks = 1},
                    .active_prefill_tokens = 64,
                    .active_blocks = 2,
                    .new_blocks = 7};
  const CandidateCost cost =
      ScoreCandidate(c, 128, 16, SelectorConfig{.track_prefill_tokens = false}, 0);
  EXPECT_DOUBLE_EQ(cost.raw_prefill_blocks, 4.0);
  EXPECT_DOUBLE_EQ(cost.prefill_cost, 3.0);
  EXPECT_EQ(cost.potential_prefill_tokens, 64u);
  EXPECT_DOUBLE_EQ(cost.cost, 3.0 + 9.0);
}

// Credit decay (Dynamo's newer cost), bs = 16, isl = 128 = 8 blocks, decay 1.0.
// Worker A: device 8, 256 prefill tokens in flight; worker B: no hit, 0 in flight (the least).
//   A: decay = 1 / (1 + 1.0·((256 − 0)/16)/8) = 1/3 → credit 8/3
//      raw = (256 + 128)/16 = 24 → prefill 24 − 8/3 = 21.33; decode 0 + 0 → cost 21.33
//   B: decay 1 → credit 0 → prefill 8; decode 0 + 8 new → cost 16
// Without decay A costs 24 − 8 = 16 + 0 and ties B: the decay says that A's hit helps less
// when the prompt waits behind 256 other tokens, and B wins.
TEST(SelectorTest, CreditDecayDiscountsHitsBehindALongPrefillQueue) {
  const Candidate a{.worker = kA, .overlap = {.device_blocks = 8}, .active_prefill_tokens = 256};
  const Candidate b{.worker = kB, .new_blocks = 8};
  const std::vector<Candidate> both = {a, b};
  const SelectionInput input{.prompt_tokens = 128, .block_size = 16, .candidates = both};
  SeededRandomSource random(1);
  auto decayed = SelectWorker(input, SelectorConfig{.overlap_score_credit_decay = 1.0}, random);
  ASSERT_TRUE(decayed.ok());
  EXPECT_DOUBLE_EQ(decayed->costs[0].credit_decay, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(decayed->costs[0].credit, 8.0 / 3.0);
  EXPECT_DOUBLE_EQ(decayed->costs[0].cost, 24.0 - 8.0 / 3.0);
  EXPECT_DOUBLE_EQ(decayed->costs[1].credit_decay, 1.0);
  EXPECT_DOUBLE_EQ(decayed->costs[1].cost, 16.0);
  EXPECT_EQ(decayed->winner().worker, kB);
  auto plain = SelectWorker(input, SelectorConfig{}, random);
  ASSERT_TRUE(plain.ok());
  EXPECT_DOUBLE_EQ(plain->costs[0].cost, 16.0);
  EXPECT_DOUBLE_EQ(plain->costs[0].credit_decay, 1.0);
  // Without prefill tracking there is no queue to measure: no decay.
  auto untracked = SelectWorker(
      input, SelectorConfig{.track_prefill_tokens = false, .overlap_score_credit_decay = 1.0},
      random);
  ASSERT_TRUE(untracked.ok());
  EXPECT_DOUBLE_EQ(untracked->costs[0].credit_decay, 1.0);
}

// decode_active_request_weight charges each request in flight. With weight 2, a rank with 10
// active blocks and 1 request (10 + 2 = 12) beats one with 4 + 1 new blocks and 4 requests
// (5 + 8 = 13); without the charge the second wins (5 < 10).
TEST(SelectorTest, ActiveRequestWeightChargesEachRequestInFlight) {
  const Candidate few{.worker = kA, .active_blocks = 10, .active_requests = 1};
  const Candidate many{.worker = kB, .active_blocks = 4, .new_blocks = 1, .active_requests = 4};
  const std::vector<Candidate> both = {few, many};
  const SelectionInput input{.prompt_tokens = 0, .block_size = 16, .candidates = both};
  SeededRandomSource random(1);
  auto weighted = SelectWorker(input, SelectorConfig{.decode_active_request_weight = 2.0}, random);
  ASSERT_TRUE(weighted.ok());
  EXPECT_DOUBLE_EQ(weighted->costs[0].request_cost, 2.0);
  EXPECT_DOUBLE_EQ(weighted->costs[0].cost, 12.0);
  EXPECT_DOUBLE_EQ(weighted->costs[1].request_cost, 8.0);
  EXPECT_DOUBLE_EQ(weighted->costs[1].cost, 13.0);
  EXPECT_EQ(weighted->winner().worker, kA);
  auto plain = SelectWorker(input, SelectorConfig{}, random);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->winner().worker, kB);  // 5 blocks < 10 without the request charge
}

TEST(SelectorTest, NewKnobsAreValidatedAndOverridable) {
  EXPECT_FALSE(ValidateSelectorConfig({.overlap_score_credit_decay = -1}).ok());
  EXPECT_FALSE(ValidateSelectorConfig({.decode_active_request_weight = NAN}).ok());
  auto config = ApplyOverrides(
      SelectorConfig{}, {.overlap_score_credit_decay = 0.5, .decode_active_request_weight = 3.0});
  ASSERT_TRUE(config.ok());
  EXPECT_DOUBLE_EQ(config->overlap_score_credit_decay, 0.5);
  EXPECT_DOUBLE_EQ(config->decode_active_request_weight, 3.0);
  EXPECT_FALSE(ApplyOverrides(SelectorConfig{}, {.decode_active_request_weight = -2}).ok());
}

TEST(SelectorTest, CachedTokensRoundTheEffectiveOverlap) {
  EXPECT_EQ(CachedTokens(5.5, 16), 88u);
  EXPECT_EQ(CachedTokens(0.25, 2), 1u);  // 0.5 rounds away from zero
  EXPECT_EQ(CachedTokens(0.75 * 3, 16), 36u);
  EXPECT_DOUBLE_EQ(
      EffectiveOverlapBlocks(
          {.device_blocks = 1, .host_blocks = 1, .disk_blocks = 1, .external_blocks = 1},
          SelectorConfig{}),
      1 + 0.75 + 0.25 + 0.25);
}

TEST(SelectorTest, TiesAtTemperatureZeroAreBrokenUniformly) {
  const std::vector<Candidate> same = {
      {.worker = kA}, {.worker = kB}, {.worker = kC}, {.worker = kD}};
  SeededRandomSource random(42);
  std::vector<int> picks(4, 0);
  constexpr int kDraws = 40'000;
  Selection selection;
  for (int i = 0; i < kDraws; ++i) {
    ASSERT_TRUE(
        SelectWorker(SelectionInput{.prompt_tokens = 32, .block_size = 16, .candidates = same},
                     SelectorConfig{}, random, selection)
            .ok());
    ++picks[selection.chosen];
  }
  for (const CandidateCost& c : selection.costs) EXPECT_DOUBLE_EQ(c.probability, 0.25);
  for (int p : picks) EXPECT_NEAR(p, kDraws / 4, kDraws / 4 * 0.05);
}

TEST(SelectorTest, SoftmaxFollowsRangeNormalisedCosts) {
  // Costs 0, 5, 10 (decode blocks only: an empty prompt adds no prefill). Range 10, T = 0.5:
  // p ∝ exp(-0/0.5), exp(-0.5/0.5), exp(-1/0.5) = 1, e^-1, e^-2.
  const std::vector<Candidate> candidates = {{.worker = kA, .active_blocks = 0},
                                             {.worker = kB, .active_blocks = 5},
                                             {.worker = kC, .active_blocks = 10}};
  const double z = 1 + std::exp(-1.0) + std::exp(-2.0);
  const double expected[] = {1 / z, std::exp(-1.0) / z, std::exp(-2.0) / z};
  SeededRandomSource random(2024);
  std::vector<int> picks(3, 0);
  constexpr int kDraws = 100'000;
  Selection selection;
  for (int i = 0; i < kDraws; ++i) {
    ASSERT_TRUE(
        SelectWorker(SelectionInput{.prompt_tokens = 0, .block_size = 16, .candidates = candidates},
                     SelectorConfig{.temperature = 0.5}, random, selection)
            .ok());
    ++picks[selection.chosen];
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(selection.costs[i].probability, expected[i], 1e-12);
    // Binomial standard deviation is at most 0.0016 here; allow about 4 of them.
    EXPECT_NEAR(picks[i] / double(kDraws), expected[i], 0.0065) << "candidate " << i;
  }
}

TEST(SelectorTest, SoftmaxScaleDoesNotDependOnTheLoadMagnitude) {
  // The same relative spread at 1000× the load gives the same probabilities.
  SeededRandomSource random(1);
  const std::vector<Candidate> small = {{.worker = kA, .active_blocks = 1},
                                        {.worker = kB, .active_blocks = 3}};
  const std::vector<Candidate> large = {{.worker = kA, .active_blocks = 1000},
                                        {.worker = kB, .active_blocks = 3000}};
  const SelectorConfig config{.temperature = 1.0};
  auto s =
      SelectWorker({.prompt_tokens = 0, .block_size = 16, .candidates = small}, config, random);
  auto l =
      SelectWorker({.prompt_tokens = 0, .block_size = 16, .candidates = large}, config, random);
  ASSERT_TRUE(s.ok() && l.ok());
  EXPECT_NEAR(s->costs[0].probability, l->costs[0].probability, 1e-12);
  EXPECT_NEAR(s->costs[0].probability, 1 / (1 + std::exp(-1.0)), 1e-12);
}

TEST(SelectorTest, SoftmaxWithEqualCostsIsUniform) {
  const std::vector<Candidate> same = {{.worker = kA}, {.worker = kB}};
  SeededRandomSource random(3);
  auto selection = SelectWorker({.prompt_tokens = 16, .block_size = 16, .candidates = same},
                                SelectorConfig{.temperature = 2.0}, random);
  ASSERT_TRUE(selection.ok());
  EXPECT_DOUBLE_EQ(selection->costs[0].probability, 0.5);
}

TEST(SelectorTest, SameSeedSameChoices) {
  const std::vector<Candidate> candidates = {{.worker = kA, .active_blocks = 1},
                                             {.worker = kB, .active_blocks = 2},
                                             {.worker = kC, .active_blocks = 2}};
  for (double temperature : {0.0, 0.7}) {
    SeededRandomSource first(99), second(99);
    for (int i = 0; i < 200; ++i) {
      const SelectionInput input{.prompt_tokens = 0, .block_size = 4, .candidates = candidates};
      auto x = SelectWorker(input, SelectorConfig{.temperature = temperature}, first);
      auto y = SelectWorker(input, SelectorConfig{.temperature = temperature}, second);
      ASSERT_TRUE(x.ok() && y.ok());
      ASSERT_EQ(x->chosen, y->chosen);
    }
  }
}

TEST(SelectorTest, AllowedSubsetRestrictsCandidates) {
  const std::vector<Candidate> candidates = {
      {.worker = kA},
      {.worker = kB, .active_blocks = 50},
      {.worker = WorkerKey{.worker_id = 2, .dp_rank = 1}, .active_blocks = 40}};
  const std::vector<uint64_t> only_b = {2};
  SeededRandomSource random(5);
  auto selection = SelectWorker({.prompt_tokens = 16,
                                 .block_size = 16,
                                 .candidates = candidates,
                                 .allowed_worker_ids = only_b},
                                SelectorConfig{}, random);
  ASSERT_TRUE(selection.ok());
  ASSERT_EQ(selection->costs.size(), 2u);  // both ranks of worker 2, not worker 1
  EXPECT_EQ(selection->winner().worker, (WorkerKey{.worker_id = 2, .dp_rank = 1}));

  const std::vector<uint64_t> nobody = {77};
  auto none = SelectWorker({.prompt_tokens = 16,
                            .block_size = 16,
                            .candidates = candidates,
                            .allowed_worker_ids = nobody},
                           SelectorConfig{}, random);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  auto empty = SelectWorker({.prompt_tokens = 16, .block_size = 16}, SelectorConfig{}, random);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kUnavailable);
}

TEST(SelectorTest, InvalidSettingsAreClearErrors) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(ValidateSelectorConfig({.overlap_score_credit = nan}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSelectorConfig({.prefill_load_scale = -1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSelectorConfig({.host_cache_hit_weight = 1.5}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSelectorConfig({.disk_cache_hit_weight = -0.1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSelectorConfig({.temperature = inf}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateSelectorConfig({.overlap_score_credit = 2.5}).ok());  // > 1 is allowed

  const auto bad_override =
      ApplyOverrides(SelectorConfig{}, SelectorOverrides{.temperature = -0.5});
  EXPECT_EQ(bad_override.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_override.status().message().find("temperature"), std::string_view::npos);

  SeededRandomSource random(1);
  const std::vector<Candidate> one = {{.worker = kA}};
  EXPECT_EQ(SelectWorker({.prompt_tokens = 16, .block_size = 0, .candidates = one},
                         SelectorConfig{}, random)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SelectorTest, OverridesReplaceOnlyWhatTheySet) {
  auto config =
      ApplyOverrides(SelectorConfig{.overlap_score_credit = 0.9, .temperature = 0.3},
                     SelectorOverrides{.host_cache_hit_weight = 0.5, .assume_kv_reuse = false});
  ASSERT_TRUE(config.ok());
  EXPECT_DOUBLE_EQ(config->overlap_score_credit, 0.9);
  EXPECT_DOUBLE_EQ(config->temperature, 0.3);
  EXPECT_DOUBLE_EQ(config->host_cache_hit_weight, 0.5);
  EXPECT_FALSE(config->assume_kv_reuse);
  EXPECT_TRUE(config->track_prefill_tokens);
}

}  // namespace
}  // namespace kvrouter

namespace kvrouter {
namespace {

// The predicted-TTFT cost, in seconds, with miss weight 2. Prompt 1,600 tokens; block size 16.
// A: 1,280 cached (80 device blocks), 4,000 tokens queued, 10k tokens/s:
//    predicted (4,000 + 320) / 10,000 = 0.432 s; cost 0.432 + 2 · 320 / 10,000 = 0.496
// B: nothing cached, idle, 10k tokens/s: predicted 0.16 s; cost 0.16 + 0.32 = 0.48 → B wins
// With miss weight 0 the cost is the prediction alone (B, 0.16 s); a twice as fast A (20k/s)
// wins at weight 2: 0.216 + 0.032 = 0.248.
TEST(SelectorTest, PredictedTtftPricesBacklogAndMissesAtTheRanksRate) {
  std::vector<Candidate> candidates = {
      {.worker = kA,
       .overlap = {.device_blocks = 80},
       .active_prefill_tokens = 4'000,
       .active_blocks = 500,
       .prefill_tokens_per_second = 10'000},
      {.worker = kB, .new_blocks = 100, .prefill_tokens_per_second = 10'000},
  };
  const SelectionInput input{.prompt_tokens = 1'600, .block_size = 16, .candidates = candidates};
  SeededRandomSource random(1);
  const SelectorConfig ttft{.cost_function = CostFunction::kPredictedTtft, .ttft_miss_weight = 2};
  auto selection = SelectWorker(input, ttft, random);
  ASSERT_TRUE(selection.ok()) << selection.status();
  EXPECT_DOUBLE_EQ(selection->costs[0].predicted_ttft_seconds, 0.432);
  EXPECT_DOUBLE_EQ(selection->costs[0].cost, 0.496);
  EXPECT_DOUBLE_EQ(selection->costs[1].predicted_ttft_seconds, 0.16);
  EXPECT_DOUBLE_EQ(selection->costs[1].cost, 0.48);
  EXPECT_EQ(selection->winner().worker, kB);
  EXPECT_EQ(selection->costs[0].prefill_tokens_per_second, 10'000);

  candidates[0].prefill_tokens_per_second = 20'000;
  selection = SelectWorker(input, ttft, random);
  ASSERT_TRUE(selection.ok());
  EXPECT_DOUBLE_EQ(selection->costs[0].cost, 0.248);
  EXPECT_EQ(selection->winner().worker, kA);

  SelectorConfig greedy = ttft;
  greedy.ttft_miss_weight = 0;
  candidates[0].prefill_tokens_per_second = 10'000;
  selection = SelectWorker(input, greedy, random);
  ASSERT_TRUE(selection.ok());
  EXPECT_DOUBLE_EQ(selection->costs[1].cost, 0.16);
  EXPECT_EQ(selection->winner().worker, kB);
  // The credit form still scores the same candidates in blocks: A's hit is worth more there.
  selection = SelectWorker(input, SelectorConfig{}, random);
  ASSERT_TRUE(selection.ok());
  EXPECT_DOUBLE_EQ(selection->costs[0].cost, (4'000 + 1'600) / 16.0 - 80 + 500);
}

// Before any rate is known every rank counts as 1 token/s: the cost is the tokens ahead.
TEST(SelectorTest, PredictedTtftWithoutRatesCountsTokens) {
  const std::vector<Candidate> candidates = {
      {.worker = kA, .active_prefill_tokens = 100},
      {.worker = kB, .active_prefill_tokens = 50},
  };
  SeededRandomSource random(1);
  auto selection =
      SelectWorker(SelectionInput{.prompt_tokens = 32, .block_size = 16, .candidates = candidates},
                   SelectorConfig{.cost_function = CostFunction::kPredictedTtft}, random);
  ASSERT_TRUE(selection.ok());
  EXPECT_DOUBLE_EQ(selection->costs[0].cost, 100 + (1 + 3) * 32);  // the default weight 3
  EXPECT_EQ(selection->winner().worker, kB);
}

TEST(SelectorTest, PredictedTtftNeedsPrefillTrackingAndAValidMissWeight) {
  SelectorConfig untracked{.track_prefill_tokens = false,
                           .cost_function = CostFunction::kPredictedTtft};
  EXPECT_EQ(ValidateSelectorConfig(untracked).code(), absl::StatusCode::kInvalidArgument);
  SelectorConfig negative{.cost_function = CostFunction::kPredictedTtft};
  negative.ttft_miss_weight = -1;
  EXPECT_EQ(ValidateSelectorConfig(negative).code(), absl::StatusCode::kInvalidArgument);
  auto overridden = ApplyOverrides(
      SelectorConfig{},
      SelectorOverrides{.cost_function = CostFunction::kPredictedTtft, .ttft_miss_weight = 0.5});
  ASSERT_TRUE(overridden.ok());
  EXPECT_EQ(overridden->cost_function, CostFunction::kPredictedTtft);
  EXPECT_EQ(overridden->ttft_miss_weight, 0.5);
}

}  // namespace
}  // namespace kvrouter

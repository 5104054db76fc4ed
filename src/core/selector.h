// Choosing a worker rank for a request: the cost of each candidate and the pick
// (shared/reference/dynamo-router.md §3.3, the NEWER credit form, and §2.6 for tier weights).
//
// Per candidate rank w, for a prompt of `isl` tokens and block size `bs`:
//   effective_overlap_w = device_w + host_cache_hit_weight * host_w
//                         + disk_cache_hit_weight * (disk_w + external_w)          [blocks]
//   cached_tokens_w     = round(effective_overlap_w * bs), at most isl
//   decay_w             = 1 / (1 + overlap_score_credit_decay
//                               * ((active_prefill_tokens_w - min over candidates) / bs)
//                               / prompt_blocks)          (1 without prefill tracking)
//   credit_w            = overlap_score_credit * decay_w * device_w + host_cache_hit_weight *
//   host_w
//                         + disk_cache_hit_weight * (disk_w + external_w)          [blocks]
//   raw_prefill_blocks_w = (active_prefill_tokens_w + isl) / bs   (without prefill tracking, the
//                          prompt adds nothing: active_prefill_tokens_w / bs)
//   decode_blocks_w     = active_blocks_w + new_blocks_w (prompt blocks the rank does not hold)
//   cost_w              = prefill_load_scale * max(0, raw_prefill_blocks_w - credit_w)
//                         + decode_blocks_w + decode_active_request_weight * active_requests_w
// The decay discounts a device hit on a rank whose prefill queue is longer than the shortest
// one's (the hit saves less when the prompt waits behind others); the request weight charges
// each request in flight beyond the blocks it holds (Dynamo's newer cost; both 0 by default).
// The predicted-TTFT cost (CostFunction::kPredictedTtft) prices a rank in seconds instead:
//   predicted_ttft_w = (active_prefill_tokens_w + uncached_w) / rate_w
//   cost_w           = predicted_ttft_w + ttft_miss_weight * uncached_w / rate_w
// predicted_ttft_w is the time until this prompt's first token if the rank prefills its backlog
// first-come first-served, then the prompt's uncached tokens (cached_tokens_w as above, every
// tier weighted), at the rank's calibrated rate (prefill_rate.h; while no rate is known every
// rank counts as 1 token/s). The second term is what the miss costs the requests that will
// queue behind it: every uncached token is prefill time that later arrivals wait for, so a
// miss weighs (1 + ttft_miss_weight) times its own delay. 0 is greedy for this request alone;
// the default 3 was tuned on the Mooncake synthetic trace and validated on others
// (docs/replay.md). The credit form's knobs do not apply; it needs prefill tracking.
//
// Temperature 0 picks the cheapest rank, ties broken uniformly at random (reservoir sampling).
// Temperature T > 0 draws from p_w ∝ exp(-(cost_w - min) / ((max - min) * T)): costs are
// normalised by their range so T means the same whatever the load; equal costs are uniform.
//
// Selection is a pure function of its inputs and the random source: it books nothing, so a
// preview and an admitted request score identically.
//
// Thread-safety: every function here is safe to call concurrently, given distinct RandomSources.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/random_source.h"
#include "core/types.h"

namespace kvrouter {

// How a candidate rank is priced (the two forms above).
enum class CostFunction : uint8_t {
  kCredit = 0,         // Dynamo's credit form (blocks)
  kPredictedTtft = 1,  // predicted time to first token (seconds)
};
constexpr std::string_view CostFunctionName(CostFunction f) {
  switch (f) {
    case CostFunction::kCredit:
      return "credit";
    case CostFunction::kPredictedTtft:
      return "predicted_ttft";
  }
  return "unknown";
}

// The knobs of one selection: the router's defaults, or those with a request's overrides.
struct SelectorConfig {
  double overlap_score_credit = 1.0;          // finite, >= 0 (> 1 allowed)
  double prefill_load_scale = 1.0;            // finite, >= 0
  double host_cache_hit_weight = 0.75;        // in [0, 1]
  double disk_cache_hit_weight = 0.25;        // in [0, 1]; also weighs external-storage hits
  double temperature = 0.0;                   // finite, >= 0
  bool assume_kv_reuse = true;                // false: book random block identities (no sharing)
  bool track_prefill_tokens = true;           // false: a prompt adds no prefill tokens
  double overlap_score_credit_decay = 0.0;    // finite, >= 0; 0 = no decay
  double decode_active_request_weight = 0.0;  // finite, >= 0; cost per active request
  CostFunction cost_function = CostFunction::kCredit;
  double ttft_miss_weight = 3.0;  // finite, >= 0; kPredictedTtft only
};

// InvalidArgument naming the first setting out of range (NaN and infinities included).
absl::Status ValidateSelectorConfig(const SelectorConfig& config);

// Per-request overrides of every SelectorConfig field; unset fields keep the router's value.
struct SelectorOverrides {
  std::optional<double> overlap_score_credit;
  std::optional<double> prefill_load_scale;
  std::optional<double> host_cache_hit_weight;
  std::optional<double> disk_cache_hit_weight;
  std::optional<double> temperature;
  std::optional<bool> assume_kv_reuse;
  std::optional<bool> track_prefill_tokens;
  std::optional<double> overlap_score_credit_decay;
  std::optional<double> decode_active_request_weight;
  std::optional<CostFunction> cost_function;
  std::optional<double> ttft_miss_weight;
};

// `base` with `overrides` applied, validated.
absl::StatusOr<SelectorConfig> ApplyOverrides(const SelectorConfig& base,
                                              const SelectorOverrides& overrides);

// How much of the prompt's prefix a rank holds, per tier, in blocks. Each tier continues after
// the previous one (§2.6).
struct TierOverlap {
  uint32_t device_blocks = 0;
  uint32_t host_blocks = 0;
  uint32_t disk_blocks = 0;
  uint32_t external_blocks = 0;
};

// Inline, like CachedTokens: a lookup computes both for every matched rank (a thousand per
// call at 1,000 workers).
inline double EffectiveOverlapBlocks(const TierOverlap& overlap, const SelectorConfig& config) {
  return overlap.device_blocks + config.host_cache_hit_weight * overlap.host_blocks +
         config.disk_cache_hit_weight * (overlap.disk_blocks + overlap.external_blocks);
}

// round(effective * block_size), half away from zero.
inline uint64_t CachedTokens(double effective_overlap_blocks, uint32_t block_size) {
  const double tokens = effective_overlap_blocks * block_size;
  // A whole number (every device-only match) needs no rounding: llround is a libm call.
  const auto whole = static_cast<uint64_t>(tokens);
  return static_cast<double>(whole) == tokens ? whole : static_cast<uint64_t>(std::llround(tokens));
}

// One rank that may serve the request, with what the selector needs to price it.
struct Candidate {
  WorkerKey worker;
  TierOverlap overlap;
  uint64_t active_prefill_tokens = 0;
  uint64_t active_blocks = 0;
  uint64_t new_blocks = 0;  // the prompt's blocks the rank would newly hold
  uint64_t active_requests = 0;
  double prefill_tokens_per_second = 0;  // the rank's calibrated rate; 0 = unknown
};

// The priced candidate: every term of its cost, so a decision can be explained.
struct CandidateCost {
  WorkerKey worker;
  TierOverlap overlap;
  double effective_overlap_blocks = 0;
  uint64_t cached_tokens = 0;
  uint64_t active_prefill_tokens = 0;
  uint64_t active_blocks = 0;
  uint64_t new_blocks = 0;
  uint64_t potential_prefill_tokens = 0;  // active + this prompt's uncached tokens
  double raw_prefill_blocks = 0;
  double credit_decay = 1;  // decay_w (1 = none)
  double credit = 0;
  double prefill_cost = 0;  // prefill_load_scale * max(0, raw_prefill_blocks - credit)
  uint64_t decode_blocks = 0;
  uint64_t active_requests = 0;
  double request_cost = 0;               // decode_active_request_weight * active_requests
  double prefill_tokens_per_second = 0;  // the rate the predicted TTFT used (0 = unknown)
  // (active_prefill_tokens + uncached) / rate: the cost under kPredictedTtft, computed either
  // way so that a decision can be explained in both forms (tokens when the rate is unknown).
  double predicted_ttft_seconds = 0;
  double cost = 0;
  double probability = 0;  // this candidate's chance of being picked
};

struct SelectionInput {
  uint64_t prompt_tokens = 0;
  uint32_t block_size = 0;
  std::span<const Candidate> candidates;
  // When not empty, only ranks of these worker ids are eligible.
  std::span<const uint64_t> allowed_worker_ids;
};

struct Selection {
  size_t chosen = 0;                 // index into `costs`
  std::vector<CandidateCost> costs;  // the eligible candidates, in input order
  const CandidateCost& winner() const { return costs[chosen]; }
};

// Prices one candidate. `min_active_prefill_tokens`: the least any candidate of the same
// selection has in flight (the credit decay's baseline; a candidate priced alone is its own).
CandidateCost ScoreCandidate(const Candidate& candidate, uint64_t prompt_tokens,
                             uint32_t block_size, const SelectorConfig& config,
                             uint64_t min_active_prefill_tokens);
// The same, written into `out` (every field).
void ScoreCandidateInto(const Candidate& candidate, uint64_t prompt_tokens, uint32_t block_size,
                        const SelectorConfig& config, uint64_t min_active_prefill_tokens,
                        CandidateCost& out);

// SelectWorker's two halves: pricing is a pure function of the candidates (the router runs it
// outside its lock), the pick draws from the random source. PriceCandidates fails as
// SelectWorker does; PickCandidate needs `priced` as PriceCandidates left it (not empty).
absl::Status PriceCandidates(const SelectionInput& input, const SelectorConfig& config,
                             Selection& out);
void PickCandidate(const SelectorConfig& config, RandomSource& random, Selection& priced);

// Prices every eligible candidate and picks one. Errors: InvalidArgument (block size 0, or an
// invalid config), Unavailable (no eligible candidate). `out` is overwritten (its capacity is
// reused).
absl::Status SelectWorker(const SelectionInput& input, const SelectorConfig& config,
                          RandomSource& random, Selection& out);
absl::StatusOr<Selection> SelectWorker(const SelectionInput& input, const SelectorConfig& config,
                                       RandomSource& random);

}  // namespace kvrouter

#include "core/selector.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvrouter {
namespace {

absl::Status CheckNonNegative(const char* name, double value) {
  if (!std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be finite and >= 0, got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckUnitInterval(const char* name, double value) {
  if (!std::isfinite(value) || value < 0 || value > 1) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be in [0, 1], got ", value));
  }
  return absl::OkStatus();
}

bool IsAllowed(uint64_t worker_id, std::span<const uint64_t> allowed) {
  return allowed.empty() || std::find(allowed.begin(), allowed.end(), worker_id) != allowed.end();
}

// Temperature 0: the cheapest candidate; among equal costs, each is kept with probability
// 1/(ties so far) as it is met, which leaves every tied candidate equally likely.
size_t PickCheapest(std::vector<CandidateCost>& costs, RandomSource& random) {
  size_t chosen = 0;
  size_t ties = 1;
  for (size_t i = 1; i < costs.size(); ++i) {
    if (costs[i].cost < costs[chosen].cost) {
      chosen = i;
      ties = 1;
    } else if (costs[i].cost == costs[chosen].cost) {
      ++ties;
      if (random.NextBelow(ties) == 0) chosen = i;
    }
  }
  const double best = costs[chosen].cost;
  for (CandidateCost& c : costs) c.probability = c.cost == best ? 1.0 / ties : 0.0;
  return chosen;
}

// Temperature > 0: softmax over costs scaled to [0, 1] by their range, so the temperature does
// not depend on how large the loads are.
size_t PickSoftmax(std::vector<CandidateCost>& costs, double temperature, RandomSource& random) {
  double lowest = costs[0].cost, highest = costs[0].cost;
  for (const CandidateCost& c : costs) {
    lowest = std::min(lowest, c.cost);
    highest = std::max(highest, c.cost);
  }
  if (lowest == highest) {
    for (CandidateCost& c : costs) c.probability = 1.0 / costs.size();
    return random.NextBelow(costs.size());
  }
  // Halving both ends keeps the range finite even for costs near the largest double.
  const double half_range = highest / 2 - lowest / 2;
  double total = 0;
  for (CandidateCost& c : costs) {
    const double normalised = (c.cost / 2 - lowest / 2) / half_range;  // in [0, 1]
    c.probability = std::exp(-normalised / temperature);
    total += c.probability;
  }
  for (CandidateCost& c : costs) c.probability /= total;
  const double u = random.NextUnit();
  double cumulative = 0;
  for (size_t i = 0; i < costs.size(); ++i) {
    cumulative += costs[i].probability;
    if (u < cumulative) return i;
  }
  return costs.size() - 1;  // rounding left the cumulative sum just below 1
}

}  // namespace

absl::Status ValidateSelectorConfig(const SelectorConfig& config) {
  if (auto s = CheckNonNegative("overlap_score_credit", config.overlap_score_credit); !s.ok()) {
    return s;
  }
  if (auto s = CheckNonNegative("prefill_load_scale", config.prefill_load_scale); !s.ok()) {
    return s;
  }
  if (auto s = CheckUnitInterval("host_cache_hit_weight", config.host_cache_hit_weight); !s.ok()) {
    return s;
  }
  if (auto s = CheckUnitInterval("disk_cache_hit_weight", config.disk_cache_hit_weight); !s.ok()) {
    return s;
  }
  if (auto s = CheckNonNegative("overlap_score_credit_decay", config.overlap_score_credit_decay);
      !s.ok()) {
    return s;
  }
  if (auto s =
          CheckNonNegative("decode_active_request_weight", config.decode_active_request_weight);
      !s.ok()) {
    return s;
  }
  if (auto s = CheckNonNegative("ttft_miss_weight", config.ttft_miss_weight); !s.ok()) return s;
  if (config.cost_function == CostFunction::kPredictedTtft && !config.track_prefill_tokens) {
    return absl::InvalidArgumentError(
        "the predicted_ttft cost function needs prefill tracking (it prices the prefill backlog)");
  }
  return CheckNonNegative("temperature", config.temperature);
}

absl::StatusOr<SelectorConfig> ApplyOverrides(const SelectorConfig& base,
                                              const SelectorOverrides& overrides) {
  SelectorConfig config = base;
  config.overlap_score_credit = overrides.overlap_score_credit.value_or(base.overlap_score_credit);
  config.prefill_load_scale = overrides.prefill_load_scale.value_or(base.prefill_load_scale);
  config.host_cache_hit_weight =
      overrides.host_cache_hit_weight.value_or(base.host_cache_hit_weight);
  config.disk_cache_hit_weight =
      overrides.disk_cache_hit_weight.value_or(base.disk_cache_hit_weight);
  config.temperature = overrides.temperature.value_or(base.temperature);
  config.assume_kv_reuse = overrides.assume_kv_reuse.value_or(base.assume_kv_reuse);
  config.track_prefill_tokens = overrides.track_prefill_tokens.value_or(base.track_prefill_tokens);
  config.overlap_score_credit_decay =
      overrides.overlap_score_credit_decay.value_or(base.overlap_score_credit_decay);
  config.decode_active_request_weight =
      overrides.decode_active_request_weight.value_or(base.decode_active_request_weight);
  config.cost_function = overrides.cost_function.value_or(base.cost_function);
  config.ttft_miss_weight = overrides.ttft_miss_weight.value_or(base.ttft_miss_weight);
  if (auto status = ValidateSelectorConfig(config); !status.ok()) return status;
  return config;
}

namespace {

// decay_w: how much of a device hit's credit a rank keeps, given how much more prefill it has
// queued than the least loaded candidate, measured in prompts of this size.
double CreditDecay(const Candidate& candidate, uint64_t prompt_tokens, uint32_t block_size,
                   const SelectorConfig& config, uint64_t min_active_prefill_tokens) {
  if (!config.track_prefill_tokens || config.overlap_score_credit_decay == 0) return 1.0;
  const double excess_blocks =
      static_cast<double>(candidate.active_prefill_tokens - min_active_prefill_tokens) / block_size;
  const double prompt_blocks =
      std::max(1.0, std::ceil(static_cast<double>(prompt_tokens) / block_size));
  return 1.0 / (1.0 + config.overlap_score_credit_decay * excess_blocks / prompt_blocks);
}

}  // namespace

CandidateCost ScoreCandidate(const Candidate& candidate, uint64_t prompt_tokens,
                             uint32_t block_size, const SelectorConfig& config,
                             uint64_t min_active_prefill_tokens) {
  CandidateCost c;
  ScoreCandidateInto(candidate, prompt_tokens, block_size, config, min_active_prefill_tokens, c);
  return c;
}

void ScoreCandidateInto(const Candidate& candidate, uint64_t prompt_tokens, uint32_t block_size,
                        const SelectorConfig& config, uint64_t min_active_prefill_tokens,
                        CandidateCost& c) {
  c.worker = candidate.worker;
  c.overlap = candidate.overlap;
  c.active_prefill_tokens = candidate.active_prefill_tokens;
  c.active_blocks = candidate.active_blocks;
  c.new_blocks = candidate.new_blocks;
  c.effective_overlap_blocks = EffectiveOverlapBlocks(candidate.overlap, config);
  c.cached_tokens = std::min(CachedTokens(c.effective_overlap_blocks, block_size), prompt_tokens);

  const uint64_t prompt_prefill = config.track_prefill_tokens ? prompt_tokens : 0;
  const uint64_t uncached = config.track_prefill_tokens ? prompt_tokens - c.cached_tokens : 0;
  c.potential_prefill_tokens = candidate.active_prefill_tokens + uncached;
  // The credit is subtracted from the prefill the whole prompt would need, so blocks the rank
  // already holds lower its cost by their tier's weight.
  c.raw_prefill_blocks =
      static_cast<double>(candidate.active_prefill_tokens + prompt_prefill) / block_size;
  c.credit_decay =
      CreditDecay(candidate, prompt_tokens, block_size, config, min_active_prefill_tokens);
  c.credit = config.overlap_score_credit * c.credit_decay * candidate.overlap.device_blocks +
             config.host_cache_hit_weight * candidate.overlap.host_blocks +
             config.disk_cache_hit_weight *
                 (candidate.overlap.disk_blocks + candidate.overlap.external_blocks);
  c.prefill_cost = config.prefill_load_scale * std::max(0.0, c.raw_prefill_blocks - c.credit);
  c.decode_blocks = candidate.active_blocks + candidate.new_blocks;
  c.active_requests = candidate.active_requests;
  c.request_cost = config.decode_active_request_weight * static_cast<double>(c.active_requests);
  c.prefill_tokens_per_second = candidate.prefill_tokens_per_second;
  const double rate = c.prefill_tokens_per_second > 0 ? c.prefill_tokens_per_second : 1.0;
  c.predicted_ttft_seconds = static_cast<double>(c.potential_prefill_tokens) / rate;
  c.cost = config.cost_function == CostFunction::kPredictedTtft
               ? c.predicted_ttft_seconds + config.ttft_miss_weight * uncached / rate
               : c.prefill_cost + static_cast<double>(c.decode_blocks) + c.request_cost;
  c.probability = 0;
}

absl::Status PriceCandidates(const SelectionInput& input, const SelectorConfig& config,
                             Selection& out) {
  out.costs.clear();
  out.chosen = 0;
  if (input.block_size == 0) return absl::InvalidArgumentError("block_size must be > 0");
  if (auto status = ValidateSelectorConfig(config); !status.ok()) return status;
  uint64_t min_active_prefill = UINT64_MAX;
  for (const Candidate& candidate : input.candidates) {
    if (!IsAllowed(candidate.worker.worker_id, input.allowed_worker_ids)) continue;
    min_active_prefill = std::min(min_active_prefill, candidate.active_prefill_tokens);
  }
  // Priced in place: a thousand candidates of 160 bytes each, built and copied, were a
  // good part of a 1,000-rank decision.
  out.costs.reserve(input.candidates.size());
  for (const Candidate& candidate : input.candidates) {
    if (!IsAllowed(candidate.worker.worker_id, input.allowed_worker_ids)) continue;
    ScoreCandidateInto(candidate, input.prompt_tokens, input.block_size, config, min_active_prefill,
                       out.costs.emplace_back());
  }
  if (out.costs.empty()) {
    return absl::UnavailableError(input.candidates.empty()
                                      ? "no worker is registered"
                                      : "no registered worker is in the allowed set");
  }
  return absl::OkStatus();
}

void PickCandidate(const SelectorConfig& config, RandomSource& random, Selection& priced) {
  priced.chosen = config.temperature == 0 ? PickCheapest(priced.costs, random)
                                          : PickSoftmax(priced.costs, config.temperature, random);
}

absl::Status SelectWorker(const SelectionInput& input, const SelectorConfig& config,
                          RandomSource& random, Selection& out) {
  if (auto status = PriceCandidates(input, config, out); !status.ok()) return status;
  PickCandidate(config, random, out);
  return absl::OkStatus();
}

absl::StatusOr<Selection> SelectWorker(const SelectionInput& input, const SelectorConfig& config,
                                       RandomSource& random) {
  Selection selection;
  if (auto status = SelectWorker(input, config, random, selection); !status.ok()) return status;
  return selection;
}

}  // namespace kvrouter

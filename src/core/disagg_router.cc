#include "core/disagg_router.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "core/scheduler_queue.h"

namespace kvrouter {

std::optional<WorkerPin> PinForPhase(const RoutingHints& hints, Phase phase) {
  std::optional<uint64_t> worker = hints.worker_id;
  std::optional<uint32_t> rank = hints.dp_rank;
  if (phase == Phase::kPrefill) {
    if (hints.prefill_worker_id) worker = hints.prefill_worker_id;
    if (hints.prefill_dp_rank) rank = hints.prefill_dp_rank;
  } else if (phase == Phase::kDecode && hints.decode_worker_id) {
    worker = hints.decode_worker_id;
  }
  if (!worker) return std::nullopt;
  return WorkerPin{.worker_id = *worker, .dp_rank = rank};
}

SelectorOverrides DecodeOverrides(SelectorOverrides overrides) {
  overrides.overlap_score_credit = 0.0;
  overrides.assume_kv_reuse = false;
  overrides.track_prefill_tokens = false;
  return overrides;
}

absl::Status ValidateDisaggOptions(const DisaggOptions& options) {
  if (!(options.max_local_prefill_ratio >= 0) || !(options.prefill_busy_threshold >= 0)) {
    return absl::InvalidArgumentError(
        "max_local_prefill_ratio and prefill_busy_threshold must be >= 0");
  }
  return absl::OkStatus();
}

DisaggRouter::DisaggRouter(Router& prefill, Router& decode, DisaggOptions options)
    : prefill_(prefill), decode_(decode), options_(options), random_(options.random_seed) {}

absl::StatusOr<std::unique_ptr<DisaggRouter>> DisaggRouter::Create(Router& prefill, Router& decode,
                                                                   DisaggOptions options) {
  if (absl::Status valid = ValidateDisaggOptions(options); !valid.ok()) return valid;
  if (prefill.block_size() != decode.block_size()) {
    return absl::InvalidArgumentError("the prefill and decode pools' block sizes differ");
  }
  return std::make_unique<DisaggRouter>(prefill, decode, options);
}

int64_t DisaggRouter::NextBootstrapRoom() {
  std::lock_guard lock(random_mu_);
  return static_cast<int64_t>(random_.NextU64() & uint64_t{std::numeric_limits<int64_t>::max()});
}

absl::StatusOr<bool> DisaggRouter::PrefillWorkerBusy(std::span<const uint32_t> tokens,
                                                     const RouteOptions& options,
                                                     double threshold) {
  if (!(threshold >= 0)) return absl::InvalidArgumentError("threshold must be >= 0");
  auto preview = prefill_.Preview(tokens, options);
  // Nowhere to prefill counts as busy (as a queue-rejected preview does in Dynamo).
  if (preview.status().code() == absl::StatusCode::kUnavailable) return true;
  if (!preview.ok()) return preview.status();
  uint64_t max_batched = 0;
  for (const WorkerConfig& worker : prefill_.Workers()) {
    if (worker.worker_id == preview->worker.worker_id) max_batched = worker.max_num_batched_tokens;
  }
  const CandidateCost& chosen = preview->candidates[preview->chosen];
  return IsOverThreshold(RankPressure{.active_prefill_tokens = chosen.potential_prefill_tokens,
                                      .max_num_batched_tokens = max_batched},
                         threshold);
}

absl::StatusOr<std::optional<PrefillPlacement>> DisaggRouter::LocalPrefillReason(
    std::span<const uint32_t> tokens, const RouteOptions& options, const RoutingHints& hints) {
  if (options_.policy == DisaggPolicy::kAlways) return std::nullopt;
  // What the decode worker would hold and carry if it prefilled the prompt itself.
  RouteOptions local = options;
  local.pin = PinForPhase(hints, Phase::kDecode);
  auto decode = decode_.Preview(tokens, local);
  if (!decode.ok()) return std::nullopt;  // no decode signal: never bypass remote prefill
  const bool guard_open =
      options_.decode_busy_threshold && decode->total_kv_blocks > 0 &&
      static_cast<double>(decode->potential_decode_blocks) <=
          *options_.decode_busy_threshold * static_cast<double>(decode->total_kv_blocks);
  if (!guard_open) return std::nullopt;

  const bool check_isl =
      options_.policy == DisaggPolicy::kIslBounding || options_.policy == DisaggPolicy::kIslOrLoad;
  const bool check_load =
      options_.policy == DisaggPolicy::kPrefillLoad || options_.policy == DisaggPolicy::kIslOrLoad;
  if (check_isl) {
    const uint64_t prompt = decode->prompt_tokens;
    const uint64_t uncached = prompt - std::min(prompt, decode->cached_tokens);
    const double ratio = prompt == 0 ? 0 : static_cast<double>(uncached) / prompt;
    if (uncached <= options_.max_local_prefill_tokens &&
        ratio <= options_.max_local_prefill_ratio) {
      return PrefillPlacement::kShortIsl;
    }
  }
  if (check_load) {
    RouteOptions prefill = options;
    prefill.pin = PinForPhase(hints, Phase::kPrefill);
    auto busy = PrefillWorkerBusy(tokens, prefill, options_.prefill_busy_threshold);
    if (!busy.ok()) return busy.status();
    if (*busy) return PrefillPlacement::kPrefillBusy;
  }
  return std::nullopt;
}

absl::StatusOr<PrefillRoute> DisaggRouter::RoutePrefill(std::span<const uint32_t> tokens,
                                                        RouteOptions options,
                                                        const RoutingHints& hints) {
  PrefillRoute route;
  if (prefill_.Workers().empty()) {
    if (options_.enforce) {
      return absl::FailedPreconditionError(
          "disaggregation is enforced but the prefill pool has no workers");
    }
    route.placement = PrefillPlacement::kNoPrefillWorkers;
    return route;
  }
  auto local = LocalPrefillReason(tokens, options, hints);
  if (!local.ok()) return local.status();
  if (*local) {
    route.placement = **local;
    return route;
  }
  options.pin = PinForPhase(hints, Phase::kPrefill);
  options.with_admission = true;
  auto decision = prefill_.FindBestMatch(tokens, options);
  if (!decision.ok()) return decision.status();
  route.decision = *std::move(decision);
  route.bootstrap_room = NextBootstrapRoom();
  return route;
}

absl::StatusOr<RouteDecision> DisaggRouter::RouteDecode(std::span<const uint32_t> tokens,
                                                        RouteOptions options, bool remote_prefill,
                                                        const RoutingHints& hints) {
  if (remote_prefill) options.overrides = DecodeOverrides(options.overrides);
  options.pin = PinForPhase(hints, Phase::kDecode);
  options.with_admission = true;
  return decode_.FindBestMatch(tokens, options);
}

}  // namespace kvrouter

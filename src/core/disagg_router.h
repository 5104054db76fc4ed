// Disaggregated serving: a prefill pool and a decode pool behind one object
// (shared/reference/dynamo-router.md §5), plus per-phase pins (§6.5).
//
// A request is prefilled on a prefill worker (selected and booked here, with a bootstrap room
// id for the KV transfer) and then decoded on a decode worker, routed with the decode overrides
// forced: its KV arrives by transfer, so prefix overlap earns no credit and its blocks are not
// shared (overlap credit 0, assume_kv_reuse false, track_prefill_tokens false). Conditional
// disaggregation may instead prefill on the decode worker when the uncached prompt is short
// (isl_bounding) or the prefill pool is busy (prefill_load), but never onto a decode worker
// that is itself busy or whose load is unknown. With no prefill workers requests run
// aggregated on the decode pool, unless disaggregation is enforced.
//
// Thread-safety: as the two Routers it routes over (internally synchronised); the random
// source for bootstrap rooms has its own mutex.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>

#include "absl/status/statusor.h"
#include "core/random_source.h"
#include "core/router.h"

namespace kvrouter {

enum class Phase : uint8_t { kAggregated = 0, kPrefill = 1, kDecode = 2 };
constexpr std::string_view PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kAggregated:
      return "aggregated";
    case Phase::kPrefill:
      return "prefill";
    case Phase::kDecode:
      return "decode";
  }
  return "unknown";
}

// Dynamo's RoutingHints pins (§6.5). Unset fields pin nothing.
struct RoutingHints {
  std::optional<uint64_t> worker_id;  // backend_instance_id: every phase's fallback
  std::optional<uint64_t> prefill_worker_id;
  std::optional<uint64_t> decode_worker_id;
  std::optional<uint32_t> dp_rank;
  std::optional<uint32_t> prefill_dp_rank;
};

// The pin a phase takes from the hints: prefill → prefill_worker_id else worker_id, rank
// prefill_dp_rank else dp_rank; decode → decode_worker_id else worker_id, rank dp_rank;
// aggregated → worker_id, dp_rank.
std::optional<WorkerPin> PinForPhase(const RoutingHints& hints, Phase phase);

// The decode phase's overrides: `overrides` with overlap credit 0 and no KV reuse or prefill
// tracking; every other field (temperature, ...) kept.
SelectorOverrides DecodeOverrides(SelectorOverrides overrides);

enum class DisaggPolicy : uint8_t {
  kAlways = 0,
  kIslBounding = 1,
  kPrefillLoad = 2,
  kIslOrLoad = 3
};
constexpr std::string_view DisaggPolicyName(DisaggPolicy policy) {
  switch (policy) {
    case DisaggPolicy::kAlways:
      return "always";
    case DisaggPolicy::kIslBounding:
      return "isl_bounding";
    case DisaggPolicy::kPrefillLoad:
      return "prefill_load";
    case DisaggPolicy::kIslOrLoad:
      return "isl_or_load";
  }
  return "unknown";
}

struct DisaggOptions {
  DisaggPolicy policy = DisaggPolicy::kAlways;
  bool enforce = false;  // no prefill workers: FailedPrecondition instead of aggregated
  uint64_t max_local_prefill_tokens = 512;
  double max_local_prefill_ratio = 1.0;
  double prefill_busy_threshold = 1.0;
  // Decode-busy guard: local prefill only on a decode rank whose potential decode blocks are at
  // most this fraction of its total_kv_blocks. Unset (or capacity unknown): never local.
  std::optional<double> decode_busy_threshold;
  uint64_t random_seed = 0;  // bootstrap room ids
};

// InvalidArgument unless max_local_prefill_ratio and prefill_busy_threshold are >= 0.
absl::Status ValidateDisaggOptions(const DisaggOptions& options);

enum class PrefillPlacement : uint8_t {
  kRemote = 0,            // booked on a prefill worker
  kNoPrefillWorkers = 1,  // aggregated on the decode pool
  kShortIsl = 2,          // policy: prefill on the decode worker
  kPrefillBusy = 3,       // policy: prefill on the decode worker
};
constexpr std::string_view PrefillPlacementName(PrefillPlacement placement) {
  switch (placement) {
    case PrefillPlacement::kRemote:
      return "remote";
    case PrefillPlacement::kNoPrefillWorkers:
      return "no_prefill_workers";
    case PrefillPlacement::kShortIsl:
      return "short_isl";
    case PrefillPlacement::kPrefillBusy:
      return "worker_busy";  // the chosen prefill worker is busy
  }
  return "unknown";
}

struct PrefillRoute {
  PrefillPlacement placement = PrefillPlacement::kRemote;
  bool remote() const { return placement == PrefillPlacement::kRemote; }
  RouteDecision decision;       // remote only: the booked prefill rank
  int64_t bootstrap_room = -1;  // remote only: uniform in [0, INT64_MAX]
};

class DisaggRouter {
 public:
  // Both routers must outlive this object.
  DisaggRouter(Router& prefill, Router& decode, DisaggOptions options);
  // The same, checked: InvalidArgument for bad options (ValidateDisaggOptions) or pools whose
  // block sizes differ (a prompt's blocks must be the same blocks in both).
  static absl::StatusOr<std::unique_ptr<DisaggRouter>> Create(Router& prefill, Router& decode,
                                                              DisaggOptions options);

  Router& prefill() { return prefill_; }
  Router& decode() { return decode_; }

  // Where to prefill; when remote, books the prefill rank under options.request_id (the caller
  // frees it on prefill() once the prefill is done). The prefill pin comes from `hints`
  // (options.pin is ignored); the policy previews the decode pool with the decode pin.
  absl::StatusOr<PrefillRoute> RoutePrefill(std::span<const uint32_t> tokens, RouteOptions options,
                                            const RoutingHints& hints = {});
  // Books the decode rank under options.request_id, pinned by the hints' decode pin; with
  // remote_prefill the decode overrides are forced.
  absl::StatusOr<RouteDecision> RouteDecode(std::span<const uint32_t> tokens, RouteOptions options,
                                            bool remote_prefill, const RoutingHints& hints = {});
  // Advisory preview: does the prefill rank selected now exceed threshold ×
  // max_num_batched_tokens? No eligible rank counts as busy. InvalidArgument unless
  // threshold >= 0.
  absl::StatusOr<bool> PrefillWorkerBusy(std::span<const uint32_t> tokens,
                                         const RouteOptions& options, double threshold);

 private:
  // The conditional-disaggregation verdict: a reason to prefill locally, or none.
  absl::StatusOr<std::optional<PrefillPlacement>> LocalPrefillReason(
      std::span<const uint32_t> tokens, const RouteOptions& options, const RoutingHints& hints);
  int64_t NextBootstrapRoom();

  Router& prefill_;
  Router& decode_;
  const DisaggOptions options_;
  std::mutex random_mu_;
  SeededRandomSource random_;
};

}  // namespace kvrouter

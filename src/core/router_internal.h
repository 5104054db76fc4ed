// What the Router's units share (router.cc, router_selection.cc, router_admission.cc,
// router_staged.cc, router_replicas.cc), and nothing else includes: a request prepared for
// pricing, a queued request, a deferred callback, and the small helpers over index matches.
#pragma once

#include <algorithm>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/router.h"

namespace kvrouter {

// A request hashed and matched against the index, ready to be priced.
struct Router::Prepared {
  std::string request_id;
  SelectorConfig config;
  bool with_admission = false;
  uint64_t prompt_tokens = 0;
  uint32_t expected_output_tokens = 0;
  double priority_jump = 0;
  std::vector<uint64_t> local_hashes;
  std::vector<uint64_t> tracking_ids;     // chained block identities; empty without KV reuse
  std::vector<uint64_t> sequence_hashes;  // only to record a booking in approximate mode
  std::vector<WorkerMatch> matches;       // in the index's order
  std::optional<std::vector<uint64_t>> allowed_worker_ids;  // unset: every worker
  std::optional<WorkerPin> pin;        // the caller's, or its session's (ApplySessionLocked)
  std::optional<WorkerKey> preferred;  // likewise
  std::optional<WorkerPin> own_pin;    // the caller's own, steered from again each time
  std::optional<WorkerKey> own_preferred;
  std::string session_id;
  SessionMode session_mode = SessionMode::kHard;
  double session_ttl_seconds = 0;
  bool hold_as_plan = false;  // booked by Plan: Commit does what a dispatch leaves behind
};

// A request waiting in the admission queue.
struct Router::Pending {
  uint64_t ticket = 0;
  Prepared prepared;
  RouteCallback done;
};

// A callback to run once the gate is released, with its result.
struct Router::Completion {
  RouteCallback done;
  absl::StatusOr<RouteDecision> result;
};

namespace router_internal {

inline absl::string_view AsAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

inline TierOverlap OverlapOf(const WorkerMatch& match) {
  return TierOverlap{.device_blocks = match.device_blocks,
                     .host_blocks = match.host_hits,
                     .disk_blocks = match.disk_hits,
                     .external_blocks = match.external_hits};
}

// A linear search: for one rank (a decision over every rank aligns them instead, with
// ActiveSequences::AlignToRanks).
inline const WorkerMatch* FindMatch(std::span<const WorkerMatch> matches, WorkerKey worker) {
  auto it = std::find_if(matches.begin(), matches.end(),
                         [&](const WorkerMatch& m) { return m.worker == worker; });
  return it != matches.end() ? &*it : nullptr;
}

// Unset allows every worker; a list (even an empty one) only the workers it names.
inline bool IsAllowed(uint64_t worker_id, const std::optional<std::vector<uint64_t>>& allowed) {
  return !allowed || std::find(allowed->begin(), allowed->end(), worker_id) != allowed->end();
}

}  // namespace router_internal
}  // namespace kvrouter

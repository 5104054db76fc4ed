#include "core/scheduler_queue.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvrouter {

absl::StatusOr<QueuePolicy> ParseQueuePolicy(std::string_view name) {
  const std::string lower = absl::AsciiStrToLower(absl::string_view(name.data(), name.size()));
  if (lower == "fcfs") return QueuePolicy::kFcfs;
  if (lower == "lcfs") return QueuePolicy::kLcfs;
  if (lower == "wspt") return QueuePolicy::kWspt;
  return absl::InvalidArgumentError(absl::StrCat("unknown queue policy '",
                                                 absl::string_view(name.data(), name.size()),
                                                 "' (expected fcfs, lcfs or wspt)"));
}

double QueueKey(QueuePolicy policy, const QueueKeyInputs& inputs) {
  const double jump = std::max(inputs.priority_jump, 0.0);
  switch (policy) {
    case QueuePolicy::kFcfs:
      return jump - inputs.arrival_offset_seconds;
    case QueuePolicy::kLcfs:
      return jump + inputs.arrival_offset_seconds;
    case QueuePolicy::kWspt: {
      const uint64_t cached = std::min(inputs.best_cached_tokens, inputs.prompt_tokens);
      const uint64_t work = std::max<uint64_t>(1, inputs.prompt_tokens - cached);
      return (1 + jump) / static_cast<double>(work);
    }
  }
  return 0;
}

bool IsOverThreshold(const RankPressure& rank, double threshold) {
  const uint64_t capacity =
      rank.max_num_batched_tokens == 0 ? kDefaultMaxBatchedTokens : rank.max_num_batched_tokens;
  return static_cast<double>(rank.active_prefill_tokens) >
         threshold * static_cast<double>(capacity);
}

bool AllOverThreshold(std::span<const RankPressure> ranks, double threshold) {
  if (ranks.empty()) return false;
  return std::all_of(ranks.begin(), ranks.end(),
                     [threshold](const RankPressure& r) { return IsOverThreshold(r, threshold); });
}

}  // namespace kvrouter

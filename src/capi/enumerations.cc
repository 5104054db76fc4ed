// The C ABI's enumerations (the X-macro lists of kvrouter.h) checked against the core's own
// enumerations at compile time: each C value must name, in the core, what its C name says.
// Nothing here runs; a renumbering on either side fails the build.
#include <absl/status/status.h>

#include <string_view>

#include "core/disagg_router.h"
#include "core/radix_index.h"
#include "core/router.h"
#include "core/scheduler_queue.h"
#include "core/types.h"
#include "ingest/ingest_service.h"
#include "kvrouter.h"

namespace kvrouter::capi {
namespace {

// `upper` (a C name such as HOST_PINNED) is `lower` (the core's host_pinned) in lower case.
constexpr bool SameName(std::string_view upper, std::string_view lower) {
  if (upper.size() != lower.size()) return false;
  for (size_t i = 0; i < upper.size(); ++i) {
    const char c = upper[i] >= 'A' && upper[i] <= 'Z' ? upper[i] - 'A' + 'a' : upper[i];
    if (c != lower[i]) return false;
  }
  return true;
}

#define KVR_CHECK_NAME_(core_name, core_type, c_name, value)                \
  static_assert(SameName(c_name, core_name(static_cast<core_type>(value))), \
                "the C value " #value " of " c_name " means something else in the core");

#define KVR_CHECK_TIER_(name, value, description) KVR_CHECK_NAME_(TierName, Tier, #name, value)
KVR_TIER_MAP(KVR_CHECK_TIER_)
#define KVR_CHECK_EVENT_KIND_(name, value, description) \
  KVR_CHECK_NAME_(EventKindName, EventKind, #name, value)
KVR_EVENT_KIND_MAP(KVR_CHECK_EVENT_KIND_)
#define KVR_CHECK_EVENT_OUTCOME_(name, value, description) \
  KVR_CHECK_NAME_(EventErrorName, EventError, #name, value)
KVR_EVENT_OUTCOME_MAP(KVR_CHECK_EVENT_OUTCOME_)
#define KVR_CHECK_QUEUE_POLICY_(name, value, description) \
  KVR_CHECK_NAME_(QueuePolicyName, QueuePolicy, #name, value)
KVR_QUEUE_POLICY_MAP(KVR_CHECK_QUEUE_POLICY_)
#define KVR_CHECK_COST_FUNCTION_(name, value, description) \
  KVR_CHECK_NAME_(CostFunctionName, CostFunction, #name, value)
KVR_COST_FUNCTION_MAP(KVR_CHECK_COST_FUNCTION_)
#define KVR_CHECK_INGEST_REJECT_(name, value, description) \
  KVR_CHECK_NAME_(IngestRejectName, IngestReject, #name, value)
KVR_INGEST_REJECT_MAP(KVR_CHECK_INGEST_REJECT_)
#define KVR_CHECK_PHASE_(name, value, description) KVR_CHECK_NAME_(PhaseName, Phase, #name, value)
KVR_PHASE_MAP(KVR_CHECK_PHASE_)
#define KVR_CHECK_SESSION_MODE_(name, value, description) \
  KVR_CHECK_NAME_(SessionModeName, SessionMode, #name, value)
KVR_SESSION_MODE_MAP(KVR_CHECK_SESSION_MODE_)
#define KVR_CHECK_DISAGG_POLICY_(name, value, description) \
  KVR_CHECK_NAME_(DisaggPolicyName, DisaggPolicy, #name, value)
KVR_DISAGG_POLICY_MAP(KVR_CHECK_DISAGG_POLICY_)
#define KVR_CHECK_PREFILL_REASON_(name, value, description) \
  KVR_CHECK_NAME_(PrefillPlacementName, PrefillPlacement, #name, value)
KVR_PREFILL_REASON_MAP(KVR_CHECK_PREFILL_REASON_)

// The core has as many values as the C lists, and the fixed array dimensions hold them all.
#define KVR_COUNT_(name, value, description) +1
static_assert(0 KVR_TIER_MAP(KVR_COUNT_) == kNumTiers);
static_assert(0 KVR_EVENT_KIND_MAP(KVR_COUNT_) == kNumEventKinds);
static_assert(0 KVR_EVENT_OUTCOME_MAP(KVR_COUNT_) == kNumEventErrors);
static_assert(kNumEventKinds <= KVR_EVENT_KINDS && kNumEventErrors <= KVR_EVENT_OUTCOMES);
static_assert(0 KVR_INGEST_REJECT_MAP(KVR_COUNT_) == kNumIngestRejects);
static_assert(0 KVR_QUEUE_POLICY_MAP(KVR_COUNT_) == 3);   // fcfs, lcfs, wspt: every core policy
static_assert(0 KVR_COST_FUNCTION_MAP(KVR_COUNT_) == 2);  // credit, predicted_ttft
static_assert(kNumIngestRejects <= KVR_INGEST_REJECT_REASONS);

// Status codes below 100 are absl::StatusCode's numbers, so mapping one is a cast.
static_assert(KVR_CANCELLED == static_cast<int>(absl::StatusCode::kCancelled));
static_assert(KVR_INVALID_ARGUMENT == static_cast<int>(absl::StatusCode::kInvalidArgument));
static_assert(KVR_DEADLINE_EXCEEDED == static_cast<int>(absl::StatusCode::kDeadlineExceeded));
static_assert(KVR_NOT_FOUND == static_cast<int>(absl::StatusCode::kNotFound));
static_assert(KVR_ALREADY_EXISTS == static_cast<int>(absl::StatusCode::kAlreadyExists));
static_assert(KVR_RESOURCE_EXHAUSTED == static_cast<int>(absl::StatusCode::kResourceExhausted));
static_assert(KVR_FAILED_PRECONDITION == static_cast<int>(absl::StatusCode::kFailedPrecondition));
static_assert(KVR_UNIMPLEMENTED == static_cast<int>(absl::StatusCode::kUnimplemented));
static_assert(KVR_INTERNAL == static_cast<int>(absl::StatusCode::kInternal));
static_assert(KVR_UNAVAILABLE == static_cast<int>(absl::StatusCode::kUnavailable));

}  // namespace
}  // namespace kvrouter::capi

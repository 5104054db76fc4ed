// Routing policies compared by the replay. The kvrouter ones route every request through the
// real router via its C ABI (include/kvrouter.h), exactly as a gateway would: find_best_match
// with admission, mark_prefill_completed at the first token, free_request at the end, and (except
// in approximate mode) every KV event the simulated engines publish. The others are the usual
// baselines, plus a prefix-only foil that shows why load must be part of the score.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvrouter.h"
#include "replay/event_path.h"
#include "replay/sim_engine.h"

namespace kvrouter::replay {

enum class PolicyKind {
  kKvRouter,         // kvr_find_best_match with KVR_REQUEST_ADMIT, router defaults
  kKvRouterSoftmax,  // same with a temperature
  kKvRouterApprox,   // KVR_ROUTER_APPROXIMATE: no KV events, the router records its decisions
  kKvRouterTtft,     // KVR_COST_PREDICTED_TTFT: each rank's predicted time to first token
  kRoundRobin,
  kRandom,
  kLeastLoaded,  // fewest requests in flight (waiting or running) on the engine
  kLeastTokens,  // fewest prompt tokens waiting for their first token on the engine
  kPrefixOnly,   // most cached prefix per kvr_router_overlap_scores; load ignored
};

struct PolicySpec {
  std::string name;
  PolicyKind kind = PolicyKind::kKvRouter;
  double temperature = 0;  // the router's (kvrouter policies); 0 = argmin
};

// "all" (or empty) is every policy. Names: kvrouter, kvrouter-softmax, kvrouter-approx,
// kvrouter-ttft, round-robin, random, least-loaded, least-tokens, prefix-only. kvrouter-softmax
// gets `softmax_temperature`, the other kvrouter policies 0; `temperatures`
// ("kvrouter=0.1,kvrouter-approx=0.2", may be empty) sets any kvrouter policy's. Throws
// std::invalid_argument naming an unknown policy, a temperature for a policy without a router
// temperature, or a bad value.
std::vector<PolicySpec> ParsePolicies(const std::string& list, double softmax_temperature,
                                      const std::string& temperatures = "");

// Router-wide settings of the kvrouter policies' routers (kvr_router_options). An unset one
// keeps the library's default (kvr_router_options_init: Dynamo's).
struct RouterSettings {
  std::optional<double> overlap_score_credit;
  std::optional<double> prefill_load_scale;
  std::optional<double> overlap_score_credit_decay;
  std::optional<double> decode_active_request_weight;
  std::optional<double> host_cache_hit_weight;  // credit of a block on a worker's host tier
  std::optional<double> ttft_miss_weight;       // the predicted-TTFT cost's (kvrouter-ttft)
  // Requests wait at the gateway while every worker's booked prefill tokens exceed threshold ×
  // max_num_batched_tokens. Unset or negative: never.
  std::optional<double> queue_threshold;
  bool assume_kv_reuse = true;       // false: KVR_ROUTER_NO_KV_REUSE
  bool track_prefill_tokens = true;  // false: KVR_ROUTER_NO_PREFILL_TRACKING
};

// Writes `settings` over `options` (initialised by kvr_router_options_init).
void ApplyRouterSettings(const RouterSettings& settings, kvr_router_options& options);

// Throws std::invalid_argument with the router's message if it refuses `settings` (checked by
// creating a router with them, so the rules are the library's own).
void CheckRouterSettings(const RouterSettings& settings, uint32_t block_size);

// The engines as a policy may see them (the load a cache-blind balancer uses).
class FleetView {
 public:
  virtual ~FleetView() = default;
  virtual uint32_t workers() const = 0;
  virtual size_t InFlight(uint32_t worker) const = 0;
  virtual uint64_t PendingPromptTokens(uint32_t worker) const = 0;
};

struct PolicyContext {
  uint32_t workers = 8;
  EngineLimits limits;
  uint64_t seed = 0;
  const FleetView* fleet = nullptr;
  EventTransport transport;  // how KV events reach the router
  // kvrouter policies: requests arrive at `gateways` router replicas in turn (each with its own
  // router, each ingesting every KV event); with replica_sync they publish their bookings to
  // each other (kvr_router_set_replica_publisher / kvr_router_apply_replica_event).
  uint32_t gateways = 1;
  bool replica_sync = true;
  RouterSettings router;
};

// Counts of what the router made of the events and calls it got.
struct RouterCounters {
  uint64_t events_stored = 0;
  uint64_t events_removed = 0;
  uint64_t events_rejected = 0;  // an event the router refused (see the ABI's apply_*)
};

class Policy {
 public:
  // What Route returns when the router queues the request (RouterSettings::queue_threshold):
  // the gateway holds it and routes it again after the next prefill completion or finish.
  static constexpr uint32_t kQueued = std::numeric_limits<uint32_t>::max();

  virtual ~Policy() = default;
  // The worker for `request`, whose prompt is `tokens`, or kQueued.
  virtual uint32_t Route(const Request& request, std::span<const uint32_t> tokens) = 0;
  // The cached tokens the policy expected on the worker it picked (router policies); -1 if it
  // has no such estimate. Valid after Route.
  virtual int64_t predicted_cached_tokens() const { return -1; }
  // The simulated time (seconds) moved to `now_s`: routers that time things (the prefill rates
  // of the predicted-TTFT cost) follow it. Called before whatever happens at that time.
  virtual void SetTime(double now_s) {}
  // Right after Route, outside the decision's timing: what a gateway does in the background
  // (e.g. other replicas applying the booking it published).
  virtual void AfterRoute() {}
  virtual void OnStored(uint32_t worker, const StoredRun& run) {}
  virtual void OnRemoved(uint32_t worker, std::span<const uint64_t> block_hashes, Tier tier) {}
  virtual void OnFirstToken(const Request& request) {}
  virtual void OnFinished(const Request& request) {}
  virtual RouterCounters counters() const { return {}; }
};

// Throws std::runtime_error with the router's message if the router cannot be set up.
std::unique_ptr<Policy> MakePolicy(const PolicySpec& spec, const PolicyContext& context);

// The request id the kvrouter policies book a request under.
std::string RequestId(uint32_t index);

}  // namespace kvrouter::replay

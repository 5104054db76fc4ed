// Routing policies compared by the replay. The kvrouter ones route every request through the
// real router via its C ABI (include/kvrouter.h), exactly as a gateway would: find_best_match
// with admission, mark_prefill_completed at the first token, free_request at the end, and (except
// in approximate mode) every KV event the simulated engines publish. The others are the usual
// baselines, plus a prefix-only foil that shows why load must be part of the score.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvrouter/event_path.h"
#include "kvrouter/sim_engine.h"

namespace kvrouter::replay {

enum class PolicyKind {
  kKvRouter,         // kvr_find_best_match with KVR_REQUEST_ADMIT, router defaults
  kKvRouterSoftmax,  // same with a temperature
  kKvRouterApprox,   // KVR_ROUTER_APPROXIMATE: no KV events, the router records its decisions
  kRoundRobin,
  kRandom,
  kLeastLoaded,  // fewest requests in flight (waiting or running) on the engine
  kPrefixOnly,   // most cached prefix per kvr_router_overlap_scores; load ignored
};

struct PolicySpec {
  std::string name;
  PolicyKind kind = PolicyKind::kKvRouter;
  double temperature = 0;
};

// "all" (or empty) is every policy. Names: kvrouter, kvrouter-softmax, kvrouter-approx,
// round-robin, random, least-loaded, prefix-only. Throws std::invalid_argument naming an
// unknown one.
std::vector<PolicySpec> ParsePolicies(const std::string& list, double temperature);

// The engines as a policy may see them (the load a cache-blind balancer uses).
class FleetView {
 public:
  virtual ~FleetView() = default;
  virtual uint32_t workers() const = 0;
  virtual size_t InFlight(uint32_t worker) const = 0;
};

struct PolicyContext {
  uint32_t workers = 8;
  EngineLimits limits;
  uint64_t seed = 0;
  const FleetView* fleet = nullptr;
  Transport transport = Transport::kInProcess;  // how KV events reach the router
  // kvrouter policies: requests arrive at `gateways` router replicas in turn (each with its own
  // router, each ingesting every KV event); with replica_sync they publish their bookings to
  // each other (kvr_router_set_replica_publisher / kvr_router_apply_replica_event).
  uint32_t gateways = 1;
  bool replica_sync = true;
};

// Counts of what the router made of the events and calls it got.
struct RouterCounters {
  uint64_t events_stored = 0;
  uint64_t events_removed = 0;
  uint64_t events_rejected = 0;  // an event the router refused (see the ABI's apply_*)
};

class Policy {
 public:
  virtual ~Policy() = default;
  // The worker for `request`, whose prompt is `tokens`.
  virtual uint32_t Route(const Request& request, std::span<const uint32_t> tokens) = 0;
  // The cached tokens the policy expected on the worker it picked (router policies); -1 if it
  // has no such estimate. Valid after Route.
  virtual int64_t predicted_cached_tokens() const { return -1; }
  // Right after Route, outside the decision's timing: what a gateway does in the background
  // (e.g. other replicas applying the booking it published).
  virtual void AfterRoute() {}
  virtual void OnStored(uint32_t worker, const StoredRun& run) {}
  virtual void OnRemoved(uint32_t worker, std::span<const uint64_t> block_hashes) {}
  virtual void OnFirstToken(const Request& request) {}
  virtual void OnFinished(const Request& request) {}
  virtual RouterCounters counters() const { return {}; }
};

// Throws std::runtime_error with the router's message if the router cannot be set up.
std::unique_ptr<Policy> MakePolicy(const PolicySpec& spec, const PolicyContext& context);

// The request id the kvrouter policies book a request under.
std::string RequestId(uint32_t index);

}  // namespace kvrouter::replay

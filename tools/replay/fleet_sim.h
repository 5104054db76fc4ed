// The discrete-event fleet simulation: one routing policy, N simulated engines, one trace.
//
// Time is simulated: the loop jumps from one event to the next (a request arriving, an engine
// step ending), so an hour of trace takes seconds. At equal times, step ends come before
// arrivals and lower worker ids before higher ones, which with seeded randomness makes a run
// reproducible bit for bit. Each policy gets fresh engines and its own router, so policies can
// run on separate threads without sharing anything.
#pragma once

#include <atomic>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "replay/cost_model.h"
#include "replay/policies.h"
#include "replay/sim_engine.h"
#include "replay/trace/mooncake_trace.h"

namespace kvrouter::replay {

struct ReplayConfig {
  uint32_t workers = 8;
  EngineLimits limits;
  CostModel cost;
  double time_scale = 1.0;  // arrival speed-up: 2 replays the trace twice as fast
  uint64_t seed = 42;
  EventTransport transport;  // how engines' KV events reach the router
  uint32_t gateways = 1;     // router replicas per kvrouter policy
  bool replica_sync = true;  // replicas share their bookings
  RouterSettings router;     // the kvrouter policies' router options
  // KV events reach the policy this long (simulated) after the engine's change, and each is
  // lost with this probability (drawn from `seed`): a lagging or lossy event plane.
  double event_delay_s = 0;
  double event_loss = 0;
};

// Everything measured for one policy. The wall-clock part is kept apart (see WallClock) so that
// the rest is a pure function of the trace, the config and the seed.
struct PolicyResult {
  std::string name;
  double temperature = 0;
  double time_scale = 1.0;  // the load it ran at (ReplayConfig::time_scale)
  uint64_t requests = 0;
  uint64_t prompt_tokens = 0;
  uint64_t cached_tokens = 0;                   // prefix-cache hits at admission (prefill saved)
  uint64_t host_cached_tokens = 0;              // of which reloaded from the host tier
  int64_t predicted_cached_tokens = -1;         // Σ the policy's own estimate, -1 if it has none
  uint64_t queued_requests = 0;                 // held at the gateway by the router's queue
  uint64_t events_lost = 0;                     // KV events dropped (ReplayConfig::event_loss)
  bool preemption = false;                      // the engines could preempt (EngineLimits)
  uint64_t preemptions = 0;                     // requests preempted (recomputed), all engines
  uint64_t recompute_tokens = 0;                // tokens prefilled again after a preemption
  std::vector<uint64_t> worker_prefill_tokens;  // computed (not cached) prompt tokens
  std::vector<uint64_t> worker_requests;
  std::vector<double> ttft_s;  // sorted
  std::vector<double> e2e_s;   // sorted
  double makespan_s = 0;       // simulated time until the last request ended
  uint64_t engine_steps = 0;
  RouterCounters router;

  struct WallClock {
    std::vector<double> decision_us;  // sorted; around the routing call only
    double run_seconds = 0;
  } wall;
};

// Requests finished so far, for a progress display on another thread.
using ProgressCounter = std::atomic<uint64_t>;

// Replays `trace` under one policy. Throws std::runtime_error if the router fails or a request
// can never fit an engine's KV cache (check with CheckCapacity first for a clear message).
PolicyResult RunPolicy(const std::vector<trace::TraceRecord>& trace, const PolicySpec& policy,
                       const ReplayConfig& config, ProgressCounter* progress = nullptr);

// Throws std::invalid_argument naming the first request whose prompt and output do not fit one
// worker's KV capacity (it could never be admitted).
void CheckCapacity(const std::vector<trace::TraceRecord>& trace, const EngineLimits& limits);

}  // namespace kvrouter::replay

#include "replay/fleet_sim.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <limits>
#include <memory>
#include <stdexcept>

namespace kvrouter::replay {
namespace {

using Stopwatch = std::chrono::steady_clock;

double MicrosSince(Stopwatch::time_point start) {
  return std::chrono::duration<double, std::micro>(Stopwatch::now() - start).count();
}

std::vector<Request> MakeRequests(const std::vector<trace::TraceRecord>& trace, double time_scale) {
  std::vector<Request> requests(trace.size());
  for (size_t i = 0; i < trace.size(); ++i) {
    Request& request = requests[i];
    request.index = static_cast<uint32_t>(i);
    request.record = &trace[i];
    request.arrival_s = static_cast<double>(trace[i].timestamp_ms) / 1000.0 / time_scale;
    request.prompt_tokens = static_cast<uint32_t>(trace::ExpandedLength(trace[i]));
    request.output_tokens = static_cast<uint32_t>(std::max<uint64_t>(1, trace[i].output_length));
  }
  return requests;
}

// Runs the event loop and forwards engine events to the policy.
class FleetSimulation final : public EngineObserver, public FleetView {
 public:
  FleetSimulation(const std::vector<trace::TraceRecord>& trace, const PolicySpec& spec,
                  const ReplayConfig& config, ProgressCounter* progress)
      : config_(config),
        progress_(progress),
        requests_(MakeRequests(trace, config.time_scale)),
        // Apart from the policies' own draws (which use `seed` as it is).
        loss_random_(config.seed ^ 0x1055'e7e7'5eed'0001ULL) {
    for (uint32_t w = 0; w < config.workers; ++w) {
      engines_.push_back(std::make_unique<SimEngine>(w, config.limits, config.cost, *this));
    }
    policy_ = MakePolicy(spec, PolicyContext{.workers = config.workers,
                                             .limits = config.limits,
                                             .seed = config.seed,
                                             .fleet = this,
                                             .transport = config.transport,
                                             .gateways = config.gateways,
                                             .replica_sync = config.replica_sync,
                                             .router = config.router});
    result_.name = spec.name;
    result_.temperature = spec.temperature;
    result_.time_scale = config.time_scale;
    result_.preemption = config.limits.preemption;
    result_.worker_prefill_tokens.assign(config.workers, 0);
    result_.worker_requests.assign(config.workers, 0);
  }

  PolicyResult Run() {
    const auto started = Stopwatch::now();
    // The routers' clocks start at simulated time 0 too (the first arrivals are at 0, where
    // AdvanceTo sees no change), so no booking is ever timed on the wall clock.
    policy_->SetTime(0);
    size_t next_arrival = 0;
    while (true) {
      const double arrival =
          next_arrival < requests_.size() ? requests_[next_arrival].arrival_s : SimEngine::kIdle;
      SimEngine* engine = EarliestStep();
      const double step_end = engine != nullptr ? engine->step_end() : SimEngine::kIdle;
      if (arrival == SimEngine::kIdle && step_end == SimEngine::kIdle) break;
      if (step_end <= arrival) {
        AdvanceTo(step_end);
        engine->FinishStep();
        engine->MaybeStartStep(step_end);
        if (retry_queued_) DispatchQueued(step_end);
      } else {
        AdvanceTo(arrival);
        Arrive(requests_[next_arrival++]);
      }
    }
    Summarise();
    result_.wall.run_seconds = MicrosSince(started) / 1e6;
    return std::move(result_);
  }

  void AdvanceTo(double now) {
    if (now != now_) policy_->SetTime(now);
    now_ = now;
  }

  // FleetView.
  uint32_t workers() const override { return config_.workers; }
  size_t InFlight(uint32_t worker) const override { return engines_[worker]->in_flight(); }
  uint64_t PendingPromptTokens(uint32_t worker) const override {
    return engines_[worker]->pending_prompt_tokens();
  }

  // EngineObserver. KV events go to the policy at once, or are lost, or wait in pending_
  // until a routing decision at or after their delivery time.
  void OnStored(uint32_t worker, const StoredRun& run) override {
    if (Lost()) return;
    if (config_.event_delay_s <= 0) return policy_->OnStored(worker, run);
    pending_.push_back({.at = now_ + config_.event_delay_s,
                        .worker = worker,
                        .stored = true,
                        .tier = run.tier,
                        .has_parent = run.has_parent,
                        .parent_hash = run.parent_hash,
                        .hashes = {run.block_hashes.begin(), run.block_hashes.end()},
                        .tokens = {run.token_ids.begin(), run.token_ids.end()}});
  }
  void OnRemoved(uint32_t worker, std::span<const uint64_t> hashes, Tier tier) override {
    if (Lost()) return;
    if (config_.event_delay_s <= 0) return policy_->OnRemoved(worker, hashes, tier);
    pending_.push_back({.at = now_ + config_.event_delay_s,
                        .worker = worker,
                        .stored = false,
                        .tier = tier,
                        .hashes = {hashes.begin(), hashes.end()},
                        .tokens = {}});
  }
  // A prefill completion or a finish can end the router's reason to queue: the requests the
  // gateway holds are routed again once the step is done (not from inside it).
  void OnFirstToken(Request& request) override {
    policy_->OnFirstToken(request);
    retry_queued_ = !queued_.empty();
  }
  void OnFinished(Request& request) override {
    policy_->OnFinished(request);
    retry_queued_ = !queued_.empty();
    if (progress_ != nullptr) progress_->fetch_add(1, std::memory_order_relaxed);
  }

 private:
  // The engine whose step ends first (lowest worker id on a tie), or null if all are idle.
  SimEngine* EarliestStep() const {
    SimEngine* earliest = nullptr;
    for (const auto& engine : engines_) {
      if (engine->stepping() &&
          (earliest == nullptr || engine->step_end() < earliest->step_end())) {
        earliest = engine.get();
      }
    }
    return earliest;
  }

  // A KV event on its way to the router (with --event-delay-ms).
  struct PendingEvent {
    double at;  // when it reaches the router
    uint32_t worker;
    bool stored;  // else removed
    Tier tier = Tier::kDevice;
    bool has_parent = false;
    uint64_t parent_hash = 0;
    std::vector<uint64_t> hashes;
    std::vector<uint32_t> tokens;
  };

  bool Lost() {
    if (config_.event_loss <= 0) return false;
    // 53 random bits as a uniform double in [0, 1): the same on every standard library.
    const double draw = static_cast<double>(loss_random_() >> 11) * 0x1.0p-53;
    if (draw >= config_.event_loss) return false;
    ++result_.events_lost;
    return true;
  }

  // Hands the policy every pending event due by `now`, in the order the engines published them
  // (one delay for all keeps them in time order).
  void DeliverEvents(double now) {
    while (!pending_.empty() && pending_.front().at <= now) {
      const PendingEvent& event = pending_.front();
      if (event.stored) {
        policy_->OnStored(event.worker, StoredRun{.tier = event.tier,
                                                  .has_parent = event.has_parent,
                                                  .parent_hash = event.parent_hash,
                                                  .block_hashes = event.hashes,
                                                  .token_ids = event.tokens});
      } else {
        policy_->OnRemoved(event.worker, event.hashes, event.tier);
      }
      pending_.pop_front();
    }
  }

  void Arrive(Request& request) {
    // Behind requests the gateway holds, a new one waits its turn (first come, first served).
    if (!queued_.empty() || !Dispatch(request, request.arrival_s)) {
      queued_.push_back(&request);
      ++result_.queued_requests;
    }
  }

  // Routes the held requests, oldest first, until the router queues one again.
  void DispatchQueued(double now) {
    retry_queued_ = false;
    while (!queued_.empty() && Dispatch(*queued_.front(), now)) queued_.pop_front();
  }

  // Routes `request` and hands it to its engine at `now`; false if the router queues it.
  bool Dispatch(Request& request, double now) {
    trace::ExpandTokensInto(*request.record, config_.limits.block_size, tokens_);
    DeliverEvents(now);
    const auto started = Stopwatch::now();
    const uint32_t worker = policy_->Route(request, tokens_);
    result_.wall.decision_us.push_back(MicrosSince(started));
    policy_->AfterRoute();  // background work a gateway does off the decision path
    if (worker == Policy::kQueued) return false;
    if (worker >= config_.workers) {
      throw std::runtime_error("policy " + result_.name + " picked unknown worker " +
                               std::to_string(worker));
    }
    const int64_t predicted = policy_->predicted_cached_tokens();
    if (predicted >= 0) {
      predicted_sum_ += predicted;
      has_prediction_ = true;
    }
    SimEngine& engine = *engines_[worker];
    engine.Enqueue(&request);
    engine.MaybeStartStep(now);
    return true;
  }

  void Summarise() {
    for (const Request& request : requests_) {
      if (request.finish_s < 0) {
        throw std::runtime_error("request " + std::to_string(request.index) + " never finished");
      }
      ++result_.requests;
      result_.prompt_tokens += request.prompt_tokens;
      result_.cached_tokens += request.cached_tokens;
      result_.host_cached_tokens += request.host_cached_tokens;
      result_.worker_requests[request.worker] += 1;
      result_.ttft_s.push_back(request.first_token_s - request.arrival_s);
      result_.e2e_s.push_back(request.finish_s - request.arrival_s);
      result_.makespan_s = std::max(result_.makespan_s, request.finish_s);
    }
    for (uint32_t w = 0; w < config_.workers; ++w) {
      result_.worker_prefill_tokens[w] = engines_[w]->prefill_tokens_computed();
      result_.engine_steps += engines_[w]->steps();
      result_.preemptions += engines_[w]->preemptions();
      result_.recompute_tokens += engines_[w]->recompute_tokens();
    }
    result_.predicted_cached_tokens = has_prediction_ ? predicted_sum_ : -1;
    result_.router = policy_->counters();
    std::sort(result_.ttft_s.begin(), result_.ttft_s.end());
    std::sort(result_.e2e_s.begin(), result_.e2e_s.end());
    std::sort(result_.wall.decision_us.begin(), result_.wall.decision_us.end());
  }

  const ReplayConfig& config_;
  ProgressCounter* progress_;
  std::vector<Request> requests_;
  std::vector<std::unique_ptr<SimEngine>> engines_;
  std::unique_ptr<Policy> policy_;
  std::vector<uint32_t> tokens_;  // scratch: the arriving prompt
  PolicyResult result_;
  int64_t predicted_sum_ = 0;
  bool has_prediction_ = false;
  std::deque<Request*> queued_;  // held at the gateway: the router queued them
  bool retry_queued_ = false;
  double now_ = 0;                    // simulated time of what the loop is handling
  std::deque<PendingEvent> pending_;  // delayed KV events, oldest first
  std::mt19937_64 loss_random_;
};

}  // namespace

PolicyResult RunPolicy(const std::vector<trace::TraceRecord>& trace, const PolicySpec& policy,
                       const ReplayConfig& config, ProgressCounter* progress) {
  CheckCapacity(trace, config.limits);
  FleetSimulation simulation(trace, policy, config, progress);
  return simulation.Run();
}

void CheckCapacity(const std::vector<trace::TraceRecord>& trace, const EngineLimits& limits) {
  for (size_t i = 0; i < trace.size(); ++i) {
    const uint64_t prompt = trace::ExpandedLength(trace[i]);
    const uint64_t needed =
        BlocksNeeded(prompt, std::max<uint64_t>(1, trace[i].output_length), limits.block_size);
    if (prompt == 0) {
      throw std::invalid_argument("request " + std::to_string(i) + " has an empty prompt");
    }
    if (needed > limits.kv_capacity_blocks) {
      throw std::invalid_argument(
          "request " + std::to_string(i) + " needs " + std::to_string(needed) +
          " KV blocks (prompt + output) but a worker holds only " +
          std::to_string(limits.kv_capacity_blocks) + "; raise --kv_capacity_blocks");
    }
  }
}

}  // namespace kvrouter::replay

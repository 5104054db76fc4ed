#include "kvrouter/fleet_sim.h"

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
      : config_(config), progress_(progress), requests_(MakeRequests(trace, config.time_scale)) {
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
    result_.worker_prefill_tokens.assign(config.workers, 0);
    result_.worker_requests.assign(config.workers, 0);
  }

  PolicyResult Run() {
    const auto started = Stopwatch::now();
    size_t next_arrival = 0;
    while (true) {
      const double arrival =
          next_arrival < requests_.size() ? requests_[next_arrival].arrival_s : SimEngine::kIdle;
      SimEngine* engine = EarliestStep();
      const double step_end = engine != nullptr ? engine->step_end() : SimEngine::kIdle;
      if (arrival == SimEngine::kIdle && step_end == SimEngine::kIdle) break;
      if (step_end <= arrival) {
        engine->FinishStep();
        engine->MaybeStartStep(step_end);
        if (retry_queued_) DispatchQueued(step_end);
      } else {
        Arrive(requests_[next_arrival++]);
      }
    }
    Summarise();
    result_.wall.run_seconds = MicrosSince(started) / 1e6;
    return std::move(result_);
  }

  // FleetView.
  uint32_t workers() const override { return config_.workers; }
  size_t InFlight(uint32_t worker) const override { return engines_[worker]->in_flight(); }
  uint64_t PendingPromptTokens(uint32_t worker) const override {
    return engines_[worker]->pending_prompt_tokens();
  }

  // EngineObserver.
  void OnStored(uint32_t worker, const StoredRun& run) override { policy_->OnStored(worker, run); }
  void OnRemoved(uint32_t worker, std::span<const uint64_t> hashes) override {
    policy_->OnRemoved(worker, hashes);
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
      result_.worker_requests[request.worker] += 1;
      result_.ttft_s.push_back(request.first_token_s - request.arrival_s);
      result_.e2e_s.push_back(request.finish_s - request.arrival_s);
      result_.makespan_s = std::max(result_.makespan_s, request.finish_s);
    }
    for (uint32_t w = 0; w < config_.workers; ++w) {
      result_.worker_prefill_tokens[w] = engines_[w]->prefill_tokens_computed();
      result_.engine_steps += engines_[w]->steps();
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

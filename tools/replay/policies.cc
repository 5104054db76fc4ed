#include "replay/policies.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kvrouter.h"
#include "replay/abi_call.h"
#include "replay/event_path.h"

namespace kvrouter::replay {
namespace {

// A router owned by a policy, with the fleet's workers registered.
class RouterHandle {
 public:
  // `gateway` distinguishes router replicas: each draws its own random sequence (replicas
  // seeded alike would break ties and sample identically, a correlation real gateways lack).
  RouterHandle(const PolicyContext& context, uint32_t flags, double temperature,
               uint32_t gateway = 0, kvr_cost_function cost_function = KVR_COST_CREDIT) {
    kvr_router_options options;
    kvr_router_options_init(&options, sizeof options);
    ApplyRouterSettings(context.router, options);
    options.block_size = context.limits.block_size;
    options.flags |= flags;
    options.temperature = temperature;
    options.cost_function = cost_function;
    options.random_seed = context.seed + gateway;
    // The ABI reads the process's steady clock, which runs ~100× faster in simulated time than
    // in wall time here. Wall-clock expiries would fire at run-dependent moments and break
    // determinism, so they are pushed out of reach: requests are always freed explicitly, and the
    // approximate index is bounded by its size budget, set to the fleet's KV capacity.
    options.request_expiry_seconds = 1e9;
    options.approx_ttl_seconds = 1e9;
    options.approx_max_blocks = context.limits.kv_capacity_blocks * context.workers;
    CheckAbi("kvr_router_new",
             [&](kvr_error** e) { return kvr_router_new(&options, &router_, e); });
    try {
      for (uint32_t w = 0; w < context.workers; ++w) {
        kvr_worker_config config;
        kvr_worker_config_init(&config, sizeof config);
        config.worker_id = w;
        config.total_kv_blocks = context.limits.kv_capacity_blocks;
        config.max_num_batched_tokens = context.limits.max_num_batched_tokens;
        CheckAbi("kvr_router_add_worker",
                 [&](kvr_error** e) { return kvr_router_add_worker(router_, &config, e); });
      }
      events_ =
          MakeEventPath(context.transport, router_, context.workers, context.limits.block_size);
    } catch (...) {
      // A transport that cannot be set up (a NATS server not there) fails the policy; no
      // destructor runs for a constructor that throws.
      kvr_router_free(router_);
      throw;
    }
  }
  ~RouterHandle() {
    events_.reset();  // an ingest feeding the router goes first
    kvr_router_free(router_);
  }
  RouterHandle(const RouterHandle&) = delete;
  RouterHandle& operator=(const RouterHandle&) = delete;

  kvr_router* get() const { return router_; }

  // The router's clock follows the simulation's (kvr_router_set_time).
  void SetTime(double now_s) {
    CheckAbi("kvr_router_set_time", [&](kvr_error** e) {
      return kvr_router_set_time(router_, static_cast<int64_t>(std::llround(now_s * 1e9)), e);
    });
  }

  // The engines' events reach the router over the run's transport (event_path.h).
  EventPath& events() { return *events_; }

  RouterCounters counters() const {
    const EventCounts counts = events_->counts();
    return {.events_stored = counts.stored,
            .events_removed = counts.removed,
            .events_rejected = counts.rejected};
  }

 private:
  kvr_router* router_ = nullptr;
  std::unique_ptr<EventPath> events_;
};

// Booking changes one gateway's router published for the others, held until the call that
// made them returns (the publish callback must not call a router), then delivered in order.
class ReplicaBus {
 public:
  // Makes `router` publish into this bus as gateway `gateway`.
  void Connect(kvr_router* router, uint32_t gateway) {
    routers_.push_back(router);
    senders_.push_back(std::make_unique<Sender>(Sender{this, gateway}));
    const std::string id = "gateway-" + std::to_string(gateway);
    CheckAbi("kvr_router_set_replica_publisher", [&](kvr_error** e) {
      return kvr_router_set_replica_publisher(router, id.c_str(), &ReplicaBus::Publish,
                                              senders_.back().get(), e);
    });
  }

  // Applies every pending change to every gateway but its sender (as a NATS subject with
  // no echo does), until none is left: applying one can publish more (a SyncRequest is
  // answered with a Reset and the answering gateway's bookings).
  void Deliver() {
    while (!pending_.empty()) {
      std::vector<Message> batch;
      batch.swap(pending_);
      for (const Message& message : batch) {
        for (uint32_t g = 0; g < routers_.size(); ++g) {
          if (g == message.from) continue;
          CheckAbi("kvr_router_apply_replica_event", [&](kvr_error** e) {
            return kvr_router_apply_replica_event(routers_[g], message.bytes.data(),
                                                  message.bytes.size(), e);
          });
        }
      }
    }
  }

 private:
  struct Sender {
    ReplicaBus* bus;
    uint32_t gateway;
  };
  struct Message {
    uint32_t from;
    std::vector<uint8_t> bytes;
  };

  static void Publish(void* user_data, const void* data, size_t size) {
    auto* sender = static_cast<Sender*>(user_data);
    const auto* bytes = static_cast<const uint8_t*>(data);
    sender->bus->pending_.push_back({sender->gateway, {bytes, bytes + size}});
  }

  std::vector<kvr_router*> routers_;
  std::vector<std::unique_ptr<Sender>> senders_;
  std::vector<Message> pending_;
};

// The kvrouter policies, behind one or more gateways: requests arrive at the gateways in turn,
// each gateway's router ingests every KV event, and with replica sync each one's bookings are
// load at the others.
class KvRouterPolicy final : public Policy {
 public:
  KvRouterPolicy(const PolicySpec& spec, const PolicyContext& context)
      : approximate_(spec.kind == PolicyKind::kKvRouterApprox),
        queues_(context.router.queue_threshold.value_or(-1) >= 0) {
    for (uint32_t g = 0; g < std::max(1u, context.gateways); ++g) {
      gateways_.push_back(std::make_unique<RouterHandle>(
          context, approximate_ ? KVR_ROUTER_APPROXIMATE : 0u, spec.temperature, g,
          spec.kind == PolicyKind::kKvRouterTtft ? KVR_COST_PREDICTED_TTFT : KVR_COST_CREDIT));
      if (context.replica_sync && context.gateways > 1) bus_.Connect(gateways_.back()->get(), g);
    }
  }

  uint32_t Route(const Request& request, std::span<const uint32_t> tokens) override {
    RouterHandle& router = GatewayOf(request);
    if (!approximate_) router.events().Sync();
    const std::string id = RequestId(request.index);
    kvr_request_options options;
    kvr_request_options_init(&options, sizeof options);
    options.flags = KVR_REQUEST_ADMIT;
    options.request_id = id.c_str();
    // A router that queues would block this (the only) thread until a free that can only come
    // from it: with no wait allowed, a request it would queue comes back DEADLINE_EXCEEDED
    // and unbooked, and the gateway holds it (Policy::kQueued).
    if (queues_) options.queue_timeout_ms = 0;
    kvr_route_result result;
    kvr_route_result_init(&result, sizeof result);
    bool queued = false;
    CheckAbi("kvr_find_best_match", [&](kvr_error** e) -> kvr_status {
      const kvr_status status = kvr_find_best_match(router.get(), tokens.data(), tokens.size(),
                                                    &options, &result, nullptr, 0, nullptr, e);
      if (status != KVR_DEADLINE_EXCEEDED || !queues_) return status;
      queued = true;
      kvr_error_free(*e);
      *e = nullptr;
      return KVR_OK;
    });
    if (queued) return kQueued;
    predicted_ = static_cast<int64_t>(result.cached_tokens);
    return static_cast<uint32_t>(result.worker_id);
  }

  int64_t predicted_cached_tokens() const override { return predicted_; }
  void SetTime(double now_s) override {
    for (auto& gateway : gateways_) gateway->SetTime(now_s);
  }
  // The other replicas learn of the booking before anything else happens in simulated time.
  void AfterRoute() override { bus_.Deliver(); }

  void OnStored(uint32_t worker, const StoredRun& run) override {
    if (approximate_) return;
    for (auto& gateway : gateways_) gateway->events().Stored(worker, run);
  }
  void OnRemoved(uint32_t worker, std::span<const uint64_t> block_hashes, Tier tier) override {
    if (approximate_) return;
    for (auto& gateway : gateways_) gateway->events().Removed(worker, block_hashes, tier);
  }
  void OnFirstToken(const Request& request) override {
    const std::string id = RequestId(request.index);
    CheckAbi("kvr_router_mark_prefill_completed", [&](kvr_error** e) {
      return kvr_router_mark_prefill_completed(GatewayOf(request).get(), id.c_str(), e);
    });
    bus_.Deliver();
  }
  void OnFinished(const Request& request) override {
    const std::string id = RequestId(request.index);
    CheckAbi("kvr_router_free_request", [&](kvr_error** e) {
      return kvr_router_free_request(GatewayOf(request).get(), id.c_str(), e);
    });
    bus_.Deliver();
  }
  // Every gateway sees the same events: the first one's counts stand for all.
  RouterCounters counters() const override { return gateways_.front()->counters(); }

 private:
  RouterHandle& GatewayOf(const Request& request) {
    return *gateways_[request.index % gateways_.size()];
  }

  const bool approximate_;
  const bool queues_;
  ReplicaBus bus_;  // declared before the routers: destroyed after them
  std::vector<std::unique_ptr<RouterHandle>> gateways_;
  int64_t predicted_ = -1;
};

// Most cached leading blocks wins, whatever the load: what a naive "KV-aware" router does.
class PrefixOnlyPolicy final : public Policy {
 public:
  explicit PrefixOnlyPolicy(const PolicyContext& context)
      : workers_(context.workers),
        block_size_(context.limits.block_size),
        router_(context, 0, 0),
        random_(context.seed),
        overlaps_(context.workers) {}

  uint32_t Route(const Request& request, std::span<const uint32_t> tokens) override {
    router_.events().Sync();
    size_t len = 0;
    CheckAbi("kvr_router_overlap_scores", [&](kvr_error** e) {
      return kvr_router_overlap_scores(router_.get(), tokens.data(), tokens.size(), nullptr,
                                       overlaps_.data(), overlaps_.size(), &len, e);
    });
    uint32_t best_blocks = 0;
    candidates_.clear();
    for (size_t i = 0; i < len; ++i) {
      const kvr_overlap& overlap = overlaps_[i];
      if (overlap.device_blocks > best_blocks) {
        best_blocks = overlap.device_blocks;
        candidates_.clear();
      }
      if (overlap.device_blocks == best_blocks && best_blocks > 0) {
        candidates_.push_back(static_cast<uint32_t>(overlap.worker_id));
      }
    }
    predicted_ = static_cast<int64_t>(best_blocks) * block_size_;
    if (candidates_.empty()) return static_cast<uint32_t>(random_() % workers_);
    // The router lists ranks in no promised order: sort so the draw is reproducible.
    std::sort(candidates_.begin(), candidates_.end());
    return candidates_[random_() % candidates_.size()];
  }

  int64_t predicted_cached_tokens() const override { return predicted_; }
  void OnStored(uint32_t worker, const StoredRun& run) override {
    router_.events().Stored(worker, run);
  }
  void OnRemoved(uint32_t worker, std::span<const uint64_t> block_hashes, Tier tier) override {
    router_.events().Removed(worker, block_hashes, tier);
  }
  RouterCounters counters() const override { return router_.counters(); }

 private:
  const uint32_t workers_;
  const int64_t block_size_;
  RouterHandle router_;
  std::mt19937_64 random_;
  std::vector<kvr_overlap> overlaps_;
  std::vector<uint32_t> candidates_;
  int64_t predicted_ = -1;
};

class RoundRobinPolicy final : public Policy {
 public:
  explicit RoundRobinPolicy(uint32_t workers) : workers_(workers) {}
  uint32_t Route(const Request&, std::span<const uint32_t>) override { return next_++ % workers_; }

 private:
  const uint32_t workers_;
  uint64_t next_ = 0;
};

class RandomPolicy final : public Policy {
 public:
  RandomPolicy(uint32_t workers, uint64_t seed) : workers_(workers), random_(seed) {}
  uint32_t Route(const Request&, std::span<const uint32_t>) override {
    return static_cast<uint32_t>(random_() % workers_);
  }

 private:
  const uint32_t workers_;
  std::mt19937_64 random_;
};

// The least loaded worker, cache-blind. Load is the requests in flight or, by tokens, the
// prompt tokens waiting for their first token (the prefill backlog a gateway can count from
// what it dispatched and the first tokens it relayed), then the requests in flight. Ties
// (common: the trace has bursts of up to 28 simultaneous arrivals) rotate like round-robin, so
// no worker is favoured by its id.
class LeastLoadedPolicy final : public Policy {
 public:
  LeastLoadedPolicy(const FleetView& fleet, bool by_tokens)
      : fleet_(fleet), by_tokens_(by_tokens) {}
  uint32_t Route(const Request&, std::span<const uint32_t>) override {
    const uint32_t workers = fleet_.workers();
    uint32_t best = start_;
    for (uint32_t i = 1; i < workers; ++i) {
      const uint32_t w = (start_ + i) % workers;
      if (Load(w) < Load(best)) best = w;
    }
    start_ = (best + 1) % workers;
    return best;
  }

 private:
  std::pair<uint64_t, size_t> Load(uint32_t worker) const {
    return {by_tokens_ ? fleet_.PendingPromptTokens(worker) : 0, fleet_.InFlight(worker)};
  }

  const FleetView& fleet_;
  const bool by_tokens_;
  uint32_t start_ = 0;
};

const std::vector<std::pair<std::string, PolicyKind>>& PolicyNames() {
  static const auto* names = new std::vector<std::pair<std::string, PolicyKind>>{
      {"kvrouter", PolicyKind::kKvRouter},
      {"kvrouter-softmax", PolicyKind::kKvRouterSoftmax},
      {"kvrouter-approx", PolicyKind::kKvRouterApprox},
      {"kvrouter-ttft", PolicyKind::kKvRouterTtft},
      {"round-robin", PolicyKind::kRoundRobin},
      {"random", PolicyKind::kRandom},
      {"least-loaded", PolicyKind::kLeastLoaded},
      {"least-tokens", PolicyKind::kLeastTokens},
      {"prefix-only", PolicyKind::kPrefixOnly},
  };
  return *names;
}

bool HasRouterTemperature(PolicyKind kind) {
  return kind == PolicyKind::kKvRouter || kind == PolicyKind::kKvRouterSoftmax ||
         kind == PolicyKind::kKvRouterApprox || kind == PolicyKind::kKvRouterTtft;
}

PolicyKind KindOf(const std::string& name) {
  const auto& names = PolicyNames();
  auto it = std::find_if(names.begin(), names.end(),
                         [&](const auto& entry) { return entry.first == name; });
  if (it == names.end()) {
    std::string known;
    for (const auto& entry : names) known += (known.empty() ? "" : ", ") + entry.first;
    throw std::invalid_argument("unknown policy \"" + name + "\" (known: " + known + ")");
  }
  return it->second;
}

// "name=T,..." → temperature per kvrouter policy.
std::map<std::string, double> ParseTemperatures(const std::string& list) {
  std::map<std::string, double> temperatures;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    const std::pair<absl::string_view, absl::string_view> entry = absl::StrSplit(part, '=');
    const std::string name(absl::StripAsciiWhitespace(entry.first));
    double value = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(entry.second), &value) ||
        !std::isfinite(value) || value < 0) {
      throw std::invalid_argument("--temperatures: \"" + std::string(part) +
                                  "\" is not POLICY=T with a finite T >= 0");
    }
    if (!HasRouterTemperature(KindOf(name))) {
      throw std::invalid_argument("--temperatures: " + name +
                                  " has no router temperature (only the kvrouter policies do)");
    }
    temperatures[name] = value;
  }
  return temperatures;
}

}  // namespace

std::string RequestId(uint32_t index) { return "req-" + std::to_string(index); }

std::vector<PolicySpec> ParsePolicies(const std::string& list, double softmax_temperature,
                                      const std::string& temperatures) {
  const std::map<std::string, double> overrides = ParseTemperatures(temperatures);
  std::vector<std::string> names;
  const absl::string_view trimmed = absl::StripAsciiWhitespace(list);
  if (trimmed.empty() || trimmed == "all") {
    for (const auto& entry : PolicyNames()) names.push_back(entry.first);
  } else {
    for (absl::string_view part : absl::StrSplit(trimmed, ',', absl::SkipWhitespace())) {
      const std::string name(absl::StripAsciiWhitespace(part));
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
  }
  std::vector<PolicySpec> specs;
  for (const std::string& name : names) {
    const PolicyKind kind = KindOf(name);
    PolicySpec spec{.name = name, .kind = kind};
    if (kind == PolicyKind::kKvRouterSoftmax) spec.temperature = softmax_temperature;
    if (auto it = overrides.find(name); it != overrides.end()) spec.temperature = it->second;
    specs.push_back(spec);
  }
  return specs;
}

void ApplyRouterSettings(const RouterSettings& settings, kvr_router_options& options) {
  if (settings.overlap_score_credit) options.overlap_score_credit = *settings.overlap_score_credit;
  if (settings.prefill_load_scale) options.prefill_load_scale = *settings.prefill_load_scale;
  if (settings.overlap_score_credit_decay) {
    options.overlap_score_credit_decay = *settings.overlap_score_credit_decay;
  }
  if (settings.decode_active_request_weight) {
    options.decode_active_request_weight = *settings.decode_active_request_weight;
  }
  if (settings.host_cache_hit_weight) {
    options.host_cache_hit_weight = *settings.host_cache_hit_weight;
  }
  if (settings.ttft_miss_weight) options.ttft_miss_weight = *settings.ttft_miss_weight;
  if (settings.queue_threshold) options.queue_threshold = *settings.queue_threshold;
  if (!settings.assume_kv_reuse) options.flags |= KVR_ROUTER_NO_KV_REUSE;
  if (!settings.track_prefill_tokens) options.flags |= KVR_ROUTER_NO_PREFILL_TRACKING;
}

void CheckRouterSettings(const RouterSettings& settings, uint32_t block_size) {
  kvr_router_options options;
  kvr_router_options_init(&options, sizeof options);
  ApplyRouterSettings(settings, options);
  options.block_size = block_size;
  kvr_router* router = nullptr;
  kvr_error* error = nullptr;
  if (kvr_router_new(&options, &router, &error) == KVR_OK) {
    kvr_router_free(router);
    return;
  }
  std::string message = "the router refuses its settings";
  if (error != nullptr) {
    message += std::string(": ") + kvr_error_message(error);
    kvr_error_free(error);
  }
  throw std::invalid_argument(message);
}

std::unique_ptr<Policy> MakePolicy(const PolicySpec& spec, const PolicyContext& context) {
  switch (spec.kind) {
    case PolicyKind::kKvRouter:
    case PolicyKind::kKvRouterSoftmax:
    case PolicyKind::kKvRouterApprox:
    case PolicyKind::kKvRouterTtft:
      return std::make_unique<KvRouterPolicy>(spec, context);
    case PolicyKind::kRoundRobin:
      return std::make_unique<RoundRobinPolicy>(context.workers);
    case PolicyKind::kRandom:
      return std::make_unique<RandomPolicy>(context.workers, context.seed);
    case PolicyKind::kLeastLoaded:
      return std::make_unique<LeastLoadedPolicy>(*context.fleet, /*by_tokens=*/false);
    case PolicyKind::kLeastTokens:
      return std::make_unique<LeastLoadedPolicy>(*context.fleet, /*by_tokens=*/true);
    case PolicyKind::kPrefixOnly:
      return std::make_unique<PrefixOnlyPolicy>(context);
  }
  throw std::invalid_argument("unknown policy kind");
}

}  // namespace kvrouter::replay

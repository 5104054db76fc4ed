// The router handle through the C ABI: creation, workers, KV events, routing, the request
// lifecycle and index snapshots. Each entry point checks its arguments, converts the C structs
// to core types, and maps absl::Status onto kvr_status; the core does the work.
#include <cmath>
#include <limits>

#include "capi_internal.h"
#include "core/clock.h"
#include "core/hashing.h"
#include "ingest/replica_sync.h"
#include "wire/flatbuffers_codec.h"

using namespace kvrouter::capi;
using kvrouter::WorkerKey;

namespace {

std::optional<double> UnlessNaN(double v) {
  return std::isnan(v) ? std::nullopt : std::optional<double>(v);
}

std::optional<bool> TriState(int32_t v) {
  return v < 0 ? std::nullopt : std::optional<bool>(v != 0);
}

kvr_status CheckTier(kvr_error** err, uint32_t tier) {
  return CheckValue(err, KnownTier, tier, "tier", "KVR_TIER_*");
}

// ---- Options -----------------------------------------------------------------------------

// Applies `bind(c_field, core_field)` to every field kvr_router_options shares with the core's
// RouterOptions: the one list that both the C defaults (core to C) and router creation (C to
// core) use. The flags, the queue policy and the threshold are converted on their own.
template <typename COptions, typename CoreOptions, typename Bind>
void BindRouterOptions(COptions& c, CoreOptions& core, Bind&& bind) {
  bind(c.block_size, core.block_size);
  bind(c.overlap_score_credit, core.selection.overlap_score_credit);
  bind(c.prefill_load_scale, core.selection.prefill_load_scale);
  bind(c.host_cache_hit_weight, core.selection.host_cache_hit_weight);
  bind(c.disk_cache_hit_weight, core.selection.disk_cache_hit_weight);
  bind(c.temperature, core.selection.temperature);
  bind(c.approx_ttl_seconds, core.approx_ttl_seconds);
  bind(c.approx_max_blocks, core.approx_max_blocks);
  bind(c.approx_prune_target_ratio, core.approx_prune_target_ratio);
  bind(c.request_expiry_seconds, core.request_expiry_seconds);
  bind(c.random_seed, core.random_seed);
  bind(c.overlap_score_credit_decay, core.selection.overlap_score_credit_decay);
  bind(c.decode_active_request_weight, core.selection.decode_active_request_weight);
  bind(c.index_shards, core.index_shards);
  bind(c.prefill_tokens_per_second, core.prefill_tokens_per_second);
  bind(c.ttft_miss_weight, core.selection.ttft_miss_weight);
}

// The router flags that stand for a core boolean: set when the boolean is `when`.
struct RouterFlag {
  uint32_t flag;
  bool kvrouter::RouterOptions::*option;
  bool kvrouter::SelectorConfig::*selection;
  bool when;
};
constexpr RouterFlag kRouterFlags[] = {
    {KVR_ROUTER_APPROXIMATE, &kvrouter::RouterOptions::use_kv_events, nullptr, false},
    {KVR_ROUTER_NO_KV_REUSE, nullptr, &kvrouter::SelectorConfig::assume_kv_reuse, false},
    {KVR_ROUTER_NO_PREFILL_TRACKING, nullptr, &kvrouter::SelectorConfig::track_prefill_tokens,
     false},
    {KVR_ROUTER_TRACK_OUTPUT_BLOCKS, &kvrouter::RouterOptions::track_output_blocks, nullptr, true},
    {KVR_ROUTER_EAGLE, &kvrouter::RouterOptions::eagle, nullptr, true},
    {KVR_ROUTER_ENTROPY_SEED, &kvrouter::RouterOptions::seed_from_entropy, nullptr, true},
};

bool& FlagOption(kvrouter::RouterOptions& core, const RouterFlag& f) {
  return f.option != nullptr ? core.*f.option : core.selection.*f.selection;
}

kvr_status ToRouterOptions(kvr_error** err, const kvr_router_options& in,
                           kvrouter::RouterOptions& out) {
  if (kvr_status s = CheckValue(err, KnownCostFunction, in.cost_function,
                                "kvr_router_options.cost_function", "KVR_COST_*")) {
    return s;
  }
  if (kvr_status s = CheckValue(err, KnownQueuePolicy, in.queue_policy,
                                "kvr_router_options.queue_policy", "KVR_QUEUE_*")) {
    return s;
  }
  if (kvr_status s = CheckFlags(err, in.flags, kKnownRouterFlags, "kvr_router_options.flags")) {
    return s;
  }
  BindRouterOptions(in, out, [](const auto& c, auto& core) { core = c; });
  for (const RouterFlag& f : kRouterFlags) {
    FlagOption(out, f) = ((in.flags & f.flag) != 0) == f.when;
  }
  if (in.queue_threshold >= 0 || std::isnan(in.queue_threshold)) {
    out.queue_threshold = in.queue_threshold;  // NaN is refused by validation
  }
  out.queue_policy = static_cast<kvrouter::QueuePolicy>(in.queue_policy);
  out.selection.cost_function = static_cast<kvrouter::CostFunction>(in.cost_function);
  return KVR_OK;
}

// As BindRouterOptions, for kvr_worker_config and the core's WorkerConfig (every field; a
// block size of 0 stands for the router's in both).
template <typename CConfig, typename CoreConfig, typename Bind>
void BindWorkerConfig(CConfig& c, CoreConfig& core, Bind&& bind) {
  BindWorkerRanks(c, core, bind);
  bind(c.total_kv_blocks, core.total_kv_blocks);
  bind(c.max_num_batched_tokens, core.max_num_batched_tokens);
}

kvr_status ToWorkerConfig(kvr_error** err, const kvr_worker_config* config,
                          kvrouter::WorkerConfig& out) {
  if (kvr_status s = RequireNonNull(err, config, "config")) return s;
  kvr_worker_config in;
  if (kvr_status s = ReadVersioned(err, config, in)) return s;
  BindWorkerConfig(in, out, [](const auto& c, auto& core) { core = c; });
  return KVR_OK;
}

}  // namespace

namespace kvrouter::capi {

template <>
kvr_router_options Defaults() noexcept {
  kvrouter::RouterOptions core;
  kvr_router_options c{};
  c.struct_size = sizeof c;
  BindRouterOptions(c, core, [](auto& c_field, const auto& core_field) { c_field = core_field; });
  for (const RouterFlag& f : kRouterFlags) {
    if (FlagOption(core, f) == f.when) c.flags |= f.flag;
  }
  c.queue_policy = static_cast<kvr_queue_policy>(core.queue_policy);
  c.queue_threshold = core.queue_threshold.value_or(-1.0);  // negative: never queue
  c.cost_function = static_cast<kvr_cost_function>(core.selection.cost_function);
  return c;
}

template <>
kvr_worker_config Defaults() noexcept {
  kvrouter::WorkerConfig core;
  kvr_worker_config c{};
  c.struct_size = sizeof c;
  BindWorkerConfig(c, core, [](auto& c_field, const auto& core_field) { c_field = core_field; });
  return c;
}

// Request options are overrides of the router's settings: their defaults mean "unset".
template <>
kvr_request_options Defaults() noexcept {
  const double unset = std::numeric_limits<double>::quiet_NaN();
  kvr_request_options c{};
  c.struct_size = sizeof c;
  c.overlap_score_credit = unset;
  c.prefill_load_scale = unset;
  c.host_cache_hit_weight = unset;
  c.disk_cache_hit_weight = unset;
  c.temperature = unset;
  c.assume_kv_reuse = -1;
  c.track_prefill_tokens = -1;
  c.queue_timeout_ms = -1;
  c.overlap_score_credit_decay = unset;
  c.decode_active_request_weight = unset;
  c.cost_function = -1;
  c.ttft_miss_weight = unset;
  return c;
}

kvr_status ToRouteOptions(kvr_error** err, const kvr_request_options* opts, RequestOptions& out) {
  if (kvr_status s = ReadVersioned(err, opts, out.c)) return s;
  const kvr_request_options& c = out.c;
  if (kvr_status s = ReadMmHashes(err, c.mm_hashes, c.mm_counts, c.mm_num_blocks, out.mm)) {
    return s;
  }
  if (kvr_status s =
          CheckArray(err, c.allowed_worker_ids, c.num_allowed_worker_ids, "allowed_worker_ids")) {
    return s;
  }
  if (kvr_status s = CheckFlags(err, c.flags, kKnownRequestFlags, "kvr_request_options.flags")) {
    return s;
  }
  kvrouter::RouteOptions& r = out.route;
  r.prompt.lora_name = OrEmpty(c.lora_name);
  r.prompt.cache_namespace = OrEmpty(c.cache_namespace);
  r.prompt.block_mm_hashes = out.mm;
  r.overrides.overlap_score_credit = UnlessNaN(c.overlap_score_credit);
  r.overrides.prefill_load_scale = UnlessNaN(c.prefill_load_scale);
  r.overrides.host_cache_hit_weight = UnlessNaN(c.host_cache_hit_weight);
  r.overrides.disk_cache_hit_weight = UnlessNaN(c.disk_cache_hit_weight);
  r.overrides.temperature = UnlessNaN(c.temperature);
  r.overrides.assume_kv_reuse = TriState(c.assume_kv_reuse);
  r.overrides.track_prefill_tokens = TriState(c.track_prefill_tokens);
  r.overrides.overlap_score_credit_decay = UnlessNaN(c.overlap_score_credit_decay);
  r.overrides.decode_active_request_weight = UnlessNaN(c.decode_active_request_weight);
  if (c.cost_function >= 0) {
    if (kvr_status s = CheckValue(err, KnownCostFunction, static_cast<uint32_t>(c.cost_function),
                                  "kvr_request_options.cost_function", "KVR_COST_* or -1")) {
      return s;
    }
    r.overrides.cost_function = static_cast<kvrouter::CostFunction>(c.cost_function);
  }
  r.overrides.ttft_miss_weight = UnlessNaN(c.ttft_miss_weight);
  if (c.num_allowed_worker_ids > 0 || (c.flags & KVR_REQUEST_ALLOW_LIST) != 0) {
    r.allowed_worker_ids = std::span(c.allowed_worker_ids, c.num_allowed_worker_ids);
  }
  r.with_admission = (c.flags & KVR_REQUEST_ADMIT) != 0;
  r.request_id = OrEmpty(c.request_id);
  r.expected_output_tokens = c.expected_output_tokens;
  r.priority_jump = c.priority_jump;
  if (c.queue_timeout_ms < -1) {
    return FailInvalid(err, "kvr_request_options.queue_timeout_ms is " +
                                std::to_string(c.queue_timeout_ms) + ": -1 (never) or >= 0");
  }
  // A wait past kLongestNanos (about 146 years; INT64_MAX ms is a caller's "never") has no
  // limit: its conversion to nanoseconds overflowed to a negative wait, timed out at once.
  constexpr int64_t kLongestMillis = kvrouter::kLongestNanos / 1'000'000;
  if (c.queue_timeout_ms >= 0 && c.queue_timeout_ms <= kLongestMillis) {
    r.queue_timeout = std::chrono::milliseconds(c.queue_timeout_ms);
  }
  return KVR_OK;
}

kvr_status ToRequest(kvr_error** err, const uint32_t* tokens, size_t num_tokens,
                     const kvr_request_options* opts, RequestOptions& out) {
  if (kvr_status s = ToRouteOptions(err, opts, out)) return s;
  const kvr_request_options& c = out.c;
  if ((c.flags & KVR_REQUEST_PREHASHED) == 0) {
    if (kvr_status s = CheckArray(err, tokens, num_tokens, "tokens")) return s;
    out.tokens = std::span(tokens, num_tokens);
    return KVR_OK;
  }
  if (tokens != nullptr) {
    return FailInvalid(err,
                       "with KVR_REQUEST_PREHASHED the prompt is opts->local_hashes: tokens must "
                       "be NULL (num_tokens is the prompt's length)");
  }
  if (kvr_status s = CheckArray(err, c.local_hashes, c.num_local_hashes, "opts->local_hashes")) {
    return s;
  }
  out.route.prompt.prehashed = kvrouter::PrehashedPrompt{
      .local_hashes = std::span(c.local_hashes, c.num_local_hashes), .num_tokens = num_tokens};
  return KVR_OK;
}

}  // namespace kvrouter::capi

namespace kvrouter::capi {

// A hybrid model's sliding-window store (kvr_stored_event with sliding_window_tokens > 0): blocks
// by engine hash, nothing else of a full-attention store.
static kvr_status ToSlidingStoredEvent(kvr_error** err, const kvr_stored_event& in,
                                       kvrouter::KvEvent& out) {
  if (in.flags != 0 || in.local_hashes != nullptr || in.num_tokens > 0 || in.lora_name != nullptr ||
      in.cache_namespace != nullptr || in.mm_hashes != nullptr || in.mm_counts != nullptr) {
    return FailInvalid(err,
                       "a sliding-window store (sliding_window_tokens > 0) names blocks by engine "
                       "hash only: no parent flag, local hashes, tokens, LoRA, namespace nor "
                       "multimodal hashes");
  }
  if (in.tier != KVR_TIER_DEVICE) {
    return FailInvalid(err,
                       "a sliding-window store is of the device tier (a request resumes "
                       "there)");
  }
  if (in.num_blocks == 0) {
    // It would still make the group known: the rank would then match nothing until its window
    // holds blocks.
    return FailInvalid(err, "a sliding-window store names no block");
  }
  if (in.sliding_group < 0 || in.reserved1 != 0) {
    return FailInvalid(err,
                       "kvr_stored_event.sliding_group must be >= 0 (an engine's group index) and "
                       "reserved1 0");
  }
  kvrouter::SlidingStoredEvent stored;
  stored.group = in.sliding_group;
  stored.window_tokens = in.sliding_window_tokens;
  stored.block_hashes.assign(in.block_hashes, in.block_hashes + in.num_blocks);
  out = kvrouter::KvEvent{.worker = {in.worker_id, in.dp_rank},
                          .tier = kvrouter::Tier::kDevice,
                          .event_id = in.event_id,
                          .data = std::move(stored)};
  return KVR_OK;
}

kvr_status ToStoredEvent(kvr_error** err, const kvr_stored_event* event, kvrouter::KvEvent& out,
                         uint32_t block_size) {
  if (kvr_status s = RequireNonNull(err, event, "event")) return s;
  kvr_stored_event in;
  if (kvr_status s = ReadVersioned(err, event, in)) return s;
  if (kvr_status s = CheckTier(err, in.tier)) return s;
  if (kvr_status s = CheckFlags(err, in.flags, kKnownStoredFlags, "kvr_stored_event.flags")) {
    return s;
  }
  if (kvr_status s = CheckArray(err, in.block_hashes, in.num_blocks, "block_hashes")) return s;
  if (kvr_status s = CheckArray(err, in.token_ids, in.num_tokens, "token_ids")) return s;
  if (in.sliding_window_tokens > 0) return ToSlidingStoredEvent(err, in, out);
  if (in.sliding_group != 0 || in.reserved1 != 0) {
    return FailInvalid(err,
                       "kvr_stored_event.sliding_group is set but sliding_window_tokens is 0 (a "
                       "sliding-window store needs its window), or reserved1 is not 0");
  }
  if (block_size != 0 && in.local_hashes == nullptr) {
    // Tokens past the blocks' would be copied and hashed only to be refused.
    const bool eagle = (in.flags & KVR_STORED_EAGLE) != 0;
    const size_t most = kvrouter::NumCompleteBlocks(SIZE_MAX, block_size, eagle);
    const size_t usable = in.num_blocks >= most ? SIZE_MAX : in.num_blocks * block_size + eagle;
    if (in.num_tokens > usable) {
      return FailInvalid(err, "kvr_stored_event has " + std::to_string(in.num_tokens) +
                                  " tokens but its " + std::to_string(in.num_blocks) +
                                  " blocks of " + std::to_string(block_size) + " take at most " +
                                  std::to_string(usable));
    }
  }
  kvrouter::StoredEvent stored;
  if (in.flags & KVR_STORED_HAS_PARENT) stored.parent_hash = in.parent_hash;
  stored.block_hashes.assign(in.block_hashes, in.block_hashes + in.num_blocks);
  if (in.local_hashes != nullptr) {
    stored.local_hashes.assign(in.local_hashes, in.local_hashes + in.num_blocks);
  } else {
    stored.token_ids.assign(in.token_ids, in.token_ids + in.num_tokens);
  }
  if (kvr_status s =
          ReadMmHashes(err, in.mm_hashes, in.mm_counts, in.num_blocks, stored.block_mm_hashes)) {
    return s;
  }
  stored.lora_name = OrEmpty(in.lora_name);
  stored.cache_namespace = OrEmpty(in.cache_namespace);
  stored.eagle = (in.flags & KVR_STORED_EAGLE) != 0;
  out = kvrouter::KvEvent{.worker = {in.worker_id, in.dp_rank},
                          .tier = static_cast<kvrouter::Tier>(in.tier),
                          .event_id = in.event_id,
                          .data = std::move(stored)};
  return KVR_OK;
}

kvr_status ToRemovedEvent(kvr_error** err, const kvr_removed_event* event, kvrouter::KvEvent& out) {
  if (kvr_status s = RequireNonNull(err, event, "event")) return s;
  kvr_removed_event in;
  if (kvr_status s = ReadVersioned(err, event, in)) return s;
  if (kvr_status s = CheckTier(err, in.tier)) return s;
  if (kvr_status s = CheckArray(err, in.block_hashes, in.num_blocks, "block_hashes")) return s;
  if (kvr_status s = CheckFlags(err, in.flags, kKnownRemovedFlags, "kvr_removed_event.flags")) {
    return s;
  }
  if (in.sliding_group != 0 && !(in.flags & KVR_REMOVED_SLIDING)) {
    return FailInvalid(err, "kvr_removed_event.sliding_group is set without KVR_REMOVED_SLIDING");
  }
  if (in.reserved1 != 0) return FailInvalid(err, "kvr_removed_event.reserved1 must be 0");
  if ((in.flags & KVR_REMOVED_SLIDING) && (in.tier != KVR_TIER_DEVICE || in.sliding_group < 0)) {
    return FailInvalid(err,
                       "a sliding-window removal is of the device tier, its sliding_group >= 0");
  }
  std::vector<uint64_t> hashes(in.block_hashes, in.block_hashes + in.num_blocks);
  decltype(kvrouter::KvEvent::data) data;
  if (in.flags & KVR_REMOVED_SLIDING) {
    data =
        kvrouter::SlidingRemovedEvent{.group = in.sliding_group, .block_hashes = std::move(hashes)};
  } else {
    data = kvrouter::RemovedEvent{std::move(hashes)};
  }
  out = kvrouter::KvEvent{.worker = {in.worker_id, in.dp_rank},
                          .tier = static_cast<kvrouter::Tier>(in.tier),
                          .event_id = in.event_id,
                          .data = std::move(data)};
  return KVR_OK;
}

}  // namespace kvrouter::capi

namespace {

kvr_status Apply(kvr_error** err, kvr_router* router, const kvrouter::KvEvent& event) {
  auto result = router->router->ApplyEvent(event);
  return FromStatus(err, result.ok() ? kvrouter::EventStatus(*result) : result.status());
}

// ---- Results -----------------------------------------------------------------------------

// Result rows are written in place, field by field (after zeroing, so reserved fields and
// padding are 0): a row built on the stack and then copied in stalled on store forwarding
// (16-byte loads over narrower stores), a fifth of a 64-rank kvr_router_find_matches.
void FillCandidate(const kvrouter::CandidateCost& c, bool chosen, kvr_candidate& out) {
  out = {};
  out.worker_id = c.worker.worker_id;
  out.dp_rank = c.worker.dp_rank;
  out.device_blocks = c.overlap.device_blocks;
  out.host_blocks = c.overlap.host_blocks;
  out.disk_blocks = c.overlap.disk_blocks;
  out.external_blocks = c.overlap.external_blocks;
  out.chosen = chosen ? 1 : 0;
  out.effective_overlap_blocks = c.effective_overlap_blocks;
  out.cached_tokens = c.cached_tokens;
  out.active_prefill_tokens = c.active_prefill_tokens;
  out.active_blocks = c.active_blocks;
  out.new_blocks = c.new_blocks;
  out.raw_prefill_blocks = c.raw_prefill_blocks;
  out.credit = c.credit;
  out.prefill_cost = c.prefill_cost;
  out.decode_blocks = c.decode_blocks;
  out.cost = c.cost;
  out.probability = c.probability;
  out.credit_decay = c.credit_decay;
  out.active_requests = c.active_requests;
  out.request_cost = c.request_cost;
}

kvr_route_result ToRouteResult(const kvrouter::RouteDecision& d) {
  kvr_route_result out = Defaults<kvr_route_result>();
  out.worker_id = d.worker.worker_id;
  out.dp_rank = d.worker.dp_rank;
  out.prompt_blocks = d.prompt_blocks;
  out.device_overlap_blocks = d.device_overlap_blocks;
  out.effective_overlap_blocks = d.effective_overlap_blocks;
  out.cached_tokens = d.cached_tokens;
  out.prompt_tokens = d.prompt_tokens;
  out.cost = d.candidates.empty() ? 0 : d.candidates[d.chosen].cost;
  out.booked = d.booked ? 1 : 0;
  out.queued = d.queued ? 1 : 0;
  return out;
}

void FillOverlap(const kvrouter::OverlapScore& s, kvr_overlap& o) {
  o = {};
  o.worker_id = s.worker.worker_id;
  o.dp_rank = s.worker.dp_rank;
  o.device_blocks = s.overlap.device_blocks;
  o.host_blocks = s.overlap.host_blocks;
  o.disk_blocks = s.overlap.disk_blocks;
  o.external_blocks = s.overlap.external_blocks;
  o.effective_overlap_blocks = s.effective_overlap_blocks;
  o.cached_tokens = s.cached_tokens;
  o.tree_size = s.tree_size;
}

void FillMatch(const kvrouter::WorkerMatch& m, kvr_match& o) {
  o = {};
  o.worker_id = m.worker.worker_id;
  o.dp_rank = m.worker.dp_rank;
  o.device_blocks = m.device_blocks;
  o.host_blocks = m.host_hits;
  o.disk_blocks = m.disk_hits;
  o.external_blocks = m.external_hits;
  o.tree_size = m.tree_size;
}

void FillPotentialLoad(const kvrouter::PotentialLoad& l, kvr_potential_load& p) {
  p = {};
  p.worker_id = l.current.worker.worker_id;
  p.dp_rank = l.current.worker.dp_rank;
  p.potential_prefill_tokens = l.potential_prefill_tokens;
  p.potential_decode_blocks = l.potential_decode_blocks;
  p.active_prefill_tokens = l.current.active_prefill_tokens;
  p.active_blocks = l.current.active_blocks;
  p.active_requests = l.current.active_requests;
}

// The shape every read-only per-rank query shares: check the arguments, convert the request
// options, ask the router, convert each rank's row, copy the rows into the caller's buffer.
template <typename Row, typename Query, typename Convert>
kvr_status PerRankQuery(kvr_error** err, kvr_router* router, const uint32_t* tokens,
                        size_t num_tokens, const kvr_request_options* opts, Row* out, size_t cap,
                        size_t* len, const char* what, Query query, Convert convert) {
  if (kvr_status s = CheckRouter(err, router)) return s;
  RequestOptions options;
  if (kvr_status s = ToRequest(err, tokens, num_tokens, opts, options)) return s;
  auto rows = query(options.tokens, options.route);
  if (!rows.ok()) return FromStatus(err, rows.status());
  return ConvertOut(err, *rows, convert, out, cap, len, what);
}

}  // namespace

extern "C" {

// ---- Router ------------------------------------------------------------------------------

KVR_API kvr_status kvr_router_options_init(kvr_router_options* options, size_t size) {
  return InitVersioned(options, size);
}

KVR_API kvr_status kvr_router_new(const kvr_router_options* opts, kvr_router** out,
                                  kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, out, "out")) return s;
    kvr_router_options options;
    if (kvr_status s = ReadVersioned(err, opts, options)) return s;
    kvrouter::RouterOptions core;
    if (kvr_status s = ToRouterOptions(err, options, core)) return s;
    auto handle = std::make_unique<kvr_router>();
    core.clock = &handle->clock;
    auto router = kvrouter::Router::Create(std::move(core));
    if (!router.ok()) return FromStatus(err, router.status());
    handle->router = std::move(*router);
    *out = handle.release();
    return KVR_OK;
  });
}

KVR_API void kvr_router_free(kvr_router* router) { delete router; }

KVR_API kvr_status kvr_router_set_time(kvr_router* router, int64_t now_ns, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    using Outcome = kvrouter::HandDrivenClock::SetOutcome;
    switch (router->clock.Set(now_ns)) {
      case Outcome::kSet:
        return KVR_OK;
      case Outcome::kEarlier:
        return Fail(err, KVR_INVALID_ARGUMENT,
                    "kvr_router_set_time: now_ns " + std::to_string(now_ns) +
                        " is earlier than the last time set (the router's clock never goes back)");
      case Outcome::kOutOfRange:
        break;
    }
    return Fail(err, KVR_INVALID_ARGUMENT,
                "kvr_router_set_time: now_ns " + std::to_string(now_ns) +
                    " is out of range: the router's time, and its offset from the times set, "
                    "stay within +-2^62 ns (146 years)");
  });
}

// ---- Workers -----------------------------------------------------------------------------

KVR_API kvr_status kvr_worker_config_init(kvr_worker_config* config, size_t size) {
  return InitVersioned(config, size);
}

KVR_API kvr_status kvr_router_add_worker(kvr_router* router, const kvr_worker_config* config,
                                         kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    kvrouter::WorkerConfig core;
    if (kvr_status s = ToWorkerConfig(err, config, core)) return s;
    return FromStatus(err, router->router->AddWorker(core));
  });
}

KVR_API kvr_status kvr_router_update_worker(kvr_router* router, const kvr_worker_config* config,
                                            kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    kvrouter::WorkerConfig core;
    if (kvr_status s = ToWorkerConfig(err, config, core)) return s;
    return FromStatus(err, router->router->UpdateWorker(core));
  });
}

KVR_API kvr_status kvr_router_remove_worker(kvr_router* router, uint64_t worker_id,
                                            kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    return FromStatus(err, router->router->RemoveWorker(worker_id));
  });
}

// ---- Events ------------------------------------------------------------------------------

KVR_API kvr_status kvr_stored_event_init(kvr_stored_event* event, size_t size) {
  return InitVersioned(event, size);
}

KVR_API kvr_status kvr_removed_event_init(kvr_removed_event* event, size_t size) {
  return InitVersioned(event, size);
}

KVR_API kvr_status kvr_router_apply_stored(kvr_router* router, const kvr_stored_event* event,
                                           kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    kvrouter::KvEvent core;
    if (kvr_status s = ToStoredEvent(err, event, core, router->router->block_size())) return s;
    return Apply(err, router, core);
  });
}

KVR_API kvr_status kvr_router_apply_removed(kvr_router* router, const kvr_removed_event* event,
                                            kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    kvrouter::KvEvent core;
    if (kvr_status s = ToRemovedEvent(err, event, core)) return s;
    return Apply(err, router, core);
  });
}

KVR_API kvr_status kvr_router_apply_cleared(kvr_router* router, uint64_t worker_id,
                                            uint32_t dp_rank, uint64_t event_id, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    return Apply(err, router,
                 kvrouter::KvEvent{.worker = {worker_id, dp_rank},
                                   .event_id = event_id,
                                   .data = kvrouter::ClearedEvent{}});
  });
}

KVR_API kvr_status kvr_router_apply_event_batch(kvr_router* router, const void* data, size_t size,
                                                kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, data, "data")) return s;
    auto events = kvrouter::DecodeEventBatch(std::span(static_cast<const uint8_t*>(data), size));
    if (!events.ok()) {
      router->router->CountRejectedBatch();
      return FromStatus(err, events.status());
    }
    return FromStatus(err, router->router->ApplyEvents(*events));
  });
}

// ---- Router replicas -----------------------------------------------------------------------

KVR_API kvr_status kvr_router_set_replica_publisher(kvr_router* router, const char* replica_id,
                                                    kvr_replica_publish_fn publish, void* user_data,
                                                    kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (publish == nullptr) {
      router->router->SetSequenceObserver("", nullptr);
      return KVR_OK;
    }
    if (kvr_status s = RequireNonNull(err, replica_id, "replica_id")) return s;
    if (absl::Status valid = kvrouter::ValidateReplicaId(replica_id); !valid.ok()) {
      return FromStatus(err, valid);
    }
    kvrouter::PublishReplicaChanges(*router->router, replica_id,
                                    [publish, user_data](const kvrouter::EncodedChange& change,
                                                         kvrouter::SequenceChange::Kind) {
                                      publish(user_data, change.bytes.data(), change.bytes.size());
                                    });
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_apply_replica_event(kvr_router* router, const void* data, size_t size,
                                                  kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, data, "data")) return s;
    const kvrouter::ReplicaMessageResult result = kvrouter::ApplyReplicaMessage(
        *router->router, std::span(static_cast<const uint8_t*>(data), size));
    return FromStatus(err, result.applied.status());
  });
}

KVR_API kvr_status kvr_router_replica_heartbeat(kvr_router* router, uint32_t interval_ms,
                                                kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (interval_ms == 0 || interval_ms > kvrouter::kMaxReplicaLivenessMs) {
      return FromStatus(err, absl::InvalidArgumentError(
                                 absl::StrCat("interval_ms ", interval_ms, " is outside 1..",
                                              kvrouter::kMaxReplicaLivenessMs)));
    }
    if (!router->router->PublishHeartbeat(interval_ms)) {
      return FromStatus(err, absl::FailedPreconditionError(
                                 "the router has no replica publisher to send a heartbeat"));
    }
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_expire_replicas(kvr_router* router, double timeout_seconds,
                                              size_t* expired, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (!(std::isfinite(timeout_seconds) && timeout_seconds > 0)) {
      return FromStatus(
          err, absl::InvalidArgumentError("timeout_seconds must be finite and greater than 0"));
    }
    const size_t n =
        router->router->ExpireSilentReplicas(kvrouter::SecondsToNanos(timeout_seconds));
    if (expired != nullptr) *expired = n;
    return KVR_OK;
  });
}

// ---- Routing -----------------------------------------------------------------------------

KVR_API kvr_status kvr_request_options_init(kvr_request_options* options, size_t size) {
  return InitVersioned(options, size);
}

KVR_API kvr_status kvr_route_result_init(kvr_route_result* result, size_t size) {
  return InitVersioned(result, size);
}

KVR_API kvr_status kvr_find_best_match(kvr_router* router, const uint32_t* tokens,
                                       size_t num_tokens, const kvr_request_options* opts,
                                       kvr_route_result* out, kvr_candidate* candidates, size_t cap,
                                       size_t* num_candidates, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = CheckResultStruct(err, out)) return s;
    if (cap > 0 && candidates == nullptr) return RequireNonNull(err, candidates, "candidates");
    RequestOptions options;
    if (kvr_status s = ToRequest(err, tokens, num_tokens, opts, options)) return s;
    auto decision = router->router->FindBestMatch(options.tokens, options.route);
    if (!decision.ok()) return FromStatus(err, decision.status());
    const auto& all = decision->candidates;
    for (size_t i = 0; i < all.size() && i < cap; ++i) {
      FillCandidate(all[i], i == decision->chosen, candidates[i]);
    }
    if (num_candidates != nullptr) *num_candidates = all.size();
    return WriteVersioned(err, ToRouteResult(*decision), out);
  });
}

KVR_API kvr_status kvr_router_overlap_scores(kvr_router* router, const uint32_t* tokens,
                                             size_t num_tokens, const kvr_request_options* opts,
                                             kvr_overlap* out, size_t cap, size_t* len,
                                             kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    return PerRankQuery(
        err, router, tokens, num_tokens, opts, out, cap, len, "overlap scores",
        [&](auto prompt, const auto& options) {
          return router->router->OverlapScores(prompt, options);
        },
        [](const auto& s, kvr_overlap& o) { FillOverlap(s, o); });
  });
}

KVR_API kvr_status kvr_router_overlap_scores_hashed(kvr_router* router,
                                                    const uint64_t* local_hashes, size_t num_hashes,
                                                    const kvr_request_options* opts,
                                                    kvr_overlap* out, size_t cap, size_t* len,
                                                    kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = CheckArray(err, local_hashes, num_hashes, "local_hashes")) return s;
    RequestOptions options;
    if (kvr_status s = ToRouteOptions(err, opts, options)) return s;
    // Reused per thread: a thousand-rank answer is 64 KiB, freed and faulted in again on
    // every call otherwise.
    thread_local std::vector<kvrouter::OverlapScore> rows;
    const absl::Status status = router->router->OverlapScoresOfHashesInto(
        std::span(local_hashes, num_hashes), options.route, rows);
    if (!status.ok()) return FromStatus(err, status);
    return ConvertOut(
        err, rows, [](const auto& s, kvr_overlap& o) { FillOverlap(s, o); }, out, cap, len,
        "overlap scores");
  });
}

KVR_API kvr_status kvr_router_find_matches(kvr_router* router, const uint64_t* local_hashes,
                                           size_t num_hashes, kvr_match* out, size_t cap,
                                           size_t* len, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = CheckArray(err, local_hashes, num_hashes, "local_hashes")) return s;
    thread_local std::vector<kvrouter::WorkerMatch> matches;  // reused, as for overlap scores
    router->router->LookUp(std::span(local_hashes, num_hashes), matches);
    return ConvertOut(
        err, matches, [](const auto& m, kvr_match& o) { FillMatch(m, o); }, out, cap, len,
        "matches");
  });
}

KVR_API kvr_status kvr_router_potential_loads(kvr_router* router, const uint32_t* tokens,
                                              size_t num_tokens, const kvr_request_options* opts,
                                              kvr_potential_load* out, size_t cap, size_t* len,
                                              kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    return PerRankQuery(
        err, router, tokens, num_tokens, opts, out, cap, len, "potential loads",
        [&](auto prompt, const auto& options) {
          return router->router->PotentialLoads(prompt, options);
        },
        [](const auto& l, kvr_potential_load& p) { FillPotentialLoad(l, p); });
  });
}

// ---- Request lifecycle -------------------------------------------------------------------

KVR_API kvr_status kvr_router_add_request(kvr_router* router, const uint32_t* tokens,
                                          size_t num_tokens, uint64_t worker_id, uint32_t dp_rank,
                                          const kvr_request_options* opts, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, opts, "opts")) return s;
    RequestOptions options;
    if (kvr_status s = ToRequest(err, tokens, num_tokens, opts, options)) return s;
    if (options.route.request_id.empty()) {
      return Fail(err, KVR_INVALID_ARGUMENT, "opts->request_id is required");
    }
    return FromStatus(err,
                      router->router->AddRequest(options.route.request_id, options.tokens,
                                                 WorkerKey{worker_id, dp_rank}, options.route));
  });
}

KVR_API kvr_status kvr_router_mark_prefill_completed(kvr_router* router, const char* request_id,
                                                     kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, request_id, "request_id")) return s;
    router->router->MarkPrefillCompleted(request_id);
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_expire_requests(kvr_router* router, size_t* expired,
                                              kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    const size_t n = router->router->ExpireStale();
    if (expired != nullptr) *expired = n;
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_close_queue(kvr_router* router, uint64_t* cancelled,
                                          kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    const size_t closed = router->router->CloseQueue();
    if (cancelled != nullptr) *cancelled = closed;
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_record_output(kvr_router* router, const char* request_id,
                                            uint64_t output_tokens, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, request_id, "request_id")) return s;
    auto changed = router->router->RecordOutputTokens(request_id, output_tokens);
    return changed.ok() ? KVR_OK : FromStatus(err, changed.status());
  });
}

KVR_API kvr_status kvr_router_free_request(kvr_router* router, const char* request_id,
                                           kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, request_id, "request_id")) return s;
    router->router->Free(request_id);
    return KVR_OK;
  });
}

// ---- Index snapshot ----------------------------------------------------------------------

KVR_API kvr_status kvr_router_snapshot(kvr_router* router, kvr_buffer** out, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, out, "out")) return s;
    auto encoded = kvrouter::EncodeIndexSnapshot(router->router->block_size(),
                                                 router->router->DumpIndexEvents());
    if (!encoded.ok()) return FromStatus(err, encoded.status());
    *out = new kvr_buffer{*std::move(encoded)};
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_restore(kvr_router* router, const void* data, size_t size,
                                      kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, data, "data")) return s;
    auto snapshot =
        kvrouter::DecodeIndexSnapshot(std::span(static_cast<const uint8_t*>(data), size));
    if (!snapshot.ok()) return FromStatus(err, snapshot.status());
    return FromStatus(err, router->router->RestoreSnapshot(snapshot->block_size, snapshot->events));
  });
}

}  // extern "C"

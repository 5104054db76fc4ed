#include "core/router.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/hashing.h"

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
  std::vector<WorkerMatch> matches;       // sorted by worker
  std::vector<uint64_t> allowed_worker_ids;
  std::optional<WorkerPin> pin;
  std::optional<WorkerKey> preferred;
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

namespace {

absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

TierOverlap OverlapOf(const WorkerMatch& match) {
  return TierOverlap{.device_blocks = match.device_blocks,
                     .host_blocks = match.host_hits,
                     .disk_blocks = match.disk_hits,
                     .external_blocks = match.external_hits};
}

const WorkerMatch* FindMatch(std::span<const WorkerMatch> sorted_matches, WorkerKey worker) {
  auto it = std::lower_bound(sorted_matches.begin(), sorted_matches.end(), worker,
                             [](const WorkerMatch& m, const WorkerKey& w) { return m.worker < w; });
  return it != sorted_matches.end() && it->worker == worker ? &*it : nullptr;
}

bool IsAllowed(uint64_t worker_id, std::span<const uint64_t> allowed) {
  return allowed.empty() || std::find(allowed.begin(), allowed.end(), worker_id) != allowed.end();
}

}  // namespace

absl::Status ValidateRouterOptions(const RouterOptions& options) {
  if (options.block_size == 0) return absl::InvalidArgumentError("block_size must be > 0");
  if (auto status = ValidateSelectorConfig(options.selection); !status.ok()) return status;
  if (options.queue_threshold &&
      (!std::isfinite(*options.queue_threshold) || *options.queue_threshold < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_threshold must be finite and >= 0, got ", *options.queue_threshold));
  }
  if (!std::isfinite(options.approx_ttl_seconds) || options.approx_ttl_seconds <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("approx_ttl_seconds must be > 0, got ", options.approx_ttl_seconds));
  }
  if (options.approx_max_blocks == 0) {
    return absl::InvalidArgumentError("approx_max_blocks must be > 0");
  }
  if (!(options.approx_prune_target_ratio > 0 && options.approx_prune_target_ratio <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "approx_prune_target_ratio must be in (0, 1], got ", options.approx_prune_target_ratio));
  }
  if (!std::isfinite(options.prefill_tokens_per_second) || options.prefill_tokens_per_second < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_tokens_per_second must be finite and >= 0, got ",
                     options.prefill_tokens_per_second));
  }
  if (!std::isfinite(options.request_expiry_seconds) || options.request_expiry_seconds <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_expiry_seconds must be > 0, got ", options.request_expiry_seconds));
  }
  if (options.index_shards < 1 || options.index_shards > kMaxIndexShards) {
    return absl::InvalidArgumentError(absl::StrCat("index_shards must be in [1, ", kMaxIndexShards,
                                                   "], got ", options.index_shards));
  }
  if (!std::isfinite(options.plan_deadline_seconds) || options.plan_deadline_seconds <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan_deadline_seconds must be > 0, got ", options.plan_deadline_seconds));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Router>> Router::Create(RouterOptions options) {
  if (auto status = ValidateRouterOptions(options); !status.ok()) return status;
  return std::unique_ptr<Router>(new Router(std::move(options)));
}

Router::Router(RouterOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? *options_.clock : SteadyClock::Instance()),
      queue_origin_(clock_.Now()),
      random_(options_.random != nullptr
                  ? options_.random
                  : std::make_shared<SeededRandomSource>(
                        options_.seed_from_entropy ? EntropySeed() : options_.random_seed)),
      active_(clock_, ActiveSequencesOptions{.expiry_seconds = options_.request_expiry_seconds,
                                             .prefill_tokens_per_second =
                                                 options_.prefill_tokens_per_second}),
      registry_(options_.block_size),
      plan_deadline_(SecondsToNanos(options_.plan_deadline_seconds)) {
  if (options_.use_kv_events) {
    index_ = std::make_unique<RadixIndex>(
        RadixIndexOptions{.block_size = options_.block_size, .shards = options_.index_shards});
  } else {
    approx_ = std::make_unique<ApproxIndex>(
        ApproxIndexOptions{.block_size = options_.block_size,
                           .ttl_seconds = options_.approx_ttl_seconds,
                           .max_blocks = options_.approx_max_blocks,
                           .prune_target_ratio = options_.approx_prune_target_ratio},
        clock_);
  }
}

Router::~Router() {
  // Nobody may wait on a destroyed router: tell every waiting caller.
  Completions completions;
  {
    std::lock_guard lock(gate_);
    while (!queue_.empty()) {
      auto entry = queue_.PopFront();
      completions.push_back(
          {std::move(entry.item->done), absl::CancelledError("the router was destroyed")});
    }
  }
  Run(completions);
}

// ---------------------------------------------------------------------------------------------
// Workers and events

namespace {

// A block size of 0 stands for the router's.
WorkerConfig WithBlockSize(WorkerConfig config, uint32_t block_size) {
  if (config.block_size == 0) config.block_size = block_size;
  return config;
}

}  // namespace

absl::Status Router::AddWorker(const WorkerConfig& given) {
  const WorkerConfig config = WithBlockSize(given, options_.block_size);
  Completions completions;
  {
    std::lock_guard lock(gate_);
    if (auto status = registry_.Add(config); !status.ok()) return status;
    for (const WorkerKey& rank : RanksOf(config)) active_.AddWorker(rank);
    DrainQueueLocked(completions);
  }
  Run(completions);
  return absl::OkStatus();
}

absl::Status Router::UpdateWorker(const WorkerConfig& config) {
  Completions completions;
  {
    std::lock_guard lock(gate_);
    auto changes = registry_.Update(WithBlockSize(config, options_.block_size));
    if (!changes.ok()) return changes.status();
    for (const WorkerKey& rank : changes->removed) RemoveRankLocked(rank);
    for (const WorkerKey& rank : changes->added) active_.AddWorker(rank);
    DrainQueueLocked(completions);  // a larger max_num_batched_tokens may admit
  }
  Run(completions);
  return absl::OkStatus();
}

absl::Status Router::RemoveWorker(uint64_t worker_id) {
  Completions completions;
  absl::Status status;
  {
    std::lock_guard lock(gate_);
    auto removed = registry_.Remove(worker_id);
    status = removed.status();
    if (removed.ok()) {
      for (const WorkerKey& rank : RanksOf(*removed)) active_.RemoveWorker(rank);
    }
    // Events may have arrived for a worker never registered: forget them too.
    if (index_) index_->RemoveWorker(worker_id);
    if (approx_) approx_->RemoveWorker(worker_id);
    // Requests waiting for this worker alone now have no eligible rank: they fail Unavailable.
    DrainQueueLocked(completions);
  }
  Run(completions);
  return status;
}

void Router::RemoveRankLocked(WorkerKey rank) {
  active_.RemoveWorker(rank);
  if (index_) index_->RemoveWorkerDpRank(rank);
  if (approx_) approx_->RemoveWorkerDpRank(rank);
}

std::vector<WorkerConfig> Router::Workers() const {
  std::lock_guard lock(gate_);
  return registry_.Workers();
}

absl::StatusOr<ApplyResult> Router::ApplyEvent(const KvEvent& event) {
  if (!index_) {
    return absl::FailedPreconditionError(
        "the router runs in approximate mode (use_kv_events = false) and takes no KV events");
  }
  return index_->Apply(event);
}

absl::Status EventStatus(const ApplyResult& result) {
  switch (result.error) {
    case EventError::kNone:
      return absl::OkStatus();
    case EventError::kParentBlockNotFound:
    case EventError::kBlockNotFound:
      return absl::NotFoundError(result.message);
    case EventError::kInvalidBlockSequence:
    case EventError::kInvalidBlock:
      return absl::InvalidArgumentError(result.message);
  }
  return absl::InternalError(result.message);
}

absl::Status Router::ApplyEvents(std::span<const KvEvent> events) {
  absl::Status first;
  size_t rejected = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    absl::StatusOr<ApplyResult> result = ApplyEvent(events[i]);
    const absl::Status status = result.ok() ? EventStatus(*result) : result.status();
    if (!status.ok() && rejected++ == 0) {
      first = absl::Status(status.code(), absl::StrCat("event ", i, ": ", status.message()));
    }
    if (!result.ok()) break;  // approximate mode: none can apply
  }
  if (first.ok()) return first;
  return absl::Status(first.code(),
                      absl::StrCat(first.message(), " (", rejected, " of ", events.size(),
                                   " events rejected, the others applied)"));
}

void Router::CountRejectedBatch() {
  event_batches_rejected_.fetch_add(1, std::memory_order_relaxed);
}

Router::Counters Router::counters() const {
  return {.decisions = decisions_.load(std::memory_order_relaxed),
          .event_batches_rejected = event_batches_rejected_.load(std::memory_order_relaxed)};
}

kvrouter::IndexStats Router::IndexStats() const {
  return index_ ? index_->Stats() : approx_->Stats().index;
}

std::vector<KvEvent> Router::DumpIndexEvents() const {
  return index_ ? index_->DumpEvents() : approx_->index().DumpEvents();
}

absl::Status Router::RestoreIndex(std::span<const KvEvent> events) {
  if (!index_) {
    return absl::FailedPreconditionError(
        "the router runs in approximate mode (use_kv_events = false); its index is not restored "
        "from snapshots");
  }
  for (const WorkerKey& rank : index_->Workers()) index_->RemoveWorkerDpRank(rank);
  size_t rejected = 0;
  std::string first_error;
  for (const KvEvent& event : events) {
    const ApplyResult result = index_->Apply(event);
    if (result.ok()) continue;
    if (rejected++ == 0) first_error = result.message;
  }
  if (rejected > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(rejected, " of ", events.size(),
                     " snapshot events were rejected; the first: ", first_error));
  }
  return absl::OkStatus();
}

absl::Status Router::RestoreSnapshot(uint32_t snapshot_block_size,
                                     std::span<const KvEvent> events) {
  if (snapshot_block_size != options_.block_size) {
    return absl::InvalidArgumentError(absl::StrCat("snapshot block size ", snapshot_block_size,
                                                   " differs from the router's ",
                                                   options_.block_size));
  }
  if (IndexStats().cached_blocks > 0) {
    return absl::FailedPreconditionError(
        "the router's index is not empty; restore into a new router");
  }
  return RestoreIndex(events);
}

// ---------------------------------------------------------------------------------------------
// Preparing a request (no router lock held)

void Router::LookUp(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out) {
  if (index_) {
    index_->FindMatches(local_hashes, out);
  } else {
    approx_->FindMatches(local_hashes, out);
  }
}

void Router::FindMatches(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out) {
  LookUp(local_hashes, out);
  std::sort(out.begin(), out.end(),
            [](const WorkerMatch& a, const WorkerMatch& b) { return a.worker < b.worker; });
}

absl::Status Router::Prepare(std::span<const uint32_t> tokens, const RouteOptions& options,
                             bool for_booking, Prepared& out) {
  auto config = ApplyOverrides(options_.selection, options.overrides);
  if (!config.ok()) return config.status();
  if (for_booking && options.request_id.empty()) {
    return absl::InvalidArgumentError("a request id is required to book a request");
  }
  if (!std::isfinite(options.priority_jump)) {
    return absl::InvalidArgumentError("priority_jump must be finite");
  }
  if (!options.session_id.empty() &&
      !(std::isfinite(options.session_ttl_seconds) && options.session_ttl_seconds > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_ttl_seconds must be > 0, got ", options.session_ttl_seconds));
  }
  out.request_id.assign(options.request_id);
  out.config = *config;
  out.with_admission = options.with_admission;
  out.prompt_tokens = tokens.size();
  out.expected_output_tokens = options.expected_output_tokens;
  out.priority_jump = options.priority_jump;
  out.allowed_worker_ids.assign(options.allowed_worker_ids.begin(),
                                options.allowed_worker_ids.end());
  out.pin = options.pin;
  out.preferred = options.preferred;
  out.session_id.assign(options.session_id);
  out.session_mode = options.session_mode;
  out.session_ttl_seconds = options.session_ttl_seconds;
  out.hold_as_plan = false;

  const BlockHashOptions hash_options{.lora_name = options.prompt.lora_name,
                                      .cache_namespace = options.prompt.cache_namespace,
                                      .eagle = options.prompt.eagle || options_.eagle,
                                      .block_mm_hashes = options.prompt.block_mm_hashes};
  ComputeLocalBlockHashesInto(tokens, options_.block_size, hash_options, out.local_hashes);
  // Without assumed KV reuse the blocks are booked under random identities instead.
  if (out.config.assume_kv_reuse) {
    ComputeTrackingIdsInto(out.local_hashes, out.tracking_ids);
  } else {
    out.tracking_ids.clear();
  }
  // The approximate index records a booking as synthetic stored events keyed by sequence hash.
  if (approx_ && for_booking) {
    ComputeSequenceHashesInto(out.local_hashes, out.sequence_hashes);
  } else {
    out.sequence_hashes.clear();
  }
  FindMatches(out.local_hashes, out.matches);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Selection and booking (under gate_)

bool Router::IsCandidateLocked(const Prepared& prepared, WorkerKey worker) const {
  if (!IsAllowed(worker.worker_id, prepared.allowed_worker_ids)) return false;
  if (!prepared.pin) return true;
  return worker.worker_id == prepared.pin->worker_id &&
         (!prepared.pin->dp_rank || worker.dp_rank == *prepared.pin->dp_rank);
}

absl::Status Router::CheckPinLocked(const Prepared& prepared) const {
  if (!prepared.pin) return absl::OkStatus();
  const WorkerPin& pin = *prepared.pin;
  if (!IsAllowed(pin.worker_id, prepared.allowed_worker_ids)) {
    return absl::InvalidArgumentError(absl::StrCat("pinned worker ", pin.worker_id,
                                                   " is not in allowed_worker_ids (the pin and "
                                                   "the allowed set contradict each other)"));
  }
  if (registry_.Find(pin.worker_id) == nullptr) {
    return absl::NotFoundError(absl::StrCat("pinned worker ", pin.worker_id, " is not registered"));
  }
  if (pin.dp_rank && !active_.HasWorker(WorkerKey{pin.worker_id, *pin.dp_rank})) {
    return absl::NotFoundError(
        absl::StrCat("pinned worker ", pin.worker_id, " has no dp_rank ", *pin.dp_rank));
  }
  return absl::OkStatus();
}

absl::Status Router::SelectLocked(const Prepared& prepared, Selection& out) {
  const SelectorConfig& config = prepared.config;
  const uint32_t block_size = options_.block_size;
  const PotentialLoadQuery query{.block_ids = prepared.tracking_ids,
                                 .random_identities = !config.assume_kv_reuse,
                                 .num_blocks = prepared.local_hashes.size(),
                                 .prompt_tokens = prepared.prompt_tokens,
                                 .track_prefill_tokens = config.track_prefill_tokens};
  const auto cached_tokens = [&](WorkerKey worker) -> uint64_t {
    const WorkerMatch* match = FindMatch(prepared.matches, worker);
    if (match == nullptr) return 0;
    return CachedTokens(EffectiveOverlapBlocks(OverlapOf(*match), config), block_size);
  };
  std::vector<PotentialLoad> loads;
  active_.PotentialLoads(query, cached_tokens, loads);

  std::vector<Candidate> candidates;
  candidates.reserve(loads.size());
  for (const PotentialLoad& load : loads) {
    if (!IsCandidateLocked(prepared, load.current.worker)) continue;
    const WorkerMatch* match = FindMatch(prepared.matches, load.current.worker);
    candidates.push_back(
        Candidate{.worker = load.current.worker,
                  .overlap = match ? OverlapOf(*match) : TierOverlap{},
                  .active_prefill_tokens = load.current.active_prefill_tokens,
                  .active_blocks = load.current.active_blocks,
                  .new_blocks = load.new_blocks,
                  .active_requests = load.current.active_requests,
                  .prefill_tokens_per_second = load.current.prefill_tokens_per_second});
  }
  const SelectionInput input{.prompt_tokens = prepared.prompt_tokens,
                             .block_size = block_size,
                             .candidates = candidates,
                             .allowed_worker_ids = {}};
  if (auto status = SelectWorker(input, config, *random_, out); !status.ok()) return status;
  // A preferred rank (previewed, or a soft session binding) wins while it is still a candidate.
  if (prepared.preferred) {
    for (size_t i = 0; i < out.costs.size(); ++i) {
      if (out.costs[i].worker == *prepared.preferred) out.chosen = i;
    }
  }
  return absl::OkStatus();
}

absl::Status Router::BookLocked(const Prepared& prepared, const CandidateCost& chosen) {
  std::vector<uint64_t> random_ids;
  std::span<const uint64_t> block_ids = prepared.tracking_ids;
  if (!prepared.config.assume_kv_reuse) {
    // Fresh identities: this request's blocks are never counted as shared with another's.
    random_ids.resize(prepared.local_hashes.size());
    for (uint64_t& id : random_ids) id = random_->NextU64();
    block_ids = random_ids;
  }
  const uint64_t prefill_tokens =
      prepared.config.track_prefill_tokens ? prepared.prompt_tokens - chosen.cached_tokens : 0;
  const SequenceRequest request{.request_id = prepared.request_id,
                                .worker = chosen.worker,
                                .block_ids = block_ids,
                                .prefill_tokens = prefill_tokens,
                                .expected_output_tokens = prepared.expected_output_tokens,
                                .prompt_tokens = prepared.prompt_tokens};
  // Booking writes no approximate-index record: that is left for the dispatch
  // (CommitDecisionLocked), so a plan that is aborted leaves no trace in the index.
  return AddBookingLocked(request);
}

void Router::CommitDecisionLocked(const Prepared& prepared, WorkerKey worker) {
  if (approx_) {
    approx_->RecordRoutingDecision(worker, prepared.local_hashes, prepared.sequence_hashes);
  }
  if (!prepared.session_id.empty()) {
    sessions_[prepared.session_id] =
        BoundSession{.worker = worker,
                     .ttl = SecondsToNanos(prepared.session_ttl_seconds),
                     .last_used = clock_.Now()};
  }
}

absl::StatusOr<RouteDecision> Router::DecideLocked(const Prepared& prepared) {
  if (auto status = CheckPinLocked(prepared); !status.ok()) return status;
  Selection selection;
  if (auto status = SelectLocked(prepared, selection); !status.ok()) return status;
  const CandidateCost& winner = selection.winner();
  if (prepared.with_admission) {
    if (auto status = BookLocked(prepared, winner); !status.ok()) return status;
  }
  RouteDecision decision;
  decision.moved_from_preferred = prepared.preferred && winner.worker != *prepared.preferred;
  decision.potential_decode_blocks = winner.decode_blocks;
  if (const WorkerConfig* config = registry_.Find(winner.worker.worker_id)) {
    decision.total_kv_blocks = config->total_kv_blocks;
  }
  decision.worker = winner.worker;
  decision.device_overlap_blocks = winner.overlap.device_blocks;
  decision.effective_overlap_blocks = winner.effective_overlap_blocks;
  decision.cached_tokens = winner.cached_tokens;
  decision.prompt_tokens = prepared.prompt_tokens;
  decision.prompt_blocks = static_cast<uint32_t>(prepared.local_hashes.size());
  decision.booked = prepared.with_admission;
  decision.chosen = selection.chosen;
  decision.candidates = std::move(selection.costs);
  if (prepared.with_admission && prepared.hold_as_plan) {
    auto plan = std::make_unique<PlanRecord>();
    decision.planned = true;
    plan->decision = decision;
    plan->deadline = clock_.Now() + plan_deadline_;
    plan->prepared = std::make_unique<Prepared>(prepared);
    plans_[prepared.request_id] = std::move(plan);
  } else if (prepared.with_admission) {
    // Booking without a plan is a dispatch at once (FindBestMatch with admission).
    CommitDecisionLocked(prepared, winner.worker);
  }
  return decision;
}

absl::Status Router::CheckNewRequestIdLocked(std::string_view request_id) const {
  if (IsReplicaRequestId(request_id)) {
    return absl::InvalidArgumentError(
        "request ids starting with byte 0x1E are reserved (they name replicas' bookings)");
  }
  if (active_.HasRequest(request_id) || queue_.Contains(request_id)) {
    return absl::AlreadyExistsError(absl::StrCat("request id '", AsAbsl(request_id),
                                                 "' is already active or waiting for admission"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Admission queue (under gate_)

bool Router::MustWaitLocked(const Prepared& prepared) const {
  if (!options_.queue_threshold || !prepared.allowed_worker_ids.empty()) return false;
  std::vector<RankPressure> ranks;
  for (const WorkerLoad& load : active_.Loads()) {
    // A pinned request waits for its own rank(s) only.
    if (!IsCandidateLocked(prepared, load.worker)) continue;
    const WorkerConfig* config = registry_.Find(load.worker.worker_id);
    ranks.push_back(RankPressure{
        .active_prefill_tokens = load.active_prefill_tokens,
        .max_num_batched_tokens = config != nullptr ? config->max_num_batched_tokens : 0});
  }
  return AllOverThreshold(ranks, *options_.queue_threshold);
}

void Router::EnqueueLocked(std::unique_ptr<Prepared> prepared, RouteCallback done) {
  // WSPT favours the request with the least uncached work on its best rank.
  uint64_t best_cached = 0;
  for (const WorkerMatch& match : prepared->matches) {
    if (!registry_.HasRank(match.worker) ||
        !IsAllowed(match.worker.worker_id, prepared->allowed_worker_ids)) {
      continue;
    }
    best_cached = std::max(best_cached,
                           CachedTokens(EffectiveOverlapBlocks(OverlapOf(match), prepared->config),
                                        options_.block_size));
  }
  const double arrival =
      static_cast<double>(clock_.Now() - queue_origin_) / static_cast<double>(kNanosPerSecond);
  const double key =
      QueueKey(options_.queue_policy, QueueKeyInputs{.priority_jump = prepared->priority_jump,
                                                     .arrival_offset_seconds = arrival,
                                                     .prompt_tokens = prepared->prompt_tokens,
                                                     .best_cached_tokens = best_cached});
  auto pending = std::make_unique<Pending>();
  pending->ticket = next_ticket_++;
  pending->prepared = std::move(*prepared);
  pending->done = std::move(done);
  const std::string id = pending->prepared.request_id;
  const uint64_t tokens = pending->prepared.prompt_tokens;
  queue_.Push(id, key, tokens, std::move(pending));
}

void Router::DrainQueueLocked(Completions& completions) {
  // Head-of-line: stop at the first request that still has to wait (as Dynamo does).
  while (!queue_.empty() && !MustWaitLocked(queue_.Front().item->prepared)) {
    auto entry = queue_.PopFront();
    auto result = DecideLocked(entry.item->prepared);
    CountDecision(result);
    if (result.ok()) result->queued = true;
    completions.push_back({std::move(entry.item->done), std::move(result)});
  }
}

bool Router::CancelLocked(std::string_view request_id, uint64_t ticket, absl::Status why,
                          Completions& completions) {
  const auto* entry = queue_.Find(request_id);
  if (entry == nullptr || (ticket != 0 && entry->item->ticket != ticket)) return false;
  auto removed = queue_.Remove(request_id);
  completions.push_back({std::move(removed->item->done), std::move(why)});
  return true;
}

void Router::Run(Completions& completions) {
  for (Completion& c : completions) c.done(std::move(c.result));
  completions.clear();
}

// ---------------------------------------------------------------------------------------------
// Routing entry points

uint64_t Router::Submit(std::span<const uint32_t> tokens, const RouteOptions& options,
                        RouteCallback done, bool as_plan) {
  // Reused per thread so the hot path does not allocate its hash and match buffers. It is only
  // used until the decision is made, before any callback runs.
  thread_local Prepared scratch;
  if (auto status = Prepare(tokens, options, options.with_admission, scratch); !status.ok()) {
    done(status);
    return 0;
  }
  scratch.hold_as_plan = as_plan;
  Completions completions;
  uint64_t ticket = 0;
  {
    std::lock_guard lock(gate_);
    // Only a request that books may age plans and sessions: a preview changes nothing.
    if (options.with_admission) {
      if (MaybeSweepLocked()) DrainQueueLocked(completions);
    }
    ApplySessionLocked(scratch, /*use=*/options.with_admission);
    absl::Status id_status =
        options.with_admission ? CheckNewRequestIdLocked(options.request_id) : absl::OkStatus();
    if (id_status.ok()) id_status = CheckPinLocked(scratch);
    if (!id_status.ok()) {
      completions.push_back({std::move(done), std::move(id_status)});
    } else if (options.with_admission && MustWaitLocked(scratch)) {
      ticket = next_ticket_;
      EnqueueLocked(std::make_unique<Prepared>(std::move(scratch)), std::move(done));
    } else {
      auto result = DecideLocked(scratch);
      CountDecision(result);
      completions.push_back({std::move(done), std::move(result)});
    }
  }
  Run(completions);
  return ticket;
}

absl::StatusOr<RouteDecision> Router::FindBestMatch(std::span<const uint32_t> tokens,
                                                    const RouteOptions& options) {
  return Route(tokens, options, /*as_plan=*/false);
}

absl::StatusOr<RouteDecision> Router::Route(std::span<const uint32_t> tokens,
                                            const RouteOptions& options, bool as_plan) {
  struct Waiter {
    std::mutex mu;
    std::condition_variable_any cv;
    std::optional<absl::StatusOr<RouteDecision>> result;
  } waiter;
  // Notifying under the waiter's mutex: once the caller sees the result it may return and
  // destroy `waiter`, which it can only do after this callback has let go of the mutex.
  auto done = [&waiter](absl::StatusOr<RouteDecision> result) {
    std::lock_guard lock(waiter.mu);
    waiter.result = std::move(result);
    waiter.cv.notify_all();
  };
  const uint64_t ticket = Submit(tokens, options, done, as_plan);

  std::unique_lock lock(waiter.mu);
  const auto ready = [&waiter] { return waiter.result.has_value(); };
  if (ready()) return std::move(*waiter.result);
  const bool admitted = options.queue_timeout ? waiter.cv.wait_for(lock, options.stop_token,
                                                                   *options.queue_timeout, ready)
                                              : waiter.cv.wait(lock, options.stop_token, ready);
  if (!admitted) {
    lock.unlock();
    absl::Status why = options.stop_token.stop_requested()
                           ? absl::CancelledError("cancelled while waiting for admission")
                           : absl::DeadlineExceededError("timed out while waiting for admission");
    Completions completions;
    {
      std::lock_guard gate(gate_);
      CancelLocked(options.request_id, ticket, std::move(why), completions);
    }
    Run(completions);
    lock.lock();
    // Either the cancellation above or an admission that won the race has set the result.
    waiter.cv.wait(lock, ready);
  }
  return std::move(*waiter.result);
}

void Router::FindBestMatchAsync(std::span<const uint32_t> tokens, const RouteOptions& options,
                                RouteCallback done) {
  Submit(tokens, options, std::move(done));
}

bool Router::CancelPending(std::string_view request_id) {
  Completions completions;
  bool cancelled;
  {
    std::lock_guard lock(gate_);
    cancelled =
        CancelLocked(request_id, 0, absl::CancelledError("cancelled while waiting"), completions);
  }
  Run(completions);
  return cancelled;
}

absl::Status Router::AddRequest(std::string_view request_id, std::span<const uint32_t> tokens,
                                WorkerKey worker, const RouteOptions& options) {
  RouteOptions booking = options;
  booking.request_id = request_id;
  booking.with_admission = true;
  Prepared prepared;
  if (auto status = Prepare(tokens, booking, /*for_booking=*/true, prepared); !status.ok()) {
    return status;
  }
  std::lock_guard lock(gate_);
  if (auto status = CheckNewRequestIdLocked(request_id); !status.ok()) return status;
  if (!active_.HasWorker(worker)) {
    return absl::NotFoundError(
        absl::StrCat("unknown worker ", worker.worker_id, " dp_rank ", worker.dp_rank));
  }
  const WorkerMatch* match = FindMatch(prepared.matches, worker);
  const Candidate candidate{.worker = worker, .overlap = match ? OverlapOf(*match) : TierOverlap{}};
  const CandidateCost priced =
      ScoreCandidate(candidate, prepared.prompt_tokens, options_.block_size, prepared.config,
                     candidate.active_prefill_tokens);
  return BookLocked(prepared, priced);
}

bool Router::MarkPrefillCompleted(std::string_view request_id) {
  if (IsReplicaRequestId(request_id)) return false;  // a replica's booking: only it may
  Completions completions;
  bool changed;
  {
    std::lock_guard lock(gate_);
    changed = MarkPrefillCompletedLocked(request_id);
    if (changed) DrainQueueLocked(completions);
  }
  Run(completions);
  return changed;
}

bool Router::Free(std::string_view request_id) {
  if (IsReplicaRequestId(request_id)) return false;
  Completions completions;
  bool freed;
  {
    std::lock_guard lock(gate_);
    // A client that gives up before admission frees a request that is still waiting.
    freed = CancelLocked(request_id, 0, absl::CancelledError("freed while waiting for admission"),
                         completions);
    // A request freed before its plan was committed (or aborted) needs no plan any more.
    plans_.erase(AsAbsl(request_id));
    if (!freed) {
      freed = FreeBookingLocked(request_id);
      if (freed) DrainQueueLocked(completions);
    }
  }
  Run(completions);
  return freed;
}

absl::StatusOr<bool> Router::RecordOutputTokens(std::string_view request_id,
                                                uint64_t output_tokens) {
  if (!options_.track_output_blocks) {
    return absl::FailedPreconditionError(
        "output tokens are not tracked (create the router with track_output_blocks)");
  }
  if (IsReplicaRequestId(request_id)) return false;
  std::lock_guard lock(gate_);
  return active_.SetOutputTokens(request_id, output_tokens, options_.block_size);
}

// ---------------------------------------------------------------------------------------------
// Views and housekeeping

absl::StatusOr<std::vector<PotentialLoad>> Router::PotentialLoads(std::span<const uint32_t> tokens,
                                                                  const RouteOptions& options) {
  Prepared prepared;
  if (auto status = Prepare(tokens, options, /*for_booking=*/false, prepared); !status.ok()) {
    return status;
  }
  const SelectorConfig& config = prepared.config;
  const PotentialLoadQuery query{.block_ids = prepared.tracking_ids,
                                 .random_identities = !config.assume_kv_reuse,
                                 .num_blocks = prepared.local_hashes.size(),
                                 .prompt_tokens = prepared.prompt_tokens,
                                 .track_prefill_tokens = config.track_prefill_tokens};
  const auto cached_tokens = [&](WorkerKey worker) -> uint64_t {
    const WorkerMatch* match = FindMatch(prepared.matches, worker);
    if (match == nullptr) return 0;
    return CachedTokens(EffectiveOverlapBlocks(OverlapOf(*match), config), options_.block_size);
  };
  std::vector<PotentialLoad> loads;
  {
    std::lock_guard lock(gate_);
    active_.PotentialLoads(query, cached_tokens, loads);
  }
  std::erase_if(loads, [&](const PotentialLoad& load) {
    return !IsAllowed(load.current.worker.worker_id, prepared.allowed_worker_ids);
  });
  return loads;
}

std::vector<OverlapScore> Router::ScoresOf(std::span<const WorkerMatch> matches,
                                           const SelectorConfig& config) const {
  std::vector<OverlapScore> scores;
  ScoresInto(matches, config, scores);
  return scores;
}

void Router::ScoresInto(std::span<const WorkerMatch> matches, const SelectorConfig& config,
                        std::vector<OverlapScore>& scores) const {
  scores.clear();
  scores.reserve(matches.size());
  for (const WorkerMatch& match : matches) {
    const TierOverlap overlap = OverlapOf(match);
    const double effective = EffectiveOverlapBlocks(overlap, config);
    scores.push_back(OverlapScore{.worker = match.worker,
                                  .overlap = overlap,
                                  .effective_overlap_blocks = effective,
                                  .cached_tokens = CachedTokens(effective, options_.block_size),
                                  .tree_size = match.tree_size});
  }
}

absl::StatusOr<std::vector<OverlapScore>> Router::OverlapScores(std::span<const uint32_t> tokens,
                                                                const RouteOptions& options) {
  Prepared prepared;
  if (auto status = Prepare(tokens, options, /*for_booking=*/false, prepared); !status.ok()) {
    return status;
  }
  return ScoresOf(prepared.matches, prepared.config);
}

absl::StatusOr<std::vector<OverlapScore>> Router::OverlapScoresOfHashes(
    std::span<const uint64_t> local_hashes, const RouteOptions& options) {
  std::vector<OverlapScore> scores;
  if (auto status = OverlapScoresOfHashesInto(local_hashes, options, scores); !status.ok()) {
    return status;
  }
  return scores;
}

absl::Status Router::OverlapScoresOfHashesInto(std::span<const uint64_t> local_hashes,
                                               const RouteOptions& options,
                                               std::vector<OverlapScore>& out) {
  auto config = ApplyOverrides(options_.selection, options.overrides);
  if (!config.ok()) return config.status();
  // Reused per thread, and not sorted: nothing here looks a rank up (a thousand matches take
  // longer to sort than to find).
  thread_local std::vector<WorkerMatch> matches;
  LookUp(local_hashes, matches);
  ScoresInto(matches, *config, out);
  return absl::OkStatus();
}

std::vector<WorkerLoad> Router::Loads() const {
  std::lock_guard lock(gate_);
  return active_.Loads();
}

size_t Router::active_requests() const {
  std::lock_guard lock(gate_);
  return active_.num_requests();
}

size_t Router::pending_count() const {
  std::lock_guard lock(gate_);
  return queue_.size();
}

uint64_t Router::pending_tokens() const {
  std::lock_guard lock(gate_);
  return queue_.pending_tokens();
}

size_t Router::ExpireStale() {
  Completions completions;
  size_t expired;
  {
    std::lock_guard lock(gate_);
    expired = active_.ExpireStale();
    ExpirePlansLocked();  // and plans past their deadline
    DrainQueueLocked(completions);
  }
  Run(completions);
  return expired;
}

void Router::RecheckQueue() {
  Completions completions;
  {
    std::lock_guard lock(gate_);
    DrainQueueLocked(completions);
  }
  Run(completions);
}

// ---------------------------------------------------------------------------------------------
// Staged routing: preview, plan, commit, abort (reference §6.2)

absl::StatusOr<RouteDecision> Router::Preview(std::span<const uint32_t> tokens,
                                              const RouteOptions& options) {
  RouteOptions look = options;
  look.with_admission = false;
  Prepared prepared;
  if (auto status = Prepare(tokens, look, /*for_booking=*/false, prepared); !status.ok()) {
    return status;
  }
  std::lock_guard lock(gate_);
  ApplySessionLocked(prepared, /*use=*/false);
  return DecideLocked(prepared);
}

absl::StatusOr<RouteDecision> Router::Plan(std::span<const uint32_t> tokens,
                                           const RouteOptions& options,
                                           std::optional<WorkerKey> previewed) {
  if (options.request_id.empty()) {
    return absl::InvalidArgumentError("a request id is required to plan a request");
  }
  Completions completions;
  {
    std::lock_guard lock(gate_);
    // Planning twice (a retried gateway call) returns the plan already booked.
    auto it = plans_.find(AsAbsl(options.request_id));
    if (it != plans_.end()) {
      if (it->second->deadline > clock_.Now() && active_.HasRequest(options.request_id)) {
        decisions_.fetch_add(1, std::memory_order_relaxed);
        return it->second->decision;
      }
      // Stale (past its deadline, or its worker removed): free what is left and plan afresh.
      plans_.erase(it);
      if (FreeBookingLocked(options.request_id)) DrainQueueLocked(completions);
    }
  }
  Run(completions);
  RouteOptions plan = options;
  plan.with_admission = true;
  if (previewed) plan.preferred = previewed;
  return Route(tokens, plan, /*as_plan=*/true);
}

absl::Status Router::Commit(std::string_view request_id) {
  Completions completions;
  absl::Status status;
  {
    std::lock_guard lock(gate_);
    if (MaybeSweepLocked()) DrainQueueLocked(completions);
    auto it = plans_.find(AsAbsl(request_id));
    // This plan's own deadline is checked exactly, whenever the last sweep ran.
    if (it != plans_.end() && it->second->deadline <= clock_.Now()) {
      FreeBookingLocked(request_id);
      plans_.erase(it);
      it = plans_.end();
      DrainQueueLocked(completions);
    }
    if (it == plans_.end()) {
      // Committed before (or booked without a plan): nothing left to do.
      status = active_.HasRequest(request_id)
                   ? absl::OkStatus()
                   : absl::NotFoundError(
                         absl::StrCat("no plan for request '", AsAbsl(request_id),
                                      "' (never planned, aborted, freed, or past its deadline)"));
    } else if (!active_.HasRequest(request_id)) {
      // The booking went with its worker (removed) or expired: nothing to dispatch to. The
      // record stays (so a retried commit says the same) until abort, free, a new plan or
      // the deadline.
      status = absl::FailedPreconditionError(
          absl::StrCat("the plan for request '", AsAbsl(request_id),
                       "' lost its booking (its worker was removed); plan again"));
    } else {
      CommitDecisionLocked(*it->second->prepared, it->second->decision.worker);
      plans_.erase(it);
    }
  }
  Run(completions);
  return status;
}

bool Router::Abort(std::string_view request_id) {
  if (IsReplicaRequestId(request_id)) return false;
  Completions completions;
  bool freed;
  {
    std::lock_guard lock(gate_);
    const bool had_plan = plans_.erase(AsAbsl(request_id)) > 0;
    freed = CancelLocked(request_id, 0, absl::CancelledError("aborted while waiting for admission"),
                         completions);
    if (!freed && FreeBookingLocked(request_id)) {
      freed = true;
      DrainQueueLocked(completions);
    }
    freed = freed || had_plan;
  }
  Run(completions);
  return freed;
}

bool Router::MaybeSweepLocked() {
  // Sweeping scans every plan and session, so a busy router does it at most this often; each
  // lookup checks its own entry's deadline or TTL exactly anyway.
  const Nanos now = clock_.Now();
  const Nanos interval = std::min(plan_deadline_, kNanosPerSecond);
  if (now - last_sweep_ < interval) return false;
  last_sweep_ = now;
  ReclaimSessionsLocked();
  return ExpirePlansLocked() > 0;
}

size_t Router::ExpirePlansLocked() {
  const Nanos now = clock_.Now();
  size_t expired = 0;
  for (auto it = plans_.begin(); it != plans_.end();) {
    if (it->second->deadline > now) {
      ++it;
      continue;
    }
    FreeBookingLocked(it->first);
    plans_.erase(it++);
    ++expired;
  }
  return expired;
}

size_t Router::ExpirePlans() {
  Completions completions;
  size_t expired;
  {
    std::lock_guard lock(gate_);
    expired = ExpirePlansLocked();
    if (expired > 0) DrainQueueLocked(completions);
  }
  Run(completions);
  return expired;
}

absl::Status Router::SetPlanDeadline(double seconds) {
  if (!std::isfinite(seconds) || seconds <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan deadline must be finite and > 0 seconds, got ", seconds));
  }
  std::lock_guard lock(gate_);
  plan_deadline_ = SecondsToNanos(seconds);
  return absl::OkStatus();
}

size_t Router::plan_count() const {
  std::lock_guard lock(gate_);
  return plans_.size();
}

// ---------------------------------------------------------------------------------------------
// Session affinity (reference §6.1)

void Router::ApplySessionLocked(Prepared& prepared, bool use) {
  if (prepared.session_id.empty()) return;
  auto it = sessions_.find(prepared.session_id);
  if (it == sessions_.end()) return;
  const Nanos now = clock_.Now();
  if (it->second.ExpiredAt(now)) {
    if (use) sessions_.erase(it);
    return;
  }
  const WorkerKey bound = it->second.worker;
  // An explicit pin outranks the session; a binding the request may not use is no target.
  const bool usable = active_.HasWorker(bound) && IsCandidateLocked(prepared, bound);
  if (prepared.session_mode == SessionMode::kHard) {
    if (!usable) {
      // The bound rank is gone: drop the binding and select once more (rebound at commit).
      if (use) sessions_.erase(it);
      return;
    }
    if (!prepared.pin) prepared.pin = WorkerPin{bound.worker_id, bound.dp_rank};
  } else if (usable && !prepared.preferred) {
    prepared.preferred = bound;
  }
  if (use) it->second.last_used = now;
}

size_t Router::ReclaimSessionsLocked() {
  const Nanos now = clock_.Now();
  return absl::erase_if(sessions_,
                        [now](const auto& entry) { return entry.second.ExpiredAt(now); });
}

std::optional<WorkerKey> Router::SessionBinding(std::string_view session_id) const {
  std::lock_guard lock(gate_);
  auto it = sessions_.find(AsAbsl(session_id));
  if (it == sessions_.end() || it->second.ExpiredAt(clock_.Now())) return std::nullopt;
  return it->second.worker;
}

bool Router::CloseSession(std::string_view session_id) {
  std::lock_guard lock(gate_);
  return sessions_.erase(AsAbsl(session_id)) > 0;
}

size_t Router::ReclaimExpiredSessions() {
  std::lock_guard lock(gate_);
  return ReclaimSessionsLocked();
}

size_t Router::session_count() const {
  std::lock_guard lock(gate_);
  return sessions_.size();
}

// ---------------------------------------------------------------------------------------------
// State digest

uint64_t Router::StateDigest() const {
  const uint64_t index = index_ ? index_->StateDigest() : approx_->index().StateDigest();
  std::lock_guard lock(gate_);
  // Sums of per-item hashes: independent of the hash tables' iteration order.
  uint64_t queue = 0;
  queue_.ForEach([&queue](const auto& entry) {
    queue += absl::HashOf(entry.request_id, entry.prompt_tokens, entry.item->ticket);
  });
  uint64_t plans = 0;
  for (const auto& [id, plan] : plans_) {
    plans += absl::HashOf(id, plan->decision.worker, plan->deadline);
  }
  uint64_t sessions = 0;
  for (const auto& [id, session] : sessions_) {
    sessions += absl::HashOf(id, session.worker, session.ttl, session.last_used);
  }
  return absl::HashOf(index, active_.StateDigest(), queue, queue_.size(), plans, plans_.size(),
                      sessions, sessions_.size());
}

// ---------------------------------------------------------------------------------------------
// Router replicas

absl::Status ValidateReplicaId(std::string_view replica_id) {
  if (replica_id.empty()) return absl::InvalidArgumentError("the replica id is empty");
  if (replica_id.find('\x1f') != std::string_view::npos) {
    return absl::InvalidArgumentError("a replica id must not contain byte 0x1F");
  }
  return absl::OkStatus();
}

namespace {

// A change that names only its request (prefill completed, freed).
SequenceChange ChangeOf(SequenceChange::Kind kind, std::string_view request_id) {
  SequenceChange change;
  change.kind = kind;
  change.request_id = request_id;
  return change;
}

// The name a replica's booking has here: the mark, the origin, a separator, its own id.
std::string ReplicaRequestId(std::string_view origin, std::string_view request_id) {
  return absl::StrCat(absl::string_view(&kReplicaRequestIdMark, 1), AsAbsl(origin), "\x1f",
                      AsAbsl(request_id));
}

}  // namespace

absl::Status Router::AddBookingLocked(const SequenceRequest& request) {
  absl::Status status = active_.AddRequest(request);
  if (status.ok()) {
    NotifyLocked({.kind = SequenceChange::Kind::kAdded,
                  .request_id = request.request_id,
                  .worker = request.worker,
                  .block_ids = request.block_ids,
                  .prefill_tokens = request.prefill_tokens,
                  .expected_output_tokens = request.expected_output_tokens});
  }
  return status;
}

bool Router::MarkPrefillCompletedLocked(std::string_view request_id) {
  if (!active_.MarkPrefillCompleted(request_id)) return false;
  NotifyLocked(ChangeOf(SequenceChange::Kind::kPrefillCompleted, request_id));
  return true;
}

bool Router::FreeBookingLocked(std::string_view request_id) {
  if (!active_.Free(request_id)) return false;
  NotifyLocked(ChangeOf(SequenceChange::Kind::kFreed, request_id));
  return true;
}

void Router::NotifyLocked(const SequenceChange& change) {
  // A replica's booking is only ever changed by that replica: never published back.
  if (observer_ && !IsReplicaRequestId(change.request_id)) observer_(change);
}

uint64_t Router::SetSequenceObserver(std::string replica_id, SequenceObserver observer) {
  static std::atomic<uint64_t> next_token{1};
  std::lock_guard lock(gate_);
  observer_ = std::move(observer);
  if (!observer_) {
    observer_token_ = 0;
    return 0;
  }
  replica_id_ = std::move(replica_id);
  observer_token_ = next_token.fetch_add(1, std::memory_order_relaxed);
  AnnounceBookingsLocked();
  NotifyLocked(ChangeOf(SequenceChange::Kind::kSyncRequest, ""));
  return observer_token_;
}

bool Router::ClearSequenceObserver(uint64_t token) {
  std::lock_guard lock(gate_);
  if (token == 0 || token != observer_token_) return false;
  observer_ = nullptr;
  observer_token_ = 0;
  return true;
}

void Router::AnnounceBookingsLocked() {
  NotifyLocked(ChangeOf(SequenceChange::Kind::kReset, ""));
  active_.ForEachRequest([](std::string_view id) { return !IsReplicaRequestId(id); },
                         [&](const SequenceRequest& booking) {
                           NotifyLocked({.kind = SequenceChange::Kind::kAdded,
                                         .request_id = booking.request_id,
                                         .worker = booking.worker,
                                         .block_ids = booking.block_ids,
                                         .prefill_tokens = booking.prefill_tokens,
                                         .expected_output_tokens = booking.expected_output_tokens});
                         });
}

absl::StatusOr<bool> Router::ApplyReplicaChange(std::string_view origin,
                                                const SequenceChange& change) {
  const bool names_a_request = change.kind != SequenceChange::Kind::kReset &&
                               change.kind != SequenceChange::Kind::kSyncRequest;
  absl::Status valid = ValidateReplicaId(origin);
  if (valid.ok() && names_a_request && change.request_id.empty()) {
    valid = absl::InvalidArgumentError("a replica change needs a request id");
  }
  if (!valid.ok()) {
    std::lock_guard lock(gate_);
    ++replica_changes_rejected_;
    return valid;
  }
  const std::string id = ReplicaRequestId(origin, change.request_id);
  Completions completions;
  absl::StatusOr<bool> changed = false;
  {
    std::lock_guard lock(gate_);
    if (origin == replica_id_) return false;  // our own change, echoed back
    switch (change.kind) {
      case SequenceChange::Kind::kAdded: {
        absl::Status status =
            active_.AddRequest({.request_id = id,
                                .worker = change.worker,
                                .block_ids = change.block_ids,
                                .prefill_tokens = change.prefill_tokens,
                                .expected_output_tokens = change.expected_output_tokens,
                                .prompt_tokens = 0});  // output is not replicated
        changed = status.ok() ? absl::StatusOr<bool>(true) : status;
        break;
      }
      case SequenceChange::Kind::kPrefillCompleted:
        changed = active_.MarkPrefillCompleted(id);
        break;
      case SequenceChange::Kind::kFreed:
        changed = active_.Free(id);
        break;
      case SequenceChange::Kind::kReset: {
        // Every booking of this origin: the names that start with its prefix.
        const std::string prefix = ReplicaRequestId(origin, "");
        changed = active_.FreeIf([&](std::string_view booking) {
          return booking.substr(0, prefix.size()) == prefix;
        }) > 0;
        break;
      }
      case SequenceChange::Kind::kSyncRequest:
        // A replica joined: tell it (and everyone) what this router has booked.
        if (observer_) AnnounceBookingsLocked();
        break;
    }
    ++(changed.ok() ? replica_changes_applied_ : replica_changes_rejected_);
    // Capacity a replica released may admit requests waiting here.
    if (changed.ok() && *changed && change.kind != SequenceChange::Kind::kAdded) {
      DrainQueueLocked(completions);
    }
  }
  Run(completions);
  return changed;
}

Router::ReplicaStats Router::replica_stats() const {
  std::lock_guard lock(gate_);
  return {.changes_applied = replica_changes_applied_,
          .changes_rejected = replica_changes_rejected_ +
                              replica_changes_undecodable_.load(std::memory_order_relaxed),
          .active_requests = active_.CountRequests(IsReplicaRequestId)};
}

void Router::CountRejectedReplicaChange() {
  replica_changes_undecodable_.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace kvrouter

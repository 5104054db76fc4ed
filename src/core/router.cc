// The Router's construction, its workers and KV events, index snapshots, read-only views,
// housekeeping and the state digest. The rest of its work is in units of their own:
// router_selection.cc (prepare, select, book), router_admission.cc (the queue and the routing
// entry points), router_staged.cc (preview, plan, commit, abort; sessions),
// router_replicas.cc (replica sync); session_table.* holds the session bindings.
#include "core/router.h"

#include <algorithm>
#include <cmath>
#include <new>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "core/router_internal.h"

namespace kvrouter {

using router_internal::IsAllowed;
using router_internal::OverlapOf;

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
  if (options.decision_latency_sampling < 1) {
    return absl::InvalidArgumentError("decision_latency_sampling must be >= 1");
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
      plans_(SecondsToNanos(options_.plan_deadline_seconds)),
      sessions_(clock_) {
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
    if (auto status = registry_.Validate(config); !status.ok()) return status;
    const std::vector<WorkerKey> ranks = RanksOf(config);
    if (auto status = registry_.Add(config); !status.ok()) return status;
    try {
      active_.ChangeRanks({}, ranks);  // all or nothing
    } catch (...) {
      registry_.Remove(config.worker_id).IgnoreError();  // allocates nothing
      throw;
    }
    TellRanksLocked(RankChange::Kind::kAdded, config.worker_id, ranks);
    DrainQueueLocked(completions);
  }
  Run(completions);
  return absl::OkStatus();
}

absl::Status Router::UpdateWorker(const WorkerConfig& given) {
  const WorkerConfig config = WithBlockSize(given, options_.block_size);
  Completions completions;
  {
    std::lock_guard lock(gate_);
    auto changes = registry_.ChangesOf(config);
    if (!changes.ok()) return changes.status();
    // The load tracker whole or not at all, then what allocates nothing.
    active_.ChangeRanks(changes->removed, changes->added);
    registry_.Replace(config);
    for (const WorkerKey& rank : changes->removed) ForgetRankLocked(rank);
    TellRanksLocked(RankChange::Kind::kDropped, config.worker_id, changes->removed);
    TellRanksLocked(RankChange::Kind::kAdded, config.worker_id, changes->added);
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
    std::vector<WorkerKey> ranks;
    if (const WorkerConfig* config = registry_.Find(worker_id); config != nullptr) {
      ranks = RanksOf(*config);
      active_.ChangeRanks(ranks, {});  // all or nothing; nothing below allocates
    }
    status = registry_.Remove(worker_id).status();
    // Events may have arrived for a worker never registered: forget them too.
    if (index_) index_->RemoveWorker(worker_id);
    if (approx_) approx_->RemoveWorker(worker_id);
    rank_listeners_.Tell({.kind = RankChange::Kind::kDropped,
                          .worker_id = worker_id,
                          .ranks = ranks,
                          .whole_worker = true});
    // Requests waiting for this worker alone now have no eligible rank: they fail Unavailable.
    DrainQueueLocked(completions);
  }
  Run(completions);
  return status;
}

void Router::TellRanksLocked(RankChange::Kind kind, uint64_t worker_id,
                             std::span<const WorkerKey> ranks) const {
  if (!ranks.empty()) {
    rank_listeners_.Tell(
        {.kind = kind, .worker_id = worker_id, .ranks = ranks, .whole_worker = false});
  }
}

void Router::ForgetRankLocked(WorkerKey rank) {
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
  try {
    return index_->Apply(event);
  } catch (const std::bad_alloc&) {  // before the event changed anything, or midway
    events_refused_for_memory_.fetch_add(1, std::memory_order_relaxed);
    throw;
  }
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

absl::Status OutOfMemoryStatus() noexcept {
  try {
    return absl::ResourceExhaustedError("out of memory");
  } catch (const std::bad_alloc&) {
    return absl::Status(absl::StatusCode::kResourceExhausted, "");  // holds no message
  }
}

absl::Status Router::ApplyEvents(std::span<const KvEvent> events) {
  absl::Status first;
  size_t first_index = 0, rejected = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    absl::StatusOr<ApplyResult> result;
    try {
      result = ApplyEvent(events[i]);
    } catch (const std::bad_alloc&) {  // the index is whole (RadixIndex::Apply): go on
      result = OutOfMemoryStatus();
    }
    const absl::Status status = result.ok() ? EventStatus(*result) : result.status();
    if (!status.ok() && rejected++ == 0) {
      first = status;
      first_index = i;
    }
    if (!result.ok() && !absl::IsResourceExhausted(result.status())) {
      break;  // approximate mode: none can apply
    }
  }
  if (first.ok()) return first;
  try {
    return absl::Status(
        first.code(), absl::StrCat("event ", first_index, ": ", first.message(), " (", rejected,
                                   " of ", events.size(), " events rejected, the others applied)"));
  } catch (const std::bad_alloc&) {  // no memory for the message: the first rejection's own
    return first;
  }
}

void Router::CountRejectedBatch() {
  event_batches_rejected_.fetch_add(1, std::memory_order_relaxed);
}

Router::Counters Router::counters() const {
  return {.decisions = decisions_.load(std::memory_order_relaxed),
          .event_batches_rejected = event_batches_rejected_.load(std::memory_order_relaxed),
          .events_refused_for_memory = events_refused_for_memory_.load(std::memory_order_relaxed),
          .decisions_priced_again = decisions_priced_again_.load(std::memory_order_relaxed)};
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
  std::lock_guard lock(restore_mutex_);  // one restore at a time
  for (const WorkerKey& rank : index_->Workers()) index_->RemoveWorkerDpRank(rank);
  return ApplySnapshotEvents(events);
}

absl::Status Router::ApplySnapshotEvents(std::span<const KvEvent> events) {
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
  if (!index_) return RestoreIndex(events);  // FailedPrecondition, saying why
  std::lock_guard lock(restore_mutex_);
  const kvrouter::IndexStats stats = IndexStats();
  if (stats.cached_blocks > 0 || stats.sliding_blocks > 0) {
    return absl::FailedPreconditionError(
        "the router's index is not empty; restore into a new router");
  }
  return ApplySnapshotEvents(events);
}

// ---------------------------------------------------------------------------------------------
// Views and housekeeping

absl::StatusOr<std::vector<PotentialLoad>> Router::PotentialLoads(std::span<const uint32_t> tokens,
                                                                  const RouteOptions& options) {
  Prepared prepared;
  if (auto status = Prepare(tokens, options, /*for_booking=*/false, prepared); !status.ok()) {
    return status;
  }
  std::vector<PotentialLoad> loads;
  {
    std::lock_guard lock(gate_);
    PotentialLoadsLocked(prepared, loads);
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
// State and index digests

uint64_t Router::IndexDigest() const {
  return index_ ? index_->StateDigest() : approx_->index().StateDigest();
}

uint64_t Router::StateDigest() const {
  const uint64_t index = IndexDigest();
  std::lock_guard lock(gate_);
  // Sums of per-item hashes: independent of the hash tables' iteration order.
  uint64_t queue = 0;
  queue_.ForEach([&queue](const auto& entry) {
    queue += absl::HashOf(entry.request_id, entry.prompt_tokens, entry.item->ticket);
  });
  return absl::HashOf(index, active_.StateDigest(), queue, queue_.size(), plans_.StateDigest(),
                      plans_.size(), sessions_.StateDigest(), sessions_.size());
}

}  // namespace kvrouter

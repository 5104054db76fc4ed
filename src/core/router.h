// The Router: the KV index, the per-rank load tracker, the selector, the admission queue and the
// worker registry behind one object (shared/reference/dynamo-router.md §3-§4).
//
// One request's path: tokens → local block hashes (and sequence hashes) → index lookup: per rank,
// how much of the prompt's prefix is cached on each tier → per rank, the load it carries and would
// carry → cost per rank → pick → (with admission) wait while every rank is over the queue
// threshold, then book the request on the picked rank under the caller's request id.
// Selection never books: FindBestMatch without admission is a preview that changes nothing
// (beyond drawing from the random source), and the same selection is what admission books.
// Load tracking identifies a prompt's blocks by ComputeTrackingIdsInto (active_sequences.h), so
// requests sharing a prefix share its blocks on a rank; without assumed KV reuse each booking
// gets random identities instead.
//
// Thread-safety: a Router is internally synchronised; every method may be called from any thread
// concurrently, except that the destructor must not run while another call is in progress or a
// request is waiting in the queue. Hashing and the index lookup run outside any router lock (the
// index has its own reader/writer lock), so requests hash and match in parallel. Selection,
// booking, load changes (MarkPrefillCompleted, Free, expiry), the queue and the registry share
// one mutex, the admission gate: a selection always sees every booking made before it, so
// concurrent identical requests spread instead of piling onto one rank.
//
// Waiting for admission: FindBestMatch (with admission and a queue threshold) blocks the calling
// thread on a condition variable until the request is admitted, its timeout passes, or its
// stop_token is triggered. FindBestMatchAsync never blocks: its callback runs on the calling
// thread if the request is admitted at once, or later on the thread whose MarkPrefillCompleted /
// Free / AddWorker / ... call freed the capacity (after the router's locks are released, so the
// callback may call back into the router). The core starts no threads; a caller that wants
// periodic re-checks (e.g. to expire lost requests) calls ExpireStale() or RecheckQueue().
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/active_sequences.h"
#include "core/approx_index.h"
#include "core/clock.h"
#include "core/radix_index.h"
#include "core/random_source.h"
#include "core/scheduler_queue.h"
#include "core/selector.h"
#include "core/types.h"
#include "core/worker_registry.h"

namespace kvrouter {

// Every router-wide setting of §4 the core implements. Validated by Router::Create.
struct RouterOptions {
  uint32_t block_size = 16;  // tokens per KV block; > 0; every worker must use the same
  // Cost weights, temperature, assume_kv_reuse and track_prefill_tokens (selector.h).
  SelectorConfig selection;
  // Queue while every eligible rank has more than threshold × max_num_batched_tokens prefill
  // tokens in flight. Unset: never queue (Dynamo's newer default). Finite, >= 0.
  std::optional<double> queue_threshold;
  QueuePolicy queue_policy = QueuePolicy::kFcfs;
  // false: approximate mode. Engines publish no KV events; each routing decision is recorded
  // in the index as if the chosen rank had cached the prompt, for approx_ttl_seconds.
  bool use_kv_events = true;
  double approx_ttl_seconds = 120.0;               // > 0
  uint64_t approx_max_blocks = uint64_t{1} << 20;  // > 0
  double approx_prune_target_ratio = 0.8;          // in (0, 1]
  double request_expiry_seconds = 300.0;           // a booked request older than this is dropped
  uint64_t random_seed = 0;                        // seeds the default random source
  // Injected collaborators (must outlive the router). Null: the process's steady clock, and a
  // SeededRandomSource(random_seed).
  const Clock* clock = nullptr;
  std::shared_ptr<RandomSource> random;
};

absl::Status ValidateRouterOptions(const RouterOptions& options);

// What changes a prompt's block hashes.
struct PromptOptions {
  std::string_view lora_name;
  std::string_view cache_namespace;
  bool eagle = false;
  // Multimodal hashes per block index (hashing.h).
  std::span<const std::vector<uint64_t>> block_mm_hashes;
};

// Per-request options of FindBestMatch and friends. Views are only read during the call.
struct RouteOptions {
  PromptOptions prompt;
  SelectorOverrides overrides;
  // When not empty, only ranks of these workers are candidates. As in Dynamo (§3.2), such an
  // externally restricted request bypasses the queue's capacity check.
  std::span<const uint64_t> allowed_worker_ids;
  // With admission: wait for capacity if queueing applies, then book the request under
  // request_id (required, unique among active and waiting requests). Without: a preview.
  bool with_admission = false;
  std::string_view request_id;
  uint32_t expected_output_tokens = 0;
  double priority_jump = 0;  // queue priority boost (>= 0 counts), §3.2
  // Blocking FindBestMatch only: give up waiting in the queue after this long (steady time),
  // or when stop_token is triggered. The request then leaves the queue unbooked.
  std::optional<std::chrono::nanoseconds> queue_timeout;
  std::stop_token stop_token;
};

// The router's answer for one request.
struct RouteDecision {
  WorkerKey worker;
  uint32_t device_overlap_blocks = 0;   // leading prompt blocks on the chosen rank's device
  double effective_overlap_blocks = 0;  // device + tier-weighted lower-tier hits (§2.6)
  uint64_t cached_tokens = 0;           // round(effective_overlap_blocks × block_size)
  uint64_t prompt_tokens = 0;
  uint32_t prompt_blocks = 0;  // complete blocks of the prompt
  bool booked = false;         // the request is now active on `worker`
  bool queued = false;         // it waited in the admission queue first
  // Every eligible candidate with each term of its cost; candidates[chosen] is `worker`.
  std::vector<CandidateCost> candidates;
  size_t chosen = 0;
};

// Receives a FindBestMatchAsync result. It may run on another caller's thread (the one that
// freed capacity), so it should be quick and must not block on the router: calling
// FindBestMatchAsync, Free or MarkPrefillCompleted from it is fine, waiting in the blocking
// FindBestMatch with admission is not (it would hold up the other admissions that thread runs).
using RouteCallback = std::function<void(absl::StatusOr<RouteDecision>)>;

// A rank's view of a prompt's prefix (for OverlapScores).
struct OverlapScore {
  WorkerKey worker;
  TierOverlap overlap;
  double effective_overlap_blocks = 0;
  uint64_t cached_tokens = 0;
  uint64_t tree_size = 0;  // blocks the rank holds in the index
};

class Router {
 public:
  static absl::StatusOr<std::unique_ptr<Router>> Create(RouterOptions options);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  uint32_t block_size() const { return options_.block_size; }
  bool approximate() const { return !options_.use_kv_events; }

  // --- Workers. Adding or updating a worker may admit waiting requests. ---
  absl::Status AddWorker(const WorkerConfig& config);
  absl::Status UpdateWorker(const WorkerConfig& config);
  // Drops the worker's ranks, its active requests and its index entries. NotFound when it is not
  // registered (its index entries, if events arrived for it anyway, are dropped all the same).
  absl::Status RemoveWorker(uint64_t worker_id);
  std::vector<WorkerConfig> Workers() const;

  // --- KV events (FailedPrecondition in approximate mode, which has none). ---
  absl::StatusOr<ApplyResult> ApplyEvent(const KvEvent& event);

  // --- The index as a whole (snapshots, metrics). ---
  kvrouter::IndexStats IndexStats() const;
  // The index as single-block stored events (RadixIndex::DumpEvents), in either mode.
  std::vector<KvEvent> DumpIndexEvents() const;
  // Replaces the index's content with `events` (a DumpIndexEvents of a router with the same
  // block size). Every event is applied even if some are rejected; then InvalidArgument says how
  // many were and why the first was. Routing during a restore sees a partial index.
  // FailedPrecondition in approximate mode (its recorded blocks carry TTLs a dump lacks).
  absl::Status RestoreIndex(std::span<const KvEvent> events);

  // --- Routing. ---
  // Blocking: returns once decided (and, with admission, booked), or with an error:
  // InvalidArgument (bad option, empty request id with admission), AlreadyExists (request id
  // active or waiting), Unavailable (no eligible rank), DeadlineExceeded / Cancelled (gave up
  // waiting in the queue).
  absl::StatusOr<RouteDecision> FindBestMatch(std::span<const uint32_t> tokens,
                                              const RouteOptions& options);
  // Non-blocking: `done` runs exactly once, possibly before this returns (see the header
  // comment). queue_timeout and stop_token are ignored; use CancelPending.
  void FindBestMatchAsync(std::span<const uint32_t> tokens, const RouteOptions& options,
                          RouteCallback done);
  // Takes a waiting request out of the queue; its caller gets Cancelled. False if not waiting.
  bool CancelPending(std::string_view request_id);

  // Books a request on a rank chosen elsewhere (e.g. a pinned worker). Uses options.prompt,
  // overrides and expected_output_tokens. NotFound for an unknown rank.
  absl::Status AddRequest(std::string_view request_id, std::span<const uint32_t> tokens,
                          WorkerKey worker, const RouteOptions& options = {});
  // Idempotent; unknown ids are no error. Both may admit waiting requests. Free of a request
  // still waiting in the queue cancels it.
  bool MarkPrefillCompleted(std::string_view request_id);
  bool Free(std::string_view request_id);

  // --- Read-only views. ---
  // The load every rank would carry with this prompt (options.prompt and overrides apply).
  absl::StatusOr<std::vector<PotentialLoad>> PotentialLoads(std::span<const uint32_t> tokens,
                                                            const RouteOptions& options = {});
  // What each rank holding the prompt's first block has of its prefix, per tier.
  absl::StatusOr<std::vector<OverlapScore>> OverlapScores(std::span<const uint32_t> tokens,
                                                          const RouteOptions& options = {});
  std::vector<WorkerLoad> Loads() const;
  size_t active_requests() const;
  size_t pending_count() const;
  uint64_t pending_tokens() const;

  // --- Housekeeping (the core has no timer thread). ---
  // Drops requests older than request_expiry_seconds; may admit waiting requests. (Booking also
  // expires old requests, at most every 30 s, but admits nobody: call this periodically when a
  // queue threshold is set and requests may be lost.)
  size_t ExpireStale();
  // Admits whatever waiting requests now fit.
  void RecheckQueue();

 private:
  struct Prepared;
  struct Pending;
  struct Completion;
  using Completions = std::vector<Completion>;

  explicit Router(RouterOptions options);

  // Hashes the prompt and looks it up in the index (no router lock held).
  absl::Status Prepare(std::span<const uint32_t> tokens, const RouteOptions& options,
                       bool for_booking, Prepared& out);
  void FindMatches(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out);

  // The rest runs under gate_.
  absl::Status SelectLocked(const Prepared& prepared, Selection& out);
  absl::StatusOr<RouteDecision> DecideLocked(const Prepared& prepared);
  absl::Status BookLocked(const Prepared& prepared, const CandidateCost& chosen);
  absl::Status CheckNewRequestIdLocked(std::string_view request_id) const;
  bool MustWaitLocked(const Prepared& prepared) const;
  void EnqueueLocked(std::unique_ptr<Prepared> prepared, RouteCallback done);
  void DrainQueueLocked(Completions& completions);
  bool CancelLocked(std::string_view request_id, uint64_t ticket, absl::Status why,
                    Completions& completions);
  void RemoveRankLocked(WorkerKey rank);
  static void Run(Completions& completions);

  // Shared by the blocking and the non-blocking form: decides at once or enqueues.
  // Returns the ticket of the queued request (0 if `done` already ran or will run inline).
  uint64_t Submit(std::span<const uint32_t> tokens, const RouteOptions& options,
                  RouteCallback done);

  const RouterOptions options_;
  const Clock& clock_;
  const Nanos queue_origin_;
  std::unique_ptr<RadixIndex> index_;    // with KV events
  std::unique_ptr<ApproxIndex> approx_;  // approximate mode

  mutable std::mutex gate_;
  std::shared_ptr<RandomSource> random_;
  ActiveSequences active_;
  WorkerRegistry registry_;
  PendingQueue<std::unique_ptr<Pending>> queue_;
  uint64_t next_ticket_ = 1;
};

}  // namespace kvrouter

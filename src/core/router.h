// The Router: the KV index, the per-rank load tracker, the selector, the admission queue, the
// worker registry and the session table behind one object (shared/reference/dynamo-router.md
// §3-§4). Its implementation is split by concern: router.cc (construction, workers, events,
// snapshots, views, digest), router_selection.cc (prepare, select, book), router_admission.cc
// (entry points and the queue), router_staged.cc (plans and sessions), router_replicas.cc
// (replica sync); router_internal.h holds what they share (docs/architecture.md).
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
// index has its own reader/writer lock), so requests hash and match in parallel. Booking, load
// changes (MarkPrefillCompleted, Free, expiry), the queue and the registry share one mutex, the
// admission gate. A decision takes its candidates' loads under it, prices them outside it (in
// parallel with other callers), and picks and books under it again only if the winner's load
// is still the one priced, else decides again wholly under it (router_selection.cc): a booking
// always sees every booking made before it on its rank, so concurrent identical requests
// spread instead of piling onto one rank.
//
// Waiting for admission: FindBestMatch (with admission and a queue threshold) blocks the calling
// thread on a condition variable until the request is admitted, its timeout passes, or its
// stop_token is triggered. FindBestMatchAsync never blocks: its callback runs on the calling
// thread if the request is admitted at once, or later on the thread whose MarkPrefillCompleted /
// Free / AddWorker / ... call freed the capacity (after the router's locks are released, so the
// callback may call back into the router). The core starts no threads; a caller that wants
// periodic re-checks (e.g. to expire lost requests) calls ExpireStale() or RecheckQueue().
#pragma once

#include <atomic>
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

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/active_sequences.h"
#include "core/adaptive_mutex.h"
#include "core/approx_index.h"
#include "core/booking_observer.h"
#include "core/clock.h"
#include "core/latency_histogram.h"
#include "core/plan_table.h"
#include "core/radix_index.h"
#include "core/random_source.h"
#include "core/rank_listeners.h"
#include "core/replica_announcements.h"
#include "core/replica_liveness.h"
#include "core/scheduler_queue.h"
#include "core/selector.h"
#include "core/session_table.h"
#include "core/types.h"
#include "core/worker_registry.h"

namespace kvrouter {

// A replica id is not empty, has no byte 0x1F (which ends it inside booking names) and is at
// most kMaxReplicaIdBytes long. InvalidArgument otherwise.
absl::Status ValidateReplicaId(std::string_view replica_id);

// The longest request id a booking may have, and the longest replica id: each booking is
// published to the other replicas under both, and a change must fit the transport's messages
// (NATS: 1 MiB by default; one that never fits would fail on every announcement).
inline constexpr size_t kMaxRequestIdBytes = 1024;
inline constexpr size_t kMaxReplicaIdBytes = 256;

// A KV event's outcome (RadixIndex::Apply) as a status: OK; NotFound for a block or parent the
// rank does not hold; InvalidArgument for a malformed event. The message is the result's.
absl::Status EventStatus(const ApplyResult& result);

// What a call answers when the heap refused it memory (std::bad_alloc): ResourceExhausted "out
// of memory", or without a message when there is no memory even for that.
absl::Status OutOfMemoryStatus() noexcept;

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
  // The predicted-TTFT cost's prefill rate (tokens/s) before the first prefill completion is
  // seen; 0 = unknown (prefill_rate.h). Finite, >= 0.
  double prefill_tokens_per_second = 0;
  // RecordOutputTokens grows a request's blocks as it generates (reference §3.5, Dynamo's
  // router_track_output_blocks); off, output is not tracked.
  bool track_output_blocks = false;
  // A plan (Plan) neither committed nor aborted within this long is dropped and its booking
  // freed, so a gateway that dies between plan and dispatch leaks nothing. Checked lazily on
  // Plan / Commit / FindBestMatch with admission (sweeps at most once a second, or once a
  // deadline if shorter; Commit checks its own plan exactly) and ExpirePlans. > 0.
  double plan_deadline_seconds = 30.0;
  uint64_t random_seed = 0;  // seeds the default random source
  // Seeds the default random source from the system's entropy (EntropySeed) instead of
  // random_seed: every router then draws differently.
  bool seed_from_entropy = false;
  // The model's blocks use eagle windows: every prompt is hashed so, whatever its
  // PromptOptions::eagle says (hashing.h).
  bool eagle = false;
  // Trees the KV index splits the workers over (RadixIndexOptions::shards), 1..64: events of
  // workers in different trees apply in parallel; every lookup walks every tree.
  uint32_t index_shards = 1;
  // One routing call in this many is timed for decision_latency() (>= 1): two clock reads
  // cost 5-8 % of a decision, a sample's distribution is the same.
  uint32_t decision_latency_sampling = 16;
  // Injected collaborators (must outlive the router). Null: the process's steady clock, and a
  // SeededRandomSource(random_seed).
  const Clock* clock = nullptr;
  std::shared_ptr<RandomSource> random;
};

absl::Status ValidateRouterOptions(const RouterOptions& options);

// A prompt its caller hashed: the local hash of each of its complete blocks (hashing.h, with
// the router's block size and the prompt's LoRA, namespace, eagle windows and multimodal
// content), and its length in tokens.
struct PrehashedPrompt {
  std::span<const uint64_t> local_hashes;
  uint64_t num_tokens = 0;
};

// What changes a prompt's block hashes.
struct PromptOptions {
  std::string_view lora_name;
  std::string_view cache_namespace;
  bool eagle = false;
  // Multimodal hashes per block index (hashing.h).
  std::span<const std::vector<uint64_t>> block_mm_hashes;
  // Set: the routing call hashes no token (its `tokens` must be empty), and the options above
  // are in the hashes already. InvalidArgument unless the hashes are the complete blocks of
  // num_tokens tokens.
  std::optional<PrehashedPrompt> prehashed;
};

// Per-request options of FindBestMatch and friends. Views are only read during the call.
struct RouteOptions {
  PromptOptions prompt;
  SelectorOverrides overrides;
  // When set, only ranks of these workers are candidates (none when it is empty: the call is
  // Unavailable). As in Dynamo (§3.2), such an externally restricted request bypasses the
  // queue's capacity check.
  std::optional<std::span<const uint64_t>> allowed_worker_ids;
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
  // Explicit pin (reference §6.5): only this worker's ranks (or this rank) are candidates.
  // NotFound when it is not registered; InvalidArgument when it is outside allowed_worker_ids.
  std::optional<WorkerPin> pin;
  // A rank to keep while it is still a candidate (a previewed worker, a soft session binding);
  // otherwise normal selection picks and the decision says it moved.
  std::optional<WorkerKey> preferred;
  // Session affinity (reference §6.1). Empty: none. Only Plan/Commit and FindBestMatch with
  // admission create or refresh bindings; previews only read them.
  std::string_view session_id;
  SessionMode session_mode = SessionMode::kHard;
  double session_ttl_seconds = 300.0;  // sliding: every use restarts it; > 0
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
  bool planned = false;        // booked as a plan: Commit or Abort it (Plan)
  // A preferred rank (previewed worker, soft session binding) was asked for but was no longer
  // a candidate, so selection picked again.
  bool moved_from_preferred = false;
  uint64_t potential_decode_blocks = 0;  // the chosen rank's active + new blocks
  uint64_t total_kv_blocks = 0;          // the chosen worker's KV capacity (0 = not reported)
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

  // --- Workers. Adding or updating a worker may admit waiting requests. A block size of 0 in
  // `config` stands for the router's. A refused allocation (std::bad_alloc) leaves the worker
  // registered as before, with the ranks, bookings and cache it had. ---
  absl::Status AddWorker(const WorkerConfig& config);
  absl::Status UpdateWorker(const WorkerConfig& config);
  // Drops the worker's ranks, its active requests and its index entries. NotFound when it is not
  // registered (its index entries, if events arrived for it anyway, are dropped all the same).
  absl::Status RemoveWorker(uint64_t worker_id);
  std::vector<WorkerConfig> Workers() const;
  // Who is told of the ranks AddWorker and UpdateWorker add and UpdateWorker and RemoveWorker
  // (even NotFound: index entries from events go all the same) drop, as the registry changes
  // (rank_listeners.h). A token for RemoveRankListener, which returns once the listener cannot
  // run again.
  uint64_t AddRankListener(RankListener listener) {
    return rank_listeners_.Add(std::move(listener));
  }
  void RemoveRankListener(uint64_t token) { rank_listeners_.Remove(token); }

  // --- KV events (FailedPrecondition in approximate mode, which has none). ---
  absl::StatusOr<ApplyResult> ApplyEvent(const KvEvent& event);
  // A batch's events in order, each on its own: a rejected event does not keep the others from
  // applying. OK when every event applied (or there are none); otherwise the first rejection's
  // code (EventStatus) and a message naming it ("event I: why") and how many of the batch were
  // rejected. In approximate mode the first event's FailedPrecondition ends the batch. An
  // event refused for memory (RadixIndex::Apply) is a ResourceExhausted rejection like another.
  absl::Status ApplyEvents(std::span<const KvEvent> events);
  // A batch that could not be decoded reached the router (nothing of it applied): counted in
  // counters().event_batches_rejected.
  void CountRejectedBatch();

  // --- The index as a whole (snapshots, metrics). ---
  kvrouter::IndexStats IndexStats() const;
  // The index as single-block stored events (RadixIndex::DumpEvents), in either mode.
  std::vector<KvEvent> DumpIndexEvents() const;
  // Replaces the index's content with `events` (a DumpIndexEvents of a router with the same
  // block size). Every event is applied even if some are rejected; then InvalidArgument says how
  // many were and why the first was. Routing during a restore sees a partial index.
  // FailedPrecondition in approximate mode (its recorded blocks carry TTLs a dump lacks).
  absl::Status RestoreIndex(std::span<const KvEvent> events);
  // A snapshot taken from another router into this one's empty index: InvalidArgument when
  // its block size is not this router's, FailedPrecondition when the index is not empty
  // (restore into a new router); otherwise its events are applied as by RestoreIndex, without
  // removing anything first (an event applied meanwhile by an ingest is kept). One restore at a
  // time: of two at once, the second finds the first's index, not an empty one.
  absl::Status RestoreSnapshot(uint32_t snapshot_block_size, std::span<const KvEvent> events);

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
  // For a shutdown: cancels every request waiting in the admission queue (its caller gets
  // Cancelled) and, from now on, every request that would wait, at once; one admitted at once
  // is still routed and booked. Final. Returns how many were waiting.
  size_t CloseQueue();

  // Books a request on a rank chosen elsewhere (e.g. a pinned worker). Uses options.prompt,
  // overrides and expected_output_tokens. NotFound for an unknown rank.
  absl::Status AddRequest(std::string_view request_id, std::span<const uint32_t> tokens,
                          WorkerKey worker, const RouteOptions& options = {});
  // Idempotent; unknown ids are no error. Both may admit waiting requests. Free of a request
  // still waiting in the queue cancels it.
  bool MarkPrefillCompleted(std::string_view request_id);
  bool Free(std::string_view request_id);
  // The request has generated `output_tokens` so far (cumulative): with track_output_blocks,
  // its rank holds one more block whenever prompt + output crosses a block boundary, until it
  // is freed (reference §3.5; not published to replicas, as in Dynamo). FailedPrecondition
  // when the router does not track output; unknown ids are no error. Returns whether the
  // rank's load changed.
  absl::StatusOr<bool> RecordOutputTokens(std::string_view request_id, uint64_t output_tokens);

  // --- Staged routing: preview, plan, commit (reference §6.2). ---
  // What FindBestMatch would pick, without admission: nothing is booked, queued, recorded in
  // the approximate index, and no session binding is created, refreshed or reclaimed (a
  // binding is only read). This is also query-only routing (§6.4). Ignores with_admission.
  absl::StatusOr<RouteDecision> Preview(std::span<const uint32_t> tokens,
                                        const RouteOptions& options);
  // Selection with admission under options.request_id, keeping `previewed` while it is still a
  // candidate (else picking again: moved_from_preferred), then booking it as a plan. Waits in
  // the queue like FindBestMatch. Idempotent: planning an id that already has a plan returns
  // that plan (its decision with the chosen candidate alone: a plan does not keep the others).
  // A plan must be committed or aborted within plan_deadline_seconds.
  absl::StatusOr<RouteDecision> Plan(std::span<const uint32_t> tokens, const RouteOptions& options,
                                     std::optional<WorkerKey> previewed = std::nullopt);
  // The plan was dispatched: records the decision in approximate mode and binds the session.
  // Idempotent (committing a committed, still active request is OK). NotFound when there is no
  // plan (never made, aborted, expired); FailedPrecondition when its worker was removed.
  absl::Status Commit(std::string_view request_id);
  // Dispatch failed or the client gave up: frees the plan's booking (or its queue place, or the
  // active request). Idempotent; returns whether anything was freed.
  bool Abort(std::string_view request_id);
  // Drops plans past their deadline, freeing their bookings; returns how many.
  size_t ExpirePlans();
  size_t plan_count() const;
  // Replaces plan_deadline_seconds for plans made from now on. InvalidArgument unless > 0.
  absl::Status SetPlanDeadline(double seconds);

  // --- Session affinity. ---
  // The rank a live session is bound to (read-only: does not refresh the TTL).
  std::optional<WorkerKey> SessionBinding(std::string_view session_id) const;
  bool CloseSession(std::string_view session_id);
  // Drops bindings whose TTL passed; returns how many. Also done lazily (at most once a second)
  // by Plan, Commit and FindBestMatch with admission.
  size_t ReclaimExpiredSessions();
  size_t session_count() const;

  // An order-independent digest of all routing state: the index, active requests, the queue,
  // plans and session bindings. Equal digests: every future answer is the same.
  uint64_t StateDigest() const;
  // A digest of the KV index alone: which ranks it knows and which blocks each holds, on which
  // tiers, under which prefix. Unlike StateDigest it is the same in every process (fixed mixing,
  // no per-process hash seed), so replicas fed the same events can compare their views. In
  // approximate mode the index is the one routing decisions record into.
  uint64_t IndexDigest() const;

  // --- Read-only views. ---
  // The load every rank would carry with this prompt (options.prompt and overrides apply).
  absl::StatusOr<std::vector<PotentialLoad>> PotentialLoads(std::span<const uint32_t> tokens,
                                                            const RouteOptions& options = {});
  // What each rank holding the prompt's first block has of its prefix, per tier.
  absl::StatusOr<std::vector<OverlapScore>> OverlapScores(std::span<const uint32_t> tokens,
                                                          const RouteOptions& options = {});
  // The same for a prompt already hashed (its blocks' local hashes, as engines' events and
  // Dynamo's find_matches take them), in no particular order; of `options` only the overrides
  // apply.
  absl::StatusOr<std::vector<OverlapScore>> OverlapScoresOfHashes(
      std::span<const uint64_t> local_hashes, const RouteOptions& options = {});
  // The same into `out` (cleared first), so a caller can reuse its capacity.
  absl::Status OverlapScoresOfHashesInto(std::span<const uint64_t> local_hashes,
                                         const RouteOptions& options,
                                         std::vector<OverlapScore>& out);
  // The index's matches of a hashed prompt into `out` (cleared first), in no particular
  // order: the walk alone, no cost model. `computable_blocks`: the blocks an engine may take
  // from its cache for this prompt, when its length is known (RadixIndex::FindMatches).
  void LookUp(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out,
              size_t computable_blocks = SIZE_MAX);
  std::vector<WorkerLoad> Loads() const;
  size_t active_requests() const;
  size_t pending_count() const;
  uint64_t pending_tokens() const;

  // --- Router replicas (reference §7.5) ---
  // `observer` sees every change this router makes to its own bookings: booked (a routed
  // request, a plan, AddRequest), prefill completed, freed (Free, Abort, a plan past its
  // deadline, a stale plan replaced). Not expiry or worker removal: every replica does those by
  // itself. It runs synchronously under the router's lock, in the order of the changes, so it
  // must be quick and must not call the router. `replica_id` names this router to its
  // replicas: ApplyReplicaChange ignores changes from that origin (its own, echoed back). An
  // empty observer stops publishing. The previous observer, if any, first says farewell (a
  // Reset promising no heartbeat: peers drop the bookings they hold under its replica id); once
  // this returns, it is not running and will not run again. A new observer first receives a Reset,
  // an Added for every booking this router holds, and a SyncRequest: peers replace whatever they
  // held from this replica id (a restart's stale bookings) and announce theirs (at once, or with
  // their next heartbeat: AnswerSyncRequestLocked), so a joining replica converges within a
  // heartbeat interval instead of after the request expiry. Returns a token naming this
  // observer for ClearSequenceObserver. Clearing (an empty observer) keeps the replica id, so this
  // router's own changes echoed back later are still recognised.
  uint64_t SetSequenceObserver(std::string replica_id, SequenceObserver observer);
  // Whether this thread is inside this router's observer: any call into the router from there
  // waits for the lock the observer runs under, so the C ABI refuses them. Needs no lock.
  bool ObserverRunningOnThisThread() const { return observer_.RunningOnThisThread(); }
  // Stops the observer `token` names if it is still the current one (a later
  // SetSequenceObserver may have replaced it: then nothing changes). Returns whether it did.
  // With `farewell`, the observer is first told a Reset: peers drop this replica's bookings at
  // once (a graceful stop), instead of when its heartbeats have been missing for the timeout.
  bool ClearSequenceObserver(uint64_t token, bool farewell = false);
  // The transport of the observer `token` names came back after an outage (NATS reconnected):
  // what it published meanwhile may have missed peers that were away too, or gone trimmed for
  // a server not known yet, and peers heard nothing that would have them ask for more. So this
  // router joins again as a new observer does: its bookings announced, then a SyncRequest
  // (peers announce theirs). Nothing if `token` is no longer the current observer; returns
  // whether it joined.
  bool RejoinReplicas(uint64_t token);
  // Applies a change published by the replica `origin`: its bookings count as load here, under
  // names of their own (local request ids cannot collide with them; see IsReplicaRequestId).
  // kAdded: InvalidArgument (empty origin or request id), NotFound (a rank this router does
  // not know), AlreadyExists (booked already). kPrefillCompleted and kFreed are idempotent and
  // may admit waiting requests. Returns whether anything changed.
  // kHeartbeat marks the origin alive (see ExpireSilentReplicas) and changes nothing.
  absl::StatusOr<bool> ApplyReplicaChange(std::string_view origin, const SequenceChange& change);
  // Tells the replicas this router is alive: a kHeartbeat promising the next within
  // `interval_ms`, through the observer. Every change the observer publishes after it carries
  // the interval too (a peer that missed the heartbeats still expires this router when it
  // falls silent). False if there is no observer.
  bool PublishHeartbeat(uint32_t interval_ms);
  // Drops the bookings held here from every replica that has sent a heartbeat (or a change
  // carrying its interval) and has been silent (no change of any kind) for longer than
  // `timeout`, or than three of its heartbeat intervals if that is longer: a replica that died
  // for good. Its capacity may admit waiting requests. Returns how many replicas were dropped; one
  // that comes back announces its bookings again (Reset, Added...) as any joining replica does.
  size_t ExpireSilentReplicas(Nanos timeout);
  // Drops every booking held here from other replicas and stops tracking them: this router no
  // longer hears them (its replica sync stopped), so their frees and heartbeats would never
  // come. Their capacity may admit waiting requests. Returns how many bookings were dropped.
  size_t ForgetReplicas();
  struct ReplicaStats {
    uint64_t changes_applied = 0;   // ApplyReplicaChange calls that succeeded
    uint64_t changes_rejected = 0;  // and those that returned an error
    uint64_t active_requests = 0;   // replicas' bookings active here now
    uint64_t live = 0;              // replicas sending heartbeats and not yet expired
    uint64_t expired = 0;           // replicas ExpireSilentReplicas dropped
    // Own booking changes the observer could not publish for want of memory (each followed by
    // announcing every booking again, once a change gets through).
    uint64_t changes_unpublished = 0;
    // Announcements of other replicas' bookings under way here (ReplicaAnnouncements).
    uint64_t announcing = 0;
  };
  ReplicaStats replica_stats() const;
  // A replica change that could not be decoded: counted in replica_stats().changes_rejected.
  void CountRejectedReplicaChange();

  // --- Counters (monotonic, for metrics). ---
  struct Counters {
    // Successful FindBestMatch, FindBestMatchAsync and Plan calls (a plan returned again by
    // an idempotent Plan counts again); not previews.
    uint64_t decisions = 0;
    uint64_t event_batches_rejected = 0;  // CountRejectedBatch
    // KV events ApplyEvent could not apply for want of memory (std::bad_alloc from the index:
    // refused before the event changed anything, or midway, its rank then cleared).
    uint64_t events_refused_for_memory = 0;
    // Decisions priced outside the gate whose winner (or the queue, or the request id) changed
    // before they could book, and that were decided again under it: how often concurrent
    // callers collide.
    uint64_t decisions_priced_again = 0;
  };
  Counters counters() const;
  // How long routing calls took from their start (hashing included) to their decision, on
  // this router's clock, for a sample of them (options.decision_latency_sampling: the 1st,
  // then every Nth call): FindBestMatch, FindBestMatchAsync and Plan answered without waiting
  // in the queue, and Preview. Queued requests are not measured (their wait is not decision
  // time); failed calls neither.
  LatencyHistogram::Snapshot decision_latency() const { return decision_latency_.Read(); }

  // --- Housekeeping (the core has no timer thread). ---
  // Drops requests older than request_expiry_seconds; may admit waiting requests. (A routing
  // call that books also expires them, at most every 30 s or every request_expiry_seconds when
  // shorter, and admits whom that makes room for; but nothing does while no call comes: call
  // this periodically when a queue threshold is set and requests may be lost.) Also drops plans
  // past their deadline.
  size_t ExpireStale();
  // Admits whatever waiting requests now fit.
  void RecheckQueue();

  // Testing only: runs `pause` on the deciding thread while a decision is priced outside the
  // gate, so that a test can change what it priced (from another thread: this one is inside
  // the call). Set before any concurrent call.
  void SetPricingPauseForTesting(std::function<void()> pause) { pricing_pause_ = std::move(pause); }
  // Stops the current observer without a farewell, as a crash would: for tests of what the
  // peers do with a replica that falls silent.
  void SilenceSequenceObserverForTesting();

 private:
  struct Prepared;
  struct Pending;
  struct Completion;
  using Completions = std::vector<Completion>;

  explicit Router(RouterOptions options);

  // router.cc: workers, events, views.
  // A snapshot's events applied to the index (with KV events), every one even if some are
  // rejected; then InvalidArgument says how many were and why the first was.
  absl::Status ApplySnapshotEvents(std::span<const KvEvent> events);
  // Drops a removed rank's cache from the index (the load tracker dropped the rank itself).
  void ForgetRankLocked(WorkerKey rank);
  // Tells the rank listeners, if there are ranks.
  void TellRanksLocked(RankChange::Kind kind, uint64_t worker_id,
                       std::span<const WorkerKey> ranks) const;
  std::vector<OverlapScore> ScoresOf(std::span<const WorkerMatch> matches,
                                     const SelectorConfig& config) const;
  void ScoresInto(std::span<const WorkerMatch> matches, const SelectorConfig& config,
                  std::vector<OverlapScore>& scores) const;

  // router_selection.cc: one request's decision. Prepare runs without a router lock; the rest
  // (every *Locked method, in every unit) under gate_.
  // Hashes the prompt and looks it up in the index.
  absl::Status Prepare(std::span<const uint32_t> tokens, const RouteOptions& options,
                       bool for_booking, Prepared& out);
  // A prehashed prompt: no tokens beside it, and a hash for each complete block of its length.
  absl::Status CheckPrehashed(std::span<const uint32_t> tokens, const PromptOptions& prompt) const;
  static PotentialLoadQuery LoadQueryOf(const Prepared& prepared);
  // Each rank's index match (nullptr: none), in the order of ActiveSequences::Loads.
  void AlignMatchesLocked(const Prepared& prepared,
                          std::vector<const WorkerMatch*>& match_of_rank) const;
  // The load every rank would carry with the prepared prompt.
  void PotentialLoadsLocked(const Prepared& prepared, std::vector<PotentialLoad>& out);
  // The ranks a request may go to, as the selector takes them, with each one's load version
  // (ActiveSequences::LoadUnchanged).
  struct RankCandidates {
    std::vector<Candidate> candidates;
    std::vector<uint64_t> versions;
  };
  absl::Status CandidatesLocked(const Prepared& prepared, RankCandidates& out) const;
  // Prices them: a pure function, run without the gate by DecidePricedOutsideLocked.
  absl::Status PriceRanks(const Prepared& prepared, const RankCandidates& ranks,
                          Selection& out) const;
  // Draws the pick (the random source is the gate's), then lets a preferred rank win.
  void PickLocked(const Prepared& prepared, Selection& priced);
  absl::Status SelectLocked(const Prepared& prepared, Selection& out);
  absl::StatusOr<RouteDecision> DecideLocked(const Prepared& prepared);
  // DecideLocked with the pricing done outside the gate: `gate` is released while pricing and
  // held again on return. nullopt when what was priced changed meanwhile in a way that matters
  // (the winner's load, the queue, the request id taken, the session's binding) or the pricing
  // failed: the caller decides again, wholly under the gate, from its steering and checks on.
  std::optional<absl::StatusOr<RouteDecision>> DecidePricedOutsideLocked(
      const Prepared& prepared, std::unique_lock<AdaptiveMutex>& gate);
  // The decision for the selection's winner, booked when `prepared` asks for admission.
  absl::StatusOr<RouteDecision> BookSelectionLocked(const Prepared& prepared, Selection& selection);
  // What a plan keeps (DecideLocked): `decision` is unchanged when this returns.
  static RouteDecision PlanRecordOf(RouteDecision& decision);
  std::unique_ptr<Prepared> WhatCommitNeeds(const Prepared& prepared) const;
  // Books `prepared` on the chosen rank and runs `complete`; if that throws, the booking is
  // undone before the exception goes on (AddBookingLocked).
  absl::Status BookLocked(const Prepared& prepared, const CandidateCost& chosen,
                          absl::FunctionRef<void()> complete);
  // What a dispatched decision leaves behind: the approximate-index record and the session
  // binding. The only writer of both. Throws std::bad_alloc with neither left when refused (as
  // far as the approximate index itself is safe against a refused allocation).
  void CommitDecisionLocked(const Prepared& prepared, WorkerKey worker);
  bool IsCandidateLocked(const Prepared& prepared, WorkerKey worker) const;
  absl::Status CheckPinLocked(const Prepared& prepared) const;
  absl::Status CheckNewRequestIdLocked(std::string_view request_id) const;

  // router_admission.cc: the entry points' shared path and the admission queue.
  // Shared by the blocking and the non-blocking form: decides at once or enqueues.
  // Returns the ticket of the queued request (0 if `done` already ran or will run inline).
  // `done` runs exactly once: refused memory, it runs with ResourceExhausted before the
  // std::bad_alloc goes on.
  uint64_t Submit(std::span<const uint32_t> tokens, const RouteOptions& options, RouteCallback done,
                  bool as_plan = false);
  // Submit's work: hands `done` over (to `completions` or the queue) once the request is
  // answered or queued, and not before, so that a refusal leaves it with the caller.
  uint64_t Admit(std::span<const uint32_t> tokens, const RouteOptions& options, RouteCallback& done,
                 bool as_plan, Completions& completions);
  absl::StatusOr<RouteDecision> Route(std::span<const uint32_t> tokens, const RouteOptions& options,
                                      bool as_plan);
  bool MustWaitLocked(const Prepared& prepared) const;
  // The decision of `request_id`'s plan if it is live (not past its deadline, its booking
  // still held), else null.
  const RouteDecision* LivePlanLocked(std::string_view request_id);
  // Takes `done` only once the request is queued (all or nothing).
  void EnqueueLocked(std::unique_ptr<Prepared> prepared, RouteCallback& done);
  void DrainQueueLocked(Completions& completions);
  bool CancelLocked(std::string_view request_id, uint64_t ticket, absl::Status why,
                    Completions& completions);
  // Cancels the request if it is waiting (its caller gets Cancelled: `why`), else frees its
  // booking and drains the queue. Whether it did either.
  bool ReleaseLocked(std::string_view request_id, std::string_view why, Completions& completions);
  static void Run(Completions& completions);
  // A routed request (Submit, or admitted from the queue) was decided: counters().decisions.
  void CountDecision(const absl::StatusOr<RouteDecision>& result) {
    if (result.ok()) decisions_.fetch_add(1, std::memory_order_relaxed);
  }

  // router_staged.cc: plans and sessions.
  size_t ExpirePlansLocked();
  // Expires plans and lost requests and reclaims sessions if the last sweep is old enough;
  // true if a booking was freed (the caller drains the queue).
  bool MaybeSweepLocked();
  // AddRequest's booking, under the gate.
  absl::Status AddRequestLocked(std::string_view request_id, WorkerKey worker,
                                const Prepared& prepared, const RouteOptions& options);
  // Resolves the session binding into a pin or a preference (SessionTable::Steer), from the
  // request's own pin and preference, so that a decision made again after the binding changed
  // (priced again, or waiting in the queue) steers by the new one; changes nothing.
  void ApplySessionLocked(Prepared& prepared);
  // The request is booked: its binding's TTL restarts, or the binding is dropped if it expired
  // or is hard and its rank is gone (a dispatch rebinds it). Allocates nothing: the last step
  // of a booking.
  void UseSessionLocked(const Prepared& prepared);

  // router_replicas.cc: every change to a local booking goes through these three, which tell
  // the observer. AddBookingLocked books, runs `complete`, and only then tells the observer;
  // if `complete` throws, the booking is freed before the exception goes on, untold.
  absl::Status AddBookingLocked(const SequenceRequest& request, absl::FunctionRef<void()> complete);
  bool MarkPrefillCompletedLocked(std::string_view request_id);
  bool FreeBookingLocked(std::string_view request_id);
  void NotifyLocked(const SequenceChange& change);
  // Replica liveness from a change of `origin`; whether to ask it to announce its bookings
  // again (this router expired it, and it has not announced them since: ReplicaLiveness::Beat).
  bool TrackLivenessLocked(std::string_view origin, const SequenceChange& change);
  // A targeted SyncRequest: the replica `origin` alone announces its bookings again.
  void AskToAnnounceAgainLocked(std::string_view origin);
  // A SyncRequest: empty `asked`, a replica joined: this one announces at once, or with its
  // next heartbeat (CanDeferJoinAnswerLocked); this one's id, it announces with its next change
  // or heartbeat; another's, nothing.
  void AnswerSyncRequestLocked(std::string_view asked);
  // Whether a join may be answered by the next heartbeat's announcement: this router beats at
  // least every 2 s, beat within its interval, and announced every booking
  // within it too (a join after a server restart, when every replica rejoins at once).
  bool CanDeferJoinAnswerLocked(Nanos now) const;
  // Whether joins wait for an announcement past their due time (no heartbeat came).
  bool JoinAnswerDueLocked() const;
  // Announces every booking if so.
  void AnnounceIfAnswerDueLocked();
  // Nothing to announce again: the observer stopped, or the announcement was made.
  void ForgetPendingAnnouncementLocked();
  // Reset, then an Added for every local booking (the observer's full picture of this router):
  // what a joining replica, or one whose change the observer lost, tells the others.
  void AnnounceBookingsLocked();
  // What a joining observer says: every booking announced, then a SyncRequest.
  void JoinReplicasLocked();
  // A Reset promising no heartbeat through the current observer: the peers drop this replica's
  // bookings and stop tracking it (an observer stopped or replaced).
  void SayFarewellLocked();
  // Counts a change the observer lost and has every booking announced again.
  void LostNotificationLocked();
  // Frees every booking held here from `origin` (ending any announcement of it under way);
  // returns whether there was any.
  bool DropReplicaBookingsLocked(std::string_view origin);
  // A Reset from `origin` announcing `count` bookings: its bookings held here stay until they
  // have come (ReplicaAnnouncements), or go at once if none come (or memory is refused).
  // Returns whether any went.
  bool ResetReplicaLocked(std::string_view origin, uint32_t count);
  // Books a replica's Added under the name `id`; during an announcement it replaces the copy
  // held before, and the last one announced ends it. `released`: load went (a booking replaced
  // or dropped), so the queue may move.
  absl::StatusOr<bool> AddReplicaBookingLocked(std::string_view origin, const std::string& id,
                                               const SequenceChange& change, bool& released);
  // Ends `origin`'s announcement, if one is under way, dropping the bookings held from before
  // it that were not announced again; returns whether any were.
  bool EndAnnouncementLocked(std::string_view origin);
  // Frees the bookings an ended announcement did not name again; whether there were any.
  bool DropNotAnnouncedLocked(const ReplicaAnnouncements::Names& not_announced_again);

  const RouterOptions options_;
  const Clock& clock_;
  const Nanos queue_origin_;
  std::unique_ptr<RadixIndex> index_;    // with KV events
  std::unique_ptr<ApproxIndex> approx_;  // approximate mode

  mutable AdaptiveMutex gate_;
  std::mutex restore_mutex_;  // RestoreSnapshot's check and its events, one restore at a time
  std::shared_ptr<RandomSource> random_;
  ActiveSequences active_;
  WorkerRegistry registry_;
  PendingQueue<std::unique_ptr<Pending>> queue_;
  uint64_t next_ticket_ = 1;
  bool queue_closed_ = false;  // CloseQueue: a request that would wait is cancelled

  // Booked requests waiting for Commit or Abort: the decision returned again when the same id
  // is planned twice, and the prepared request (hashes, session) for CommitDecisionLocked. Its
  // deadline is options_.plan_deadline_seconds until SetPlanDeadline.
  PlanTable<Prepared, RouteDecision> plans_;
  Nanos last_sweep_ = 0;
  SessionTable sessions_;
  RankListeners rank_listeners_;  // told under gate_, in the registry's order
  // Replica sync.
  BookingObserver observer_;
  ReplicaLiveness liveness_;
  ReplicaAnnouncements announcements_;
  uint64_t replicas_expired_ = 0;
  uint64_t replica_changes_unpublished_ = 0;
  bool reannounce_pending_ = false;  // a change was lost: announce every booking again
  // Joins answered together (AnswerSyncRequestLocked): when this router last published a
  // heartbeat (or tried to) and last announced every booking, and, while joins wait for the
  // next heartbeat's announcement, when it falls due without one.
  std::optional<Nanos> last_heartbeat_;
  std::optional<Nanos> last_announcement_;
  std::optional<Nanos> join_answer_due_;
  uint64_t replica_changes_applied_ = 0;
  uint64_t replica_changes_rejected_ = 0;
  std::atomic<uint64_t> replica_changes_undecodable_{0};
  // counters(): outside the gate.
  std::atomic<uint64_t> decisions_{0};
  std::atomic<uint64_t> event_batches_rejected_{0};
  std::atomic<uint64_t> events_refused_for_memory_{0};
  std::atomic<uint64_t> decisions_priced_again_{0};
  LatencyHistogram decision_latency_;
  std::function<void()> pricing_pause_;  // SetPricingPauseForTesting
  // Calls left until the next one is timed (1: the next one).
  std::atomic<uint32_t> calls_until_timed_{1};

  // The call's start on the router's clock when it is one of the sample, else nullopt. A
  // relaxed load and store, not an atomic decrement: calls racing may count as one, which only
  // shifts the sample, where a locked instruction would cost a good part of what sampling saves.
  std::optional<Nanos> StartTimingIfSampled() {
    const uint32_t left = calls_until_timed_.load(std::memory_order_relaxed);
    if (left > 1) {
      calls_until_timed_.store(left - 1, std::memory_order_relaxed);
      return std::nullopt;
    }
    calls_until_timed_.store(options_.decision_latency_sampling, std::memory_order_relaxed);
    return clock_.Now();
  }
  void FinishTiming(std::optional<Nanos> started) {
    if (started) decision_latency_.Record(clock_.Now() - *started);
  }
};

}  // namespace kvrouter

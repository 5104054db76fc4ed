// Load accounting per worker rank: which requests a rank is serving, how many prompt tokens it
// still has to prefill, and how many KV blocks those requests hold
// (shared/reference/dynamo-router.md §3.5).
//
// Blocks are counted once per rank however many active requests share them. A request books its
// prompt as a chain of block identities: chained hashes such as ComputeTrackingIdsInto's (so two
// requests with the same prefix share the prefix's blocks), or fresh random identities when KV
// reuse is not assumed (so nothing is shared). Because a chained identity names a whole prefix,
// the booked chains form a trie. The tracker keeps that trie path-compressed: one node per run of
// blocks between branch points (and request ends), storing the run's identities, with, per rank,
// how many of its requests cover the run. A rank holds a run entirely or not at all, and a rank
// holding a run holds every run above it. That makes the router's questions cheap:
//   - "how many of this prompt's blocks would be new on each rank": one walk down the trie (a
//     hash lookup per run, a bisection inside the last run), then each run's ranks;
//   - booking touches the runs on the prompt's path and copies its new blocks into one new run
//     (no per-block hashing), and freeing drops only runs no request covers any more (and merges
//     runs a departed request had split).
// The trie is shared by all ranks, so a block's identity is stored once however many ranks hold
// it. Memory follows the live requests: a freed request's record and the runs nobody covers are
// erased at once, and the hash tables shrink when they become mostly empty. (Identities are
// trusted to be prefix-chained as described; a 64-bit collision could only miscount load.)
//
// A refused allocation (std::bad_alloc) changes nothing: AddRequest and ChangeRanks (AddWorker,
// RemoveWorker) allocate all they need before they change anything, and Free, ExpireStale and
// FreeIf allocate nothing (a release merges runs only when the merged run's
// ids fit; shrinking a table is skipped when refused). Hence tables that grow all or nothing
// (FailSafeMap), not absl's raw_hash_set (fail_safe_map.h).
//
// Requests older than the expiry (300 s by default, on the injectable clock) are dropped: a lost
// free() must not leave load behind forever. The owner expires them: MaybeExpire at most once
// per check interval (30 s, or the expiry when shorter), ExpireStale whenever it likes (the
// Router, which then admits whom that makes room for).
//
// Thread-safety: none. An ActiveSequences is a plain data structure; the Router serialises every
// call under its admission gate.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "core/clock.h"
#include "core/fail_safe_map.h"
#include "core/id_hash.h"
#include "core/prefill_rate.h"
#include "core/types.h"

namespace kvrouter {

// Block identities for load tracking: a chain over the prompt's local block hashes, like the
// sequence hash (an identity names the block's whole prefix) but with a cheap 64-bit mixer
// instead of XXH3, since they never leave the router. (Dynamo's newer router_tracking_hash
// decouples tracking identities from sequence hashes in the same way.) `out` is cleared first.
void ComputeTrackingIdsInto(std::span<const uint64_t> local_hashes, std::vector<uint64_t>& out);

struct ActiveSequencesOptions {
  double expiry_seconds = 300.0;  // a request older than this is dropped
  // MaybeExpire looks for expired requests this often, or every expiry_seconds when shorter (a
  // request then outlives its expiry by less than the expiry again).
  double expiry_check_seconds = 30.0;
  // The ranks' prefill rate before the first completion is seen (prefill_rate.h); 0 = unknown.
  double prefill_tokens_per_second = 0;
};

// One request to book on one rank.
struct SequenceRequest {
  std::string request_id;
  WorkerKey worker;
  // The prompt's block identities, in order: chained identities (tracking ids or sequence
  // hashes) when KV reuse is assumed, otherwise distinct random values. May be empty (a prompt
  // shorter than one block).
  std::span<const uint64_t> block_ids;
  // Prompt tokens this rank still has to prefill (isl - cached tokens), or 0 when prefill tokens
  // are not tracked. Counted until MarkPrefillCompleted or Free.
  uint64_t prefill_tokens = 0;
  // Expected output length, when the caller knows it (kept for reporting; 0 = unknown).
  uint32_t expected_output_tokens = 0;
  // The prompt's length in tokens, for output-block tracking (SetOutputTokens); 0 = unknown.
  uint64_t prompt_tokens = 0;
  // How long ago it was booked: 0 for a booking made now; more for one learnt after the fact
  // (a replica's, announced again), which expires that much sooner and, its work ahead unknown,
  // gives no prefill-rate sample. ForEachRequest reports each booking's age here.
  Nanos booked_ago = 0;
};

// A change to the requests one router has booked, as its replicas learn of it (router replica
// sync, shared/reference/dynamo-router.md §7.5): replicas that route to the same workers tell
// each other, so that each one's load view includes the others' requests. Views only: the
// data must be copied to be kept.
struct SequenceChange {
  enum class Kind : uint8_t {
    kAdded = 0,
    kPrefillCompleted = 1,
    kFreed = 2,
    // The origin forgets every booking it announced before and announces its current ones
    // (Added, announced_bookings of them) right after: a replica (re)joining replaces whatever
    // its peers held from it.
    kReset = 3,
    // The origin asks every replica to Reset and announce its bookings again (it has just
    // joined and knows none), or the one request_id names (it had expired that one).
    kSyncRequest = 4,
    // The origin is alive; its bookings are dropped where it stays silent past the liveness
    // timeout (Router::ExpireSilentReplicas).
    kHeartbeat = 5,
  };
  Kind kind = Kind::kAdded;
  // Empty for kReset and kHeartbeat; for kSyncRequest, the replica asked to announce its
  // bookings again (empty: every replica).
  std::string_view request_id;
  // kAdded only: the booking, as SequenceRequest has it.
  WorkerKey worker;
  std::span<const uint64_t> block_ids;
  uint64_t prefill_tokens = 0;
  uint32_t expected_output_tokens = 0;
  // kHeartbeat: how often the origin promises one. Any other kind: that of the origin's last
  // heartbeat through its current publisher (0 = none), so that a receiver that missed the
  // heartbeats still expires the origin when it falls silent.
  uint32_t heartbeat_interval_ms = 0;
  // kAdded: how long before this change the booking was made (SequenceRequest::booked_ago),
  // in milliseconds; 0 when the change announces it as it is made.
  uint32_t booked_ms_ago = 0;
  // kReset: how many kAdded changes follow as the origin's current bookings (0: none, or a sender
  // that does not say). The receiver keeps the origin's bookings held so far until they have
  // come, instead of holding none for that moment (core/replica_announcements.h).
  uint32_t announced_bookings = 0;
};

// Whether a change of this kind names one request (the others speak for the whole origin).
inline bool NamesARequest(SequenceChange::Kind kind) {
  return kind == SequenceChange::Kind::kAdded || kind == SequenceChange::Kind::kPrefillCompleted ||
         kind == SequenceChange::Kind::kFreed;
}

// What a rank is serving now.
struct WorkerLoad {
  WorkerKey worker;
  uint64_t active_blocks = 0;          // distinct blocks held by its active requests
  uint64_t active_prefill_tokens = 0;  // prompt tokens booked and not yet prefilled
  uint64_t active_requests = 0;
  // Prompt tokens per second it prefills, learnt from the fleet's completions (prefill_rate.h);
  // 0 while nothing is known.
  double prefill_tokens_per_second = 0;
};

// A rank's load now and the prompt's blocks it does not hold yet: what booking the prompt
// there would add, as far as bookings tell (the selector prices the prefill itself).
struct LoadWithPrompt {
  WorkerLoad current;
  uint64_t new_blocks = 0;
  // Changes whenever the rank's load does (ActiveSequences::LoadUnchanged).
  uint64_t version = 0;
};

// The load a rank would carry if a new request were booked on it.
struct PotentialLoad {
  WorkerLoad current;
  uint64_t new_blocks = 0;                // the prompt's blocks the rank does not hold yet
  uint64_t potential_prefill_tokens = 0;  // active prefill + this prompt's uncached tokens
  uint64_t potential_decode_blocks = 0;   // active blocks + new_blocks
};

// A prompt whose potential load is asked for.
struct PotentialLoadQuery {
  // The prompt's chained block identities (as booked); ignored when `random_identities` is set.
  std::span<const uint64_t> block_ids;
  // The prompt would be booked with fresh random identities (no KV reuse assumed): every one of
  // its `num_blocks` blocks is new on every rank.
  bool random_identities = false;
  size_t num_blocks = 0;  // used only with random_identities
  uint64_t prompt_tokens = 0;
  bool track_prefill_tokens = true;
};

// NotFound naming a rank the tracker does not have (what AddRequest answers for one).
absl::Status UnknownRankError(WorkerKey worker);

class ActiveSequences {
 public:
  // `clock` must outlive the tracker.
  explicit ActiveSequences(const Clock& clock, ActiveSequencesOptions options = {});
  ~ActiveSequences();
  ActiveSequences(const ActiveSequences&) = delete;
  ActiveSequences& operator=(const ActiveSequences&) = delete;

  // Ranks must be added before requests are booked on them. Adding a known rank is a no-op.
  void AddWorker(WorkerKey worker);
  // Drops the rank and every request booked on it; returns how many requests were dropped.
  // Unknown ranks are no error (0).
  size_t RemoveWorker(WorkerKey worker);
  // Drops the `removed` ranks (as RemoveWorker), then adds the `added` ones (as AddWorker),
  // all or nothing: a refused allocation (std::bad_alloc) changes none of them. Returns how
  // many requests were dropped.
  size_t ChangeRanks(std::span<const WorkerKey> removed, std::span<const WorkerKey> added);
  bool HasWorker(WorkerKey worker) const;
  size_t num_workers() const { return slot_of_.size(); }

  // Books a request. Errors: InvalidArgument (empty id), AlreadyExists (the id is active),
  // NotFound (unknown rank). On error nothing changes, nor when it throws std::bad_alloc.
  absl::Status AddRequest(const SequenceRequest& request);

  // The request's prompt is prefilled: its prefill tokens stop counting, and the time since it
  // was booked is a sample of the prefill rate. Idempotent; unknown ids are no error.
  // Returns whether anything changed.
  bool MarkPrefillCompleted(std::string_view request_id);

  // The request has generated `output_tokens` so far (cumulative): it holds one more block each
  // time ceil((prompt + output) / block_size) grows past ceil(prompt / block_size). Output
  // blocks are the request's own (never shared) and count in its rank's active_blocks until
  // it is freed. Unknown ids are no error. Returns whether the rank's load changed.
  bool SetOutputTokens(std::string_view request_id, uint64_t output_tokens, uint32_t block_size);

  // The request is done (or cancelled): its prefill tokens and its blocks are released.
  // Idempotent; unknown ids are no error. Returns whether a request was freed. Allocates
  // nothing, so it never fails.
  bool Free(std::string_view request_id);

  // Drops every request older than the expiry; returns how many.
  size_t ExpireStale();
  // ExpireStale if the check interval has passed since the last; returns how many it dropped.
  size_t MaybeExpire();

  bool HasRequest(std::string_view request_id) const;
  size_t num_requests() const { return requests_.size(); }
  // Active requests whose id satisfies `pred` (a scan: for metrics, not the hot path).
  size_t CountRequests(absl::FunctionRef<bool(std::string_view)> pred) const;
  // Frees every active request whose id satisfies `pred`; returns how many (a scan).
  size_t FreeIf(absl::FunctionRef<bool(std::string_view)> pred);
  // Calls `visit` with every active request whose id satisfies `pred`, as it was booked (its
  // remaining prefill tokens; block_ids valid during the call), in no particular order.
  void ForEachRequest(absl::FunctionRef<bool(std::string_view)> pred,
                      absl::FunctionRef<void(const SequenceRequest&)> visit) const;
  // The rank a request is booked on, if it is active.
  std::optional<WorkerKey> WorkerOf(std::string_view request_id) const;

  // Current load of one rank (zero if unknown) and of every rank, in a stable order.
  WorkerLoad Load(WorkerKey worker) const;
  std::vector<WorkerLoad> Loads() const;

  // For every rank (stable order, the order of Loads()), its load and the prompt's new blocks.
  void LoadsWithPrompt(const PotentialLoadQuery& query, std::vector<LoadWithPrompt>& out) const;
  // Whether `worker` is still a rank and nothing booked, freed, prefilled or grew on it since
  // LoadsWithPrompt gave it `version` (what it would report is the same, but for the
  // fleet-wide prefill rate, which scales every rank's predicted time alike).
  bool LoadUnchanged(WorkerKey worker, uint64_t version) const;
  // For every rank (the same order), the load it would carry with the new request.
  // `cached_tokens(position, worker)` gives the prompt tokens already cached on the rank at
  // that position of the order (as AlignToRanks numbers them).
  void PotentialLoads(const PotentialLoadQuery& query,
                      absl::FunctionRef<uint64_t(size_t position, WorkerKey worker)> cached_tokens,
                      std::vector<PotentialLoad>& out) const;

  // Lines `items` up with the ranks in the order of Loads() and PotentialLoads(): `out` gets one
  // element per rank, the item whose key_of(item) names that rank or nullptr. Items naming no
  // registered rank are left out. One hash lookup per item and no sorting: a decision at a
  // thousand ranks joins its index matches to the loads this way.
  template <typename Item, typename KeyOf>
  void AlignToRanks(std::span<const Item> items, KeyOf key_of,
                    std::vector<const Item*>& out) const {
    out.assign(slot_of_.size(), nullptr);
    for (const Item& item : items) {
      const uint32_t* slot = slot_of_.Find(key_of(item));
      if (slot == nullptr) continue;
      out[position_of_slot_.empty() ? *slot : position_of_slot_[*slot]] = &item;
    }
  }

  // (rank, block) pairs held, over all ranks; and distinct blocks stored. For tests and memory
  // checks.
  size_t TotalActiveBlocks() const;
  size_t DistinctBlockIds() const { return stored_blocks_; }

  // An order-independent digest of every booked request and every rank's load (for tests that
  // prove a call changed nothing). Stable within one process only.
  uint64_t StateDigest() const;

 private:
  // One rank covering one run: how many of its active requests pass through or end in it.
  struct Holder {
    uint32_t slot;
    uint32_t requests;
  };

  // A run of consecutive blocks of the trie (the root's run is empty).
  struct Run {
    std::vector<uint64_t> ids;
    Run* parent = nullptr;
    std::vector<std::unique_ptr<Run>> children;
    absl::InlinedVector<Holder, 2> holders;
  };

  // Where a walk down the trie went: a run, how many of its blocks matched, and the chain's
  // depth after them.
  struct Step {
    Run* run;
    size_t matched;
    size_t depth;
  };
  using Path = absl::InlinedVector<Step, 8>;

  // A key of child_of_: a run, and the first id of one of its children.
  struct Edge {
    const Run* parent;
    uint64_t first_id;
    friend bool operator==(const Edge&, const Edge&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const Edge& e) {
      return H::combine(std::move(h), e.parent, e.first_id);
    }
  };

  struct Slot {
    WorkerKey worker;
    bool in_use = false;
    uint64_t active_blocks = 0;
    uint64_t active_prefill_tokens = 0;
    uint64_t active_requests = 0;
    uint64_t output_blocks = 0;  // its requests' output blocks (not in the trie)
    uint64_t version = 0;        // changed_ when its load last changed (Changed)
  };

  // Owned by requests_ (a FailSafeMap holds plain values), keyed by a view of its own id.
  struct Record {
    std::string id;
    uint32_t slot;
    std::vector<uint64_t> block_ids;
    uint64_t prefill_tokens;  // 0 once prefilled
    // The rank's prefill tokens when it was booked, its own included: the work its first token
    // waits for (a prefill-rate sample at MarkPrefillCompleted); 0 when unknown (no sample).
    uint64_t work_ahead;
    Nanos started_at;
    uint32_t expected_output_tokens;
    uint64_t prompt_tokens;
    uint64_t output_blocks = 0;
  };

  // A rank's load as the router sees it: trie blocks plus output blocks.
  WorkerLoad LoadOf(const Slot& s) const;
  static void LoadInto(const Slot& s, double prefill_tokens_per_second, WorkerLoad& out);
  // Rebuilds position_of_slot_.
  void NumberPositions();

  // Follows `chain` down the trie as far as it matches, calling on_step(step) for each run it
  // enters; returns the last step (run null if none).
  template <typename OnStep>
  Step Descend(std::span<const uint64_t> chain, OnStep on_step) const;
  // Every step of Descend (allocates for paths deeper than eight runs).
  void Walk(std::span<const uint64_t> chain, Path& path) const;
  // Books the chain on `slot`: all or nothing (it allocates what it needs first).
  void BookBlocks(std::span<const uint64_t> chain, uint32_t slot);
  // Allocates nothing.
  void ReleaseBlocks(std::span<const uint64_t> chain, uint32_t slot);
  // Splits `run` after `keep` ids: `upper` (its first `keep` ids and holders, room for its
  // children) takes its place; returns it. `upper` and child_of_'s room come from the caller.
  Run* Split(Run* run, size_t keep, std::unique_ptr<Run> upper);
  // Adds `run` (its ids set) under `parent`, which has room for it, as has child_of_.
  Run* AddRun(Run* parent, std::unique_ptr<Run> run);
  void DeleteRun(Run* run);
  void MergeSingleChild(Run* run);
  // The slot's holder among the run's, or null.
  static Holder* FindHolder(Run* run, uint32_t slot);
  // Counts one more request of `slot` in the run: on `held`, its holder (FindHolder), or as
  // a new holder when null (the caller made room).
  void AddHolder(Run* run, uint32_t slot, Holder* held);
  void RemoveHolder(Run* run, uint32_t slot);
  // Takes `slot` out of every run (and the runs left empty out of the trie). Allocates
  // nothing; O(runs × siblings), but only ever needed if a rank's runs outlived its requests.
  void SweepSlot(uint32_t slot);
  // Where `run` is among its parent's children.
  static size_t PlaceAmongSiblings(const Run* run);
  // ChangeRanks' steps, once it has made room: neither allocates.
  size_t DropRank(WorkerKey worker);
  void TakeSlot(WorkerKey worker);
  // Depth of `chain` on every slot.
  void HeldDepthPerSlot(std::span<const uint64_t> chain, std::vector<uint32_t>& depth) const;
  // Releases the record's blocks and load; the caller erases it from requests_ and deletes
  // it. Allocates nothing.
  void ReleaseRecord(const Record& record);
  void MaybeShrinkTables();
  // `s`'s load changed: a version no slot had before.
  void Changed(Slot& s) { s.version = ++changes_; }

  const Clock& clock_;
  Nanos expiry_;
  Nanos expiry_check_interval_;
  Nanos last_expiry_check_;
  // No request started before this (a bound: the oldest left at the last scan, or older ones
  // added since; frees leave it low, so a later scan may find nothing and set it again).
  Nanos oldest_started_at_ = std::numeric_limits<Nanos>::max();

  PrefillRate prefill_rate_;
  std::vector<Slot> slots_;  // indexed by slot number; freed slots are reused
  uint64_t changes_ = 0;     // the last version given (Changed)
  std::vector<uint32_t> free_slots_;
  FailSafeMap<WorkerKey, uint32_t> slot_of_;
  // Each slot's position among the ranks in use (the order of Loads()), rebuilt when a rank
  // is added or removed; empty while every slot is in use, when a slot's number is its position.
  std::vector<uint32_t> position_of_slot_;
  // The trie of booked chains, and its edges: (run, first id of a child run) -> that child.
  std::unique_ptr<Run> root_;
  FailSafeMap<Edge, Run*> child_of_;
  size_t stored_blocks_ = 0;
  // Active requests by id; the records do not move, so their ids stay valid while active.
  FailSafeMap<std::string_view, Record*, IdHash> requests_;
};

}  // namespace kvrouter

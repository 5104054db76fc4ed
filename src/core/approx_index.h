// Approximate mode: a KV index for fleets whose engines publish no KV events
// (shared/reference/dynamo-router.md §2.3).
//
// Every routing decision is recorded as if the chosen worker had cached the prompt's blocks:
// the blocks it lacks go into a RadixIndex as a synthetic stored event (engine hash = the
// block's sequence hash). Each recorded (worker, block) expires `ttl` after it was last
// recorded, and when the index holds more than `max_blocks` (worker, block) entries it is
// pruned down to `max_blocks * prune_target_ratio`, earliest expiry first and, among equal
// expiries, deepest block first (a prompt's tail goes before its shared prefix).
// Recording costs O(log n) lookups for the blocks already tracked (whatever their number) plus
// the store of the new ones; expiry and pruning are spread over the following calls (at least
// 256 blocks, or 1.25 per recorded block, each), so no single decision pays for a large prune or
// a mass expiry; ExpireDue drops everything due at once (for idle reclamation). Time comes
// from an injectable Clock, so tests advance it by hand.
//
// The sequence hashes must be the chain of the local hashes (ComputeSequenceHashes): blocks
// are taken apart along paths rebuilt from the tree's local hashes.
//
// Running out of memory (the heap refuses an allocation, std::bad_alloc): every block the
// index holds stays on the path of a live decision, which expires it in time; nothing tracked
// is ever left behind to match forever.
// - RecordRoutingDecision records the decision whole, or throws std::bad_alloc having recorded
//   nothing: the refusal came before the index changed (nothing changed), or in the store of
//   the prompt's new blocks, which then leaves that worker holding nothing (RadixIndex::Apply;
//   counted in IndexStats::refused_events): understated, never a block without a decision.
//   Either way the index stays consistent and takes later decisions normally. Expiry and
//   pruning run before and after it (see below), so blocks that were due may be gone. (If
//   the heap refuses only the decision's entry in its worker's table of endpoints, once the
//   blocks are stored, the decision is recorded without it: an earlier decision ending at the
//   same block then stays too, and an earlier decision's expiry may drop blocks this one
//   still covers. Understated, never left behind.)
// - Expiry and pruning (in RecordRoutingDecision, FindMatches and ExpireDue) never throw and
//   allocate nothing of their own: what taking a decision apart needs is reserved when it is
//   recorded. The index may need to split a run to drop part of it; if the heap refuses that,
//   the decision's worker is left holding nothing (RadixIndex::DropPathTail, counted) and the
//   rest goes on. So memory can always be reclaimed, however short the heap is.
// - FindMatches throws only from its lookup, which changes nothing; RemoveWorker and
//   RemoveWorkerDpRank allocate nothing (nor do the radix index's), so a worker's removal from
//   the Router cannot stop halfway.
//
// Thread-safety: internally synchronised; every method may be called from any thread.
// Lookups share the index's reader lock; recording and expiry serialise on a writer mutex.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/radix_index.h"

namespace kvrouter {

struct ApproxIndexOptions {
  uint32_t block_size = 16;
  double ttl_seconds = 120.0;
  uint64_t max_blocks = uint64_t{1} << 20;
  double prune_target_ratio = 0.8;
};

struct ApproxIndexStats {
  uint64_t tracked_blocks = 0;  // (worker, block) entries with a live TTL
  uint64_t expired_blocks = 0;  // removed because their TTL passed (total)
  uint64_t pruned_blocks = 0;   // removed by size pruning (total)
  uint64_t decisions = 0;       // live decisions: the latest one ending at each (worker, block)
  IndexStats index;
};

class ApproxIndex {
 public:
  // `clock` must outlive the index.
  ApproxIndex(ApproxIndexOptions options, const Clock& clock);
  ~ApproxIndex();
  ApproxIndex(const ApproxIndex&) = delete;
  ApproxIndex& operator=(const ApproxIndex&) = delete;

  // Records that a prompt with these hashes (one local and one sequence hash per complete
  // block, same length) was routed to `worker`. Refreshes the TTL of blocks recorded before.
  void RecordRoutingDecision(WorkerKey worker, std::span<const uint64_t> local_hashes,
                             std::span<const uint64_t> sequence_hashes);

  // As RadixIndex::FindMatches, after dropping blocks whose TTL has passed (a bounded number
  // per call: after a long idle spell a few calls may still see some expired blocks).
  void FindMatches(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out);

  // Drops every block whose TTL has passed; returns how many. Called by FindMatches and
  // RecordRoutingDecision, so calling it is needed only to reclaim memory while idle.
  size_t ExpireDue();

  size_t RemoveWorker(uint64_t worker_id);
  size_t RemoveWorkerDpRank(WorkerKey worker);

  ApproxIndexStats Stats() const;
  const RadixIndex& index() const;

  // Checks the index's invariants (RadixIndex::CheckInvariants), the decisions' own, and that
  // every block a worker holds is on the path of one of its live decisions (so it will
  // expire): "" when all hold, else the first broken one. For tests; walks everything.
  std::string CheckInvariants() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrouter

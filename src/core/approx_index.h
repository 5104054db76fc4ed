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
// 512 blocks, or 2 per recorded block, each), so no single decision pays for a large prune or
// a mass expiry; ExpireDue drops everything due at once (for idle reclamation). Time comes
// from an injectable Clock, so tests advance it by hand.
//
// The sequence hashes must be the chain of the local hashes (ComputeSequenceHashes): blocks
// are taken apart along paths rebuilt from the tree's local hashes.
//
// Thread-safety: internally synchronised; every method may be called from any thread.
// Lookups share the index's reader lock; recording and expiry serialise on a writer mutex.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
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

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrouter

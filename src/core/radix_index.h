// The KV-cache index: which worker holds which prefix of which prompt, on which storage tier.
//
// Data model (Dynamo semantics, shared/reference/dynamo-router.md §2.1-§2.2, §2.6):
// - A radix tree of blocks keyed by their *local* hashes (hashing.h): matching a prompt walks
//   the tree by its local hashes. The tree is path-compressed: a node is a run of consecutive
//   blocks that the same workers hold the same way (its local hashes in one array, its holders
//   once), so a walk compares hashes along an array and updates the workers only where the
//   holders change. A change to some blocks of a run splits the run around them first; runs
//   are never merged back (a split leaves runs of fewer blocks, never more nodes than blocks).
// - Each worker rank has a table from the engine's own block hash to the block's position (its
//   node and offset in the run) and the tiers it holds it on ("dual key"). Engine hashes are
//   opaque: they only find parents and apply removals. A split does not rewrite the tables of
//   the other holders: a position past a run's end is followed to the node that took the
//   run's suffix (lazily, and the entry repaired when next used).
// - A block's holders record, per worker rank, how many of that worker's engine blocks name it
//   on each tier. Removing a block does not cascade to its descendants (as in Dynamo), but a
//   run that no worker holds and that has no children is freed at once, and so is every
//   ancestor left empty by that, so memory follows the live blocks.
//
// Concurrency model: the workers are split over `shards` trees (1 by default), a worker's
// ranks all in one, and each tree has its own reader/writer lock whose readers touch only a
// cache line of their own (scalable_shared_mutex.h), so lookups on different cores do not
// contend. FindMatches, TreeSize, Stats, DumpEvents and StateDigest take the locks shared;
// Apply, RemoveWorker and RemoveWorkerDpRank take their shard's lock exclusively for one
// event (a stored event's tokens are hashed before), so events of workers in different shards
// apply in parallel. Every public method may be called from any thread.
#pragma once

#include <absl/functional/function_ref.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <span>
#include <string>
#include <vector>

#include "core/types.h"

namespace kvrouter {

// Why an event (or part of one) was not applied. Counted per event type and reason.
enum class EventError : uint8_t {
  kNone = 0,
  kParentBlockNotFound,   // the stored event's parent hash is unknown for that worker:
                          // the whole event is dropped (Dynamo)
  kBlockNotFound,         // a removed hash is unknown for that worker (on that tier): the
                          // other hashes of the event are still removed; or a stored event
                          // without tokens (a copy to another tier) names a block the worker
                          // does not hold: the others are still added
  kInvalidBlockSequence,  // a stored block repeats its parent's or an earlier block's hash:
                          // blocks before it are applied, the rest is dropped
  kInvalidBlock,          // a stored block's tokens do not make a complete block, or the
                          // event's hash lists disagree in length: blocks before it apply
};
inline constexpr int kNumEventErrors = 5;
constexpr std::string_view EventErrorName(EventError error) {
  switch (error) {
    case EventError::kNone:
      return "ok";
    case EventError::kParentBlockNotFound:
      return "parent_block_not_found";
    case EventError::kBlockNotFound:
      return "block_not_found";
    case EventError::kInvalidBlockSequence:
      return "invalid_block_sequence";
    case EventError::kInvalidBlock:
      return "invalid_block";
  }
  return "unknown";
}

enum class EventKind : uint8_t { kStored = 0, kRemoved = 1, kCleared = 2 };
inline constexpr int kNumEventKinds = 3;
constexpr std::string_view EventKindName(EventKind kind) {
  switch (kind) {
    case EventKind::kStored:
      return "stored";
    case EventKind::kRemoved:
      return "removed";
    case EventKind::kCleared:
      return "cleared";
  }
  return "unknown";
}

struct ApplyResult {
  EventError error = EventError::kNone;
  std::string message;  // empty when error == kNone
  // A stored event's blocks the rank already held on the event's tier (an engine that keeps
  // two copies of a block publishes such a store for the second); usually empty.
  std::vector<uint64_t> repeated;
  bool ok() const { return error == EventError::kNone; }
};

// What one worker rank holds of a prompt's prefix.
struct WorkerMatch {
  WorkerKey worker;
  uint32_t device_blocks = 0;  // leading blocks cached on the device
  uint32_t host_hits = 0;      // then contiguous blocks on host pinned memory
  uint32_t disk_hits = 0;      // then contiguous blocks on disk
  uint32_t external_hits = 0;  // then contiguous blocks on external storage
  uint64_t tree_size = 0;      // blocks the worker holds in the whole index
};

struct IndexStats {
  uint64_t nodes = 0;           // tree nodes (runs of blocks held alike), the root included
  uint64_t tree_blocks = 0;     // blocks in the tree (distinct prefixes of cached blocks)
  uint64_t cached_blocks = 0;   // (engine block, worker rank) entries
  uint64_t workers = 0;         // worker ranks the index knows (cleared ones included)
  int64_t allocated_bytes = 0;  // heap bytes owned by the index's containers, exactly
  // events[kind][error]: events applied (kNone) or rejected for each reason.
  std::array<std::array<uint64_t, kNumEventErrors>, kNumEventKinds> events{};
  uint64_t duplicate_stores = 0;  // a block stored again on a tier that already held it
  uint64_t rekeyed_blocks = 0;    // an engine hash reused for a different prefix
  // Events the heap refused an allocation for midway: each left its rank holding nothing (see
  // Apply) and threw std::bad_alloc. Counted in no `events` cell.
  uint64_t refused_events = 0;
  // Hybrid models: (sliding-window group, block) entries held, over every rank, and the
  // sliding-window events: sliding_events[0] stores, [1] removals, by outcome.
  uint64_t sliding_blocks = 0;
  std::array<std::array<uint64_t, kNumEventErrors>, 2> sliding_events{};
};

// Most trees an index may be split into (RadixIndexOptions::shards).
inline constexpr uint32_t kMaxIndexShards = 64;

struct RadixIndexOptions {
  uint32_t block_size = 16;  // tokens per block; must be > 0
  // Trees the workers are split over (1..kMaxIndexShards; 0 counts as 1). Events of workers in
  // different shards apply in parallel, each under its shard's own lock; a lookup walks every
  // shard (on the Mooncake trace, 2 shards cost 1.4x a lookup, 4 cost 2.3x).
  uint32_t shards = 1;
};

class RadixIndex {
 public:
  explicit RadixIndex(RadixIndexOptions options = {});
  ~RadixIndex();
  RadixIndex(const RadixIndex&) = delete;
  RadixIndex& operator=(const RadixIndex&) = delete;

  uint32_t block_size() const;
  uint32_t shards() const;
  // The shard that holds the worker's ranks: worker_id mod shards(). Events of workers in
  // different shards apply in parallel, so an applier with several threads gives each of them
  // whole shards.
  uint32_t ShardOf(uint64_t worker_id) const;

  // Applies one event. Never fails fatally: an error is returned and counted, and the part of
  // the event that Dynamo applies despite that error is applied (see EventError).
  //
  // Running out of memory: if the heap refuses an allocation midway, the event's rank is left
  // holding nothing (known, as after a cleared event: the rank's cache is understated, never a
  // block claimed that it lacks), the rest of the index is as it was, it is counted
  // (IndexStats::refused_events) and std::bad_alloc goes on to the caller. An event refused
  // before it changed anything (hashing its tokens, a new rank's slot) leaves the index as it
  // was. The same holds for DropPathTail. Queries that run out of memory throw and change
  // nothing; RemoveWorker and RemoveWorkerDpRank allocate nothing, so they cannot fail.
  ApplyResult Apply(const KvEvent& event);

  // Per worker rank that holds at least the first block (on any tier), what it holds of the
  // prefix given by `local_hashes`. Workers are in no particular order. `out` is cleared first
  // so a caller can reuse its capacity.
  //
  // A rank with sliding-window groups (SlidingStoredEvent: a hybrid model) holds a prefix only
  // where those groups hold the blocks before its end that their window needs
  // (sliding_windows.h); the search for that end starts at the full-attention hit, or at
  // `computable_blocks` if fewer: the blocks an engine may take from its cache for this prompt
  // (vLLM computes at least a prompt's last token: (tokens - 1) / block_size blocks). A hit
  // only that cap lowers is reported whole, as for a rank without such groups; one the groups
  // lower ends on the device, and a rank left with none is not a match.
  void FindMatches(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out,
                   size_t computable_blocks = SIZE_MAX) const;
  std::vector<WorkerMatch> FindMatches(std::span<const uint64_t> local_hashes,
                                       size_t computable_blocks = SIZE_MAX) const;

  // Forgets every rank of the worker, or one rank. Returns the number of blocks dropped.
  size_t RemoveWorker(uint64_t worker_id);
  size_t RemoveWorkerDpRank(WorkerKey worker);

  // Blocks the worker rank holds (0 if unknown).
  uint64_t TreeSize(WorkerKey worker) const;
  // (worker, block) entries in the index (IndexStats::cached_blocks, without the rest).
  uint64_t CachedBlocks() const;

  // For indexes whose holders keep leading runs of chains (approximate mode): how many leading
  // blocks of `engine_hashes`, a chain (each block's parent the one before), the worker holds.
  // A binary search: it assumes that holding a block means holding its ancestors.
  size_t HeldPrefix(WorkerKey worker, std::span<const uint64_t> engine_hashes) const;
  // The local hashes of the path from the root to the worker's block `engine_hash`, root
  // first; empty if the worker does not hold it.
  std::vector<uint64_t> PathTo(WorkerKey worker, uint64_t engine_hash) const;
  // The same into `path` (cleared first), which goes to the heap only if its capacity is short.
  void PathTo(WorkerKey worker, uint64_t engine_hash, std::vector<uint64_t>& path) const;
  // Approximate mode's eviction. `engine_hashes` is a path the worker holds, root first (a
  // chain, as PathTo's local hashes give it): drops up to `limit` of its deepest blocks,
  // deepest first, stopping before a block that is still in use: one for which `keep` is
  // true, or below which the worker holds a block off the path. `finished`: it stopped for
  // good (a block in use, the whole path dropped, or a path the worker does not hold) rather
  // than at the limit, or after 32 runs (tree nodes) of the path; otherwise the caller resumes
  // with the path minus the dropped blocks. The only allocations it needs are the splits of a
  // run it drops part of (a refusal there clears the rank, as for Apply).
  struct TailDrop {
    size_t dropped = 0;
    bool finished = false;
  };
  TailDrop DropPathTail(WorkerKey worker, std::span<const uint64_t> engine_hashes, size_t limit,
                        absl::FunctionRef<bool(uint64_t)> keep);
  std::vector<WorkerKey> Workers() const;

  IndexStats Stats() const;

  // The whole index as events (event ids 0, 1, 2, ...), depth first so parents come before
  // children and each path is contiguous (an index rebuilt from it is laid out as compactly as
  // one built by the engines' events): one single-block stored event per (block, worker, tier),
  // and a cleared event first for each worker that is known but holds nothing. Applying them to
  // an empty index rebuilds one whose StateDigest, and so every answer, is identical. A block
  // whose holder lost its parent (removals do not cascade) is stored with its path rebuilt
  // through temporary blocks, which a removed event drops right after, so the dump has multi-
  // block stores and removals too.
  std::vector<KvEvent> DumpEvents() const;

  // An order-independent digest of everything the index answers from: for every worker rank,
  // every engine hash with its tiers and the local-hash path of the block it names. It does
  // not depend on how runs are split, so a restored index has its original's digest.
  uint64_t StateDigest() const;

  // Checks every structural invariant (links, uniform membership over runs, table entries
  // resolving to runs their worker holds, counts): "" when all hold, else the first broken
  // one. For tests; walks the whole index.
  std::string CheckInvariants() const;

 private:
  class Impl;
  Impl& Shard(uint64_t worker_id) const;

  RadixIndexOptions options_;
  std::vector<std::unique_ptr<Impl>> shards_;
};

}  // namespace kvrouter

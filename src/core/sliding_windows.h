// What the sliding-window KV-cache groups of hybrid models hold, per worker rank (one index
// shard's ranks), and the prefix hit that leaves an engine.
//
// A hybrid model (Gemma-2/3, gpt-oss, Mistral with interleaved windows) has full-attention
// layers and sliding-window layers, which attend to the last W tokens only. vLLM caches each
// group of layers apart, under the same block hashes: a sliding-window group keeps a block only
// while some request's window may still need it, so it holds scattered blocks of a prefix the
// full-attention group holds whole. vLLM (KVCoordinator, SlidingWindowManager.
// find_longest_cache_hit) counts a prefix of n blocks as cached only if every group can resume
// there: full attention holds blocks [0, n), and each sliding group of window W holds the
// ceil((W - 1) / block_size) blocks just before n (all of its groups of that window: they are
// looked up together). It searches from the full-attention hit down to the first such n; if
// there is none, the sliding group's leading run of held blocks is the hit.
//
// Blocks are identified by their sequence hash (hashing.h: the whole prefix up to and including
// the block), which the index finds from the engine hash of a block the rank holds in full
// attention, and which a prompt's local hashes give at lookup. A group's blocks are recorded by
// (group, engine hash) for removals; a block the group names under several engine hashes is held
// until the last goes. Memory follows the engine's: a block stays until the engine removes it,
// clears the rank, or the rank goes. The groups a rank has (at most kMaxGroups) stay as long as
// its blocks (so that a rank whose sliding groups hold nothing hits nothing) and go with a clear
// (an engine restarted with another configuration must not keep the old one's groups): until a
// window stores again, the rank is matched by full attention alone (one batch of an engine's
// events, each applied under the shard's lock on its own, may show that state to a lookup).
//
// Not modelled: vLLM with EAGLE speculative decoding, whose window manager needs one block more
// and drops the last block of a hit (predictions for such workers may be one block high).
//
// Thread-safety: none; the index shard's lock guards it. Every byte it allocates is counted in
// the `bytes` it was given. A refused allocation throws std::bad_alloc after forgetting the rank
// (see Store).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/hash/hash.h"
#include "core/counting_allocator.h"
#include "core/types.h"

namespace kvrouter {

class SlidingWindows {
 public:
  // Sliding groups a rank may have (a real model has a handful; garbage must not grow this).
  static constexpr size_t kMaxGroups = 64;

  SlidingWindows(int64_t* bytes, uint32_t block_size);

  struct Outcome {
    size_t missing = 0;          // blocks not applied: not placed (a store) or not held (a removal)
    uint64_t first_missing = 0;  // the first of them
    bool too_many_groups = false;  // a store of a new group past kMaxGroups: nothing applied
  };

  // The group (of window `window_tokens`) now holds these blocks. `sequence_hash(i)` gives the
  // sequence hash of block i, or nullopt when the rank does not hold it in full attention (it
  // is then not applied, and counted missing). A group already known with another window takes
  // the new one. Refused: std::bad_alloc, the rank forgotten (as by Release).
  Outcome Store(WorkerKey rank, int64_t group, uint32_t window_tokens,
                std::span<const uint64_t> engine_hashes,
                absl::FunctionRef<std::optional<uint64_t>(size_t)> sequence_hash);
  // The group no longer holds these blocks. Allocates nothing.
  Outcome Remove(WorkerKey rank, int64_t group, std::span<const uint64_t> engine_hashes) noexcept;
  // The rank forgotten, its groups and blocks: a clear or the rank's removal. Allocates nothing.
  void Release(WorkerKey rank) noexcept;
  bool empty() const { return ranks_.empty(); }
  bool Has(WorkerKey rank) const { return ranks_.contains(rank); }

  // The blocks of a prompt the rank can resume from given that its full attention holds the
  // first `limit` (sequence_hashes has at least that many: the prompt's, from the first block),
  // applying every window's rule until none lowers it further. `limit` for a rank without
  // sliding groups.
  uint32_t Hit(WorkerKey rank, std::span<const uint64_t> sequence_hashes, uint32_t limit) const;

  // (group, engine hash) entries held, over every rank.
  uint64_t blocks() const { return blocks_; }

  // Per rank and group, in no particular order: the group's window and its blocks as (engine
  // hash, sequence hash), sorted.
  void ForEachGroup(absl::FunctionRef<void(WorkerKey, int64_t group, uint32_t window_tokens,
                                           std::span<const std::pair<uint64_t, uint64_t>>)>
                        visit) const;
  // "" when the per-window counts agree with the groups' blocks, else what does not.
  std::string CheckInvariants() const;

 private:
  // A block within a scope: a group (its index) for Rank::sequence_of (by engine hash) and
  // Rank::copies (by sequence hash), a window (its tokens) for Rank::holding.
  struct ScopedBlock {
    int64_t scope;
    uint64_t hash;
    friend bool operator==(const ScopedBlock&, const ScopedBlock&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const ScopedBlock& b) {
      return H::combine(std::move(h), b.scope, b.hash);
    }
  };
  struct Group {
    int64_t index;
    uint32_t window_tokens;
  };
  template <typename K, typename V>
  using Map = std::unordered_map<K, V, absl::Hash<K>, std::equal_to<>,
                                 CountingAllocator<std::pair<const K, V>>>;
  struct Rank {
    explicit Rank(int64_t* bytes);
    std::vector<Group, CountingAllocator<Group>> groups;
    Map<ScopedBlock, uint64_t> sequence_of;  // (group, engine hash) -> the block's sequence hash
    Map<ScopedBlock, uint32_t> copies;       // (group, sequence hash) -> its engine hashes
    Map<ScopedBlock, uint32_t> holding;      // -> how many groups of that window hold the block
  };

  Rank& RankFor(WorkerKey rank);
  void ChangeWindow(Rank& r, int64_t group, uint32_t window_tokens) noexcept;
  static void Hold(Rank& r, int64_t group, uint32_t window_tokens, uint64_t sequence);
  static void Unhold(Rank& r, int64_t group, uint32_t window_tokens, uint64_t sequence) noexcept;
  static uint32_t WindowOf(const Rank& r, int64_t group);
  uint32_t BlocksBefore(uint32_t window_tokens) const;
  uint32_t RuleHit(const Rank& r, uint32_t window_tokens, uint32_t groups,
                   std::span<const uint64_t> sequence_hashes, uint32_t limit) const;

  int64_t* bytes_;
  uint32_t block_size_;
  uint64_t blocks_ = 0;
  Map<WorkerKey, Rank> ranks_;
};

}  // namespace kvrouter

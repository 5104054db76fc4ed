// Per publisher: the blocks an engine holds more than once (ingest state, not a wire format).
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>

#include "absl/hash/hash.h"
#include "core/types.h"

namespace kvrouter {

// vLLM holds a block twice when it recomputes the last block of a fully cached prompt (its
// block pool does not de-duplicate): it publishes a BlockStored for the copy and, later, one
// BlockRemoved per copy it evicts, while the index keeps one membership per (rank, tier,
// block). A publisher's extra copies, so that evicting one copy leaves the block indexed. Only
// blocks held more than once have an entry; a clear or restart forgets them.
class BlockCopies {
 public:
  // The rank stored `engine_hash` on `tier` again while holding it: one more copy.
  void Add(WorkerKey rank, Tier tier, uint64_t engine_hash);
  // A removal of `engine_hash`: true when it took an extra copy (the block stays held), false
  // when it was the last one.
  bool TakeExtra(WorkerKey rank, Tier tier, uint64_t engine_hash);
  void ForgetRank(WorkerKey rank);
  void Clear() { extra_.clear(); }
  size_t size() const { return extra_.size(); }

 private:
  struct Key {
    WorkerKey rank;
    Tier tier;
    uint64_t engine_hash;
    friend bool operator==(const Key&, const Key&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const Key& k) {
      return H::combine(std::move(h), k.rank, k.tier, k.engine_hash);
    }
  };
  // Not absl's table: one refused growth corrupts it (core/fail_safe_map.h); a single insert
  // into libstdc++'s is all or nothing.
  std::unordered_map<Key, uint32_t, absl::Hash<Key>> extra_;  // copies beyond the first
};

}  // namespace kvrouter

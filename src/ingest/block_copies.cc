#include "ingest/block_copies.h"

#include "absl/container/flat_hash_map.h"

namespace kvrouter {

void BlockCopies::Add(WorkerKey rank, Tier tier, uint64_t engine_hash) {
  ++extra_[Key{rank, tier, engine_hash}];
}

bool BlockCopies::TakeExtra(WorkerKey rank, Tier tier, uint64_t engine_hash) {
  const auto it = extra_.find(Key{rank, tier, engine_hash});
  if (it == extra_.end()) return false;
  if (--it->second == 0) extra_.erase(it);
  return true;
}

void BlockCopies::ForgetRank(WorkerKey rank) {
  std::erase_if(extra_, [&](const auto& entry) { return entry.first.rank == rank; });
}

}  // namespace kvrouter

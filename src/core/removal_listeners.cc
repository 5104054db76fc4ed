#include "core/removal_listeners.h"

#include <algorithm>

namespace kvrouter {

bool RemovedRanks::Covers(WorkerKey rank) const {
  if (rank.worker_id != worker_id) return false;
  return ranks.empty() || std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
}

uint64_t RemovalListeners::Add(RemovalListener listener) {
  std::lock_guard lock(mutex_);
  listeners_.emplace_back(next_token_, std::move(listener));
  return next_token_++;
}

void RemovalListeners::Remove(uint64_t token) {
  std::lock_guard lock(mutex_);
  std::erase_if(listeners_, [token](const auto& entry) { return entry.first == token; });
}

void RemovalListeners::Tell(const RemovedRanks& removed) const {
  std::lock_guard lock(mutex_);
  for (const auto& [token, listener] : listeners_) listener(removed);
}

}  // namespace kvrouter

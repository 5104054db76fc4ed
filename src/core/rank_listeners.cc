#include "core/rank_listeners.h"

namespace kvrouter {

uint64_t RankListeners::Add(RankListener listener) {
  std::lock_guard lock(mutex_);
  listeners_.emplace_back(next_token_, std::move(listener));
  return next_token_++;
}

void RankListeners::Remove(uint64_t token) {
  std::lock_guard lock(mutex_);
  std::erase_if(listeners_, [token](const auto& entry) { return entry.first == token; });
}

void RankListeners::Tell(const RankChange& change) const noexcept {
  std::lock_guard lock(mutex_);
  for (const auto& [token, listener] : listeners_) {
    try {
      listener(change);
    } catch (...) {  // a listener must not throw: what it missed is its own loss
    }
  }
}

}  // namespace kvrouter

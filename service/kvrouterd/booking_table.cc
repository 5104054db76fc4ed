#include "kvrouterd/booking_table.h"

namespace kvrouterd {

std::optional<nlohmann::json> BookingTable::Claim(const std::string& id, Clock::time_point now) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    auto it = entries_.find(id);
    if (it != entries_.end() && it->second.pending) {
      settled_.wait(lock);
      continue;
    }
    if (it != entries_.end() && it->second.expires > now) return it->second.decision;
    if (it != entries_.end()) entries_.erase(it);  // the router dropped it by now
    EvictLocked(now);
    Entry entry;
    entry.sequence = next_sequence_++;
    order_.emplace_back(entry.sequence, id);
    entries_.emplace(id, std::move(entry));
    return std::nullopt;
  }
}

void BookingTable::Complete(const std::string& id, nlohmann::json decision, uint64_t worker_id,
                            Clock::time_point expires) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return;
    it->second.decision = std::move(decision);
    it->second.worker_id = worker_id;
    it->second.expires = expires;
    it->second.pending = false;
  }
  settled_.notify_all();
}

void BookingTable::Fail(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.erase(id);
  }
  settled_.notify_all();
}

void BookingTable::Extend(const std::string& id, Clock::time_point expires) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it != entries_.end() && !it->second.pending) it->second.expires = expires;
}

bool BookingTable::Drop(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.pending) return false;
  entries_.erase(it);
  return true;
}

void BookingTable::DropWorker(uint64_t worker_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (!it->second.pending && it->second.worker_id == worker_id) {
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

std::vector<std::string> BookingTable::PendingIds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> ids;
  for (const auto& [id, entry] : entries_) {
    if (entry.pending) ids.push_back(id);
  }
  return ids;
}

size_t BookingTable::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

// Forgets expired entries at the front, then the oldest settled ones while over capacity; also
// drops order_'s stale pairs (entries freed or replaced since), which keeps it bounded too.
void BookingTable::EvictLocked(Clock::time_point now) {
  while (!order_.empty()) {
    const auto& [sequence, id] = order_.front();
    auto it = entries_.find(id);
    const bool stale = it == entries_.end() || it->second.sequence != sequence;
    if (!stale && it->second.pending) break;  // still booking: never forgotten
    if (!stale && it->second.expires > now && entries_.size() < capacity_) break;
    if (!stale) entries_.erase(it);
    order_.pop_front();
  }
  // Pairs whose entries went away behind the front: compact once they dominate.
  if (order_.size() > 2 * entries_.size() + 64) {
    std::deque<std::pair<uint64_t, std::string>> live;
    for (auto& pair : order_) {
      auto it = entries_.find(pair.second);
      if (it != entries_.end() && it->second.sequence == pair.first)
        live.push_back(std::move(pair));
    }
    order_.swap(live);
  }
}

}  // namespace kvrouterd

#include "kvrouterd/booking_table.h"

#include <algorithm>
#include <iterator>

namespace kvrouterd {

uint64_t BookingTable::Arrive() {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t arrival = next_arrival_++;
  arrivals_.insert(arrival);
  return arrival;
}

void BookingTable::Depart(uint64_t arrival) {
  std::lock_guard<std::mutex> lock(mutex_);
  arrivals_.erase(arrival);
  PruneCancellationsLocked();
}

bool BookingTable::CancelledLocked(const std::string& id, uint64_t arrival) const {
  if (arrival == kNoArrival) return false;
  const auto it = cancelled_.find(id);
  return it != cancelled_.end() && arrival < it->second;
}

bool BookingTable::Cancelled(const std::string& id, uint64_t arrival) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return CancelledLocked(id, arrival);
}

// A cancellation matters while a call that arrived before it is in flight.
void BookingTable::PruneCancellationsLocked() {
  const uint64_t oldest = arrivals_.empty() ? UINT64_MAX : *arrivals_.begin();
  while (!cancel_order_.empty() &&
         (cancel_order_.front().first <= oldest || cancel_order_.size() > capacity_)) {
    const auto& [before, id] = cancel_order_.front();
    const auto it = cancelled_.find(id);
    if (it != cancelled_.end() && it->second == before) cancelled_.erase(it);
    cancel_order_.pop_front();
  }
}

BookingTable::Claimed BookingTable::Claim(const std::string& id, Clock::time_point now,
                                          uint64_t arrival, const Wait& wait) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (CancelledLocked(id, arrival)) return {Outcome::kCancelled, nullptr};
    auto it = entries_.find(id);
    if (it != entries_.end() && it->second.pending) {
      if (wait.abandoned && wait.abandoned()) return {Outcome::kAbandoned, nullptr};
      const Clock::time_point poll = Clock::now() + kAbandonPoll;
      if (!wait.deadline) {
        settled_.wait_until(lock, poll);
      } else if (Clock::now() >= *wait.deadline) {
        return {Outcome::kTimedOut, nullptr};
      } else {
        settled_.wait_until(lock, std::min(poll, *wait.deadline));
      }
      continue;
    }
    if (it != entries_.end() && it->second.expires > now) {
      return {Outcome::kReplay, it->second.decision};
    }
    if (it != entries_.end()) entries_.erase(it);  // the router dropped it by now
    EvictLocked(now);
    Entry entry;
    entry.sequence = next_sequence_++;
    order_.emplace_back(entry.sequence, id);
    entries_.emplace(id, std::move(entry));
    return {Outcome::kBook, nullptr};
  }
}

bool BookingTable::Complete(const std::string& id, nlohmann::json decision, uint64_t worker_id,
                            uint32_t dp_rank, Clock::time_point expires, uint64_t arrival) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return false;
    if (CancelledLocked(id, arrival)) return false;  // still claimed: Fail follows
    it->second.decision = std::move(decision);
    it->second.worker_id = worker_id;
    it->second.dp_rank = dp_rank;
    it->second.expires = expires;
    it->second.booked = Clock::now();
    it->second.pending = false;
  }
  settled_.notify_all();
  return true;
}

void BookingTable::Fail(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.erase(id);
  }
  settled_.notify_all();
}

void BookingTable::Extend(const std::string& id, Clock::duration lifetime) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it != entries_.end() && !it->second.pending)
    it->second.expires = it->second.booked + lifetime;
}

void BookingTable::RecordCancellationLocked(const std::string& id) {
  if (arrivals_.empty()) return;  // no call can be waiting to book it
  cancelled_[id] = next_arrival_;
  cancel_order_.emplace_back(next_arrival_, id);
  PruneCancellationsLocked();
}

bool BookingTable::Cancel(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  RecordCancellationLocked(id);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.pending) return false;
  entries_.erase(it);
  return true;
}

bool BookingTable::CancelPending(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end() || !it->second.pending) return false;
  RecordCancellationLocked(id);
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

void BookingTable::DropRanksOutside(uint64_t worker_id, uint32_t dp_start, uint32_t dp_size) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    const Entry& entry = it->second;
    const bool dropped = !entry.pending && entry.worker_id == worker_id &&
                         (entry.dp_rank < dp_start || entry.dp_rank - dp_start >= dp_size);
    it = dropped ? entries_.erase(it) : std::next(it);
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

size_t BookingTable::cancellations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cancelled_.size();
}

// Forgets expired entries at the front, then the oldest settled ones while over capacity; also
// drops order_'s stale pairs (entries freed or replaced since), which keeps it bounded too.
// Entries still booking are never forgotten, but they are stepped over, kept at the front: one
// waiting long in the admission queue must not hold every entry behind it.
void BookingTable::EvictLocked(Clock::time_point now) {
  std::vector<std::pair<uint64_t, std::string>> booking;  // from the front, in order
  while (!order_.empty()) {
    const auto& [sequence, id] = order_.front();
    auto it = entries_.find(id);
    const bool stale = it == entries_.end() || it->second.sequence != sequence;
    if (!stale && it->second.pending) {
      booking.push_back(std::move(order_.front()));
      order_.pop_front();
      continue;
    }
    if (!stale && it->second.expires > now && entries_.size() < capacity_) break;
    if (!stale) entries_.erase(it);
    order_.pop_front();
  }
  order_.insert(order_.begin(), std::make_move_iterator(booking.begin()),
                std::make_move_iterator(booking.end()));
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

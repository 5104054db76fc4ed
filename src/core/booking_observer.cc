#include "core/booking_observer.h"

#include <atomic>
#include <utility>

namespace kvrouter {

uint64_t BookingObserver::Set(std::string replica_id, SequenceObserver observer) {
  static std::atomic<uint64_t> next_token{1};
  observer_ = std::move(observer);
  promised_interval_ms_ = 0;  // a new publisher promises nothing until it beats
  if (!observer_) {
    token_ = 0;
    return 0;
  }
  replica_id_ = std::move(replica_id);
  token_ = next_token.fetch_add(1, std::memory_order_relaxed);
  return token_;
}

bool BookingObserver::Clear(uint64_t token) {
  if (token == 0 || token != token_) return false;
  observer_ = nullptr;
  token_ = 0;
  promised_interval_ms_ = 0;
  return true;
}

}  // namespace kvrouter

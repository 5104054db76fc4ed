// The admission queue (shared/reference/dynamo-router.md §3.2): where requests wait while every
// worker rank they could go to is over its prefill threshold.
//
// A rank is over the threshold when its active prefill tokens exceed
// threshold × max_num_batched_tokens. A request waits only when every eligible rank is over;
// with no eligible rank at all it is "not busy" (its selection then fails with Unavailable).
// Waiting requests are ordered by a policy key, higher first, ties by arrival:
//   FCFS  key = max(priority_jump, 0) - arrival_offset_seconds
//   LCFS  key = max(priority_jump, 0) + arrival_offset_seconds
//   WSPT  key = (1 + max(priority_jump, 0)) / max(1, prompt_tokens - best_cached_tokens)
//         (Smith's rule: short uncached work first; best_cached = the most any eligible rank
//         has cached)
// The queue admits from its head only (head-of-line blocking, as in Dynamo): when load drops, the
// head is admitted while some rank it may use is under the threshold.
//
// A refused allocation (std::bad_alloc) leaves a queue as it was: its tables are std::map and
// std::unordered_map (a single insert is all or nothing in libstdc++), not absl's btree or
// raw_hash_set (whose refused growth corrupts the map in Debian's Abseil, fail_safe_map.h).
//
// Thread-safety: none. The Router guards its queue with its admission gate; the waiting itself
// (condition variables, callbacks) lives in the Router.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "absl/status/statusor.h"
#include "core/id_hash.h"

namespace kvrouter {

enum class QueuePolicy : uint8_t { kFcfs = 0, kLcfs = 1, kWspt = 2 };

// "fcfs", "lcfs", "wspt" (case-insensitive); InvalidArgument otherwise.
absl::StatusOr<QueuePolicy> ParseQueuePolicy(std::string_view name);
constexpr std::string_view QueuePolicyName(QueuePolicy policy) {
  switch (policy) {
    case QueuePolicy::kFcfs:
      return "fcfs";
    case QueuePolicy::kLcfs:
      return "lcfs";
    case QueuePolicy::kWspt:
      return "wspt";
  }
  return "unknown";
}

// Dynamo's default max_num_batched_tokens for a worker that does not report one.
inline constexpr uint64_t kDefaultMaxBatchedTokens = 10'000'000;

struct QueueKeyInputs {
  double priority_jump = 0;
  double arrival_offset_seconds = 0;  // since the queue's origin
  uint64_t prompt_tokens = 0;
  uint64_t best_cached_tokens = 0;
};
double QueueKey(QueuePolicy policy, const QueueKeyInputs& inputs);

// One rank's prefill pressure, for the threshold check.
struct RankPressure {
  uint64_t active_prefill_tokens = 0;
  uint64_t max_num_batched_tokens = 0;  // 0 = not reported (kDefaultMaxBatchedTokens)
};
bool IsOverThreshold(const RankPressure& rank, double threshold);
// True when there is at least one rank and every one is over the threshold.
bool AllOverThreshold(std::span<const RankPressure> ranks, double threshold);

// Waiting requests of type T, by policy key. Request ids are unique within the queue.
template <typename T>
class PendingQueue {
 public:
  struct Entry {
    Entry(std::string id, uint64_t tokens, T&& it)
        : request_id(std::move(id)), prompt_tokens(tokens), item(std::move(it)) {}
    std::string request_id;
    uint64_t prompt_tokens = 0;
    T item;
  };

  // Returns false (and keeps nothing) when `request_id` is already waiting. Throws
  // std::bad_alloc, the queue unchanged, when the heap refuses. `item` is moved from only
  // when it is queued (a refused caller keeps it, to answer the request).
  bool Push(std::string request_id, double key, uint64_t prompt_tokens, T&& item) {
    if (position_.contains(request_id)) return false;
    const Position position{.key = key, .arrival = next_arrival_};
    auto at = position_.emplace(request_id, position).first;
    try {
      // Built in the node once it is allocated: a refused node leaves `item` where it was.
      order_.emplace(std::piecewise_construct, std::forward_as_tuple(position),
                     std::forward_as_tuple(std::move(request_id), prompt_tokens, std::move(item)));
    } catch (...) {
      position_.erase(at);
      throw;
    }
    ++next_arrival_;
    pending_tokens_ += prompt_tokens;
    return true;
  }

  bool empty() const { return order_.empty(); }
  size_t size() const { return order_.size(); }
  uint64_t pending_tokens() const { return pending_tokens_; }
  bool Contains(std::string_view request_id) const { return position_.contains(request_id); }

  // The waiting request with this id, or null.
  const Entry* Find(std::string_view request_id) const {
    auto found = position_.find(request_id);
    if (found == position_.end()) return nullptr;
    return &order_.find(found->second)->second;
  }

  // Calls visit(entry) for every waiting request, in admission order.
  template <typename Visit>
  void ForEach(Visit visit) const {
    for (const auto& [position, entry] : order_) visit(entry);
  }

  // The next request to admit. Requires !empty().
  const Entry& Front() const { return order_.begin()->second; }

  Entry PopFront() {
    auto it = order_.begin();
    return Take(it);
  }

  // Takes a waiting request out, if it is waiting.
  std::optional<Entry> Remove(std::string_view request_id) {
    auto found = position_.find(request_id);
    if (found == position_.end()) return std::nullopt;
    return Take(order_.find(found->second));
  }

 private:
  struct Position {
    double key;
    uint64_t arrival;  // breaks key ties first come, first served
    bool operator<(const Position& other) const {
      if (key != other.key) return key > other.key;  // higher key first
      return arrival < other.arrival;
    }
  };

  // Allocates nothing.
  Entry Take(typename std::map<Position, Entry>::iterator it) {
    Entry entry = std::move(it->second);
    order_.erase(it);
    position_.erase(entry.request_id);
    pending_tokens_ -= entry.prompt_tokens;
    return entry;
  }

  std::map<Position, Entry> order_;
  std::unordered_map<std::string, Position, IdHash, std::equal_to<>> position_;
  uint64_t next_arrival_ = 0;
  uint64_t pending_tokens_ = 0;
};

}  // namespace kvrouter

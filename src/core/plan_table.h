// Plans (shared/reference/dynamo-router.md §6.2): requests booked by Router::Plan that wait for
// Commit or Abort. Each keeps the decision a retried Plan returns again, its deadline, and what
// Commit needs (`Payload`: the Router's prepared request). The table knows deadlines, not
// bookings: the Router frees a plan's booking when it drops an expired plan (ExpireDue's
// callback), aborts one or commits one.
//
// A refused allocation (std::bad_alloc) leaves the table as it was: its plans are in a
// std::unordered_map (a single insert is all or nothing in libstdc++), not in absl's
// raw_hash_set, whose refused growth corrupts the map in Debian's Abseil (fail_safe_map.h).
//
// Thread-safety: none. The Router serialises every call under its admission gate.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>

#include "absl/functional/function_ref.h"
#include "absl/hash/hash.h"
#include "core/clock.h"
#include "core/id_hash.h"

namespace kvrouter {

template <typename Payload, typename Decision>
class PlanTable {
 public:
  struct Entry {
    Decision decision;
    Nanos deadline = 0;
    std::unique_ptr<Payload> payload;
    bool DueAt(Nanos now) const { return deadline <= now; }
  };

  // Plans made from now on are due `deadline` after they are made (> 0).
  explicit PlanTable(Nanos deadline) : deadline_(deadline) {}
  Nanos deadline() const { return deadline_; }
  void set_deadline(Nanos deadline) { deadline_ = deadline; }

  // Records the plan of `id`, made at `now` (replacing any other plan of `id`). Throws
  // std::bad_alloc with the table unchanged when the heap refuses; replacing allocates only
  // the entry.
  void Add(std::string_view id, Decision decision, Nanos now, std::unique_ptr<Payload> payload) {
    auto entry = std::make_unique<Entry>();
    entry->decision = std::move(decision);
    entry->deadline = now + deadline_;
    entry->payload = std::move(payload);
    if (auto it = plans_.find(id); it != plans_.end()) {
      it->second = std::move(entry);
    } else {
      plans_.emplace(std::string(id), std::move(entry));
    }
  }
  // The plan of `id`, due or not; null when there is none.
  Entry* Find(std::string_view id) {
    auto it = plans_.find(id);
    return it == plans_.end() ? nullptr : it->second.get();
  }
  // Allocates nothing.
  bool Erase(std::string_view id) {
    auto it = plans_.find(id);
    if (it == plans_.end()) return false;
    plans_.erase(it);
    return true;
  }
  // Drops every plan due at `now`, telling `expired` its id first; returns how many.
  size_t ExpireDue(Nanos now, absl::FunctionRef<void(std::string_view id)> expired) {
    size_t dropped = 0;
    for (auto it = plans_.begin(); it != plans_.end();) {
      if (!it->second->DueAt(now)) {
        ++it;
        continue;
      }
      expired(it->first);
      it = plans_.erase(it);
      ++dropped;
    }
    return dropped;
  }
  size_t size() const { return plans_.size(); }
  // A sum of per-plan hashes (id, worker, deadline): independent of the table's iteration
  // order. Router::StateDigest combines it with size().
  uint64_t StateDigest() const {
    uint64_t sum = 0;
    for (const auto& [id, plan] : plans_) {
      sum += absl::HashOf(id, plan->decision.worker, plan->deadline);
    }
    return sum;
  }

 private:
  Nanos deadline_;
  std::unordered_map<std::string, std::unique_ptr<Entry>, IdHash, std::equal_to<>> plans_;
};

}  // namespace kvrouter

// Announcements of replicas' bookings under way at a receiver. A replica announces its whole
// state as a Reset saying how many bookings follow, then an Added for each; they arrive one
// message at a time. Dropping the origin's bookings at the Reset and adding them back one by one
// would leave the receiver, for that moment, routing as if the origin's workers were idle. So
// the bookings held from the origin stay until its announcement ends: each announced again
// replaces its old copy, and those not announced again are dropped at the end (the last
// announced booking, or any other change from the origin, since it sends nothing between them).
// An origin that holds nothing here needs no announcement: its bookings are simply added.
// Not thread-safe: the router holds its lock.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "core/id_hash.h"

namespace kvrouter {

class ReplicaAnnouncements {
 public:
  // Origins announcing at once at most (ids a peer makes up cannot grow this): past it the
  // oldest announcement is ended (EndOldest) to make room, as one stalled for good.
  static constexpr size_t kMaxAnnouncing = 1024;

  using Names = std::unordered_set<std::string, IdHash, std::equal_to<>>;

  // `origin` announces `count` bookings; `held` names the bookings held from it now (not
  // empty). Replaces any announcement of the origin under way. The caller makes room first
  // (full()). May throw std::bad_alloc (nothing begun).
  void Begin(std::string_view origin, uint32_t count, Names held) {
    auto it = announcing_.find(origin);
    if (it == announcing_.end())
      it = announcing_.emplace(std::string(origin), Announcement{}).first;
    it->second = {.remaining = count, .not_announced_again = std::move(held), .order = ++begun_};
  }

  bool Announcing(std::string_view origin) const { return announcing_.contains(origin); }
  size_t size() const { return announcing_.size(); }
  bool full() const { return announcing_.size() >= kMaxAnnouncing; }

  // Whether `name` was held from `origin` before its announcement and not announced again yet.
  // Call only while Announcing(origin).
  bool HeldBefore(std::string_view origin, std::string_view name) const {
    return announcing_.find(origin)->second.not_announced_again.contains(name);
  }

  // The booking named `name` was announced: it is no longer one to drop. Whether that was the
  // last one announced (then End the announcement). Call only while Announcing(origin).
  bool Announced(std::string_view origin, std::string_view name) {
    Announcement& announcement = announcing_.find(origin)->second;
    if (auto it = announcement.not_announced_again.find(name);
        it != announcement.not_announced_again.end()) {
      announcement.not_announced_again.erase(it);
    }
    return --announcement.remaining == 0;
  }

  // Ends `origin`'s announcement, if one is under way: the names of the bookings held from it
  // before that were not announced again (to drop). Allocates nothing.
  Names End(std::string_view origin) {
    auto it = announcing_.find(origin);
    return it == announcing_.end() ? Names{} : Take(it);
  }

  // Ends the announcement begun first among those under way (none: nothing), as End.
  Names EndOldest() {
    auto oldest = std::min_element(
        announcing_.begin(), announcing_.end(),
        [](const auto& a, const auto& b) { return a.second.order < b.second.order; });
    return oldest == announcing_.end() ? Names{} : Take(oldest);
  }

  void ForgetAll() noexcept { announcing_.clear(); }

 private:
  struct Announcement {
    uint32_t remaining = 0;
    Names not_announced_again;
    uint64_t order = 0;  // when it began, among the others
  };
  using Table = std::unordered_map<std::string, Announcement, IdHash, std::equal_to<>>;

  Names Take(Table::iterator it) {
    Names not_announced_again = std::move(it->second.not_announced_again);
    announcing_.erase(it);
    return not_announced_again;
  }

  Table announcing_;
  uint64_t begun_ = 0;
};

}  // namespace kvrouter

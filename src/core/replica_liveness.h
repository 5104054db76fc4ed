// Which router replicas are alive, from their heartbeats (SequenceChange::Kind::kHeartbeat).
// Only an origin that has sent a heartbeat, or a change carrying the interval it beats at, is
// tracked: a replica that never sends one (an older build, a bus without heartbeats) keeps its
// bookings until they expire as requests do.
// Every change heard from a tracked origin counts as a sign of life. Not thread-safe: the
// router holds its lock.
#pragma once

#include <algorithm>
#include <new>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/clock.h"
#include "core/id_hash.h"

namespace kvrouter {

// The longest heartbeat interval a replica may promise (one hour), in milliseconds; a peer's
// longer one counts as this.
inline constexpr uint32_t kMaxHeartbeatIntervalMs = 3'600'000;
// The most prefill tokens a peer's booking may carry (its rank's load sums them).
inline constexpr uint64_t kMaxReplicaPrefillTokens = uint64_t{1} << 32;

class ReplicaLiveness {
 public:
  // A heartbeat from `origin`, or a change carrying the interval it promises one at. Returns
  // whether to ask `origin` to announce its bookings again: it had been expired here
  // (TakeSilent) and is heard again, a replica that was only cut off or stalled, and it has
  // not announced them since (Restarted) nor been asked within the last kAskAgainAfter or
  // three of its intervals (the request, or the answer, may have been lost).
  // Refused memory for a new origin leaves it untracked until its next change.
  bool Beat(std::string_view origin, Nanos interval, Nanos now) {
    auto it = origins_.find(origin);  // not copying the name of a tracked origin
    if (it == origins_.end()) {
      if (origins_.size() >= kTracked) ForgetLongestSilent();
      try {
        it = origins_.emplace(std::string(origin), Entry{}).first;
      } catch (const std::bad_alloc&) {
        return false;
      }
    }
    it->second.last_heard = now;
    it->second.interval = interval;
    return !expired_.empty() && TimeToAsk(origin, std::max(kAskAgainAfter, 3 * interval), now);
  }

  // Any other change from `origin`: alive too, if it is tracked.
  void Heard(std::string_view origin, Nanos now) {
    if (auto it = origins_.find(origin); it != origins_.end()) {  // not copying the name
      it->second.last_heard = now;
    }
  }

  // `origin` announced its whole state from scratch (a Reset): whether it was expired here no
  // longer matters. Without a promised interval (a replica leaving, or joining before its first
  // heartbeat), it is not tracked either: one that left is not counted as expired later.
  void Restarted(std::string_view origin, bool promises_heartbeats) {
    Unremember(origin);
    if (auto it = origins_.find(origin); it != origins_.end() && !promises_heartbeats) {
      origins_.erase(it);
    }
  }

  // Removes and returns the origins silent for longer than `timeout`, or than three of their
  // own heartbeat intervals if that is longer (a timeout shorter than the sender's period
  // would drop a live replica between two beats). They are remembered (up to kRemembered of
  // them) so that Beat can tell when one comes back.
  std::vector<std::string> TakeSilent(Nanos now, Nanos timeout) {
    size_t count = 0;
    for (const auto& [origin, entry] : origins_) count += IsSilent(entry, now, timeout) ? 1 : 0;
    std::vector<std::string> silent;
    silent.reserve(count);  // the only allocation before anything is taken
    for (auto it = origins_.begin(); it != origins_.end();) {
      if (IsSilent(it->second, now, timeout)) {
        silent.push_back(std::move(origins_.extract(it++).key()));
      } else {
        ++it;
      }
    }
    for (const std::string& origin : silent) Remember(origin);
    return silent;
  }

  size_t live() const { return origins_.size(); }

  // Every origin, tracked or remembered as expired, forgotten (their changes no longer come).
  void Forget() noexcept {
    origins_.clear();
    expired_.clear();
  }

  // Expired origins remembered at most: beyond it, the forgotten ones' return goes unnoticed
  // (their bookings come back when they next restart).
  static constexpr size_t kRemembered = 1024;
  // Origins tracked at most: without expiry (no timeout), every replica id ever heard would
  // stay (ids that name a process change at every restart); beyond it the longest silent one
  // is no longer tracked (its bookings stay; it is expired no more).
  static constexpr size_t kTracked = 4096;
  static constexpr Nanos kAskAgainAfter = kNanosPerSecond;

 private:
  struct Entry {
    Nanos last_heard = 0;
    Nanos interval = 0;
  };

  static bool IsSilent(const Entry& entry, Nanos now, Nanos timeout) {
    return now - entry.last_heard > std::max(timeout, 3 * entry.interval);
  }

  struct Expired {
    uint64_t order = 0;  // when it was expired, among the others (the oldest is forgotten first)
    Nanos asked = 0;     // when it was last asked to announce its bookings; 0 = never
  };

  void ForgetLongestSilent() {
    origins_.erase(std::min_element(
        origins_.begin(), origins_.end(),
        [](const auto& a, const auto& b) { return a.second.last_heard < b.second.last_heard; }));
  }

  // Whether `origin` is remembered as expired and was not asked within `wait`; if so, it is
  // asked now.
  bool TimeToAsk(std::string_view origin, Nanos wait, Nanos now) {
    const auto it = expired_.find(origin);
    if (it == expired_.end() || (it->second.asked != 0 && now - it->second.asked <= wait)) {
      return false;
    }
    it->second.asked = now;
    return true;
  }

  // `origin` is no longer remembered as expired.
  void Unremember(std::string_view origin) {
    if (const auto it = expired_.find(origin); it != expired_.end()) expired_.erase(it);
  }

  void Remember(const std::string& origin) {
    try {
      if (expired_.size() >= kRemembered) {
        expired_.erase(std::min_element(
            expired_.begin(), expired_.end(),
            [](const auto& a, const auto& b) { return a.second.order < b.second.order; }));
      }
      expired_.insert_or_assign(origin, Expired{.order = ++expiries_});
    } catch (const std::bad_alloc&) {
      // Forgotten: as beyond kRemembered.
    }
  }

  // Not absl's tables: one refused growth corrupts them (core/fail_safe_map.h); a single
  // insert into libstdc++'s is all or nothing.
  std::unordered_map<std::string, Entry, IdHash, std::equal_to<>> origins_;
  std::unordered_map<std::string, Expired, IdHash, std::equal_to<>> expired_;
  uint64_t expiries_ = 0;
};

}  // namespace kvrouter

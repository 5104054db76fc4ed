// Which router replicas are alive, from their heartbeats (SequenceChange::Kind::kHeartbeat).
// Only an origin that has sent a heartbeat, or a change carrying the interval it beats at, is
// tracked: a replica that never sends one (an older build, a bus without heartbeats) keeps its
// bookings until they expire as requests do.
// Every change heard from a tracked origin counts as a sign of life. Not thread-safe: the
// router holds its lock.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/clock.h"
#include "core/id_hash.h"

namespace kvrouter {

class ReplicaLiveness {
 public:
  // A heartbeat from `origin`, which promises one every `interval`.
  void Beat(std::string_view origin, Nanos interval, Nanos now) {
    auto it = origins_.find(origin);  // not copying the name of a tracked origin
    if (it == origins_.end()) it = origins_.emplace(std::string(origin), Entry{}).first;
    it->second.last_heard = now;
    it->second.interval = interval;
  }

  // Any other change from `origin`: alive too, if it is tracked.
  void Heard(std::string_view origin, Nanos now) {
    if (auto it = origins_.find(origin); it != origins_.end()) {  // not copying the name
      it->second.last_heard = now;
    }
  }

  // Removes and returns the origins silent for longer than `timeout`, or than three of their
  // own heartbeat intervals if that is longer (a timeout shorter than the sender's period
  // would drop a live replica between two beats).
  std::vector<std::string> TakeSilent(Nanos now, Nanos timeout) {
    std::vector<std::string> silent;
    for (auto it = origins_.begin(); it != origins_.end();) {
      const Nanos allowed = std::max(timeout, 3 * it->second.interval);
      if (now - it->second.last_heard > allowed) {
        silent.push_back(it->first);
        origins_.erase(it++);
      } else {
        ++it;
      }
    }
    return silent;
  }

  size_t live() const { return origins_.size(); }

 private:
  struct Entry {
    Nanos last_heard = 0;
    Nanos interval = 0;
  };
  // Not absl's table: one refused growth corrupts it (core/fail_safe_map.h); a single insert
  // into libstdc++'s is all or nothing.
  std::unordered_map<std::string, Entry, IdHash, std::equal_to<>> origins_;
};

}  // namespace kvrouter

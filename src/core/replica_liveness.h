// Which router replicas are alive, from their heartbeats (SequenceChange::Kind::kHeartbeat).
// Only an origin that has sent a heartbeat is tracked: a replica that never sends one (an
// older build, a bus without heartbeats) keeps its bookings until they expire as requests do.
// Every change heard from a tracked origin counts as a sign of life. Not thread-safe: the
// router holds its lock.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "core/clock.h"

namespace kvrouter {

class ReplicaLiveness {
 public:
  // A heartbeat from `origin`, which promises one every `interval`.
  void Beat(std::string_view origin, Nanos interval, Nanos now) {
    Entry& entry = origins_[std::string(origin)];
    entry.last_heard = now;
    entry.interval = interval;
  }

  // Any other change from `origin`: alive too, if it is tracked.
  void Heard(std::string_view origin, Nanos now) {
    // (absl::string_view: a lookup without copying the name; Debian's Abseil has its own.)
    if (auto it = origins_.find(absl::string_view(origin.data(), origin.size()));
        it != origins_.end()) {
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
  absl::flat_hash_map<std::string, Entry> origins_;
};

}  // namespace kvrouter

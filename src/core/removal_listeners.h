// Who hears that a router dropped ranks from its index (Router::RemoveWorker, and
// Router::UpdateWorker when the new configuration has fewer ranks): an ingest forgets what it
// tracked for them. A NATS source's flag on a rank (state_unknown) would otherwise outlive the
// worker, and the source's gauge and a daemon's /healthz stay "degraded" for good.
//
// Thread-safety: every call from any thread. A listener runs on the thread that removed the
// ranks, after the router's own lock is released, under this registry's mutex: it must be quick,
// must not call into the router nor add or remove listeners. Once Remove returns, the listener
// it named is not running and will not run again.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "core/types.h"

namespace kvrouter {

// Ranks the router dropped: the listed ranks of one worker, or all of them (a worker removed
// whole: every rank of its id, registered or only heard of in events).
struct RemovedRanks {
  uint64_t worker_id = 0;
  std::span<const WorkerKey> ranks;  // empty: every rank of worker_id

  bool Covers(WorkerKey rank) const;
};

// Told of every removal; must not throw (a listener that cannot act on one, for want of memory,
// leaves what it tracked as it was).
using RemovalListener = std::function<void(const RemovedRanks&)>;

class RemovalListeners {
 public:
  // Installs `listener`; a token naming it (never 0).
  uint64_t Add(RemovalListener listener);
  // Stops the listener `token` names; nothing if none does.
  void Remove(uint64_t token);
  void Tell(const RemovedRanks& removed) const;

 private:
  mutable std::mutex mutex_;
  std::vector<std::pair<uint64_t, RemovalListener>> listeners_;
  uint64_t next_token_ = 1;
};

}  // namespace kvrouter

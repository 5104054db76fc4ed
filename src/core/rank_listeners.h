// Who hears that a router's registry gained or dropped ranks (Router::AddWorker, UpdateWorker,
// RemoveWorker): an ingest keeps the ranks the router dropped out of its state_unknown count. A
// NATS source's flag on a removed worker's rank would otherwise stay counted for good (its engine
// may never clear it), and a daemon's /healthz stay "degraded".
//
// Thread-safety: every call from any thread. A listener runs under the router's lock (so that
// listeners hear the changes in the order the registry made them) and this registry's mutex: it
// must be quick, must not throw, must not call into the router nor add or remove listeners. Once
// Remove returns, the listener it named is not running and will not run again.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "core/types.h"

namespace kvrouter {

// Ranks of one worker the registry gained or dropped.
struct RankChange {
  enum class Kind : uint8_t { kAdded, kDropped };
  Kind kind = Kind::kAdded;
  uint64_t worker_id = 0;
  // The ranks: added, or dropped; a worker removed whole lists those it had registered (none if
  // it was not), and says so in whole_worker: every rank of its id goes, registered or only
  // heard of in events.
  std::span<const WorkerKey> ranks;
  bool whole_worker = false;
};

using RankListener = std::function<void(const RankChange&)>;

class RankListeners {
 public:
  // Installs `listener`; a token naming it (never 0).
  uint64_t Add(RankListener listener);
  // Stops the listener `token` names; nothing if none does.
  void Remove(uint64_t token);
  // Tells every listener; one that throws (breaking the rule) is skipped, the others still told.
  void Tell(const RankChange& change) const noexcept;

 private:
  mutable std::mutex mutex_;
  std::vector<std::pair<uint64_t, RankListener>> listeners_;
  uint64_t next_token_ = 1;
};

}  // namespace kvrouter

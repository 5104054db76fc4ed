#include "core/session_table.h"

#include "absl/hash/hash.h"

namespace kvrouter {

SessionTable::Previous SessionTable::Bind(std::string_view session_id, WorkerKey worker,
                                          double ttl_seconds) {
  const Bound bound{
      .worker = worker, .ttl = SecondsToNanos(ttl_seconds), .last_used = clock_.Now()};
  Previous previous;
  if (auto it = sessions_.find(session_id); it != sessions_.end()) {
    previous.bound = it->second;
    it->second = bound;
  } else {
    sessions_.emplace(std::string(session_id), bound);
  }
  return previous;
}

void SessionTable::Restore(std::string_view session_id, const Previous& previous) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return;
  if (previous.bound) {
    it->second = *previous.bound;
  } else {
    sessions_.erase(it);
  }
}

void SessionTable::Steer(std::string_view session_id, SessionMode mode, bool use,
                         absl::FunctionRef<bool(WorkerKey)> usable, std::optional<WorkerPin>& pin,
                         std::optional<WorkerKey>& preferred) {
  if (session_id.empty()) return;
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return;
  const Nanos now = clock_.Now();
  if (it->second.ExpiredAt(now)) {
    if (use) sessions_.erase(it);
    return;
  }
  const WorkerKey bound = it->second.worker;
  const bool can_use = usable(bound);
  if (mode == SessionMode::kHard) {
    if (!can_use) {
      // The bound rank is gone: drop the binding and select once more (rebound at commit).
      if (use) sessions_.erase(it);
      return;
    }
    if (!pin) pin = WorkerPin{bound.worker_id, bound.dp_rank};
  } else if (can_use && !preferred) {
    preferred = bound;
  }
  if (use) it->second.last_used = now;
}

std::optional<WorkerKey> SessionTable::Binding(std::string_view session_id) const {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end() || it->second.ExpiredAt(clock_.Now())) return std::nullopt;
  return it->second.worker;
}

bool SessionTable::Close(std::string_view session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return false;
  sessions_.erase(it);
  return true;
}

size_t SessionTable::Reclaim() {
  const Nanos now = clock_.Now();
  return std::erase_if(sessions_, [now](const auto& entry) { return entry.second.ExpiredAt(now); });
}

uint64_t SessionTable::StateDigest() const {
  uint64_t sum = 0;
  for (const auto& [id, session] : sessions_) {
    sum += absl::HashOf(id, session.worker, session.ttl, session.last_used);
  }
  return sum;
}

}  // namespace kvrouter

// Session affinity (shared/reference/dynamo-router.md §6.1): which rank each session is bound
// to, for how long, and how a binding steers a session's next request (hard: the exact target;
// soft: a preference inside normal selection). The Router binds a session when a request of it
// is dispatched (Router::Commit, FindBestMatch with admission) and asks the table to steer
// every request that names a session.
//
// TTLs slide: every use of a binding restarts it. An expired binding is dropped when it is
// next used, or by Reclaim.
//
// A refused allocation (std::bad_alloc) leaves the table as it was: its bindings are in a
// std::unordered_map (a single insert is all or nothing in libstdc++), not in absl's
// raw_hash_set, whose refused growth corrupts the map in Debian's Abseil (fail_safe_map.h).
//
// Thread-safety: none. The Router serialises every call under its admission gate.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "absl/functional/function_ref.h"
#include "core/clock.h"
#include "core/id_hash.h"
#include "core/types.h"

namespace kvrouter {

// How a session's binding steers its next requests (reference §6.1, hard vs soft).
enum class SessionMode : uint8_t {
  // The bound rank is the exact target. If it is gone (or not allowed), the binding is
  // dropped, selection runs once more and the session is rebound at commit.
  kHard = 0,
  // The bound rank is a preference inside normal selection: kept while eligible; when the
  // request is dispatched elsewhere, the session is rebound there at commit.
  kSoft = 1,
};
constexpr std::string_view SessionModeName(SessionMode mode) {
  return mode == SessionMode::kHard ? "hard" : mode == SessionMode::kSoft ? "soft" : "unknown";
}

// A worker (and optionally one of its ranks) a request must run on.
struct WorkerPin {
  uint64_t worker_id = 0;
  std::optional<uint32_t> dp_rank;  // unset: the best of the worker's ranks
};

class SessionTable {
 private:
  struct Bound {
    WorkerKey worker;
    Nanos ttl = 0;
    Nanos last_used = 0;
    bool ExpiredAt(Nanos now) const { return now - last_used >= ttl; }
  };

 public:
  explicit SessionTable(const Clock& clock) : clock_(clock) {}

  // What a session's binding was before Bind: what Restore puts back.
  class Previous {
   private:
    friend class SessionTable;
    std::optional<Bound> bound;
  };

  // Binds `session_id` to `worker` from now, for `ttl_seconds` (> 0) after each use. Throws
  // std::bad_alloc, the table unchanged, when the heap refuses a new binding.
  Previous Bind(std::string_view session_id, WorkerKey worker, double ttl_seconds);
  // Undoes the Bind of `session_id` that returned `previous` (nothing changed the session
  // since). Allocates nothing.
  void Restore(std::string_view session_id, const Previous& previous);

  // Steers a request of `session_id` by its live binding: in kHard mode the bound rank becomes
  // `pin` (unless the request has one), in kSoft mode `preferred` (unless it has one); a binding
  // whose rank is not `usable` steers nothing. With `use`, the binding's TTL restarts, and an
  // expired binding, or a hard one whose rank is not usable, is dropped (selection then runs
  // as without a session, and the dispatch rebinds it). Without `use` nothing changes.
  void Steer(std::string_view session_id, SessionMode mode, bool use,
             absl::FunctionRef<bool(WorkerKey)> usable, std::optional<WorkerPin>& pin,
             std::optional<WorkerKey>& preferred);

  // The rank a live session is bound to (does not restart the TTL).
  std::optional<WorkerKey> Binding(std::string_view session_id) const;
  bool Close(std::string_view session_id);
  // Drops every expired binding; returns how many.
  size_t Reclaim();
  size_t size() const { return sessions_.size(); }
  // A sum of per-binding hashes (binding, TTL, last use): independent of the table's
  // iteration order. Router::StateDigest combines it with size().
  uint64_t StateDigest() const;

 private:
  const Clock& clock_;
  std::unordered_map<std::string, Bound, IdHash, std::equal_to<>> sessions_;
};

}  // namespace kvrouter

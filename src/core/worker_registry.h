// The workers a router may route to, with the configuration each reported
// (shared/reference/dynamo-router.md §3.5 "Topology", §7.6).
//
// A worker serves data-parallel ranks dp_start .. dp_start + dp_size - 1; each rank is a separate
// routing target (WorkerKey). The registry only validates and stores configurations and says
// which ranks appeared or disappeared; the Router applies that to its index and load tracker.
//
// Thread-safety: none. The Router serialises every call under its admission gate.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/fail_safe_map.h"
#include "core/types.h"

namespace kvrouter {

struct WorkerConfig {
  uint64_t worker_id = 0;
  uint32_t dp_start = 0;
  uint32_t dp_size = 1;                 // >= 1
  uint64_t total_kv_blocks = 0;         // 0 = not reported
  uint64_t max_num_batched_tokens = 0;  // 0 = not reported (kDefaultMaxBatchedTokens)
  uint32_t block_size = 0;              // must equal the router's block size

  friend bool operator==(const WorkerConfig&, const WorkerConfig&) = default;
};

// The ranks of a worker, in order.
std::vector<WorkerKey> RanksOf(const WorkerConfig& config);

// Ranks that an update removed and added.
struct RankChanges {
  std::vector<WorkerKey> removed;
  std::vector<WorkerKey> added;
};

class WorkerRegistry {
 public:
  explicit WorkerRegistry(uint32_t block_size) : block_size_(block_size) {}

  // InvalidArgument when the config cannot be served by this router (block size mismatch,
  // dp_size 0, rank range overflowing 32 bits).
  absl::Status Validate(const WorkerConfig& config) const;

  // AlreadyExists when the worker id is registered. A refused allocation (std::bad_alloc)
  // leaves the registry as it was.
  absl::Status Add(const WorkerConfig& config);
  // The ranks an update to `config` would remove and add; NotFound when the worker id is not
  // registered. Changes nothing: Replace makes the update.
  absl::StatusOr<RankChanges> ChangesOf(const WorkerConfig& config) const;
  // Puts `config` in place of a registered worker's. Allocates nothing.
  void Replace(const WorkerConfig& config);
  // NotFound when the worker id is not registered; otherwise the removed configuration.
  // Allocates nothing when the worker is registered.
  absl::StatusOr<WorkerConfig> Remove(uint64_t worker_id);

  const WorkerConfig* Find(uint64_t worker_id) const;
  bool HasRank(WorkerKey rank) const;
  // Registered workers, by worker id.
  std::vector<WorkerConfig> Workers() const;
  size_t size() const { return workers_.size(); }
  uint32_t block_size() const { return block_size_; }

 private:
  uint32_t block_size_;
  // Grows whole or not at all, and erases without allocating (fail_safe_map.h).
  FailSafeMap<uint64_t, WorkerConfig> workers_;
};

}  // namespace kvrouter

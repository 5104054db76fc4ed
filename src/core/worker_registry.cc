#include "core/worker_registry.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvrouter {
namespace {

// The most data-parallel ranks one worker may have (each rank has its own load record, index
// table and candidate row): checked before anything is allocated for them.
constexpr uint32_t kMaxDpSize = 1024;

}  // namespace

std::vector<WorkerKey> RanksOf(const WorkerConfig& config) {
  std::vector<WorkerKey> ranks;
  ranks.reserve(config.dp_size);
  for (uint32_t i = 0; i < config.dp_size; ++i) {
    ranks.push_back(WorkerKey{.worker_id = config.worker_id, .dp_rank = config.dp_start + i});
  }
  return ranks;
}

absl::Status WorkerRegistry::Validate(const WorkerConfig& config) const {
  if (config.block_size != block_size_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker ", config.worker_id, " has block size ", config.block_size, " but the router uses ",
        block_size_, "; its cache cannot be matched against the router's block hashes"));
  }
  if (config.dp_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", config.worker_id, " has dp_size 0; it needs at least one rank"));
  }
  if (config.dp_size > kMaxDpSize) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", config.worker_id, " has dp_size ",
                                                   config.dp_size, "; at most ", kMaxDpSize,
                                                   " ranks per worker"));
  }
  if (config.dp_start > std::numeric_limits<uint32_t>::max() - (config.dp_size - 1)) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", config.worker_id, " ranks ",
                                                   config.dp_start, " + ", config.dp_size,
                                                   " overflow 32 bits"));
  }
  return absl::OkStatus();
}

absl::Status WorkerRegistry::Add(const WorkerConfig& config) {
  if (auto status = Validate(config); !status.ok()) return status;
  if (workers_.contains(config.worker_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("worker ", config.worker_id, " is already registered; use update"));
  }
  workers_.emplace(config.worker_id, config);
  return absl::OkStatus();
}

absl::StatusOr<RankChanges> WorkerRegistry::Update(const WorkerConfig& config) {
  if (auto status = Validate(config); !status.ok()) return status;
  auto it = workers_.find(config.worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", config.worker_id, " is not registered"));
  }
  RankChanges changes;
  const auto in_range = [](const WorkerConfig& c, uint32_t rank) {
    return rank >= c.dp_start && rank - c.dp_start < c.dp_size;
  };
  for (const WorkerKey& rank : RanksOf(it->second)) {
    if (!in_range(config, rank.dp_rank)) changes.removed.push_back(rank);
  }
  for (const WorkerKey& rank : RanksOf(config)) {
    if (!in_range(it->second, rank.dp_rank)) changes.added.push_back(rank);
  }
  it->second = config;
  return changes;
}

absl::StatusOr<WorkerConfig> WorkerRegistry::Remove(uint64_t worker_id) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", worker_id, " is not registered"));
  }
  WorkerConfig removed = it->second;
  workers_.erase(it);
  return removed;
}

const WorkerConfig* WorkerRegistry::Find(uint64_t worker_id) const {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

bool WorkerRegistry::HasRank(WorkerKey rank) const {
  const WorkerConfig* config = Find(rank.worker_id);
  return config != nullptr && rank.dp_rank >= config->dp_start &&
         rank.dp_rank - config->dp_start < config->dp_size;
}

std::vector<WorkerConfig> WorkerRegistry::Workers() const {
  std::vector<WorkerConfig> out;
  out.reserve(workers_.size());
  for (const auto& [id, config] : workers_) out.push_back(config);
  std::sort(out.begin(), out.end(),
            [](const WorkerConfig& a, const WorkerConfig& b) { return a.worker_id < b.worker_id; });
  return out;
}

}  // namespace kvrouter

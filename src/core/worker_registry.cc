#include "core/worker_registry.h"

#include <algorithm>
#include <limits>
#include <optional>

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
  if (workers_.Contains(config.worker_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("worker ", config.worker_id, " is already registered; use update"));
  }
  workers_.Set(config.worker_id, config);
  return absl::OkStatus();
}

absl::StatusOr<RankChanges> WorkerRegistry::ChangesOf(const WorkerConfig& config) const {
  if (auto status = Validate(config); !status.ok()) return status;
  const WorkerConfig* current = Find(config.worker_id);
  if (current == nullptr) {
    return absl::NotFoundError(absl::StrCat("worker ", config.worker_id, " is not registered"));
  }
  RankChanges changes;
  const auto in_range = [](const WorkerConfig& c, uint32_t rank) {
    return rank >= c.dp_start && rank - c.dp_start < c.dp_size;
  };
  for (const WorkerKey& rank : RanksOf(*current)) {
    if (!in_range(config, rank.dp_rank)) changes.removed.push_back(rank);
  }
  for (const WorkerKey& rank : RanksOf(config)) {
    if (!in_range(*current, rank.dp_rank)) changes.added.push_back(rank);
  }
  return changes;
}

void WorkerRegistry::Replace(const WorkerConfig& config) {
  *workers_.Find(config.worker_id) = config;
}

absl::StatusOr<WorkerConfig> WorkerRegistry::Remove(uint64_t worker_id) {
  std::optional<WorkerConfig> removed = workers_.Take(worker_id);
  if (!removed) {
    return absl::NotFoundError(absl::StrCat("worker ", worker_id, " is not registered"));
  }
  return *removed;
}

const WorkerConfig* WorkerRegistry::Find(uint64_t worker_id) const {
  return workers_.Find(worker_id);
}

bool WorkerRegistry::HasRank(WorkerKey rank) const {
  const WorkerConfig* config = Find(rank.worker_id);
  return config != nullptr && rank.dp_rank >= config->dp_start &&
         rank.dp_rank - config->dp_start < config->dp_size;
}

std::vector<WorkerConfig> WorkerRegistry::Workers() const {
  std::vector<WorkerConfig> out;
  out.reserve(workers_.size());
  workers_.ForEach([&out](uint64_t, const WorkerConfig& config) { out.push_back(config); });
  std::sort(out.begin(), out.end(),
            [](const WorkerConfig& a, const WorkerConfig& b) { return a.worker_id < b.worker_id; });
  return out;
}

}  // namespace kvrouter

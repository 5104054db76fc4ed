// Access to the data the tests read (data/ of this tree: traces, data/vectors), and small helpers
// shared by the index suites (event builders, match formatting).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/radix_index.h"
#include "core/types.h"

namespace kvrouter::testing {

// `relative` to data/ (KVR_DATA_DIR is set by the build).
inline std::string DataPath(const std::string& relative) {
  return std::string(KVR_DATA_DIR) + "/" + relative;
}

inline nlohmann::json LoadDataJson(const std::string& relative) {
  std::ifstream in(DataPath(relative));
  if (!in) throw std::runtime_error("cannot open " + DataPath(relative));
  return nlohmann::json::parse(in);
}

// `blocks` complete blocks of `block_size` tokens, numbered from `first`.
inline std::vector<uint32_t> BlockTokens(size_t blocks, uint32_t block_size, uint32_t first = 0) {
  std::vector<uint32_t> tokens(blocks * block_size);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = first + static_cast<uint32_t>(i);
  return tokens;
}

// ---- Index events and answers ----------------------------------------------------------------

// A stored event with precomputed local hashes (one per engine hash).
inline KvEvent StoredBlocks(WorkerKey worker, std::optional<uint64_t> parent,
                            std::vector<uint64_t> engine_hashes, std::vector<uint64_t> local_hashes,
                            Tier tier = Tier::kDevice, uint64_t event_id = 0) {
  StoredEvent stored;
  stored.parent_hash = parent;
  stored.block_hashes = std::move(engine_hashes);
  stored.local_hashes = std::move(local_hashes);
  return KvEvent{.worker = worker, .tier = tier, .event_id = event_id, .data = std::move(stored)};
}

inline KvEvent RemovedBlocks(WorkerKey worker, std::vector<uint64_t> engine_hashes,
                             Tier tier = Tier::kDevice, uint64_t event_id = 0) {
  return KvEvent{.worker = worker,
                 .tier = tier,
                 .event_id = event_id,
                 .data = RemovedEvent{.block_hashes = std::move(engine_hashes)}};
}

// A hybrid model's sliding-window group `group` now holds these blocks (by engine hash).
inline KvEvent SlidingStoredBlocks(WorkerKey worker, int64_t group, uint32_t window_tokens,
                                   std::vector<uint64_t> engine_hashes) {
  SlidingStoredEvent stored;
  stored.group = group;
  stored.window_tokens = window_tokens;
  stored.block_hashes = std::move(engine_hashes);
  return KvEvent{.worker = worker, .data = std::move(stored)};
}

inline KvEvent SlidingRemovedBlocks(WorkerKey worker, int64_t group,
                                    std::vector<uint64_t> engine_hashes) {
  return KvEvent{
      .worker = worker,
      .data = SlidingRemovedEvent{.group = group, .block_hashes = std::move(engine_hashes)}};
}

inline KvEvent ClearedWorker(WorkerKey worker, uint64_t event_id = 0) {
  return KvEvent{
      .worker = worker, .tier = Tier::kDevice, .event_id = event_id, .data = ClearedEvent{}};
}

// {device, host, disk, external} hits of one match.
inline std::array<uint32_t, 4> TierHits(const WorkerMatch& m) {
  return {m.device_blocks, m.host_hits, m.disk_hits, m.external_hits};
}

// The match of `worker` in `matches`, if any.
inline std::optional<WorkerMatch> MatchOf(const std::vector<WorkerMatch>& matches,
                                          WorkerKey worker) {
  for (const auto& m : matches) {
    if (m.worker == worker) return m;
  }
  return std::nullopt;
}

// Canonical text of a FindMatches answer (sorted by worker), for readable comparisons.
inline std::string MatchesToString(std::vector<WorkerMatch> matches) {
  std::sort(matches.begin(), matches.end(),
            [](const WorkerMatch& a, const WorkerMatch& b) { return a.worker < b.worker; });
  std::string out;
  for (const auto& m : matches) {
    out += std::to_string(m.worker.worker_id) + "/" + std::to_string(m.worker.dp_rank) + ":d" +
           std::to_string(m.device_blocks) + ",h" + std::to_string(m.host_hits) + ",s" +
           std::to_string(m.disk_hits) + ",e" + std::to_string(m.external_hits) + ",t" +
           std::to_string(m.tree_size) + ";";
  }
  return out;
}

// Total events of one kind that ended with one error (or kNone).
inline uint64_t EventCount(const IndexStats& stats, EventKind kind, EventError error) {
  return stats.events[static_cast<int>(kind)][static_cast<int>(error)];
}

// Small, fast, deterministic generator (splitmix64) for randomised tests.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  uint32_t Below(uint32_t n) { return static_cast<uint32_t>(Next() % n); }

 private:
  uint64_t state_;
};

}  // namespace kvrouter::testing

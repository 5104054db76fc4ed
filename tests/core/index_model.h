// A radix index's expected state kept by hand, for tests and fuzzers that check the index
// against it: per worker rank, the engine blocks it holds, with the prefix (the sequence hash of
// the block's local-hash path) and the tiers of each.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/hashing.h"
#include "core/radix_index.h"
#include "core/types.h"

namespace kvrouter::testing {

// A radix index's expected state (see the file comment).
class IndexModel {
 public:
  struct Entry {
    uint64_t path = 0;
    uint8_t tiers = 0;  // bit per Tier
  };
  struct Rank {
    std::unordered_map<uint64_t, Entry> blocks;  // engine hash -> entry
    // path -> number of engine blocks per tier naming it
    std::unordered_map<uint64_t, std::array<int, kNumTiers>> held;
    // Sliding-window groups (hybrid models): group -> window tokens, and per group the engine
    // hashes it holds, each with its block's path.
    std::map<int64_t, uint32_t> windows;
    std::map<int64_t, std::unordered_map<uint64_t, uint64_t>> sliding;
  };

  uint32_t block_size = 16;  // the index's: a window's blocks before a hit point follow from it

  // path (sequence hash) -> parent path, 0 for a first block
  std::unordered_map<uint64_t, uint64_t> parent_of;
  std::map<WorkerKey, Rank> ranks;

  void Add(WorkerKey w, uint64_t engine, uint64_t path, Tier tier) {
    Rank& r = ranks[w];
    Entry& e = r.blocks[engine];
    e.path = path;
    const uint8_t bit = uint8_t{1} << static_cast<int>(tier);
    if (e.tiers & bit) return;
    e.tiers |= bit;
    r.held[path][static_cast<int>(tier)]++;
  }

  // Returns false if the worker does not hold `engine` on `tier`.
  bool Remove(WorkerKey w, uint64_t engine, Tier tier) {
    auto rit = ranks.find(w);
    if (rit == ranks.end()) return false;
    Rank& r = rit->second;
    auto it = r.blocks.find(engine);
    const uint8_t bit = uint8_t{1} << static_cast<int>(tier);
    if (it == r.blocks.end() || !(it->second.tiers & bit)) return false;
    it->second.tiers &= ~bit;
    auto hit = r.held.find(it->second.path);
    if (--hit->second[static_cast<int>(tier)] == 0 && hit->second == std::array<int, kNumTiers>{}) {
      r.held.erase(hit);
    }
    if (it->second.tiers == 0) r.blocks.erase(it);
    return true;
  }

  // A sliding-window group of the rank now holds these blocks: those it holds in full attention
  // (on any tier) are placed, the others are not. Returns whether all were.
  bool SlidingStore(WorkerKey w, int64_t group, uint32_t window,
                    const std::vector<uint64_t>& hashes) {
    Rank& r = ranks[w];
    r.windows.emplace(group, window);
    bool all = true;
    for (uint64_t h : hashes) {
      auto it = r.blocks.find(h);
      if (it == r.blocks.end()) {
        all = false;
        continue;
      }
      r.sliding[group][h] = it->second.path;
    }
    return all;
  }

  // Returns whether the group held every one of them.
  bool SlidingRemove(WorkerKey w, int64_t group, const std::vector<uint64_t>& hashes) {
    bool all = true;
    for (uint64_t h : hashes) {
      auto rit = ranks.find(w);
      auto git = rit == ranks.end() ? nullptr : &rit->second.sliding[group];
      if (git == nullptr || git->erase(h) == 0) all = false;
    }
    return all;
  }

  // vLLM's rule (KVCoordinator with SlidingWindowManager), plainly: from `limit` down, the end
  // of the first run of ceil((window - 1) / block_size) blocks every group of the window holds,
  // else the leading run; each window in turn until none lowers it.
  uint32_t SlidingHit(const Rank& r, const std::vector<uint64_t>& seq, uint32_t limit) const {
    auto held = [&](uint32_t window, uint64_t path) {
      for (const auto& [group, w] : r.windows) {
        if (w != window) continue;
        auto g = r.sliding.find(group);
        if (g == r.sliding.end()) return false;
        bool any = false;
        for (const auto& [engine, p] : g->second) any = any || p == path;
        if (!any) return false;
      }
      return true;
    };
    for (bool lowered = true; lowered;) {
      lowered = false;
      for (const auto& [group, window] : r.windows) {
        const uint32_t needed = std::max<uint32_t>(
            1, static_cast<uint32_t>((window - 1 + block_size - 1) / block_size));
        uint32_t run = 0, hit = limit;
        bool found = false;
        for (uint32_t i = limit; i-- > 0 && !found;) {
          run = held(window, seq[i]) ? run + 1 : 0;
          if (run == needed) {
            hit = i + needed;
            found = true;
          }
        }
        if (!found) hit = run;
        if (hit < limit) {
          limit = hit;
          lowered = true;
        }
      }
    }
    return limit;
  }

  // A clear empties the publishing rank only (each rank has a cache of its own).
  void Clear(WorkerKey worker) {
    if (auto it = ranks.find(worker); it != ranks.end()) it->second = Rank{};
  }

  void RemoveWorker(uint64_t worker_id) {
    for (auto it = ranks.begin(); it != ranks.end();) {
      it = it->first.worker_id == worker_id ? ranks.erase(it) : std::next(it);
    }
  }

  std::optional<uint64_t> PathOf(WorkerKey w, uint64_t engine) const {
    auto rit = ranks.find(w);
    if (rit == ranks.end()) return std::nullopt;
    auto it = rit->second.blocks.find(engine);
    if (it == rit->second.blocks.end()) return std::nullopt;
    return it->second.path;
  }

  bool Holds(const Rank& r, uint64_t path, int tier) const {
    auto it = r.held.find(path);
    return it != r.held.end() && it->second[tier] > 0;
  }
  bool HoldsAny(const Rank& r, uint64_t path) const { return r.held.count(path) > 0; }

  std::vector<WorkerMatch> FindMatches(const std::vector<uint64_t>& local) const {
    std::vector<WorkerMatch> out;
    FindMatchesAlong(ComputeSequenceHashes(local), out);
    return out;
  }

  // The matches of a prompt given by its blocks' sequence hashes `seq`, into `out` (cleared
  // first; reused by callers that check many prompts). `computable`: as RadixIndex::FindMatches.
  void FindMatchesAlong(const std::vector<uint64_t>& seq, std::vector<WorkerMatch>& out,
                        size_t computable = SIZE_MAX) const {
    out.clear();
    if (seq.empty()) return;
    for (const auto& [w, r] : ranks) {
      if (!HoldsAny(r, seq[0])) continue;
      WorkerMatch m;
      m.worker = w;
      size_t pos = 0;
      std::array<uint32_t, kNumTiers> hits{};
      for (int t = 0; t < kNumTiers; ++t) {
        while (pos < seq.size() && Holds(r, seq[pos], t)) {
          ++hits[t];
          ++pos;
        }
      }
      m.device_blocks = hits[0];
      m.host_hits = hits[1];
      m.disk_hits = hits[2];
      m.external_hits = hits[3];
      m.tree_size = r.blocks.size();
      if (!r.windows.empty() && m.device_blocks > 0) {
        const auto limit = static_cast<uint32_t>(std::min<size_t>(m.device_blocks, computable));
        const uint32_t hit = SlidingHit(r, seq, limit);
        if (hit < limit) {
          m.device_blocks = hit;
          m.host_hits = m.disk_hits = m.external_hits = 0;
        }
        if (m.device_blocks + m.host_hits + m.disk_hits + m.external_hits == 0) continue;
      }
      out.push_back(m);
    }
  }

  uint64_t TreeSize(WorkerKey w) const {
    auto it = ranks.find(w);
    return it == ranks.end() ? 0 : it->second.blocks.size();
  }

  // Root plus every prefix of every held path.
  uint64_t Nodes() const {
    std::unordered_set<uint64_t> nodes;
    for (const auto& [w, r] : ranks) {
      for (const auto& [path, counts] : r.held) {
        for (uint64_t p = path; p != 0 && nodes.insert(p).second; p = parent_of.at(p)) {
        }
      }
    }
    return nodes.size() + 1;
  }
};

}  // namespace kvrouter::testing

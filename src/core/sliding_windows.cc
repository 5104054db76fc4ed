#include "core/sliding_windows.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvrouter {

SlidingWindows::SlidingWindows(int64_t* bytes, uint32_t block_size)
    : bytes_(bytes),
      block_size_(block_size),
      ranks_(0, absl::Hash<WorkerKey>(), std::equal_to<>(),
             CountingAllocator<std::pair<const WorkerKey, Rank>>(bytes)) {}

SlidingWindows::Rank::Rank(int64_t* bytes)
    : groups(CountingAllocator<Group>(bytes)),
      sequence_of(0, absl::Hash<ScopedBlock>(), std::equal_to<>(),
                  CountingAllocator<std::pair<const ScopedBlock, uint64_t>>(bytes)),
      copies(0, absl::Hash<ScopedBlock>(), std::equal_to<>(),
             CountingAllocator<std::pair<const ScopedBlock, uint32_t>>(bytes)),
      holding(0, absl::Hash<ScopedBlock>(), std::equal_to<>(),
              CountingAllocator<std::pair<const ScopedBlock, uint32_t>>(bytes)) {}

namespace {

// An empty table gives its bucket array back (shrink.h's ShrinkTableIfSparse, for std's tables:
// a new empty map allocates nothing).
template <typename Map>
void ReleaseBuckets(Map& map) noexcept {
  map = Map(0, map.hash_function(), map.key_eq(), map.get_allocator());
}

}  // namespace

SlidingWindows::Rank& SlidingWindows::RankFor(WorkerKey rank) {
  auto it = ranks_.find(rank);
  if (it == ranks_.end()) it = ranks_.try_emplace(rank, bytes_).first;
  return it->second;
}

uint32_t SlidingWindows::WindowOf(const Rank& r, int64_t group) {
  for (const Group& g : r.groups) {
    if (g.index == group) return g.window_tokens;
  }
  return 0;
}

SlidingWindows::Outcome SlidingWindows::Store(
    WorkerKey rank, int64_t group, uint32_t window_tokens, std::span<const uint64_t> engine_hashes,
    absl::FunctionRef<std::optional<uint64_t>(size_t)> sequence_hash) {
  Outcome outcome;
  try {
    Rank& r = RankFor(rank);
    const uint32_t known = WindowOf(r, group);
    if (known == 0 && r.groups.size() >= kMaxGroups) {
      outcome.too_many_groups = true;
      return outcome;
    }
    if (known == 0) {
      r.groups.push_back({group, window_tokens});
    } else if (known != window_tokens) {
      ChangeWindow(r, group, window_tokens);
    }
    for (size_t i = 0; i < engine_hashes.size(); ++i) {
      const std::optional<uint64_t> sequence = sequence_hash(i);
      if (!sequence) {
        if (outcome.missing++ == 0) outcome.first_missing = engine_hashes[i];
        continue;
      }
      auto [it, added] = r.sequence_of.try_emplace(ScopedBlock{group, engine_hashes[i]}, *sequence);
      if (!added) {
        if (it->second == *sequence) continue;  // held already
        // The engine hash now names another block: the old one goes.
        Unhold(r, group, window_tokens, it->second);
        it->second = *sequence;
      } else {
        ++blocks_;
      }
      Hold(r, group, window_tokens, *sequence);
    }
  } catch (const std::bad_alloc&) {
    Release(rank);
    throw;
  }
  return outcome;
}

// A group's window changed (the engine restarted with another configuration): its blocks, counted
// under the old window, go.
void SlidingWindows::ChangeWindow(Rank& r, int64_t group, uint32_t window_tokens) noexcept {
  for (Group& g : r.groups) {
    if (g.index != group) continue;
    for (auto it = r.sequence_of.begin(); it != r.sequence_of.end();) {
      if (it->first.scope == group) {
        Unhold(r, group, g.window_tokens, it->second);
        it = r.sequence_of.erase(it);
        --blocks_;
      } else {
        ++it;
      }
    }
    g.window_tokens = window_tokens;
  }
}

// The group names the block under one more engine hash; the window's count of groups holding it
// goes up with its first.
void SlidingWindows::Hold(Rank& r, int64_t group, uint32_t window_tokens, uint64_t sequence) {
  if (++r.copies[ScopedBlock{group, sequence}] == 1) {
    ++r.holding[ScopedBlock{window_tokens, sequence}];
  }
}

void SlidingWindows::Unhold(Rank& r, int64_t group, uint32_t window_tokens,
                            uint64_t sequence) noexcept {
  auto copy = r.copies.find(ScopedBlock{group, sequence});
  if (--copy->second > 0) return;
  r.copies.erase(copy);
  auto held = r.holding.find(ScopedBlock{window_tokens, sequence});
  if (--held->second == 0) r.holding.erase(held);
}

SlidingWindows::Outcome SlidingWindows::Remove(WorkerKey rank, int64_t group,
                                               std::span<const uint64_t> engine_hashes) noexcept {
  Outcome outcome;
  auto rank_it = ranks_.find(rank);
  for (uint64_t engine_hash : engine_hashes) {
    if (rank_it != ranks_.end()) {
      Rank& r = rank_it->second;
      if (auto it = r.sequence_of.find(ScopedBlock{group, engine_hash});
          it != r.sequence_of.end()) {
        Unhold(r, group, WindowOf(r, group), it->second);
        r.sequence_of.erase(it);
        --blocks_;
        continue;
      }
    }
    if (outcome.missing++ == 0) outcome.first_missing = engine_hash;
  }
  // A rank whose windows hold nothing keeps its groups, not its tables' peak buckets (a new
  // empty map allocates nothing).
  if (rank_it != ranks_.end() && rank_it->second.sequence_of.empty()) {
    Rank& r = rank_it->second;
    ReleaseBuckets(r.sequence_of);
    ReleaseBuckets(r.copies);
    ReleaseBuckets(r.holding);
  }
  return outcome;
}

void SlidingWindows::Release(WorkerKey rank) noexcept {
  auto it = ranks_.find(rank);
  if (it == ranks_.end()) return;
  blocks_ -= it->second.sequence_of.size();
  ranks_.erase(it);
  if (ranks_.empty()) ReleaseBuckets(ranks_);  // the last rank gone
}

uint32_t SlidingWindows::BlocksBefore(uint32_t window_tokens) const {
  // vLLM: cdiv(sliding_window - 1, block_size). A window of one token needs none before the
  // hit point; counting one keeps the search's shape (the rightmost held block) all the same.
  const uint64_t blocks = (uint64_t{window_tokens} - 1 + block_size_ - 1) / block_size_;
  return static_cast<uint32_t>(std::max<uint64_t>(1, blocks));
}

// The hit one window's groups allow below `limit`: the end of the rightmost run of
// BlocksBefore(window) blocks that all `groups` of the window hold, or else the leading run.
// vLLM scans down block by block; this skips instead (a block missing rules out every run that
// would contain it), so a rank whose window holds nothing of the prompt costs about
// limit / needed probes rather than limit, and one that holds a run costs `needed`.
uint32_t SlidingWindows::RuleHit(const Rank& r, uint32_t window_tokens, uint32_t groups,
                                 std::span<const uint64_t> sequence_hashes, uint32_t limit) const {
  const uint32_t needed = BlocksBefore(window_tokens);
  auto held = [&](uint32_t i) {
    const auto it = r.holding.find(ScopedBlock{window_tokens, sequence_hashes[i]});
    return it != r.holding.end() && it->second >= groups;
  };
  uint32_t end = limit;  // the candidate run is [end - needed, end)
  while (end >= needed) {
    const uint32_t first = end - needed;
    if (!held(first)) {
      end = first;  // every run ending in (first, end] contains `first`
      continue;
    }
    uint32_t missing = end - 1;
    while (missing > first && held(missing)) --missing;
    if (missing == first) return end;  // all of [first, end) held
    end = missing;                     // every run ending in (missing, end] contains it
  }
  uint32_t run = 0;  // the blocks from the prompt's first one on (fewer than needed)
  while (run < limit && held(run)) ++run;
  return run;
}

uint32_t SlidingWindows::Hit(WorkerKey rank, std::span<const uint64_t> sequence_hashes,
                             uint32_t limit) const {
  auto it = ranks_.find(rank);
  if (it == ranks_.end()) return limit;
  const Rank& r = it->second;
  limit = std::min<uint32_t>(limit, static_cast<uint32_t>(sequence_hashes.size()));
  // Each window lowers the hit at most; several windows are applied until none does.
  for (bool lowered = true; lowered && limit > 0;) {
    lowered = false;
    for (size_t g = 0; g < r.groups.size(); ++g) {
      const uint32_t window = r.groups[g].window_tokens;
      // Each window once: at its first group, counting the others of that window.
      bool first = true;
      uint32_t groups = 0;
      for (size_t o = 0; o < r.groups.size(); ++o) {
        if (r.groups[o].window_tokens != window) continue;
        first = first && o >= g;
        ++groups;
      }
      if (!first) continue;
      const uint32_t hit = RuleHit(r, window, groups, sequence_hashes, limit);
      if (hit < limit) {
        limit = hit;
        lowered = true;
      }
    }
  }
  return limit;
}

void SlidingWindows::ForEachGroup(
    absl::FunctionRef<void(WorkerKey, int64_t, uint32_t,
                           std::span<const std::pair<uint64_t, uint64_t>>)>
        visit) const {
  std::vector<std::pair<uint64_t, uint64_t>> blocks;
  for (const auto& [rank, r] : ranks_) {
    for (const Group& g : r.groups) {
      blocks.clear();
      for (const auto& [key, sequence] : r.sequence_of) {
        if (key.scope == g.index) blocks.emplace_back(key.hash, sequence);
      }
      std::sort(blocks.begin(), blocks.end());
      visit(rank, g.index, g.window_tokens, blocks);
    }
  }
}

std::string SlidingWindows::CheckInvariants() const {
  uint64_t entries = 0;
  for (const auto& [rank, r] : ranks_) {
    entries += r.sequence_of.size();
    int64_t scratch_bytes = 0;
    Map<ScopedBlock, uint32_t> copies(
        0, absl::Hash<ScopedBlock>(), std::equal_to<>(),
        CountingAllocator<std::pair<const ScopedBlock, uint32_t>>(&scratch_bytes));
    Map<ScopedBlock, uint32_t> holding(
        0, absl::Hash<ScopedBlock>(), std::equal_to<>(),
        CountingAllocator<std::pair<const ScopedBlock, uint32_t>>(&scratch_bytes));
    for (const auto& [key, sequence] : r.sequence_of) {
      const uint32_t window = WindowOf(r, key.scope);
      if (window == 0) {
        return absl::StrCat("worker ", rank.worker_id, " rank ", rank.dp_rank,
                            ": a sliding block of group ", key.scope, ", which it does not have");
      }
      if (++copies[ScopedBlock{key.scope, sequence}] == 1) ++holding[ScopedBlock{window, sequence}];
    }
    if (copies != r.copies || holding != r.holding) {
      return absl::StrCat("worker ", rank.worker_id, " rank ", rank.dp_rank,
                          ": the sliding windows' counts disagree with their groups' blocks");
    }
  }
  if (entries != blocks_) {
    return absl::StrCat(blocks_, " sliding blocks counted, ", entries, " held");
  }
  return "";
}

}  // namespace kvrouter

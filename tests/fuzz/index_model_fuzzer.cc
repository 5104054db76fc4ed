// libFuzzer harness, state-aware: the input is a sequence of KV events (stores along a small
// forest of prompts, from the root or after a block the rank holds, on any tier, with the
// engine hash of either of two variants; removals of held blocks with or without an unknown
// one; stores under a parent the rank does not hold; clears; a rank's or a worker's removal;
// a hybrid model's sliding-window groups storing and removing blocks, some not placeable)
// applied to a radix index and to a model of it (tests/core/index_model.h). After every event
// the index must answer what the model says: the event's acceptance, every rank's tree size,
// the matches of every prompt (every other one capped at its last block, where a hybrid
// engine resumes); and its internal invariants must hold. At the end, its dump must rebuild an
// index with the same state.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/hashing.h"
#include "core/radix_index.h"
#include "fuzz_input.h"
#include "index_model.h"
#include "test_data.h"

namespace kvrouter {
namespace {

using fuzz::Input;
using fuzz::kVerbose;

using testing::ClearedWorker;
using testing::IndexModel;
using testing::MatchesToString;
using testing::RemovedBlocks;
using testing::StoredBlocks;

void Log(const std::string& what, WorkerKey rank) {
  if (kVerbose) std::fprintf(stderr, "%s on %lu.%u\n", what.c_str(), rank.worker_id, rank.dp_rank);
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "index differs from the model: %s\n", what.c_str());
  std::abort();
}

struct Prompt {
  std::vector<uint64_t> local;  // the router's hash of each block
  std::vector<uint64_t> path;   // the sequence hash of each block's prefix
};

const std::vector<WorkerKey> kRanks = {{1, 0}, {1, 1}, {2, 0}, {3, 0}};

// Prompts forming a forest: four stems, then prompts branching off earlier ones. Fixed, so an
// input means the same history on every run.
const std::vector<Prompt>& Prompts() {
  static const std::vector<Prompt> prompts = [] {
    std::mt19937_64 rng(0xf022);
    std::vector<Prompt> out;
    for (int i = 0; i < 12; ++i) {
      std::vector<uint64_t> local;
      if (i >= 4) {
        const Prompt& base = out[rng() % out.size()];
        local.assign(base.local.begin(), base.local.begin() + 1 + rng() % base.local.size());
      }
      for (uint64_t k = 1 + rng() % 5; k > 0; --k) local.push_back(rng());
      out.push_back(Prompt{local, ComputeSequenceHashes(local)});
    }
    return out;
  }();
  return prompts;
}

// Engine hash of a prefix for one of two variants (two engine blocks naming one prefix).
uint64_t EngineHash(uint64_t path, int variant) { return path * 0x9e3779b97f4a7c15ULL + variant; }

class History {
 public:
  History() {
    for (const Prompt& p : Prompts()) {
      for (size_t k = 0; k < p.path.size(); ++k)
        model_.parent_of[p.path[k]] = k ? p.path[k - 1] : 0;
    }
  }

  void Step(Input& in) {
    const WorkerKey rank = kRanks[in.Pick(kRanks.size())];
    switch (in.Pick(10)) {
      case 8:
        return SlidingStore(in, rank);
      case 9:
        return SlidingRemove(in, rank);
      case 0:
      case 1:
      case 2:
        return Store(in, rank);
      case 3:
        return Remove(in, rank, /*with_unknown=*/false);
      case 4:
        return Remove(in, rank, /*with_unknown=*/true);
      case 5:
        return StoreUnderUnknownParent(in, rank);
      case 6:
        Log("clear", rank);
        Expect(index_.Apply(ClearedWorker(rank)).ok(), "a clear is accepted");
        model_.Clear(rank);
        return;
      case 7:
        if (in.Pick(2) == 0) {
          Log("remove rank", rank);
          index_.RemoveWorkerDpRank(rank);
          model_.ranks.erase(rank);
        } else {
          Log("remove worker", rank);
          index_.RemoveWorker(rank.worker_id);
          model_.RemoveWorker(rank.worker_id);
        }
        return;
    }
  }

  void Check() const {
    if (const std::string broken = index_.CheckInvariants(); !broken.empty()) Fail(broken);
    for (const WorkerKey& rank : kRanks) {
      if (index_.TreeSize(rank) != model_.TreeSize(rank)) Fail("tree size of a rank");
    }
    for (size_t i = 0; i < Prompts().size(); ++i) {
      const Prompt& p = Prompts()[i];
      const size_t computable = i % 2 ? p.local.size() - 1 : SIZE_MAX;
      model_.FindMatchesAlong(p.path, expected_, computable);  // in worker order
      index_.FindMatches(p.local, actual_, computable);
      std::sort(actual_.begin(), actual_.end(),
                [](const WorkerMatch& a, const WorkerMatch& b) { return a.worker < b.worker; });
      if (!std::equal(expected_.begin(), expected_.end(), actual_.begin(), actual_.end(), Same)) {
        Fail("matches: expected " + MatchesToString(expected_) + ", got " +
             MatchesToString(actual_));
      }
    }
  }

  void CheckDumpRebuilds() const {
    RadixIndex rebuilt;
    for (const KvEvent& event : index_.DumpEvents()) {
      if (!rebuilt.Apply(event).ok()) Fail("an event of the dump was rejected");
    }
    if (rebuilt.StateDigest() != index_.StateDigest()) Fail("the dump rebuilt another state");
  }

 private:
  static void Expect(bool ok, const char* what) {
    if (!ok) Fail(what);
  }

  static Tier PickTier(Input& in) { return static_cast<Tier>(in.Pick(kNumTiers)); }

  void Store(Input& in, WorkerKey rank) {
    const Prompt& p = Prompts()[in.Pick(Prompts().size())];
    const Tier tier = PickTier(in);
    const int variant = in.Pick(4) == 0 ? 1 : 0;
    // From the root, or right after a block of this prompt the rank holds (any tier, any
    // variant): the n-th such block, n read from the input.
    size_t start = 0;
    std::optional<uint64_t> parent;
    const size_t after = in.Pick(p.path.size() + 1);
    for (size_t k = 0, seen = 0; k + 1 < p.path.size() && after > 0; ++k) {
      for (int v = 0; v < 2; ++v) {
        const uint64_t engine = EngineHash(p.path[k], v);
        if (model_.PathOf(rank, engine) == p.path[k] && ++seen == after) {
          start = k + 1;
          parent = engine;
        }
      }
    }
    const size_t count = 1 + in.Pick(p.path.size() - start);
    std::vector<uint64_t> engine, local;
    for (size_t k = start; k < start + count; ++k) {
      engine.push_back(EngineHash(p.path[k], variant));
      local.push_back(p.local[k]);
    }
    Log("store prompt blocks " + std::to_string(start) + ".." + std::to_string(start + count) +
            " variant " + std::to_string(variant) + " tier " + std::string(TierName(tier)) +
            (parent ? " after a held block" : " from the root"),
        rank);
    Expect(index_.Apply(StoredBlocks(rank, parent, engine, local, tier)).ok(),
           "a store after a held block or from the root is accepted");
    for (size_t k = 0; k < count; ++k) model_.Add(rank, engine[k], p.path[start + k], tier);
  }

  // Up to four of the rank's blocks on `tier` (chosen by the input), and an unknown hash among
  // them if asked: the known ones are removed either way, the unknown one is an error.
  void Remove(Input& in, WorkerKey rank, bool with_unknown) {
    const Tier tier = PickTier(in);
    std::vector<uint64_t> held;
    if (auto it = model_.ranks.find(rank); it != model_.ranks.end()) {
      const uint8_t bit = uint8_t{1} << static_cast<int>(tier);
      for (const auto& [engine, entry] : it->second.blocks) {
        if (entry.tiers & bit) held.push_back(engine);
      }
    }
    std::sort(held.begin(), held.end());
    std::vector<uint64_t> hashes;
    for (int n = in.Pick(4) + 1; n > 0 && !held.empty(); --n) {
      const size_t i = in.Pick(held.size());
      hashes.push_back(held[i]);
      held.erase(held.begin() + i);
    }
    if (with_unknown) {
      hashes.insert(hashes.begin() + in.Pick(hashes.size() + 1), kUnknownHash);
    } else if (hashes.empty()) {
      return;
    }
    Log("remove " + std::to_string(hashes.size()) + " blocks" +
            (with_unknown ? " (one unknown)" : "") + " tier " + std::string(TierName(tier)),
        rank);
    const ApplyResult result = index_.Apply(RemovedBlocks(rank, hashes, tier));
    Expect(with_unknown ? result.error == EventError::kBlockNotFound : result.ok(),
           "a removal is rejected exactly when it names a block the rank does not hold");
    for (uint64_t h : hashes) {
      if (h != kUnknownHash && !model_.Remove(rank, h, tier)) Fail("model: removal");
    }
  }

  // Sliding-window groups: 0 and 1 of one window (two blocks before a hit point), 2 of another
  // (five).
  static constexpr uint32_t kWindows[] = {32, 32, 80};

  // Up to four blocks of a prompt (any variant), held in full attention or not, and the unknown
  // hash if asked: placed where the rank holds them, the others reported.
  void SlidingStore(Input& in, WorkerKey rank) {
    const int64_t group = in.Pick(3);
    const Prompt& p = Prompts()[in.Pick(Prompts().size())];
    std::vector<uint64_t> hashes;
    for (int n = in.Pick(4) + 1; n > 0; --n) {
      hashes.push_back(EngineHash(p.path[in.Pick(p.path.size())], in.Pick(4) == 0 ? 1 : 0));
    }
    if (in.Pick(8) == 0) hashes.push_back(kUnknownHash);
    Log("sliding store of " + std::to_string(hashes.size()) + " blocks, group " +
            std::to_string(group),
        rank);
    const ApplyResult result =
        index_.Apply(testing::SlidingStoredBlocks(rank, group, kWindows[group], hashes));
    const bool all = model_.SlidingStore(rank, group, kWindows[group], hashes);
    Expect(all ? result.ok() : result.error == EventError::kBlockNotFound,
           "a sliding store is rejected exactly when it names a block not held in full attention");
  }

  // Up to three blocks the group holds, and the unknown hash if asked.
  void SlidingRemove(Input& in, WorkerKey rank) {
    const int64_t group = in.Pick(3);
    std::vector<uint64_t> held;
    if (auto it = model_.ranks.find(rank); it != model_.ranks.end()) {
      if (auto g = it->second.sliding.find(group); g != it->second.sliding.end()) {
        for (const auto& [engine, path] : g->second) held.push_back(engine);
      }
    }
    std::sort(held.begin(), held.end());
    std::vector<uint64_t> hashes;
    for (int n = in.Pick(3) + 1; n > 0 && !held.empty(); --n) {
      const size_t i = in.Pick(held.size());
      hashes.push_back(held[i]);
      held.erase(held.begin() + i);
    }
    if (in.Pick(4) == 0) hashes.push_back(kUnknownHash);
    if (hashes.empty()) return;
    Log("sliding removal of " + std::to_string(hashes.size()) + " blocks, group " +
            std::to_string(group),
        rank);
    const ApplyResult result = index_.Apply(testing::SlidingRemovedBlocks(rank, group, hashes));
    const bool all = model_.SlidingRemove(rank, group, hashes);
    Expect(all ? result.ok() : result.error == EventError::kBlockNotFound,
           "a sliding removal is rejected exactly when it names a block the group lacks");
  }

  void StoreUnderUnknownParent(Input& in, WorkerKey rank) {
    const Prompt& p = Prompts()[in.Pick(Prompts().size())];
    Log("store under an unknown parent", rank);
    const ApplyResult result = index_.Apply(
        StoredBlocks(rank, kUnknownHash, {EngineHash(p.path[0], 0)}, {p.local[0]}, PickTier(in)));
    Expect(result.error == EventError::kParentBlockNotFound,
           "a store under a parent the rank does not hold is rejected whole");
  }

  static bool Same(const WorkerMatch& a, const WorkerMatch& b) {
    return a.worker == b.worker && a.device_blocks == b.device_blocks &&
           a.host_hits == b.host_hits && a.disk_hits == b.disk_hits &&
           a.external_hits == b.external_hits && a.tree_size == b.tree_size;
  }

  static constexpr uint64_t kUnknownHash = 0xdeadbeefcafef00dULL;  // never an EngineHash here
  RadixIndex index_;
  IndexModel model_;
  // Check's answers, kept to reuse their memory: a check runs after every event, and comparing
  // them as text (allocating under ASan) took as long as the rest of the harness.
  mutable std::vector<WorkerMatch> expected_, actual_;
};

}  // namespace
}  // namespace kvrouter

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvrouter::fuzz::Input in(data, size);
  kvrouter::History history;
  while (!in.empty()) {
    history.Step(in);
    history.Check();
  }
  history.CheckDumpRebuilds();
  return 0;
}

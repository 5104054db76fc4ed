// A million store/remove cycles over 64 workers whose prompts share common stems: memory (nodes
// and allocated bytes) follows the live blocks and returns exactly to where it started.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <vector>

#include "core/radix_index.h"
#include "core/types.h"
#include "test_data.h"

namespace kvrouter {
namespace {

using testing::MatchOf;
using testing::Rng;

bool ErrorFree(const IndexStats& stats) {
  for (const auto& per_kind : stats.events) {
    for (int e = 1; e < kNumEventErrors; ++e) {
      if (per_kind[e] != 0) return false;
    }
  }
  return true;
}

constexpr int kWorkers = 64;
constexpr int kStems = 16;
constexpr uint32_t kMaxLength = 16;

struct Stem {
  uint32_t length = 0;
  std::array<uint64_t, kMaxLength> local{};
  std::array<uint64_t, kMaxLength> engine{};
};

// One worker's current prompt: a shared stem then a tail of its own. Blocks [0, tip) have been
// stored; `held` says which of them the worker still holds (removals leave holes). The block at
// tip - 1 is always held, so the next store can name it as its parent.
struct WorkerState {
  WorkerKey key;
  uint32_t length = 0;
  uint32_t tip = 0;
  uint32_t held = 0;  // bit per block
  std::array<uint64_t, kMaxLength> local{};
  std::array<uint64_t, kMaxLength> engine{};
};

class Churn {
 public:
  explicit Churn(RadixIndex& index) : index_(index), rng_(42) {
    for (int s = 0; s < kStems; ++s) {
      stems_[s].length = 4 + rng_.Below(5);
      for (uint32_t k = 0; k < stems_[s].length; ++k) {
        stems_[s].local[k] = rng_.Next();
        stems_[s].engine[k] = rng_.Next();
      }
    }
    for (int w = 0; w < kWorkers; ++w) {
      workers_[w].key = WorkerKey{static_cast<uint64_t>(1000 + w), 0};
      NewPrompt(workers_[w]);
    }
    stored_.data = StoredEvent{};
    removed_.data = RemovedEvent{};
  }

  void Cycle() {
    WorkerState& w = workers_[rng_.Below(kWorkers)];
    if (w.tip < w.length) Store(w, 1 + rng_.Below(3));
    const uint32_t r = rng_.Below(100);
    if (w.tip == w.length && r < 30) {
      RemoveAll(w);
      NewPrompt(w);
    } else if (r < 55) {
      Truncate(w, 1 + rng_.Below(3));
    } else if (r < 70) {
      Hole(w);
    } else if (r == 99 && rng_.Below(100) == 0) {
      Expect(index_.Apply(testing::ClearedWorker(w.key)));
      w.held = 0;
      w.tip = 0;
      NewPrompt(w);
    }
  }

  void RemoveEverything() {
    for (WorkerState& w : workers_) RemoveAll(w);
  }

  uint64_t HeldBlocks() const {
    uint64_t n = 0;
    for (const WorkerState& w : workers_) n += std::popcount(w.held);
    return n;
  }

  // The worker's device depth on its own prompt is its first hole.
  void CheckSomeWorker() {
    const WorkerState& w = workers_[rng_.Below(kWorkers)];
    const std::vector<uint64_t> query(w.local.begin(), w.local.begin() + w.length);
    const uint32_t expected = static_cast<uint32_t>(std::countr_one(w.held));
    const auto m = MatchOf(index_.FindMatches(query), w.key);
    if (expected == 0) {
      EXPECT_FALSE(m.has_value());
    } else if (m.has_value()) {
      EXPECT_EQ(m->device_blocks, expected);
      EXPECT_EQ(m->tree_size, static_cast<uint64_t>(std::popcount(w.held)));
    } else {
      ADD_FAILURE() << "worker " << w.key.worker_id << " not matched";
    }
  }

  const std::array<WorkerState, kWorkers>& workers() const { return workers_; }
  uint64_t failures() const { return failures_; }

 private:
  void Expect(const ApplyResult& r) {
    if (!r.ok() && ++failures_ <= 5) ADD_FAILURE() << r.message;
  }

  void NewPrompt(WorkerState& w) {
    const Stem& stem = stems_[rng_.Below(kStems)];
    w.length = stem.length + 1 + rng_.Below(kMaxLength - stem.length);
    for (uint32_t k = 0; k < w.length; ++k) {
      w.local[k] = k < stem.length ? stem.local[k] : rng_.Next();
      w.engine[k] = k < stem.length ? stem.engine[k] : rng_.Next();
    }
    w.tip = 0;
    w.held = 0;
  }

  void Store(WorkerState& w, uint32_t count) {
    count = std::min(count, w.length - w.tip);
    auto& s = std::get<StoredEvent>(stored_.data);
    stored_.worker = w.key;
    s.parent_hash.reset();
    if (w.tip > 0) s.parent_hash = w.engine[w.tip - 1];
    s.block_hashes.assign(w.engine.begin() + w.tip, w.engine.begin() + w.tip + count);
    s.local_hashes.assign(w.local.begin() + w.tip, w.local.begin() + w.tip + count);
    Expect(index_.Apply(stored_));
    for (uint32_t k = w.tip; k < w.tip + count; ++k) w.held |= 1u << k;
    w.tip += count;
  }

  void RemoveBlocks(WorkerState& w, uint32_t mask) {
    auto& r = std::get<RemovedEvent>(removed_.data);
    removed_.worker = w.key;
    r.block_hashes.clear();
    for (uint32_t k = 0; k < w.length; ++k) {
      if (mask & (1u << k)) r.block_hashes.push_back(w.engine[k]);
    }
    if (r.block_hashes.empty()) return;
    Expect(index_.Apply(removed_));
    w.held &= ~mask;
  }

  void RemoveAll(WorkerState& w) {
    RemoveBlocks(w, w.held);
    w.tip = 0;
  }

  // Evicts the last `count` stored blocks; the tip moves back to the last block still held.
  void Truncate(WorkerState& w, uint32_t count) {
    uint32_t mask = 0;
    for (uint32_t k = w.tip; k > 0 && count > 0; --k, --count) mask |= 1u << (k - 1);
    RemoveBlocks(w, mask & w.held);
    while (w.tip > 0 && !(w.held & (1u << (w.tip - 1)))) --w.tip;
  }

  // Evicts one held block below the tip: its descendants become orphans.
  void Hole(WorkerState& w) {
    if (w.tip < 2) return;
    const uint32_t k = rng_.Below(w.tip - 1);
    if (w.held & (1u << k)) RemoveBlocks(w, 1u << k);
  }

  RadixIndex& index_;
  Rng rng_;
  std::array<Stem, kStems> stems_;
  std::array<WorkerState, kWorkers> workers_;
  KvEvent stored_;
  KvEvent removed_;
  uint64_t failures_ = 0;
};

TEST(RadixIndexChurnTest, MillionCyclesReturnMemoryToTheStart) {
  RadixIndex index;
  const IndexStats start = index.Stats();
  ASSERT_EQ(start.nodes, 1u);
  ASSERT_EQ(start.cached_blocks, 0u);

  Churn churn(index);
  constexpr int kCycles = 1'000'000;
  int64_t peak_bytes = start.allocated_bytes;
  uint64_t peak_nodes = 1;
  for (int i = 1; i <= kCycles; ++i) {
    churn.Cycle();
    if (i % 1000 == 0) churn.CheckSomeWorker();
    if (i % 50'000 == 0) {
      const IndexStats s = index.Stats();
      EXPECT_EQ(s.cached_blocks, churn.HeldBlocks()) << "after " << i << " cycles";
      peak_bytes = std::max(peak_bytes, s.allocated_bytes);
      peak_nodes = std::max(peak_nodes, s.nodes);
      // The tree never holds more than the live blocks (and their ancestors) need: every
      // worker's prompt is at most kMaxLength long; nor more nodes than blocks.
      EXPECT_LE(s.tree_blocks, static_cast<uint64_t>(kWorkers) * kMaxLength);
      EXPECT_LE(s.nodes, 1u + s.tree_blocks);
      if (i % 200'000 == 0) {
        EXPECT_EQ(index.CheckInvariants(), "") << "after " << i;
      }
      if (::testing::Test::HasFailure()) break;
    }
  }
  EXPECT_EQ(churn.failures(), 0u);
  EXPECT_GT(peak_bytes, start.allocated_bytes);
  EXPECT_GT(peak_nodes, 1u);

  churn.RemoveEverything();
  IndexStats end = index.Stats();
  EXPECT_EQ(end.nodes, 1u);
  EXPECT_EQ(end.cached_blocks, 0u);
  for (const WorkerState& w : churn.workers()) EXPECT_EQ(index.TreeSize(w.key), 0u);
  EXPECT_TRUE(ErrorFree(end));

  for (const WorkerState& w : churn.workers()) EXPECT_EQ(index.RemoveWorker(w.key.worker_id), 0u);
  end = index.Stats();
  EXPECT_EQ(end.workers, 0u);
  EXPECT_EQ(end.nodes, 1u);
  EXPECT_EQ(end.allocated_bytes, start.allocated_bytes);
}

}  // namespace
}  // namespace kvrouter

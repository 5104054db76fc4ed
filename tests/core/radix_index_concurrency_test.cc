// Concurrent writers and readers on one RadixIndex (and one ApproxIndex). Run under
// ThreadSanitizer in CI; here the checks are the invariants every answer must keep while the
// index changes under it, and the state once every writer is done.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/approx_index.h"
#include "core/clock.h"
#include "core/hashing.h"
#include "core/radix_index.h"
#include "core/scalable_shared_mutex.h"
#include "core/types.h"
#include "test_data.h"

namespace kvrouter {
namespace {

using testing::ClearedWorker;
using testing::RemovedBlocks;
using testing::Rng;
using testing::StoredBlocks;

constexpr int kWriters = 4;
constexpr int kReaders = 3;
constexpr int kOwnedPerWriter = 8;
constexpr uint64_t kFirstShared = 1000;  // workers every writer touches
constexpr int kShared = 4;
constexpr int kStems = 8;
constexpr uint32_t kStemLength = 6;
constexpr uint32_t kMaxLength = 12;
constexpr int kOpsPerWriter = 60'000;
constexpr int kMaxReaderIterations = 200'000;

// Shared stems: local and engine hashes (engine hashes are the same for every worker, which is
// allowed: they are per-worker keys).
struct Stems {
  std::vector<std::vector<uint64_t>> local, engine;
  Stems() {
    Rng rng(7);
    local.resize(kStems);
    engine.resize(kStems);
    for (int s = 0; s < kStems; ++s) {
      for (uint32_t k = 0; k < kStemLength; ++k) {
        local[s].push_back(rng.Next());
        engine[s].push_back(rng.Next());
      }
    }
  }
};

const Stems& GetStems() {
  static const Stems stems;
  return stems;
}

bool IsKnownWorker(const WorkerKey& w) {
  if (w.dp_rank > 1) return false;
  if (w.worker_id >= kFirstShared) return w.worker_id < kFirstShared + kShared;
  return w.worker_id < static_cast<uint64_t>(kWriters * kOwnedPerWriter);
}

// A worker owned by one writer: stores its prompt block by block, evicts, starts over.
struct OwnedWorker {
  WorkerKey key;
  Tier tier = Tier::kDevice;
  uint32_t length = 0, tip = 0;
  std::vector<uint64_t> local, engine;
};

void NewPrompt(OwnedWorker& w, Rng& rng) {
  const Stems& stems = GetStems();
  const int s = rng.Below(kStems);
  w.length = kStemLength + 1 + rng.Below(kMaxLength - kStemLength);
  w.local.assign(stems.local[s].begin(), stems.local[s].end());
  w.engine.assign(stems.engine[s].begin(), stems.engine[s].end());
  while (w.local.size() < w.length) {
    w.local.push_back(rng.Next());
    w.engine.push_back(rng.Next());
  }
  w.tip = 0;
  w.tier = rng.Below(4) == 0 ? Tier::kHostPinned : Tier::kDevice;
}

void RemoveAllOf(RadixIndex& index, OwnedWorker& w, std::atomic<int>& failures) {
  if (w.tip == 0) return;
  // Two events, children first then parents, so orphans exist in between.
  const uint32_t half = w.tip / 2;
  const std::vector<uint64_t> tail(w.engine.begin() + half, w.engine.begin() + w.tip);
  const std::vector<uint64_t> head(w.engine.begin(), w.engine.begin() + half);
  if (!index.Apply(RemovedBlocks(w.key, tail, w.tier)).ok()) ++failures;
  if (!head.empty() && !index.Apply(RemovedBlocks(w.key, head, w.tier)).ok()) ++failures;
  w.tip = 0;
}

void Writer(RadixIndex& index, int id, std::atomic<int>& failures) {
  Rng rng(1000 + id);
  std::vector<OwnedWorker> owned(kOwnedPerWriter);
  for (int i = 0; i < kOwnedPerWriter; ++i) {
    owned[i].key =
        WorkerKey{static_cast<uint64_t>(id * kOwnedPerWriter + i), static_cast<uint32_t>(i % 2)};
    NewPrompt(owned[i], rng);
  }
  const Stems& stems = GetStems();
  for (int op = 0; op < kOpsPerWriter; ++op) {
    if (rng.Below(5) != 0) {
      // Owned workers: errors are bugs.
      OwnedWorker& w = owned[rng.Below(kOwnedPerWriter)];
      if (w.tip < w.length) {
        const uint32_t n = std::min<uint32_t>(1 + rng.Below(3), w.length - w.tip);
        std::optional<uint64_t> parent;
        if (w.tip > 0) parent = w.engine[w.tip - 1];
        const ApplyResult r = index.Apply(
            StoredBlocks(w.key, parent, {w.engine.begin() + w.tip, w.engine.begin() + w.tip + n},
                         {w.local.begin() + w.tip, w.local.begin() + w.tip + n}, w.tier));
        if (!r.ok()) ++failures;
        w.tip += n;
      } else {
        RemoveAllOf(index, w, failures);
        NewPrompt(w, rng);
      }
    } else {
      // Shared workers: writers race on them, so removals may find nothing (an error is fine).
      const WorkerKey w{kFirstShared + rng.Below(kShared), rng.Below(2)};
      const int s = rng.Below(kStems);
      const uint32_t n = 1 + rng.Below(kStemLength);
      const uint32_t r = rng.Below(100);
      if (r < 55) {
        index.Apply(StoredBlocks(w, std::nullopt,
                                 {stems.engine[s].begin(), stems.engine[s].begin() + n},
                                 {stems.local[s].begin(), stems.local[s].begin() + n},
                                 rng.Below(3) == 0 ? Tier::kDisk : Tier::kDevice));
      } else if (r < 97) {
        index.Apply(
            RemovedBlocks(w, {stems.engine[s].begin() + rng.Below(n), stems.engine[s].begin() + n},
                          rng.Below(3) == 0 ? Tier::kDisk : Tier::kDevice));
      } else {
        index.Apply(ClearedWorker(w));
      }
    }
  }
  for (OwnedWorker& w : owned) RemoveAllOf(index, w, failures);
}

struct ReaderReport {
  uint64_t queries = 0;
  uint64_t matches = 0;
  std::string error;  // first implausible answer
};

void Reader(const RadixIndex& index, int id, const std::atomic<int>& writers_done,
            ReaderReport& report) {
  Rng rng(2000 + id);
  const Stems& stems = GetStems();
  std::vector<WorkerMatch> out;
  std::vector<uint64_t> query;
  auto fail = [&](const std::string& what) {
    if (report.error.empty()) report.error = what;
  };
  // At least one query, however soon the writers finish (a loaded machine may run them first).
  for (int i = 0; i == 0 || (i < kMaxReaderIterations && writers_done.load() < kWriters); ++i) {
    const int s = rng.Below(kStems);
    query.assign(stems.local[s].begin(), stems.local[s].begin() + 1 + rng.Below(kStemLength));
    const uint32_t extra = rng.Below(4);
    for (uint32_t k = 0; k < extra; ++k) query.push_back(rng.Next());
    index.FindMatches(query, out);
    ++report.queries;
    std::set<WorkerKey> seen;
    for (const WorkerMatch& m : out) {
      ++report.matches;
      const uint64_t hits = uint64_t{m.device_blocks} + m.host_hits + m.disk_hits + m.external_hits;
      if (!IsKnownWorker(m.worker)) fail("unknown worker " + std::to_string(m.worker.worker_id));
      if (!seen.insert(m.worker).second) fail("worker reported twice");
      if (m.device_blocks > query.size()) fail("device_blocks > query length");
      if (hits > query.size()) fail("hits > query length");
      if (hits == 0) fail("worker reported without holding the first block");
      if (m.tree_size < hits) fail("tree_size < matched blocks");
    }
    if (i % 64 == 0) {
      const IndexStats stats = index.Stats();
      if (stats.nodes < 1) fail("no root");
      if (stats.workers > kWriters * kOwnedPerWriter + 2 * kShared) fail("too many workers");
      for (const WorkerKey& w : index.Workers()) {
        if (!IsKnownWorker(w)) fail("Workers() lists an unknown worker");
      }
      const WorkerKey w{rng.Below(kWriters * kOwnedPerWriter), 0};
      if (index.TreeSize(w) > kMaxLength) fail("tree size beyond the prompt length");
    }
    if (id == 0 && i % 4096 == 0) {
      (void)index.StateDigest();
      (void)index.DumpEvents();
    }
  }
}

void WritersAndReadersOn(uint32_t shards) {
  RadixIndex index(RadixIndexOptions{.shards = shards});
  const int64_t start_bytes = index.Stats().allocated_bytes;
  std::atomic<int> failures{0};
  std::atomic<int> writers_done{0};
  std::vector<ReaderReport> reports(kReaders);
  std::vector<std::thread> threads;
  for (int r = 0; r < kReaders; ++r) {
    threads.emplace_back([&, r] { Reader(index, r, writers_done, reports[r]); });
  }
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      Writer(index, w, failures);
      writers_done.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();

  EXPECT_EQ(failures.load(), 0) << "events on owned workers must all apply";
  uint64_t queries = 0;
  for (const ReaderReport& r : reports) {
    EXPECT_EQ(r.error, "");
    queries += r.queries;
  }
  EXPECT_GT(queries, 0u);

  // Every owned worker removed its blocks; only the shared workers hold anything now.
  for (uint64_t id = 0; id < kWriters * kOwnedPerWriter; ++id) {
    EXPECT_EQ(index.TreeSize({id, 0}) + index.TreeSize({id, 1}), 0u) << id;
  }
  for (uint64_t id = kFirstShared; id < kFirstShared + kShared; ++id) index.RemoveWorker(id);
  const IndexStats end = index.Stats();
  EXPECT_EQ(end.nodes, shards);  // each shard's root
  EXPECT_EQ(end.cached_blocks, 0u);
  for (uint64_t id = 0; id < kWriters * kOwnedPerWriter; ++id) index.RemoveWorker(id);
  EXPECT_EQ(index.Stats().workers, 0u);
  EXPECT_EQ(index.Stats().allocated_bytes, start_bytes);
}

TEST(RadixIndexConcurrencyTest, WritersAndReaders) { WritersAndReadersOn(1); }

// The writers' workers spread over four trees: events of different shards apply in parallel.
TEST(RadixIndexConcurrencyTest, WritersAndReadersOnShards) { WritersAndReadersOn(4); }

// One rank's chain grows, 64 blocks an event, until its position table is far past
// PositionTable::kMapFromBytes (40 K entries at 16 bytes, at most 90 % full: over 700 KiB, so
// mapped and grown in place several times) and then shrinks again, while readers look the chain up
// both ways: FindMatches walks the tree, HeldPrefix searches the rank's table. Every answer is a
// prefix the rank held at some moment of the lookup, never more than was stored.
TEST(RadixIndexConcurrencyTest, ReadersWhileATableGrowsInPlaceAndShrinks) {
  constexpr uint32_t kEvent = 64, kBlocks = 40'000;
  RadixIndex index;
  const WorkerKey rank{7, 0};
  Rng rng(31);
  std::vector<uint64_t> local(kBlocks), engine(kBlocks);
  for (uint32_t i = 0; i < kBlocks; ++i) {
    local[i] = rng.Next();
    engine[i] = rng.Next();
  }
  // Blocks stored for certain (set after an event applies) and at most (set before it).
  std::atomic<uint32_t> stored{0}, at_most{0};
  std::atomic<bool> shrinking{false}, done{false};
  std::vector<std::string> errors(2);
  std::vector<uint64_t> lookups(2);
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&, r] {
      std::vector<WorkerMatch> out;
      Rng pick(100 + r);
      do {  // at least one lookup, however soon the writer is done
        const uint32_t length = 1 + pick.Below(kBlocks);
        const bool in_table = pick.Below(2) == 0;
        const uint32_t before = stored.load();
        uint64_t depth = 0;
        if (in_table) {
          depth = index.HeldPrefix(rank, std::span<const uint64_t>(engine.data(), length));
        } else {
          index.FindMatches(std::span<const uint64_t>(local.data(), length), out);
          if (out.size() > 1 || (!out.empty() && out[0].worker != rank)) {
            errors[r] = "an answer about another rank";
          }
          depth = out.empty() ? 0 : out[0].device_blocks;
        }
        const uint32_t after = at_most.load();
        ++lookups[r];
        if (depth > std::min(length, after)) {
          errors[r] = std::string(in_table ? "HeldPrefix" : "FindMatches") +
                      ": more matched than was stored";
        } else if (!shrinking.load() && depth < std::min(length, before)) {
          errors[r] = std::string(in_table ? "HeldPrefix" : "FindMatches") +
                      ": less matched than was stored before the lookup";
        }
      } while (!done.load());
    });
  }
  bool applied = true;  // no ASSERT until the readers are joined
  for (uint32_t at = 0; applied && at < kBlocks; at += kEvent) {
    const std::optional<uint64_t> parent =
        at == 0 ? std::nullopt : std::optional<uint64_t>(engine[at - 1]);
    at_most.store(at + kEvent);
    applied =
        index
            .Apply(StoredBlocks(rank, parent, {engine.begin() + at, engine.begin() + at + kEvent},
                                {local.begin() + at, local.begin() + at + kEvent}))
            .ok();
    stored.store(at + kEvent);
  }
  const uint64_t held = index.TreeSize(rank);
  shrinking.store(true);
  for (uint32_t end = kBlocks; applied && end > 0;
       end -= kEvent) {  // deepest first, as engines evict
    applied =
        index.Apply(RemovedBlocks(rank, {engine.begin() + end - kEvent, engine.begin() + end}))
            .ok();
  }
  done.store(true);
  for (std::thread& t : readers) t.join();
  EXPECT_TRUE(applied);
  EXPECT_EQ(held, kBlocks);
  for (const std::string& e : errors) EXPECT_EQ(e, "");
  EXPECT_GT(lookups[0] + lookups[1], 0u);
  EXPECT_EQ(index.TreeSize(rank), 0u);
}

// The lock itself: writers keep two plain counters equal, readers check they always are (a
// torn view means a reader overlapped a writer), and the total counts every write. Under
// ThreadSanitizer any overlap is also reported as a race on the plain counters.
TEST(RadixIndexConcurrencyTest, ScalableSharedMutexExcludesWritersFromReaders) {
  ScalableSharedMutex mu;
  uint64_t a = 0, b = 0;
  constexpr int kThreads = 6, kRounds = 20'000;
  std::atomic<int> torn{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        if ((i + t) % 4 == 0) {
          std::unique_lock lock(mu);
          ++a;
          ++b;
        } else {
          std::shared_lock lock(mu);
          if (a != b) torn.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(torn.load(), 0);
  EXPECT_EQ(a, uint64_t{kThreads} * kRounds / 4);
  EXPECT_EQ(b, a);
}

TEST(RadixIndexConcurrencyTest, ApproxIndexRecordersFindersAndAClock) {
  ManualClock clock;
  ApproxIndexOptions options;
  options.block_size = 4;
  options.ttl_seconds = 2;
  options.max_blocks = 2000;
  ApproxIndex index(options, clock);
  const Stems& stems = GetStems();
  constexpr int kRecorders = 3;
  std::atomic<int> recorders_done{0};
  std::atomic<bool> implausible{false};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRecorders; ++r) {
    threads.emplace_back([&, r] {
      Rng rng(3000 + r);
      std::vector<uint64_t> local;
      for (int i = 0; i < 5000; ++i) {
        const int s = rng.Below(kStems);
        local.assign(stems.local[s].begin(), stems.local[s].end());
        for (int k = 0; k < 4; ++k) local.push_back(rng.Below(64));
        index.RecordRoutingDecision({static_cast<uint64_t>(rng.Below(16)), 0}, local,
                                    ComputeSequenceHashes(local));
        if (i % 500 == 0) index.RemoveWorker(rng.Below(16));
      }
      recorders_done.fetch_add(1);
    });
  }
  threads.emplace_back([&] {  // the clock
    for (int i = 0; i < 20000 && recorders_done.load() < kRecorders; ++i) {
      clock.Advance(SecondsToNanos(0.001));
      if (i % 100 == 0) index.ExpireDue();
    }
  });
  for (int f = 0; f < 2; ++f) {
    threads.emplace_back([&, f] {
      Rng rng(4000 + f);
      std::vector<WorkerMatch> out;
      for (int i = 0; i < 100'000 && recorders_done.load() < kRecorders; ++i) {
        const int s = rng.Below(kStems);
        const std::vector<uint64_t> q(stems.local[s].begin(), stems.local[s].end());
        index.FindMatches(q, out);
        for (const WorkerMatch& m : out) {
          if (m.device_blocks > q.size() || m.worker.worker_id >= 16) implausible = true;
        }
        if (i % 256 == 0 && index.Stats().tracked_blocks > options.max_blocks) implausible = true;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_FALSE(implausible.load());
  EXPECT_LE(index.Stats().tracked_blocks, options.max_blocks);

  clock.AdvanceSeconds(3);
  index.ExpireDue();
  const ApproxIndexStats s = index.Stats();
  EXPECT_EQ(s.tracked_blocks, 0u);
  EXPECT_EQ(s.index.nodes, 1u);
  EXPECT_EQ(s.index.cached_blocks, 0u);
}

}  // namespace
}  // namespace kvrouter

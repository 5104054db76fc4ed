// RadixIndex benchmarks. Aims (BENCHMARKS.md): >= 2 M applied block-events/s per core,
// find_matches p50 < 10 us for an 8,192-token prompt over 64 workers, <= 64 bytes per cached
// (block, worker) entry.
//
// (a) Apply: batches of 32-block stored events, each stored batch removed again so the index
//     returns to the same background state every iteration (it never grows). Stores and
//     removals are timed separately with manual timing, and together as a round trip.
// (b) FindMatches over an index loaded from the Mooncake conversation trace: every request's
//     prompt (expanded at block size 16) is stored on one of 64 workers, round-robin.
// (c) Memory: Stats().allocated_bytes / Stats().cached_blocks on that loaded index.
//
// Extra flags, stripped before Google Benchmark parses the rest:
//   --trace=PATH            Mooncake JSONL trace (default: the shared conversation trace)
//   --trace_requests=N      load only the first N requests (default 0 = all)
//   --workers=N             workers the trace is spread over (default 64)
#include <absl/container/flat_hash_set.h>
#include <benchmark/benchmark.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <latch>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "core/hashing.h"
#include "core/radix_index.h"
#include "core/types.h"
#include "replay/trace/mooncake_trace.h"

namespace kvrouter::bench {
namespace {

using namespace kvrouter::trace;

using Clock = std::chrono::steady_clock;

constexpr uint32_t kBlockSize = 16;

WorkerKey Worker(uint64_t id) { return WorkerKey{.worker_id = id, .dp_rank = 0}; }

KvEvent MakeStored(WorkerKey worker, std::optional<uint64_t> parent, StoredEvent stored) {
  stored.parent_hash = parent;
  return KvEvent{.worker = worker, .tier = Tier::kDevice, .event_id = 0, .data = std::move(stored)};
}

KvEvent MakeRemoved(WorkerKey worker, std::vector<uint64_t> engine_hashes) {
  return KvEvent{.worker = worker,
                 .tier = Tier::kDevice,
                 .event_id = 0,
                 .data = RemovedEvent{.block_hashes = std::move(engine_hashes)}};
}

// Current resident memory, to cross-check the index's own byte count.
double ResidentMiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// (a) Applying events.

constexpr size_t kEventBlocks = 32;
constexpr uint32_t kApplyWorkers = 64;
constexpr size_t kPrefixes = 64;           // shared 32-block prefixes, held by every worker
constexpr size_t kBatchSequences = 256;    // distinct 32-block continuations per batch
constexpr size_t kHoldersPerSequence = 4;  // each continuation is stored by 4 workers

// One 32-block run of random tokens with its hashes. Engine hashes are the sequence hashes
// chained from `parent` (as an engine would chain them), so they are unique per prefix.
struct BlockRun {
  std::vector<uint32_t> tokens;
  std::vector<uint64_t> local;
  std::vector<uint64_t> engine;
};

BlockRun MakeRun(std::mt19937_64& rng, std::optional<uint64_t> parent) {
  BlockRun run;
  run.tokens.resize(kEventBlocks * kBlockSize);
  for (uint32_t& t : run.tokens) t = static_cast<uint32_t>(rng());
  run.local = ComputeLocalBlockHashes(run.tokens, kBlockSize);
  uint64_t prev = parent.value_or(0);
  for (size_t i = 0; i < run.local.size(); ++i) {
    prev = (i == 0 && !parent) ? run.local[0] : NextSequenceHash(prev, run.local[i]);
    run.engine.push_back(prev);
  }
  return run;
}

// A batch of stored events and the removals that undo them, applied as a pair so the index
// returns to the same state after every iteration.
struct EventBatch {
  std::vector<KvEvent> stores;
  std::vector<KvEvent> removals;
  size_t blocks = 0;

  void Add(WorkerKey worker, std::optional<uint64_t> parent, const BlockRun& run,
           bool with_tokens) {
    StoredEvent stored{.block_hashes = run.engine};
    if (with_tokens) {
      stored.token_ids = run.tokens;  // the index hashes them (outside its lock)
    } else {
      stored.local_hashes = run.local;
    }
    stores.push_back(MakeStored(worker, parent, std::move(stored)));
    removals.push_back(MakeRemoved(worker, run.engine));
    blocks += run.engine.size();
  }
};

// Applies `events`; returns false (after flagging the benchmark) if any is rejected, since a
// rejected event is cheaper than an applied one and would flatter the figure.
bool ApplyAll(benchmark::State& state, RadixIndex& index, const std::vector<KvEvent>& events) {
  bool ok = true;
  for (const KvEvent& e : events) ok &= index.Apply(e).ok();
  if (!ok) state.SkipWithError("an event was rejected");
  return ok;
}

enum class Timed { kStores, kRemovals, kBoth };

// Every iteration stores the batch then removes it; only the `timed` phase counts (manual
// time), and items = blocks in the timed phase(s).
void RunBatch(benchmark::State& state, RadixIndex& index, const EventBatch& batch, Timed timed) {
  for (auto _ : state) {
    const auto t0 = Clock::now();
    if (!ApplyAll(state, index, batch.stores)) break;
    const auto t1 = Clock::now();
    if (!ApplyAll(state, index, batch.removals)) break;
    const auto t2 = Clock::now();
    const auto spent = timed == Timed::kStores     ? t1 - t0
                       : timed == Timed::kRemovals ? t2 - t1
                                                   : t2 - t0;
    state.SetIterationTime(Seconds(spent));
  }
  const size_t per_iteration = timed == Timed::kBoth ? 2 * batch.blocks : batch.blocks;
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * per_iteration));
}

// A small index: kPrefixes shared 32-block prefixes held by every worker (131,072 entries).
// The batch continues those prefixes: kBatchSequences new runs, each stored by
// kHoldersPerSequence workers, so a run's first store creates its nodes and the others only
// join them, and every event exercises the parent lookup an engine's continuation needs.
class SyntheticIndex {
 public:
  explicit SyntheticIndex(bool with_tokens) : index_(RadixIndexOptions{.block_size = kBlockSize}) {
    std::mt19937_64 rng(7);
    std::vector<BlockRun> prefixes;
    for (size_t p = 0; p < kPrefixes; ++p) prefixes.push_back(MakeRun(rng, std::nullopt));
    for (uint32_t w = 0; w < kApplyWorkers; ++w) {
      for (const BlockRun& prefix : prefixes) {
        StoredEvent stored{.block_hashes = prefix.engine, .local_hashes = prefix.local};
        index_.Apply(MakeStored(Worker(w), std::nullopt, std::move(stored)));
      }
    }
    for (size_t s = 0; s < kBatchSequences; ++s) {
      const uint64_t parent = prefixes[s % kPrefixes].engine.back();
      const BlockRun run = MakeRun(rng, parent);
      for (size_t h = 0; h < kHoldersPerSequence; ++h) {
        // Holders 16 apart: distinct workers, and every worker gets the same share.
        batch_.Add(Worker((s + h * 16) % kApplyWorkers), parent, run, with_tokens);
      }
    }
  }

  RadixIndex& index() { return index_; }
  const EventBatch& batch() const { return batch_; }

 private:
  RadixIndex index_;
  EventBatch batch_;
};

void BM_ApplyStored(benchmark::State& state) {
  SyntheticIndex fx(/*with_tokens=*/false);
  RunBatch(state, fx.index(), fx.batch(), Timed::kStores);
}

void BM_ApplyStoredWithTokens(benchmark::State& state) {
  SyntheticIndex fx(/*with_tokens=*/true);
  RunBatch(state, fx.index(), fx.batch(), Timed::kStores);
}

void BM_ApplyRemoved(benchmark::State& state) {
  SyntheticIndex fx(/*with_tokens=*/false);
  RunBatch(state, fx.index(), fx.batch(), Timed::kRemovals);
}

void BM_ApplyStoreThenRemove(benchmark::State& state) {
  SyntheticIndex fx(/*with_tokens=*/false);
  RunBatch(state, fx.index(), fx.batch(), Timed::kBoth);
}

BENCHMARK(BM_ApplyStored)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ApplyStoredWithTokens)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ApplyRemoved)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ApplyStoreThenRemove)->UseManualTime()->Unit(benchmark::kMillisecond);

// ---------------------------------------------------------------------------------------------
// (b), (c) An index loaded from the Mooncake trace.

constexpr size_t kQueryBlocks = 512;  // 8,192 tokens at block size 16
constexpr size_t kMaxQueries = 1024;

struct LoadReport {
  size_t requests = 0;
  uint64_t blocks_applied = 0;  // blocks sent in stored events (new to their worker)
  double total_seconds = 0;     // parse + expand + hash + apply
  double apply_seconds = 0;     // Apply alone
  double rss_delta_mib = 0;     // resident memory the load added: the index's alone
};

// What each worker already holds, by engine hash, so a request stores only the blocks that are
// new to its worker (an engine publishes a stored event only for blocks it newly caches).
using HeldBlocks = std::vector<absl::flat_hash_set<uint64_t>>;

class TraceIndex {
 public:
  // Loaded once per shard count, shared by every benchmark and repetition.
  static TraceIndex& Get(uint32_t shards = 1) {
    static std::map<uint32_t, std::unique_ptr<TraceIndex>> instances;
    std::unique_ptr<TraceIndex>& instance = instances[shards];
    if (!instance) instance.reset(new TraceIndex(shards));
    return *instance;
  }

  RadixIndex& index() { return index_; }
  const LoadReport& report() const { return report_; }
  // Where each query's prompt was stored: its worker and the engine hash of its last block.
  const std::vector<std::pair<WorkerKey, uint64_t>>& query_anchors() const { return anchors_; }
  const std::vector<std::vector<uint64_t>>& queries() const { return queries_; }
  const std::vector<std::vector<uint32_t>>& query_tokens() const { return query_tokens_; }

 private:
  // The events are made first and applied after, so that the memory measured around the apply
  // is the index's alone: the sets that tell what each worker already holds grow while the
  // events are made, and their old arrays, freed in the heap among the index's, would count as
  // the index's holes (at 1,000 workers they added 171 MiB to the figure).
  explicit TraceIndex(uint32_t shards)
      : index_(RadixIndexOptions{.block_size = kBlockSize, .shards = shards}) {
    const auto start = Clock::now();
    std::vector<TraceRecord> records = LoadTrace(GetFlags().trace_path);
    if (GetFlags().trace_requests > 0 && GetFlags().trace_requests < records.size()) {
      records.resize(GetFlags().trace_requests);
    }
    const std::vector<KvEvent> events = MakeEvents(records);
    malloc_trim(0);  // the making's holes leave the process before the measure starts
    const double rss_before = ResidentMiB();
    Apply(events);
    report_.rss_delta_mib = ResidentMiB() - rss_before;
    report_.total_seconds = Seconds(Clock::now() - start);
  }

  std::vector<KvEvent> MakeEvents(const std::vector<TraceRecord>& records) {
    HeldBlocks held(GetFlags().workers);
    std::vector<KvEvent> events;
    std::vector<uint32_t> tokens;
    std::vector<uint64_t> local;
    std::vector<uint64_t> engine;
    for (size_t i = 0; i < records.size(); ++i) {
      ExpandTokensInto(records[i], kBlockSize, tokens);
      ComputeLocalBlockHashesInto(tokens, kBlockSize, {}, local);
      ComputeSequenceHashesInto(local, engine);
      const uint32_t w = static_cast<uint32_t>(i % GetFlags().workers);
      if (auto stored = NewBlocks(Worker(w), local, engine, held[w])) {
        events.push_back(std::move(*stored));
      }
      MaybeAddQuery(Worker(w), tokens, local, engine);
    }
    report_.requests = records.size();
    return events;
  }

  // Trace ids are chained, so what a worker holds of a prompt is a leading run: the event
  // carries the blocks after it, with the last held block as parent.
  static std::optional<KvEvent> NewBlocks(WorkerKey worker, const std::vector<uint64_t>& local,
                                          const std::vector<uint64_t>& engine,
                                          absl::flat_hash_set<uint64_t>& held) {
    size_t first_new = 0;
    while (first_new < engine.size() && held.contains(engine[first_new])) ++first_new;
    if (first_new == engine.size()) return std::nullopt;
    StoredEvent stored{.block_hashes = {engine.begin() + first_new, engine.end()},
                       .local_hashes = {local.begin() + first_new, local.end()}};
    std::optional<uint64_t> parent;
    if (first_new > 0) parent = engine[first_new - 1];
    held.insert(engine.begin() + first_new, engine.end());
    return MakeStored(worker, parent, std::move(stored));
  }

  void Apply(const std::vector<KvEvent>& events) {
    for (const KvEvent& event : events) {
      const auto start = Clock::now();
      const ApplyResult result = index_.Apply(event);
      report_.apply_seconds += Seconds(Clock::now() - start);
      if (!result.ok()) throw std::runtime_error("trace load: event rejected: " + result.message);
      report_.blocks_applied += std::get<StoredEvent>(event.data).block_hashes.size();
    }
  }

  // Queries are real trace prompts long enough for 512 blocks, cut to exactly 8,192 tokens.
  void MaybeAddQuery(WorkerKey worker, const std::vector<uint32_t>& tokens,
                     const std::vector<uint64_t>& local, const std::vector<uint64_t>& engine) {
    if (queries_.size() >= kMaxQueries || local.size() < kQueryBlocks) return;
    anchors_.emplace_back(worker, engine[kQueryBlocks - 1]);
    queries_.emplace_back(local.begin(), local.begin() + kQueryBlocks);
    query_tokens_.emplace_back(tokens.begin(), tokens.begin() + kQueryBlocks * kBlockSize);
  }

  RadixIndex index_;
  LoadReport report_;
  std::vector<std::vector<uint64_t>> queries_;
  std::vector<std::vector<uint32_t>> query_tokens_;
  std::vector<std::pair<WorkerKey, uint64_t>> anchors_;
};

// (c) Bytes per cached (block, worker), and how long the load took.
void BM_TraceIndexMemory(benchmark::State& state) {
  TraceIndex& trace = TraceIndex::Get();
  IndexStats stats;
  for (auto _ : state) {
    stats = trace.index().Stats();
    benchmark::DoNotOptimize(stats);
  }
  const LoadReport& r = trace.report();
  state.counters["bytes_per_entry"] =
      static_cast<double>(stats.allocated_bytes) / static_cast<double>(stats.cached_blocks);
  state.counters["bytes_per_node"] =
      static_cast<double>(stats.allocated_bytes) / static_cast<double>(stats.nodes);
  state.counters["cached_blocks"] = static_cast<double>(stats.cached_blocks);
  state.counters["nodes"] = static_cast<double>(stats.nodes);
  state.counters["allocated_MiB"] = static_cast<double>(stats.allocated_bytes) / (1 << 20);
  state.counters["rss_delta_MiB"] = r.rss_delta_mib;
  state.counters["requests"] = static_cast<double>(r.requests);
  state.counters["load_s"] = r.total_seconds;
  state.counters["load_apply_s"] = r.apply_seconds;
  state.counters["load_apply_blocks_per_s"] =
      static_cast<double>(r.blocks_applied) / r.apply_seconds;
}

// The trace index as a snapshot restore rebuilds it: its DumpEvents applied to a fresh index
// (what kvr_router_restore does). Its lookups should cost what the original's do.
RadixIndex& RestoredTraceIndex() {
  static RadixIndex* restored = [] {
    auto* index = new RadixIndex(RadixIndexOptions{.block_size = kBlockSize});
    for (const KvEvent& event : TraceIndex::Get().index().DumpEvents()) {
      if (!index->Apply(event).ok()) throw std::runtime_error("restore: event rejected");
    }
    return index;
  }();
  return *restored;
}

// (b) FindMatches for 8,192-token trace prompts, local hashes precomputed, on `index`. Arg =
// how many distinct prompts are cycled through: 1024 (the default figure) walks paths that are
// mostly out of cache, 1 repeats one prompt so its path stays cached (the compute floor).
void FindMatchesOn(benchmark::State& state, RadixIndex& index) {
  TraceIndex& trace = TraceIndex::Get();
  const auto& all = trace.queries();
  const std::span<const std::vector<uint64_t>> queries(
      all.data(), std::min(all.size(), static_cast<size_t>(state.range(0))));
  if (queries.empty()) {
    state.SkipWithError("no trace prompt has 512 blocks");
    return;
  }
  std::vector<WorkerMatch> matches;
  std::vector<double> latencies;
  size_t q = 0;
  double matched_workers = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    index.FindMatches(queries[q], matches);
    const double s = Seconds(Clock::now() - start);
    state.SetIterationTime(s);
    latencies.push_back(s);
    matched_workers += static_cast<double>(matches.size());
    q = (q + 1) % queries.size();
  }
  ReportLatency(state, latencies);
  state.counters["workers_matched"] = matched_workers / static_cast<double>(state.iterations());
  state.counters["queries"] = static_cast<double>(queries.size());
}

void BM_FindMatches(benchmark::State& state) { FindMatchesOn(state, TraceIndex::Get().index()); }
void BM_FindMatchesRestored(benchmark::State& state) { FindMatchesOn(state, RestoredTraceIndex()); }

// Same, hashing the 8,192 tokens first: the index cost of one routing request end to end.
// The prompt is copied into a reused buffer before the clock starts, as a request's tokens
// are in cache right after it was decoded; hashing 1,024 cold 32 KiB prompts in turn would
// measure memory bandwidth instead (about 2.5x slower on this machine).
void BM_HashAndFindMatches(benchmark::State& state) {
  TraceIndex& trace = TraceIndex::Get();
  const auto& queries = trace.query_tokens();
  if (queries.empty()) {
    state.SkipWithError("no trace prompt has 512 blocks");
    return;
  }
  std::vector<uint32_t> prompt;
  std::vector<uint64_t> local;
  std::vector<WorkerMatch> matches;
  std::vector<double> latencies;
  size_t q = 0;
  for (auto _ : state) {
    prompt.assign(queries[q].begin(), queries[q].end());
    const auto start = Clock::now();
    ComputeLocalBlockHashesInto(prompt, kBlockSize, {}, local);
    trace.index().FindMatches(local, matches);
    const double s = Seconds(Clock::now() - start);
    state.SetIterationTime(s);
    latencies.push_back(s);
    q = (q + 1) % queries.size();
  }
  ReportLatency(state, latencies);
}

// Applying events to the big trace-loaded index (8.5 M entries, tables far beyond cache):
// 1,024 distinct 32-block runs, each continuing one query prompt on the worker that holds it.
EventBatch TraceContinuations(TraceIndex& trace, bool with_tokens) {
  std::mt19937_64 rng(11);
  EventBatch batch;
  const auto& anchors = trace.query_anchors();
  for (size_t e = 0; e < kBatchSequences * kHoldersPerSequence && !anchors.empty(); ++e) {
    const auto& [worker, parent] = anchors[e % anchors.size()];
    batch.Add(worker, parent, MakeRun(rng, parent), with_tokens);
  }
  return batch;
}

void BM_TraceApplyStored(benchmark::State& state) {
  TraceIndex& trace = TraceIndex::Get();
  RunBatch(state, trace.index(), TraceContinuations(trace, false), Timed::kStores);
}

void BM_TraceApplyStoredWithTokens(benchmark::State& state) {
  TraceIndex& trace = TraceIndex::Get();
  RunBatch(state, trace.index(), TraceContinuations(trace, true), Timed::kStores);
}

void BM_TraceApplyRemoved(benchmark::State& state) {
  TraceIndex& trace = TraceIndex::Get();
  RunBatch(state, trace.index(), TraceContinuations(trace, false), Timed::kRemovals);
}

// (d) Scaling with threads on the trace index split into `shards` trees: `threads` threads
//     at once, started together, the figure being all threads' work over the wall time (and
//     cpu_share, the process's CPU time over threads x wall: below 1 when other processes
//     took the cores, or when threads waited for each other).
//   BM_TraceFindMatchesThreads/threads:N/shards:S: each thread runs 4,096 lookups over the
//     1,024 queries, thread t starting at query 512 t. items/s = lookups/s.
//   BM_TraceApplyThreads/threads:N/shards:S: the continuation batch of BM_TraceApplyStored
//     split by worker (each worker's events in order on one thread; with at least as many
//     shards as threads, shards are dealt to threads in turn); each thread stores its share,
//     then removes it. items/s = stored and removed blocks/s; busiest_share = the share of
//     the events on the busiest thread (the wall time is that thread's).
template <typename Work>
void RunThreads(benchmark::State& state, size_t threads, Work&& work) {
  for (auto _ : state) {
    std::latch start(static_cast<std::ptrdiff_t>(threads) + 1);
    std::vector<std::thread> pool;
    for (size_t t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        start.arrive_and_wait();
        work(t);
      });
    }
    timespec cpu0{}, cpu1{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu0);
    const auto t0 = Clock::now();
    start.arrive_and_wait();
    for (std::thread& thread : pool) thread.join();
    const double wall = Seconds(Clock::now() - t0);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu1);
    const double cpu = static_cast<double>(cpu1.tv_sec - cpu0.tv_sec) +
                       static_cast<double>(cpu1.tv_nsec - cpu0.tv_nsec) * 1e-9;
    state.SetIterationTime(wall);
    state.counters["cpu_share"] = cpu / (wall * static_cast<double>(threads));
  }
}

void BM_TraceFindMatchesThreads(benchmark::State& state) {
  TraceIndex& trace = TraceIndex::Get(static_cast<uint32_t>(state.range(1)));
  const auto& queries = trace.queries();
  const size_t threads = static_cast<size_t>(state.range(0));
  constexpr size_t kLookups = 4096;
  if (queries.empty()) {
    state.SkipWithError("no trace prompt has 512 blocks");
    return;
  }
  RunThreads(state, threads, [&](size_t t) {
    std::vector<WorkerMatch> matches;
    for (size_t i = 0; i < kLookups; ++i) {
      trace.index().FindMatches(queries[(512 * t + i) % queries.size()], matches);
    }
  });
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * threads * kLookups));
}

// The thread that applies a worker's events: with a shard per thread or more, its shard's
// (shards dealt to threads in turn), so two threads never write to one tree.
std::vector<size_t> ThreadOfWorker(const RadixIndex& index, size_t threads) {
  std::vector<size_t> thread_of(GetFlags().workers);
  for (uint32_t w = 0; w < GetFlags().workers; ++w) {
    thread_of[w] = index.shards() >= threads ? index.ShardOf(w) % threads : w % threads;
  }
  return thread_of;
}

void BM_TraceApplyThreads(benchmark::State& state) {
  const size_t threads = static_cast<size_t>(state.range(0));
  const auto shards = static_cast<uint32_t>(state.range(1));
  TraceIndex& trace = TraceIndex::Get(shards);
  const EventBatch batch = TraceContinuations(trace, false);
  const std::vector<size_t> thread_of = ThreadOfWorker(trace.index(), threads);
  std::vector<std::vector<const KvEvent*>> stores(threads), removals(threads);
  for (size_t e = 0; e < batch.stores.size(); ++e) {
    const size_t t = thread_of[batch.stores[e].worker.worker_id];
    stores[t].push_back(&batch.stores[e]);
    removals[t].push_back(&batch.removals[e]);
  }
  size_t largest = 0;  // the wall time is the busiest thread's: report how even the split is
  for (const auto& share : stores) largest = std::max(largest, share.size());
  state.counters["busiest_share"] =
      static_cast<double>(largest) / static_cast<double>(batch.stores.size());
  std::atomic<bool> rejected{false};
  RunThreads(state, threads, [&](size_t t) {
    for (const KvEvent* e : stores[t]) rejected = rejected || !trace.index().Apply(*e).ok();
    for (const KvEvent* e : removals[t]) rejected = rejected || !trace.index().Apply(*e).ok();
  });
  if (rejected) state.SkipWithError("an event was rejected");
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * 2 * batch.blocks));
}

// (d) Hybrid models: what a sliding-window group's rule (core/sliding_windows.h) adds to a
// lookup. 64 workers hold a shared 64-block prefix and a 448-block continuation each (8,192
// tokens at 16 a block); with sliding:1 each also has a sliding group of 1,024 tokens (Gemma-3's:
// 64 blocks before a hit point) holding its prompt's last 64 blocks, as vLLM leaves them. The
// query is worker 0's prompt plus one token: worker 0's rule finds its run in 64 probes, each
// other worker's searches its 64 shared blocks and finds none (a hit of 0: it drops out).
void BM_FindMatchesHybrid(benchmark::State& state) {
  const bool sliding = state.range(0) != 0;
  constexpr uint32_t kWorkers = 64, kShared = 64, kOwn = 448, kWindowTokens = 1024;
  RadixIndex index({.block_size = kBlockSize});
  std::mt19937_64 rng(7);
  auto random_blocks = [&](size_t n) {
    std::vector<uint64_t> hashes(n);
    for (uint64_t& h : hashes) h = rng();
    return hashes;
  };
  const std::vector<uint64_t> shared = random_blocks(kShared);
  std::vector<uint64_t> query;
  for (uint32_t w = 0; w < kWorkers; ++w) {
    std::vector<uint64_t> local = shared;
    const std::vector<uint64_t> own = random_blocks(kOwn);
    local.insert(local.end(), own.begin(), own.end());
    if (w == 0) query = local;
    std::vector<uint64_t> engine = ComputeSequenceHashes(local);
    StoredEvent stored{.block_hashes = engine, .local_hashes = local};
    (void)index.Apply(MakeStored(Worker(w), std::nullopt, std::move(stored)));
    if (!sliding) continue;
    SlidingStoredEvent window{.group = 0, .window_tokens = kWindowTokens};
    window.block_hashes.assign(engine.end() - kWindowTokens / kBlockSize, engine.end());
    (void)index.Apply(KvEvent{.worker = Worker(w), .data = std::move(window)});
  }
  const size_t computable = query.size();  // the prompt plus one token
  std::vector<WorkerMatch> matches;
  std::vector<double> latencies;
  for (auto _ : state) {
    const auto start = Clock::now();
    index.FindMatches(query, matches, computable);
    const double s = Seconds(Clock::now() - start);
    state.SetIterationTime(s);
    latencies.push_back(s);
  }
  ReportLatency(state, latencies);
  state.counters["workers_matched"] = static_cast<double>(matches.size());
  state.counters["worker0_blocks"] = matches.empty() ? 0 : matches[0].device_blocks;
}

BENCHMARK(BM_TraceIndexMemory)->Iterations(1);
BENCHMARK(BM_FindMatchesHybrid)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->ArgName("sliding")
    ->Arg(0)
    ->Arg(1);
BENCHMARK(BM_FindMatches)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->ArgName("prompts")
    ->Arg(kMaxQueries)
    ->Arg(1);
BENCHMARK(BM_FindMatchesRestored)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->ArgName("prompts")
    ->Arg(kMaxQueries);
BENCHMARK(BM_HashAndFindMatches)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TraceApplyStored)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TraceApplyStoredWithTokens)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TraceApplyRemoved)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TraceFindMatchesThreads)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->ArgNames({"threads", "shards"})
    ->Args({1, 1})
    ->Args({2, 1})
    ->Args({1, 2})
    ->Args({2, 2})
    ->Args({1, 4})
    ->Args({2, 4});
BENCHMARK(BM_TraceApplyThreads)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->ArgNames({"threads", "shards"})
    ->Args({1, 1})
    ->Args({2, 1})
    ->Args({1, 2})
    ->Args({2, 2})
    ->Args({1, 4})
    ->Args({2, 4});

}  // namespace
}  // namespace kvrouter::bench

int main(int argc, char** argv) { return kvrouter::bench::RunBenchmarks(argc, argv); }

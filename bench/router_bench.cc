// Router benchmarks. Aims (issue 12): find_best_match end to end (hash + match + score + book)
// p50 <= 10 us, p99 <= 25 us for an 8,192-token prompt over 64 workers on an idle machine;
// an approximate-mode decision within 2x of an exact one at p50 and p99.
//
// The index is loaded from the Mooncake conversation trace through Router::ApplyEvent: every
// request's prompt (expanded at block size 16) is stored on one of 64 workers, round-robin,
// as only the blocks new to that worker. Queries are the first 1,024 trace prompts that reach
// 512 blocks, cut to exactly 8,192 tokens.
//
// (a) BM_FindBestMatch/inflight:N — FindBestMatch with admission (hash, match, price 64
//     candidates, book), then Free. N requests stay booked (the oldest is freed after each new
//     booking), so selection and booking run against realistic load: N = 0 frees at once,
//     N = 256 keeps 256 in flight. Manual time = FindBestMatch only; free_p50/p99 time Free.
//     Besides p50/p99/p999: allocs_per_call (heap allocations in the timed call),
//     faulting_per_1k (calls that took a minor page fault), slow_per_1k (calls over 50 us) and
//     slow_faulting_per_1k (of those, the ones that faulted): where a tail comes from.
// (b) BM_FindBestMatchPreview — the same without admission (nothing booked, nothing freed).
// (c) BM_ActiveSequencesAddFree/inflight:N — the load tracker alone: AddRequest of a 512-block
//     prompt (block identities precomputed) on one of 64 workers, then Free; items/s = bookings.
// (d) BM_RouterAddRequestFree — Router::AddRequest for a pinned worker (hash + match + book)
//     and Free, items/s = bookings.
// (e) BM_FindBestMatchApprox/budget:N — as (a) with 0 in flight, in approximate mode (see
//     below).
// (f) BM_FindBestMatchThreads/threads:T — T threads deciding at once on the one router, each
//     admitting requests of its own and freeing each at once; items/s = the decisions of all
//     threads together over real time: how the admission gate (the router's lock around
//     pricing and booking) holds up when a gateway calls from several threads.
//
// Extra flags, stripped before Google Benchmark parses the rest:
//   --trace=PATH            Mooncake JSONL trace (default: the shared conversation trace)
//   --trace_requests=N      load only the first N requests (default 0 = all)
//   --workers=N             workers (default 64)
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "bench_common.h"
#include "core/active_sequences.h"
#include "core/hashing.h"
#include "core/router.h"
#include "replay/trace/mooncake_trace.h"

// Heap allocations made by this thread, counted by the replaced operator new below: a
// decision's allocations are where its tail latency can come from (a malloc slow path, a page
// fault on fresh memory), so the benchmarks report them per call.
thread_local uint64_t t_allocations = 0;

void* operator new(size_t size) {
  ++t_allocations;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace kvrouter::bench {
namespace {

// Minor page faults of this thread so far (first touches of fresh memory): with the
// allocation count, what tells a slow call's cause apart from the machine's (an interrupt,
// another process).
long MinorFaults() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_minflt;
}

// A call this slow is counted apart (slow_per_1k), and whether it took a page fault.
constexpr double kSlowCall = 50e-6;

using namespace kvrouter::trace;

using SteadyTime = std::chrono::steady_clock;

constexpr uint32_t kBlockSize = 16;
constexpr size_t kQueryBlocks = 512;  // 8,192 tokens
constexpr size_t kMaxQueries = 1024;

// A router whose index holds the trace, and the query prompts.
class TraceRouter {
 public:
  static TraceRouter& Get() {
    static TraceRouter instance;
    return instance;
  }

  Router& router() { return *router_; }
  const std::vector<std::vector<uint32_t>>& queries() const { return queries_; }
  // Tracking identities of each query's blocks (for the load-tracker benchmark).
  const std::vector<std::vector<uint64_t>>& query_sequences() const { return sequences_; }

 private:
  TraceRouter() {
    RouterOptions options;
    options.block_size = kBlockSize;
    options.random_seed = 1;
    auto router = Router::Create(options);
    if (!router.ok()) throw std::runtime_error(std::string(router.status().message()));
    router_ = std::move(*router);
    for (uint32_t w = 0; w < GetFlags().workers; ++w) {
      const auto status = router_->AddWorker(
          WorkerConfig{.worker_id = w, .max_num_batched_tokens = 16384, .block_size = kBlockSize});
      if (!status.ok()) throw std::runtime_error(std::string(status.message()));
    }
    std::vector<TraceRecord> records = LoadTrace(GetFlags().trace_path);
    if (GetFlags().trace_requests > 0 && GetFlags().trace_requests < records.size()) {
      records.resize(GetFlags().trace_requests);
    }
    Load(records);
  }

  void Load(const std::vector<TraceRecord>& records) {
    std::vector<absl::flat_hash_set<uint64_t>> held(GetFlags().workers);
    std::vector<uint32_t> tokens;
    std::vector<uint64_t> local, engine;
    for (size_t i = 0; i < records.size(); ++i) {
      ExpandTokensInto(records[i], kBlockSize, tokens);
      ComputeLocalBlockHashesInto(tokens, kBlockSize, {}, local);
      ComputeSequenceHashesInto(local, engine);
      const uint32_t w = static_cast<uint32_t>(i % GetFlags().workers);
      // Trace ids are chained: what a worker holds of a prompt is a leading run.
      size_t first_new = 0;
      while (first_new < engine.size() && held[w].contains(engine[first_new])) ++first_new;
      if (first_new < engine.size()) {
        StoredEvent stored{.block_hashes = {engine.begin() + first_new, engine.end()},
                           .local_hashes = {local.begin() + first_new, local.end()}};
        if (first_new > 0) stored.parent_hash = engine[first_new - 1];
        auto applied = router_->ApplyEvent(
            KvEvent{.worker = {.worker_id = w}, .event_id = i, .data = std::move(stored)});
        if (!applied.ok() || !applied->ok()) throw std::runtime_error("trace event rejected");
        held[w].insert(engine.begin() + first_new, engine.end());
      }
      if (queries_.size() < kMaxQueries && local.size() >= kQueryBlocks) {
        queries_.emplace_back(tokens.begin(), tokens.begin() + kQueryBlocks * kBlockSize);
        std::vector<uint64_t> ids;
        ComputeTrackingIdsInto(std::span(local).first(kQueryBlocks), ids);
        sequences_.push_back(std::move(ids));
      }
    }
  }

  std::unique_ptr<Router> router_;
  std::vector<std::vector<uint32_t>> queries_;
  std::vector<std::vector<uint64_t>> sequences_;
};

// Request ids prepared up front so formatting them is not timed; they cycle, and the in-flight
// window is far smaller than the cycle, so an id is always free again when it comes back.
std::vector<std::string> RequestIds(size_t n) {
  std::vector<std::string> ids;
  ids.reserve(n);
  for (size_t i = 0; i < n; ++i) ids.push_back("request-" + std::to_string(i));
  return ids;
}

// Admitted decisions on `router` over `queries`, `in_flight` of them kept booked.
void RunDecisions(benchmark::State& state, Router& router,
                  const std::vector<std::vector<uint32_t>>& queries, size_t in_flight) {
  if (queries.empty()) {
    state.SkipWithError("no trace prompt has 512 blocks");
    return;
  }
  const auto ids = RequestIds(4096);
  std::deque<size_t> booked;
  std::vector<uint32_t> prompt;
  std::vector<double> find_latency, free_latency;
  size_t q = 0, next_id = 0;
  double cached_tokens = 0;
  uint64_t allocations = 0, faulting_calls = 0, slow_calls = 0, slow_with_fault = 0;
  for (auto _ : state) {
    // The prompt is copied into a reused buffer before the clock starts, as a request's tokens
    // are in cache right after they were decoded.
    prompt.assign(queries[q].begin(), queries[q].end());
    const size_t id = next_id;
    const RouteOptions options{.with_admission = true, .request_id = ids[id]};
    const uint64_t allocations_before = t_allocations;
    const long faults_before = MinorFaults();
    const auto start = SteadyTime::now();
    auto decision = router.FindBestMatch(prompt, options);
    const double spent = Seconds(SteadyTime::now() - start);
    allocations += t_allocations - allocations_before;
    const bool faulted = MinorFaults() != faults_before;
    faulting_calls += faulted;
    if (spent > kSlowCall) {
      ++slow_calls;
      slow_with_fault += faulted;
    }
    if (!decision.ok()) {
      state.SkipWithError(std::string(decision.status().message()).c_str());
      break;
    }
    state.SetIterationTime(spent);
    find_latency.push_back(spent);
    cached_tokens += static_cast<double>(decision->cached_tokens);
    booked.push_back(id);
    while (booked.size() > in_flight) {
      const auto free_start = SteadyTime::now();
      router.Free(ids[booked.front()]);
      free_latency.push_back(Seconds(SteadyTime::now() - free_start));
      booked.pop_front();
    }
    q = (q + 1) % queries.size();
    next_id = (next_id + 1) % ids.size();
  }
  for (size_t id : booked) router.Free(ids[id]);
  ReportLatency(state, find_latency);
  ReportLatency(state, free_latency, "free_");
  state.counters["cached_tokens"] = cached_tokens / static_cast<double>(state.iterations());
  state.counters["allocs_per_call"] =
      static_cast<double>(allocations) / static_cast<double>(state.iterations());
  const double calls = static_cast<double>(state.iterations());
  state.counters["faulting_per_1k"] = 1000.0 * static_cast<double>(faulting_calls) / calls;
  state.counters["slow_per_1k"] = 1000.0 * static_cast<double>(slow_calls) / calls;
  state.counters["slow_faulting_per_1k"] = 1000.0 * static_cast<double>(slow_with_fault) / calls;
}

void BM_FindBestMatch(benchmark::State& state) {
  TraceRouter& trace = TraceRouter::Get();
  RunDecisions(state, trace.router(), trace.queries(), static_cast<size_t>(state.range(0)));
}

// (e) BM_FindBestMatchApprox/budget:N — as (a) with 0 in flight, in approximate mode (no KV
//     events: every admitted decision is recorded as cached, for 120 s), the index's budget
//     N (worker, block) entries: the trace's 1,024 prompts over 64 workers need far more, so
//     the budget binds and every decision also prunes. Warmed up with 4,096 decisions first.
void BM_FindBestMatchApprox(benchmark::State& state) {
  RouterOptions options;
  options.block_size = kBlockSize;
  options.random_seed = 1;
  options.use_kv_events = false;
  options.approx_max_blocks = static_cast<uint64_t>(state.range(0));
  auto router = Router::Create(options);
  if (!router.ok()) {
    state.SkipWithError(std::string(router.status().message()).c_str());
    return;
  }
  for (uint32_t w = 0; w < GetFlags().workers; ++w) {
    (void)(*router)->AddWorker(
        WorkerConfig{.worker_id = w, .max_num_batched_tokens = 16384, .block_size = kBlockSize});
  }
  const auto& queries = TraceRouter::Get().queries();
  for (size_t i = 0; i < 4096 && !queries.empty(); ++i) {
    const std::string id = "warm-" + std::to_string(i);
    (void)(*router)->FindBestMatch(queries[i % queries.size()],
                                   RouteOptions{.with_admission = true, .request_id = id});
    (*router)->Free(id);
  }
  RunDecisions(state, **router, queries, 0);
  state.counters["tracked_blocks"] = static_cast<double>((*router)->IndexStats().cached_blocks);
}

void BM_FindBestMatchPreview(benchmark::State& state) {
  TraceRouter& trace = TraceRouter::Get();
  const auto& queries = trace.queries();
  if (queries.empty()) {
    state.SkipWithError("no trace prompt has 512 blocks");
    return;
  }
  std::vector<uint32_t> prompt;
  std::vector<double> latency;
  size_t q = 0;
  uint64_t allocations = 0;
  for (auto _ : state) {
    prompt.assign(queries[q].begin(), queries[q].end());
    const uint64_t allocations_before = t_allocations;
    const auto start = SteadyTime::now();
    auto decision = trace.router().FindBestMatch(prompt, {});
    const double spent = Seconds(SteadyTime::now() - start);
    allocations += t_allocations - allocations_before;
    benchmark::DoNotOptimize(decision);
    state.SetIterationTime(spent);
    latency.push_back(spent);
    q = (q + 1) % queries.size();
  }
  ReportLatency(state, latency);
  state.counters["allocs_per_call"] =
      static_cast<double>(allocations) / static_cast<double>(state.iterations());
}

void BM_ActiveSequencesAddFree(benchmark::State& state) {
  const auto& sequences = TraceRouter::Get().query_sequences();
  if (sequences.empty()) {
    state.SkipWithError("no trace prompt has 512 blocks");
    return;
  }
  const size_t in_flight = static_cast<size_t>(state.range(0));
  ManualClock clock;
  ActiveSequences active(clock);
  const uint32_t workers = GetFlags().workers;
  for (uint32_t w = 0; w < workers; ++w) active.AddWorker(WorkerKey{.worker_id = w});
  const auto ids = RequestIds(4096);
  std::deque<size_t> booked;
  size_t q = 0, next_id = 0;
  for (auto _ : state) {
    const absl::Status status = active.AddRequest(
        SequenceRequest{.request_id = ids[next_id],
                        .worker = WorkerKey{.worker_id = static_cast<uint32_t>(q % workers)},
                        .block_ids = sequences[q],
                        .prefill_tokens = kQueryBlocks * kBlockSize});
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      break;
    }
    booked.push_back(next_id);
    while (booked.size() > in_flight) {
      active.Free(ids[booked.front()]);
      booked.pop_front();
    }
    q = (q + 1) % sequences.size();
    next_id = (next_id + 1) % ids.size();
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["active_blocks"] = static_cast<double>(active.TotalActiveBlocks());
}

void BM_RouterAddRequestFree(benchmark::State& state) {
  TraceRouter& trace = TraceRouter::Get();
  const auto& queries = trace.queries();
  if (queries.empty()) {
    state.SkipWithError("no trace prompt has 512 blocks");
    return;
  }
  const uint32_t workers = GetFlags().workers;
  size_t q = 0;
  for (auto _ : state) {
    const WorkerKey worker{.worker_id = static_cast<uint32_t>(q % workers)};
    const absl::Status status = trace.router().AddRequest("pinned", queries[q], worker);
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      break;
    }
    trace.router().Free("pinned");
    q = (q + 1) % queries.size();
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_FindBestMatchThreads(benchmark::State& state) {
  TraceRouter& trace = TraceRouter::Get();
  const auto& queries = trace.queries();
  if (queries.empty()) {
    state.SkipWithError("no trace prompt has 512 blocks");
    return;
  }
  std::vector<std::string> ids = RequestIds(4096);
  for (std::string& id : ids) id.insert(0, "t" + std::to_string(state.thread_index()) + "-");
  size_t q = queries.size() * state.thread_index() / state.threads(), next_id = 0;
  const Router::Counters start = trace.router().counters();
  for (auto _ : state) {
    const RouteOptions options{.with_admission = true, .request_id = ids[next_id]};
    auto decision = trace.router().FindBestMatch(queries[q], options);
    if (!decision.ok()) {
      state.SkipWithError(std::string(decision.status().message()).c_str());
      break;
    }
    trace.router().Free(ids[next_id]);
    q = (q + 1) % queries.size();
    next_id = (next_id + 1) % ids.size();
  }
  state.SetItemsProcessed(state.iterations());
  // How often a caller's winner changed while it priced (decided again under the gate), per
  // 1,000 decisions of every thread while this one ran.
  if (state.thread_index() == 0) {
    const Router::Counters end = trace.router().counters();
    const double decisions = static_cast<double>(end.decisions - start.decisions);
    state.counters["priced_again_per_1k"] =
        decisions > 0
            ? 1000.0 *
                  static_cast<double>(end.decisions_priced_again - start.decisions_priced_again) /
                  decisions
            : 0;
  }
}

BENCHMARK(BM_FindBestMatch)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->ArgName("inflight")
    ->Arg(0)
    ->Arg(256);
BENCHMARK(BM_FindBestMatchPreview)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_FindBestMatchApprox)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->ArgName("budget")
    ->Arg(1 << 16)
    ->Arg(1 << 20);
BENCHMARK(BM_ActiveSequencesAddFree)
    ->Unit(benchmark::kMicrosecond)
    ->ArgName("inflight")
    ->Arg(0)
    ->Arg(256);
BENCHMARK(BM_RouterAddRequestFree)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_FindBestMatchThreads)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->Threads(1)
    ->Threads(2)
    ->Threads(4);  // more callers than this machine's cores: the gate's spinning must not hurt

}  // namespace
}  // namespace kvrouter::bench

int main(int argc, char** argv) { return kvrouter::bench::RunBenchmarks(argc, argv); }

// kvr_soak: the router fed a Mooncake trace in a loop, for a bounded time, through its C ABI,
// with the churn of a real fleet: every request admitted, its prompt's blocks stored by the
// chosen worker (the replay simulator's prefix cache: LRU eviction, the removals published),
// its prefill completed and the request freed a few requests later; every loop of the trace is new
// content (its tokens salted with the loop number), so the index keeps turning over; a worker
// leaves and comes back (its cache lost) every few hundred requests. The process's resident memory
// and the library's own figure of the index's heap bytes are sampled as it runs. After a warm-up,
// both must stay within a tolerance of their warm-up peak: memory is bounded and reclaimed.
//
//   kvr_soak [--seconds N] [--warmup-seconds N] [--sample-seconds N] [--tolerance-percent P]
//            [--trace FILE]
//
// Prints one line per sample and a verdict; exits 1 if memory grew past the tolerance.
// scripts/soak.sh runs it for long; ctest runs a short one (label `soak`). Figures:
// docs/testing.md.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvrouter.h"
#include "replay/kv_cache.h"
#include "replay/trace/mooncake_trace.h"

namespace {

constexpr uint32_t kBlockSize = 16;
constexpr uint64_t kWorkers = 8;
constexpr size_t kCacheBlocks = 8192;  // per worker: 131,072 tokens
constexpr size_t kInFlight = 32;       // requests booked at once
constexpr size_t kChurnEvery = 500;    // requests between a worker leaving and coming back

struct Options {
  double seconds = 60;
  double warmup_seconds = -1;  // default: a quarter of the run
  double sample_seconds = 5;
  double tolerance_percent = 10;
  std::string trace = KVR_SOAK_DEFAULT_TRACE;
};

[[noreturn]] void Die(const char* what, kvr_status status, kvr_error* err) {
  std::fprintf(stderr, "kvr_soak: %s: %s: %s\n", what, kvr_status_str(status),
               kvr_error_message(err));
  std::exit(2);
}

// `err` by address: it is read after the call that fills it (an argument's value could be
// taken before the call in the same argument list runs).
void Check(kvr_status status, const char* what, kvr_error** err) {
  if (status != KVR_OK) Die(what, status, *err);
  kvr_error_free(*err);
  *err = nullptr;
}

Options ParseOptions(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--seconds") {
      o.seconds = std::atof(value);
    } else if (flag == "--warmup-seconds") {
      o.warmup_seconds = std::atof(value);
    } else if (flag == "--sample-seconds") {
      o.sample_seconds = std::atof(value);
    } else if (flag == "--tolerance-percent") {
      o.tolerance_percent = std::atof(value);
    } else if (flag == "--trace") {
      o.trace = value;
    } else {
      std::fprintf(stderr, "kvr_soak: unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  if (o.warmup_seconds < 0) o.warmup_seconds = o.seconds / 4;
  return o;
}

uint64_t ResidentBytes() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr || std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
  if (f != nullptr) std::fclose(f);
  return static_cast<uint64_t>(resident) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

class Soak {
 public:
  explicit Soak(const Options& options) : options_(options) {
    kvr_router_options ro;
    kvr_router_options_init(&ro, sizeof ro);
    ro.block_size = kBlockSize;
    kvr_error* err = nullptr;
    Check(kvr_router_new(&ro, &router_, &err), "kvr_router_new", &err);
    for (uint64_t id = 1; id <= kWorkers; ++id) AddWorker(id);
    caches_.resize(kWorkers + 1);
    for (auto& cache : caches_) cache.emplace(kCacheBlocks);
    records_ = kvrouter::trace::LoadTrace(options.trace);
  }
  ~Soak() { kvr_router_free(router_); }

  int Run() {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const auto elapsed = [&] {
      return std::chrono::duration<double>(Clock::now() - start).count();
    };
    double next_sample = 0;
    uint64_t warm_rss = 0, warm_index = 0, last_rss = 0, last_index = 0;
    std::printf("%8s %10s %6s %12s %12s %10s %8s\n", "seconds", "requests", "loop", "rss_MiB",
                "index_MiB", "blocks", "active");
    for (;;) {
      Step();
      if (elapsed() < next_sample) continue;
      const kvr_metrics m = Metrics();
      last_rss = ResidentBytes();
      last_index = static_cast<uint64_t>(m.index_bytes);
      std::printf("%8.0f %10llu %6llu %12.1f %12.1f %10llu %8llu\n", elapsed(),
                  static_cast<unsigned long long>(requests_),
                  static_cast<unsigned long long>(loop_), last_rss / 1048576.0,
                  last_index / 1048576.0, static_cast<unsigned long long>(m.index_blocks),
                  static_cast<unsigned long long>(m.requests_active));
      std::fflush(stdout);
      if (elapsed() <= options_.warmup_seconds) {
        warm_rss = std::max(warm_rss, last_rss);
        warm_index = std::max(warm_index, last_index);
      }
      if (elapsed() >= options_.seconds) break;
      next_sample += options_.sample_seconds;
    }
    const double limit = 1 + options_.tolerance_percent / 100;
    const bool flat = last_rss <= warm_rss * limit && last_index <= warm_index * limit;
    std::printf(
        "soak: %s: %llu requests in %.0f s (%llu loops of the trace); resident %.1f MiB at the "
        "end, %.1f MiB at the warm-up peak (%+.1f %%); index %.1f MiB, %.1f MiB (%+.1f %%); "
        "tolerance %.0f %%\n",
        flat ? "flat" : "GREW", static_cast<unsigned long long>(requests_), elapsed(),
        static_cast<unsigned long long>(loop_), last_rss / 1048576.0, warm_rss / 1048576.0,
        100.0 * (static_cast<double>(last_rss) / warm_rss - 1), last_index / 1048576.0,
        warm_index / 1048576.0, 100.0 * (static_cast<double>(last_index) / warm_index - 1),
        options_.tolerance_percent);
    return flat ? 0 : 1;
  }

 private:
  void AddWorker(uint64_t id) {
    kvr_worker_config config;
    kvr_worker_config_init(&config, sizeof config);
    config.worker_id = id;
    config.total_kv_blocks = kCacheBlocks;
    kvr_error* err = nullptr;
    Check(kvr_router_add_worker(router_, &config, &err), "kvr_router_add_worker", &err);
  }

  kvr_metrics Metrics() {
    kvr_metrics m;
    kvr_metrics_init(&m, sizeof m);
    kvr_error* err = nullptr;
    Check(kvr_router_get_metrics(router_, &m, &err), "kvr_router_get_metrics", &err);
    return m;
  }

  // One request of the trace: routed and booked, stored by its worker, completed, and freed
  // once kInFlight newer requests are booked.
  void Step() {
    if (next_record_ == records_.size()) {
      next_record_ = 0;
      ++loop_;
    }
    const kvrouter::trace::TraceRecord& record = records_[next_record_++];
    kvrouter::trace::ExpandTokensInto(record, kBlockSize, tokens_);
    for (uint32_t& t : tokens_) t ^= static_cast<uint32_t>(loop_) * 0x9e3779b9u;
    tokens_.resize(tokens_.size() / kBlockSize * kBlockSize);
    if (tokens_.empty()) return;

    const std::string id = "soak-" + std::to_string(requests_++);
    kvr_request_options ro;
    kvr_request_options_init(&ro, sizeof ro);
    ro.flags = KVR_REQUEST_ADMIT;
    ro.request_id = id.c_str();
    ro.expected_output_tokens = static_cast<uint32_t>(record.output_length);
    kvr_route_result result;
    kvr_route_result_init(&result, sizeof result);
    kvr_error* err = nullptr;
    Check(kvr_find_best_match(router_, tokens_.data(), tokens_.size(), &ro, &result, nullptr, 0,
                              nullptr, &err),
          "kvr_find_best_match", &err);
    StoreOnWorker(result.worker_id);
    Check(kvr_router_mark_prefill_completed(router_, id.c_str(), &err),
          "kvr_router_mark_prefill_completed", &err);
    in_flight_.push_back(id);
    if (in_flight_.size() > kInFlight) {
      Check(kvr_router_free_request(router_, in_flight_.front().c_str(), &err),
            "kvr_router_free_request", &err);
      in_flight_.pop_front();
    }
    if (requests_ % kChurnEvery == 0) Churn();
  }

  // The worker's engine stores the blocks it did not hold and evicts what no longer fits.
  void StoreOnWorker(uint64_t worker) {
    hashes_.resize(tokens_.size() / kBlockSize);
    size_t n = 0;
    kvr_error* err = nullptr;
    Check(kvr_compute_block_hashes(tokens_.data(), tokens_.size(), kBlockSize, nullptr,
                                   hashes_.data(), hashes_.size(), &n, &err),
          "kvr_compute_block_hashes", &err);
    engine_.resize(n);
    Check(kvr_compute_sequence_hashes(hashes_.data(), n, engine_.data(), n, &n, &err),
          "kvr_compute_sequence_hashes", &err);
    // As vLLM's block pool does: the prompt's cached prefix is reused, room for the rest is
    // made by evicting least recently used blocks (published first), then the rest is stored.
    kvrouter::replay::PrefixCache& cache = *caches_[worker];
    const std::span<const uint64_t> prompt(engine_);
    const size_t hits = cache.MatchPrefix(prompt);
    if (hits == prompt.size() || !cache.CanAdmit(prompt.first(hits), prompt.size() - hits)) return;
    cache.Acquire(prompt.first(hits));
    evicted_.clear();
    cache.AllocatePrivate(prompt.size() - hits, evicted_);
    for (uint64_t block : prompt.subspan(hits)) cache.Commit(block);
    cache.Release(prompt, 0);
    if (!evicted_.empty()) {
      kvr_removed_event removed;
      kvr_removed_event_init(&removed, sizeof removed);
      removed.worker_id = worker;
      removed.block_hashes = evicted_.data();
      removed.num_blocks = evicted_.size();
      Check(kvr_router_apply_removed(router_, &removed, &err), "kvr_router_apply_removed", &err);
    }
    kvr_stored_event stored;
    kvr_stored_event_init(&stored, sizeof stored);
    stored.worker_id = worker;
    if (hits > 0) {
      stored.flags = KVR_STORED_HAS_PARENT;
      stored.parent_hash = engine_[hits - 1];
    }
    stored.block_hashes = engine_.data() + hits;
    stored.num_blocks = engine_.size() - hits;
    stored.local_hashes = hashes_.data() + hits;
    Check(kvr_router_apply_stored(router_, &stored, &err), "kvr_router_apply_stored", &err);
  }

  // A worker leaves (its requests and index entries go with it) and comes back empty.
  void Churn() {
    const uint64_t worker = 1 + (requests_ / kChurnEvery) % kWorkers;
    kvr_error* err = nullptr;
    Check(kvr_router_remove_worker(router_, worker, &err), "kvr_router_remove_worker", &err);
    caches_[worker].emplace(kCacheBlocks);
    AddWorker(worker);
  }

  Options options_;
  kvr_router* router_ = nullptr;
  std::vector<kvrouter::trace::TraceRecord> records_;
  std::vector<std::optional<kvrouter::replay::PrefixCache>> caches_;  // by worker id
  std::deque<std::string> in_flight_;
  std::vector<uint32_t> tokens_;
  std::vector<uint64_t> hashes_, engine_, evicted_;
  size_t next_record_ = 0;
  uint64_t requests_ = 0, loop_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  const Options options = ParseOptions(argc, argv);
  return Soak(options).Run();
}

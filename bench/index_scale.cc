// How the KV index scales with the number of cached (block, worker) entries (issue 18 point 5;
// results and the workload's rationale in docs/scale.md).
//
// Builds an index through the public C ABI only (kvr_router_new, kvr_router_add_worker,
// kvr_router_apply_stored / kvr_router_apply_removed) for W workers, growing it to a target
// number of entries, and at each checkpoint (1 M, 2 M, 5 M, 10 M, 20 M, 50 M, 100 M, ...) prints
// one table row: entries, tree nodes, kvr_metrics.index_bytes, the process's VmRSS, bytes per
// entry, the apply rate over the last interval, lookup latency on fresh prompts of the same
// distribution, and the rate of a steady-state churn (new requests stored while the oldest
// unique tails are removed, so the entry count stays put).
//
// The workload (docs/scale.md, "The workload", says why these numbers): every prompt is
//   system prompt (one of --sys_prompts, 32 blocks) + shared document (Zipf over --docs,
//   64..448 blocks) + unique tail (16..928 blocks), then 0..--output_blocks_max generated blocks,
// at block size 16: on average 32 + 256 + 472 = 760 prompt blocks (12 k tokens, Mooncake's
// conversation mean), 38 % of them shared (Mooncake's infinite-cache bound is 37 %). A request
// goes to a uniformly random worker, which publishes what is new to it as vLLM does: the system
// prompt and the document if it does not hold them yet, the tail in prefill chunks of
// --chunk_blocks, and each generated block in an event of its own. Churn evicts whole tails,
// deepest block first, in removed events of --remove_blocks blocks (vLLM: one per block).
//
// Flags (--name=value): workers, shards, threads (appliers: thread t applies the workers with
// id mod threads = t, which with shards a multiple of threads never share a tree), max_entries,
// max_rss_gib (stop before the process passes it), min_avail_gib (stop when the machine's
// MemAvailable falls below it), lookups, churn_requests, seed, trim (1: malloc_trim(0) at each
// checkpoint, printing the RSS after it), and the workload's shape above.
#include <kvrouter.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// ---- Flags ----------------------------------------------------------------------------------

struct Flags {
  uint32_t workers = 1000;
  uint32_t shards = 1;
  uint32_t threads = 1;
  uint64_t max_entries = 100'000'000;
  double max_rss_gib = 8.5;
  double min_avail_gib = 3.0;
  uint32_t lookups = 2000;
  uint32_t churn_requests = 4000;
  uint64_t seed = 42;
  uint32_t sys_prompts = 4;
  uint32_t sys_blocks = 32;
  uint32_t docs = 200'000;
  double doc_zipf = 1.0;
  uint32_t doc_blocks_min = 64, doc_blocks_max = 448;
  uint32_t tail_blocks_min = 16, tail_blocks_max = 928;
  uint32_t output_blocks_max = 42;  // uniform 0..max: mean 21 blocks = 336 tokens (Mooncake 343)
  uint32_t chunk_blocks = 128;      // 2,048-token prefill chunks
  uint32_t remove_blocks = 1;
  uint32_t trim = 0;  // 1: malloc_trim(0) at each checkpoint, after reading RSS (docs/scale.md)
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  std::map<std::string, double*> reals = {{"max_rss_gib", &f.max_rss_gib},
                                          {"min_avail_gib", &f.min_avail_gib},
                                          {"doc_zipf", &f.doc_zipf}};
  std::map<std::string, uint32_t*> ints = {{"workers", &f.workers},
                                           {"shards", &f.shards},
                                           {"threads", &f.threads},
                                           {"lookups", &f.lookups},
                                           {"churn_requests", &f.churn_requests},
                                           {"sys_prompts", &f.sys_prompts},
                                           {"sys_blocks", &f.sys_blocks},
                                           {"docs", &f.docs},
                                           {"doc_blocks_min", &f.doc_blocks_min},
                                           {"doc_blocks_max", &f.doc_blocks_max},
                                           {"tail_blocks_min", &f.tail_blocks_min},
                                           {"tail_blocks_max", &f.tail_blocks_max},
                                           {"output_blocks_max", &f.output_blocks_max},
                                           {"chunk_blocks", &f.chunk_blocks},
                                           {"remove_blocks", &f.remove_blocks},
                                           {"trim", &f.trim}};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      std::fprintf(stderr, "bad flag %s (want --name=value)\n", argv[i]);
      std::exit(2);
    }
    const std::string name = arg.substr(2, eq - 2), value = arg.substr(eq + 1);
    if (name == "max_entries") {
      f.max_entries = static_cast<uint64_t>(std::stod(value));
    } else if (name == "seed") {
      f.seed = std::stoull(value);
    } else if (reals.count(name)) {
      *reals[name] = std::stod(value);
    } else if (ints.count(name)) {
      *ints[name] = static_cast<uint32_t>(std::stoul(value));
    } else {
      std::fprintf(stderr, "unknown flag --%s\n", name.c_str());
      std::exit(2);
    }
  }
  f.threads = std::max(1u, f.threads);
  f.remove_blocks = std::max(1u, f.remove_blocks);
  f.chunk_blocks = std::max(1u, f.chunk_blocks);
  return f;
}

// ---- Memory ---------------------------------------------------------------------------------

// A "Name:   123 kB" line of a /proc file, in GiB (0 if absent).
double ProcGiB(const char* file, const char* name) {
  std::ifstream in(file);
  std::string line;
  const size_t n = std::strlen(name);
  while (std::getline(in, line)) {
    if (line.compare(0, n, name) == 0) return std::stod(line.substr(n)) / (1024.0 * 1024.0);
  }
  return 0;
}
double RssGiB() { return ProcGiB("/proc/self/status", "VmRSS:"); }
double AvailGiB() { return ProcGiB("/proc/meminfo", "MemAvailable:"); }

// Where RSS beyond the index's own byte count goes: glibc's view of the heap (bytes in use,
// including per-allocation headers; bytes freed but kept; mmapped blocks).
void PrintMalloc(double entries) {
  const struct mallinfo2 mi = mallinfo2();
  const double mib = 1024.0 * 1024.0;
  std::fprintf(stderr,
               "# malloc at %.2f M entries: in use %.0f MiB, free in heap %.0f MiB, mmapped %.0f "
               "MiB\n",
               entries / 1e6, mi.uordblks / mib, mi.fordblks / mib, mi.hblkhd / mib);
}

// ---- Hashes ---------------------------------------------------------------------------------

// splitmix64's finaliser over two words: content hashes that never collide in practice.
uint64_t Mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0xBF58476D1CE4E5B9ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A segment's blocks: local hashes from its content (kind, id, position), engine hashes chained
// from the parent's as an engine chains them, so the same prefix has the same engine hashes on
// every worker.
struct Blocks {
  std::vector<uint64_t> local, engine;
};

void AppendSegment(uint64_t kind, uint64_t id, uint32_t length, uint64_t parent, Blocks& out) {
  uint64_t prev = parent;
  for (uint32_t j = 0; j < length; ++j) {
    const uint64_t local = Mix(Mix(kind, id), j);
    prev = Mix(prev, local);
    out.local.push_back(local);
    out.engine.push_back(prev);
  }
}

constexpr uint64_t kSys = 1, kDoc = 2, kTail = 3;

// ---- The workload ---------------------------------------------------------------------------

// A prompt: which system prompt and document it starts with, and its unique tail.
struct Prompt {
  uint32_t sys = 0;
  uint32_t doc = 0;
  uint32_t doc_blocks = 0;
  uint64_t tail_id = 0;
  uint32_t tail_blocks = 0;
  uint32_t output_blocks = 0;
};

// What a worker holds, so that it publishes only blocks new to it, and the tails it may evict.
struct Tail {
  uint64_t id;
  uint64_t parent;  // engine hash of the document's last block
  uint32_t blocks;  // prompt tail + generated blocks
};
struct WorkerState {
  uint64_t id = 0;
  uint64_t sys_held = 0;  // bit s: holds system prompt s
  std::unordered_set<uint32_t> docs;
  std::deque<Tail> tails;
  uint64_t entries = 0;
};

class Workload {
 public:
  explicit Workload(const Flags& f) : f_(f) {
    // Zipf CDF over documents: a few are in every other prompt, most in almost none.
    doc_cdf_.resize(f.docs);
    double sum = 0;
    for (uint32_t k = 0; k < f.docs; ++k) doc_cdf_[k] = sum += std::pow(k + 1.0, -f.doc_zipf);
    for (double& c : doc_cdf_) c /= sum;
  }

  Prompt Draw(std::mt19937_64& rng, uint64_t tail_id) const {
    std::uniform_real_distribution<double> u(0, 1);
    Prompt p;
    p.doc = static_cast<uint32_t>(std::lower_bound(doc_cdf_.begin(), doc_cdf_.end(), u(rng)) -
                                  doc_cdf_.begin());
    p.doc = std::min(p.doc, f_.docs - 1);
    p.sys = p.doc % f_.sys_prompts;  // a document always follows the same system prompt
    p.doc_blocks =
        f_.doc_blocks_min +
        static_cast<uint32_t>(Mix(kDoc, p.doc) % (f_.doc_blocks_max - f_.doc_blocks_min + 1));
    p.tail_id = tail_id;
    p.tail_blocks =
        std::uniform_int_distribution<uint32_t>(f_.tail_blocks_min, f_.tail_blocks_max)(rng);
    p.output_blocks = std::uniform_int_distribution<uint32_t>(0, f_.output_blocks_max)(rng);
    return p;
  }

  // The prompt's blocks, and with `with_output` the generated blocks after them (they continue
  // the unique tail, so the prompt's blocks are a prefix of these).
  Blocks PromptBlocks(const Prompt& p, bool with_output = false) const {
    Blocks b;
    AppendSegment(kSys, p.sys, f_.sys_blocks, 0, b);
    AppendSegment(kDoc, p.doc, p.doc_blocks, b.engine.back(), b);
    AppendSegment(kTail, p.tail_id, p.tail_blocks + (with_output ? p.output_blocks : 0),
                  b.engine.back(), b);
    return b;
  }

  const Flags& flags() const { return f_; }

 private:
  const Flags& f_;
  std::vector<double> doc_cdf_;
};

// ---- Events ---------------------------------------------------------------------------------

// One event to apply: a store (with parent, or none) or a removal, over a slice of `blocks`.
struct Event {
  uint64_t worker;
  bool removed;
  bool has_parent;
  uint64_t parent;
  size_t first, count;  // into EventBuffer::blocks
};

// Events generated ahead of applying them, so the apply loop times nothing but the library.
struct EventBuffer {
  Blocks blocks;
  std::vector<Event> events;
  uint64_t stored = 0, removed = 0;

  void Clear() {
    blocks.local.clear();
    blocks.engine.clear();
    events.clear();
    stored = removed = 0;
  }
  // Stores `count` blocks of `segment` from `first`, chained to `parent`, in events of `chunk`.
  void Store(uint64_t worker, const Blocks& segment, size_t first, size_t count, bool has_parent,
             uint64_t parent, uint32_t chunk) {
    for (size_t done = 0; done < count; done += chunk) {
      const size_t n = std::min<size_t>(chunk, count - done), at = blocks.local.size();
      for (size_t i = first + done; i < first + done + n; ++i) {
        blocks.local.push_back(segment.local[i]);
        blocks.engine.push_back(segment.engine[i]);
      }
      events.push_back({worker, false, has_parent || done > 0,
                        done > 0 ? segment.engine[first + done - 1] : parent, at, n});
      stored += n;
    }
  }
  // Removes a tail's blocks deepest first, `per_event` hashes per event (vLLM: one).
  void Remove(uint64_t worker, const Tail& t, uint32_t per_event) {
    Blocks tail;
    AppendSegment(kTail, t.id, t.blocks, t.parent, tail);
    for (size_t end = t.blocks; end > 0;) {
      const size_t n = std::min<size_t>(per_event, end), at = blocks.engine.size();
      for (size_t i = end; i > end - n; --i) {
        blocks.engine.push_back(tail.engine[i - 1]);
        blocks.local.push_back(0);
      }
      events.push_back({worker, true, false, 0, at, n});
      removed += n;
      end -= n;
    }
  }
};

// Appends the events a worker publishes when it serves `p`: what is new to it.
void ServeRequest(const Workload& wl, const Prompt& p, WorkerState& w, EventBuffer& out) {
  const Flags& f = wl.flags();
  const Blocks all = wl.PromptBlocks(p, /*with_output=*/true);
  const uint32_t tail_start = f.sys_blocks + p.doc_blocks;
  const uint32_t prompt_blocks = tail_start + p.tail_blocks;
  if (!(w.sys_held >> p.sys & 1)) {
    out.Store(w.id, all, 0, f.sys_blocks, false, 0, f.chunk_blocks);
    w.sys_held |= uint64_t{1} << p.sys;
    w.entries += f.sys_blocks;
  }
  if (w.docs.insert(p.doc).second) {
    out.Store(w.id, all, f.sys_blocks, p.doc_blocks, true, all.engine[f.sys_blocks - 1],
              f.chunk_blocks);
    w.entries += p.doc_blocks;
  }
  out.Store(w.id, all, tail_start, p.tail_blocks, true, all.engine[tail_start - 1], f.chunk_blocks);
  // Decode: one event per generated block.
  out.Store(w.id, all, prompt_blocks, p.output_blocks, true, all.engine[prompt_blocks - 1], 1);
  w.tails.push_back({p.tail_id, all.engine[tail_start - 1], p.tail_blocks + p.output_blocks});
  w.entries += p.tail_blocks + p.output_blocks;
}

// Evicts the worker's oldest tails until it holds no more than `target` entries.
void EvictTo(WorkerState& w, uint64_t target, uint32_t per_event, EventBuffer& out) {
  while (w.entries > target && !w.tails.empty()) {
    out.Remove(w.id, w.tails.front(), per_event);
    w.entries -= w.tails.front().blocks;
    w.tails.pop_front();
  }
}

// ---- Applying -------------------------------------------------------------------------------

void Check(kvr_status s, kvr_error* err, const char* what) {
  if (s == KVR_OK) return;
  std::fprintf(stderr, "%s: status %d: %s\n", what, s, kvr_error_message(err));
  std::exit(1);
}

// Applies the buffer's events; returns the seconds spent inside the library.
double Apply(kvr_router* router, const EventBuffer& buf) {
  kvr_stored_event stored;
  kvr_stored_event_init(&stored, sizeof stored);
  kvr_removed_event removed;
  kvr_removed_event_init(&removed, sizeof removed);
  kvr_error* err = nullptr;
  const auto start = Clock::now();
  for (const Event& e : buf.events) {
    kvr_status s;
    if (e.removed) {
      removed.worker_id = e.worker;
      removed.block_hashes = buf.blocks.engine.data() + e.first;
      removed.num_blocks = e.count;
      s = kvr_router_apply_removed(router, &removed, &err);
    } else {
      stored.worker_id = e.worker;
      stored.flags = e.has_parent ? KVR_STORED_HAS_PARENT : 0;
      stored.parent_hash = e.parent;
      stored.block_hashes = buf.blocks.engine.data() + e.first;
      stored.local_hashes = buf.blocks.local.data() + e.first;
      stored.num_blocks = e.count;
      s = kvr_router_apply_stored(router, &stored, &err);
    }
    Check(s, err, e.removed ? "apply_removed" : "apply_stored");
  }
  return Seconds(Clock::now() - start);
}

// One applier: its own workers (id mod threads = its index), generator and request ids.
struct Applier {
  std::vector<WorkerState> workers;
  std::mt19937_64 rng;
  uint64_t next_tail = 0;
  uint32_t index = 0, threads = 1;
  uint64_t entries = 0;
  // Interval counters.
  uint64_t events = 0, stored = 0, removed = 0;
  double apply_seconds = 0;

  WorkerState& Pick() {
    return workers[std::uniform_int_distribution<size_t>(0, workers.size() - 1)(rng)];
  }
  uint64_t NewTailId() { return next_tail++ * threads + index; }
  void Account(const EventBuffer& buf, double seconds) {
    events += buf.events.size();
    stored += buf.stored;
    removed += buf.removed;
    entries += buf.stored;
    entries -= buf.removed;
    apply_seconds += seconds;
  }
};

constexpr int kRequestsPerBatch = 32;

// Set when the process passes --max_rss_gib while growing: every applier stops.
std::atomic<bool> g_stop{false};

// Grows the applier's share of the index to `target` entries (or until the RSS cap).
void Grow(kvr_router* router, const Workload& wl, Applier& a, uint64_t target, double max_rss) {
  EventBuffer buf;
  for (uint64_t batch = 0; a.entries < target && !g_stop; ++batch) {
    if (batch % 256 == 0 && RssGiB() > max_rss) g_stop = true;
    buf.Clear();
    for (int r = 0; r < kRequestsPerBatch; ++r) {
      ServeRequest(wl, wl.Draw(a.rng, a.NewTailId()), a.Pick(), buf);
    }
    a.Account(buf, Apply(router, buf));
  }
}

// Steady state: each new request's worker evicts old tails back to its previous size.
void Churn(kvr_router* router, const Workload& wl, Applier& a, uint32_t requests) {
  EventBuffer buf;
  for (uint32_t done = 0; done < requests; done += kRequestsPerBatch) {
    buf.Clear();
    for (int r = 0; r < kRequestsPerBatch; ++r) {
      WorkerState& w = a.Pick();
      const uint64_t before = w.entries;
      ServeRequest(wl, wl.Draw(a.rng, a.NewTailId()), w, buf);
      EvictTo(w, before, wl.flags().remove_blocks, buf);
    }
    a.Account(buf, Apply(router, buf));
  }
}

// Runs `fn(applier)` on one thread per applier and waits for all.
template <typename Fn>
void OnEveryApplier(std::vector<Applier>& appliers, Fn fn) {
  if (appliers.size() == 1) return fn(appliers[0]);
  std::vector<std::thread> threads;
  for (Applier& a : appliers) threads.emplace_back([&fn, &a] { fn(a); });
  for (std::thread& t : threads) t.join();
}

// Rates over an interval: blocks over the slowest applier's time inside the library (the
// appliers apply concurrently).
struct Rates {
  double events_per_s = 0, stored_per_s = 0, removed_per_s = 0, wall_s = 0;
};
Rates TakeRates(std::vector<Applier>& appliers, double wall_s) {
  uint64_t events = 0, stored = 0, removed = 0;
  double seconds = 0;
  for (Applier& a : appliers) {
    events += a.events;
    stored += a.stored;
    removed += a.removed;
    seconds = std::max(seconds, a.apply_seconds);
    a.events = a.stored = a.removed = 0;
    a.apply_seconds = 0;
  }
  if (seconds <= 0) return {.wall_s = wall_s};
  return {events / seconds, stored / seconds, removed / seconds, wall_s};
}

// ---- Lookups --------------------------------------------------------------------------------

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * v.size()));
  std::nth_element(v.begin(), v.begin() + static_cast<ptrdiff_t>(k), v.end());
  return v[k];
}

struct LookupStats {
  double find_p50_us = 0, find_p99_us = 0, overlap_p50_us = 0, overlap_p99_us = 0;
  double mean_prompt_blocks = 0, mean_ranks = 0;
};

// Fresh prompts of the same distribution (their tails are new: only the shared prefix hits),
// looked up with the index walk alone (kvr_router_find_matches) and with the cost figures
// (kvr_router_overlap_scores_hashed), alternating so both see the same machine state.
LookupStats MeasureLookups(kvr_router* router, const Workload& wl, uint32_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<kvr_match> matches(wl.flags().workers + 16);
  std::vector<kvr_overlap> overlaps(wl.flags().workers + 16);
  std::vector<double> find_us, overlap_us;
  LookupStats s;
  kvr_error* err = nullptr;
  for (uint32_t i = 0; i < count; ++i) {
    const Blocks b = wl.PromptBlocks(wl.Draw(rng, ~uint64_t{0} - i));
    size_t len = 0;
    auto t0 = Clock::now();
    Check(kvr_router_find_matches(router, b.local.data(), b.local.size(), matches.data(),
                                  matches.size(), &len, &err),
          err, "find_matches");
    auto t1 = Clock::now();
    Check(kvr_router_overlap_scores_hashed(router, b.local.data(), b.local.size(), nullptr,
                                           overlaps.data(), overlaps.size(), &len, &err),
          err, "overlap_scores_hashed");
    auto t2 = Clock::now();
    find_us.push_back(Seconds(t1 - t0) * 1e6);
    overlap_us.push_back(Seconds(t2 - t1) * 1e6);
    s.mean_prompt_blocks += static_cast<double>(b.local.size()) / count;
    s.mean_ranks += static_cast<double>(len) / count;
  }
  s.find_p50_us = Percentile(find_us, 0.5);
  s.find_p99_us = Percentile(find_us, 0.99);
  s.overlap_p50_us = Percentile(overlap_us, 0.5);
  s.overlap_p99_us = Percentile(overlap_us, 0.99);
  return s;
}

// ---- The run --------------------------------------------------------------------------------

kvr_router* NewRouter(const Flags& f) {
  kvr_router_options opts;
  kvr_router_options_init(&opts, sizeof opts);
  opts.block_size = 16;
  opts.index_shards = f.shards;
  kvr_router* router = nullptr;
  kvr_error* err = nullptr;
  Check(kvr_router_new(&opts, &router, &err), err, "router_new");
  for (uint32_t w = 0; w < f.workers; ++w) {
    kvr_worker_config cfg;
    kvr_worker_config_init(&cfg, sizeof cfg);
    cfg.worker_id = w;
    Check(kvr_router_add_worker(router, &cfg, &err), err, "add_worker");
  }
  return router;
}

std::vector<Applier> MakeAppliers(const Flags& f) {
  std::vector<Applier> appliers(f.threads);
  for (uint32_t t = 0; t < f.threads; ++t) {
    appliers[t].index = t;
    appliers[t].threads = f.threads;
    appliers[t].rng.seed(f.seed * 1000 + t);
  }
  for (uint32_t w = 0; w < f.workers; ++w) appliers[w % f.threads].workers.push_back({.id = w});
  return appliers;
}

// 1, 2, 5 × 10^k up to max.
std::vector<uint64_t> Checkpoints(uint64_t max) {
  std::vector<uint64_t> out;
  for (uint64_t decade = 1'000'000; decade <= max; decade *= 10) {
    for (uint64_t m : {1, 2, 5}) {
      if (m * decade <= max) out.push_back(m * decade);
    }
  }
  return out;
}

void PrintHeader(const Flags& f) {
  std::printf("# index_scale: workers %u, index_shards %u, apply threads %u, remove_blocks %u\n",
              f.workers, f.shards, f.threads, f.remove_blocks);
  std::printf(
      "| entries | nodes | index MiB | RSS MiB | B/entry (index) | B/entry (RSS) | build s | "
      "apply events/s | apply entries/s | find p50/p99 us | overlap p50/p99 us | ranks matched | "
      "churn events/s | churn blocks/s (stored+removed) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  const Workload wl(f);
  const double rss0 = RssGiB();  // the generator's tables, not the index
  kvr_router* router = NewRouter(f);
  std::vector<Applier> appliers = MakeAppliers(f);
  PrintHeader(f);
  const auto start = Clock::now();
  const std::vector<uint64_t> targets = Checkpoints(f.max_entries);
  for (size_t i = 0; i < targets.size(); ++i) {
    const uint64_t target = targets[i];
    const auto t0 = Clock::now();
    OnEveryApplier(appliers,
                   [&](Applier& a) { Grow(router, wl, a, target / f.threads, f.max_rss_gib); });
    const Rates grow = TakeRates(appliers, Seconds(Clock::now() - t0));

    kvr_metrics m;
    kvr_metrics_init(&m, sizeof m);
    kvr_error* err = nullptr;
    Check(kvr_router_get_metrics(router, &m, &err), err, "get_metrics");
    const double rss = RssGiB();
    PrintMalloc(static_cast<double>(m.index_blocks));
    if (f.trim) {
      malloc_trim(0);  // gives the free pages inside the heap back to the system
      std::fprintf(stderr, "# RSS after malloc_trim: %.0f MiB\n", RssGiB() * 1024);
    }
    const LookupStats look = MeasureLookups(router, wl, f.lookups, f.seed + target);

    const auto t1 = Clock::now();
    OnEveryApplier(appliers,
                   [&](Applier& a) { Churn(router, wl, a, f.churn_requests / f.threads); });
    const Rates churn = TakeRates(appliers, Seconds(Clock::now() - t1));

    const double mib = 1024.0 * 1024.0;
    std::printf(
        "| %.2f M | %.1f k | %.0f | %.0f | %.1f | %.1f | %.1f | %.0f k | %.2f M | %.0f / %.0f | "
        "%.0f / %.0f | %.0f | %.0f k | %.2f M |\n",
        m.index_blocks / 1e6, m.index_nodes / 1e3, m.index_bytes / mib, rss * 1024,
        static_cast<double>(m.index_bytes) / m.index_blocks,
        (rss - rss0) * 1024 * mib / m.index_blocks, Seconds(Clock::now() - start),
        grow.events_per_s / 1e3, grow.stored_per_s / 1e6, look.find_p50_us, look.find_p99_us,
        look.overlap_p50_us, look.overlap_p99_us, look.mean_ranks, churn.events_per_s / 1e3,
        (churn.stored_per_s + churn.removed_per_s) / 1e6);
    std::fflush(stdout);
    std::fprintf(stderr, "# %.2f M entries: mean prompt %.0f blocks, MemAvailable %.1f GiB\n",
                 m.index_blocks / 1e6, look.mean_prompt_blocks, AvailGiB());
    // Stop before the next checkpoint could pass the caps: memory grows about as the entries.
    const double next_rss = rss0 + (rss - rss0) * (i + 1 < targets.size() ? targets[i + 1] : 0) /
                                       static_cast<double>(m.index_blocks);
    if (g_stop || next_rss > f.max_rss_gib || AvailGiB() - (next_rss - rss) < f.min_avail_gib) {
      std::printf(
          "# stopped%s: the next checkpoint would need about %.1f GiB RSS (cap %.1f), "
          "%.1f GiB available\n",
          g_stop ? " (RSS cap reached while growing)" : "", next_rss, f.max_rss_gib, AvailGiB());
      break;
    }
  }
  kvr_router_free(router);
  return 0;
}

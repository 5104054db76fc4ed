// What the trace-driven benchmarks share: their extra command-line flags, latency percentiles
// reported as counters, and main().
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "replay/trace/mooncake_trace.h"

namespace kvrouter::bench {

// Extra flags, stripped before Google Benchmark parses the rest:
//   --trace=PATH        Mooncake JSONL trace (default: the shared conversation trace)
//   --trace_requests=N  load only the first N requests (default 0 = all)
//   --workers=N         workers the trace is spread over (default 64)
struct TraceFlags {
  std::string trace_path = trace::DefaultConversationTracePath();
  size_t trace_requests = 0;
  uint32_t workers = 64;
};

inline TraceFlags& GetFlags() {
  static TraceFlags flags;
  return flags;
}

inline double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Nearest-rank percentile of `samples` (reordered).
inline double Percentile(std::vector<double>& samples, double p) {
  if (samples.empty()) return 0;
  const size_t k = std::min(samples.size() - 1, static_cast<size_t>(p * samples.size()));
  std::nth_element(samples.begin(), samples.begin() + static_cast<ptrdiff_t>(k), samples.end());
  return samples[k];
}

// Per-call latencies (seconds) as p50_us / p99_us counters, optionally prefixed.
inline void ReportLatency(benchmark::State& state, std::vector<double>& seconds,
                          const std::string& prefix = "") {
  state.counters[prefix + "p50_us"] = Percentile(seconds, 0.50) * 1e6;
  state.counters[prefix + "p99_us"] = Percentile(seconds, 0.99) * 1e6;
  state.counters[prefix + "p999_us"] = Percentile(seconds, 0.999) * 1e6;
}

// Removes the TraceFlags from argv so Google Benchmark does not reject them.
inline void ParseTraceFlags(int& argc, char** argv) {
  auto value = [](const char* arg, const char* name) -> const char* {
    const size_t n = std::strlen(name);
    return std::strncmp(arg, name, n) == 0 ? arg + n : nullptr;
  };
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (const char* v = value(argv[i], "--trace=")) {
      GetFlags().trace_path = v;
    } else if (const char* v = value(argv[i], "--trace_requests=")) {
      GetFlags().trace_requests = std::stoull(v);
    } else if (const char* v = value(argv[i], "--workers=")) {
      GetFlags().workers = std::max<uint32_t>(1, static_cast<uint32_t>(std::stoul(v)));
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
}

inline int RunBenchmarks(int argc, char** argv) {
  ParseTraceFlags(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace kvrouter::bench

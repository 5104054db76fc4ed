#include "replay/replay_command.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "replay/fleet_sim.h"
#include "replay/progress.h"
#include "replay/report.h"
#include "replay/trace_source.h"

namespace kvrouter::replay {
namespace {

void Validate(const ReplayArgs& args) {
  if (args.trace.empty()) throw std::invalid_argument("--trace is required");
  if (ParseTransport(args.transport) == Transport::kNats && args.nats_url.empty()) {
    throw std::invalid_argument(
        "--transport nats needs --nats_url, a NATS server's (e.g. nats://127.0.0.1:4222)");
  }
  if (args.gateways == 0) throw std::invalid_argument("--gateways must be at least 1");
  if (args.workers == 0) throw std::invalid_argument("--workers must be at least 1");
  if (args.block_size == 0 || trace::kMooncakeBlockTokens % args.block_size != 0) {
    throw std::invalid_argument("--block_size must divide 512 (the trace block), got " +
                                std::to_string(args.block_size));
  }
  ParseTimeScales(args.time_scales);  // throws for a bad list
  if (!(args.temperature >= 0)) throw std::invalid_argument("--temperature must be >= 0");
  if (args.max_num_batched_tokens == 0 || args.max_num_seqs == 0) {
    throw std::invalid_argument("--max_num_batched_tokens and --max_num_seqs must be > 0");
  }
  if (args.azure_shared_prefix_tokens % trace::kMooncakeBlockTokens != 0) {
    throw std::invalid_argument("--azure_shared_prefix_tokens must be a multiple of 512");
  }
  const CostModel& cost = args.cost;
  for (const auto& [flag, value] :
       {std::pair{"step_overhead_s", cost.step_overhead_s},
        {"prefill_per_token_s", cost.prefill_per_token_s},
        {"attention_per_pair_s", cost.attention_per_pair_s},
        {"decode_per_sequence_s", cost.decode_per_sequence_s},
        {"decode_per_context_token_s", cost.decode_per_context_token_s}}) {
    if (!std::isfinite(value) || value < 0) {
      throw std::invalid_argument(std::string("--") + flag + " must be finite and >= 0, got " +
                                  std::to_string(value));
    }
  }
  if (args.host_reload_per_block_s &&
      (!std::isfinite(*args.host_reload_per_block_s) || *args.host_reload_per_block_s < 0)) {
    throw std::invalid_argument("--host_reload_per_block_s must be finite and >= 0, got " +
                                std::to_string(*args.host_reload_per_block_s));
  }
  if (!std::isfinite(args.event_delay_ms) || args.event_delay_ms < 0) {
    throw std::invalid_argument("--event_delay_ms must be finite and >= 0, got " +
                                std::to_string(args.event_delay_ms));
  }
  if (!(args.event_loss >= 0 && args.event_loss <= 1)) {
    throw std::invalid_argument("--event_loss must be a probability in [0, 1], got " +
                                std::to_string(args.event_loss));
  }
  CheckRouterSettings(args.router, args.block_size);
}

ReplayConfig MakeConfig(const ReplayArgs& args, double time_scale) {
  ReplayConfig config;
  config.workers = args.workers;
  config.limits.block_size = args.block_size;
  config.limits.kv_capacity_blocks = args.kv_capacity_blocks > 0
                                         ? args.kv_capacity_blocks
                                         : kDefaultKvCapacityTokens / args.block_size;
  config.limits.max_num_batched_tokens = args.max_num_batched_tokens;
  config.limits.max_num_seqs = args.max_num_seqs;
  config.limits.host_capacity_blocks = args.host_capacity_blocks;
  config.limits.preemption = args.preemption;
  config.cost = args.cost;
  config.cost.host_reload_per_block_s =
      args.host_reload_per_block_s.value_or(kHostReloadPerTokenS * args.block_size);
  config.time_scale = time_scale;
  config.seed = args.seed;
  config.transport = {.kind = ParseTransport(args.transport), .nats_url = args.nats_url};
  config.gateways = args.gateways;
  config.replica_sync = args.replica_sync;
  config.router = args.router;
  config.event_delay_s = args.event_delay_ms / 1000.0;
  config.event_loss = args.event_loss;
  return config;
}

struct RunOutcome {
  std::vector<PolicyResult> results;  // of the runs that completed, scale by scale, in order
  std::vector<PolicyFailure> failures;
};

// Runs every policy at every load (one config each), `jobs` runs at a time. A run that throws
// is recorded as failed, with its policy and load; the others go on.
RunOutcome RunAll(const std::vector<trace::TraceRecord>& trace,
                  const std::vector<PolicySpec>& policies, const std::vector<ReplayConfig>& configs,
                  uint32_t jobs, ProgressCounter& progress, const PolicyRunner& run_policy) {
  const size_t runs = policies.size() * configs.size();
  std::vector<PolicyResult> results(runs);
  std::vector<std::string> errors(runs);
  std::vector<bool> failed(runs, false);
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < runs;) {
      try {
        results[i] = run_policy(trace, policies[i % policies.size()], configs[i / policies.size()],
                                &progress);
      } catch (const std::exception& e) {
        failed[i] = true;
        errors[i] = e.what();
      } catch (...) {
        failed[i] = true;
        errors[i] = "unknown exception";
      }
    }
  };
  std::vector<std::thread> threads;
  const size_t count = std::min<size_t>(jobs, runs);
  for (size_t t = 1; t < count; ++t) threads.emplace_back(worker);
  worker();
  for (std::thread& thread : threads) thread.join();
  RunOutcome outcome;
  for (size_t i = 0; i < runs; ++i) {
    if (failed[i]) {
      outcome.failures.push_back({.policy = policies[i % policies.size()].name,
                                  .error = errors[i],
                                  .time_scale = configs[i / policies.size()].time_scale});
    } else {
      outcome.results.push_back(std::move(results[i]));
    }
  }
  return outcome;
}

uint32_t ResolveJobs(uint32_t jobs) {
  if (jobs > 0) return jobs;
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

std::vector<double> ParseTimeScales(const std::string& list) {
  std::vector<double> scales;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    double scale = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(part), &scale) || !std::isfinite(scale) ||
        !(scale > 0)) {
      throw std::invalid_argument("--time_scale: \"" + std::string(part) +
                                  "\" is not a finite number > 0");
    }
    scales.push_back(scale);
  }
  if (scales.empty()) throw std::invalid_argument("--time_scale: no value in \"" + list + "\"");
  std::sort(scales.begin(), scales.end());
  if (std::adjacent_find(scales.begin(), scales.end()) != scales.end()) {
    throw std::invalid_argument("--time_scale: \"" + list + "\" repeats a value");
  }
  return scales;
}

int RunReplay(const ReplayArgs& args, std::ostream& out, std::ostream& err,
              const PolicyRunner& run_policy) {
  try {
    Validate(args);
    const TraceFormat format = ResolveTraceFormat(args.format, args.trace);
    const AzurePrefixOptions azure{.groups = args.azure_shared_prefix_groups,
                                   .prefix_tokens = args.azure_shared_prefix_tokens,
                                   .seed = args.seed};
    std::vector<trace::TraceRecord> trace =
        LoadReplayTrace(args.trace, format, azure, args.max_requests);
    const size_t rejected = RejectOverContext(trace, args.max_model_len);
    if (trace.empty()) {
      throw std::invalid_argument("every request's prompt is longer than --max_model_len " +
                                  std::to_string(args.max_model_len));
    }
    const std::vector<PolicySpec> policies =
        ParsePolicies(args.policies, args.temperature, args.temperatures);
    const std::vector<double> time_scales = ParseTimeScales(args.time_scales);
    std::vector<ReplayConfig> configs;
    for (double scale : time_scales) configs.push_back(MakeConfig(args, scale));
    const ReplayConfig& config = configs.front();
    CheckCapacity(trace, config.limits);

    RunInfo info;
    info.trace = args.trace;
    info.format = format == TraceFormat::kMooncake ? "mooncake" : "azure";
    info.requests = trace.size();
    info.rejected_requests = rejected;
    info.max_model_len = args.max_model_len;
    info.trace_span_s =
        static_cast<double>(trace.back().timestamp_ms - trace.front().timestamp_ms) / 1000.0;
    info.infinite_cache_hit_rate = InfiniteCacheHitRate(trace, args.block_size);
    info.config = config;
    info.time_scales = time_scales;
    for (const PolicySpec& policy : policies) info.policies.push_back(policy.name);

    ProgressCounter progress{0};
    RunOutcome outcome;
    {
      std::optional<ProgressBar> bar;
      if (args.progress) bar.emplace(progress, trace.size() * policies.size() * configs.size());
      outcome = RunAll(trace, policies, configs, ResolveJobs(args.jobs), progress, run_policy);
    }
    info.failures = outcome.failures;
    const std::vector<PolicyResult>& results = outcome.results;
    WriteConsoleTable(out, info, results);
    if (!args.output_dir.empty()) {
      const std::string png = WriteOutputDir(args.output_dir, info, results, args.plot, err);
      out << "\nwrote " << args.output_dir << "/{summary.txt,results.csv,results.json,"
          << "decision_latency.csv" << (png.empty() ? "" : ",replay.png") << "}\n";
    }
    for (const PolicyFailure& failure : outcome.failures) {
      err << "kvrouter replay: error: policy " << FailedRunName(info, failure) << ": "
          << failure.error << "\n";
    }
    return outcome.failures.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    err << "kvrouter replay: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace kvrouter::replay

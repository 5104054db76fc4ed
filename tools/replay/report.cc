#include "replay/report.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "kvrouter.h"

namespace kvrouter::replay {
namespace {

using Json = nlohmann::ordered_json;

double Mean(const std::vector<double>& values) {
  if (values.empty()) return 0;
  return std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
}

double Ratio(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : static_cast<double>(part) / static_cast<double>(whole);
}

bool IsSweep(const RunInfo& info) { return info.time_scales.size() > 1; }

// "1, 1.5, 2"
std::string ScalesText(const std::vector<double>& scales) {
  std::string text;
  for (double scale : scales) text += (text.empty() ? "" : ", ") + absl::StrFormat("%g", scale);
  return text;
}

// The results of one load, in the order the policies were given.
std::vector<const PolicyResult*> At(const std::vector<PolicyResult>& results, double scale) {
  std::vector<const PolicyResult*> at;
  for (const PolicyResult& result : results) {
    if (result.time_scale == scale) at.push_back(&result);
  }
  return at;
}

const PolicyResult* Find(const std::vector<PolicyResult>& results, const std::string& policy,
                         double scale) {
  for (const PolicyResult& result : results) {
    if (result.name == policy && result.time_scale == scale) return &result;
  }
  return nullptr;
}

// The scenario in a few words, for the plot's title.
std::string Scenario(const RunInfo& info) {
  const ReplayConfig& c = info.config;
  return absl::StrFormat(
      "%s, %d requests, %d workers x %d KV blocks of %d tokens, time scale%s %s, seed %d",
      std::filesystem::path(info.trace).filename().string(), info.requests, c.workers,
      c.limits.kv_capacity_blocks, c.limits.block_size, IsSweep(info) ? "s" : "",
      ScalesText(info.time_scales), c.seed);
}

// The kvrouter policies' router options as the routers get them.
kvr_router_options EffectiveRouterOptions(const RouterSettings& settings) {
  kvr_router_options options;
  kvr_router_options_init(&options, sizeof options);
  ApplyRouterSettings(settings, options);
  return options;
}

std::string QueueThresholdText(const kvr_router_options& o) {
  return o.queue_threshold < 0 ? "off" : absl::StrFormat("%g", o.queue_threshold);
}

void WriteHeader(std::ostream& out, const RunInfo& info) {
  const ReplayConfig& c = info.config;
  const kvr_router_options r = EffectiveRouterOptions(c.router);
  const CostModel& m = c.cost;
  out << absl::StrFormat(
      "kvrouter replay: %s (%s), %d requests over %.0f s, time scale%s %s, seed %d\n"
      "fleet: %d workers, each %d KV blocks x %d tokens, max %d batched tokens, max %d seqs\n"
      "step: %g ms + %g us/prefill token + %g ns/attention pair + %g us/decoding seq + %g "
      "ns/context token\n"
      "router: overlap credit %g, prefill load scale %g, credit decay %g, decode request weight "
      "%g, queue threshold %s%s%s; kvrouter-ttft miss weight %g\n"
      "%s%s%s%s%s"
      "bound: one infinite cache shared by all workers would hit %.1f %% of prompt tokens\n\n",
      std::filesystem::path(info.trace).filename().string(), info.format, info.requests,
      info.trace_span_s, IsSweep(info) ? "s" : "", ScalesText(info.time_scales), c.seed, c.workers,
      c.limits.kv_capacity_blocks, c.limits.block_size, c.limits.max_num_batched_tokens,
      c.limits.max_num_seqs, m.step_overhead_s * 1e3, m.prefill_per_token_s * 1e6,
      m.attention_per_pair_s * 1e9, m.decode_per_sequence_s * 1e6,
      m.decode_per_context_token_s * 1e9, r.overlap_score_credit, r.prefill_load_scale,
      r.overlap_score_credit_decay, r.decode_active_request_weight, QueueThresholdText(r),
      c.router.assume_kv_reuse ? "" : ", no KV reuse",
      c.router.track_prefill_tokens ? "" : ", no prefill tracking", r.ttft_miss_weight,
      c.gateways > 1 ? absl::StrFormat("gateways: %d router replicas per kvrouter policy, replica "
                                       "sync %s\n",
                                       c.gateways, c.replica_sync ? "on" : "off")
                     : "",
      info.max_model_len > 0
          ? absl::StrFormat("context: %d tokens; %d requests with longer prompts rejected (not "
                            "replayed)\n",
                            info.max_model_len, info.rejected_requests)
          : "",
      c.limits.host_capacity_blocks > 0
          ? absl::StrFormat("host tier: %d KV blocks per worker, reload %g us/block, router host "
                            "hit weight %g\n",
                            c.limits.host_capacity_blocks, m.host_reload_per_block_s * 1e6,
                            r.host_cache_hit_weight)
          : "",
      c.event_delay_s > 0 || c.event_loss > 0
          ? absl::StrFormat("KV events: reach the router %g ms after the engine's change; %g %% "
                            "lost\n",
                            c.event_delay_s * 1e3, 100 * c.event_loss)
          : "",
      c.limits.preemption ? "preemption: on (vLLM-style: output KV blocks allocated as decoding "
                            "goes; out of blocks, the newest running request is preempted and "
                            "recomputed)\n"
                          : "",
      100 * info.infinite_cache_hit_rate);
}

constexpr const char* kRowFormat = "%-17s %7.1f %% %12.2f %10.3f %8.3f %8.3f %10.3f %8.3f %10.2f";

// One load's table: column heads and a row per policy.
void WriteRows(std::ostream& out, const std::vector<const PolicyResult*>& results,
               bool with_latency) {
  std::string head1 =
      absl::StrFormat("%-17s %9s %12s %10s %8s %8s %10s %8s %10s", "policy", "hit rate", "prefill",
                      "TTFT mean", "p50", "p99", "E2E mean", "p99", "imbalance");
  std::string head2 = absl::StrFormat("%-17s %9s %12s %10s %8s %8s %10s %8s %10s", "", "(tokens)",
                                      "saved (M)", "(s)", "(s)", "(s)", "(s)", "(s)", "(max/mean)");
  if (with_latency) {
    head1 += absl::StrFormat(" | %9s %8s", "decision", "p99");
    head2 += absl::StrFormat(" | %9s %8s", "p50 (us)", "(us)");
  }
  out << head1 << "\n" << head2 << "\n";
  for (const PolicyResult* result : results) {
    const PolicyMetrics m = ComputeMetrics(*result);
    out << absl::StrFormat(kRowFormat, result->name, 100 * m.hit_rate,
                           static_cast<double>(m.prefill_saved_tokens) / 1e6, m.ttft_mean,
                           m.ttft_p50, m.ttft_p99, m.e2e_mean, m.e2e_p99, m.load_imbalance);
    if (with_latency) {
      out << absl::StrFormat(" | %9.1f %8.1f", m.decision_p50_us, m.decision_p99_us);
    }
    out << "\n";
  }
}

// The sweep: per policy, hit rate, TTFT mean and p99 at each load.
void WriteSweep(std::ostream& out, const RunInfo& info, const std::vector<PolicyResult>& results) {
  out << "load sweep: hit rate, TTFT mean and TTFT p99 of each policy at each time scale\n";
  std::string head1 = absl::StrFormat("%-17s", "");
  std::string head2 = absl::StrFormat("%-17s", "policy");
  for (double scale : info.time_scales) {
    head1 += absl::StrFormat(" | %-26s", absl::StrFormat("time scale %g", scale));
    head2 += absl::StrFormat(" | %8s %9s %7s", "hit rate", "mean (s)", "p99 (s)");
  }
  out << absl::StripTrailingAsciiWhitespace(head1) << "\n" << head2 << "\n";
  for (const std::string& policy : info.policies) {
    out << absl::StrFormat("%-17s", policy);
    for (double scale : info.time_scales) {
      const PolicyResult* result = Find(results, policy, scale);
      if (result == nullptr) {
        out << absl::StrFormat(" | %8s %9s %7s", "FAILED", "-", "-");
        continue;
      }
      const PolicyMetrics m = ComputeMetrics(*result);
      out << absl::StrFormat(" | %6.1f %% %9.3f %7.2f", 100 * m.hit_rate, m.ttft_mean, m.ttft_p99);
    }
    out << "\n";
  }
}

void WriteTable(std::ostream& out, const RunInfo& info, const std::vector<PolicyResult>& results,
                bool with_latency) {
  WriteHeader(out, info);
  const bool sweep = IsSweep(info);
  for (double scale : info.time_scales) {
    if (sweep) out << absl::StrFormat("time scale %g:\n", scale);
    WriteRows(out, At(results, scale), with_latency);
    if (sweep) out << "\n";
  }
  if (sweep) WriteSweep(out, info, results);
  for (const PolicyResult& result : results) {
    if (result.temperature > 0 && result.time_scale == info.time_scales.front()) {
      out << absl::StrFormat("\n%s: router temperature %g.", result.name, result.temperature);
    }
  }
  for (const PolicyResult& result : results) {
    if (result.queued_requests > 0) {
      out << absl::StrFormat("\n%s%s: %d requests waited in the router's queue.", result.name,
                             sweep ? absl::StrFormat(" at time scale %g", result.time_scale) : "",
                             result.queued_requests);
    }
  }
  for (const PolicyResult& result : results) {
    if (result.preemptions > 0) {
      out << absl::StrFormat(
          "\n%s%s: %d preemption%s (vLLM-style); %d tokens prefilled again.", result.name,
          sweep ? absl::StrFormat(" at time scale %g", result.time_scale) : "", result.preemptions,
          result.preemptions == 1 ? "" : "s", result.recompute_tokens);
    }
  }
  for (const PolicyFailure& failure : info.failures) {
    out << absl::StrFormat("\n%s: FAILED, no results: %s", FailedRunName(info, failure),
                           failure.error);
  }
  out << "\nhit rate: prompt tokens found in the worker's prefix cache at admission; imbalance: "
         "max/mean of prompt tokens computed per worker.\n";
  if (sweep) {
    out << "time scale: arrival speed-up over the trace (2 = the same requests in half the "
           "time).\n";
  }
  if (with_latency) {
    out << "decision: wall-clock time of the routing call (varies run to run; not in the "
           "deterministic files).\n";
  }
}

Json MetricsJson(const PolicyResult& result) {
  const PolicyMetrics m = ComputeMetrics(result);
  Json j;
  j["policy"] = result.name;
  j["time_scale"] = result.time_scale;
  if (result.temperature > 0) j["temperature"] = result.temperature;
  j["requests"] = result.requests;
  j["prompt_tokens"] = result.prompt_tokens;
  j["cache_hit_rate"] = m.hit_rate;
  j["prefill_tokens_saved"] = m.prefill_saved_tokens;
  j["host_hit_tokens"] = result.host_cached_tokens;
  j["prefill_tokens_computed"] = m.prefill_computed_tokens;
  if (m.predicted_hit_rate >= 0) j["router_predicted_hit_rate"] = m.predicted_hit_rate;
  j["requests_queued"] = result.queued_requests;
  j["ttft_s"] = {{"mean", m.ttft_mean}, {"p50", m.ttft_p50}, {"p99", m.ttft_p99}};
  j["e2e_s"] = {{"mean", m.e2e_mean}, {"p50", m.e2e_p50}, {"p99", m.e2e_p99}};
  j["load_imbalance_max_over_mean"] = m.load_imbalance;
  j["worker_prefill_tokens"] = result.worker_prefill_tokens;
  j["worker_requests"] = result.worker_requests;
  j["makespan_s"] = result.makespan_s;
  j["engine_steps"] = result.engine_steps;
  j["router_events"] = {{"stored", result.router.events_stored},
                        {"removed", result.router.events_removed},
                        {"rejected", result.router.events_rejected},
                        {"lost", result.events_lost}};
  if (result.preemption) {
    j["preemptions"] = result.preemptions;
    j["recompute_tokens"] = result.recompute_tokens;
  }
  return j;
}

// The TTFT distribution, sampled at 200 quantiles per run; one gnuplot data block each, load
// by load.
void WriteTtftCdf(std::ostream& out, const std::vector<PolicyResult>& results) {
  constexpr int kPoints = 200;
  for (const PolicyResult& result : results) {
    out << "# " << result.name << ", time scale " << absl::StrFormat("%g", result.time_scale)
        << ": ttft_s fraction\n";
    for (int i = 1; i <= kPoints; ++i) {
      const double p = static_cast<double>(i) / kPoints;
      out << absl::StrFormat("%.6f %.4f\n", Percentile(result.ttft_s, p), p);
    }
    out << "\n\n";
  }
}

// One gnuplot data block per policy (in the order given): a row per load it completed.
void WriteLoadData(std::ostream& out, const RunInfo& info,
                   const std::vector<PolicyResult>& results) {
  for (const std::string& policy : info.policies) {
    out << "# " << policy << ": policy time_scale hit_rate_percent ttft_mean_s ttft_p99_s\n";
    for (double scale : info.time_scales) {
      const PolicyResult* result = Find(results, policy, scale);
      if (result == nullptr) continue;
      const PolicyMetrics m = ComputeMetrics(*result);
      out << absl::StrFormat("%s %g %.4f %.6f %.6f\n", policy, scale, 100 * m.hit_rate, m.ttft_mean,
                             m.ttft_p99);
    }
    out << "\n\n";
  }
}

// One load: the TTFT distribution of each policy, and each policy's hit rate. A sweep: TTFT
// mean, TTFT p99 and hit rate of each policy against load. The title names the scenario.
void WriteGnuplotScript(std::ostream& out, const RunInfo& info,
                        const std::vector<PolicyResult>& results) {
  const bool sweep = IsSweep(info);
  const size_t policies = info.policies.size();
  out << "# Draws replay.png from " << (sweep ? "load.dat" : "ttft_cdf.dat and load.dat")
      << " (run: gnuplot replay.gp)\n"
      << absl::StrFormat("set terminal pngcairo noenhanced size %d,650 font 'sans,10'\n",
                         sweep ? 1800 : 1600)
      << "set output 'replay.png'\n"
      << absl::StrFormat("set multiplot layout 1,%d title 'kvrouter replay: %s'\n", sweep ? 3 : 2,
                         Scenario(info))
      << "set grid\n";
  // One plot command over the policies' blocks of load.dat: `column` against time scale.
  const auto plot_against_load = [&](int column) {
    out << "plot ";
    for (size_t i = 0; i < policies; ++i) {
      out << absl::StrFormat(
          "%s'load.dat' index %d using 2:%d with linespoints lw 2 pt 7 title '%s'",
          i == 0 ? "" : ", \\\n     ", i, column, info.policies[i]);
    }
    out << "\n";
  };
  if (sweep) {
    out << absl::StrFormat("set xrange [%g:%g]\nset offsets graph 0.04, graph 0.04, 0, 0\n",
                           info.time_scales.front(), info.time_scales.back())
        << "set xlabel 'time scale (arrival speed-up over the trace)'\n"
        << "set key top left\nset title 'TTFT mean against load'\n"
        << "set ylabel 'TTFT mean (s, log scale)'\nset logscale y\n";
    plot_against_load(4);
    out << "set title 'TTFT p99 against load'\nset ylabel 'TTFT p99 (s, log scale)'\n";
    plot_against_load(5);
    out << "unset logscale y\nset title 'prefix-cache hit rate against load'\n"
        << "set ylabel 'prompt tokens cached (%)'\nset yrange [0:*]\n";
    plot_against_load(3);
  } else {
    out << "set title 'TTFT distribution'\n"
           "set logscale x\nset xlabel 'time to first token (s, log scale)'\n"
           "set ylabel 'fraction of requests'\nset yrange [0:1]\n"
           "set key bottom right\n"
           "plot ";
    for (size_t i = 0; i < results.size(); ++i) {
      out << absl::StrFormat("%s'ttft_cdf.dat' index %d using 1:2 with lines lw 2 title '%s'",
                             i == 0 ? "" : ", \\\n     ", i, results[i].name);
    }
    out << "\n"
        << "unset logscale x\nset title 'prefix-cache hit rate (prompt tokens cached at "
           "admission)'\n"
        << "set xlabel ''\nset ylabel 'hit rate (%)'\nset yrange [0:*]\n"
        << absl::StrFormat("set xrange [-0.6:%g]\n", static_cast<double>(policies) - 0.4)
        << "set style fill solid 0.8 border -1\nset boxwidth 0.7\nset xtics rotate by -25\n"
           "unset key\n";
    out << "plot ";
    for (size_t i = 0; i < policies; ++i) {
      out << absl::StrFormat("%s'load.dat' index %d using (%d):3:xtic(1) with boxes lc %d",
                             i == 0 ? "" : ", \\\n     ", i, i, i + 1);
    }
    out << "\n";
  }
  out << "unset multiplot\n";
}

void WriteFile(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

template <typename Writer>
std::string Render(Writer writer) {
  std::ostringstream out;
  writer(out);
  return out.str();
}

bool GnuplotAvailable() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

std::string ShellQuote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

}  // namespace

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double rank = std::ceil(p * static_cast<double>(sorted.size()));
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, double(sorted.size()))) - 1;
  return sorted[index];
}

double MaxOverMean(const std::vector<uint64_t>& values) {
  if (values.empty()) return 0;
  const uint64_t total = std::accumulate(values.begin(), values.end(), uint64_t{0});
  if (total == 0) return 0;
  const double mean = static_cast<double>(total) / static_cast<double>(values.size());
  return static_cast<double>(*std::max_element(values.begin(), values.end())) / mean;
}

PolicyMetrics ComputeMetrics(const PolicyResult& result) {
  PolicyMetrics m;
  m.hit_rate = Ratio(result.cached_tokens, result.prompt_tokens);
  m.prefill_saved_tokens = result.cached_tokens;
  m.prefill_computed_tokens = result.prompt_tokens - result.cached_tokens;
  if (result.predicted_cached_tokens >= 0) {
    m.predicted_hit_rate =
        Ratio(static_cast<uint64_t>(result.predicted_cached_tokens), result.prompt_tokens);
  }
  m.ttft_mean = Mean(result.ttft_s);
  m.ttft_p50 = Percentile(result.ttft_s, 0.50);
  m.ttft_p99 = Percentile(result.ttft_s, 0.99);
  m.e2e_mean = Mean(result.e2e_s);
  m.e2e_p50 = Percentile(result.e2e_s, 0.50);
  m.e2e_p99 = Percentile(result.e2e_s, 0.99);
  m.load_imbalance = MaxOverMean(result.worker_prefill_tokens);
  m.decision_p50_us = Percentile(result.wall.decision_us, 0.50);
  m.decision_p99_us = Percentile(result.wall.decision_us, 0.99);
  return m;
}

std::string FailedRunName(const RunInfo& info, const PolicyFailure& failure) {
  if (!IsSweep(info)) return failure.policy;
  return absl::StrFormat("%s at time scale %g", failure.policy, failure.time_scale);
}

void WriteSummaryTable(std::ostream& out, const RunInfo& info,
                       const std::vector<PolicyResult>& results) {
  WriteTable(out, info, results, /*with_latency=*/false);
}

void WriteConsoleTable(std::ostream& out, const RunInfo& info,
                       const std::vector<PolicyResult>& results) {
  WriteTable(out, info, results, /*with_latency=*/true);
}

void WriteCsv(std::ostream& out, const std::vector<PolicyResult>& results) {
  out << "policy,time_scale,temperature,requests,prompt_tokens,cache_hit_rate,prefill_tokens_saved,"
         "prefill_tokens_computed,ttft_mean_s,ttft_p50_s,ttft_p99_s,e2e_mean_s,e2e_p50_s,"
         "e2e_p99_s,load_imbalance,makespan_s\n";
  for (const PolicyResult& r : results) {
    const PolicyMetrics m = ComputeMetrics(r);
    out << absl::StrFormat("%s,%g,%g,%d,%d,%.6f,%d,%d,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.3f\n",
                           r.name, r.time_scale, r.temperature, r.requests, r.prompt_tokens,
                           m.hit_rate, m.prefill_saved_tokens, m.prefill_computed_tokens,
                           m.ttft_mean, m.ttft_p50, m.ttft_p99, m.e2e_mean, m.e2e_p50, m.e2e_p99,
                           m.load_imbalance, r.makespan_s);
  }
}

void WriteJson(std::ostream& out, const RunInfo& info, const std::vector<PolicyResult>& results) {
  const ReplayConfig& c = info.config;
  Json j;
  j["trace"] = std::filesystem::path(info.trace).filename().string();
  j["format"] = info.format;
  j["requests"] = info.requests;
  j["requests_rejected"] = info.rejected_requests;
  j["trace_span_s"] = info.trace_span_s;
  j["infinite_cache_hit_rate"] = info.infinite_cache_hit_rate;
  j["config"] = {{"workers", c.workers},
                 {"block_size", c.limits.block_size},
                 {"kv_capacity_blocks", c.limits.kv_capacity_blocks},
                 {"max_num_batched_tokens", c.limits.max_num_batched_tokens},
                 {"max_num_seqs", c.limits.max_num_seqs},
                 {"max_model_len", info.max_model_len},
                 {"host_capacity_blocks", c.limits.host_capacity_blocks},
                 {"time_scales", info.time_scales},
                 {"seed", c.seed},
                 {"gateways", c.gateways},
                 {"replica_sync", c.replica_sync},
                 {"event_delay_ms", c.event_delay_s * 1e3},
                 {"event_loss", c.event_loss}};
  // Only when on, so that results without it stay as they were.
  if (c.limits.preemption) j["config"]["preemption"] = true;
  const kvr_router_options r = EffectiveRouterOptions(c.router);
  j["router"] = {{"overlap_score_credit", r.overlap_score_credit},
                 {"prefill_load_scale", r.prefill_load_scale},
                 {"overlap_score_credit_decay", r.overlap_score_credit_decay},
                 {"decode_active_request_weight", r.decode_active_request_weight},
                 {"host_cache_hit_weight", r.host_cache_hit_weight},
                 {"ttft_miss_weight", r.ttft_miss_weight},
                 {"queue_threshold", r.queue_threshold},
                 {"assume_kv_reuse", c.router.assume_kv_reuse},
                 {"track_prefill_tokens", c.router.track_prefill_tokens}};
  j["cost_model"] = {{"step_overhead_s", c.cost.step_overhead_s},
                     {"prefill_per_token_s", c.cost.prefill_per_token_s},
                     {"attention_per_pair_s", c.cost.attention_per_pair_s},
                     {"decode_per_sequence_s", c.cost.decode_per_sequence_s},
                     {"decode_per_context_token_s", c.cost.decode_per_context_token_s},
                     {"host_reload_per_block_s", c.cost.host_reload_per_block_s}};
  j["policies"] = Json::array();  // every run, load by load
  for (const PolicyResult& result : results) j["policies"].push_back(MetricsJson(result));
  if (IsSweep(info)) {
    // Per policy, its curve: the numbers of the sweep table.
    j["load_sweep"] = Json::array();
    for (const std::string& policy : info.policies) {
      Json points = Json::array();
      for (double scale : info.time_scales) {
        const PolicyResult* result = Find(results, policy, scale);
        if (result == nullptr) continue;
        const PolicyMetrics m = ComputeMetrics(*result);
        points.push_back({{"time_scale", scale},
                          {"cache_hit_rate", m.hit_rate},
                          {"ttft_mean_s", m.ttft_mean},
                          {"ttft_p99_s", m.ttft_p99}});
      }
      j["load_sweep"].push_back({{"policy", policy}, {"points", points}});
    }
  }
  if (!info.failures.empty()) {
    j["failed_policies"] = Json::array();
    for (const PolicyFailure& failure : info.failures) {
      j["failed_policies"].push_back({{"policy", failure.policy},
                                      {"time_scale", failure.time_scale},
                                      {"error", failure.error}});
    }
  }
  out << j.dump(2) << "\n";
}

void WriteDecisionLatencyCsv(std::ostream& out, const std::vector<PolicyResult>& results) {
  out << "# WALL-CLOCK measurements: they differ from run to run (excluded from determinism "
         "checks)\n";
  out << "policy,time_scale,decisions,decision_p50_us,decision_p99_us,decision_max_us,run_"
         "seconds\n";
  for (const PolicyResult& r : results) {
    const PolicyMetrics m = ComputeMetrics(r);
    out << absl::StrFormat("%s,%g,%d,%.3f,%.3f,%.3f,%.3f\n", r.name, r.time_scale,
                           r.wall.decision_us.size(), m.decision_p50_us, m.decision_p99_us,
                           r.wall.decision_us.empty() ? 0.0 : r.wall.decision_us.back(),
                           r.wall.run_seconds);
  }
}

std::string WriteOutputDir(const std::string& dir, const RunInfo& info,
                           const std::vector<PolicyResult>& results, bool plot, std::ostream& log) {
  const std::filesystem::path root(dir);
  std::filesystem::create_directories(root);
  WriteFile(root / "summary.txt",
            Render([&](std::ostream& o) { WriteSummaryTable(o, info, results); }));
  WriteFile(root / "results.csv", Render([&](std::ostream& o) { WriteCsv(o, results); }));
  WriteFile(root / "results.json", Render([&](std::ostream& o) { WriteJson(o, info, results); }));
  WriteFile(root / "decision_latency.csv",
            Render([&](std::ostream& o) { WriteDecisionLatencyCsv(o, results); }));
  WriteFile(root / "ttft_cdf.dat", Render([&](std::ostream& o) { WriteTtftCdf(o, results); }));
  WriteFile(root / "load.dat", Render([&](std::ostream& o) { WriteLoadData(o, info, results); }));
  WriteFile(root / "replay.gp",
            Render([&](std::ostream& o) { WriteGnuplotScript(o, info, results); }));
  if (!plot) return "";
  if (!GnuplotAvailable()) {
    log << "note: gnuplot not found; install gnuplot-nox for replay.png (data and script are in "
        << dir << ")\n";
    return "";
  }
  const std::string command = "cd " + ShellQuote(root.string()) + " && gnuplot replay.gp";
  if (std::system(command.c_str()) != 0) {
    log << "note: gnuplot failed; replay.png not drawn\n";
    return "";
  }
  return (root / "replay.png").string();
}

}  // namespace kvrouter::replay

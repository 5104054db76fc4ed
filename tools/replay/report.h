// Turning PolicyResults into what people read: the table, CSV, JSON and a gnuplot PNG.
//
// A run has one load (time scale) or several (a load sweep). Results come scale by scale, each
// scale's policies in the order given; with several scales the table of each is followed by
// the sweep's (TTFT mean, p99 and hit rate per policy against load) and the plot shows those
// curves instead of the TTFT distribution.
//
// Everything except the router decision latency is a pure function of the inputs and the seed,
// and is written so that equal runs give byte-identical files: summary.txt, results.csv,
// results.json, ttft_cdf.dat, load.dat, replay.gp. Decision latency is wall-clock: it
// appears only in the printed table's last columns and in decision_latency.csv.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "replay/fleet_sim.h"

namespace kvrouter::replay {

// The derived numbers of one policy.
struct PolicyMetrics {
  double hit_rate = 0;  // Σ cached prompt tokens / Σ prompt tokens
  uint64_t prefill_saved_tokens = 0;
  uint64_t prefill_computed_tokens = 0;
  double predicted_hit_rate = -1;  // the router's own estimate, -1 if none
  double ttft_mean = 0, ttft_p50 = 0, ttft_p99 = 0;
  double e2e_mean = 0, e2e_p50 = 0, e2e_p99 = 0;
  double load_imbalance = 0;  // max / mean of prefill tokens computed per worker
  double decision_p50_us = 0, decision_p99_us = 0;  // wall clock
};

// Nearest-rank percentile (p in [0, 1]) of sorted values; 0 for none.
double Percentile(const std::vector<double>& sorted, double p);
// max / mean; 0 when everything is 0.
double MaxOverMean(const std::vector<uint64_t>& values);

PolicyMetrics ComputeMetrics(const PolicyResult& result);

// A policy whose replay failed: no results, only the error.
struct PolicyFailure {
  std::string policy;
  std::string error;
  double time_scale = 1.0;  // the load it failed at
};

// What the report says about the run besides the policies.
struct RunInfo {
  std::string trace;
  std::string format;
  uint64_t requests = 0;           // replayed (the rejected ones are not)
  uint64_t max_model_len = 0;      // context limit; 0: none
  uint64_t rejected_requests = 0;  // prompt longer than max_model_len
  double trace_span_s = 0;
  double infinite_cache_hit_rate = 0;
  ReplayConfig config;                   // the first load's (the others differ in time_scale only)
  std::vector<double> time_scales{1.0};  // ascending; more than one: a load sweep
  std::vector<std::string> policies;     // names, in the order given
  std::vector<PolicyFailure> failures;   // listed after the table and in results.json
};

// "prefix-only", or in a sweep "prefix-only at time scale 2".
std::string FailedRunName(const RunInfo& info, const PolicyFailure& failure);

// The deterministic table (no decision latency).
void WriteSummaryTable(std::ostream& out, const RunInfo& info,
                       const std::vector<PolicyResult>& results);
// The table as printed: the summary plus the wall-clock decision latency columns.
void WriteConsoleTable(std::ostream& out, const RunInfo& info,
                       const std::vector<PolicyResult>& results);
void WriteCsv(std::ostream& out, const std::vector<PolicyResult>& results);
void WriteJson(std::ostream& out, const RunInfo& info, const std::vector<PolicyResult>& results);
void WriteDecisionLatencyCsv(std::ostream& out, const std::vector<PolicyResult>& results);

// Writes every file into `dir` (created if missing) and, with `plot`, runs gnuplot for
// replay.png when it is installed. Returns the PNG path, or "" if none was drawn (with a note on
// `log` when gnuplot is missing or fails).
std::string WriteOutputDir(const std::string& dir, const RunInfo& info,
                           const std::vector<PolicyResult>& results, bool plot, std::ostream& log);

}  // namespace kvrouter::replay

// kvrouter: the command-line tool. Subcommands:
//   kvrouter replay --trace=FILE [flags]   trace-driven fleet simulation (docs/replay.md)
//   kvrouter version                       the library's version
// Flags are Abseil flags; `--block-size` and `--block_size` are both accepted.
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "kvrouter.h"
#include "replay/replay_command.h"

ABSL_FLAG(std::string, trace, "", "Trace file: Mooncake JSONL or Azure LLM inference CSV");
ABSL_FLAG(std::string, format, "auto", "Trace format: mooncake, azure, or auto (by extension)");
ABSL_FLAG(uint32_t, workers, 8, "Simulated workers (engines)");
ABSL_FLAG(uint32_t, block_size, 16, "KV block size in tokens (must divide 512)");
ABSL_FLAG(uint64_t, kv_capacity_blocks, 0,
          "KV cache blocks per worker; 0 = 400k tokens / block size (H100 80GB, Llama-3.1-8B)");
ABSL_FLAG(uint32_t, max_num_batched_tokens, 8192, "Token budget of one engine step");
ABSL_FLAG(uint32_t, max_num_seqs, 256, "Running sequences per engine");
ABSL_FLAG(std::string, time_scale, "1",
          "Arrival speed-up: 2 replays the trace twice as fast. A comma list (1,1.5,2) is a load "
          "sweep: every policy at each, and a table and plot of TTFT against load");
ABSL_FLAG(uint64_t, seed, 42, "Seed of every random choice (same seed, same output)");
ABSL_FLAG(std::string, policies, "all",
          "Comma list of: kvrouter, kvrouter-softmax, kvrouter-approx, kvrouter-ttft, round-robin, "
          "random, "
          "least-loaded, least-tokens, prefix-only (or all)");
ABSL_FLAG(double, temperature, 0.5, "Router temperature of the kvrouter-softmax policy");
ABSL_FLAG(std::string, temperatures, "",
          "Router temperature per kvrouter policy, e.g. kvrouter=0.1,kvrouter-approx=0.2 (over "
          "--temperature; default 0 for kvrouter and kvrouter-approx)");
// Router options of the kvrouter policies; unset = the library's default (Dynamo's).
ABSL_FLAG(std::optional<double>, overlap_score_credit, std::nullopt,
          "Router: blocks of prefill a cached block is worth (default 1)");
ABSL_FLAG(std::optional<double>, prefill_load_scale, std::nullopt,
          "Router: weight of prefill blocks against decode blocks in the cost (default 1)");
ABSL_FLAG(std::optional<double>, overlap_score_credit_decay, std::nullopt,
          "Router: discount of a cache hit on a worker with a longer prefill queue (default 0)");
ABSL_FLAG(std::optional<double>, ttft_miss_weight, std::nullopt,
          "Router (kvrouter-ttft): extra weight of a cache miss's prefill time, the delay it "
          "adds for the requests queued behind it (default 3)");
ABSL_FLAG(std::optional<double>, decode_active_request_weight, std::nullopt,
          "Router: cost per active request on the worker (default 0)");
ABSL_FLAG(std::optional<double>, queue_threshold, std::nullopt,
          "Router: hold requests at the gateway while every worker's booked prefill tokens exceed "
          "this x max_num_batched_tokens (default: never)");
ABSL_FLAG(bool, assume_kv_reuse, true, "Router: a prompt's blocks already booked are shared");
ABSL_FLAG(bool, track_prefill_tokens, true, "Router: count booked prefill tokens as load");
// The simulated engines' cost model (tools/replay/cost_model.h).
ABSL_FLAG(double, step_overhead_s, kvrouter::replay::CostModel{}.step_overhead_s,
          "Engine step: fixed seconds per step (weights read, launches)");
ABSL_FLAG(double, prefill_per_token_s, kvrouter::replay::CostModel{}.prefill_per_token_s,
          "Engine step: seconds per prefill token (GEMMs)");
ABSL_FLAG(double, attention_per_pair_s, kvrouter::replay::CostModel{}.attention_per_pair_s,
          "Engine step: seconds per (query, key) pair of prefill attention");
ABSL_FLAG(double, decode_per_sequence_s, kvrouter::replay::CostModel{}.decode_per_sequence_s,
          "Engine step: seconds per decoding sequence");
ABSL_FLAG(double, decode_per_context_token_s,
          kvrouter::replay::CostModel{}.decode_per_context_token_s,
          "Engine step: seconds per context token of a decoding sequence (KV reads)");
ABSL_FLAG(uint64_t, host_capacity_blocks, 0,
          "Host-memory KV tier per worker, in blocks: device evictions are offloaded there and "
          "reloaded on a hit instead of recomputed (0 = no host tier)");
ABSL_FLAG(std::optional<double>, host_reload_per_block_s, std::nullopt,
          "Engine step: seconds to reload one block from the host tier (default 2.62 us per "
          "token of the block: 128 KiB at ~50 GB/s)");
ABSL_FLAG(std::optional<double>, host_cache_hit_weight, std::nullopt,
          "Router: prefill blocks a block cached on a worker's host tier is worth (default 0.75)");
ABSL_FLAG(double, event_delay_ms, 0,
          "KV events reach the router this many ms (simulated) after the engine's change");
ABSL_FLAG(double, event_loss, 0,
          "Probability that a KV event never reaches the router (seeded draw per event)");
ABSL_FLAG(bool, preemption, false,
          "Engines allocate output KV blocks as decoding goes and, out of blocks, preempt the "
          "newest running request, which is recomputed later (vLLM V1); default: each request "
          "reserves its whole output at admission and nothing is preempted");
ABSL_FLAG(std::string, output_dir, "",
          "Write summary.txt, results.csv, results.json, decision_latency.csv and replay.png here");
ABSL_FLAG(uint32_t, azure_shared_prefix_groups, 0,
          "Azure traces: give requests one of N synthetic shared prefixes (0 = none)");
ABSL_FLAG(uint32_t, azure_shared_prefix_tokens, 2048,
          "Azure traces: length of the shared prefix (a multiple of 512)");
ABSL_FLAG(uint64_t, max_requests, 0, "Replay only the first N requests (0 = all)");
ABSL_FLAG(uint64_t, max_model_len, 0,
          "Context limit in tokens: requests with a longer prompt are rejected and counted, not "
          "replayed (0 = no limit)");
ABSL_FLAG(std::string, transport, "inprocess",
          "How KV events reach the router: inprocess (direct ABI calls), stream (FlatBuffers "
          "batches over a Unix socket to kvr_ingest), zmq (every engine a vLLM ZMQ publisher), "
          "nats (FlatBuffers batches on a NATS server, a subject per engine; see --nats_url)");
ABSL_FLAG(std::string, nats_url, "",
          "With --transport nats: the NATS server the engines publish on and the router "
          "subscribes to, e.g. nats://127.0.0.1:4222");
ABSL_FLAG(uint32_t, gateways, 1,
          "Router replicas (gateways) per kvrouter policy; requests arrive at them in turn");
ABSL_FLAG(bool, replica_sync, true,
          "With --gateways > 1: replicas publish their bookings to each other (replica sync)");
ABSL_FLAG(uint32_t, jobs, 0, "Policies simulated in parallel (0 = one per core)");
ABSL_FLAG(bool, progress, true,
          "Progress on stderr: a bar on a terminal, otherwise a plain line every 10 s and at the "
          "end");
ABSL_FLAG(bool, plot, true, "Draw replay.png with gnuplot (with --output_dir)");

namespace {

constexpr const char* kUsage =
    "kvrouter: KV-cache-aware LLM request router tools.\n\n"
    "usage:\n"
    "  kvrouter replay --trace=FILE [--workers=8] [--policies=all] [--output_dir=DIR] ...\n"
    "  kvrouter version\n\n"
    "replay: trace-driven fleet simulation comparing routing policies (docs/replay.md).\n"
    "Flag names accept '-' or '_' (--block-size = --block_size).";

// Abseil flag names use underscores; accept the hyphenated spelling too.
std::vector<std::string> NormaliseFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--") break;
    if (arg.rfind("--", 0) != 0) continue;
    const size_t end = std::min(arg.find('='), arg.size());
    for (size_t c = 2; c < end; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  return args;
}

kvrouter::replay::ReplayArgs ArgsFromFlags() {
  kvrouter::replay::ReplayArgs args;
  args.trace = absl::GetFlag(FLAGS_trace);
  args.format = absl::GetFlag(FLAGS_format);
  args.workers = absl::GetFlag(FLAGS_workers);
  args.block_size = absl::GetFlag(FLAGS_block_size);
  args.kv_capacity_blocks = absl::GetFlag(FLAGS_kv_capacity_blocks);
  args.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  args.max_num_seqs = absl::GetFlag(FLAGS_max_num_seqs);
  args.time_scales = absl::GetFlag(FLAGS_time_scale);
  args.seed = absl::GetFlag(FLAGS_seed);
  args.policies = absl::GetFlag(FLAGS_policies);
  args.temperature = absl::GetFlag(FLAGS_temperature);
  args.temperatures = absl::GetFlag(FLAGS_temperatures);
  args.router.overlap_score_credit = absl::GetFlag(FLAGS_overlap_score_credit);
  args.router.prefill_load_scale = absl::GetFlag(FLAGS_prefill_load_scale);
  args.router.overlap_score_credit_decay = absl::GetFlag(FLAGS_overlap_score_credit_decay);
  args.router.decode_active_request_weight = absl::GetFlag(FLAGS_decode_active_request_weight);
  args.router.ttft_miss_weight = absl::GetFlag(FLAGS_ttft_miss_weight);
  args.router.queue_threshold = absl::GetFlag(FLAGS_queue_threshold);
  args.router.assume_kv_reuse = absl::GetFlag(FLAGS_assume_kv_reuse);
  args.router.track_prefill_tokens = absl::GetFlag(FLAGS_track_prefill_tokens);
  using kvrouter::replay::CostModel;
  const std::pair<const absl::Flag<double>*, double CostModel::*> cost_flags[] = {
      {&FLAGS_step_overhead_s, &CostModel::step_overhead_s},
      {&FLAGS_prefill_per_token_s, &CostModel::prefill_per_token_s},
      {&FLAGS_attention_per_pair_s, &CostModel::attention_per_pair_s},
      {&FLAGS_decode_per_sequence_s, &CostModel::decode_per_sequence_s},
      {&FLAGS_decode_per_context_token_s, &CostModel::decode_per_context_token_s}};
  for (const auto& [flag, field] : cost_flags) args.cost.*field = absl::GetFlag(*flag);
  args.host_capacity_blocks = absl::GetFlag(FLAGS_host_capacity_blocks);
  args.host_reload_per_block_s = absl::GetFlag(FLAGS_host_reload_per_block_s);
  args.router.host_cache_hit_weight = absl::GetFlag(FLAGS_host_cache_hit_weight);
  args.event_delay_ms = absl::GetFlag(FLAGS_event_delay_ms);
  args.event_loss = absl::GetFlag(FLAGS_event_loss);
  args.preemption = absl::GetFlag(FLAGS_preemption);
  args.output_dir = absl::GetFlag(FLAGS_output_dir);
  args.azure_shared_prefix_groups = absl::GetFlag(FLAGS_azure_shared_prefix_groups);
  args.azure_shared_prefix_tokens = absl::GetFlag(FLAGS_azure_shared_prefix_tokens);
  args.max_requests = absl::GetFlag(FLAGS_max_requests);
  args.max_model_len = absl::GetFlag(FLAGS_max_model_len);
  args.transport = absl::GetFlag(FLAGS_transport);
  args.nats_url = absl::GetFlag(FLAGS_nats_url);
  args.gateways = absl::GetFlag(FLAGS_gateways);
  args.replica_sync = absl::GetFlag(FLAGS_replica_sync);
  args.jobs = absl::GetFlag(FLAGS_jobs);
  args.progress = absl::GetFlag(FLAGS_progress);
  args.plot = absl::GetFlag(FLAGS_plot);
  return args;
}

}  // namespace

// --help lists this tool's flags (Abseil's default looks for a file named after the program).
void ConfigureHelp() {
  absl::FlagsUsageConfig config;
  const auto ours = [](absl::string_view file) { return absl::StrContains(file, "kvrouter/"); };
  config.contains_help_flags = ours;
  config.contains_helpshort_flags = ours;
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(kUsage);
}

int main(int argc, char** argv) {
  ConfigureHelp();
  if (argc < 2 || argv[1][0] == '-') {
    // `kvrouter --help` and friends still reach Abseil's usage handling.
    if (argc >= 2) absl::ParseCommandLine(argc, argv);
    std::cerr << kUsage << "\n";
    return 2;
  }
  const std::string command = argv[1];
  if (command == "version") {
    std::cout << "kvrouter " << kvr_version_string() << "\n";
    return 0;
  }
  if (command != "replay") {
    std::cerr << "kvrouter: unknown command \"" << command << "\"\n\n" << kUsage << "\n";
    return 2;
  }
  // Parse the flags after the subcommand, as if the program were `kvrouter-replay`.
  std::vector<std::string> normalised = NormaliseFlagNames(argc - 1, argv + 1);
  std::vector<char*> flag_argv;
  for (std::string& arg : normalised) flag_argv.push_back(arg.data());
  const std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(flag_argv.size()), flag_argv.data());
  if (positional.size() > 1) {
    std::cerr << "kvrouter replay: unexpected argument \"" << positional[1] << "\"\n";
    return 2;
  }
  return kvrouter::replay::RunReplay(ArgsFromFlags(), std::cout, std::cerr);
}

// `kvrouter replay`: load a trace, replay it under each policy (in parallel, one thread per
// policy at a time), print the table, write the files. Independent of the flag parser so that
// tests can drive it directly.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "replay/cost_model.h"
#include "replay/fleet_sim.h"

namespace kvrouter::replay {

struct ReplayArgs {
  std::string trace;
  std::string format = "auto";  // mooncake | azure | auto (by extension)
  uint32_t workers = 8;
  uint32_t block_size = 16;
  uint64_t kv_capacity_blocks = 0;  // 0: kDefaultKvCapacityTokens / block_size
  uint32_t max_num_batched_tokens = 8192;
  uint32_t max_num_seqs = 256;
  // Arrival speed-ups, a comma list ("1,1.5,2": 2 replays the trace twice as fast). More than
  // one is a load sweep: every policy runs at each, and a table of TTFT against load follows.
  std::string time_scales = "1";
  uint64_t seed = 42;
  std::string policies = "all";
  double temperature = 0.5;  // kvrouter-softmax's
  std::string temperatures;  // "kvrouter=0.1,...": any kvrouter policy's (over `temperature`)
  RouterSettings router;     // the kvrouter policies' router options
  std::string output_dir;    // empty: print only
  uint32_t azure_shared_prefix_groups = 0;
  uint32_t azure_shared_prefix_tokens = 2048;
  uint64_t max_requests = 0;   // 0: all
  uint64_t max_model_len = 0;  // requests with longer prompts are rejected; 0: no limit
  std::string transport = "inprocess";
  std::string nats_url;      // the NATS server of --transport nats
  uint32_t gateways = 1;     // router replicas (gateways) per kvrouter policy
  bool replica_sync = true;  // with gateways > 1: replicas publish their bookings to each other
  uint32_t jobs = 0;         // 0: one per core
  bool progress = true;
  bool plot = true;                   // run gnuplot for replay.png (with output_dir)
  CostModel cost;                     // the simulated engines' step time
  uint64_t host_capacity_blocks = 0;  // host-memory tier per worker; 0: none
  // Seconds to reload one block from the host; unset: kHostReloadPerTokenS × block_size.
  std::optional<double> host_reload_per_block_s;
  double event_delay_ms = 0;  // KV events reach the router this long after the engine's change
  double event_loss = 0;      // probability that a KV event is lost
  bool preemption = false;    // engines allocate output blocks as they go and preempt (vLLM)
};

// "1,1.5,2" → {1, 1.5, 2}: sorted, each finite and > 0, no repeats. Throws
// std::invalid_argument naming the bad entry.
std::vector<double> ParseTimeScales(const std::string& list);

// Replays one policy: RunPolicy, or a stand-in in tests.
using PolicyRunner =
    std::function<PolicyResult(const std::vector<trace::TraceRecord>&, const PolicySpec&,
                               const ReplayConfig&, ProgressCounter*)>;

// Runs the command. Returns the process exit status: 0, or 1 after printing the error on `err`
// (a bad flag, a bad trace line, a policy that failed). A policy that fails (its router refuses
// a call, its simulation breaks) is named in the error; the others' results are still printed
// and written.
int RunReplay(const ReplayArgs& args, std::ostream& out, std::ostream& err,
              const PolicyRunner& run_policy = RunPolicy);

}  // namespace kvrouter::replay

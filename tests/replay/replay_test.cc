// Whole replays through the real router (C ABI): routing quality against the baselines,
// determinism, and the command line's errors. Runs on the first requests of the bundled Mooncake
// conversation trace to stay fast.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "replay/fleet_sim.h"
#include "replay/progress.h"
#include "replay/replay_command.h"
#include "replay/report.h"
#include "replay/trace_source.h"

#if KVR_TEST_WITH_NATS
#include "nats_server.h"
#endif

namespace kvrouter::replay {
namespace {

namespace fs = std::filesystem;

const std::string kTrace = std::string(KVR_DATA_DIR) + "/mooncake/conversation_trace.jsonl";

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

fs::path TempDir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("kvr_replay_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// The bundled trace's first requests under the router and the foils. One test, so that ctest
// (one process per test) replays them once: that matters under the sanitizers.
class BundledTraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto trace = LoadReplayTrace(kTrace, TraceFormat::kMooncake, {}, 800);
    ReplayConfig config;
    config.workers = 8;
    config.limits.kv_capacity_blocks = 25'000;
    for (const PolicySpec& spec :
         ParsePolicies("kvrouter,kvrouter-approx,round-robin,prefix-only", 0.5)) {
      results_.push_back(RunPolicy(trace, spec, config));
    }
  }
  const PolicyResult& Result(const std::string& name) const {
    for (const PolicyResult& result : results_) {
      if (result.name == name) return result;
    }
    throw std::out_of_range(name);
  }
  std::vector<PolicyResult> results_;
};

TEST_F(BundledTraceTest, KvRouterBeatsTheFoilsWithoutHerding) {
  const PolicyMetrics kv = ComputeMetrics(Result("kvrouter"));
  const PolicyMetrics rr = ComputeMetrics(Result("round-robin"));
  const PolicyMetrics prefix = ComputeMetrics(Result("prefix-only"));
  // More cache hits and a shorter TTFT than round-robin, not bought by herding.
  EXPECT_GT(kv.hit_rate, 1.5 * rr.hit_rate) << kv.hit_rate << " vs " << rr.hit_rate;
  EXPECT_LT(kv.ttft_mean, rr.ttft_mean);
  EXPECT_LT(kv.load_imbalance, 1.5);
  // Sticky prefix affinity without load piles sessions onto the workers that served the first
  // burst (the ones that cached trace block 0, which every request starts with).
  EXPECT_GT(prefix.ttft_mean, 2 * kv.ttft_mean);
  EXPECT_GT(prefix.load_imbalance, kv.load_imbalance);

  // Every request is accounted for.
  for (const PolicyResult& result : results_) {
    SCOPED_TRACE(result.name);
    EXPECT_EQ(result.requests, 800u);
    uint64_t computed = 0;
    for (uint64_t tokens : result.worker_prefill_tokens) computed += tokens;
    EXPECT_EQ(computed + result.cached_tokens, result.prompt_tokens);
    EXPECT_EQ(result.ttft_s.size(), 800u);
    EXPECT_GT(result.ttft_s.front(), 0);
  }

  // Events reach the router, except in approximate mode.
  const PolicyResult& with_events = Result("kvrouter");
  EXPECT_GT(with_events.router.events_stored, 0u);
  EXPECT_GT(with_events.router.events_removed, 0u);
  EXPECT_EQ(with_events.router.events_rejected, 0u);
  EXPECT_EQ(Result("kvrouter-approx").router.events_stored, 0u);
  // With events and no lag, the router's predicted hits are close to the engines' real ones
  // (they differ only by what changes while a request waits in an engine's queue).
  const double predicted = static_cast<double>(with_events.predicted_cached_tokens);
  EXPECT_NEAR(predicted / static_cast<double>(with_events.cached_tokens), 1.0, 0.15);
}

// Requests that share a long system prompt (12 of their 16 trace blocks) and, after a first one
// that warms one worker's cache, arrive faster than one worker can prefill their own parts. The
// warm worker has the most overlap for every later request, so "most overlap wins" piles
// everything there, while kvrouter weighs the overlap against the load and spreads.
TEST(SharedPromptTest, PrefixOnlyHerdsAndKvRouterSpreads) {
  std::vector<trace::TraceRecord> trace;
  for (uint64_t i = 0; i < 400; ++i) {
    std::vector<uint64_t> ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    for (uint64_t own = 0; own < 4; ++own) ids.push_back(1000 + 4 * i + own);
    trace.push_back({.timestamp_ms = i == 0 ? 0 : static_cast<int64_t>(2000 + i * 20),
                     .input_length = 8000,
                     .output_length = 20,
                     .hash_ids = std::move(ids)});
  }
  ReplayConfig config;
  config.workers = 8;
  const auto prefix = ComputeMetrics(RunPolicy(trace, ParsePolicies("prefix-only", 0)[0], config));
  const auto kv = ComputeMetrics(RunPolicy(trace, ParsePolicies("kvrouter", 0)[0], config));
  EXPECT_GT(prefix.load_imbalance, 3.0) << "8.0 = everything on one worker";
  EXPECT_LT(kv.load_imbalance, 1.5);
  EXPECT_LT(kv.ttft_mean, prefix.ttft_mean / 2);
}

// Four gateways, each with its own router, in front of the same fleet (the first 1,500
// requests of the bundled trace): without replica sync each one sees only the quarter of the
// load it booked itself, so they pile onto workers that look idle to each of them; with sync
// they route as one router does. (On this slice: TTFT mean 1.01 s for one router, 1.48 s for
// four blind gateways, 1.01 s for four synced ones.)
TEST(ReplayGatewaysTest, GatewaysNeedReplicaSyncToRouteAsOne) {
  const auto trace = LoadReplayTrace(kTrace, TraceFormat::kMooncake, {}, 1500);
  const PolicySpec kvrouter = ParsePolicies("kvrouter", 0)[0];
  ReplayConfig config;
  const auto one = ComputeMetrics(RunPolicy(trace, kvrouter, config));
  config.gateways = 4;
  config.replica_sync = false;
  const auto blind = ComputeMetrics(RunPolicy(trace, kvrouter, config));
  config.replica_sync = true;
  const auto synced = ComputeMetrics(RunPolicy(trace, kvrouter, config));
  EXPECT_GT(blind.ttft_mean, 1.25 * one.ttft_mean) << "four blind gateways herd";
  EXPECT_LT(synced.ttft_mean, 1.05 * one.ttft_mean) << "synced gateways route as one";
}

ReplayArgs SmallRun(const fs::path& output_dir) {
  ReplayArgs args;
  args.trace = kTrace;
  args.max_requests = 200;
  args.policies = "all";
  args.output_dir = output_dir.string();
  args.progress = false;
  args.plot = false;
  args.jobs = 2;
  args.seed = 7;
  return args;
}

TEST(ReplayCommandTest, SameSeedGivesByteIdenticalOutput) {
  const fs::path a = TempDir("det_a"), b = TempDir("det_b");
  std::ostringstream out_a, out_b, err;
  ASSERT_EQ(RunReplay(SmallRun(a), out_a, err), 0) << err.str();
  ASSERT_EQ(RunReplay(SmallRun(b), out_b, err), 0) << err.str();
  // decision_latency.csv is wall-clock by design and excluded.
  for (const char* file :
       {"summary.txt", "results.csv", "results.json", "ttft_cdf.dat", "load.dat", "replay.gp"}) {
    const std::string text = ReadFile(a / file);
    EXPECT_FALSE(text.empty()) << file;
    EXPECT_EQ(text, ReadFile(b / file)) << file << " differs between two runs with one seed";
  }
  EXPECT_NE(ReadFile(a / "summary.txt").find("kvrouter-approx"), std::string::npos);
}

// The wire paths (a kvr_ingest fed over a Unix socket with FlatBuffers batches, subscribed to
// every engine as a vLLM ZMQ publisher, or subscribed on a real nats-server to the engines'
// subjects) must deliver exactly what the in-process calls do: same decisions, same cache hits,
// same latencies, same event counts, byte for byte.
TEST(ReplayCommandTest, EveryTransportGivesTheSameResults) {
  std::vector<std::string> wire = {"stream", "zmq"};
#if KVR_TEST_WITH_NATS
  NatsServer server(FreePort());
  ASSERT_TRUE(server.Start()) << "nats-server did not start";
  wire.push_back("nats");
#endif
  std::map<std::string, fs::path> dirs;
  std::vector<std::string> transports = {"inprocess"};
  transports.insert(transports.end(), wire.begin(), wire.end());
  for (const std::string& transport : transports) {
    ReplayArgs args = SmallRun(TempDir("transport_" + transport));
    args.policies = "kvrouter,prefix-only";
    args.transport = transport;
#if KVR_TEST_WITH_NATS
    args.nats_url = server.url();
#endif
    std::ostringstream out, err;
    ASSERT_EQ(RunReplay(args, out, err), 0) << transport << ": " << err.str();
    dirs[transport] = args.output_dir;
  }
  const std::string events = ReadFile(dirs["inprocess"] / "results.csv");
  EXPECT_NE(events.find("kvrouter"), std::string::npos);
  for (const std::string& transport : wire) {
    for (const char* file :
         {"summary.txt", "results.csv", "results.json", "ttft_cdf.dat", "load.dat", "replay.gp"}) {
      EXPECT_EQ(ReadFile(dirs[transport] / file), ReadFile(dirs["inprocess"] / file))
          << file << " differs between --transport=" << transport << " and inprocess";
    }
  }
}

TEST(ReplayCommandTest, UnknownTransportIsRefused) {
  ReplayArgs args = SmallRun(TempDir("bad_transport"));
  args.transport = "carrier-pigeon";
  std::ostringstream out, err;
  EXPECT_EQ(RunReplay(args, out, err), 1);
  EXPECT_NE(
      err.str().find("unknown --transport \"carrier-pigeon\" (inprocess, stream, zmq or nats)"),
      std::string::npos)
      << err.str();
}

TEST(ReplayCommandTest, NatsTransportNeedsAServer) {
  ReplayArgs args = SmallRun(TempDir("nats_without_url"));
  args.transport = "nats";
  std::ostringstream out, err;
  EXPECT_EQ(RunReplay(args, out, err), 1);
  EXPECT_NE(err.str().find("--transport nats needs --nats_url"), std::string::npos) << err.str();
}

#if KVR_TEST_WITH_NATS
// A server whose messages are at most 4 KiB (the default is 1 MiB): the engines' events, up to
// 32 KiB of token ids each here, go in parts (stores chained by parent), and the router ends with
// the same view: the table is the in-process one, byte for byte. Without the parts, publishing
// fails ("Maximum Payload Exceeded").
TEST(ReplayCommandTest, NatsEventsLargerThanTheServersMessagesGoInParts) {
  const fs::path config = TempDir("nats_small_payload") / "nats.conf";
  std::ofstream(config) << "max_payload: 4096\n";
  NatsServer server(FreePort(), "", config.string());
  ASSERT_TRUE(server.Start()) << "nats-server did not start";
  std::map<std::string, fs::path> dirs;
  for (const char* transport : {"inprocess", "nats"}) {
    ReplayArgs args = SmallRun(TempDir(std::string("small_payload_") + transport));
    args.policies = "kvrouter";
    args.kv_capacity_blocks = 8'000;  // evictions: removals, copies to the host tier
    args.host_capacity_blocks = 16'000;
    args.transport = transport;
    args.nats_url = server.url();
    std::ostringstream out, err;
    ASSERT_EQ(RunReplay(args, out, err), 0) << transport << ": " << err.str();
    dirs[transport] = args.output_dir;
  }
  for (const char* file : {"summary.txt", "results.csv", "results.json"}) {
    EXPECT_EQ(ReadFile(dirs["nats"] / file), ReadFile(dirs["inprocess"] / file)) << file;
  }
}

// A server that is not there fails each kvrouter policy with the subscription's own message;
// the baselines, which take no events, still come out.
TEST(ReplayCommandTest, NatsServerThatIsNotThereFailsThePoliciesThatNeedIt) {
  ReplayArgs args = SmallRun(TempDir("nats_not_there"));
  args.policies = "kvrouter,round-robin";
  args.transport = "nats";
  args.nats_url = "nats://127.0.0.1:" + std::to_string(FreePort());  // nothing listens there
  std::ostringstream out, err;
  EXPECT_EQ(RunReplay(args, out, err), 1);
  EXPECT_NE(err.str().find("kvr_ingest_subscribe_nats failed: KVR_UNAVAILABLE"), std::string::npos)
      << err.str();
  EXPECT_NE(out.str().find("round-robin"), std::string::npos) << out.str();
}
#endif

// A policy whose replay fails is named in the error, and the other policies' results still
// come out (printed, and written to the output directory) with exit status 1.
TEST(ReplayCommandTest, OnePolicysFailureNamesItAndKeepsTheOthers) {
  ReplayArgs args = SmallRun(TempDir("one_fails"));
  args.policies = "round-robin,random,least-loaded";
  const PolicyRunner failing_random = [](const std::vector<trace::TraceRecord>& trace,
                                         const PolicySpec& spec, const ReplayConfig& config,
                                         ProgressCounter* progress) {
    if (spec.name == "random") throw std::runtime_error("KV cache: cannot allocate 81 blocks");
    return RunPolicy(trace, spec, config, progress);
  };
  std::ostringstream out, err;
  EXPECT_EQ(RunReplay(args, out, err, failing_random), 1);
  EXPECT_NE(err.str().find("policy random: KV cache: cannot allocate 81 blocks"), std::string::npos)
      << err.str();
  EXPECT_NE(out.str().find("random: FAILED"), std::string::npos) << out.str();
  const std::string json = ReadFile(fs::path(args.output_dir) / "results.json");
  for (const char* name : {"round-robin", "least-loaded"}) {
    EXPECT_NE(out.str().find(std::string("\n") + name + " "), std::string::npos) << name;
    EXPECT_NE(json.find(std::string("\"policy\": \"") + name + "\""), std::string::npos) << name;
  }
  EXPECT_NE(json.find("\"failed_policies\""), std::string::npos) << json;
}

// A load sweep runs every policy at every time scale and adds a table of hit rate, TTFT mean
// and p99 against load; the same seed gives the same files byte for byte, and each load's
// numbers are those of a run at that load alone.
TEST(ReplayCommandTest, LoadSweepIsDeterministicAndMatchesSingleLoadRuns) {
  const auto sweep_run = [](const std::string& name, const std::string& scales) {
    ReplayArgs args = SmallRun(TempDir(name));
    args.policies = "kvrouter,round-robin,least-tokens";
    args.time_scales = scales;
    return args;
  };
  const ReplayArgs a = sweep_run("sweep_a", "2,1"), b = sweep_run("sweep_b", "1, 2");
  std::ostringstream out_a, out_b, err;
  ASSERT_EQ(RunReplay(a, out_a, err), 0) << err.str();
  ASSERT_EQ(RunReplay(b, out_b, err), 0) << err.str();
  for (const char* file :
       {"summary.txt", "results.csv", "results.json", "ttft_cdf.dat", "load.dat", "replay.gp"}) {
    const std::string text = ReadFile(fs::path(a.output_dir) / file);
    EXPECT_FALSE(text.empty()) << file;
    EXPECT_EQ(text, ReadFile(fs::path(b.output_dir) / file)) << file << " differs";
  }
  const std::string table = out_a.str();
  for (const char* expected : {"time scales 1, 2, seed 7", "time scale 1:\n", "time scale 2:\n",
                               "load sweep:", "| time scale 1 ", "| time scale 2\n"}) {
    EXPECT_NE(table.find(expected), std::string::npos) << expected << " in\n" << table;
  }
  // The sweep table: one row per policy, three numbers per load.
  const size_t sweep_at = table.find("load sweep:");
  EXPECT_NE(table.find("\nround-robin       |", sweep_at), std::string::npos) << table;

  const fs::path dir(a.output_dir);
  const auto json = nlohmann::json::parse(ReadFile(dir / "results.json"));
  EXPECT_EQ(json["config"]["time_scales"], nlohmann::json({1.0, 2.0}));
  ASSERT_EQ(json["policies"].size(), 6u);
  ASSERT_EQ(json["load_sweep"].size(), 3u);
  for (const auto& curve : json["load_sweep"]) ASSERT_EQ(curve["points"].size(), 2u);
  const std::string csv = ReadFile(dir / "results.csv");
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 7) << csv;
  EXPECT_NE(csv.find("\nleast-tokens,2,"), std::string::npos) << csv;
  // The plot: the scenario in the title, TTFT mean, p99 and hit rate against load.
  const std::string plot = ReadFile(dir / "replay.gp");
  EXPECT_NE(plot.find("conversation_trace.jsonl, 200 requests, 8 workers x 25000 KV blocks of "
                      "16 tokens, time scales 1, 2, seed 7"),
            std::string::npos)
      << plot;
  EXPECT_NE(plot.find("layout 1,3"), std::string::npos) << plot;
  EXPECT_EQ(plot.find("worker"), plot.find("workers x")) << "no per-worker panel";

  // The load of 2 in the sweep is the run at 2 alone, and more load means longer TTFT.
  ReplayArgs alone = sweep_run("sweep_alone", "2");
  std::ostringstream out_alone;
  ASSERT_EQ(RunReplay(alone, out_alone, err), 0) << err.str();
  const auto single = nlohmann::json::parse(ReadFile(fs::path(alone.output_dir) / "results.json"));
  ASSERT_EQ(single["policies"].size(), 3u);
  EXPECT_FALSE(single.contains("load_sweep"));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(json["policies"][3 + i], single["policies"][i]) << i;
    const auto& points = json["load_sweep"][i]["points"];
    EXPECT_EQ(points[1]["ttft_mean_s"], single["policies"][i]["ttft_s"]["mean"]);
    EXPECT_GT(points[1]["ttft_mean_s"].get<double>(), points[0]["ttft_mean_s"].get<double>())
        << json["load_sweep"][i]["policy"];
  }
}

TEST(ReplayCommandTest, BadTimeScaleListsAreRefused) {
  EXPECT_EQ(ParseTimeScales("2, 1,1.5"), (std::vector<double>{1, 1.5, 2}));
  for (const char* bad : {"", "1,0", "1,-2", "1,x", "1,1", "inf"}) {
    ReplayArgs args = SmallRun(TempDir("bad_scales"));
    args.time_scales = bad;
    std::ostringstream out, err;
    EXPECT_EQ(RunReplay(args, out, err), 1) << bad;
    EXPECT_NE(err.str().find("--time_scale"), std::string::npos) << bad << ": " << err.str();
  }
}

// In a sweep, a run that fails is named with its load; the policy's other loads still count.
TEST(ReplayCommandTest, SweepFailureNamesThePolicyAndLoad) {
  ReplayArgs args = SmallRun(TempDir("sweep_fails"));
  args.policies = "round-robin,random";
  args.time_scales = "1,2";
  args.max_requests = 100;
  const PolicyRunner failing = [](const std::vector<trace::TraceRecord>& trace,
                                  const PolicySpec& spec, const ReplayConfig& config,
                                  ProgressCounter* progress) {
    if (spec.name == "random" && config.time_scale == 2) throw std::runtime_error("boom");
    return RunPolicy(trace, spec, config, progress);
  };
  std::ostringstream out, err;
  EXPECT_EQ(RunReplay(args, out, err, failing), 1);
  EXPECT_NE(err.str().find("policy random at time scale 2: boom"), std::string::npos) << err.str();
  EXPECT_NE(out.str().find("random at time scale 2: FAILED"), std::string::npos) << out.str();
  const auto json = nlohmann::json::parse(ReadFile(fs::path(args.output_dir) / "results.json"));
  EXPECT_EQ(json["policies"].size(), 3u);
  EXPECT_EQ(json["failed_policies"][0]["time_scale"], 2.0);
  EXPECT_EQ(json["load_sweep"][1]["points"].size(), 1u);
}

// A lagging event plane hides what the engines cached: the router misses hits it would have
// seen; a lossy one loses some for good (and keeps blocks the engines evicted). Both are
// seeded: the same run twice gives the same numbers.
TEST(ReplayEventsTest, DelayAndLossCostHitsAndAreDeterministic) {
  const auto trace = LoadReplayTrace(kTrace, TraceFormat::kMooncake, {}, 800);
  const PolicySpec kvrouter = ParsePolicies("kvrouter", 0)[0];
  ReplayConfig config;
  const PolicyResult base = RunPolicy(trace, kvrouter, config);
  const double base_hits = ComputeMetrics(base).hit_rate;
  EXPECT_EQ(base.events_lost, 0u);

  // Longer than the slice: the router never sees an event, so it routes cache-blind.
  config.event_delay_s = 600;
  const PolicyResult blind = RunPolicy(trace, kvrouter, config);
  EXPECT_EQ(blind.router.events_stored, 0u);
  EXPECT_EQ(blind.predicted_cached_tokens, 0);
  EXPECT_LT(ComputeMetrics(blind).hit_rate, 0.8 * base_hits);

  // A few seconds: every event arrives, late; the router expects fewer hits than it did.
  config.event_delay_s = 5;
  const PolicyResult late = RunPolicy(trace, kvrouter, config);
  EXPECT_GT(late.router.events_stored, 0u);
  EXPECT_LT(late.predicted_cached_tokens, base.predicted_cached_tokens);
  EXPECT_LT(ComputeMetrics(late).hit_rate, base_hits);

  config.event_delay_s = 0;
  config.event_loss = 0.5;
  const PolicyResult lossy = RunPolicy(trace, kvrouter, config);
  const uint64_t published = base.router.events_stored + base.router.events_removed;
  EXPECT_GT(lossy.events_lost, published / 4);
  EXPECT_LT(lossy.events_lost, 3 * published / 4);
  EXPECT_GT(lossy.router.events_rejected, 0u) << "removals of blocks whose store was lost";
  EXPECT_LT(ComputeMetrics(lossy).hit_rate, base_hits);

  for (const double delay : {0.0, 5.0}) {
    config.event_delay_s = delay;
    config.event_loss = 0.5;
    const PolicyResult a = RunPolicy(trace, kvrouter, config);
    const PolicyResult b = RunPolicy(trace, kvrouter, config);
    EXPECT_EQ(a.events_lost, b.events_lost) << delay;
    EXPECT_EQ(a.cached_tokens, b.cached_tokens) << delay;
    EXPECT_EQ(a.ttft_s, b.ttft_s) << delay;
  }
}

// Small device caches that evict constantly, with and without a host tier: with one, evicted
// prefixes are reloaded instead of recomputed (more hits, shorter TTFT), the router is told of
// the host copies and counts them in its cost, and every event applies cleanly.
TEST(ReplayHostTierTest, HostTierReloadsEvictedPrefixesAndTheRouterSeesThem) {
  const auto trace = LoadReplayTrace(kTrace, TraceFormat::kMooncake, {}, 800);
  const PolicySpec kvrouter = ParsePolicies("kvrouter", 0)[0];
  ReplayConfig config;
  config.limits.kv_capacity_blocks = 10'000;
  const PolicyResult device_only = RunPolicy(trace, kvrouter, config);
  EXPECT_EQ(device_only.host_cached_tokens, 0u);
  config.limits.host_capacity_blocks = 50'000;
  const PolicyResult tiered = RunPolicy(trace, kvrouter, config);
  EXPECT_GT(tiered.host_cached_tokens, 0u);
  EXPECT_GT(ComputeMetrics(tiered).hit_rate, ComputeMetrics(device_only).hit_rate);
  EXPECT_LT(ComputeMetrics(tiered).ttft_mean, ComputeMetrics(device_only).ttft_mean);
  EXPECT_GT(tiered.router.events_stored, device_only.router.events_stored) << "host copies";
  EXPECT_EQ(tiered.router.events_rejected, 0u);
  // The router's predicted hits include the host ones it was told of.
  EXPECT_NEAR(static_cast<double>(tiered.predicted_cached_tokens) /
                  static_cast<double>(tiered.cached_tokens),
              1.0, 0.2);
  // Deterministic, and the host hit weight is the router's to use.
  const PolicyResult again = RunPolicy(trace, kvrouter, config);
  EXPECT_EQ(again.ttft_s, tiered.ttft_s);
  config.router.host_cache_hit_weight = 0;
  const PolicyResult unweighted = RunPolicy(trace, kvrouter, config);
  EXPECT_NE(unweighted.ttft_s, tiered.ttft_s);
}

// Long outputs on small caches: with preemption, engines admit prompts as they fit and run out of
// blocks while decoding, so requests are preempted and recomputed. Every request still ends,
// after its first token, each once; the router's index takes every KV event (a removal for a
// block still cached, or a store of one the router already has, would be rejected); and the run
// is deterministic. Without preemption nothing is preempted.
TEST(ReplayPreemptionTest, TightCachesPreemptAndEveryEventStillApplies) {
  std::vector<trace::TraceRecord> trace;
  for (uint64_t i = 0; i < 120; ++i) {
    // A shared 1,024-token prefix, a per-request tail; 222 blocks at most each, on 600.
    trace.push_back({.timestamp_ms = static_cast<int64_t>(i * 100),
                     .input_length = 2048,
                     .output_length = 1500,
                     .hash_ids = {0, 1, 100 + i, 1000 + i}});
  }
  ReplayConfig config;
  config.workers = 2;
  config.limits.kv_capacity_blocks = 600;
  const PolicySpec kvrouter = ParsePolicies("kvrouter", 0)[0];
  const PolicyResult reserved = RunPolicy(trace, kvrouter, config);
  EXPECT_EQ(reserved.preemptions, 0u);
  EXPECT_FALSE(reserved.preemption);

  config.limits.preemption = true;
  const PolicyResult preempting = RunPolicy(trace, kvrouter, config);
  EXPECT_TRUE(preempting.preemption);
  EXPECT_GT(preempting.preemptions, 10u);
  EXPECT_GT(preempting.recompute_tokens, 0u);
  EXPECT_EQ(preempting.requests, 120u);
  EXPECT_EQ(preempting.ttft_s.size(), 120u);
  EXPECT_GT(preempting.router.events_stored, 0u);
  EXPECT_GT(preempting.router.events_removed, 0u);
  EXPECT_EQ(preempting.router.events_rejected, 0u);
  // Admitting on the prompt's blocks alone starts requests sooner.
  EXPECT_LT(ComputeMetrics(preempting).ttft_mean, ComputeMetrics(reserved).ttft_mean);
  // The recompute is engine work: computed prompt tokens exceed the prompts' uncached part.
  uint64_t computed = 0;
  for (uint64_t tokens : preempting.worker_prefill_tokens) computed += tokens;
  EXPECT_EQ(computed,
            preempting.prompt_tokens - preempting.cached_tokens + preempting.recompute_tokens);

  const PolicyResult again = RunPolicy(trace, kvrouter, config);
  EXPECT_EQ(again.preemptions, preempting.preemptions);
  EXPECT_EQ(again.ttft_s, preempting.ttft_s);
  EXPECT_EQ(again.e2e_s, preempting.e2e_s);
}

// Runs the real binary; returns its exit status and stderr.
std::pair<int, std::string> RunCli(const std::string& arguments) {
  const fs::path err_file = TempDir("cli") / "stderr.txt";
  const std::string command =
      std::string(KVR_CLI_PATH) + " " + arguments + " >/dev/null 2>" + err_file.string();
  const int status = std::system(command.c_str());
  return {WEXITSTATUS(status), ReadFile(err_file)};
}

TEST(ReplayCliTest, BadTraceLineNamesTheLine) {
  const fs::path trace = TempDir("bad_trace") / "bad.jsonl";
  std::ofstream(trace)
      << R"({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]})"
      << "\n"
      << R"({"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]})"
      << "\n"
      << R"({"timestamp": 9, "input_length": "lots", "output_length": 5, "hash_ids": [3]})"
      << "\n";
  const auto [status, err] = RunCli("replay --trace=" + trace.string() + " --progress=false");
  EXPECT_EQ(status, 1);
  EXPECT_NE(err.find("bad.jsonl:3:"), std::string::npos) << err;
  EXPECT_NE(err.find("input_length"), std::string::npos) << err;
}

TEST(ReplayCliTest, HyphenatedFlagsAndTableOnTheBundledTrace) {
  const fs::path out = TempDir("cli_table") / "stdout.txt";
  const std::string command = std::string(KVR_CLI_PATH) + " replay --trace " + kTrace +
                              " --max-requests 200 --policies kvrouter,round-robin --block-size 16"
                              " --progress=false >" +
                              out.string() + " 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << ReadFile(out);
  const std::string table = ReadFile(out);
  EXPECT_NE(table.find("kvrouter "), std::string::npos) << table;
  EXPECT_NE(table.find("round-robin"), std::string::npos) << table;
  EXPECT_NE(table.find("200 requests"), std::string::npos) << table;
}

// Runs the binary on a loaded slice of the bundled trace (400 requests at 4x speed, where the
// router's choices matter) under the kvrouter policy, with `flags`; returns results.json.
nlohmann::json LoadedSliceJson(const std::string& flags, const std::string& name) {
  const fs::path dir = TempDir("flags_" + name);
  const std::string command = std::string(KVR_CLI_PATH) + " replay --trace " + kTrace +
                              " --max-requests 400 --time-scale 4 --policies kvrouter --jobs 1"
                              " --progress=false --plot=false --output-dir " +
                              dir.string() + " " + flags + " >" + (dir / "out.txt").string() +
                              " 2>&1";
  EXPECT_EQ(std::system(command.c_str()), 0) << flags << ": " << ReadFile(dir / "out.txt");
  return nlohmann::json::parse(ReadFile(dir / "results.json"));
}

// Every router option and cost-model constant has a flag, and each reaches what it sets: the
// value is in results.json and the kvrouter policy's results change.
TEST(ReplayCliTest, EveryRouterAndCostModelFlagTakesEffect) {
  struct Case {
    std::string flags;
    std::string section;  // of results.json: "router", "cost_model", or "" (checked below)
    std::string key;
    double value;
  };
  const std::vector<Case> cases = {
      {"--overlap-score-credit 0", "router", "overlap_score_credit", 0},
      {"--prefill-load-scale 0", "router", "prefill_load_scale", 0},
      {"--overlap-score-credit-decay 10", "router", "overlap_score_credit_decay", 10},
      {"--decode-active-request-weight 1000", "router", "decode_active_request_weight", 1000},
      {"--queue-threshold 1", "router", "queue_threshold", 1},
      {"--assume-kv-reuse=false", "router", "assume_kv_reuse", 0},
      {"--track-prefill-tokens=false", "router", "track_prefill_tokens", 0},
      {"--temperatures kvrouter=1", "", "temperature", 1},
      {"--step-overhead-s 0.012", "cost_model", "step_overhead_s", 0.012},
      {"--prefill-per-token-s 8e-5", "cost_model", "prefill_per_token_s", 8e-5},
      {"--attention-per-pair-s 3e-9", "cost_model", "attention_per_pair_s", 3e-9},
      {"--decode-per-sequence-s 1e-3", "cost_model", "decode_per_sequence_s", 1e-3},
      {"--decode-per-context-token-s 1e-7", "cost_model", "decode_per_context_token_s", 1e-7},
  };
  const nlohmann::json base = LoadedSliceJson("", "base");
  EXPECT_EQ(base["router"]["queue_threshold"].get<double>(), -1) << "never queues by default";
  EXPECT_EQ(base["policies"][0]["requests_queued"], 0);
  const auto outcome = [](const nlohmann::json& j) {
    const nlohmann::json& policy = j["policies"][0];
    return std::make_pair(policy["cache_hit_rate"].get<double>(),
                          policy["ttft_s"]["mean"].get<double>());
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(c.flags);
    const nlohmann::json j = LoadedSliceJson(c.flags, std::to_string(i));
    const nlohmann::json& echoed =
        c.section.empty() ? j["policies"][0][c.key] : j[c.section][c.key];
    EXPECT_EQ(echoed.is_boolean() ? double(echoed.get<bool>()) : echoed.get<double>(), c.value);
    EXPECT_NE(outcome(j), outcome(base)) << "the results did not change";
  }
}

// The predicted-TTFT policy and its miss weight; the host tier's flags (the tier takes
// evictions and reloads them, so the hit rate rises). Each flag is echoed and changes results.
TEST(ReplayCliTest, PredictedTtftAndHostTierFlagsTakeEffect) {
  const auto outcome = [](const nlohmann::json& j) {
    const nlohmann::json& policy = j["policies"][0];
    return std::make_pair(policy["cache_hit_rate"].get<double>(),
                          policy["ttft_s"]["mean"].get<double>());
  };
  const nlohmann::json ttft = LoadedSliceJson("--policies kvrouter-ttft", "ttft");
  EXPECT_EQ(ttft["policies"][0]["policy"], "kvrouter-ttft");
  EXPECT_EQ(ttft["router"]["ttft_miss_weight"].get<double>(), 3);
  const nlohmann::json greedy =
      LoadedSliceJson("--policies kvrouter-ttft --ttft-miss-weight 0", "ttft_greedy");
  EXPECT_EQ(greedy["router"]["ttft_miss_weight"].get<double>(), 0);
  EXPECT_NE(outcome(greedy), outcome(ttft));
  EXPECT_LT(greedy["policies"][0]["cache_hit_rate"].get<double>(),
            ttft["policies"][0]["cache_hit_rate"].get<double>())
      << "a miss that costs only its own delay is taken more often";

  const nlohmann::json small = LoadedSliceJson("--kv-capacity-blocks 8000", "small_cache");
  const nlohmann::json host = LoadedSliceJson(
      "--kv-capacity-blocks 8000 --host-capacity-blocks 20000 --host-reload-per-block-s 1e-4",
      "host_tier");
  EXPECT_EQ(host["config"]["host_capacity_blocks"].get<uint64_t>(), 20000u);
  EXPECT_EQ(host["cost_model"]["host_reload_per_block_s"].get<double>(), 1e-4);
  EXPECT_GT(host["policies"][0]["cache_hit_rate"].get<double>(),
            small["policies"][0]["cache_hit_rate"].get<double>());
}

// With a queue threshold the router holds requests while every worker is busy prefilling; the
// replay keeps them at the gateway and routes them once a prefill completes, and every request
// still ends.
TEST(ReplayQueueTest, QueuedRequestsWaitAtTheGatewayAndAllFinish) {
  const auto trace = LoadReplayTrace(kTrace, TraceFormat::kMooncake, {}, 400);
  ReplayConfig config;
  config.time_scale = 4;
  config.router.queue_threshold = 0.5;
  const PolicyResult queued = RunPolicy(trace, ParsePolicies("kvrouter", 0)[0], config);
  EXPECT_GT(queued.queued_requests, 0u);
  EXPECT_EQ(queued.requests, 400u);
  EXPECT_EQ(queued.ttft_s.size(), 400u);
  // The wait counts in the time to first token: it starts at arrival.
  config.router.queue_threshold.reset();
  const PolicyResult direct = RunPolicy(trace, ParsePolicies("kvrouter", 0)[0], config);
  EXPECT_EQ(direct.queued_requests, 0u);
  EXPECT_NE(ComputeMetrics(queued).ttft_mean, ComputeMetrics(direct).ttft_mean);
}

TEST(ReplayCommandTest, BadRouterOrCostModelValuesAreRefusedUpFront) {
  ReplayArgs args = SmallRun(TempDir("bad_values"));
  args.router.prefill_load_scale = -1;
  std::ostringstream out, err;
  EXPECT_EQ(RunReplay(args, out, err), 1);
  EXPECT_NE(err.str().find("prefill_load_scale"), std::string::npos) << err.str();
  EXPECT_TRUE(out.str().empty()) << "no policy ran";
  args.router.prefill_load_scale.reset();
  args.cost.attention_per_pair_s = -1e-9;
  err.str("");
  EXPECT_EQ(RunReplay(args, out, err), 1);
  EXPECT_NE(err.str().find("--attention_per_pair_s must be finite and >= 0"), std::string::npos)
      << err.str();
  args.cost = {};
  args.temperatures = "round-robin=1";
  err.str("");
  EXPECT_EQ(RunReplay(args, out, err), 1);
  EXPECT_NE(err.str().find("round-robin has no router temperature"), std::string::npos)
      << err.str();
}

TEST(PolicySpecTest, TemperaturesSetAnyKvRouterPolicys) {
  const auto specs = ParsePolicies("kvrouter,kvrouter-softmax,kvrouter-approx,prefix-only", 0.5,
                                   "kvrouter-approx=0.25, kvrouter = 0.1");
  ASSERT_EQ(specs.size(), 4u);
  EXPECT_EQ(specs[0].temperature, 0.1);
  EXPECT_EQ(specs[1].temperature, 0.5);  // --temperature
  EXPECT_EQ(specs[2].temperature, 0.25);
  EXPECT_EQ(specs[3].temperature, 0);
  EXPECT_THROW(ParsePolicies("kvrouter", 0.5, "kvrouter=-1"), std::invalid_argument);
  EXPECT_THROW(ParsePolicies("kvrouter", 0.5, "nosuch=1"), std::invalid_argument);
}

// A context limit rejects the requests whose prompt is longer: they are counted, not replayed,
// and a worker's KV capacity only has to hold the ones that are.
TEST(ReplayCommandTest, ContextLimitRejectsLongerPromptsAndCountsThem) {
  auto trace = LoadReplayTrace(kTrace, TraceFormat::kMooncake, {}, 200);
  const uint64_t limit = 16'384;
  const auto longer = std::count_if(trace.begin(), trace.end(), [&](const auto& record) {
    return trace::ExpandedLength(record) > limit;
  });
  ASSERT_GT(longer, 0);  // the slice has prompts up to 120k tokens

  ReplayArgs args = SmallRun(TempDir("context_limit"));
  args.policies = "kvrouter,least-tokens";
  args.kv_capacity_blocks = 1'100;  // 17,600 tokens: the longest accepted prompt and its output
  std::ostringstream out, err;
  ASSERT_EQ(RunReplay(args, out, err), 1) << "without the limit a prompt cannot fit";
  EXPECT_NE(err.str().find("raise --kv_capacity_blocks"), std::string::npos) << err.str();

  args.max_model_len = limit;
  out.str("");
  err.str("");
  ASSERT_EQ(RunReplay(args, out, err), 0) << err.str();
  const std::string accepted = std::to_string(200 - longer) + " requests";
  EXPECT_NE(out.str().find(accepted), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("context: 16384 tokens; " + std::to_string(longer) +
                           " requests with longer prompts rejected"),
            std::string::npos)
      << out.str();
  const auto json = nlohmann::json::parse(ReadFile(fs::path(args.output_dir) / "results.json"));
  EXPECT_EQ(json["requests_rejected"], longer);
  EXPECT_EQ(json["config"]["max_model_len"], limit);
  for (const auto& policy : json["policies"]) EXPECT_EQ(policy["requests"], 200 - longer);
  EXPECT_EQ(RejectOverContext(trace, 0), 0u);
  EXPECT_EQ(RejectOverContext(trace, limit), static_cast<size_t>(longer));
}

// A fleet whose load the test sets.
class FixedFleet final : public FleetView {
 public:
  FixedFleet(std::vector<size_t> in_flight, std::vector<uint64_t> pending)
      : in_flight_(std::move(in_flight)), pending_(std::move(pending)) {}
  uint32_t workers() const override { return static_cast<uint32_t>(in_flight_.size()); }
  size_t InFlight(uint32_t worker) const override { return in_flight_[worker]; }
  uint64_t PendingPromptTokens(uint32_t worker) const override { return pending_[worker]; }

 private:
  std::vector<size_t> in_flight_;
  std::vector<uint64_t> pending_;
};

// least-loaded counts requests; least-tokens counts the prompt tokens still waiting for their
// first token, then requests: one long prompt outweighs several short decodes.
TEST(LeastLoadedTest, TokensOrRequests) {
  const FixedFleet fleet({1, 3, 1, 5}, {50'000, 0, 100, 0});
  PolicyContext context;
  context.workers = 4;
  context.fleet = &fleet;
  const Request request;
  const auto by_requests = MakePolicy(ParsePolicies("least-loaded", 0)[0], context);
  const auto by_tokens = MakePolicy(ParsePolicies("least-tokens", 0)[0], context);
  EXPECT_EQ(by_requests->Route(request, {}), 0u);
  EXPECT_EQ(by_tokens->Route(request, {}), 1u) << "no backlog, then fewer requests than 3";
}

// The engine's prefill backlog: whole prompts from enqueue to first token.
TEST(LeastLoadedTest, EngineCountsPromptTokensUntilTheFirstToken) {
  const trace::TraceRecord record{.input_length = 600, .output_length = 3, .hash_ids = {1, 2}};
  Request request;
  request.record = &record;
  request.prompt_tokens = 600;
  request.output_tokens = 3;
  class Quiet final : public EngineObserver {
    void OnStored(uint32_t, const StoredRun&) override {}
    void OnRemoved(uint32_t, std::span<const uint64_t>, Tier) override {}
    void OnFirstToken(Request&) override {}
    void OnFinished(Request&) override {}
  } observer;
  SimEngine engine(0, EngineLimits{}, CostModel{}, observer);
  engine.Enqueue(&request);
  EXPECT_EQ(engine.pending_prompt_tokens(), 600u);
  ASSERT_TRUE(engine.MaybeStartStep(0));
  engine.FinishStep();  // 600 tokens fit one step: the first token
  EXPECT_EQ(engine.pending_prompt_tokens(), 0u);
  EXPECT_EQ(engine.in_flight(), 1u);  // still decoding
}

// Off a terminal the progress is plain lines, one per interval and one at the end.
TEST(ProgressTest, PlainLinesWhenNotATerminal) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  std::atomic<uint64_t> done{10};
  {
    ProgressBar progress(done, 40, file, std::chrono::milliseconds(20));
    // Until the first periodic line is out (stdio locks the stream, so asking is safe).
    for (int i = 0; i < 500 && std::ftell(file) <= 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    done = 40;
  }
  std::rewind(file);
  std::string text(4096, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), file));
  std::fclose(file);
  EXPECT_EQ(text.find('\r'), std::string::npos) << "no bar redrawn in place";
  EXPECT_NE(text.find("replaying: 10/40 requests (25 %)"), std::string::npos) << text;
  EXPECT_NE(text.find("replaying: 40/40 requests (100 %)"), std::string::npos) << text;
  EXPECT_GE(std::count(text.begin(), text.end(), '\n'), 2) << text;
}

// --preemption is echoed in results.json with each policy's preemptions, and changes the results
// of a slice tight enough for it; without it results.json and the table say nothing of it.
TEST(ReplayCliTest, PreemptionFlagTakesEffect) {
  const nlohmann::json off = LoadedSliceJson("--kv-capacity-blocks 8000", "preemption_off");
  EXPECT_FALSE(off["config"].contains("preemption"));
  EXPECT_FALSE(off["policies"][0].contains("preemptions"));
  const nlohmann::json on =
      LoadedSliceJson("--kv-capacity-blocks 8000 --preemption", "preemption_on");
  EXPECT_EQ(on["config"]["preemption"], true);
  const nlohmann::json& policy = on["policies"][0];
  EXPECT_GT(policy["preemptions"].get<int>(), 0);
  EXPECT_GT(policy["recompute_tokens"].get<int>(), 0);
  EXPECT_EQ(policy["router_events"]["rejected"].get<int>(), 0);
  EXPECT_NE(policy["ttft_s"], off["policies"][0]["ttft_s"]);
  const fs::path dir = fs::path(::testing::TempDir());
  const std::string on_table = ReadFile(dir / "kvr_replay_flags_preemption_on" / "summary.txt");
  EXPECT_NE(on_table.find("preemption: on"), std::string::npos) << on_table;
  EXPECT_NE(on_table.find("\nkvrouter: " + std::to_string(policy["preemptions"].get<int>()) +
                          " preemption"),
            std::string::npos)
      << on_table;
  const std::string off_table = ReadFile(dir / "kvr_replay_flags_preemption_off" / "summary.txt");
  EXPECT_EQ(off_table.find("preemption"), std::string::npos) << off_table;
}

TEST(ReplayCliTest, EventDelayAndLossFlagsAreEchoed) {
  const nlohmann::json j = LoadedSliceJson("--event-delay-ms 250 --event-loss 0.1", "events");
  EXPECT_EQ(j["config"]["event_delay_ms"].get<double>(), 250);
  EXPECT_EQ(j["config"]["event_loss"].get<double>(), 0.1);
  EXPECT_GT(j["policies"][0]["router_events"]["lost"].get<int>(), 0);
  for (const auto& [flag, message] :
       {std::pair{"--event-delay-ms -1", "--event_delay_ms must be finite and >= 0"},
        {"--event-loss 1.5", "--event_loss must be a probability in [0, 1]"}}) {
    const auto [status, err] = RunCli(std::string("replay --trace ") + kTrace + " " + flag);
    EXPECT_EQ(status, 1) << flag;
    EXPECT_NE(err.find(message), std::string::npos) << err;
  }
}

}  // namespace
}  // namespace kvrouter::replay

// The option table: command line and config file parsing, their precedence, --help's
// completeness, and the example config (service/kvrouterd/kvrouterd.conf.example).
#include "kvrouterd/options.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace kvrouterd {
namespace {

std::string WriteTempFile(const std::string& text) {
  char path[] = "/tmp/kvrouterd-options-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(OptionsTest, DefaultsAreTheLibrarys) {
  Config config;
  kvr_router_options defaults;
  kvr_router_options_init(&defaults, sizeof defaults);
  EXPECT_EQ(config.router.block_size, defaults.block_size);
  EXPECT_EQ(config.router.request_expiry_seconds, defaults.request_expiry_seconds);
  EXPECT_EQ(config.listen_host, "127.0.0.1");
  EXPECT_EQ(config.listen_port, 8080);
}

TEST(OptionsTest, FlagsTakeTheirValueEitherWay) {
  Config config;
  ASSERT_EQ(ParseCommandLine({"--listen", "0.0.0.0:0", "--block-size=32", "--temperature", "0.5",
                              "--queue-policy=wspt", "--cost-function=predicted_ttft",
                              "--approximate=true", "--track-output-blocks", "yes"},
                             &config),
            "");
  EXPECT_EQ(config.listen_host, "0.0.0.0");
  EXPECT_EQ(config.listen_port, 0);
  EXPECT_EQ(config.router.block_size, 32u);
  EXPECT_EQ(config.router.temperature, 0.5);
  EXPECT_EQ(config.router.queue_policy, static_cast<uint32_t>(KVR_QUEUE_WSPT));
  EXPECT_EQ(config.router.cost_function, static_cast<uint32_t>(KVR_COST_PREDICTED_TTFT));
  EXPECT_EQ(config.router.flags, KVR_ROUTER_APPROXIMATE | KVR_ROUTER_TRACK_OUTPUT_BLOCKS);
}

TEST(OptionsTest, IpV6ListenAddress) {
  Config config;
  ASSERT_EQ(ParseCommandLine({"--listen=[::1]:9000"}, &config), "");
  EXPECT_EQ(config.listen_host, "::1");
  EXPECT_EQ(config.listen_port, 9000);
}

TEST(OptionsTest, ConfigFileThenFlagsOverrideIt) {
  const std::string path = WriteTempFile(
      "# a comment\n"
      "block-size = 64   # trailing comment\n"
      "\n"
      "temperature=0.25\n"
      "worker = id=1,address=a:1\n"
      "worker = id=2\n"
      "listen-events = tcp://127.0.0.1:0\n");
  Config config;
  ASSERT_EQ(ParseCommandLine({"--config", path, "--block-size", "8", "--worker", "id=3"}, &config),
            "");
  EXPECT_EQ(config.config_file, path);
  EXPECT_EQ(config.router.block_size, 8u);  // the flag wins, wherever it stands
  EXPECT_EQ(config.router.temperature, 0.25);
  ASSERT_EQ(config.workers.size(), 3u);  // repeatable keys add up
  EXPECT_EQ(config.workers[0].address, "a:1");
  EXPECT_EQ(config.workers[2].worker_id, 3u);
  EXPECT_EQ(config.listen_events, std::vector<std::string>{"tcp://127.0.0.1:0"});
  std::remove(path.c_str());
}

TEST(OptionsTest, ErrorsNameTheOptionAndTheLine) {
  Config config;
  EXPECT_EQ(ParseCommandLine({"--no-such-thing"}, &config),
            "unknown option --no-such-thing (see --help)");
  EXPECT_EQ(ParseCommandLine({"--block-size", "sixteen"}, &config),
            "block-size: expected an unsigned integer, got 'sixteen'");
  EXPECT_EQ(ParseCommandLine({"--temperature"}, &config), "--temperature needs a value (X)");
  EXPECT_EQ(ParseCommandLine({"--help=yes"}, &config), "--help takes no value");
  EXPECT_EQ(ParseCommandLine({"stray"}, &config), "unexpected argument 'stray' (see --help)");
  EXPECT_EQ(ParseCommandLine({"--queue-policy=fifo"}, &config),
            "queue-policy: expected fcfs, lcfs or wspt, got 'fifo'");
  EXPECT_EQ(ParseCommandLine({"--listen=localhost"}, &config),
            "listen: expected HOST:PORT, got 'localhost'");
  EXPECT_EQ(ParseCommandLine({"--nats-events=nats://x"}, &config),
            "nats-events: expected URL SUBJECT, got 'nats://x'");
  // Options of KEY=VALUE lists name the option once, then the key.
  EXPECT_EQ(ParseCommandLine({"--worker", "id=x"}, &config),
            "worker: id: expected an unsigned integer, got 'x'");
  EXPECT_EQ(ParseCommandLine({"--worker", "address=h:1"}, &config), "worker: id=N is required");
  EXPECT_EQ(ParseCommandLine({"--jetstream-events", "url=nats://h:1,stream=KV"}, &config),
            "jetstream-events: url=, stream= and subject= are required");
  EXPECT_EQ(ParseCommandLine({"--jetstream-relay", "bad"}, &config),
            "jetstream-relay: expected KEY=VALUE, got 'bad'");
  EXPECT_EQ(ParseCommandLine({"--jetstream-relay", "url=nats://h:1,stream=KV,subject=s,durable=d"},
                             &config),
            "jetstream-relay: durable=, start= and resume= are a consumer's");
  EXPECT_NE(ParseCommandLine({"--config", "/nonexistent/kvrouterd.conf"}, &config)
                .find("cannot read the config file"),
            std::string::npos);

  EXPECT_EQ(ParseConfigText("block-size = 16\nbogus\n", "f.conf", &config),
            "f.conf:2: expected `name = value`");
  EXPECT_EQ(ParseConfigText("colour = blue\n", "f.conf", &config),
            "f.conf:1: unknown setting 'colour'");
  EXPECT_EQ(ParseConfigText("help = 1\n", "f.conf", &config),
            "f.conf:1: 'help' is a command-line option only");
  EXPECT_EQ(ParseConfigText("\n\ntemperature = hot\n", "f.conf", &config),
            "f.conf:3: temperature: expected a number, got 'hot'");
  EXPECT_EQ(ParseConfigText("worker = id=x\n", "f.conf", &config),
            "f.conf:1: worker: id: expected an unsigned integer, got 'x'");
  // The HTTP server binds an address, and looks no name up: a host name does not parse (it
  // failed only when the server bound it, exit code 1 instead of 2).
  EXPECT_EQ(ParseCommandLine({"--listen", "localhost:8080"}, &config),
            "listen: expected an IP address (127.0.0.1, 0.0.0.0, [::1]; not a host name), got "
            "'localhost'");
  EXPECT_EQ(ParseCommandLine({"--listen", "0.0.0.0:8080"}, &config), "");
  EXPECT_EQ(ParseCommandLine({"--listen", "[::1]:0"}, &config), "");
  EXPECT_EQ(config.listen_host, "::1");
}

// docs/kvrouterd.md writes `--nats-events URL SUBJECT` and `--replica-sync URL SUBJECT
// REPLICA_ID`: the words as consecutive arguments, or as one (quoted), or after `=`.
TEST(OptionsTest, ValuesOfSeveralWords) {
  Config config;
  ASSERT_EQ(ParseCommandLine({"--nats-events", "nats://h:4222", "kv.>", "--replica-sync",
                              "nats://h:4222", "replicas", "router-a", "--block-size", "32"},
                             &config),
            "");
  ASSERT_EQ(config.nats_events.size(), 1u);
  EXPECT_EQ(config.nats_events[0], (NatsEventsSpec{"nats://h:4222", "kv.>"}));
  ASSERT_TRUE(config.replica_sync.has_value());
  EXPECT_EQ(*config.replica_sync, (ReplicaSyncSpec{"nats://h:4222", "replicas", "router-a"}));
  EXPECT_EQ(config.router.block_size, 32u);
  EXPECT_EQ(ValidateConfig(config), "");
  config.replica_sync->replica_id = std::string(257, 'r');  // refused before anything connects
  EXPECT_EQ(ValidateConfig(config), "replica-sync: the replica id must be at most 256 bytes");

  Config other;
  ASSERT_EQ(ParseCommandLine({"--nats-events", "nats://a:1 one", "--nats-events=nats://b:2", "two",
                              "--replica-sync=nats://c:3 sync", "r1"},
                             &other),
            "");
  ASSERT_EQ(other.nats_events.size(), 2u);
  EXPECT_EQ(other.nats_events[0], (NatsEventsSpec{"nats://a:1", "one"}));
  EXPECT_EQ(other.nats_events[1], (NatsEventsSpec{"nats://b:2", "two"}));
  EXPECT_EQ(*other.replica_sync, (ReplicaSyncSpec{"nats://c:3", "sync", "r1"}));

  // A missing word is still an error; the next flag is never taken as one.
  Config short_of_one;
  EXPECT_EQ(ParseCommandLine({"--nats-events", "nats://h:4222", "--block-size=8"}, &short_of_one),
            "nats-events: expected URL SUBJECT, got 'nats://h:4222'");
}

TEST(OptionsTest, HelpAndVersionAreSwitches) {
  Config config;
  ASSERT_EQ(ParseCommandLine({"--help", "--version"}, &config), "");
  EXPECT_TRUE(config.help);
  EXPECT_TRUE(config.version);
}

TEST(OptionsTest, WorkerSpec) {
  WorkerSpec worker;
  ASSERT_EQ(ParseWorkerSpec("id=7, address=h:1, dp-start=2, dp-size=4, total-kv-blocks=100, "
                            "max-num-batched-tokens=8192, engine=sglang, events=tcp://h:5557, "
                            "replay=tcp://h:5558, topic=kv",
                            &worker),
            "");
  EXPECT_EQ(worker.worker_id, 7u);
  EXPECT_EQ(worker.address, "h:1");
  EXPECT_EQ(worker.dp_start, 2u);
  EXPECT_EQ(worker.dp_size, 4u);
  EXPECT_EQ(worker.total_kv_blocks, 100u);
  EXPECT_EQ(worker.max_num_batched_tokens, 8192u);
  ASSERT_TRUE(worker.events.has_value());
  EXPECT_EQ(worker.events->engine, static_cast<kvr_engine>(KVR_ENGINE_SGLANG));
  EXPECT_EQ(worker.events->endpoint, "tcp://h:5557");
  EXPECT_EQ(worker.events->replay_endpoint, "tcp://h:5558");
  EXPECT_EQ(worker.events->topic, "kv");

  EXPECT_EQ(ParseWorkerSpec("address=h:1", &worker), "id=N is required");
  EXPECT_EQ(ParseWorkerSpec("id=1,replay=tcp://h:1", &worker), "replay= needs events=");
  EXPECT_EQ(ParseWorkerSpec("id=x", &worker), "id: expected an unsigned integer, got 'x'");
  EXPECT_EQ(ParseWorkerSpec("id=1,colour=red", &worker).rfind("colour: unknown key", 0), 0u);
  EXPECT_EQ(ParseWorkerSpec("id=1,engine=trt", &worker),
            "engine: must be vllm or sglang, got 'trt'");
  EXPECT_EQ(ParseWorkerSpec("id=1,address=h", &worker), "address: expected HOST:PORT, got 'h'");
  EXPECT_EQ(ParseWorkerSpec("id=1,bare", &worker), "expected KEY=VALUE, got 'bare'");
}

// A worker's address is where a proxy sends its requests: refused when it cannot be one, at
// startup, on a reload and through the API, rather than routed to and failing there.
TEST(OptionsTest, WorkerAddressIsAHostAndAPort) {
  for (const char* good : {"", "h:1", "10.0.0.12:8000", "vllm-0.vllm.default.svc:8000",
                           "Vllm.Example.:8000", "_svc.example:65535", "[::1]:8000", "[fe80::1]:80",
                           "[fe80::1%eth0]:80", "[::ffff:10.0.0.1]:80"}) {
    EXPECT_EQ(CheckWorkerAddress(good), "") << good;
  }
  const std::string want = "expected HOST:PORT (a host name, an IPv4 address or an [IPv6] one), ";
  EXPECT_EQ(CheckWorkerAddress("h:0"), "expected a port 1..65535 in 'h:0'");
  EXPECT_EQ(CheckWorkerAddress("h:65536"), "expected a port 1..65535 in 'h:65536'");
  EXPECT_EQ(CheckWorkerAddress("h:"), "expected a port 1..65535 in 'h:'");
  // libuv takes any zone id (up to a NUL): what would break a proxy's header is refused.
  EXPECT_EQ(CheckWorkerAddress("[fe80::1%eth0\r\nx: y]:80"),
            want + "got '[fe80::1%eth0\r\nx: y]:80'");
  EXPECT_EQ(CheckWorkerAddress(std::string("[::1\0junk]:80", 13)),
            want + "got '" + std::string("[::1\0junk]:80", 13) + "'");
  EXPECT_EQ(CheckWorkerAddress("h..:80"), want + "got 'h..:80'");
  EXPECT_EQ(CheckWorkerAddress(".:80"), want + "got '.:80'");
  EXPECT_EQ(CheckWorkerAddress(":80"), "expected HOST:PORT, got ':80'");
  EXPECT_EQ(CheckWorkerAddress("::1:80"), want + "got '::1:80'");  // IPv6 needs its brackets
  EXPECT_EQ(CheckWorkerAddress("[::g]:80"), want + "got '[::g]:80'");
  EXPECT_EQ(CheckWorkerAddress("[h]:80"), want + "got '[h]:80'");
  EXPECT_EQ(CheckWorkerAddress("a b:80"), want + "got 'a b:80'");
  EXPECT_EQ(CheckWorkerAddress("h..example:80"), want + "got 'h..example:80'");
  EXPECT_EQ(CheckWorkerAddress("http://h:80"), want + "got 'http://h:80'");
  EXPECT_EQ(CheckWorkerAddress(std::string(64, 'a') + ":80"),
            want + "got '" + std::string(64, 'a') + ":80'");
  EXPECT_EQ(CheckWorkerAddress(std::string(63, 'a') + ":80"), "");
}

// --help is the manual: every option of the table appears in it, with its value's name.
TEST(OptionsTest, HelpDocumentsEveryOption) {
  const std::string help = HelpText();
  for (const OptionSpec& option : Options()) {
    std::string flag = std::string("--") + option.name;
    if (option.value_name) flag += std::string(" ") + option.value_name;
    EXPECT_NE(help.find(flag + "\n"), std::string::npos) << flag;
    EXPECT_GT(std::string(option.help).size(), 10u) << option.name;
  }
}

TEST(OptionsTest, JetStreamSpec) {
  JetStreamSpec spec;
  ASSERT_EQ(ParseJetStreamSpec("url=nats://127.0.0.1:4222, stream=KV,subject=kv.>,durable=a,"
                               "start=42,resume=true,create=yes,max-age-seconds=60,max-bytes=-1",
                               &spec),
            "");
  EXPECT_EQ(spec.url, "nats://127.0.0.1:4222");
  EXPECT_EQ(spec.stream, "KV");
  EXPECT_EQ(spec.subject, "kv.>");
  EXPECT_EQ(spec.durable, "a");
  EXPECT_EQ(spec.start_sequence, 42u);
  EXPECT_TRUE(spec.resume);
  EXPECT_TRUE(spec.create);
  EXPECT_EQ(spec.max_age_seconds, 60);
  EXPECT_EQ(spec.max_bytes, -1);
  EXPECT_NE(ParseJetStreamSpec("url=nats://h:1,stream=KV", &spec).find("required"),
            std::string::npos);
  EXPECT_NE(ParseJetStreamSpec("url=nats://h:1,stream=KV,subject=s,start=x", &spec).find("start"),
            std::string::npos);
  EXPECT_NE(ParseJetStreamSpec("url=nats://h:1,stream=KV,subject=s,colour=red", &spec)
                .find("unknown key"),
            std::string::npos);
}

// The row of docs/kvrouterd.md's option table for `option`: --help's words, "|" escaped.
std::string DocRow(const OptionSpec& option) {
  std::string flag = std::string("--") + option.name;
  if (option.value_name) flag += std::string(" ") + option.value_name;
  std::string help = option.help;
  if (option.repeatable) help += " [repeatable]";
  if (!option.in_config_file) help += " [command line only]";
  std::string escaped;
  for (const char c : help) {
    if (c == '|') escaped += '\\';
    escaped += c;
  }
  return "| `" + flag + "` | " + escaped + " |\n";
}

// docs/kvrouterd.md ("Running it") lists every option, each row as --help says it (the doc
// said more than --help for two options before this compared the words).
TEST(OptionsTest, DocsListEveryOptionAsHelpSaysIt) {
  std::ifstream file(KVRD_DOC);
  std::ostringstream text;
  text << file.rdbuf();
  ASSERT_FALSE(text.str().empty());
  for (const OptionSpec& option : Options()) {
    const size_t row = text.str().find(std::string("| `--") + option.name + "`");
    const size_t row_with_value = text.str().find(std::string("| `--") + option.name + " ");
    const size_t at = std::min(row, row_with_value);
    ASSERT_NE(at, std::string::npos) << option.name;
    const std::string line = text.str().substr(at, text.str().find('\n', at) + 1 - at);
    EXPECT_EQ(line, DocRow(option));
  }
}

// Every field of kvr_router_options has its option, named after the field with dashes (the
// flags word is split into one switch per bit).
TEST(OptionsTest, EveryRouterSettingHasAnOption) {
  const char* const names[] = {"block-size",
                               "queue-policy",
                               "overlap-score-credit",
                               "prefill-load-scale",
                               "host-cache-hit-weight",
                               "disk-cache-hit-weight",
                               "temperature",
                               "queue-threshold",
                               "approx-ttl-seconds",
                               "approx-max-blocks",
                               "approx-prune-target-ratio",
                               "request-expiry-seconds",
                               "random-seed",
                               "overlap-score-credit-decay",
                               "decode-active-request-weight",
                               "index-shards",
                               "cost-function",
                               "prefill-tokens-per-second",
                               "ttft-miss-weight",
                               "approximate",
                               "no-kv-reuse",
                               "no-prefill-tracking",
                               "eagle",
                               "entropy-seed",
                               "track-output-blocks",
                               "max-frame-bytes",
                               "replay-timeout-ms"};
  for (const char* name : names) {
    bool found = false;
    for (const OptionSpec& option : Options()) found = found || std::string(option.name) == name;
    EXPECT_TRUE(found) << name;
  }
}

TEST(OptionsTest, ExampleConfigParses) {
  Config config;
  ASSERT_EQ(ParseConfigFile(KVRD_EXAMPLE_CONFIG, &config), "");
  EXPECT_EQ(config.listen_port, 8080);
  ASSERT_EQ(config.workers.size(), 2u);
  EXPECT_EQ(config.workers[1].dp_size, 2u);
  ASSERT_TRUE(config.workers[1].events.has_value());
  EXPECT_EQ(config.listen_events.size(), 1u);
}

}  // namespace
}  // namespace kvrouterd

// kvrouterd's settings: one table of options drives the command-line parser, the config file
// parser (`name = value` lines whose names are the long flags without "--") and --help, so the
// three can never disagree.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvrouter.h"
#include "kvrouterd/log.h"

namespace kvrouterd {

// A worker's engine event subscription (kvr_ingest_add_engine_worker).
struct EventsSpec {
  kvr_engine engine = KVR_ENGINE_VLLM;
  std::string endpoint;
  std::string replay_endpoint;  // empty = none
  std::string topic;            // empty = every message
  bool operator==(const EventsSpec&) const = default;
};

// A worker as the API and the config file describe it (docs/kvrouterd.md, "Workers").
struct WorkerSpec {
  uint64_t worker_id = 0;
  std::string address;  // empty = none
  uint32_t dp_start = 0;
  uint32_t dp_size = 1;
  uint64_t total_kv_blocks = 0;
  uint64_t max_num_batched_tokens = 0;
  std::optional<EventsSpec> events;
  bool operator==(const WorkerSpec&) const = default;
};

struct NatsEventsSpec {
  std::string url;
  std::string subject;
  bool operator==(const NatsEventsSpec&) const = default;
};

struct ReplicaSyncSpec {
  std::string url;
  std::string subject;
  std::string replica_id;
  bool operator==(const ReplicaSyncSpec&) const = default;
};

// A JetStream stream of KV events (kvr_jetstream_source; docs/ingest.md).
struct JetStreamSpec {
  std::string url;
  std::string stream;
  std::string subject;
  std::string durable;  // empty = an ephemeral consumer
  uint64_t start_sequence = 0;
  bool resume = false;
  bool create = false;
  double max_age_seconds = 3600;
  int64_t max_bytes = int64_t{1} << 30;
  bool operator==(const JetStreamSpec&) const = default;
};

struct Config {
  // The daemon
  std::string listen_host = "127.0.0.1";
  int listen_port = 8080;
  std::string port_file;
  std::string snapshot_file;                // restored at startup, before any event source
  std::vector<std::string> bootstrap_from;  // peers' http://HOST:PORT, tried in order
  std::string config_file;
  LogLevel log_level = LogLevel::kInfo;
  uint64_t max_body_bytes = 64ull << 20;      // any body (a snapshot's)
  uint64_t max_json_body_bytes = 4ull << 20;  // a JSON body: every other one
  double request_read_timeout_seconds = 60;   // 0 = no limit
  double idle_timeout_seconds = 300;          // 0 = no limit
  uint64_t max_connections = 4096;            // HTTP connections open at once
  uint64_t max_header_bytes = 64ull << 10;
  uint64_t max_tracked_requests = 1000000;
  double max_session_ttl_seconds = 3600;  // a longer hints.session_ttl_seconds is taken as this
  double shutdown_timeout_seconds = 30;
  uint32_t routing_threads = 16;  // UV_THREADPOOL_SIZE
  uint32_t preview_threads = 2;   // QuickCallPool
  // The router (kvr_router_options, initialised with the library's defaults)
  kvr_router_options router{};
  double plan_deadline_seconds = 30;
  // Ingest
  kvr_ingest_options ingest{};
  std::vector<std::string> listen_events;
  std::vector<NatsEventsSpec> nats_events;
  std::vector<JetStreamSpec> jetstream_events;
  std::optional<JetStreamSpec> jetstream_relay;  // no durable, start or resume
  std::optional<ReplicaSyncSpec> replica_sync;
  std::vector<WorkerSpec> workers;
  // Commands
  bool help = false;
  bool version = false;

  Config();
};

// One option: its name (the long flag without "--" and the config file key), the placeholder
// of its value in --help, its help text, and how it sets the Config.
struct OptionSpec {
  const char* name;
  const char* value_name;  // nullptr: a switch (--help), which takes no value
  const char* help;
  bool repeatable;
  bool in_config_file;  // false for --config, --help, --version: command line only
  // Applies `value` to `config`; returns an error message, empty on success.
  std::string (*apply)(Config& config, std::string_view value);
};

// Every option, in --help order.
const std::vector<OptionSpec>& Options();

// The --help text: usage and every option of Options().
std::string HelpText();

// Parses the command line (argv[0] excluded). `--name value` and `--name=value`; a value of
// several words (`--nats-events URL SUBJECT`) as one argument or as consecutive ones. When it names
// a config file (--config), the file is read first and the flags then override its settings;
// repeatable keys (worker, listen-events, nats-events) add to the file's. Returns an error
// message, empty on success.
std::string ParseCommandLine(const std::vector<std::string>& args, Config* config);
// What the library cannot check of the daemon's own settings: "" when valid, else why not
// (at startup, and for each reload: an invalid reload changes nothing).
std::string ValidateConfig(const Config& config);

// Parses config file text into `config` (on top of what it holds). `origin` names the file in
// messages. Returns an error message ("FILE:LINE: ..."), empty on success.
std::string ParseConfigText(std::string_view text, std::string_view origin, Config* config);

// Reads and parses the file at `path`.
std::string ParseConfigFile(const std::string& path, Config* config);

// "HOST:PORT" (HOST may be "[v6]"), PORT from `min_port`: "" and the parts set, or why it is not.
std::string ParseHostPort(std::string_view text, std::string* host, int* port, int min_port = 0);

// Where a worker's requests go (its `address`): "" when empty (none) or a HOST:PORT a proxy can
// send to (a host name, an IPv4 address or an [IPv6] one, maybe with a zone id of letters,
// digits, '.', '-' and '_'; a port 1..65535), else why not.
std::string CheckWorkerAddress(std::string_view address);

// Parses a worker's description "id=1,address=h:p,dp-size=2,..." (the `worker` option). Like
// every option's parser, its errors do not name the option: the caller does, once.
std::string ParseWorkerSpec(std::string_view text, WorkerSpec* out);
// "url=URL,stream=NAME,subject=SUBJECT[,durable=NAME][,start=N][,resume=BOOL][,create=BOOL]
// [,max-age-seconds=S][,max-bytes=N]" (the value of --jetstream-events and --jetstream-relay).
std::string ParseJetStreamSpec(std::string_view text, JetStreamSpec* out);

// The names of the enumerations as the options and the API spell them.
std::optional<kvr_queue_policy> ParseQueuePolicy(std::string_view text);
std::optional<kvr_cost_function> ParseCostFunction(std::string_view text);
std::optional<kvr_engine> ParseEngine(std::string_view text);
const char* EngineName(kvr_engine engine);

}  // namespace kvrouterd

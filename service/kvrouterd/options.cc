#include "kvrouterd/options.h"

#include <uv.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "kvrouter_version.h"
#include "kvrouterd/bootstrap.h"

namespace kvrouterd {
namespace {

std::string_view Trim(std::string_view text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(" \t\r\n");
  return text.substr(first, last - first + 1);
}

std::vector<std::string_view> SplitWords(std::string_view text) {
  std::vector<std::string_view> words;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t start = text.find_first_not_of(" \t", pos);
    if (start == std::string_view::npos) break;
    const size_t end = std::min(text.find_first_of(" \t", start), text.size());
    words.push_back(text.substr(start, end - start));
    pos = end;
  }
  return words;
}

std::string Quoted(std::string_view value) { return "'" + std::string(value) + "'"; }

// How many words an option's value has: "URL SUBJECT" 2, "N" 1.
size_t ValueWords(const char* value_name) {
  return value_name == nullptr ? 0 : SplitWords(value_name).size();
}

template <typename T>
std::string ParseUnsigned(std::string_view text, T* out) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
    return "expected an unsigned integer, got " + Quoted(text);
  }
  *out = value;
  return {};
}

std::string ParseDouble(std::string_view text, double* out) {
  const std::string copy(text);
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(copy.c_str(), &end);
  if (copy.empty() || end != copy.c_str() + copy.size() || errno == ERANGE) {
    return "expected a number, got " + Quoted(text);
  }
  *out = value;
  return {};
}

std::string ParseBool(std::string_view text, bool* out) {
  if (text == "true" || text == "yes" || text == "1" || text == "on") {
    *out = true;
  } else if (text == "false" || text == "no" || text == "0" || text == "off") {
    *out = false;
  } else {
    return "expected true or false, got " + Quoted(text);
  }
  return {};
}

// A boolean option that sets (or clears) one bit of kvr_router_options.flags.
std::string SetFlag(std::string_view text, uint32_t* flags, uint32_t bit) {
  bool on = false;
  if (std::string error = ParseBool(text, &on); !error.empty()) return error;
  *flags = on ? (*flags | bit) : (*flags & ~bit);
  return {};
}

std::string NoValue(Config&, std::string_view) { return {}; }

// What the HTTP server binds: an IPv4 or IPv6 address as libuv parses them (no name lookup).
bool IsIpAddress(const std::string& host) {
  sockaddr_in v4{};
  sockaddr_in6 v6{};
  return uv_ip4_addr(host.c_str(), 0, &v4) == 0 || uv_ip6_addr(host.c_str(), 0, &v6) == 0;
}

// A DNS name or an IPv4 address in dotted form: labels of letters, digits, '-' and '_' (some
// service names have one), 1 to 63 bytes each, 253 in all, and maybe the root's dot after them
// (a fully qualified name, which resolvers look up as it is).
bool IsHostName(std::string_view host) {
  if (!host.empty() && host.back() == '.') host.remove_suffix(1);
  if (host.empty() || host.size() > 253) return false;
  size_t label = 0;
  for (const char c : host) {
    if (c == '.') {
      if (label == 0) return false;
      label = 0;
    } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') {
      if (++label > 63) return false;
    } else {
      return false;
    }
  }
  return label > 0;
}

// What an address may hold at all: no space, control byte or NUL, which would end up in a
// proxy's header (libuv reads an IPv6 zone id up to a NUL, whatever it holds).
bool IsAddressText(std::string_view address) {
  return std::all_of(address.begin(), address.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) ||
           std::string_view("-._:[]%").find(c) != std::string_view::npos;
  });
}

}  // namespace

// "HOST:PORT" or "[IPV6]:PORT".
std::string ParseHostPort(std::string_view text, std::string* host, int* port, int min_port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return "expected HOST:PORT, got " + Quoted(text);
  }
  std::string_view host_part = text.substr(0, colon);
  if (host_part.size() >= 2 && host_part.front() == '[' && host_part.back() == ']') {
    host_part = host_part.substr(1, host_part.size() - 2);
  }
  uint32_t value = 0;
  if (!ParseUnsigned(text.substr(colon + 1), &value).empty() || value > 65535 ||
      value < static_cast<uint32_t>(min_port)) {
    return "expected a port " + std::to_string(min_port) + "..65535 in " + Quoted(text);
  }
  *host = std::string(host_part);
  *port = static_cast<int>(value);
  return {};
}

std::string CheckWorkerAddress(std::string_view address) {
  if (address.empty()) return {};  // none
  std::string host;
  int port = 0;
  if (std::string error = ParseHostPort(address, &host, &port, /*min_port=*/1); !error.empty()) {
    return error;
  }
  sockaddr_in6 v6{};
  const bool valid =
      IsAddressText(address) &&
      (address.front() == '[' ? uv_ip6_addr(host.c_str(), 0, &v6) == 0 : IsHostName(host));
  if (!valid) {
    return "expected HOST:PORT (a host name, an IPv4 address or an [IPv6] one), got " +
           Quoted(address);
  }
  return {};
}

Config::Config() {
  kvr_router_options_init(&router, sizeof router);
  kvr_ingest_options_init(&ingest, sizeof ingest);
}

std::optional<kvr_queue_policy> ParseQueuePolicy(std::string_view text) {
  if (text == "fcfs") return KVR_QUEUE_FCFS;
  if (text == "lcfs") return KVR_QUEUE_LCFS;
  if (text == "wspt") return KVR_QUEUE_WSPT;
  return std::nullopt;
}

std::optional<kvr_cost_function> ParseCostFunction(std::string_view text) {
  if (text == "credit") return KVR_COST_CREDIT;
  if (text == "predicted_ttft") return KVR_COST_PREDICTED_TTFT;
  return std::nullopt;
}

std::optional<kvr_engine> ParseEngine(std::string_view text) {
  if (text == "vllm") return KVR_ENGINE_VLLM;
  if (text == "sglang") return KVR_ENGINE_SGLANG;
  return std::nullopt;
}

const char* EngineName(kvr_engine engine) {
  return engine == KVR_ENGINE_SGLANG ? "sglang" : "vllm";
}

// Calls `item(key, value)` for each comma-separated KEY=VALUE of `text`; the first error (from
// the text or from `item`, then prefixed with the key) is returned.
template <typename Item>
std::string ForEachKeyValue(std::string_view text, Item item) {
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string_view entry = Trim(text.substr(pos, comma - pos));
    pos = comma + 1;
    if (entry.empty()) continue;
    const size_t eq = entry.find('=');
    if (eq == std::string_view::npos) {
      return "expected KEY=VALUE, got " + Quoted(entry);
    }
    const std::string_view key = Trim(entry.substr(0, eq));
    if (std::string error = item(key, Trim(entry.substr(eq + 1))); !error.empty()) {
      return std::string(key) + ": " + error;
    }
  }
  return {};
}

std::string ParseWorkerSpec(std::string_view text, WorkerSpec* out) {
  WorkerSpec worker;
  EventsSpec events;
  bool has_id = false;
  bool has_events_key = false;
  std::string error = ForEachKeyValue(text, [&](std::string_view key, std::string_view value) {
    std::string error;
    if (key == "id") {
      error = ParseUnsigned(value, &worker.worker_id);
      has_id = true;
    } else if (key == "address") {
      error = CheckWorkerAddress(value);
      worker.address = value;
    } else if (key == "dp-start") {
      error = ParseUnsigned(value, &worker.dp_start);
    } else if (key == "dp-size") {
      error = ParseUnsigned(value, &worker.dp_size);
    } else if (key == "total-kv-blocks") {
      error = ParseUnsigned(value, &worker.total_kv_blocks);
    } else if (key == "max-num-batched-tokens") {
      error = ParseUnsigned(value, &worker.max_num_batched_tokens);
    } else if (key == "engine") {
      const auto engine = ParseEngine(value);
      if (!engine) return "must be vllm or sglang, got " + Quoted(value);
      events.engine = *engine;
    } else if (key == "events") {
      events.endpoint = value;
      has_events_key = true;
    } else if (key == "replay") {
      events.replay_endpoint = value;
    } else if (key == "topic") {
      events.topic = value;
    } else {
      return std::string(
          "unknown key (id, address, dp-start, dp-size, total-kv-blocks, "
          "max-num-batched-tokens, engine, events, replay, topic)");
    }
    return error;
  });
  if (!error.empty()) return error;
  if (!has_id) return "id=N is required";
  if (!has_events_key && !events.replay_endpoint.empty()) {
    return "replay= needs events=";
  }
  if (has_events_key) worker.events = events;
  *out = worker;
  return {};
}

std::string ParseJetStreamSpec(std::string_view text, JetStreamSpec* out) {
  JetStreamSpec spec;
  std::string error = ForEachKeyValue(text, [&](std::string_view key, std::string_view value) {
    if (key == "url") {
      spec.url = value;
    } else if (key == "stream") {
      spec.stream = value;
    } else if (key == "subject") {
      spec.subject = value;
    } else if (key == "durable") {
      spec.durable = value;
    } else if (key == "start") {
      return ParseUnsigned(value, &spec.start_sequence);
    } else if (key == "resume") {
      return ParseBool(value, &spec.resume);
    } else if (key == "create") {
      return ParseBool(value, &spec.create);
    } else if (key == "max-age-seconds") {
      return ParseDouble(value, &spec.max_age_seconds);
    } else if (key == "max-bytes") {
      const std::string parsed = std::string(value);
      char* end = nullptr;
      spec.max_bytes = std::strtoll(parsed.c_str(), &end, 10);
      if (parsed.empty() || *end != '\0') return "expected an integer, got " + Quoted(value);
    } else {
      return std::string(
          "unknown key (url, stream, subject, durable, start, resume, create, "
          "max-age-seconds, max-bytes)");
    }
    return std::string();
  });
  if (!error.empty()) return error;
  if (spec.url.empty() || spec.stream.empty() || spec.subject.empty()) {
    return "url=, stream= and subject= are required";
  }
  *out = spec;
  return {};
}

const std::vector<OptionSpec>& Options() {
  // clang-format off
  static const std::vector<OptionSpec> options = {
    // Commands and files
    {"help", nullptr, "print this help and exit", false, false, NoValue},
    {"version", nullptr, "print the version and exit", false, false, NoValue},
    {"config", "PATH", "read settings from PATH: `name = value` lines (# starts a comment) whose "
     "names are these options without --; flags given too override the file. SIGHUP re-reads it",
     false, false, [](Config& c, std::string_view v) { c.config_file = v; return std::string(); }},
    // The HTTP server
    {"listen", "HOST:PORT", "address of the HTTP API (default 127.0.0.1:8080; HOST is an IPv4 "
     "or [IPv6] address, not a name; port 0 = a free port, logged and written to --port-file)",
     false, true,
     [](Config& c, std::string_view v) {
       std::string error = ParseHostPort(v, &c.listen_host, &c.listen_port);
       if (error.empty() && !IsIpAddress(c.listen_host)) {
         error = "expected an IP address (127.0.0.1, 0.0.0.0, [::1]; not a host name), got " +
                 Quoted(c.listen_host);
       }
       return error;
     }},
    {"port-file", "PATH", "write the bound HTTP port to PATH once listening", false, true,
     [](Config& c, std::string_view v) { c.port_file = v; return std::string(); }},
    {"snapshot-file", "PATH", "restore the KV index from PATH (the body of a GET /v1/snapshot, "
     "e.g. a peer's) at startup, before any event source starts; with --jetstream-events, start "
     "at the peer's kvrouter_ingest_stream_sequence + 1, read before taking the snapshot",
     false, true, [](Config& c, std::string_view v) { c.snapshot_file = v; return std::string(); }},
    {"bootstrap-from", "URL", "start warm from a running peer, http://HOST:PORT (repeatable: the "
     "first that answers within 30 s): restore its GET /v1/snapshot before any event source "
     "starts, and consume each --jetstream-events stream from the position after the one the "
     "peer had applied (replacing this router's durable consumer); with no peer answering, start "
     "cold from the configured positions (logged). Not with --snapshot-file", true, true,
     [](Config& c, std::string_view v) {
       std::string host;
       int port = 0;
       std::string error = ParsePeerUrl(v, &host, &port);
       if (error.empty()) c.bootstrap_from.emplace_back(v);
       return error;
     }},
    {"log-level", "LEVEL", "debug, info (default), warn or error; debug logs every HTTP request",
     false, true, [](Config& c, std::string_view v) {
       return ParseLogLevel(v, &c.log_level) ? std::string()
                                             : "expected debug, info, warn or error, got " + Quoted(v);
     }},
    {"max-body-bytes", "N", "largest request body accepted (default 64 MiB: a PUT /v1/snapshot); "
     "larger is 413", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.max_body_bytes); }},
    {"max-json-body-bytes", "N", "largest JSON request body accepted, every body but a snapshot's "
     "(default 4 MiB: a prompt of about 600,000 token ids; parsed, a body takes 4 to 32 times its "
     "size); larger is 413", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.max_json_body_bytes); }},
    {"request-read-timeout-seconds", "S", "a request whose line, headers and body have not all "
     "arrived S after its first byte is answered 408 and its connection closed; also how long a "
     "refused connection is drained at most (default 60; 0 = no limit on a request, and a "
     "refused connection is drained for idle-timeout-seconds)",
     false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.request_read_timeout_seconds); }},
    {"idle-timeout-seconds", "S", "a connection with no request under way for S (a keep-alive "
     "connection between requests, one that never sends) is closed (default 300, longer than "
     "clients' own pool timeouts such as Go's 90 s, so that they close first; 0 = no limit); "
     "an answer still being written is under way while the client reads it",
     false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.idle_timeout_seconds); }},
    {"max-connections", "N", "HTTP connections open at once; one more is accepted and closed at "
     "once, counted in kvrouterd_http_connections_refused_total (default 4096; each holds a "
     "descriptor: keep it below the open-file limit, ulimit -n, less the event sources' own)",
     false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.max_connections); }},
    {"max-header-bytes", "N", "largest request line and headers accepted, 1024..81920 (default "
     "64 KiB; http_parser's own limit is 80 KiB); larger is 431", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.max_header_bytes); }},
    {"max-tracked-requests", "N", "booked request ids remembered for idempotent retries "
     "(default 1000000; the oldest are forgotten first)", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.max_tracked_requests); }},
    {"max-session-ttl-seconds", "S", "the longest session binding: a request's "
     "hints.session_ttl_seconds above S is taken as S (default 3600, an hour; each live binding "
     "holds its session id until it expires; inf = no limit)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.max_session_ttl_seconds); }},
    {"shutdown-timeout-seconds", "S", "on SIGTERM, how long requests waiting in the admission "
     "queue may take before they are cancelled, and answers still being written (to clients "
     "reading slowly or not at all) before their connections are closed (default 30; inf = "
     "never)",
     false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.shutdown_timeout_seconds); }},
    {"routing-threads", "N", "threads running the routing calls that may wait in the admission "
     "queue (route, plan), 1..1024 (default 16); a request beyond them waits for one", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.routing_threads); }},
    {"preview-threads", "N", "threads parsing and running previews (and digests), off the event "
     "loop and apart from the routing threads (a preview never waits in the admission queue), "
     "1..64 (default 2)", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.preview_threads); }},
    // The router: kvr_router_options
    {"block-size", "N", "tokens per KV block (default 16); every worker must match", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.router.block_size); }},
    {"approximate", "BOOL", "approximate mode: no KV events, routing decisions are recorded as "
     "cached blocks (default false)", false, true,
     [](Config& c, std::string_view v) { return SetFlag(v, &c.router.flags, KVR_ROUTER_APPROXIMATE); }},
    {"no-kv-reuse", "BOOL", "assume_kv_reuse = false (default false)", false, true,
     [](Config& c, std::string_view v) { return SetFlag(v, &c.router.flags, KVR_ROUTER_NO_KV_REUSE); }},
    {"no-prefill-tracking", "BOOL", "track_prefill_tokens = false (default false)", false, true,
     [](Config& c, std::string_view v) {
       return SetFlag(v, &c.router.flags, KVR_ROUTER_NO_PREFILL_TRACKING);
     }},
    {"eagle", "BOOL", "the model uses eagle block windows (default false)", false, true,
     [](Config& c, std::string_view v) { return SetFlag(v, &c.router.flags, KVR_ROUTER_EAGLE); }},
    {"entropy-seed", "BOOL", "seed the random source from the OS, not random-seed (default false)",
     false, true,
     [](Config& c, std::string_view v) { return SetFlag(v, &c.router.flags, KVR_ROUTER_ENTROPY_SEED); }},
    {"track-output-blocks", "BOOL", "grow requests' blocks as they generate "
     "(POST /v1/requests/{id}/output; default false)", false, true,
     [](Config& c, std::string_view v) {
       return SetFlag(v, &c.router.flags, KVR_ROUTER_TRACK_OUTPUT_BLOCKS);
     }},
    {"queue-policy", "POLICY", "admission queue order: fcfs (default), lcfs or wspt", false, true,
     [](Config& c, std::string_view v) {
       const auto policy = ParseQueuePolicy(v);
       if (!policy) return "expected fcfs, lcfs or wspt, got " + Quoted(v);
       c.router.queue_policy = *policy;
       return std::string();
     }},
    {"overlap-score-credit", "X", "weight of a device cache hit (default 1.0)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.overlap_score_credit); }},
    {"prefill-load-scale", "X", "weight of the prefill term (default 1.0)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.prefill_load_scale); }},
    {"host-cache-hit-weight", "X", "weight of a host memory hit (default 0.75)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.host_cache_hit_weight); }},
    {"disk-cache-hit-weight", "X", "weight of a disk or external hit (default 0.25)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.disk_cache_hit_weight); }},
    {"temperature", "X", "softmax temperature; 0 = argmin with a random tie-break (default)",
     false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.temperature); }},
    {"queue-threshold", "X", "queue while every rank has more than X x max_num_batched_tokens "
     "prefill tokens in flight; negative = never queue (default)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.queue_threshold); }},
    {"approx-ttl-seconds", "S", "approximate mode: block TTL (default 120)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.approx_ttl_seconds); }},
    {"approx-max-blocks", "N", "approximate mode: index budget in blocks (default 1048576)",
     false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.router.approx_max_blocks); }},
    {"approx-prune-target-ratio", "X", "approximate mode: prune to this fraction of the budget "
     "(default 0.8)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.approx_prune_target_ratio); }},
    {"request-expiry-seconds", "S", "a booked request older than this is dropped (default 300; "
     "checked every second, and every routing call sweeps at most every min(30 s, S)), "
     "admitting whom the queue held behind it; the daemon forgets its id as well", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.request_expiry_seconds); }},
    {"random-seed", "N", "seed of the random tie-break and softmax (default 0)", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.router.random_seed); }},
    {"overlap-score-credit-decay", "X", "discount of a device hit behind a long prefill queue "
     "(default 0 = off)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.overlap_score_credit_decay); }},
    {"decode-active-request-weight", "X", "cost per active request of a rank (default 0 = off)",
     false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.decode_active_request_weight); }},
    {"index-shards", "N", "trees the KV index splits the workers over, 1..64 (default 1)", false,
     true, [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.router.index_shards); }},
    {"cost-function", "NAME", "credit (Dynamo's, default) or predicted_ttft", false, true,
     [](Config& c, std::string_view v) {
       const auto function = ParseCostFunction(v);
       if (!function) return "expected credit or predicted_ttft, got " + Quoted(v);
       c.router.cost_function = *function;
       return std::string();
     }},
    {"prefill-tokens-per-second", "X", "predicted_ttft: prefill rate assumed before the first "
     "completion (default 0 = unknown)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.prefill_tokens_per_second); }},
    {"ttft-miss-weight", "X", "predicted_ttft: weight of a miss's delay to later requests "
     "(default 3)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.router.ttft_miss_weight); }},
    {"plan-deadline-seconds", "S", "a plan neither committed nor aborted within S is dropped "
     "(default 30; checked every second)", false, true,
     [](Config& c, std::string_view v) { return ParseDouble(v, &c.plan_deadline_seconds); }},
    // Ingest
    {"max-frame-bytes", "N", "largest native event stream frame (default and maximum 64 MiB)",
     false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.ingest.max_frame_bytes); }},
    {"replay-timeout-ms", "MS", "a vLLM replay taking longer falls back to clearing the worker "
     "(default 2000)", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.ingest.replay_timeout_ms); }},
    {"listen-events", "ENDPOINT", "listen for native KV event streams on tcp://HOST:PORT or "
     "unix://PATH", true, true,
     [](Config& c, std::string_view v) { c.listen_events.emplace_back(v); return std::string(); }},
    {"nats-events", "URL SUBJECT", "subscribe to KV events on a NATS subject (native batches or "
     "Dynamo's event plane; repeatable)", true, true,
     [](Config& c, std::string_view v) {
       const auto words = SplitWords(v);
       if (words.size() != 2) return "expected URL SUBJECT, got " + Quoted(v);
       c.nats_events.push_back({std::string(words[0]), std::string(words[1])});
       return std::string();
     }},
    {"jetstream-events", "SPEC", "consume KV events from a NATS JetStream stream, each message "
     "acknowledged once applied (repeatable): url=URL,stream=NAME,subject=SUBJECT[,durable=NAME]"
     "[,start=SEQ][,resume=BOOL][,create=BOOL][,max-age-seconds=S][,max-bytes=N]; durable names "
     "this router's consumer, create makes the stream with that retention", true, true,
     [](Config& c, std::string_view v) {
       JetStreamSpec spec;
       std::string error = ParseJetStreamSpec(v, &spec);
       if (error.empty()) c.jetstream_events.push_back(std::move(spec));
       return error;
     }},
    {"jetstream-relay", "SPEC", "republish every change the other event sources make to the KV "
     "index into a NATS JetStream stream, on SUBJECT.<worker id>, for routers that consume it "
     "with --jetstream-events on SUBJECT.> (how vLLM and SGLang engines feed a stream): "
     "url=URL,stream=NAME,subject=SUBJECT[,create=BOOL][,max-age-seconds=S][,max-bytes=N]; "
     "SUBJECT is a prefix without wildcards", false, true,
     [](Config& c, std::string_view v) {
       JetStreamSpec spec;
       std::string error = ParseJetStreamSpec(v, &spec);
       if (error.empty() && (!spec.durable.empty() || spec.start_sequence != 0 || spec.resume)) {
         error = "durable=, start= and resume= are a consumer's";
       }
       if (error.empty()) c.jetstream_relay = std::move(spec);
       return error;
     }},
    {"replica-heartbeat-ms", "MS", "replica sync: send a heartbeat every MS (default 1000; 0 = "
     "none)", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.ingest.replica_heartbeat_ms); }},
    {"replica-timeout-ms", "MS", "replica sync: drop the bookings of a replica that sent "
     "heartbeats and has been silent for MS (default 10000; 0 = never)", false, true,
     [](Config& c, std::string_view v) { return ParseUnsigned(v, &c.ingest.replica_timeout_ms); }},
    {"replica-sync", "URL SUBJECT REPLICA_ID", "share this router's bookings with other replicas "
     "over NATS", false, true,
     [](Config& c, std::string_view v) {
       const auto words = SplitWords(v);
       if (words.size() != 3) return "expected URL SUBJECT REPLICA_ID, got " + Quoted(v);
       c.replica_sync = ReplicaSyncSpec{std::string(words[0]), std::string(words[1]),
                                        std::string(words[2])};
       return std::string();
     }},
    {"worker", "SPEC", "a worker (repeatable): id=N[,address=HOST:PORT][,dp-start=N][,dp-size=N]"
     "[,total-kv-blocks=N][,max-num-batched-tokens=N][,engine=vllm|sglang,events=tcp://HOST:PORT"
     "[,replay=tcp://HOST:PORT][,topic=T]]; with events= the daemon subscribes to the engine's "
     "KV events. SIGHUP applies the config file's changes to these workers", true, true,
     [](Config& c, std::string_view v) {
       WorkerSpec worker;
       std::string error = ParseWorkerSpec(v, &worker);
       if (error.empty()) c.workers.push_back(std::move(worker));
       return error;
     }},
  };
  // clang-format on
  return options;
}

std::string HelpText() {
  std::ostringstream out;
  out << "Usage: kvrouterd [--config PATH] [OPTION...]\n\n"
         "kvrouterd serves one kvrouter router over HTTP/JSON (docs/kvrouterd.md) and ingests\n"
         "the engines' KV events. Every option may also be set in the config file as\n"
         "`name = value`. Signals: SIGHUP re-reads the config file (workers, log-level);\n"
         "SIGTERM or SIGINT stop gracefully.\n\nOptions:\n";
  for (const OptionSpec& option : Options()) {
    std::string left = std::string("  --") + option.name;
    if (option.value_name) left += std::string(" ") + option.value_name;
    out << left << "\n      " << option.help;
    if (option.repeatable) out << " [repeatable]";
    if (!option.in_config_file) out << " [command line only]";
    out << "\n";
  }
  return out.str();
}

namespace {

const OptionSpec* FindOption(std::string_view name) {
  for (const OptionSpec& option : Options()) {
    if (name == option.name) return &option;
  }
  return nullptr;
}

// A setting not yet applied: the command line's flags wait until the config file is read.
struct PendingSetting {
  const OptionSpec* option;
  std::string value;
};

std::string Apply(const PendingSetting& setting, Config* config) {
  const std::string error = setting.option->apply(*config, setting.value);
  return error.empty() ? std::string() : std::string(setting.option->name) + ": " + error;
}

}  // namespace

// What the library cannot check for the daemon's own settings.
std::string ValidateConfig(const Config& config) {
  if (config.max_body_bytes == 0) return "max-body-bytes: must be > 0";
  if (config.max_json_body_bytes == 0) return "max-json-body-bytes: must be > 0";
  if (!(config.request_read_timeout_seconds >= 0)) {
    return "request-read-timeout-seconds: must be >= 0";
  }
  if (!(config.idle_timeout_seconds >= 0)) return "idle-timeout-seconds: must be >= 0";
  if (config.max_connections == 0) return "max-connections: must be > 0";
  if (config.max_header_bytes < 1024 || config.max_header_bytes > 80 * 1024) {
    return "max-header-bytes: must be 1024..81920 (http_parser stops at 80 KiB)";
  }
  if (config.max_tracked_requests == 0) return "max-tracked-requests: must be > 0";
  if (!(config.max_session_ttl_seconds > 0)) return "max-session-ttl-seconds: must be > 0";
  if (!(config.shutdown_timeout_seconds >= 0)) return "shutdown-timeout-seconds: must be >= 0";
  if (config.routing_threads < 1 || config.routing_threads > 1024) {
    return "routing-threads: must be 1..1024";
  }
  if (config.preview_threads < 1 || config.preview_threads > 64) {
    return "preview-threads: must be 1..64";
  }
  if (!config.snapshot_file.empty() && !config.bootstrap_from.empty()) {
    return "snapshot-file and bootstrap-from: one warm start or the other, not both";
  }
  // As the library checks it (kvr_ingest_sync_replicas), before any source connects.
  if (config.replica_sync && config.replica_sync->replica_id.size() > 256) {
    return "replica-sync: the replica id must be at most 256 bytes";
  }
  return {};
}

std::string ParseCommandLine(const std::vector<std::string>& args, Config* config) {
  std::vector<PendingSetting> settings;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0) return "unexpected argument '" + arg + "' (see --help)";
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const OptionSpec* option = FindOption(name);
    if (!option) return "unknown option --" + name + " (see --help)";
    if (!option->value_name) {
      if (eq != std::string::npos) return "--" + name + " takes no value";
      if (name == "help") config->help = true;
      if (name == "version") config->version = true;
      continue;
    }
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      return "--" + name + " needs a value (" + option->value_name + ")";
    }
    // A value of several words (--nats-events URL SUBJECT) is one argument or several.
    while (SplitWords(value).size() < ValueWords(option->value_name) && i + 1 < args.size() &&
           args[i + 1].rfind("--", 0) != 0) {
      value += " " + args[++i];
    }
    settings.push_back({option, value});
  }
  for (const PendingSetting& setting : settings) {  // --config first: the flags override it
    if (std::string(setting.option->name) != "config") continue;
    if (std::string error = Apply(setting, config); !error.empty()) return error;
    if (std::string error = ParseConfigFile(config->config_file, config); !error.empty()) {
      return error;
    }
  }
  for (const PendingSetting& setting : settings) {
    if (std::string(setting.option->name) == "config") continue;
    if (std::string error = Apply(setting, config); !error.empty()) return error;
  }
  return {};
}

std::string ParseConfigText(std::string_view text, std::string_view origin, Config* config) {
  size_t line_number = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t end = std::min(text.find('\n', pos), text.size());
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_number;
    const std::string where = std::string(origin) + ":" + std::to_string(line_number) + ": ";
    if (const size_t hash = line.find('#'); hash != std::string_view::npos) {
      line = line.substr(0, hash);
    }
    line = Trim(line);
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) return where + "expected `name = value`";
    const std::string name(Trim(line.substr(0, eq)));
    const OptionSpec* option = FindOption(name);
    if (!option) return where + "unknown setting '" + name + "'";
    if (!option->in_config_file) return where + "'" + name + "' is a command-line option only";
    const std::string error = option->apply(*config, Trim(line.substr(eq + 1)));
    if (!error.empty()) return where + name + ": " + error;
  }
  return {};
}

std::string ParseConfigFile(const std::string& path, Config* config) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return "cannot read the config file '" + path + "'";
  std::ostringstream text;
  text << file.rdbuf();
  return ParseConfigText(text.str(), path, config);
}

}  // namespace kvrouterd

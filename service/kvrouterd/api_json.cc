#include "kvrouterd/api_json.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string_view>

namespace kvrouterd {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxExactJsonInteger = 1ull << 53;

[[noreturn]] void Invalid(const std::string& message) {
  throw ApiError(KVR_INVALID_ARGUMENT, message);
}

// A field the daemon does not know is refused, not ignored: a misspelt "allowed_worker_ids"
// would otherwise route unrestricted, and a field of a later version would seem to work.
void RefuseUnknownFields(const json& object, std::initializer_list<std::string_view> known,
                         const std::string& prefix) {
  for (const auto& [key, value] : object.items()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    constexpr size_t kShown = 64;  // the name is echoed, not a megabyte of it
    const std::string shown = key.size() > kShown ? key.substr(0, kShown) + "..." : key;
    Invalid(prefix + shown + ": unknown field");
  }
}

const json* Find(const json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

uint64_t UnsignedField(const json& value, const std::string& field, uint64_t max) {
  if (!value.is_number_unsigned() && !(value.is_number_integer() && value.get<int64_t>() >= 0)) {
    Invalid(field + ": expected an unsigned integer");
  }
  const uint64_t number = value.get<uint64_t>();
  if (number > max) Invalid(field + ": " + std::to_string(number) + " is out of range");
  return number;
}

double DoubleField(const json& value, const std::string& field) {
  if (!value.is_number()) Invalid(field + ": expected a number");
  return value.get<double>();
}

bool BoolField(const json& value, const std::string& field) {
  if (!value.is_boolean()) Invalid(field + ": expected true or false");
  return value.get<bool>();
}

std::string StringField(const json& value, const std::string& field) {
  if (!value.is_string()) Invalid(field + ": expected a string");
  std::string text = value.get<std::string>();
  // The library takes C strings: "a\u0000x" would be "a" there (two such ids one booking).
  if (text.find('\0') != std::string::npos) Invalid(field + ": must not contain NUL (\\u0000)");
  return text;
}

template <typename T>
void SetUnsigned(const json& object, const char* key, const std::string& prefix, T* out) {
  if (const json* value = Find(object, key)) {
    *out = static_cast<T>(UnsignedField(*value, prefix + key, std::numeric_limits<T>::max()));
  }
}

void SetDouble(const json& object, const char* key, const std::string& prefix, double* out) {
  if (const json* value = Find(object, key)) *out = DoubleField(*value, prefix + key);
}

void SetTriState(const json& object, const char* key, const std::string& prefix, int32_t* out) {
  if (const json* value = Find(object, key)) *out = BoolField(*value, prefix + key) ? 1 : 0;
}

int32_t RankField(const json& value, const std::string& field) {
  return static_cast<int32_t>(UnsignedField(value, field, INT32_MAX));
}

void ParseOverrides(const json& overrides, kvr_request_options* options) {
  if (!overrides.is_object()) Invalid("overrides: expected an object");
  const std::string prefix = "overrides.";
  RefuseUnknownFields(overrides,
                      {"overlap_score_credit", "prefill_load_scale", "temperature",
                       "host_cache_hit_weight", "disk_cache_hit_weight", "assume_kv_reuse",
                       "track_prefill_tokens", "overlap_score_credit_decay",
                       "decode_active_request_weight", "ttft_miss_weight", "cost_function"},
                      prefix);
  SetDouble(overrides, "overlap_score_credit", prefix, &options->overlap_score_credit);
  SetDouble(overrides, "prefill_load_scale", prefix, &options->prefill_load_scale);
  SetDouble(overrides, "temperature", prefix, &options->temperature);
  SetDouble(overrides, "host_cache_hit_weight", prefix, &options->host_cache_hit_weight);
  SetDouble(overrides, "disk_cache_hit_weight", prefix, &options->disk_cache_hit_weight);
  SetTriState(overrides, "assume_kv_reuse", prefix, &options->assume_kv_reuse);
  SetTriState(overrides, "track_prefill_tokens", prefix, &options->track_prefill_tokens);
  SetDouble(overrides, "overlap_score_credit_decay", prefix, &options->overlap_score_credit_decay);
  SetDouble(overrides, "decode_active_request_weight", prefix,
            &options->decode_active_request_weight);
  SetDouble(overrides, "ttft_miss_weight", prefix, &options->ttft_miss_weight);
  if (const json* value = Find(overrides, "cost_function")) {
    const auto function = ParseCostFunction(StringField(*value, prefix + "cost_function"));
    if (!function) Invalid("overrides.cost_function: expected \"credit\" or \"predicted_ttft\"");
    options->cost_function = static_cast<int32_t>(*function);
  }
}

void ParseHints(const json& hints, RouteInput* input) {
  if (!hints.is_object()) Invalid("hints: expected an object");
  RefuseUnknownFields(
      hints,
      {"worker_id", "prefill_worker_id", "decode_worker_id", "dp_rank", "prefill_dp_rank",
       "session_id", "session_mode", "session_ttl_seconds", "phase"},
      "hints.");
  kvr_routing_hints& out = input->hints;
  if (const json* v = Find(hints, "worker_id")) out.worker_id = IdFromJson(*v, "hints.worker_id");
  if (const json* v = Find(hints, "prefill_worker_id")) {
    out.prefill_worker_id = IdFromJson(*v, "hints.prefill_worker_id");
  }
  if (const json* v = Find(hints, "decode_worker_id")) {
    out.decode_worker_id = IdFromJson(*v, "hints.decode_worker_id");
  }
  if (const json* v = Find(hints, "dp_rank")) out.dp_rank = RankField(*v, "hints.dp_rank");
  if (const json* v = Find(hints, "prefill_dp_rank")) {
    out.prefill_dp_rank = RankField(*v, "hints.prefill_dp_rank");
  }
  if (const json* v = Find(hints, "session_id")) {
    input->session_id = StringField(*v, "hints.session_id");
    CheckSessionId(*input->session_id, "hints.session_id");
  }
  if (const json* v = Find(hints, "session_mode")) {
    const std::string mode = StringField(*v, "hints.session_mode");
    if (mode == "hard") {
      out.session_mode = KVR_SESSION_HARD;
    } else if (mode == "soft") {
      out.session_mode = KVR_SESSION_SOFT;
    } else {
      Invalid("hints.session_mode: expected \"hard\" or \"soft\"");
    }
  }
  SetDouble(hints, "session_ttl_seconds", "hints.", &out.session_ttl_seconds);
  if (const json* v = Find(hints, "phase")) {
    const std::string phase = StringField(*v, "hints.phase");
    if (phase == "aggregated") {
      out.phase = KVR_PHASE_AGGREGATED;
    } else if (phase == "prefill") {
      out.phase = KVR_PHASE_PREFILL;
    } else if (phase == "decode") {
      out.phase = KVR_PHASE_DECODE;
    } else {
      Invalid("hints.phase: expected \"aggregated\", \"prefill\" or \"decode\"");
    }
  }
}

std::vector<std::string> SplitPath(const std::string& path) {
  std::vector<std::string> segments;
  size_t pos = 1;  // after the leading '/'
  while (pos <= path.size()) {
    const size_t slash = std::min(path.find('/', pos), path.size());
    segments.push_back(path.substr(pos, slash - pos));
    pos = slash + 1;
  }
  return segments;
}

}  // namespace

void CheckSessionId(const std::string& id, const std::string& field) {
  if (id.size() > kMaxSessionIdBytes) {
    Invalid(field + ": " + std::to_string(id.size()) + " bytes, longer than the " +
            std::to_string(kMaxSessionIdBytes) + " a session id may have");
  }
}

void ThrowIfError(kvr_status status, kvr_error*& err) {
  kvr_error* owned = err;
  err = nullptr;
  if (status == KVR_OK) {
    kvr_error_free(owned);
    return;
  }
  const std::string message = owned ? kvr_error_message(owned) : kvr_status_str(status);
  kvr_error_free(owned);
  throw ApiError(status, message);
}

int HttpStatusFor(kvr_status status) {
  switch (status) {
    case KVR_INVALID_ARGUMENT:
    case KVR_BUFFER_TOO_SMALL:
      return 400;
    case KVR_NOT_FOUND:
      return 404;
    case KVR_ALREADY_EXISTS:
    case KVR_FAILED_PRECONDITION:
    case KVR_CANCELLED:
      return 409;
    case KVR_RESOURCE_EXHAUSTED:
      return 429;
    case KVR_UNAVAILABLE:
      return 503;
    case KVR_DEADLINE_EXCEEDED:
      return 504;
    default:
      return 500;
  }
}

// The status names as the contract spells them: kvr_status's names without KVR_.
static const char* StatusName(kvr_status status) {
  switch (status) {
#define KVRD_STATUS_NAME_(name, value, description) \
  case value:                                       \
    return #name;
    KVR_STATUS_MAP(KVRD_STATUS_NAME_)
#undef KVRD_STATUS_NAME_
  }
  return "INTERNAL";
}

HttpResponse ErrorAnswer(const ApiError& error) {
  return ErrorResponse(HttpStatusFor(error.status()), StatusName(error.status()), error.what());
}

HttpResponse JsonAnswer(const json& body, int status) {
  HttpResponse response;
  response.status = status;
  response.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  return response;
}

// Refuses a body nesting arrays and objects deeper than kMaxJsonDepth before it is parsed: a
// parse tree costs tens of bytes per level, and no body of the API nests more than 3 deep.
static void CheckJsonDepth(std::string_view body) {
  size_t depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (const char ch : body) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (ch == '\\') {
        escaped = true;
      } else if (ch == '"') {
        in_string = false;
      }
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > kMaxJsonDepth) {
        Invalid("the body nests arrays and objects deeper than " + std::to_string(kMaxJsonDepth) +
                " levels");
      }
    } else if ((ch == ']' || ch == '}') && depth > 0) {
      --depth;
    }
  }
}

json ParseJsonObject(std::string_view body) {
  CheckJsonDepth(body);
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) Invalid("the body is not JSON");
  if (!parsed.is_object()) Invalid("the body must be a JSON object");
  return parsed;
}

void RouteInput::Bind() {
  options.request_id = request_id.empty() ? nullptr : request_id.c_str();
  options.lora_name = lora_name ? lora_name->c_str() : nullptr;
  options.cache_namespace = cache_namespace ? cache_namespace->c_str() : nullptr;
  if (allowed_worker_ids) {
    options.flags |= KVR_REQUEST_ALLOW_LIST;  // [] allows no worker
    options.allowed_worker_ids = allowed_worker_ids->empty() ? nullptr : allowed_worker_ids->data();
    options.num_allowed_worker_ids = allowed_worker_ids->size();
  }
  hints.session_id = session_id ? session_id->c_str() : nullptr;
  if (local_hashes) {
    options.flags |= KVR_REQUEST_PREHASHED;
    options.local_hashes = local_hashes->data();
    options.num_local_hashes = local_hashes->size();
  }
}

namespace {

// The prompt: its token ids, or its blocks' local hashes and its length.
void ParsePrompt(const json& body, RouteInput* input) {
  const json* tokens = Find(body, "token_ids");
  const json* hashes = Find(body, "local_hashes");
  if (tokens && hashes) Invalid("token_ids and local_hashes: give the prompt one way, not both");
  if (hashes) {
    // The hashes carry the adapter and the namespace: a field that would be ignored is refused
    // (a tenant counting on its namespace must not be routed on hashes made without it).
    for (const char* carried : {"lora_name", "cache_namespace"}) {
      if (Find(body, carried)) {
        Invalid(std::string(carried) + ": not with local_hashes (they are hashed with it)");
      }
    }
    if (!hashes->is_array()) Invalid("local_hashes: expected an array of unsigned 64-bit hashes");
    input->local_hashes.emplace();
    input->local_hashes->reserve(hashes->size());
    for (size_t i = 0; i < hashes->size(); ++i) {
      // Numbers are taken exactly as written; a client whose JSON numbers are doubles
      // (JavaScript) sends decimal strings.
      const json& hash = (*hashes)[i];
      const std::string field = "local_hashes[" + std::to_string(i) + "]";
      input->local_hashes->push_back(hash.is_string()
                                         ? DecimalU64(hash.get<std::string>(), field, "hash")
                                         : UnsignedField(hash, field, UINT64_MAX));
    }
    const json* length = Find(body, "num_tokens");
    if (!length) Invalid("num_tokens: required with local_hashes (the prompt's length)");
    input->num_tokens = UnsignedField(*length, "num_tokens", UINT64_MAX);
    return;
  }
  if (!tokens) Invalid("token_ids: required (or local_hashes and num_tokens)");
  if (Find(body, "num_tokens")) Invalid("num_tokens: only with local_hashes (token_ids count)");
  if (!tokens->is_array()) Invalid("token_ids: expected an array of token ids");
  input->token_ids.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    input->token_ids.push_back(static_cast<uint32_t>(
        UnsignedField((*tokens)[i], "token_ids[" + std::to_string(i) + "]", UINT32_MAX)));
  }
}

}  // namespace

RouteInput ParseRouteInput(const json& body, bool need_request_id) {
  RouteInput input;
  kvr_request_options_init(&input.options, sizeof input.options);
  kvr_routing_hints_init(&input.hints, sizeof input.hints);
  RefuseUnknownFields(body,
                      {"request_id", "token_ids", "local_hashes", "num_tokens", "lora_name",
                       "cache_namespace", "allowed_worker_ids", "expected_output_tokens",
                       "priority_jump", "queue_timeout_ms", "overrides", "hints", "previewed"},
                      "");
  if (const json* v = Find(body, "request_id")) {
    input.request_id = StringField(*v, "request_id");
  }
  if (need_request_id && input.request_id.empty()) Invalid("request_id: required");
  ParsePrompt(body, &input);
  if (const json* v = Find(body, "lora_name")) input.lora_name = StringField(*v, "lora_name");
  if (const json* v = Find(body, "cache_namespace")) {
    input.cache_namespace = StringField(*v, "cache_namespace");
  }
  if (const json* ids = Find(body, "allowed_worker_ids")) {
    if (!ids->is_array()) Invalid("allowed_worker_ids: expected an array of worker ids");
    input.allowed_worker_ids.emplace();
    for (size_t i = 0; i < ids->size(); ++i) {
      input.allowed_worker_ids->push_back(
          IdFromJson((*ids)[i], "allowed_worker_ids[" + std::to_string(i) + "]"));
    }
  }
  SetUnsigned(body, "expected_output_tokens", "", &input.options.expected_output_tokens);
  SetDouble(body, "priority_jump", "", &input.options.priority_jump);
  if (const json* v = Find(body, "queue_timeout_ms")) {
    input.options.queue_timeout_ms =
        static_cast<int64_t>(UnsignedField(*v, "queue_timeout_ms", kMaxQueueTimeoutMs));
  }
  if (const json* v = Find(body, "overrides")) ParseOverrides(*v, &input.options);
  if (const json* v = Find(body, "hints")) ParseHints(*v, &input);
  if (const json* v = Find(body, "previewed")) {
    if (!v->is_object()) Invalid("previewed: expected {\"worker_id\", \"dp_rank\"}");
    RefuseUnknownFields(*v, {"worker_id", "dp_rank"}, "previewed.");
    kvr_route_signals previewed;
    kvr_route_signals_init(&previewed, sizeof previewed);
    const json* worker = Find(*v, "worker_id");
    if (!worker) Invalid("previewed.worker_id: required");
    previewed.worker_id = IdFromJson(*worker, "previewed.worker_id");
    SetUnsigned(*v, "dp_rank", "previewed.", &previewed.dp_rank);
    input.previewed = previewed;
  }
  input.Bind();
  return input;
}

json DecisionJson(const std::string& request_id, const kvr_route_signals& s,
                  const std::string& address, bool replayed) {
  json decision;
  decision["request_id"] = request_id.empty() ? json(nullptr) : json(request_id);
  decision["worker_id"] = s.worker_id;
  decision["dp_rank"] = s.dp_rank;
  decision["address"] = address.empty() ? json(nullptr) : json(address);
  decision["prompt_tokens"] = s.prompt_tokens;
  decision["prompt_blocks"] = s.prompt_blocks;
  decision["overlap_blocks"] = s.overlap_blocks;
  decision["cached_tokens"] = s.cached_tokens;
  decision["cost"] = std::isfinite(s.cost) ? json(s.cost) : json(nullptr);
  decision["booked"] = s.booked != 0;
  decision["queued"] = s.queued != 0;
  decision["moved"] = s.moved != 0;
  decision["replayed"] = replayed;
  return decision;
}

uint64_t OutputTokensFromJson(const json& body) {
  RefuseUnknownFields(body, {"tokens"}, "");
  const json* tokens = Find(body, "tokens");
  if (!tokens) Invalid("tokens: required, an unsigned integer");
  return UnsignedField(*tokens, "tokens", UINT64_MAX);
}

WorkerSpec WorkerFromJson(const json& body) {
  WorkerSpec worker;
  RefuseUnknownFields(body,
                      {"worker_id", "address", "dp_start", "dp_size", "total_kv_blocks",
                       "max_num_batched_tokens", "events"},
                      "");
  const json* id = Find(body, "worker_id");
  if (!id) Invalid("worker_id: required");
  worker.worker_id = IdFromJson(*id, "worker_id");
  if (const json* v = Find(body, "address")) {
    worker.address = StringField(*v, "address");
    if (std::string error = CheckWorkerAddress(worker.address); !error.empty()) {
      Invalid("address: " + error);
    }
  }
  SetUnsigned(body, "dp_start", "", &worker.dp_start);
  SetUnsigned(body, "dp_size", "", &worker.dp_size);
  SetUnsigned(body, "total_kv_blocks", "", &worker.total_kv_blocks);
  SetUnsigned(body, "max_num_batched_tokens", "", &worker.max_num_batched_tokens);
  if (const json* events = Find(body, "events")) {
    if (!events->is_object()) Invalid("events: expected an object");
    RefuseUnknownFields(*events, {"engine", "endpoint", "replay_endpoint", "topic"}, "events.");
    EventsSpec spec;
    if (const json* v = Find(*events, "engine")) {
      const auto engine = ParseEngine(StringField(*v, "events.engine"));
      if (!engine) Invalid("events.engine: expected \"vllm\" or \"sglang\"");
      spec.engine = *engine;
    }
    const json* endpoint = Find(*events, "endpoint");
    if (!endpoint) Invalid("events.endpoint: required");
    spec.endpoint = StringField(*endpoint, "events.endpoint");
    if (const json* v = Find(*events, "replay_endpoint")) {
      spec.replay_endpoint = StringField(*v, "events.replay_endpoint");
    }
    if (const json* v = Find(*events, "topic")) spec.topic = StringField(*v, "events.topic");
    worker.events = spec;
  }
  return worker;
}

json WorkerToJson(const WorkerSpec& worker) {
  json out;
  out["worker_id"] = worker.worker_id;
  out["address"] = worker.address.empty() ? json(nullptr) : json(worker.address);
  out["dp_start"] = worker.dp_start;
  out["dp_size"] = worker.dp_size;
  out["total_kv_blocks"] = worker.total_kv_blocks;
  out["max_num_batched_tokens"] = worker.max_num_batched_tokens;
  if (worker.events) {
    out["events"] = {{"engine", EngineName(worker.events->engine)},
                     {"endpoint", worker.events->endpoint},
                     {"replay_endpoint", worker.events->replay_endpoint.empty()
                                             ? json(nullptr)
                                             : json(worker.events->replay_endpoint)},
                     {"topic", worker.events->topic}};
  } else {
    out["events"] = nullptr;
  }
  return out;
}

uint64_t IdFromJson(const json& value, const std::string& field) {
  if (value.is_string()) return IdFromPath(value.get<std::string>(), field);
  return UnsignedField(value, field, kMaxExactJsonInteger);
}

uint64_t IdFromPath(const std::string& segment, const std::string& field) {
  return DecimalU64(segment, field, "id");
}

uint64_t DecimalU64(const std::string& text, const std::string& field, const char* what) {
  uint64_t value = 0;
  const char* begin = text.data();
  const char* end = begin + text.size();
  const auto [ptr, ec] = std::from_chars(begin, end, value);
  if (text.empty() || ec != std::errc() || ptr != end) {
    Invalid(field + ": expected a decimal 64-bit " + what + ", got '" + text + "'");
  }
  return value;
}

std::string PercentDecode(std::string_view segment) {
  std::string out;
  out.reserve(segment.size());
  for (size_t i = 0; i < segment.size(); ++i) {
    if (segment[i] != '%') {
      out.push_back(segment[i]);
      continue;
    }
    const auto hex = [](char c) {
      return std::isxdigit(static_cast<unsigned char>(c))
                 ? (c <= '9' ? c - '0' : (std::tolower(static_cast<unsigned char>(c)) - 'a' + 10))
                 : -1;
    };
    if (i + 2 >= segment.size() || hex(segment[i + 1]) < 0 || hex(segment[i + 2]) < 0) {
      Invalid("bad percent-encoding in the path");
    }
    const int value = hex(segment[i + 1]) * 16 + hex(segment[i + 2]);
    out.push_back(static_cast<char>(value));
    i += 2;
  }
  return out;
}

const std::vector<RouteSpec>& Routes() {
  static const std::vector<RouteSpec> routes = {
      {"POST", "/v1/route", Endpoint::kRoute, RouteSpec::Runs::kOnRoutingThread},
      {"POST", "/v1/preview", Endpoint::kPreview, RouteSpec::Runs::kOnQuickCallThread},
      {"POST", "/v1/plan", Endpoint::kPlan, RouteSpec::Runs::kOnRoutingThread},
      {"POST", "/v1/requests/{id}/commit", Endpoint::kCommit, RouteSpec::Runs::kOnLoop},
      {"POST", "/v1/requests/{id}/abort", Endpoint::kAbort, RouteSpec::Runs::kOnLoop},
      {"POST", "/v1/requests/{id}/prefill_completed", Endpoint::kPrefillCompleted,
       RouteSpec::Runs::kOnLoop},
      {"POST", "/v1/requests/{id}/output", Endpoint::kOutput, RouteSpec::Runs::kOnLoop},
      {"DELETE", "/v1/requests/{id}", Endpoint::kFree, RouteSpec::Runs::kOnLoop},
      {"GET", "/v1/workers", Endpoint::kListWorkers, RouteSpec::Runs::kOnLoop},
      {"POST", "/v1/workers", Endpoint::kAddWorker, RouteSpec::Runs::kOnLoop},
      {"GET", "/v1/workers/{id}", Endpoint::kGetWorker, RouteSpec::Runs::kOnLoop},
      {"PUT", "/v1/workers/{id}", Endpoint::kUpdateWorker, RouteSpec::Runs::kOnLoop},
      {"DELETE", "/v1/workers/{id}", Endpoint::kRemoveWorker, RouteSpec::Runs::kOnLoop},
      {"GET", "/v1/sessions/{id}", Endpoint::kGetSession, RouteSpec::Runs::kOnLoop},
      {"DELETE", "/v1/sessions/{id}", Endpoint::kCloseSession, RouteSpec::Runs::kOnLoop},
      {"GET", "/v1/snapshot", Endpoint::kGetSnapshot, RouteSpec::Runs::kOnRoutingThread},
      {"PUT", "/v1/snapshot", Endpoint::kPutSnapshot, RouteSpec::Runs::kOnRoutingThread},
      {"GET", "/v1/digest", Endpoint::kDigest, RouteSpec::Runs::kOnQuickCallThread},
      {"GET", "/metrics", Endpoint::kMetrics, RouteSpec::Runs::kOnLoop},
      {"GET", "/healthz", Endpoint::kHealthz, RouteSpec::Runs::kOnLoop},
  };
  return routes;
}

RouteMatch MatchRoute(const std::string& method, const std::string& path) {
  RouteMatch match;
  if (path.empty() || path[0] != '/') return match;
  const std::vector<std::string> segments = SplitPath(path);
  for (const RouteSpec& route : Routes()) {
    const std::vector<std::string> pattern = SplitPath(route.pattern);
    if (pattern.size() != segments.size()) continue;
    std::string param;
    bool same = true;
    for (size_t i = 0; i < pattern.size() && same; ++i) {
      if (pattern[i] == "{id}") {
        same = !segments[i].empty();
        param = segments[i];
      } else {
        same = pattern[i] == segments[i];
      }
    }
    if (!same) continue;
    const bool get = std::string_view(route.method) == "GET";
    if (method != route.method && !(get && method == "HEAD")) {  // HEAD: GET without the body
      match.miss_status = 405;
      match.allow += (match.allow.empty() ? "" : ", ") + std::string(route.method);
      if (get) match.allow += ", HEAD";
      continue;
    }
    match.route = &route;
    match.param = PercentDecode(param);
    // As in a body's strings (StringField): the library takes C strings, so "a%00x" would be
    // "a" there and not in the daemon's table of bookings.
    if (match.param.find('\0') != std::string::npos) {
      Invalid("the path's id must not contain NUL (%00)");
    }
    return match;
  }
  return match;
}

}  // namespace kvrouterd

// The HTTP/JSON mapping of docs/kvrouterd.md, with no state: request bodies to the C ABI's
// structs, results to JSON, kvr_status to HTTP statuses, URL paths to routes. Kept apart from
// the daemon's state so that tests check it directly.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvrouter.h"
#include "kvrouterd/http_server.h"
#include "kvrouterd/options.h"

namespace kvrouterd {

// An error for the client: a kvr_status (the library's or the daemon's) and its message.
class ApiError : public std::runtime_error {
 public:
  ApiError(kvr_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  kvr_status status() const { return status_; }

 private:
  kvr_status status_;
};

// Throws ApiError with the library's status and message unless `status` is KVR_OK; frees `err`
// and resets it. `err` is taken by reference so that `ThrowIfError(kvr_call(..., &err), err)`
// reads it after the call (a copy could be taken before: argument order is unspecified).
void ThrowIfError(kvr_status status, kvr_error*& err);

// The HTTP status of a kvr_status (docs/kvrouterd.md, the error table).
int HttpStatusFor(kvr_status status);

// The one error mapper: an ApiError's answer.
HttpResponse ErrorAnswer(const ApiError& error);

// A JSON answer.
HttpResponse JsonAnswer(const nlohmann::json& body, int status = 200);

// The deepest nesting of arrays and objects a JSON body may have.
inline constexpr size_t kMaxJsonDepth = 32;

// Parses a JSON body; ApiError INVALID_ARGUMENT if it is not JSON, not an object, or nested
// deeper than kMaxJsonDepth.
nlohmann::json ParseJsonObject(std::string_view body);

// The longest queue_timeout_ms a request may give: 2^62 ns (about 146 years), the longest span
// the library's clock takes (a longer one would overflow its nanoseconds).
inline constexpr uint64_t kMaxQueueTimeoutMs = (uint64_t{1} << 62) / 1000000;

// The longest session id taken (hints.session_id, GET and DELETE /v1/sessions/{id}), as the
// library takes request ids: the library itself takes any length, and keeps each binding (its
// id) until it expires.
inline constexpr size_t kMaxSessionIdBytes = 1024;
// ApiError INVALID_ARGUMENT naming `field` unless `id` is at most kMaxSessionIdBytes long.
void CheckSessionId(const std::string& id, const std::string& field);

// A routing request body (route, preview, plan), with the storage its C structs point into.
struct RouteInput {
  std::string request_id;
  std::vector<uint32_t> token_ids;
  // A prompt given hashed ("local_hashes", "num_tokens"): KVR_REQUEST_PREHASHED.
  std::optional<std::vector<uint64_t>> local_hashes;
  uint64_t num_tokens = 0;
  std::optional<std::string> lora_name;
  std::optional<std::string> cache_namespace;
  std::optional<std::vector<uint64_t>> allowed_worker_ids;  // [] allows no worker
  std::optional<std::string> session_id;
  kvr_request_options options{};  // pointers set by Bind()
  kvr_routing_hints hints{};
  std::optional<kvr_route_signals> previewed;  // plan's "previewed"

  // Points the structs' string and array fields at this object's storage. Call after any copy.
  void Bind();
  // The routing call's `tokens, num_tokens`: NULL and the prompt's length when it is hashed.
  const uint32_t* tokens() const { return local_hashes ? nullptr : token_ids.data(); }
  size_t prompt_length() const { return local_hashes ? num_tokens : token_ids.size(); }
};

// Parses a routing body. `need_request_id`: route and plan require one; preview ignores it.
// Bound when returned, but a move (no copy elision is promised) leaves the views pointing into
// the moved-from object: Bind() the result where it is kept.
RouteInput ParseRouteInput(const nlohmann::json& body, bool need_request_id);

// The decision (docs/kvrouterd.md, "The decision"). `address` empty = null.
nlohmann::json DecisionJson(const std::string& request_id, const kvr_route_signals& signals,
                            const std::string& address, bool replayed);

// The body of POST /v1/requests/{id}/output: {"tokens": n}, n the output tokens generated.
uint64_t OutputTokensFromJson(const nlohmann::json& body);

// Workers as the API spells them.
WorkerSpec WorkerFromJson(const nlohmann::json& body);
nlohmann::json WorkerToJson(const WorkerSpec& worker);

// A 64-bit id from JSON: a number up to 2^53 or a decimal string. `field` names it in errors.
uint64_t IdFromJson(const nlohmann::json& value, const std::string& field);
// A 64-bit id from a URL path segment.
uint64_t IdFromPath(const std::string& segment, const std::string& field);
// A decimal 64-bit unsigned integer, the whole of `text`; else INVALID_ARGUMENT naming `field`
// and what was expected (a "id", a "hash").
uint64_t DecimalU64(const std::string& text, const std::string& field, const char* what);

// Percent-decodes a URL path segment; ApiError INVALID_ARGUMENT on a bad escape.
std::string PercentDecode(std::string_view segment);

// The endpoints. `pattern` is what the metrics call the path.
enum class Endpoint {
  kRoute,
  kPreview,
  kPlan,
  kCommit,
  kAbort,
  kPrefillCompleted,
  kOutput,
  kFree,
  kListWorkers,
  kGetWorker,
  kAddWorker,
  kUpdateWorker,
  kRemoveWorker,
  kGetSession,
  kCloseSession,
  kGetSnapshot,
  kPutSnapshot,
  kDigest,
  kMetrics,
  kHealthz,
};

struct RouteSpec {
  const char* method;
  const char* pattern;  // segments; "{id}" matches one segment
  Endpoint endpoint;
  // Where its calls run: on the event loop (quick), on a routing thread (libuv's pool: it may
  // wait in the admission queue), or on a quick-call thread (never waits, but its body may
  // take a while to parse: daemon.cc's QuickCallPool).
  enum class Runs : uint8_t { kOnLoop, kOnRoutingThread, kOnQuickCallThread };
  Runs runs;
};

const std::vector<RouteSpec>& Routes();

struct RouteMatch {
  const RouteSpec* route = nullptr;  // nullptr: no match
  std::string param;                 // the {id} segment, percent-decoded
  int miss_status = 404;             // without a route: 404 (unknown path) or 405
  std::string allow;                 // with 405: the methods the path takes
};

// ApiError INVALID_ARGUMENT if the matched route's id is badly percent-encoded or holds a NUL.
RouteMatch MatchRoute(const std::string& method, const std::string& path);

}  // namespace kvrouterd

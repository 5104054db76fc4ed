// The HTTP/JSON mapping of docs/kvrouterd.md: bodies to the C ABI's structs, decisions and
// workers to JSON, statuses to HTTP, paths to routes; and the booking table's idempotence and
// bounds.
#include "kvrouterd/api_json.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

#include "kvrouterd/booking_table.h"

namespace kvrouterd {
namespace {

using nlohmann::json;

// The ApiError a call throws, as (status, message).
template <typename F>
std::pair<kvr_status, std::string> ErrorOf(F&& call) {
  try {
    call();
  } catch (const ApiError& e) {
    return {e.status(), e.what()};
  }
  return {KVR_OK, ""};
}

TEST(ApiJsonTest, StatusTable) {
  EXPECT_EQ(HttpStatusFor(KVR_INVALID_ARGUMENT), 400);
  EXPECT_EQ(HttpStatusFor(KVR_BUFFER_TOO_SMALL), 400);
  EXPECT_EQ(HttpStatusFor(KVR_NOT_FOUND), 404);
  EXPECT_EQ(HttpStatusFor(KVR_ALREADY_EXISTS), 409);
  EXPECT_EQ(HttpStatusFor(KVR_FAILED_PRECONDITION), 409);
  EXPECT_EQ(HttpStatusFor(KVR_CANCELLED), 409);
  EXPECT_EQ(HttpStatusFor(KVR_RESOURCE_EXHAUSTED), 429);
  EXPECT_EQ(HttpStatusFor(KVR_UNAVAILABLE), 503);
  EXPECT_EQ(HttpStatusFor(KVR_DEADLINE_EXCEEDED), 504);
  EXPECT_EQ(HttpStatusFor(KVR_INTERNAL), 500);
  EXPECT_EQ(HttpStatusFor(KVR_UNIMPLEMENTED), 500);
}

TEST(ApiJsonTest, ErrorBodyNamesTheStatus) {
  const HttpResponse response = ErrorAnswer(ApiError(KVR_ALREADY_EXISTS, "worker 1 exists"));
  EXPECT_EQ(response.status, 409);
  EXPECT_EQ(response.content_type, "application/json");
  EXPECT_EQ(
      json::parse(response.body),
      json::parse(R"({"error": {"status": "ALREADY_EXISTS", "message": "worker 1 exists"}})"));
}

// The call and its error in one expression, as the service writes it: the message is the
// library's (err is read after the call), and nothing leaks (ASan).
TEST(ApiJsonTest, LibraryErrorsKeepTheirMessage) {
  kvr_router* router = nullptr;
  ASSERT_EQ(kvr_router_new(nullptr, &router, nullptr), KVR_OK);
  kvr_error* err = nullptr;
  ASSERT_EQ(kvr_router_remove_worker(router, 42, &err), KVR_NOT_FOUND);
  const std::string message = kvr_error_message(err);
  kvr_error_free(err);
  err = nullptr;
  const auto [thrown, text] =
      ErrorOf([&] { ThrowIfError(kvr_router_remove_worker(router, 42, &err), err); });
  EXPECT_EQ(thrown, KVR_NOT_FOUND);
  EXPECT_EQ(text, message);
  EXPECT_NE(text, kvr_status_str(KVR_NOT_FOUND));
  EXPECT_EQ(err, nullptr);
  kvr_router_free(router);
}

// "allowed_worker_ids": [] allows no worker (a gateway's tenant filtered down to none); without
// the key every worker is allowed.
TEST(ApiJsonTest, AnEmptyAllowListAllowsNoWorker) {
  RouteInput listed =
      ParseRouteInput(json::parse(R"({"token_ids": [1], "allowed_worker_ids": []})"), false);
  EXPECT_EQ(listed.options.num_allowed_worker_ids, 0u);
  EXPECT_NE(listed.options.flags & KVR_REQUEST_ALLOW_LIST, 0u);
  RouteInput unlisted = ParseRouteInput(json::parse(R"({"token_ids": [1]})"), false);
  EXPECT_EQ(unlisted.options.flags & KVR_REQUEST_ALLOW_LIST, 0u);
}

TEST(ApiJsonTest, RouteBodyToOptions) {
  const json body = json::parse(R"({
    "request_id": "req-1", "token_ids": [1, 2, 3], "lora_name": "a", "cache_namespace": "t",
    "allowed_worker_ids": [1, "2"], "expected_output_tokens": 256, "priority_jump": 1.5,
    "queue_timeout_ms": 2000,
    "overrides": {"temperature": 0.5, "assume_kv_reuse": false, "cost_function": "predicted_ttft",
                  "ttft_miss_weight": 2},
    "hints": {"worker_id": 3, "dp_rank": 1, "session_id": "s", "session_mode": "soft",
              "session_ttl_seconds": 60, "phase": "decode"},
    "previewed": {"worker_id": 3, "dp_rank": 1}})");
  RouteInput input = ParseRouteInput(body, true);
  const RouteInput copy = input;  // the structs point into the object they are bound to
  EXPECT_STREQ(input.options.request_id, "req-1");
  EXPECT_EQ(input.token_ids, (std::vector<uint32_t>{1, 2, 3}));
  EXPECT_STREQ(input.options.lora_name, "a");
  EXPECT_STREQ(input.options.cache_namespace, "t");
  ASSERT_EQ(input.options.num_allowed_worker_ids, 2u);
  EXPECT_EQ(input.options.allowed_worker_ids[1], 2u);
  EXPECT_NE(input.options.flags & KVR_REQUEST_ALLOW_LIST, 0u);
  EXPECT_EQ(input.options.expected_output_tokens, 256u);
  EXPECT_EQ(input.options.priority_jump, 1.5);
  EXPECT_EQ(input.options.queue_timeout_ms, 2000);
  EXPECT_EQ(input.options.temperature, 0.5);
  EXPECT_EQ(input.options.assume_kv_reuse, 0);
  EXPECT_EQ(input.options.track_prefill_tokens, -1);  // not given: the router's
  EXPECT_TRUE(std::isnan(input.options.overlap_score_credit));
  EXPECT_EQ(input.options.cost_function, static_cast<int32_t>(KVR_COST_PREDICTED_TTFT));
  EXPECT_EQ(input.options.ttft_miss_weight, 2.0);
  EXPECT_EQ(input.hints.worker_id, 3u);
  EXPECT_EQ(input.hints.dp_rank, 1);
  EXPECT_STREQ(input.hints.session_id, "s");
  EXPECT_EQ(input.hints.session_mode, static_cast<uint32_t>(KVR_SESSION_SOFT));
  EXPECT_EQ(input.hints.session_ttl_seconds, 60.0);
  EXPECT_EQ(input.hints.phase, static_cast<uint32_t>(KVR_PHASE_DECODE));
  ASSERT_TRUE(input.previewed.has_value());
  EXPECT_EQ(input.previewed->worker_id, 3u);
  EXPECT_EQ(input.previewed->dp_rank, 1u);
}

TEST(ApiJsonTest, RouteBodyDefaults) {
  const RouteInput input = ParseRouteInput(json::parse(R"({"token_ids": []})"), false);
  EXPECT_EQ(input.options.request_id, nullptr);
  EXPECT_EQ(input.options.queue_timeout_ms, -1);
  EXPECT_EQ(input.hints.worker_id, KVR_WORKER_NONE);
  EXPECT_EQ(input.hints.session_id, nullptr);
  EXPECT_FALSE(input.previewed.has_value());
}

TEST(ApiJsonTest, BadBodiesNameTheField) {
  const auto error = [](const char* text, bool need_id = true) {
    return ErrorOf([&] { ParseRouteInput(ParseJsonObject(text), need_id); });
  };
  EXPECT_EQ(error("{").first, KVR_INVALID_ARGUMENT);
  EXPECT_EQ(error("{").second, "the body is not JSON");
  EXPECT_EQ(error("[1]").second, "the body must be a JSON object");
  EXPECT_EQ(error(R"({"token_ids": [1]})").second, "request_id: required");
  // A NUL would cut the id where the library reads it (two ids, one booking).
  EXPECT_EQ(error(R"({"request_id": "a\u0000x", "token_ids": [1]})").second,
            "request_id: must not contain NUL (\\u0000)");
  EXPECT_EQ(error(R"({"token_ids": [1]})", false).first, KVR_OK);
  EXPECT_EQ(error(R"({"request_id": "r"})").second,
            "token_ids: required (or local_hashes and num_tokens)");
  EXPECT_EQ(error(R"({"request_id": "r", "token_ids": [1, -2]})").second,
            "token_ids[1]: expected an unsigned integer");
  EXPECT_EQ(error(R"({"request_id": "r", "token_ids": [4294967296]})").second,
            "token_ids[0]: 4294967296 is out of range");
  EXPECT_EQ(error(R"({"request_id": 5, "token_ids": []})").second, "request_id: expected a string");
  EXPECT_EQ(
      error(R"({"request_id": "r", "token_ids": [], "overrides": {"temperature": "hot"}})").second,
      "overrides.temperature: expected a number");
  EXPECT_EQ(
      error(R"({"request_id": "r", "token_ids": [], "hints": {"session_mode": "loose"}})").second,
      "hints.session_mode: expected \"hard\" or \"soft\"");
  EXPECT_EQ(
      error(R"({"request_id": "r", "token_ids": [], "allowed_worker_ids": [9007199254740993]})")
          .second,
      "allowed_worker_ids[0]: 9007199254740993 is out of range");
  EXPECT_EQ(
      error(
          R"({"request_id": "r", "token_ids": [], "allowed_worker_ids": ["18446744073709551615"]})")
          .first,
      KVR_OK);  // as a string, any 64-bit id
}

// A field the daemon does not know is refused by name, at every level of every body: ignored,
// a misspelt "allowed_worker_ids" routed the request unrestricted.
TEST(ApiJsonTest, UnknownFieldsAreRefusedByName) {
  const auto route_error = [](const char* text) {
    return ErrorOf([&] { ParseRouteInput(ParseJsonObject(text), false); });
  };
  EXPECT_EQ(route_error(R"({"token_ids": [1], "allowed_worker_id": [2]})").first,
            KVR_INVALID_ARGUMENT);
  EXPECT_EQ(route_error(R"({"token_ids": [1], "allowed_worker_id": [2]})").second,
            "allowed_worker_id: unknown field");
  EXPECT_EQ(route_error(R"({"token_ids": [1], "overrides": {"temprature": 0}})").second,
            "overrides.temprature: unknown field");
  EXPECT_EQ(route_error(R"({"token_ids": [1], "hints": {"session": "s"}})").second,
            "hints.session: unknown field");
  EXPECT_EQ(route_error(R"({"token_ids": [1], "previewed": {"worker_id": 1, "rank": 0}})").second,
            "previewed.rank: unknown field");
  // Null is "not given" for a known field, and still unknown for another.
  EXPECT_EQ(route_error(R"({"token_ids": [1], "lora_name": null})").first, KVR_OK);
  EXPECT_EQ(route_error(R"({"token_ids": [1], "model": null})").second, "model: unknown field");
  const std::string long_name(100000, 'x');
  EXPECT_EQ(route_error(("{\"" + long_name + "\": 1, \"token_ids\": [1]}").c_str()).second,
            std::string(64, 'x') + "...: unknown field");  // not echoed whole

  const auto worker_error = [](const char* text) {
    return ErrorOf([&] { WorkerFromJson(ParseJsonObject(text)); }).second;
  };
  EXPECT_EQ(worker_error(R"({"worker_id": 1, "dp-size": 2})"), "dp-size: unknown field");
  EXPECT_EQ(worker_error(R"({"worker_id": 1, "events": {"endpoint": "tcp://h:1", "port": 2}})"),
            "events.port: unknown field");
  EXPECT_EQ(
      ErrorOf([] { OutputTokensFromJson(json::parse(R"({"tokens": 3, "token": 4})")); }).second,
      "token: unknown field");
  EXPECT_EQ(OutputTokensFromJson(json::parse(R"({"tokens": 3})")), 3u);
  EXPECT_EQ(ErrorOf([] { OutputTokensFromJson(json::parse(R"({"tokens": -1})")); }).second,
            "tokens: expected an unsigned integer");
  EXPECT_EQ(ErrorOf([] { OutputTokensFromJson(json::object()); }).second,
            "tokens: required, an unsigned integer");
}

// A session id is at most 1,024 bytes, as the library's request ids: the library takes any
// length and keeps each binding's id until it expires (a 3 MB id was taken).
TEST(ApiJsonTest, ASessionIdIsAtMost1024Bytes) {
  const auto parse = [](size_t length) {
    const json body = {{"request_id", "r"},
                       {"token_ids", {1}},
                       {"hints", {{"session_id", std::string(length, 's')}}}};
    return ErrorOf([&] { ParseRouteInput(body, true); });
  };
  EXPECT_EQ(parse(kMaxSessionIdBytes).first, KVR_OK);
  EXPECT_EQ(parse(kMaxSessionIdBytes + 1).first, KVR_INVALID_ARGUMENT);
  EXPECT_EQ(parse(kMaxSessionIdBytes + 1).second,
            "hints.session_id: 1025 bytes, longer than the 1024 a session id may have");
  EXPECT_EQ(parse(3 << 20).first, KVR_INVALID_ARGUMENT);
  const RouteMatch match = MatchRoute("DELETE", "/v1/sessions/conv%209");
  ASSERT_NE(match.route, nullptr);
  EXPECT_EQ(match.route->endpoint, Endpoint::kCloseSession);
  EXPECT_EQ(match.param, "conv 9");
  EXPECT_EQ(MatchRoute("GET", "/v1/sessions/conv-9").route->endpoint, Endpoint::kGetSession);
}

// A prompt given hashed: its blocks' local hashes (numbers taken exactly, or decimal strings)
// and its length, passed on with KVR_REQUEST_PREHASHED and no tokens.
TEST(ApiJsonTest, AHashedPromptIsPassedOnPrehashed) {
  const RouteInput input =
      ParseRouteInput(json::parse(R"({"local_hashes": [18446744073709551615, "9007199254740993"],
                      "num_tokens": 40})"),
                      false);
  ASSERT_TRUE(input.local_hashes.has_value());
  EXPECT_EQ(*input.local_hashes, (std::vector<uint64_t>{UINT64_MAX, 9007199254740993u}));
  EXPECT_EQ(input.options.flags & KVR_REQUEST_PREHASHED, KVR_REQUEST_PREHASHED);
  EXPECT_EQ(input.options.local_hashes, input.local_hashes->data());
  EXPECT_EQ(input.options.num_local_hashes, 2u);
  EXPECT_EQ(input.tokens(), nullptr);
  EXPECT_EQ(input.prompt_length(), 40u);

  const auto error = [](const char* text) {
    return ErrorOf([&] { ParseRouteInput(ParseJsonObject(text), false); }).second;
  };
  EXPECT_EQ(error(R"({"token_ids": [1], "local_hashes": [2], "num_tokens": 1})"),
            "token_ids and local_hashes: give the prompt one way, not both");
  EXPECT_EQ(error(R"({"local_hashes": [2]})"),
            "num_tokens: required with local_hashes (the prompt's length)");
  EXPECT_EQ(error(R"({"local_hashes": ["0x12"], "num_tokens": 16})"),
            "local_hashes[0]: expected a decimal 64-bit hash, got '0x12'");
  EXPECT_EQ(error(R"({"local_hashes": 7, "num_tokens": 16})"),
            "local_hashes: expected an array of unsigned 64-bit hashes");
  EXPECT_EQ(error("{}"), "token_ids: required (or local_hashes and num_tokens)");
  EXPECT_EQ(error(R"({"local_hashes": [2], "num_tokens": 16, "cache_namespace": "t"})"),
            "cache_namespace: not with local_hashes (they are hashed with it)");
  EXPECT_EQ(error(R"({"local_hashes": [2], "num_tokens": 16, "lora_name": "a"})"),
            "lora_name: not with local_hashes (they are hashed with it)");
  EXPECT_EQ(error(R"({"token_ids": [1], "num_tokens": 1})"),
            "num_tokens: only with local_hashes (token_ids count)");
}

// The library takes queue_timeout_ms as int64 milliseconds and counts in int64 nanoseconds:
// more than 2^62 ns is refused here, so that it never overflows there.
TEST(ApiJsonTest, QueueTimeoutIsBounded) {
  const auto parse = [](uint64_t ms) {
    return ParseRouteInput(json{{"token_ids", json::array()}, {"queue_timeout_ms", ms}}, false);
  };
  EXPECT_EQ(parse(kMaxQueueTimeoutMs).options.queue_timeout_ms,
            static_cast<int64_t>(kMaxQueueTimeoutMs));
  EXPECT_EQ(kMaxQueueTimeoutMs, 4611686018427u);
  for (const uint64_t ms : {kMaxQueueTimeoutMs + 1, uint64_t{INT64_MAX}, uint64_t{UINT64_MAX}}) {
    const auto [status, message] = ErrorOf([&] { parse(ms); });
    EXPECT_EQ(status, KVR_INVALID_ARGUMENT) << ms;
    EXPECT_EQ(message, "queue_timeout_ms: " + std::to_string(ms) + " is out of range") << ms;
  }
}

// Nesting is refused before the parse tree is built; brackets in strings do not count.
TEST(ApiJsonTest, DeepNestingIsRefused) {
  const auto nested = [](size_t depth) {  // the object itself is one level
    return R"({"x": )" + std::string(depth - 1, '[') + std::string(depth - 1, ']') + "}";
  };
  EXPECT_EQ(ErrorOf([&] { ParseJsonObject(nested(kMaxJsonDepth)); }).first, KVR_OK);
  const auto [status, message] = ErrorOf([&] { ParseJsonObject(nested(kMaxJsonDepth + 1)); });
  EXPECT_EQ(status, KVR_INVALID_ARGUMENT);
  EXPECT_EQ(message, "the body nests arrays and objects deeper than 32 levels");
  EXPECT_EQ(ErrorOf([&] { ParseJsonObject(nested(100000)); }).second, message);
  const std::string in_string = R"({"x": "\"[[[[)" + std::string(100, '[') + R"("})";
  EXPECT_EQ(ErrorOf([&] { ParseJsonObject(in_string); }).first, KVR_OK);
}

TEST(ApiJsonTest, Decision) {
  kvr_route_signals signals;
  kvr_route_signals_init(&signals, sizeof signals);
  signals.worker_id = 2;
  signals.dp_rank = 1;
  signals.prompt_tokens = 48;
  signals.prompt_blocks = 3;
  signals.overlap_blocks = 2;
  signals.cached_tokens = 32;
  signals.cost = 1.5;
  signals.booked = 1;
  EXPECT_EQ(DecisionJson("r", signals, "h:1", true), json::parse(R"({
    "request_id": "r", "worker_id": 2, "dp_rank": 1, "address": "h:1", "prompt_tokens": 48,
    "prompt_blocks": 3, "overlap_blocks": 2, "cached_tokens": 32, "cost": 1.5, "booked": true,
    "queued": false, "moved": false, "replayed": true})"));
  EXPECT_TRUE(DecisionJson("", signals, "", false)["address"].is_null());
}

TEST(ApiJsonTest, WorkerRoundTrip) {
  const json body = json::parse(R"({"worker_id": "7", "address": "h:1", "dp_start": 2,
    "dp_size": 4, "total_kv_blocks": 9, "max_num_batched_tokens": 8,
    "events": {"engine": "sglang", "endpoint": "tcp://h:5557", "topic": "t"}})");
  const WorkerSpec worker = WorkerFromJson(body);
  EXPECT_EQ(worker.worker_id, 7u);
  ASSERT_TRUE(worker.events.has_value());
  EXPECT_EQ(worker.events->engine, static_cast<kvr_engine>(KVR_ENGINE_SGLANG));
  const json out = WorkerToJson(worker);
  EXPECT_EQ(out["worker_id"], 7);
  EXPECT_EQ(out["events"]["endpoint"], "tcp://h:5557");
  EXPECT_TRUE(out["events"]["replay_endpoint"].is_null());
  EXPECT_EQ(WorkerFromJson(out), worker);
  EXPECT_EQ(ErrorOf([] { WorkerFromJson(json::object()); }).second, "worker_id: required");
  EXPECT_EQ(
      ErrorOf([] { WorkerFromJson(json::parse(R"({"worker_id": 1, "events": {}})")); }).second,
      "events.endpoint: required");
  EXPECT_EQ(ErrorOf([] {
              WorkerFromJson(json::parse(R"({"worker_id": 1, "address": "h:80\r\nx-y: z"})"));
            }).second,
            "address: expected a port 1..65535 in 'h:80\r\nx-y: z'");
  EXPECT_EQ(ErrorOf([] {
              WorkerFromJson(json::parse(R"({"worker_id": 1, "address": "a b:80"})"));
            }).second,
            "address: expected HOST:PORT (a host name, an IPv4 address or an [IPv6] one), got "
            "'a b:80'");
}

TEST(ApiJsonTest, Routes) {
  RouteMatch match = MatchRoute("POST", "/v1/requests/a%2Fb%20c/commit");
  ASSERT_NE(match.route, nullptr);
  EXPECT_EQ(match.route->endpoint, Endpoint::kCommit);
  EXPECT_EQ(match.param, "a/b c");
  EXPECT_STREQ(match.route->pattern, "/v1/requests/{id}/commit");

  match = MatchRoute("DELETE", "/v1/requests/r1");
  ASSERT_NE(match.route, nullptr);
  EXPECT_EQ(match.route->endpoint, Endpoint::kFree);

  match = MatchRoute("PATCH", "/v1/workers/3");
  EXPECT_EQ(match.route, nullptr);
  EXPECT_EQ(match.miss_status, 405);
  EXPECT_EQ(match.allow, "GET, HEAD, PUT, DELETE");

  // HEAD is GET without the body: it matches GET routes only.
  match = MatchRoute("HEAD", "/healthz");
  ASSERT_NE(match.route, nullptr);
  EXPECT_EQ(match.route->endpoint, Endpoint::kHealthz);
  match = MatchRoute("HEAD", "/v1/route");
  EXPECT_EQ(match.route, nullptr);
  EXPECT_EQ(match.miss_status, 405);
  EXPECT_EQ(match.allow, "POST");

  match = MatchRoute("GET", "/v1/nothing");
  EXPECT_EQ(match.route, nullptr);
  EXPECT_EQ(match.miss_status, 404);
  EXPECT_EQ(MatchRoute("GET", "/v1/workers/").route, nullptr);  // an empty id is no id

  EXPECT_EQ(MatchRoute("POST", "/v1/route").route->runs, RouteSpec::Runs::kOnRoutingThread);
  EXPECT_EQ(MatchRoute("POST", "/v1/plan").route->runs, RouteSpec::Runs::kOnRoutingThread);
  EXPECT_EQ(MatchRoute("POST", "/v1/preview").route->runs, RouteSpec::Runs::kOnQuickCallThread);
  EXPECT_EQ(MatchRoute("GET", "/v1/digest").route->runs, RouteSpec::Runs::kOnQuickCallThread);
  EXPECT_EQ(MatchRoute("GET", "/healthz").route->runs, RouteSpec::Runs::kOnLoop);
  EXPECT_EQ(ErrorOf([] { MatchRoute("DELETE", "/v1/requests/bad%zz"); }).second,
            "bad percent-encoding in the path");
  // A NUL would cut the id where the library reads it: "a%00x" freed the library's "a" and
  // not the daemon's booking of it.
  const auto nul = ErrorOf([] { MatchRoute("DELETE", "/v1/requests/a%00x"); });
  EXPECT_EQ(nul.first, KVR_INVALID_ARGUMENT);
  EXPECT_EQ(nul.second, "the path's id must not contain NUL (%00)");
  EXPECT_EQ(ErrorOf([] { MatchRoute("POST", "/v1/requests/%00/abort"); }).first,
            KVR_INVALID_ARGUMENT);
}

TEST(ApiJsonTest, PathIds) {
  EXPECT_EQ(IdFromPath("18446744073709551615", "id"), UINT64_MAX);
  EXPECT_EQ(ErrorOf([] { IdFromPath("12x", "worker id"); }).second,
            "worker id: expected a decimal 64-bit id, got '12x'");
}

using Outcome = BookingTable::Outcome;

TEST(BookingTableTest, ReplaysUntilCancelled) {
  BookingTable table(10);
  const auto now = BookingTable::Clock::now();
  EXPECT_EQ(table.Claim("a", now).outcome, Outcome::kBook);
  EXPECT_TRUE(table.Complete("a", json{{"worker_id", 2}}, 2, 0, now + std::chrono::seconds(60)));
  const BookingTable::Claimed replay = table.Claim("a", now);
  ASSERT_EQ(replay.outcome, Outcome::kReplay);
  EXPECT_EQ(replay.decision["worker_id"], 2);
  EXPECT_TRUE(table.Cancel("a"));
  EXPECT_FALSE(table.Cancel("a"));
  EXPECT_EQ(table.Claim("a", now).outcome, Outcome::kBook);  // free again
  table.Fail("a");
  EXPECT_EQ(table.size(), 0u);
}

TEST(BookingTableTest, AgesOutAndStaysBounded) {
  BookingTable table(3);
  const auto now = BookingTable::Clock::now();
  for (int i = 0; i < 10; ++i) {
    const std::string id = "r" + std::to_string(i);
    ASSERT_EQ(table.Claim(id, now).outcome, Outcome::kBook);
    table.Complete(id, json::object(), 1, 0, now + std::chrono::seconds(60));
    EXPECT_LE(table.size(), 3u);
  }
  EXPECT_EQ(table.Claim("r9", now).outcome, Outcome::kReplay);  // the newest are kept
  // Past its expiry an entry is gone: the router dropped its request by then.
  const auto later = now + std::chrono::seconds(61);
  EXPECT_EQ(table.Claim("r9", later).outcome, Outcome::kBook);
}

// A committed plan lives its request expiry from its booking (the plan), as the router counts it,
// not from the commit: before, a plan committed late was replayed after the router dropped it.
TEST(BookingTableTest, ACommittedPlanLivesFromItsBooking) {
  BookingTable table(10);
  const auto planned = BookingTable::Clock::now();
  ASSERT_EQ(table.Claim("p", planned).outcome, Outcome::kBook);
  ASSERT_TRUE(table.Complete("p", json::object(), 1, 0, planned + std::chrono::seconds(30)));
  table.Extend("p", std::chrono::seconds(3));  // committed: request expiry 3 s
  EXPECT_EQ(table.Claim("p", planned + std::chrono::seconds(2)).outcome, Outcome::kReplay);
  EXPECT_EQ(table.Claim("p", planned + std::chrono::seconds(4)).outcome, Outcome::kBook);
}

// An entry still booking (a call waiting in the admission queue, perhaps for good) is kept, but
// it holds back no other: those behind it expire and are forgotten past the capacity (before,
// eviction stopped at it and the table grew without bound).
TEST(BookingTableTest, AnEntryStillBookingHoldsNoOtherBack) {
  BookingTable table(3);
  const auto now = BookingTable::Clock::now();
  ASSERT_EQ(table.Claim("waiting", now).outcome, Outcome::kBook);  // never completes here
  for (int i = 0; i < 10; ++i) {
    const std::string id = "r" + std::to_string(i);
    ASSERT_EQ(table.Claim(id, now).outcome, Outcome::kBook);
    table.Complete(id, json::object(), 1, 0, now + std::chrono::seconds(60));
    EXPECT_LE(table.size(), 3u);
  }
  EXPECT_EQ(table.PendingIds(), std::vector<std::string>{"waiting"});
  EXPECT_EQ(table.Claim("r9", now).outcome, Outcome::kReplay);
  // Expired entries behind it go too.
  const auto later = now + std::chrono::seconds(61);
  ASSERT_EQ(table.Claim("new", later).outcome, Outcome::kBook);
  EXPECT_EQ(table.size(), 2u);  // "waiting" and "new"
}

// A retry of an id another call still books (in the admission queue, perhaps for good) waits
// for it within its deadline, and stops waiting once it is abandoned (before, it waited for as
// long as the first call, holding a routing thread).
TEST(BookingTableTest, AClaimWaitsForAnotherCallWithinItsWait) {
  BookingTable table(10);
  const auto now = BookingTable::Clock::now();
  ASSERT_EQ(table.Claim("q", now).outcome, Outcome::kBook);  // still booking
  BookingTable::Wait short_wait;
  short_wait.deadline = BookingTable::Clock::now() + std::chrono::milliseconds(20);
  EXPECT_EQ(table.Claim("q", now, BookingTable::kNoArrival, short_wait).outcome,
            Outcome::kTimedOut);
  std::atomic<bool> gone{false};
  BookingTable::Wait until_gone;
  until_gone.abandoned = [&] { return gone.load(); };
  std::thread leaver([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gone = true;
  });
  EXPECT_EQ(table.Claim("q", now, BookingTable::kNoArrival, until_gone).outcome,
            Outcome::kAbandoned);
  leaver.join();
  // Within its wait, a retry gets the first call's answer.
  std::thread first([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    table.Complete("q", json{{"worker_id", 7}}, 7, 0, now + std::chrono::seconds(60));
  });
  BookingTable::Wait long_wait;
  long_wait.deadline = BookingTable::Clock::now() + std::chrono::seconds(600);
  const BookingTable::Claimed replay = table.Claim("q", now, BookingTable::kNoArrival, long_wait);
  first.join();
  ASSERT_EQ(replay.outcome, Outcome::kReplay);
  EXPECT_EQ(replay.decision["worker_id"], 7);
}

TEST(BookingTableTest, DropWorkerForgetsItsRequests) {
  BookingTable table(10);
  const auto now = BookingTable::Clock::now();
  table.Claim("a", now);
  table.Complete("a", json::object(), 1, 0, now + std::chrono::seconds(60));
  table.Claim("b", now);
  table.Complete("b", json::object(), 2, 0, now + std::chrono::seconds(60));
  table.DropWorker(1);
  EXPECT_EQ(table.Claim("a", now).outcome, Outcome::kBook);
  EXPECT_EQ(table.Claim("b", now).outcome, Outcome::kReplay);
}

// A worker shrunk to ranks 4..4 (dp_start 4, dp_size 1): its requests on rank 5 went with it.
TEST(BookingTableTest, DropRanksOutsideForgetsTheDroppedRanks) {
  BookingTable table(10);
  const auto now = BookingTable::Clock::now();
  const auto book = [&](const std::string& id, uint64_t worker, uint32_t rank) {
    ASSERT_EQ(table.Claim(id, now).outcome, Outcome::kBook);
    table.Complete(id, json::object(), worker, rank, now + std::chrono::seconds(60));
  };
  book("on-4", 1, 4);
  book("on-5", 1, 5);
  book("on-3", 1, 3);
  book("other-5", 2, 5);
  table.DropRanksOutside(1, 4, 1);
  EXPECT_EQ(table.Claim("on-4", now).outcome, Outcome::kReplay);
  EXPECT_EQ(table.Claim("on-5", now).outcome, Outcome::kBook);
  EXPECT_EQ(table.Claim("on-3", now).outcome, Outcome::kBook);
  EXPECT_EQ(table.Claim("other-5", now).outcome, Outcome::kReplay);
}

// A retry that arrives while the first attempt is still booking waits for its answer.
TEST(BookingTableTest, ConcurrentClaimWaitsForTheFirst) {
  BookingTable table(10);
  const auto now = BookingTable::Clock::now();
  ASSERT_EQ(table.Claim("a", now).outcome, Outcome::kBook);
  EXPECT_EQ(table.PendingIds(), std::vector<std::string>{"a"});
  BookingTable::Claimed second{Outcome::kBook, nullptr};
  std::thread retry([&] { second = table.Claim("a", now); });
  table.Complete("a", json{{"worker_id", 5}}, 5, 0, now + std::chrono::seconds(60));
  retry.join();
  ASSERT_EQ(second.outcome, Outcome::kReplay);
  EXPECT_EQ(second.decision["worker_id"], 5);
}

// A free or abort cancels the calls for its id that arrived before it, not those after.
TEST(BookingTableTest, CancelReachesCallsThatArrivedBefore) {
  BookingTable table(10);
  const auto now = BookingTable::Clock::now();
  const uint64_t before = table.Arrive();
  EXPECT_FALSE(table.Cancel("c"));  // nothing booked yet
  const uint64_t after = table.Arrive();
  ASSERT_EQ(table.Claim("c", now, before).outcome, Outcome::kCancelled);  // (else c is claimed)
  EXPECT_EQ(table.Claim("c", now, after).outcome, Outcome::kBook);
  EXPECT_TRUE(table.Complete("c", json::object(), 1, 0, now + std::chrono::seconds(60), after));
  table.Depart(before);
  table.Depart(after);
  EXPECT_EQ(table.cancellations(), 0u);  // no call left that it could cancel
}

// Cancelled while it books: Complete refuses, the id stays claimed until Fail.
TEST(BookingTableTest, CancelWhileBookingFailsComplete) {
  BookingTable table(10);
  const auto now = BookingTable::Clock::now();
  const uint64_t arrival = table.Arrive();
  ASSERT_EQ(table.Claim("c", now, arrival).outcome, Outcome::kBook);
  EXPECT_FALSE(table.Cancel("c"));  // pending: not booked here yet
  EXPECT_FALSE(table.Complete("c", json::object(), 1, 0, now + std::chrono::seconds(60), arrival));
  EXPECT_EQ(table.PendingIds(), std::vector<std::string>{"c"});
  table.Fail("c");
  EXPECT_EQ(table.size(), 0u);
  // CancelPending (shutdown) marks only a call booking now.
  const uint64_t next = table.Arrive();
  EXPECT_FALSE(table.CancelPending("d"));
  ASSERT_EQ(table.Claim("d", now, next).outcome, Outcome::kBook);
  EXPECT_TRUE(table.CancelPending("d"));
  EXPECT_FALSE(table.Complete("d", json::object(), 1, 0, now + std::chrono::seconds(60), next));
}

TEST(BookingTableTest, CancellationsAreBounded) {
  BookingTable table(3);
  const uint64_t waiting = table.Arrive();
  for (int i = 0; i < 10; ++i) table.Cancel("x" + std::to_string(i));
  EXPECT_LE(table.cancellations(), 3u);
  EXPECT_EQ(table.Claim("x9", BookingTable::Clock::now(), waiting).outcome, Outcome::kCancelled);
  table.Depart(waiting);
  EXPECT_EQ(table.cancellations(), 0u);
  table.Cancel("y");  // no call in flight: nothing to remember
  EXPECT_EQ(table.cancellations(), 0u);
}

}  // namespace
}  // namespace kvrouterd

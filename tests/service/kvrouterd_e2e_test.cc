// kvrouterd end to end: the real binary as a child process on 127.0.0.1 (port 0, told through
// its port file), workers added over HTTP and from its config file, KV events published to its
// event listener with kvr_publisher_*, requests routed through a plain-socket HTTP client.
// Everything that waits polls with a deadline.
#include <gtest/gtest.h>
#include <poll.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "e2e_support.h"
#include "kvrouter.h"
#include "nats_server.h"     // FreePort (tests/ingest)
#include "process_memory.h"  // KVR_TEST_ASAN (tests/core)

namespace {

using kvrouter::FreePort;
using kvrouterd_test::DaemonProcess;
using kvrouterd_test::Http;
using kvrouterd_test::HttpAnswer;
using kvrouterd_test::WaitFor;
using nlohmann::json;

constexpr uint32_t kBlockSize = 16;

// A prompt of 48 tokens (3 blocks); worker 2's engine caches its first two blocks.
std::vector<uint32_t> Prompt() {
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 3 * kBlockSize; ++i) tokens.push_back(1000 + i);
  return tokens;
}

std::string RouteBody(const std::string& id, const json& extra = json::object()) {
  json body = {{"request_id", id}, {"token_ids", Prompt()}};
  body.update(extra);
  return body.dump();
}

json Body(const HttpAnswer& answer) { return json::parse(answer.body, nullptr, false); }

// One answer read from a keep-alive connection; status 0 if it closed first.
HttpAnswer ReadOneAnswer(int fd) {
  std::string bytes;
  char buffer[4096];
  for (;;) {
    const size_t head_end = bytes.find("\r\n\r\n");
    const size_t length_at = bytes.find("Content-Length: ");
    if (head_end != std::string::npos && length_at < head_end &&
        bytes.size() >= head_end + 4 + std::stoul(bytes.substr(length_at + 16))) {
      return kvrouterd_test::ParseAnswers(bytes).front();
    }
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) return {};
    bytes.append(buffer, static_cast<size_t>(n));
  }
}

// A TCP listener on 127.0.0.1 standing in for an engine's ZMQ publisher: it speaks no ZMTP, but
// sees the daemon's subscription connect, which is all these tests ask of it.
class FakeEngine {
 public:
  FakeEngine() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof address;
    if (bind(fd_, reinterpret_cast<sockaddr*>(&address), size) == 0 && listen(fd_, 16) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &size) == 0) {
      port_ = ntohs(address.sin_port);
    }
  }
  ~FakeEngine() {
    Drop();
    close(fd_);
  }
  FakeEngine(const FakeEngine&) = delete;
  FakeEngine& operator=(const FakeEngine&) = delete;

  std::string endpoint() const { return "tcp://127.0.0.1:" + std::to_string(port_); }
  // True once a subscriber connected (within `seconds`).
  bool Accept(double seconds = 30) {
    pollfd ready{fd_, POLLIN, 0};
    if (poll(&ready, 1, static_cast<int>(seconds * 1000)) != 1) return false;
    const int connection = accept(fd_, nullptr, nullptr);
    if (connection < 0) return false;
    accepted_.push_back(connection);
    return true;
  }
  // Closes the connections accepted: a subscriber still subscribed connects again.
  void Drop() {
    for (const int connection : accepted_) close(connection);
    accepted_.clear();
  }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::vector<int> accepted_;
};

class KvrouterdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvrouterd-e2e-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    events_port_ = FreePort();
    ASSERT_GT(events_port_, 0);
    WriteConfig({"id=1,address=10.0.0.1:8000", "id=2,address=10.0.0.2:8000"});
  }

  void TearDown() override {
    daemon_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::string ConfigPath() const { return dir_ + "/kvrouterd.conf"; }
  std::string PortFile() const { return dir_ + "/port"; }

  void WriteConfig(const std::vector<std::string>& workers, const std::string& extra = "") {
    std::string text =
        "# written by kvrouterd_e2e_test\n"
        "listen = 127.0.0.1:0\n"
        "port-file = " +
        PortFile() +
        "\n"
        "listen-events = tcp://127.0.0.1:" +
        std::to_string(events_port_) +
        "\n"
        "block-size = 16\n"
        "max-body-bytes = 65536\n"
        "log-level = debug\n" +
        extra;
    for (const std::string& worker : workers) text += "worker = " + worker + "\n";
    const std::string temporary = ConfigPath() + ".tmp";
    { std::ofstream(temporary) << text; }
    std::filesystem::rename(temporary, ConfigPath());
  }

  // Starts the daemon on the config and waits for its port file. Its log goes to `log_path` if
  // given, else to the test's stderr.
  void Start(std::vector<std::string> extra_args = {}, const std::string& log_path = "") {
    std::filesystem::remove(PortFile());
    std::vector<std::string> args{"--config", ConfigPath()};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    daemon_ = std::make_unique<DaemonProcess>(KVRD_BINARY, args, log_path);
    ASSERT_GT(daemon_->pid(), 0);
    ASSERT_TRUE(WaitFor([&] { return !kvrouterd_test::ReadFile(PortFile()).empty(); }))
        << "kvrouterd wrote no port file";
    port_ = std::stoi(kvrouterd_test::ReadFile(PortFile()));
  }

  // SIGTERM: it must exit 0.
  void Stop() {
    daemon_->Signal(SIGTERM);
    EXPECT_EQ(daemon_->WaitExit(), std::optional<int>(0));
    daemon_.reset();
  }

  HttpAnswer Get(const std::string& path) { return Http(port_, "GET", path); }
  HttpAnswer Post(const std::string& path, const std::string& body) {
    return Http(port_, "POST", path, body);
  }
  // A request answered on another thread (one that may wait in the daemon).
  std::future<HttpAnswer> PostAsync(const std::string& path, const std::string& body) {
    return std::async(std::launch::async,
                      [port = port_, path, body] { return Http(port, "POST", path, body); });
  }
  HttpAnswer Delete(const std::string& path) { return Http(port_, "DELETE", path); }
  // An unlabelled series of /metrics; -1 if absent.
  double Metric(const std::string& name) {
    return kvrouterd_test::MetricValue(Get("/metrics").body, name);
  }
  bool MetricIs(const std::string& name, double value) {
    return WaitFor([&] { return Metric(name) == value; });
  }

  // Worker 2's engine reports the prompt's first two blocks cached, over the native stream.
  void PublishCachedPrefix() {
    kvr_publisher* publisher = nullptr;
    const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(events_port_);
    ASSERT_TRUE(WaitFor(
        [&] { return kvr_publisher_connect(endpoint.c_str(), &publisher, nullptr) == KVR_OK; }));
    const std::vector<uint32_t> prompt = Prompt();
    const uint64_t engine_hashes[2] = {0xA1, 0xA2};
    kvr_stored_event stored;
    kvr_stored_event_init(&stored, sizeof stored);
    stored.worker_id = 2;
    stored.block_hashes = engine_hashes;
    stored.num_blocks = 2;
    stored.token_ids = prompt.data();
    stored.num_tokens = 2 * kBlockSize;
    kvr_event_batch* batch = nullptr;
    ASSERT_EQ(kvr_event_batch_new(&batch, nullptr), KVR_OK);
    ASSERT_EQ(kvr_event_batch_add_stored(batch, &stored, nullptr), KVR_OK);
    EXPECT_EQ(kvr_publisher_send(publisher, batch, nullptr), KVR_OK);
    kvr_event_batch_free(batch);
    kvr_publisher_free(publisher);
  }

  // Waits until a preview sees worker 2's cached blocks.
  bool PreviewSeesCachedPrefix() {
    return WaitFor([&] {
      const json decision = Body(Post("/v1/preview", RouteBody("")));
      return decision.is_object() && decision.value("worker_id", 0) == 2 &&
             decision.value("overlap_blocks", 0) == 2;
    });
  }

  std::string Digest() { return Body(Get("/v1/digest")).value("digest", ""); }

  std::string dir_;
  int events_port_ = 0;
  int port_ = 0;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(KvrouterdTest, CachedPrefixWins) {
  Start();
  PublishCachedPrefix();
  ASSERT_TRUE(PreviewSeesCachedPrefix());
  const HttpAnswer answer = Post("/v1/route", RouteBody("req-1"));
  ASSERT_EQ(answer.status, 200) << answer.body;
  const json decision = Body(answer);
  EXPECT_EQ(decision["request_id"], "req-1");
  EXPECT_EQ(decision["worker_id"], 2);
  EXPECT_EQ(decision["address"], "10.0.0.2:8000");
  EXPECT_EQ(decision["prompt_tokens"], 48);
  EXPECT_EQ(decision["prompt_blocks"], 3);
  EXPECT_EQ(decision["overlap_blocks"], 2);
  EXPECT_EQ(decision["cached_tokens"], 32);
  EXPECT_EQ(decision["booked"], true);
  EXPECT_EQ(decision["replayed"], false);
  EXPECT_EQ(Body(Post("/v1/requests/req-1/prefill_completed", "")),
            json::parse(R"({"request_id": "req-1"})"));
  EXPECT_EQ(Body(Http(port_, "DELETE", "/v1/requests/req-1")),
            json::parse(R"({"request_id": "req-1", "freed": true})"));
  Stop();
}

// A prompt sent as its blocks' local hashes and its length routes as its tokens do (hashes as
// numbers or decimal strings); a count that is not the prompt's blocks is 400.
TEST_F(KvrouterdTest, AHashedPromptRoutesAsItsTokens) {
  Start();
  PublishCachedPrefix();
  ASSERT_TRUE(PreviewSeesCachedPrefix());
  const std::vector<uint32_t> prompt = Prompt();
  std::vector<uint64_t> hashes(3);
  size_t num_hashes = 0;
  ASSERT_EQ(kvr_compute_block_hashes(prompt.data(), prompt.size(), kBlockSize, nullptr,
                                     hashes.data(), hashes.size(), &num_hashes, nullptr),
            KVR_OK);
  ASSERT_EQ(num_hashes, 3u);
  json as_strings = json::array();
  for (uint64_t h : hashes) as_strings.push_back(std::to_string(h));
  const json preview = Body(Post(
      "/v1/preview", json({{"local_hashes", as_strings}, {"num_tokens", prompt.size()}}).dump()));
  EXPECT_EQ(preview["worker_id"], 2) << preview;
  EXPECT_EQ(preview["overlap_blocks"], 2) << preview;
  EXPECT_EQ(preview["prompt_tokens"], 48) << preview;
  const json hashed = {{"request_id", "req-h"}, {"local_hashes", hashes}, {"num_tokens", 48}};
  const HttpAnswer routed = Post("/v1/route", hashed.dump());
  ASSERT_EQ(routed.status, 200) << routed.body;
  EXPECT_EQ(Body(routed)["worker_id"], 2);
  EXPECT_EQ(Body(routed)["cached_tokens"], 32);
  EXPECT_EQ(Body(routed)["booked"], true);
  EXPECT_EQ(Body(Delete("/v1/requests/req-h"))["freed"], true);
  const HttpAnswer wrong =
      Post("/v1/preview", json({{"local_hashes", hashes}, {"num_tokens", 64}}).dump());
  EXPECT_EQ(wrong.status, 400) << wrong.body;
  EXPECT_NE(Body(wrong)["error"]["message"].get<std::string>().find("local hashes were given"),
            std::string::npos)
      << wrong.body;
  Stop();
}

TEST_F(KvrouterdTest, RouteAndPlanAreIdempotentByRequestId) {
  Start();
  const json first = Body(Post("/v1/route", RouteBody("r")));
  ASSERT_TRUE(first.contains("worker_id")) << first;
  const std::string booked = Digest();
  // The same id again, whatever the body: the first decision, booked once.
  const json again = Body(Post("/v1/route", RouteBody("r", {{"token_ids", {1, 2, 3}}})));
  EXPECT_EQ(again["worker_id"], first["worker_id"]);
  EXPECT_EQ(again["prompt_tokens"], first["prompt_tokens"]);
  EXPECT_EQ(again["replayed"], true);
  EXPECT_EQ(Digest(), booked) << "a replay changed the router's state";
  EXPECT_EQ(Body(Http(port_, "DELETE", "/v1/requests/r"))["freed"], true);
  EXPECT_EQ(Body(Http(port_, "DELETE", "/v1/requests/r"))["freed"], false);
  EXPECT_EQ(Body(Post("/v1/route", RouteBody("r")))["replayed"], false);  // free to reuse

  // plan, then commit and abort, each safe to repeat; an id with a percent-escape.
  const json plan = Body(Post("/v1/plan", RouteBody("p 1")));
  EXPECT_EQ(plan["booked"], true);
  EXPECT_EQ(Body(Post("/v1/plan", RouteBody("p 1")))["replayed"], true);
  EXPECT_EQ(Post("/v1/requests/p%201/commit", "").status, 200);
  EXPECT_EQ(Post("/v1/requests/p%201/commit", "").status, 200);
  EXPECT_EQ(Body(Post("/v1/requests/p%201/abort", "")),
            json::parse(R"({"request_id": "p 1", "freed": true})"));
  EXPECT_EQ(Body(Post("/v1/requests/p%201/abort", ""))["freed"], false);
  const HttpAnswer unknown = Post("/v1/requests/never/commit", "");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(Body(unknown)["error"]["status"], "NOT_FOUND");
  Stop();
}

TEST_F(KvrouterdTest, ErrorsFollowTheContract) {
  Start();
  const auto expect_error = [&](const HttpAnswer& answer, int status, const std::string& name) {
    EXPECT_EQ(answer.status, status) << answer.head << answer.body;
    const json body = Body(answer);
    EXPECT_EQ(body["error"]["status"], name) << answer.body;
    EXPECT_TRUE(body["error"]["message"].is_string()) << answer.body;
    return body["error"].value("message", "");
  };
  expect_error(Post("/v1/route", "{not json"), 400, "INVALID_ARGUMENT");
  EXPECT_EQ(expect_error(Post("/v1/route", R"({"request_id": "x"})"), 400, "INVALID_ARGUMENT"),
            "token_ids: required (or local_hashes and num_tokens)");
  expect_error(Get("/v1/workers/99"), 404, "NOT_FOUND");
  expect_error(Http(port_, "DELETE", "/v1/workers/99"), 404, "NOT_FOUND");
  // The library's own message, not the status's generic description.
  EXPECT_NE(expect_error(Post("/v1/workers", R"({"worker_id": 1})"), 409, "ALREADY_EXISTS"),
            kvr_status_str(KVR_ALREADY_EXISTS));
  expect_error(Post("/v1/preview", RouteBody("", {{"hints", {{"worker_id", 99}}}})), 404,
               "NOT_FOUND");
  const HttpAnswer wrong_method = Get("/v1/route");
  expect_error(wrong_method, 405, "INVALID_ARGUMENT");
  EXPECT_NE(wrong_method.head.find("Allow: POST"), std::string::npos);
  expect_error(Get("/v1/nowhere"), 404, "NOT_FOUND");
  // Output tracking is off (no track-output-blocks): the library's FAILED_PRECONDITION.
  expect_error(Post("/v1/requests/x/output", R"({"tokens": 5})"), 409, "FAILED_PRECONDITION");
  expect_error(Post("/v1/requests/x/output", R"({"tokens": -5})"), 400, "INVALID_ARGUMENT");
  expect_error(Post("/v1/route", std::string(70000, ' ')), 413, "INVALID_ARGUMENT");
  // A NUL in a path's id is refused, as in a body's: the library would read "nul" alone.
  ASSERT_EQ(Post("/v1/route", RouteBody("nul")).status, 200);
  expect_error(Delete("/v1/requests/nul%00x"), 400, "INVALID_ARGUMENT");
  EXPECT_EQ(Body(Delete("/v1/requests/nul"))["freed"], true);

  // Headers over max-header-bytes (default 64 KiB) are 431; bytes that are not HTTP are 400.
  const auto raw_exchange = [&](const std::string& bytes) {
    const int fd = kvrouterd_test::Connect(port_);
    kvrouterd_test::SendAll(fd, bytes);
    auto answers = kvrouterd_test::ParseAnswers(kvrouterd_test::ReadToEnd(fd));
    close(fd);
    return answers;
  };
  auto answers =
      raw_exchange("GET /healthz HTTP/1.1\r\nX-Big: " + std::string(70000, 'x') + "\r\n\r\n");
  ASSERT_EQ(answers.size(), 1u);
  expect_error(answers[0], 431, "INVALID_ARGUMENT");
  answers = raw_exchange("HELLO\r\n\r\n");
  ASSERT_EQ(answers.size(), 1u);
  expect_error(answers[0], 400, "INVALID_ARGUMENT");
  // A header name with a space (a proxy may read it otherwise) is malformed.
  answers = raw_exchange("GET /healthz HTTP/1.1\r\nContent Length: 5\r\n\r\n");
  ASSERT_EQ(answers.size(), 1u);
  expect_error(answers[0], 400, "INVALID_ARGUMENT");
  // A target in absolute form, as a proxy sends it, is served (HTTP/1.1 servers must take it).
  answers = raw_exchange("GET HTTP://127.0.0.1:" + std::to_string(port_) +
                         "/healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_EQ(answers[0].status, 200);
  // A misspelt field is refused, not ignored (ignored, this one routed unrestricted).
  expect_error(
      Post("/v1/route", R"({"request_id": "u", "token_ids": [1], "allowed_worker_id": [7]})"), 400,
      "INVALID_ARGUMENT");

  // A chunked body is refused (411), and the connection closed.
  const int fd = kvrouterd_test::Connect(port_);
  ASSERT_GE(fd, 0);
  kvrouterd_test::SendAll(fd,
                          "POST /v1/route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                          "2\r\n{}\r\n0\r\n\r\n");
  answers = kvrouterd_test::ParseAnswers(kvrouterd_test::ReadToEnd(fd));
  close(fd);
  ASSERT_EQ(answers.size(), 1u);
  expect_error(answers[0], 411, "INVALID_ARGUMENT");
  EXPECT_EQ(Get("/healthz").status, 200);  // still serving
  Stop();
}

TEST_F(KvrouterdTest, WorkersOverHttp) {
  Start();
  const std::string events = "tcp://127.0.0.1:" + std::to_string(FreePort());
  const json worker = {{"worker_id", 3},
                       {"address", "10.0.0.3:8000"},
                       {"total_kv_blocks", 1000},
                       {"events", {{"engine", "vllm"}, {"endpoint", events}}}};
  const HttpAnswer added = Post("/v1/workers", worker.dump());
  ASSERT_EQ(added.status, 201) << added.body;
  EXPECT_EQ(Body(added)["events"]["endpoint"], events);
  EXPECT_EQ(Body(Get("/v1/workers"))["workers"].size(), 3u);
  // Subscribed to the engine's KV events (kvr_ingest_add_engine_worker): an ingest source.
  EXPECT_NE(Get("/metrics").body.find("kind=\"engine\",endpoint=\"" + events + "\"}"),
            std::string::npos);
  EXPECT_EQ(Body(Get("/v1/workers/3"))["total_kv_blocks"], 1000);

  const HttpAnswer updated =
      Http(port_, "PUT", "/v1/workers/3", R"({"address": "10.0.0.33:8000", "dp_size": 2})");
  ASSERT_EQ(updated.status, 200) << updated.body;
  const json now = Body(Get("/v1/workers/3"));
  EXPECT_EQ(now["address"], "10.0.0.33:8000");
  EXPECT_EQ(now["dp_size"], 2);
  EXPECT_TRUE(now["events"].is_null());  // PUT takes the whole worker
  EXPECT_EQ(Http(port_, "PUT", "/v1/workers/4", R"({"worker_id": 4})").status, 404);
  // An address a proxy cannot send to is refused, and the worker left as it was.
  const HttpAnswer unsendable = Http(port_, "PUT", "/v1/workers/3", R"({"address": "10.0.0.3"})");
  EXPECT_EQ(unsendable.status, 400) << unsendable.body;
  EXPECT_EQ(Body(Get("/v1/workers/3"))["address"], "10.0.0.33:8000");
  EXPECT_EQ(Post("/v1/workers", R"({"worker_id": 5, "address": "[::1]"})").status, 400);
  EXPECT_EQ(Get("/v1/workers/5").status, 404);

  // An id past 2^53 (exact as a string) is updated by its path alone: the path's id was put
  // into the body as a JSON number, which ids past 2^53 may not be ("out of range").
  ASSERT_EQ(Post("/v1/workers", R"({"worker_id": "9007199254740993"})").status, 201);
  const HttpAnswer large = Http(port_, "PUT", "/v1/workers/9007199254740993", R"({"dp_size": 2})");
  ASSERT_EQ(large.status, 200) << large.body;
  EXPECT_EQ(Body(large)["worker_id"], 9007199254740993ull);
  EXPECT_EQ(Body(Get("/v1/workers/9007199254740993"))["dp_size"], 2);
  ASSERT_EQ(Http(port_, "DELETE", "/v1/workers/9007199254740993").status, 200);

  EXPECT_EQ(Body(Http(port_, "DELETE", "/v1/workers/3")), json::parse(R"({"worker_id": 3})"));
  EXPECT_EQ(Get("/v1/workers/3").status, 404);
  EXPECT_EQ(Body(Get("/healthz")),
            json::parse(R"({"status": "ok", "workers": 2, "ranks_state_unknown": 0})"));
  Stop();
}

// An ipc path longer than a socket address holds: the library takes it as an endpoint, and
// fails only when it connects to it, once the change is under way.
std::string UnconnectableIpc(const std::string& dir) {
  return "ipc://" + dir + "/" + std::string(200, 'x');
}

// PUT /v1/workers/{id} is all or nothing: a change the library refuses, whether found before
// anything changes (a bad endpoint) or only midway (an endpoint it cannot connect to), leaves
// the worker as it was: its address, its ranks and their bookings, its subscription. (It was
// answered 400 with the address and ranks changed, the subscription dropped and the bookings
// of rank 0 gone; POST /v1/workers undid its own.)
TEST_F(KvrouterdTest, ARefusedWorkerUpdateChangesNothing) {
  Start();
  FakeEngine engine;
  const json worker = {{"worker_id", 7},
                       {"address", "old:1"},
                       {"events", {{"engine", "vllm"}, {"endpoint", engine.endpoint()}}}};
  ASSERT_EQ(Post("/v1/workers", worker.dump()).status, 201);
  ASSERT_TRUE(engine.Accept());
  ASSERT_EQ(Post("/v1/route", RouteBody("on-7", {{"allowed_worker_ids", {7}}})).status, 200);
  const json before = Body(Get("/v1/workers/7"));
  for (const std::string& endpoint : {std::string("garbage"), UnconnectableIpc(dir_)}) {
    SCOPED_TRACE(endpoint);
    const json change = {{"address", "new:1"},
                         {"dp_start", 4},
                         {"dp_size", 3},
                         {"events", {{"engine", "vllm"}, {"endpoint", endpoint}}}};
    const HttpAnswer refused = Http(port_, "PUT", "/v1/workers/7", change.dump());
    EXPECT_EQ(refused.status, 400) << refused.body;
    EXPECT_EQ(Body(Get("/v1/workers/7")), before);
    EXPECT_EQ(Body(Post("/v1/route", RouteBody("on-7")))["replayed"], true);  // still booked
    engine.Drop();
    EXPECT_TRUE(engine.Accept());  // still subscribed: it connects again
    // Nor is a worker added with such events.
    const json added = {{"worker_id", 8}, {"events", {{"endpoint", endpoint}}}};
    EXPECT_EQ(Post("/v1/workers", added.dump()).status, 400);
    EXPECT_EQ(Get("/v1/workers/8").status, 404);
  }
  // What the library takes still applies.
  const HttpAnswer moved = Http(port_, "PUT", "/v1/workers/7", R"({"address": "new:1"})");
  ASSERT_EQ(moved.status, 200) << moved.body;
  EXPECT_EQ(Body(Get("/v1/workers/7"))["address"], "new:1");
  EXPECT_TRUE(Body(Get("/v1/workers/7"))["events"].is_null());
  Stop();
}

// Session bindings are bounded: an id past 1,024 bytes is refused, a TTL past
// max-session-ttl-seconds is taken as that. (A 3 MB id and a TTL of 1e308 were taken: 100,000
// sessions held 35 MB for good, since a binding goes only once it expires.)
TEST_F(KvrouterdTest, SessionBindingsAreBounded) {
  WriteConfig({"id=1", "id=2"}, "max-session-ttl-seconds = 1\n");
  Start();
  const json forever = {{"session_id", "conv-9"}, {"session_ttl_seconds", 1e308}};
  const HttpAnswer routed = Post("/v1/route", RouteBody("s1", {{"hints", forever}}));
  ASSERT_EQ(routed.status, 200) << routed.body;
  const HttpAnswer bound = Get("/v1/sessions/conv-9");
  ASSERT_EQ(bound.status, 200) << bound.body;
  EXPECT_EQ(Body(bound)["session_id"], "conv-9");
  EXPECT_EQ(Body(bound)["worker_id"], Body(routed)["worker_id"]);
  EXPECT_EQ(Body(bound)["dp_rank"], Body(routed)["dp_rank"]);
  // Gone after a second (an expired binding is none), not in 1e308 s.
  EXPECT_TRUE(WaitFor([&] { return Get("/v1/sessions/conv-9").status == 404; }, 10));

  const std::string longest(1024, 's');
  const json too_long = {{"session_id", longest + "s"}};
  const HttpAnswer refused = Post("/v1/route", RouteBody("s2", {{"hints", too_long}}));
  EXPECT_EQ(refused.status, 400) << refused.body;
  EXPECT_EQ(Post("/v1/preview", RouteBody("", {{"hints", too_long}})).status, 400);
  EXPECT_EQ(Get("/v1/sessions/" + longest + "s").status, 400);
  EXPECT_EQ(Delete("/v1/sessions/" + longest + "s").status, 400);
  EXPECT_EQ(Post("/v1/route", RouteBody("s3", {{"hints", {{"session_id", longest}}}})).status, 200);
  EXPECT_EQ(Get("/v1/sessions/" + longest).status, 200);
  Stop();
}

// DELETE /v1/sessions/{id} unbinds a session (kvr_router_close_session): its next request is
// routed afresh. (There was no way to close one over HTTP.)
TEST_F(KvrouterdTest, ASessionIsClosedOverHttp) {
  Start();
  const json session = {{"session_id", "conv 9"}};
  const json decision = Body(Post("/v1/route", RouteBody("s1", {{"hints", session}})));
  ASSERT_TRUE(decision.is_object());
  EXPECT_EQ(Body(Get("/v1/sessions/conv%209"))["worker_id"], decision["worker_id"]);
  const HttpAnswer closed = Delete("/v1/sessions/conv%209");
  ASSERT_EQ(closed.status, 200) << closed.body;
  EXPECT_EQ(Body(closed), json::parse(R"({"session_id": "conv 9"})"));
  const HttpAnswer gone = Get("/v1/sessions/conv%209");
  EXPECT_EQ(gone.status, 404);
  EXPECT_EQ(Body(gone)["error"]["status"], "NOT_FOUND");
  EXPECT_EQ(Delete("/v1/sessions/conv%209").status, 200);  // closing again is no error
  Stop();
}

TEST_F(KvrouterdTest, MetricsAndHealth) {
  Start();
  EXPECT_EQ(Body(Get("/healthz")),
            json::parse(R"({"status": "ok", "workers": 2, "ranks_state_unknown": 0})"));
  ASSERT_EQ(Post("/v1/route", RouteBody("m")).status, 200);
  const HttpAnswer metrics = Get("/metrics");
  ASSERT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.head.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  for (const char* expected :
       {"kvrouterd_http_requests_total{path=\"/v1/route\",code=\"200\"} 1\n",
        "kvrouterd_http_requests_total{path=\"/healthz\",code=\"200\"} 1\n", "kvrouter_",
        "kvrouter_ingest_", "kvrouterd_workers 2\n", "kvrouterd_tracked_requests 1\n"}) {
    EXPECT_NE(metrics.body.find(expected), std::string::npos) << expected;
  }
  Stop();
}

// Requests refused before they are parsed whole (malformed, chunked, too large, too slow) are
// counted too, as path "unparsed" with their status: they were not counted at all.
TEST_F(KvrouterdTest, RefusedRequestsAreCounted) {
  WriteConfig({"id=1", "id=2"}, "request-read-timeout-seconds = 0.2\n");
  Start();
  const auto refused_status = [&](const std::string& bytes) {
    const int fd = kvrouterd_test::Connect(port_);
    kvrouterd_test::SendAll(fd, bytes);
    const auto answers = kvrouterd_test::ParseAnswers(kvrouterd_test::ReadToEnd(fd));
    close(fd);
    return answers.size() == 1 ? answers[0].status : 0;
  };
  EXPECT_EQ(refused_status("HELLO\r\n\r\n"), 400);
  EXPECT_EQ(refused_status("HELLO\r\n\r\n"), 400);
  EXPECT_EQ(refused_status("POST /v1/route HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"), 411);
  EXPECT_EQ(refused_status("POST /v1/route HTTP/1.1\r\nContent-Length: 70000\r\n\r\n"), 413);
  EXPECT_EQ(
      refused_status("GET /healthz HTTP/1.1\r\nX-Big: " + std::string(70000, 'x') + "\r\n\r\n"),
      431);
  EXPECT_EQ(refused_status("POST /v1/route HTTP/1.1\r\nContent-Length: 10\r\n\r\n{"), 408);
  const std::string metrics = Get("/metrics").body;
  for (const char* expected :
       {"kvrouterd_http_requests_total{path=\"unparsed\",code=\"400\"} 2\n",
        "kvrouterd_http_requests_total{path=\"unparsed\",code=\"408\"} 1\n",
        "kvrouterd_http_requests_total{path=\"unparsed\",code=\"411\"} 1\n",
        "kvrouterd_http_requests_total{path=\"unparsed\",code=\"413\"} 1\n",
        "kvrouterd_http_requests_total{path=\"unparsed\",code=\"431\"} 1\n"}) {
    EXPECT_NE(metrics.find(expected), std::string::npos) << expected << metrics;
  }
  Stop();
}

// Keep-alive and pipelining: three requests in one write, answered in order on one connection,
// the routing one (off the loop) in the middle.
TEST_F(KvrouterdTest, PipelinedRequestsAreAnsweredInOrder) {
  Start();
  const int fd = kvrouterd_test::Connect(port_);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(kvrouterd_test::SendAll(
      fd, kvrouterd_test::RequestText("GET", "/healthz", "") +
              kvrouterd_test::RequestText("POST", "/v1/route", RouteBody("pipelined")) +
              kvrouterd_test::RequestText("GET", "/v1/workers/1", "", "Connection: close\r\n")));
  const auto answers = kvrouterd_test::ParseAnswers(kvrouterd_test::ReadToEnd(fd));
  close(fd);
  ASSERT_EQ(answers.size(), 3u);
  EXPECT_EQ(Body(answers[0])["status"], "ok");
  EXPECT_EQ(Body(answers[1])["request_id"], "pipelined");
  EXPECT_EQ(Body(answers[2])["worker_id"], 1);
  Stop();
}

TEST_F(KvrouterdTest, ReloadAppliesTheConfigsWorkerChanges) {
  Start();
  ASSERT_EQ(Post("/v1/route", RouteBody("on-1", {{"allowed_worker_ids", {1}}})).status, 200);
  ASSERT_EQ(Post("/v1/route", RouteBody("on-2", {{"allowed_worker_ids", {2}}})).status, 200);
  // Worker 1 moves (same ranks: its requests stay), 2 goes, 3 comes.
  const std::string events = "tcp://127.0.0.1:" + std::to_string(FreePort());
  WriteConfig({"id=1,address=10.0.0.11:8000", "id=3,address=10.0.0.3:8000,events=" + events});
  daemon_->Signal(SIGHUP);
  ASSERT_TRUE(WaitFor([&] { return Get("/v1/workers/3").status == 200; }));
  EXPECT_EQ(Get("/v1/workers/2").status, 404);
  EXPECT_EQ(Body(Get("/v1/workers/1"))["address"], "10.0.0.11:8000");
  EXPECT_EQ(Body(Get("/v1/workers/3"))["events"]["endpoint"], events);
  EXPECT_NE(Get("/metrics").body.find("kind=\"engine\",endpoint=\"" + events + "\"}"),
            std::string::npos);
  EXPECT_EQ(Body(Post("/v1/route", RouteBody("on-1")))["replayed"], true);  // still booked
  const json moved = Body(Post("/v1/route", RouteBody("on-2")));
  EXPECT_EQ(moved["replayed"], false);  // its worker is gone, and its booking with it
  EXPECT_NE(Get("/metrics").body.find("kvrouterd_reloads_total{result=\"ok\"} 1\n"),
            std::string::npos);

  // A config refused changes nothing: the `n`-th reload counted as an error.
  const auto refused = [&](int n) {
    daemon_->Signal(SIGHUP);
    EXPECT_TRUE(WaitFor([&] {
      return Get("/metrics")
                 .body.find("kvrouterd_reloads_total{result=\"error\"} " + std::to_string(n) +
                            "\n") != std::string::npos;
    }));
    EXPECT_EQ(Get("/v1/workers/3").status, 200);
  };
  // One that does not parse.
  WriteConfig({"id=1,address=10.0.0.11:8000", "oops"});
  refused(1);
  // One that parses but is invalid (it was applied: a negative shutdown timeout left SIGTERM
  // without a deadline).
  WriteConfig({"id=1,address=10.0.0.11:8000"}, "shutdown-timeout-seconds = -1\n");
  refused(2);
  // One the library would refuse at the next start (it passed as "needs a restart", and the
  // restart failed).
  WriteConfig({"id=1,address=10.0.0.11:8000"}, "temperature = -1\n");
  refused(3);

  // One with a worker the library refuses (no ranks), as a start would refuse it.
  WriteConfig({"id=1,address=10.0.0.11:8000", "id=4,dp-size=0"});
  refused(4);
  EXPECT_EQ(Get("/v1/workers/4").status, 404);
  WriteConfig({"id=1,address=10.0.0.11:8000", "id=4"});
  daemon_->Signal(SIGHUP);
  EXPECT_TRUE(WaitFor([&] { return Get("/v1/workers/4").status == 200; }));
  EXPECT_EQ(Get("/v1/workers/3").status, 404);
  Stop();
}

// A reload the next start would refuse changes nothing, its worker lines checked as a start
// checks them (the library's checks of the ranks and event endpoints, an id given twice), and
// is counted as an error; the lines in effect stay the previous ones, so that setting the file
// back is no change, and a corrected file applies. (A bad endpoint was applied halfway, the
// address and ranks changed and the subscription dropped, and counted ok; the daemon took the
// refused line as not applied, so that setting the file back changed nothing either.)
TEST_F(KvrouterdTest, AReloadAStartWouldRefuseChangesNothing) {
  FakeEngine engine;
  const std::string line = "id=5,address=h:5,engine=vllm,events=" + engine.endpoint();
  WriteConfig({line});
  Start();
  ASSERT_TRUE(engine.Accept());
  ASSERT_EQ(Post("/v1/route", RouteBody("on-5")).status, 200);
  const json before = Body(Get("/v1/workers/5"));
  const auto reload = [&](const std::string& result, int n) {
    daemon_->Signal(SIGHUP);
    return WaitFor([&] {
      return Get("/metrics")
                 .body.find("kvrouterd_reloads_total{result=\"" + result + "\"} " +
                            std::to_string(n) + "\n") != std::string::npos;
    });
  };
  WriteConfig({"id=5,address=h:55,dp-size=2,engine=vllm,events=garbage"});
  ASSERT_TRUE(reload("error", 1));
  EXPECT_EQ(Body(Get("/v1/workers/5")), before);
  EXPECT_EQ(Body(Post("/v1/route", RouteBody("on-5")))["replayed"], true);
  engine.Drop();
  EXPECT_TRUE(engine.Accept());  // still subscribed
  WriteConfig({line, "id=6", "id=6,address=h:6"});
  ASSERT_TRUE(reload("error", 2));
  EXPECT_EQ(Get("/v1/workers/6").status, 404);
  EXPECT_NE(Get("/metrics").body.find("kvrouterd_reloads_total{result=\"ok\"} 0\n"),
            std::string::npos);

  WriteConfig({line});  // what runs
  ASSERT_TRUE(reload("ok", 1));
  EXPECT_EQ(Body(Get("/v1/workers/5")), before);
  WriteConfig({"id=5,address=h:55,dp-size=2"});
  ASSERT_TRUE(reload("ok", 2));
  const json after = Body(Get("/v1/workers/5"));
  EXPECT_EQ(after["address"], "h:55");
  EXPECT_EQ(after["dp_size"], 2);
  EXPECT_TRUE(after["events"].is_null());
  Stop();
}

// A worker change that fails while a reload applies it (its id added over HTTP meanwhile, an
// endpoint the library cannot connect to) is undone and makes the reload an error; the other
// changes apply, and the next reload compares the file with what runs and tries it again.
// (Such reloads counted ok, and a half-made change was taken as not made.)
TEST_F(KvrouterdTest, AReloadWhoseWorkerChangeFailsIsAnErrorAndTriedAgain) {
  Start();
  ASSERT_EQ(Post("/v1/workers", R"({"worker_id": 3, "address": "http:3"})").status, 201);
  ASSERT_EQ(Post("/v1/route", RouteBody("on-2", {{"allowed_worker_ids", {2}}})).status, 200);
  const json worker_2 = Body(Get("/v1/workers/2"));
  WriteConfig({"id=1,address=10.0.0.11:8000",
               "id=2,address=10.0.0.22:8000,dp-size=2,events=" + UnconnectableIpc(dir_),
               "id=3,address=file:3"});
  daemon_->Signal(SIGHUP);
  ASSERT_TRUE(WaitFor([&] {
    return Get("/metrics").body.find("kvrouterd_reloads_total{result=\"error\"} 1\n") !=
           std::string::npos;
  }));
  EXPECT_NE(Get("/metrics").body.find("kvrouterd_reloads_total{result=\"ok\"} 0\n"),
            std::string::npos);
  EXPECT_EQ(Body(Get("/v1/workers/1"))["address"], "10.0.0.11:8000");  // applied
  EXPECT_EQ(Body(Get("/v1/workers/2")), worker_2);                     // undone
  EXPECT_EQ(Body(Post("/v1/route", RouteBody("on-2")))["replayed"], true);
  EXPECT_EQ(Body(Get("/v1/workers/3"))["address"], "http:3");  // left alone

  // Worker 3 gone over HTTP, worker 2's line corrected: the next reload applies both.
  ASSERT_EQ(Delete("/v1/workers/3").status, 200);
  WriteConfig({"id=1,address=10.0.0.11:8000", "id=2,address=10.0.0.22:8000,dp-size=2",
               "id=3,address=file:3"});
  daemon_->Signal(SIGHUP);
  ASSERT_TRUE(WaitFor([&] {
    return Get("/metrics").body.find("kvrouterd_reloads_total{result=\"ok\"} 1\n") !=
           std::string::npos;
  }));
  EXPECT_EQ(Body(Get("/v1/workers/2"))["address"], "10.0.0.22:8000");
  EXPECT_EQ(Body(Get("/v1/workers/2"))["dp_size"], 2);
  EXPECT_EQ(Body(Get("/v1/workers/3"))["address"], "file:3");
  Stop();
}

// A setting that applies only at start, changed on reload, is logged as needing a restart, on
// every reload while it differs from what runs, and not once set back. (What runs was taken to
// be the last reload's: a second reload said nothing, and setting it back warned.)
TEST_F(KvrouterdTest, ReloadWarnsOfRestartOnlySettingsAgainstWhatRuns) {
  const std::string log = dir_ + "/kvrouterd.log";
  const std::vector<std::string> workers = {"id=1,address=10.0.0.1:8000",
                                            "id=2,address=10.0.0.2:8000"};
  Start({}, log);
  const auto warnings = [&] {
    std::istringstream lines(kvrouterd_test::ReadFile(log));
    int count = 0;
    for (std::string text; std::getline(lines, text);) {
      const json line = json::parse(text, nullptr, false);
      if (line.is_object() &&
          line.value("msg", "") ==
              "reload: these settings changed and apply only after a restart" &&
          line["settings"] == json::array({"preview-threads"})) {
        ++count;
      }
    }
    return count;
  };
  const auto reload = [&](int ok) {
    daemon_->Signal(SIGHUP);
    EXPECT_TRUE(WaitFor([&] {
      return Get("/metrics")
                 .body.find("kvrouterd_reloads_total{result=\"ok\"} " + std::to_string(ok) +
                            "\n") != std::string::npos;
    }));
  };
  WriteConfig(workers, "preview-threads = 3\n");
  reload(1);
  EXPECT_EQ(warnings(), 1) << kvrouterd_test::ReadFile(log);
  reload(2);
  EXPECT_EQ(warnings(), 2);
  WriteConfig(workers);  // back to what runs
  reload(3);
  EXPECT_EQ(warnings(), 2);
  Stop();
}

TEST_F(KvrouterdTest, SigtermStopsGracefully) {
  Start();
  ASSERT_EQ(Post("/v1/route", RouteBody("t")).status, 200);
  daemon_->Signal(SIGTERM);
  EXPECT_EQ(daemon_->WaitExit(), std::optional<int>(0));
  EXPECT_EQ(Get("/healthz").status, 0);  // no longer listening
}

// What SIGTERM does to connections (docs/kvrouterd.md, "Stopping"): no request is read from
// then on, so a probe never sees /healthz's "stopping" (the page promised it): idle
// connections and one whose body is still arriving are closed unanswered, new ones refused; a
// request read whole is answered (here a queued route, cancelled at the timeout) with
// Connection: close, and what is pipelined behind it is not run.
TEST_F(KvrouterdTest, AtSigtermNoFurtherRequestIsRead) {
  WriteConfig({"id=1,max-num-batched-tokens=1"},
              "queue-threshold = 0\nshutdown-timeout-seconds = 1\n");
  Start();
  ASSERT_EQ(Post("/v1/route", RouteBody("a")).status, 200);  // the one rank busy now
  const int busy = kvrouterd_test::Connect(port_);
  ASSERT_TRUE(kvrouterd_test::SendAll(
      busy, kvrouterd_test::RequestText("POST", "/v1/route", RouteBody("b")) +
                kvrouterd_test::RequestText("GET", "/healthz", "")));
  ASSERT_TRUE(MetricIs("kvrouterd_routing_calls_running", 1));  // b waits in the queue
  const int idle = kvrouterd_test::Connect(port_);
  const int partial = kvrouterd_test::Connect(port_);
  ASSERT_TRUE(kvrouterd_test::SendAll(
      partial, "POST /v1/route HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"request_id\""));
  // Every one accepted (the metrics request's own connection is the fourth).
  ASSERT_TRUE(MetricIs("kvrouterd_http_connections", 4));
  daemon_->Signal(SIGTERM);
  EXPECT_EQ(kvrouterd_test::ReadToEnd(idle), "");
  EXPECT_EQ(kvrouterd_test::ReadToEnd(partial), "");
  EXPECT_TRUE(WaitFor([&] {
    const int fd = kvrouterd_test::Connect(port_);
    if (fd >= 0) close(fd);
    return fd < 0;
  }));
  const auto answers = kvrouterd_test::ParseAnswers(kvrouterd_test::ReadToEnd(busy));
  ASSERT_EQ(answers.size(), 1u);  // the pipelined /healthz was not run
  EXPECT_EQ(answers[0].status, 409) << answers[0].body;
  EXPECT_NE(answers[0].head.find("Connection: close"), std::string::npos) << answers[0].head;
  for (const int fd : {busy, idle, partial}) close(fd);
  EXPECT_EQ(daemon_->WaitExit(), std::optional<int>(0));
}

// With a queue (threshold 0: a rank with any prefill in flight is busy), a request waits off the
// loop while others are served; a queue timeout is 504; at SIGTERM the daemon waits for the
// queued request, cancels it after shutdown-timeout-seconds (409 CANCELLED) and exits 0.
TEST_F(KvrouterdTest, QueuedRequestsTimeOutOrAreCancelledAtShutdown) {
  WriteConfig({"id=1,max-num-batched-tokens=1", "id=2,max-num-batched-tokens=1"},
              "queue-threshold = 0\nshutdown-timeout-seconds = 0.5\n");
  Start();
  ASSERT_EQ(Post("/v1/route", RouteBody("a1")).status, 200);
  ASSERT_EQ(Post("/v1/route", RouteBody("a2")).status, 200);  // both ranks busy now
  const HttpAnswer timed_out = Post("/v1/route", RouteBody("c", {{"queue_timeout_ms", 100}}));
  EXPECT_EQ(timed_out.status, 504) << timed_out.body;
  EXPECT_EQ(Body(timed_out)["error"]["status"], "DEADLINE_EXCEEDED");

  HttpAnswer queued;
  std::thread waiter([&] { queued = Post("/v1/route", RouteBody("b")); });
  // While "b" waits in the queue, the loop still answers.
  EXPECT_TRUE(WaitFor([&] {
    return Get("/metrics").body.find("kvrouterd_tracked_requests 3\n") != std::string::npos;
  }));
  EXPECT_EQ(Get("/healthz").status, 200);
  // A retry of b waits for b's answer, and ends with it (not refused at once at the stop: b
  // might still have been admitted, and the retry's client left with a refusal).
  std::future<HttpAnswer> retry = PostAsync("/v1/route", RouteBody("b"));
  ASSERT_TRUE(MetricIs("kvrouterd_routing_calls_running", 2));
  daemon_->Signal(SIGTERM);
  waiter.join();
  EXPECT_EQ(queued.status, 409) << queued.body;
  EXPECT_EQ(Body(queued)["error"]["status"], "CANCELLED");
  const HttpAnswer retried = retry.get();
  EXPECT_EQ(retried.status, 409) << retried.body;
  EXPECT_EQ(Body(retried)["error"]["status"], "CANCELLED");
  EXPECT_EQ(daemon_->WaitExit(), std::optional<int>(0));
}

// A request whose free never comes is dropped past request-expiry-seconds by the daemon's own
// timer, though no other call comes to sweep it: the request it kept in the queue is admitted
// (it waited for good before), the gauges drop, and the lost id may be booked again.
TEST_F(KvrouterdTest, ALostRequestIsExpiredAndReleasesTheQueue) {
  WriteConfig({"id=1,max-num-batched-tokens=1"},
              "queue-threshold = 0\nrequest-expiry-seconds = 1\n");
  Start();
  ASSERT_EQ(Post("/v1/route", RouteBody("lost")).status, 200);  // the only rank is busy now
  const HttpAnswer admitted = Post("/v1/route", RouteBody("next", {{"queue_timeout_ms", 8000}}));
  EXPECT_EQ(admitted.status, 200) << admitted.body;
  EXPECT_EQ(Delete("/v1/requests/next").status, 200);
  EXPECT_TRUE(MetricIs("kvrouter_requests_active", 0));
  const HttpAnswer again = Post("/v1/route", RouteBody("lost"));
  EXPECT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(Body(again)["replayed"], false) << "booked anew, not the expired booking replayed";
  Stop();
}

// The index survives a restart through the snapshot endpoints.
TEST_F(KvrouterdTest, RestartRestoresTheSnapshot) {
  Start();
  PublishCachedPrefix();
  ASSERT_TRUE(PreviewSeesCachedPrefix());
  const HttpAnswer snapshot = Get("/v1/snapshot");
  ASSERT_EQ(snapshot.status, 200);
  EXPECT_NE(snapshot.head.find("Content-Type: application/octet-stream"), std::string::npos);
  ASSERT_FALSE(snapshot.body.empty());
  Stop();

  Start();
  EXPECT_EQ(Body(Post("/v1/preview", RouteBody("")))["overlap_blocks"], 0);
  const HttpAnswer restored = Http(port_, "PUT", "/v1/snapshot", snapshot.body);
  ASSERT_EQ(restored.status, 200) << restored.body;
  EXPECT_EQ(Body(restored)["digest"].get<std::string>().size(), 16u);
  const json decision = Body(Post("/v1/preview", RouteBody("")));
  EXPECT_EQ(decision["worker_id"], 2);
  EXPECT_EQ(decision["overlap_blocks"], 2);
  const int refused = Http(port_, "PUT", "/v1/snapshot", "garbage").status;
  EXPECT_TRUE(refused == 400 || refused == 409) << refused;  // not a snapshot; index not empty
  Stop();

  // A new replica starts warm from a file holding that snapshot.
  const std::string file = ConfigPath() + ".snapshot";
  std::ofstream(file, std::ios::binary) << snapshot.body;
  Start({"--snapshot-file", file});
  const json warm = Body(Post("/v1/preview", RouteBody("")));
  EXPECT_EQ(warm["worker_id"], 2);
  EXPECT_EQ(warm["overlap_blocks"], 2);
  Stop();
  std::filesystem::remove(file);
}

// --bootstrap-from: a second daemon starts warm from the first one's snapshot; a peer that does
// not answer leaves it cold, and running.
TEST_F(KvrouterdTest, BootstrapFromAPeerStartsWarm) {
  Start();
  PublishCachedPrefix();
  ASSERT_TRUE(PreviewSeesCachedPrefix());
  const std::string peer = "http://127.0.0.1:" + std::to_string(port_);
  const std::string dead_peer = "http://127.0.0.1:" + std::to_string(FreePort());
  for (const bool warm : {true, false}) {
    const std::string port_file = dir_ + "/second.port";
    std::filesystem::remove(port_file);
    DaemonProcess second(KVRD_BINARY,
                         {"--listen=127.0.0.1:0", "--port-file", port_file, "--block-size=16",
                          "--worker=id=1", "--worker=id=2", "--bootstrap-from", dead_peer,
                          "--bootstrap-from", warm ? peer : dead_peer});
    ASSERT_TRUE(WaitFor([&] { return !kvrouterd_test::ReadFile(port_file).empty(); }));
    const int second_port = std::stoi(kvrouterd_test::ReadFile(port_file));
    const json decision = Body(Http(second_port, "POST", "/v1/preview", RouteBody("")));
    EXPECT_EQ(decision["overlap_blocks"], warm ? 2 : 0) << decision;
    const json digests = Body(Http(second_port, "GET", "/v1/digest"));
    EXPECT_EQ(digests["index_digest"] == Body(Get("/v1/digest"))["index_digest"], warm) << digests;
    second.Signal(SIGTERM);
    EXPECT_EQ(second.WaitExit(), std::optional<int>(0));
  }
  Stop();
}

// One routing thread, one worker that is busy as soon as it has any prefill in flight: a1 is
// booked, b waits in the admission queue on the only routing thread, c waits for that thread.
class RoutingThreadTest : public KvrouterdTest {
 protected:
  void StartBusy(const std::string& extra = "", int routing_threads = 1) {
    WriteConfig(
        {"id=1,max-num-batched-tokens=1"},
        "queue-threshold = 0\nrouting-threads = " + std::to_string(routing_threads) + "\n" + extra);
    Start();
    ASSERT_EQ(Post("/v1/route", RouteBody("a1")).status, 200);
    b_ = PostAsync("/v1/route", RouteBody("b"));
    ASSERT_TRUE(MetricIs("kvrouterd_tracked_requests", 2));  // b is in the admission queue
  }
  bool Ready(const std::future<HttpAnswer>& answer) {
    return answer.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  std::future<HttpAnswer> b_;
};

// A free of an id whose route still waits for a routing thread cancels it: it never books.
TEST_F(RoutingThreadTest, FreedWhileWaitingForAThreadNeverBooks) {
  StartBusy();
  std::future<HttpAnswer> c = PostAsync("/v1/route", RouteBody("c"));
  ASSERT_TRUE(MetricIs("kvrouterd_routing_calls_waiting", 1));
  EXPECT_EQ(Body(Delete("/v1/requests/c"))["freed"], false);  // not booked (yet)
  EXPECT_EQ(Body(Delete("/v1/requests/a1"))["freed"], true);  // b is admitted
  const HttpAnswer b = b_.get();
  ASSERT_EQ(b.status, 200) << b.body;
  EXPECT_EQ(Body(Delete("/v1/requests/b"))["freed"], true);
  const HttpAnswer cancelled = c.get();
  EXPECT_EQ(cancelled.status, 409) << cancelled.body;
  EXPECT_EQ(Body(cancelled)["error"]["status"], "CANCELLED");
  EXPECT_EQ(Metric("kvrouterd_tracked_requests"), 0);
  const json again = Body(Post("/v1/route", RouteBody("c")));
  EXPECT_EQ(again["replayed"], false) << again;  // booked by this call, the id was free
  EXPECT_EQ(again["booked"], true) << again;
  Stop();
}

// A route whose client left before a routing thread took it is not routed at all.
TEST_F(RoutingThreadTest, ClientGoneWhileWaitingForAThreadNeverBooks) {
  StartBusy();
  const int fd = kvrouterd_test::Connect(port_);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(kvrouterd_test::SendAll(
      fd, kvrouterd_test::RequestText("POST", "/v1/route", RouteBody("c"))));
  ASSERT_TRUE(MetricIs("kvrouterd_routing_calls_waiting", 1));
  close(fd);
  // The daemon saw it leave: b's connection and the one asking are left.
  ASSERT_TRUE(MetricIs("kvrouterd_http_connections", 2));
  EXPECT_EQ(Body(Delete("/v1/requests/a1"))["freed"], true);
  ASSERT_EQ(b_.get().status, 200);
  EXPECT_EQ(Body(Delete("/v1/requests/b"))["freed"], true);
  // c's call ends: refused (409), or, booked, once b's booking is freed (200, a third one).
  std::string metrics;
  ASSERT_TRUE(WaitFor([&] {
    metrics = Get("/metrics").body;
    return metrics.find("{path=\"/v1/route\",code=\"409\"} 1\n") != std::string::npos ||
           metrics.find("{path=\"/v1/route\",code=\"200\"} 3\n") != std::string::npos;
  }));
  EXPECT_NE(metrics.find("{path=\"/v1/route\",code=\"409\"} 1\n"), std::string::npos) << metrics;
  EXPECT_EQ(kvrouterd_test::MetricValue(metrics, "kvrouterd_tracked_requests"), 0);
  EXPECT_EQ(Body(Post("/v1/route", RouteBody("c")))["replayed"], false);
  Stop();
}

// A retry of b (still in the admission queue) waits for b's answer no longer than its own
// queue_timeout_ms, and gives its routing thread back when its client leaves. Before, it
// waited for as long as b did: for good here, on one of the two routing threads.
TEST_F(RoutingThreadTest, ARetryOfAQueuedIdWaitsWithinItsOwnTimeout) {
  StartBusy("", /*routing_threads=*/2);
  std::future<HttpAnswer> retry =
      PostAsync("/v1/route", RouteBody("b", {{"queue_timeout_ms", 200}}));
  if (retry.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    Delete("/v1/requests/a1");  // b is admitted: the retry gets its answer, too late
  }
  const HttpAnswer timed_out = retry.get();
  EXPECT_EQ(timed_out.status, 504) << timed_out.body;
  EXPECT_EQ(Body(timed_out)["error"]["status"], "DEADLINE_EXCEEDED");

  // A retry without a timeout holds the second thread (c waits for it) until its client
  // leaves; then c gets the thread and claims its id (three tracked) while b still waits.
  const int fd = kvrouterd_test::Connect(port_);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(kvrouterd_test::SendAll(
      fd, kvrouterd_test::RequestText("POST", "/v1/route", RouteBody("b"))));
  ASSERT_TRUE(MetricIs("kvrouterd_routing_calls_running", 2));  // b and its retry
  std::future<HttpAnswer> c = PostAsync("/v1/route", RouteBody("c"));
  ASSERT_TRUE(MetricIs("kvrouterd_routing_calls_waiting", 1));
  EXPECT_EQ(Metric("kvrouterd_tracked_requests"), 2);  // a1 and b: c has no thread
  close(fd);
  EXPECT_TRUE(MetricIs("kvrouterd_tracked_requests", 3));
  EXPECT_FALSE(Ready(b_));
  EXPECT_EQ(Body(Delete("/v1/requests/a1"))["freed"], true);
  EXPECT_EQ(b_.get().status, 200);
  EXPECT_EQ(Body(Delete("/v1/requests/b"))["freed"], true);
  EXPECT_EQ(c.get().status, 200);
  Stop();
}

// queue_timeout_ms runs from the request's arrival: a route that spent it waiting for a routing
// thread is admitted only at once, not after a whole timeout more in the queue.
TEST_F(RoutingThreadTest, QueueTimeoutCountsTheWaitForAThread) {
  StartBusy();
  std::future<HttpAnswer> c = PostAsync("/v1/route", RouteBody("c", {{"queue_timeout_ms", 3000}}));
  ASSERT_TRUE(MetricIs("kvrouterd_routing_calls_waiting", 1));
  // c's whole timeout passes while it waits for the thread (a lower bound: slower is fine).
  std::this_thread::sleep_for(std::chrono::milliseconds(3500));
  EXPECT_EQ(Body(Post("/v1/requests/b/abort", ""))["request_id"], "b");  // b leaves the queue
  EXPECT_EQ(b_.get().status, 409);
  // Now c has the thread and a1 still holds the worker: c is answered at once. Had it got a new
  // timeout, it would still be waiting in the router's queue, and a1's free would admit it.
  // (Not "c is in the queue": it is, for the moment before its spent timeout cancels it, and a
  // free then admits it; that failed so in CI. Nor "c is tracked": c claims its id before it
  // routes.)
  if (c.wait_for(std::chrono::milliseconds(2500)) != std::future_status::ready) {
    Delete("/v1/requests/a1");
  }
  const HttpAnswer timed_out = c.get();
  EXPECT_EQ(timed_out.status, 504) << timed_out.body;
  EXPECT_EQ(Body(timed_out)["error"]["status"], "DEADLINE_EXCEEDED");
  Stop();
}

// Previews run on threads of their own (preview-threads): with the only routing thread held by
// a route waiting in the admission queue, a preview is still answered (on libuv's pool it
// would wait for that thread; on the loop, its body's parse stalled every connection).
TEST_F(RoutingThreadTest, APreviewIsAnsweredWhileEveryRoutingThreadWaits) {
  StartBusy("preview-threads = 1\n");
  const HttpAnswer preview = Post("/v1/preview", RouteBody(""));
  ASSERT_EQ(preview.status, 200) << preview.body;
  EXPECT_EQ(Body(preview)["worker_id"], 1);
  EXPECT_FALSE(Ready(b_));  // b still waits
  EXPECT_EQ(Body(Delete("/v1/requests/a1"))["freed"], true);
  EXPECT_EQ(b_.get().status, 200);
  Stop();
}

// SIGTERM with a route waiting in the queue and another waiting for the routing thread: the
// first is cancelled after shutdown-timeout-seconds, the second refused, and the daemon exits.
TEST_F(KvrouterdTest, SigtermDoesNotWaitForeverForRoutesWaitingForAThread) {
  WriteConfig({"id=1,max-num-batched-tokens=1", "id=2,max-num-batched-tokens=1"},
              "queue-threshold = 0\nshutdown-timeout-seconds = 0.5\nrouting-threads = 1\n");
  Start();
  ASSERT_EQ(Post("/v1/route", RouteBody("a1")).status, 200);
  ASSERT_EQ(Post("/v1/route", RouteBody("a2")).status, 200);  // both ranks busy now
  std::future<HttpAnswer> b = PostAsync("/v1/route", RouteBody("b"));
  ASSERT_TRUE(MetricIs("kvrouterd_tracked_requests", 3));
  std::future<HttpAnswer> c = PostAsync("/v1/route", RouteBody("c"));
  ASSERT_TRUE(MetricIs("kvrouterd_routing_calls_waiting", 1));
  daemon_->Signal(SIGTERM);
  const HttpAnswer queued = b.get();
  EXPECT_EQ(queued.status, 409) << queued.body;
  const HttpAnswer waiting = c.get();
  EXPECT_TRUE(waiting.status == 409 || waiting.status == 503) << waiting.head << waiting.body;
  EXPECT_EQ(daemon_->WaitExit(120), std::optional<int>(0));
}

// shutdown-timeout-seconds = inf: queued requests are never cancelled (it was undefined, and in
// practice 0 ms: cancelled at once).
TEST_F(KvrouterdTest, InfiniteShutdownTimeoutNeverCancels) {
  WriteConfig({"id=1,max-num-batched-tokens=1"},
              "queue-threshold = 0\nshutdown-timeout-seconds = inf\n");
  Start();
  ASSERT_EQ(Post("/v1/route", RouteBody("a1")).status, 200);
  std::future<HttpAnswer> b = PostAsync("/v1/route", RouteBody("b"));
  ASSERT_TRUE(MetricIs("kvrouterd_tracked_requests", 2));
  daemon_->Signal(SIGTERM);
  // Not a deadline: had the timer fired at once, b would be answered within this.
  EXPECT_EQ(b.wait_for(std::chrono::seconds(2)), std::future_status::timeout);
  EXPECT_EQ(daemon_->WaitExit(0.1), std::nullopt);  // still stopping, waiting for b
  daemon_.reset();                                  // SIGKILL
  b.get();
}

// A JSON body beyond max-json-body-bytes is 413 (a snapshot keeps max-body-bytes), one nested
// too deep 400, and neither is parsed.
TEST_F(KvrouterdTest, JsonBodiesAreBoundedInSizeAndDepth) {
  WriteConfig({"id=1", "id=2"}, "max-json-body-bytes = 4096\n");  // max-body-bytes = 65536
  Start();
  const std::string deep =
      R"({"token_ids": [1, 2, 3], "x": )" + std::string(1000, '[') + std::string(1000, ']') + "}";
  ASSERT_LT(deep.size(), 4096u);
  ASSERT_TRUE(json::accept(deep));
  HttpAnswer answer = Post("/v1/preview", deep);
  EXPECT_EQ(answer.status, 400) << answer.body;
  EXPECT_EQ(Body(answer)["error"]["message"],
            "the body nests arrays and objects deeper than 32 levels");

  std::string large = RouteBody("");
  large += std::string(5000 - large.size(), ' ');
  answer = Post("/v1/preview", large);
  EXPECT_EQ(answer.status, 413) << answer.body;
  EXPECT_EQ(Body(answer)["error"]["message"],
            "the request body is larger than max-json-body-bytes allows");
  answer = Http(port_, "PUT", "/v1/snapshot", std::string(5000, 'x'));  // not JSON: not limited so
  EXPECT_TRUE(answer.status == 400 || answer.status == 409) << answer.status << answer.body;
  EXPECT_EQ(Post("/v1/preview", RouteBody("")).status, 200);
  EXPECT_EQ(Get("/healthz").status, 200);
  Stop();
}

// Memory given back cannot be seen under AddressSanitizer: its heap quarantines what is freed,
// so the daemon's resident memory does not fall.
#ifdef KVR_TEST_ASAN
#define SKIP_UNDER_ASAN() GTEST_SKIP() << "AddressSanitizer keeps freed memory resident"
#else
#define SKIP_UNDER_ASAN() (void)0
#endif

// Shuts a socket down and closes it when it goes out of scope: a sender blocked on it (a
// std::async whose future waits in its destructor) then returns, also when an assertion ends
// the test early.
class CloseOnExit {
 public:
  explicit CloseOnExit(int fd) : fd_(fd) {}
  ~CloseOnExit() {
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
  }
  CloseOnExit(const CloseOnExit&) = delete;
  CloseOnExit& operator=(const CloseOnExit&) = delete;

 private:
  int fd_;
};

// The daemon's resident memory in bytes (VmRSS), -1 if unknown.
double ResidentBytes(pid_t pid) {
  std::istringstream lines(kvrouterd_test::ReadFile("/proc/" + std::to_string(pid) + "/status"));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) * 1024;  // in kB
  }
  return -1;
}

// A request refused halfway (here 408, its 40 MB body not all sent) is let go at once: its
// connection is drained for up to request-read-timeout-seconds more, and held the request's
// body all along. (A buffer this large is mmapped, so freed it leaves the resident memory.)
TEST_F(KvrouterdTest, ARefusedRequestIsNotHeldWhileItsClientIsDrained) {
  SKIP_UNDER_ASAN();
  WriteConfig({"id=1", "id=2"}, "max-body-bytes = 50000000\nrequest-read-timeout-seconds = 2\n");
  Start();
  const double before = ResidentBytes(daemon_->pid());
  ASSERT_GT(before, 0);
  const int fd = kvrouterd_test::Connect(port_);
  ASSERT_GE(fd, 0);
  constexpr size_t kBody = 40000000;
  ASSERT_TRUE(kvrouterd_test::SendAll(
      fd, "PUT /v1/snapshot HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(kBody) +
              "\r\n\r\n" + std::string(kBody - 1, 'x')));
  const HttpAnswer refused = ReadOneAnswer(fd);  // after the read timeout; the drain begins
  const double draining = ResidentBytes(daemon_->pid());
  EXPECT_EQ(refused.status, 408) << refused.head;
  EXPECT_LT(draining - before, kBody / 2) << "resident: " << before << " then " << draining;
  close(fd);
  EXPECT_EQ(Get("/healthz").status, 200);
  Stop();
}

// While a request is handled (here a route waiting in the admission queue), a connection reads
// ahead no more than a JSON request's worth of what is pipelined after it (max-json-body-bytes,
// 4 MiB by default); it read ahead up to max-body-bytes, here 40 MB of a snapshot that streams
// in as well once its turn comes.
TEST_F(KvrouterdTest, APipelinedRequestBehindABusyOneIsReadAheadOnlySoFar) {
  SKIP_UNDER_ASAN();
  WriteConfig({"id=1,max-num-batched-tokens=1"},
              "queue-threshold = 0\nmax-body-bytes = 50000000\n");
  Start();
  ASSERT_EQ(Post("/v1/route", RouteBody("a1")).status, 200);  // the worker is busy from now on
  const double before = ResidentBytes(daemon_->pid());
  ASSERT_GT(before, 0);
  const int fd = kvrouterd_test::Connect(port_);
  ASSERT_GE(fd, 0);
  constexpr size_t kBody = 40000000;
  const std::string pipelined =
      kvrouterd_test::RequestText("POST", "/v1/route", RouteBody("b")) +
      kvrouterd_test::RequestText("PUT", "/v1/snapshot", std::string(kBody, 'x'),
                                  "Connection: close\r\n");
  std::future<bool> sent = std::async(std::launch::async, [&] {
    return kvrouterd_test::SendAll(fd, pipelined);  // blocks while the daemon reads no more
  });
  const CloseOnExit unblock(fd);  // after the future: gone first, before its wait
  ASSERT_TRUE(MetricIs("kvrouterd_tracked_requests", 2));  // b waits in the queue
  std::this_thread::sleep_for(std::chrono::seconds(1));    // what it reads ahead, it has read
  const double read_ahead = ResidentBytes(daemon_->pid());
  EXPECT_LT(read_ahead - before, kBody / 2) << "resident: " << before << " then " << read_ahead;

  EXPECT_EQ(Body(Delete("/v1/requests/a1"))["freed"], true);  // b is admitted and answered
  const auto answers = kvrouterd_test::ParseAnswers(kvrouterd_test::ReadToEnd(fd));
  EXPECT_TRUE(sent.get());
  ASSERT_EQ(answers.size(), 2u);
  EXPECT_EQ(answers[0].status, 200) << answers[0].body;
  EXPECT_TRUE(answers[1].status == 400 || answers[1].status == 409)  // read whole: not a snapshot
      << answers[1].status << answers[1].body;
  Stop();
}

// A request that does not arrive within request-read-timeout-seconds is answered 408 and its
// connection closed.
TEST_F(KvrouterdTest, ARequestArrivingTooSlowlyIsAnswered408) {
  WriteConfig({"id=1", "id=2"}, "request-read-timeout-seconds = 0.2\n");
  Start();
  const int fd = kvrouterd_test::Connect(port_);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(kvrouterd_test::SendAll(
      fd, "POST /v1/preview HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"token_ids\""));
  const auto answers = kvrouterd_test::ParseAnswers(kvrouterd_test::ReadToEnd(fd));
  close(fd);
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_EQ(answers[0].status, 408);
  EXPECT_EQ(Body(answers[0])["error"]["status"], "INVALID_ARGUMENT");
  EXPECT_EQ(Get("/healthz").status, 200);
  Stop();
}

// What the server sent on `fd` until it closed the connection; nullopt if it did not within
// the socket's receive timeout (30 s).
std::optional<std::string> UntilClosed(int fd) {
  std::string bytes;
  char buffer[4096];
  for (;;) {
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n == 0) return bytes;
    if (n < 0) return std::nullopt;
    bytes.append(buffer, static_cast<size_t>(n));
  }
}

// A client that pipelines requests and never reads the answers: the daemon stops taking its
// requests while 1 MiB of answers waits unsent (it wrote every answer into memory, without
// bound: here about 85 MB), lets it go once it has read nothing for an idle timeout, and
// answers other clients meanwhile.
TEST_F(KvrouterdTest, AClientThatNeverReadsGetsNoMoreAnswersQueued) {
  WriteConfig({"id=1", "id=2"}, "idle-timeout-seconds = 1\n");
  Start();
  int metrics_asked = 0;  // this test's own GET /metrics: counted too
  const auto metrics = [&] {
    ++metrics_asked;
    return Get("/metrics").body;
  };
  const int hog = kvrouterd_test::Connect(port_, /*receive_buffer_bytes=*/4096);
  ASSERT_GE(hog, 0);
  constexpr int kRequests = 8000;  // answers of about 10 KB each
  std::string pipelined;
  for (int i = 0; i < kRequests; ++i)
    pipelined += kvrouterd_test::RequestText("GET", "/metrics", "");
  // Blocks while the daemon reads nothing more; fails once it closes the connection.
  std::future<bool> sender =
      std::async(std::launch::async, [&] { return kvrouterd_test::SendAll(hog, pipelined); });
  std::string text;
  EXPECT_TRUE(WaitFor([&] {
    text = metrics();
    return kvrouterd_test::MetricValue(text, "kvrouterd_http_connections") == 1;  // this one
  })) << "the connection that reads nothing was never closed";
  shutdown(hog, SHUT_RDWR);
  sender.get();
  close(hog);
  const double answered =
      kvrouterd_test::MetricValue(text,
                                  R"(kvrouterd_http_requests_total{path="/metrics",code="200"})") -
      (metrics_asked - 1);
  EXPECT_GT(answered, 0);
  EXPECT_LT(answered, kRequests / 2);  // 1 MiB and what the kernel holds: a few hundred
  EXPECT_EQ(Get("/healthz").status, 200);
  Stop();
}

// A client that pipelines more than 1 MiB of answers' worth of requests and then reads gets
// every answer, in order: the connection that stopped for its unsent answers goes on.
TEST_F(KvrouterdTest, APipeliningClientThatReadsLateGetsEveryAnswer) {
  Start();
  // A small receive buffer: the answers pile up in the daemon, past its 1 MiB, however fast
  // the machine.
  const int fd = kvrouterd_test::Connect(port_, /*receive_buffer_bytes=*/4096);
  ASSERT_GE(fd, 0);
  constexpr int kRequests = 2000;  // about 10 MB of answers
  std::string pipelined;
  for (int i = 0; i < kRequests; ++i) {
    pipelined += kvrouterd_test::RequestText("GET", i % 2 ? "/metrics" : "/v1/workers/1", "");
  }
  pipelined += kvrouterd_test::RequestText("GET", "/healthz", "", "Connection: close\r\n");
  std::future<bool> sent =
      std::async(std::launch::async, [&] { return kvrouterd_test::SendAll(fd, pipelined); });
  const CloseOnExit unblock(fd);  // after the future: gone first, before its wait
  std::this_thread::sleep_for(std::chrono::seconds(1));  // the answers pile up unread
  const auto answers = kvrouterd_test::ParseAnswers(kvrouterd_test::ReadToEnd(fd));
  EXPECT_TRUE(sent.get());
  ASSERT_EQ(answers.size(), kRequests + 1u);
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_EQ(answers[i].status, 200) << i;
    if (i % 2 == 0) {
      ASSERT_EQ(Body(answers[i])["worker_id"], 1) << i;
    }
  }
  EXPECT_EQ(Body(answers[kRequests])["status"], "ok");
  Stop();
}

// Past max-connections a connection is accepted and closed at once, and counted; those open
// are served on, and a new one is taken once one of them closes.
TEST_F(KvrouterdTest, ConnectionsPastMaxConnectionsAreClosedAtOnce) {
  WriteConfig({"id=1", "id=2"}, "max-connections = 2\n");
  Start();
  const int a = kvrouterd_test::Connect(port_);
  const int b = kvrouterd_test::Connect(port_);
  ASSERT_TRUE(a >= 0 && b >= 0);
  for (int fd : {a, b}) {  // both accepted
    ASSERT_TRUE(kvrouterd_test::SendAll(fd, kvrouterd_test::RequestText("GET", "/healthz", "")));
    ASSERT_EQ(ReadOneAnswer(fd).status, 200);
  }
  const int refused = kvrouterd_test::Connect(port_);
  ASSERT_GE(refused, 0);  // the kernel accepts it; the daemon closes it unanswered
  EXPECT_EQ(UntilClosed(refused), std::optional<std::string>(""));
  close(refused);

  ASSERT_TRUE(kvrouterd_test::SendAll(b, kvrouterd_test::RequestText("GET", "/healthz", "")));
  EXPECT_EQ(ReadOneAnswer(b).status, 200);
  close(a);
  std::string metrics;
  ASSERT_TRUE(WaitFor([&] {
    const HttpAnswer answer = Get("/metrics");  // refused until the daemon saw a close
    metrics = answer.body;
    return answer.status == 200;
  }));
  EXPECT_GE(kvrouterd_test::MetricValue(metrics, "kvrouterd_http_connections_refused_total"), 1);
  EXPECT_EQ(kvrouterd_test::MetricValue(metrics, "kvrouterd_http_connections"), 2);
  close(b);
  Stop();
}

// A connection with no request under way for idle-timeout-seconds is closed: one that never
// sends, and a keep-alive one after its answer (both held a descriptor for good). A request on
// its way is not: the read timeout governs it.
TEST_F(KvrouterdTest, IdleConnectionsAreClosed) {
  WriteConfig({"id=1", "id=2"}, "idle-timeout-seconds = 1\n");
  Start();
  const int silent = kvrouterd_test::Connect(port_);
  const int kept_alive = kvrouterd_test::Connect(port_);
  const int slow = kvrouterd_test::Connect(port_);
  ASSERT_TRUE(silent >= 0 && kept_alive >= 0 && slow >= 0);
  ASSERT_TRUE(
      kvrouterd_test::SendAll(kept_alive, kvrouterd_test::RequestText("GET", "/healthz", "")));
  ASSERT_TRUE(kvrouterd_test::SendAll(slow, "POST /v1/preview HTTP/1.1\r\nHost: x\r\n"));

  EXPECT_EQ(UntilClosed(silent), std::optional<std::string>(""));
  const std::optional<std::string> kept_bytes = UntilClosed(kept_alive);
  ASSERT_TRUE(kept_bytes.has_value());
  const auto answers = kvrouterd_test::ParseAnswers(*kept_bytes);
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_EQ(answers[0].status, 200);

  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // well past the idle timeout
  const std::string body = RouteBody("");
  ASSERT_TRUE(kvrouterd_test::SendAll(slow, "Content-Length: " + std::to_string(body.size()) +
                                                "\r\nConnection: close\r\n\r\n" + body));
  const std::optional<std::string> slow_bytes = UntilClosed(slow);
  ASSERT_TRUE(slow_bytes.has_value());
  const auto slow_answers = kvrouterd_test::ParseAnswers(*slow_bytes);
  ASSERT_EQ(slow_answers.size(), 1u);
  EXPECT_EQ(slow_answers[0].status, 200) << slow_answers[0].body;
  for (int fd : {silent, kept_alive, slow}) close(fd);
  EXPECT_TRUE(MetricIs("kvrouterd_http_connections", 1));  // the metrics request's own
  Stop();
}

// A request pipelined after one that closes its connection is never run: its answer could not
// be sent (the connection closes once the first answer is written), so the client would not
// know it was done. (It was run: here the worker was removed, unanswered.)
TEST_F(KvrouterdTest, NothingAfterAnAnswerThatClosesTheConnectionIsRun) {
  Start();
  const int fd = kvrouterd_test::Connect(port_);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(kvrouterd_test::SendAll(
      fd, kvrouterd_test::RequestText("GET", "/healthz", "", "Connection: close\r\n") +
              kvrouterd_test::RequestText("DELETE", "/v1/workers/1", "")));
  const std::optional<std::string> bytes = UntilClosed(fd);
  close(fd);
  ASSERT_TRUE(bytes.has_value());
  const auto answers = kvrouterd_test::ParseAnswers(*bytes);
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_EQ(answers[0].status, 200);
  EXPECT_EQ(Get("/v1/workers/1").status, 200);  // not removed
  Stop();
}

// Without a read timeout, a refused client that never closes is drained for the idle timeout,
// not for good.
TEST_F(KvrouterdTest, WithoutAReadTimeoutARefusedClientIsDrainedForTheIdleTimeout) {
  WriteConfig({"id=1", "id=2"}, "request-read-timeout-seconds = 0\nidle-timeout-seconds = 0.5\n");
  Start();
  const int fd = kvrouterd_test::Connect(port_);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(kvrouterd_test::SendAll(fd, "NOT HTTP\r\n\r\n"));
  const std::optional<std::string> bytes = UntilClosed(fd);  // the answer, then its FIN
  ASSERT_TRUE(bytes.has_value());
  const auto answers = kvrouterd_test::ParseAnswers(*bytes);
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_EQ(answers[0].status, 400);
  // The client keeps its side open: the daemon lets it go (only the asking connection is left).
  EXPECT_TRUE(MetricIs("kvrouterd_http_connections", 1));
  close(fd);
  Stop();
}

// PUT dp_size 2 -> 1: the request booked on rank 1 went with the rank, and its id with it.
TEST_F(KvrouterdTest, ShrinkingAWorkersRanksForgetsTheirRequests) {
  WriteConfig({"id=1,dp-size=2", "id=2"});
  Start();
  const json on_rank_1 =
      Body(Post("/v1/route", RouteBody("on-1", {{"hints", {{"worker_id", 1}, {"dp_rank", 1}}}})));
  ASSERT_EQ(on_rank_1["dp_rank"], 1) << on_rank_1;
  const json on_rank_0 =
      Body(Post("/v1/route", RouteBody("on-0", {{"hints", {{"worker_id", 1}, {"dp_rank", 0}}}})));
  ASSERT_EQ(on_rank_0["dp_rank"], 0) << on_rank_0;
  ASSERT_EQ(Http(port_, "PUT", "/v1/workers/1", R"({"dp_size": 1})").status, 200);
  const json retried = Body(Post("/v1/route", RouteBody("on-1")));
  EXPECT_EQ(retried["replayed"], false) << retried;
  EXPECT_FALSE(retried["worker_id"] == 1 && retried["dp_rank"] == 1) << retried;
  EXPECT_EQ(Body(Post("/v1/route", RouteBody("on-0")))["replayed"], true);  // its rank stays
  Stop();
}

// request-expiry-seconds = 1e10 (meant as never) saturates: it was undefined (INT64_MIN, every
// booking born expired, so a retry was refused 409 instead of replayed).
TEST_F(KvrouterdTest, AVeryLongRequestExpiryKeepsRetriesReplayed) {
  WriteConfig({"id=1", "id=2"}, "request-expiry-seconds = 1e10\n");
  Start();
  ASSERT_EQ(Body(Post("/v1/route", RouteBody("r1")))["replayed"], false);
  const HttpAnswer retry = Post("/v1/route", RouteBody("r1"));
  EXPECT_EQ(retry.status, 200) << retry.body;
  EXPECT_EQ(Body(retry)["replayed"], true) << retry.body;
  Stop();
}

// HEAD is answered without a body (GET's headers), so that a keep-alive client reads the next
// answer where it starts; a HEAD where GET is not allowed too.
TEST_F(KvrouterdTest, HeadAnswersCarryNoBody) {
  Start();
  const int fd = kvrouterd_test::Connect(port_);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(kvrouterd_test::SendAll(
      fd, kvrouterd_test::RequestText("HEAD", "/healthz", "") +
              kvrouterd_test::RequestText("HEAD", "/v1/route", "") +
              kvrouterd_test::RequestText("GET", "/healthz", "", "Connection: close\r\n")));
  const std::string bytes = kvrouterd_test::ReadToEnd(fd);
  close(fd);
  std::vector<std::string> heads;
  size_t pos = 0;
  for (int i = 0; i < 2; ++i) {  // the two HEAD answers: a head each, nothing after it
    const size_t end = bytes.find("\r\n\r\n", pos);
    ASSERT_NE(end, std::string::npos) << bytes;
    heads.push_back(bytes.substr(pos, end - pos));
    pos = end + 4;
  }
  EXPECT_EQ(heads[0].rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << heads[0];
  EXPECT_NE(heads[0].find("Content-Length: "), std::string::npos) << heads[0];
  EXPECT_EQ(heads[1].rfind("HTTP/1.1 405 ", 0), 0u) << heads[1];
  EXPECT_NE(heads[1].find("Allow: POST"), std::string::npos) << heads[1];
  const auto last = kvrouterd_test::ParseAnswers(bytes.substr(pos));
  ASSERT_EQ(last.size(), 1u) << bytes.substr(pos);
  EXPECT_EQ(last[0].status, 200);
  EXPECT_EQ(Body(last[0])["status"], "ok");
  Stop();
}

// At log-level debug, one line per request names its method, path and status.
TEST_F(KvrouterdTest, DebugLogNamesEachRequest) {
  const std::string log = dir_ + "/kvrouterd.log";
  Start({}, log);
  ASSERT_EQ(Get("/healthz").status, 200);
  ASSERT_EQ(Delete("/v1/requests/x%20y").status, 200);
  const auto logged = [&](const std::string& method, const std::string& path, int status) {
    std::istringstream lines(kvrouterd_test::ReadFile(log));
    std::string text;
    while (std::getline(lines, text)) {
      const json line = json::parse(text, nullptr, false);
      if (line.is_object() && line.value("msg", "") == "http request" &&
          line.value("method", "") == method && line.value("path", "") == path &&
          line.value("status", 0) == status) {
        return true;
      }
    }
    return false;
  };
  EXPECT_TRUE(WaitFor([&] { return logged("GET", "/healthz", 200); }))
      << kvrouterd_test::ReadFile(log);
  EXPECT_TRUE(WaitFor([&] { return logged("DELETE", "/v1/requests/x%20y", 200); }));
  Stop();
}

// The command line: --help and --version exit 0; bad settings exit non-zero with a message.
TEST(KvrouterdCommandLineTest, ExitCodes) {
  const auto run = [](const std::vector<std::string>& args) {
    DaemonProcess process(KVRD_BINARY, args);
    return process.WaitExit();
  };
  EXPECT_EQ(run({"--help"}), std::optional<int>(0));
  EXPECT_EQ(run({"--version"}), std::optional<int>(0));
  EXPECT_EQ(run({"--block-size", "sixteen"}), std::optional<int>(2));
  EXPECT_EQ(run({"--no-such-option"}), std::optional<int>(2));
  EXPECT_EQ(run({"--max-header-bytes=1000000"}), std::optional<int>(2));
  EXPECT_EQ(run({"--max-connections=0"}), std::optional<int>(2));
  EXPECT_EQ(run({"--max-session-ttl-seconds=0"}), std::optional<int>(2));
  EXPECT_EQ(run({"--listen=localhost:0"}), std::optional<int>(2));  // a name, not an address
  EXPECT_EQ(run({"--bootstrap-from=router-a:8080"}), std::optional<int>(2));
  EXPECT_EQ(run({"--bootstrap-from=http://a:1", "--snapshot-file=/dev/null"}),
            std::optional<int>(2));
  // Refused by the library: a block size of 0, a worker twice.
  EXPECT_EQ(run({"--listen=127.0.0.1:0", "--block-size=0"}), std::optional<int>(1));
  EXPECT_EQ(run({"--listen=127.0.0.1:0", "--worker=id=1", "--worker=id=1"}), std::optional<int>(1));
}

}  // namespace

// kvrouterd's HTTP server while the heap refuses its loop thread's allocations (its own binary:
// it replaces operator new, tests/core/refusing_operator_new.h). Before, a refusal in a libuv or
// http_parser callback unwound into C frames: std::terminate, the daemon gone. Now the
// connection concerned is closed (answered 503 where the answer itself fits), the server goes
// on, and once memory is back it serves as before, new connections included.
#include <gtest/gtest.h>
#include <uv.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "e2e_support.h"
#include "kvrouterd/http_server.h"
#include "refusing_operator_new.h"

namespace {

// What the loop thread is refused: nothing, every allocation, or those over kLarge bytes (its
// 64 KiB read buffers and small answers then still get memory: a request's body does not).
enum class Refusing { kNothing, kEverything, kLarge };
std::atomic<Refusing> refusing{Refusing::kNothing};
constexpr size_t kLarge = 80 << 10;
thread_local bool on_loop_thread = false;
std::atomic<bool> slow_entered{false}, slow_released{false};

}  // namespace

// Only the server's loop thread is refused: the test's own thread allocates freely.
bool RefuseThisAllocation() noexcept {
  if (!on_loop_thread) return false;
  switch (refusing.load(std::memory_order_relaxed)) {
    case Refusing::kNothing:
      return false;
    case Refusing::kEverything:
      return true;
    case Refusing::kLarge:
      return refusing_operator_new::requested_bytes > kLarge;
  }
  return false;
}

namespace kvrouterd {
namespace {

// Sets what the loop is refused for its scope, and nothing again when it ends (an assertion
// ending the test early included).
class RefusingWhileAlive {
 public:
  explicit RefusingWhileAlive(Refusing what) { refusing = what; }
  ~RefusingWhileAlive() { refusing = Refusing::kNothing; }
  RefusingWhileAlive(const RefusingWhileAlive&) = delete;
  RefusingWhileAlive& operator=(const RefusingWhileAlive&) = delete;
};

// An HttpServer answering every request 200 "ok", on a loop thread of its own.
class ServerOnItsOwnThread {
 public:
  ServerOnItsOwnThread() {
    uv_loop_init(&loop_);
    uv_async_init(&loop_, &stop_, [](uv_async_t* async) {
      auto* self = static_cast<ServerOnItsOwnThread*>(async->data);
      self->server_->Shutdown([] {});
      uv_close(reinterpret_cast<uv_handle_t*>(&self->stop_), nullptr);
    });
    stop_.data = this;
    server_ =
        std::make_unique<HttpServer>(&loop_, HttpLimits{}, [](HttpRequest request, Responder r) {
          // "/slow" holds the loop until released: connections made meanwhile wait on the
          // listener together.
          if (request.path == "/slow") {
            slow_entered = true;
            while (!slow_released) std::this_thread::yield();
          }
          HttpResponse response;
          response.body = "ok";
          r.Respond(std::move(response));
        });
    listened_ = server_->Listen("127.0.0.1", 0);
    thread_ = std::thread([this] {
      on_loop_thread = true;
      uv_run(&loop_, UV_RUN_DEFAULT);
    });
  }
  ~ServerOnItsOwnThread() {
    uv_async_send(&stop_);
    thread_.join();
    server_.reset();
    uv_loop_close(&loop_);
  }
  const std::string& listened() const { return listened_; }
  int port() const { return server_->port(); }

 private:
  uv_loop_t loop_{};
  uv_async_t stop_{};
  std::unique_ptr<HttpServer> server_;
  std::string listened_;
  std::thread thread_;
};

// A GET on its own connection; status 0 if the connection closed without an answer.
int Get(int port, const std::string& path = "/") {
  return kvrouterd_test::Http(port, "GET", path).status;
}

// Refused from its accept on, a connection is taken and closed (by the server's spare handle
// when even that is refused); two waiting at once are both taken, the second once the spare
// is free again. Before: std::terminate.
TEST(HttpServerAllocationFailureTest, ConnectionsRefusedMemoryAreClosedAndTheServerGoesOn) {
  ServerOnItsOwnThread server;
  ASSERT_EQ(server.listened(), "");
  ASSERT_EQ(Get(server.port()), 200);
  {
    RefusingWhileAlive refuse(Refusing::kEverything);
    EXPECT_EQ(Get(server.port()), 0);
  }
  EXPECT_EQ(Get(server.port()), 200);

  // Two connections arrive while the loop is held: with everything refused, the spare takes
  // the first, and the second waits for it.
  std::future<int> slow =
      std::async(std::launch::async, [&] { return Get(server.port(), "/slow"); });
  while (!slow_entered) std::this_thread::yield();  // the loop is held in the handler
  std::string read[2];
  {
    RefusingWhileAlive refuse(Refusing::kEverything);
    const int first = kvrouterd_test::Connect(server.port());  // queued on the listener
    const int second = kvrouterd_test::Connect(server.port());
    slow_released = true;
    ASSERT_TRUE(first >= 0 && second >= 0);
    read[0] = kvrouterd_test::ReadToEnd(first);  // until the server closes it
    read[1] = kvrouterd_test::ReadToEnd(second);
    close(first);
    close(second);
  }
  EXPECT_EQ(read[0], "");  // closed unanswered
  EXPECT_EQ(read[1], "");
  EXPECT_EQ(slow.get(), 0);  // its answer was refused too: closed unanswered
  EXPECT_EQ(Get(server.port()), 200);
}

// A request whose body the heap refuses (its read buffers and the answers still get memory) is
// answered 503 and its connection closed; the request before it on the connection was answered.
TEST(HttpServerAllocationFailureTest, ARequestRefusedMemoryIsAnswered503) {
  ServerOnItsOwnThread server;
  const int fd = kvrouterd_test::Connect(server.port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(kvrouterd_test::SendAll(fd, kvrouterd_test::RequestText("GET", "/", "")));
  char first[512];
  ASSERT_GT(recv(fd, first, sizeof first, 0), 0);  // its answer (a few dozen bytes) came
  std::string rest;
  {
    RefusingWhileAlive refuse(Refusing::kLarge);
    ASSERT_TRUE(kvrouterd_test::SendAll(
        fd, kvrouterd_test::RequestText("POST", "/", std::string(200000, 'x'))));
    rest = kvrouterd_test::ReadToEnd(fd);  // until the server closes
  }
  close(fd);
  const auto answers = kvrouterd_test::ParseAnswers(rest);
  ASSERT_EQ(answers.size(), 1u) << rest;
  EXPECT_EQ(answers[0].status, 503);
  EXPECT_NE(answers[0].body.find("RESOURCE_EXHAUSTED"), std::string::npos) << answers[0].body;
  EXPECT_EQ(Get(server.port()), 200);
}

}  // namespace
}  // namespace kvrouterd

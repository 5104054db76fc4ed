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

std::atomic<bool> refusing{false};
thread_local bool on_loop_thread = false;

}  // namespace

// Only the server's loop thread is refused: the test's own thread allocates freely.
bool RefuseThisAllocation() noexcept {
  return on_loop_thread && refusing.load(std::memory_order_relaxed);
}

namespace kvrouterd {
namespace {

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
    server_ = std::make_unique<HttpServer>(&loop_, HttpLimits{}, [](HttpRequest, Responder r) {
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
int Get(int port) { return kvrouterd_test::Http(port, "GET", "/").status; }

TEST(HttpServerAllocationFailureTest, ARefusedConnectionIsClosedAndTheServerGoesOn) {
  ServerOnItsOwnThread server;
  ASSERT_EQ(server.listened(), "");
  ASSERT_EQ(Get(server.port()), 200);

  // Refused from its accept on: taken and closed.
  refusing = true;
  EXPECT_EQ(Get(server.port()), 0);
  refusing = false;
  EXPECT_EQ(Get(server.port()), 200);

  // Accepted, then refused while its request is read (a body, headers): closed, unanswered.
  const int fd = kvrouterd_test::Connect(server.port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(kvrouterd_test::SendAll(fd, kvrouterd_test::RequestText("GET", "/", "")));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // its first answer written
  refusing = true;
  ASSERT_TRUE(kvrouterd_test::SendAll(
      fd, kvrouterd_test::RequestText("POST", "/", std::string(100000, 'x'))));
  const std::string rest = kvrouterd_test::ReadToEnd(fd);  // until the server closes
  refusing = false;
  close(fd);
  const auto answers = kvrouterd_test::ParseAnswers(rest);
  ASSERT_GE(answers.size(), 1u);
  EXPECT_EQ(answers.front().status, 200);  // the first request's
  for (size_t i = 1; i < answers.size(); ++i) EXPECT_EQ(answers[i].status, 503);

  // Memory back: served as before.
  EXPECT_EQ(Get(server.port()), 200);
}

}  // namespace
}  // namespace kvrouterd

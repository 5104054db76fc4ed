// A small HTTP/1.1 server on a libuv loop: keep-alive, pipelined requests answered in order
// (the parser pauses after each request until its answer is given, and while 1 MiB of answers
// waits unsent to a client that does not read), Content-Length bodies
// with size limits (a chunked request body is refused with 411), a read timeout for requests
// that arrive too slowly (408), Expect: 100-continue, HEAD answered without a body. Requests
// go to one handler, which answers once through the Responder it gets, on the loop thread, now
// or later (after work off the loop).
#pragma once

#include <http_parser.h>
#include <uv.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

namespace kvrouterd {

struct HttpRequest {
  std::string method;
  std::string path;  // the URL's path, still percent-encoded
  std::string query;
  std::vector<std::pair<std::string, std::string>> headers;  // names lowercased
  std::string body;

  // The value of header `name` (lowercase), or nullptr.
  const std::string* Header(const std::string& name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers (e.g. Allow)
};

// The standard reason phrase of a status code ("Not Found").
const char* ReasonPhrase(int status);

// An error answer: {"error": {"status": STATUS_NAME, "message": MESSAGE}} (docs/kvrouterd.md).
HttpResponse ErrorResponse(int http_status, std::string_view status_name, std::string_view message);

// Serialises a response (status line, headers, body). The one writer of every answer. Without
// `with_body` (the answer to HEAD) the body is left out, its Content-Length kept.
std::string SerializeResponse(const HttpResponse& response, bool keep_alive, bool with_body = true);

struct Connection;

// Answers one request; holds its connection alive until called. Call once, on the loop thread.
class Responder {
 public:
  explicit Responder(std::shared_ptr<Connection> connection) : connection_(std::move(connection)) {}
  void Respond(HttpResponse response);
  // True once the client closed the connection (its answer would go nowhere); callable from
  // any thread, also after Respond.
  std::function<bool()> ClientGoneProbe() const;

 private:
  std::shared_ptr<Connection> connection_;
};

// The largest body a request may have, and the setting that says so (named in the 413 answer).
struct BodyLimit {
  uint64_t bytes;
  const char* setting;
};

struct HttpLimits {
  uint64_t max_header_bytes = 64 << 10;
  uint64_t max_body_bytes = 64 << 20;  // the largest of any request (and "max-body-bytes")
  // A request's own limit, from its method, path and headers (at most max_body_bytes); empty:
  // max_body_bytes for every request.
  std::function<BodyLimit(const HttpRequest& request)> body_limit;
  // What a connection reads ahead while one of its requests is handled, before it stops
  // reading. Nothing needs to fit: a request larger streams in once parsing goes on (its body
  // is taken as it arrives); reading ahead only lets the next request start at once.
  uint64_t max_read_ahead_bytes = (64 << 10) + (4 << 20);
  // A request whose line, headers and body have not all arrived this long after its first
  // byte is answered 408 and its connection closed; a refused connection is drained this long
  // at most. 0 = no limit.
  uint64_t read_timeout_ms = 0;
  // A connection with no request under way this long (after its accept, after an answer kept
  // alive) is closed. 0 = no limit.
  uint64_t idle_timeout_ms = 0;
  // Connections open at once: one more is accepted and closed at once (each holds a descriptor,
  // buffers and a timer, and a flood of them would exhaust the descriptors).
  uint64_t max_connections = 4096;
};

class HttpServer {
 public:
  using Handler = std::function<void(HttpRequest request, Responder responder)>;

  HttpServer(uv_loop_t* loop, HttpLimits limits, Handler handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens. Returns an error message, empty on success; port() is then the bound
  // port (useful with port 0).
  std::string Listen(const std::string& host, int port);
  int port() const { return port_; }

  // Called, on the loop, with the status of each request refused before the handler could have
  // it (malformed 400, too slow 408, chunked 411, too large 413 or 431): the handler's answers
  // are counted where it gives them, these only here.
  void SetRefusalCounter(std::function<void(int status)> count) {
    count_refusal_ = std::move(count);
  }

  // Graceful stop: closes the listener, closes idle connections, lets each busy one finish its
  // request (answered with Connection: close), then calls `done` once no connection is left.
  void Shutdown(std::function<void()> done);
  // Past the shutdown's deadline: every connection not handling a request is closed, answers
  // still being written (to a client that reads slowly or not at all) and drains cut short.
  void CloseEveryConnectionNotBusy();

  bool shutting_down() const { return shutting_down_; }
  size_t connection_count() const { return connections_.size(); }
  // Connections closed as soon as accepted: limits.max_connections being open, or the heap
  // refusing what serving one needs.
  uint64_t connections_refused() const { return connections_refused_; }

 private:
  friend struct Connection;
  static void OnConnection(uv_stream_t* listener, int status);
  void Accept(uv_stream_t* listener);  // throws std::bad_alloc (nothing taken then)
  // Takes the connection waiting on the listener and closes it (past max-connections, or when
  // the heap refused what serving it needs), counted.
  void RefuseConnection() noexcept;
  void Forget(Connection* connection);
  void MaybeFinishShutdown();

  uv_loop_t* loop_;
  HttpLimits limits_;
  Handler handler_;
  std::function<void(int status)> count_refusal_;
  uv_tcp_t listener_{};
  bool listening_ = false;
  bool shutting_down_ = false;
  int port_ = 0;
  uint64_t connections_refused_ = 0;
  uv_tcp_t spare_socket_{};  // RefuseConnection's when the heap refuses it one
  bool spare_socket_in_use_ = false;
  bool refusal_waiting_ = false;  // a connection to refuse waits for the spare's close
  std::function<void()> shutdown_done_;
  // Owned here while their socket is open; a Responder may keep one alive a little longer.
  std::unordered_set<std::shared_ptr<Connection>> connections_;
};

}  // namespace kvrouterd

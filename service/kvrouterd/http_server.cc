#include "kvrouterd/http_server.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <climits>
#include <cstring>
#include <new>
#include <nlohmann/json.hpp>
#include <string_view>

#include "kvrouterd/log.h"

namespace kvrouterd {

// The answers a connection may have waiting to be written before it takes no more requests: a
// client that pipelines requests and never reads the answers would otherwise have every answer
// queued in memory, without bound. Past it, the connection stops reading and parsing until the
// client has taken enough (an answer may exceed it alone: a snapshot is written whole).
constexpr size_t kMaxUnsentAnswerBytes = 1 << 20;
// The input buffer's capacity a connection keeps once it has parsed all it read: more (what it
// read ahead while busy) is released.
constexpr size_t kKeptInputCapacity = 64 << 10;

// One client connection. Its uv_tcp_t's data points back here; the server's set owns it until
// the socket has closed, and a pending Responder shares that ownership.
struct Connection : std::enable_shared_from_this<Connection> {
  HttpServer* server = nullptr;
  HttpLimits limits;
  uv_tcp_t socket{};
  // limits.read_timeout_ms while a request arrives or a refused client is drained;
  // limits.idle_timeout_ms while no request is under way.
  uv_timer_t read_timer{};
  int open_handles = 0;  // the socket and the timer until both closed
  http_parser parser{};
  std::string input;    // bytes read and not yet parsed
  HttpRequest request;  // the request being parsed
  std::string header_field;
  bool header_value_last = false;  // the parser alternates fields and values
  uint64_t header_bytes = 0;
  int reject_status = 0;            // a limit the request broke: answered with this, then closed
  const char* reject_setting = "";  // with 413: the setting that limits this body
  bool request_complete = false;
  bool in_request = false;  // a request's first byte parsed, its last not yet
  // The connection's last answer is given (Connection: close, or its FIN at shutdown): what the
  // client sends after it is read (closing with it unread would reset the connection and could
  // destroy the answer) and thrown away, never run.
  bool last_answered = false;
  size_t unsent_at_idle_check = 0;  // bytes of answers left to send when the idle timer last ran
  bool busy = false;                // a request is being handled: parsing waits for its answer
  bool parsing = false;  // inside ParseInput (an answer given synchronously returns to it)
  bool reading = false;
  // Stopped reading and parsing until the client takes its answers (kMaxUnsentAnswerBytes).
  bool waiting_for_client_to_read = false;
  bool closing = false;           // uv_close called
  std::atomic<bool> gone{false};  // closing, for other threads (Responder::ClientGoneProbe)
  bool close_after_answer = false;
  bool draining = false;      // refused: our side is shut down, input is discarded until EOF
  uint64_t started_ns = 0;    // when the busy request was complete (access log)
  std::string active_method;  // the busy request's method and path (access log)
  std::string active_path;
  bool head_request = false;  // the busy request is HEAD: its answer has no body

  void StartReading();
  void Read(ssize_t nread, const uv_buf_t* buffer);  // the read callback's work
  void StartTimer(uint64_t ms);
  void ArmReadTimer();
  void ArmIdleTimer();
  void OnTimer();
  void StopReading();
  void ParseInput();
  bool TooManyAnswersUnsent() const;
  void OnAnswerWritten();
  void Dispatch();
  void RefuseMalformed(http_errno error);
  void ShutdownAndDrain();
  bool SendFin(bool close_after);
  void Answer(HttpResponse response, bool keep_alive);
  void Close();
};

const std::string* HttpRequest::Header(const std::string& name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return &value;
  }
  return nullptr;
}

const char* ReasonPhrase(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 201:
      return "Created";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 409:
      return "Conflict";
    case 411:
      return "Length Required";
    case 413:
      return "Content Too Large";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return "Unknown";
  }
}

HttpResponse ErrorResponse(int http_status, std::string_view status_name,
                           std::string_view message) {
  nlohmann::json body;
  body["error"] = {{"status", status_name}, {"message", message}};
  HttpResponse response;
  response.status = http_status;
  response.body = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return response;
}

std::string SerializeResponse(const HttpResponse& response, bool keep_alive, bool with_body) {
  std::string out =
      "HTTP/1.1 " + std::to_string(response.status) + " " + ReasonPhrase(response.status) + "\r\n";
  out += "Content-Type: " + response.content_type + "\r\n";
  out += "Content-Length: " + std::to_string(response.body.size()) + "\r\n";
  for (const auto& [name, value] : response.headers) out += name + ": " + value + "\r\n";
  if (!keep_alive) out += "Connection: close\r\n";
  out += "\r\n";
  if (with_body) out += response.body;
  return out;
}

namespace {

Connection* ConnectionOf(http_parser* parser) { return static_cast<Connection*>(parser->data); }

// A connection closed because the heap refused what serving it needed (refused the log's
// memory too, the close goes unlogged).
void LogClosedForMemory(const char* doing) noexcept {
  LogContained(LogLevel::kWarn, "http connection closed: out of memory", "while", doing);
}

// Runs `work` for connection `c` from a libuv callback: the heap refusing what it needs closes
// that connection (unanswered, or half answered), instead of unwinding into libuv's C frames
// (std::terminate, the daemon gone); the other connections go on.
template <typename Work>
void ContainedFor(Connection* c, const char* doing, Work&& work) noexcept {
  try {
    work();
  } catch (const std::bad_alloc&) {
    LogClosedForMemory(doing);
    c->Close();  // allocates nothing
  }
}

uint64_t NowNs() { return uv_hrtime(); }

// Counts request line and header bytes against the limit; a callback's non-zero return stops
// the parser (HPE_CB_*), and reject_status says why.
int CountHeaderBytes(Connection* c, size_t length) {
  c->header_bytes += length;
  if (c->header_bytes <= c->limits.max_header_bytes) return 0;
  c->reject_status = 431;
  return -1;
}

int OnMessageBegin(http_parser* parser) {
  Connection* c = ConnectionOf(parser);
  c->request = HttpRequest();
  c->header_field.clear();
  c->header_value_last = false;
  c->header_bytes = 0;
  c->in_request = true;
  c->ArmReadTimer();  // the whole request must arrive within the read timeout
  return 0;
}

int OnUrl(http_parser* parser, const char* at, size_t length) {
  Connection* c = ConnectionOf(parser);
  c->request.path.append(at, length);  // the whole URL until headers complete, split then
  return CountHeaderBytes(c, length);
}

// RFC 9110's token characters, which a header name is made of. A name with a space in it
// ("Content Length") is refused: a proxy in front may read it otherwise than the daemon does.
bool IsTokenChar(unsigned char ch) {
  return std::isalnum(ch) || (ch != 0 && std::strchr("!#$%&'*+-.^_`|~", ch) != nullptr);
}

int OnHeaderField(http_parser* parser, const char* at, size_t length) {
  Connection* c = ConnectionOf(parser);
  if (!std::all_of(at, at + length, [](char ch) { return IsTokenChar(ch); })) {
    c->reject_status = 400;
    return -1;
  }
  if (c->header_value_last) {
    c->header_field.clear();
    c->header_value_last = false;
  }
  c->header_field.append(at, length);
  return CountHeaderBytes(c, length);
}

int OnHeaderValue(http_parser* parser, const char* at, size_t length) {
  Connection* c = ConnectionOf(parser);
  if (!c->header_value_last) {
    std::string name = c->header_field;
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    c->request.headers.emplace_back(std::move(name), std::string());
    c->header_value_last = true;
  }
  c->request.headers.back().second.append(at, length);
  return CountHeaderBytes(c, length);
}

void WriteRaw(Connection* c, std::string bytes);

// A request target in absolute form ("http://host:port/v1/route", as a proxy sends it; every
// HTTP/1.1 server must take it) without its scheme and authority: the origin form.
std::string OriginForm(std::string url) {
  constexpr std::string_view kSchemes[] = {"http://", "https://"};
  for (const std::string_view scheme : kSchemes) {
    if (url.size() < scheme.size() ||
        !std::equal(scheme.begin(), scheme.end(), url.begin(), [](char a, char b) {
          return a == std::tolower(static_cast<unsigned char>(b));
        })) {
      continue;
    }
    const size_t path = url.find_first_of("/?", scheme.size());
    if (path == std::string::npos) return "/";
    return (url[path] == '?' ? "/" : "") + url.substr(path);
  }
  return url;
}

int OnHeadersComplete(http_parser* parser) {
  Connection* c = ConnectionOf(parser);
  c->request.method = http_method_str(static_cast<http_method>(parser->method));
  std::string url = OriginForm(std::move(c->request.path));
  const size_t question = url.find('?');
  c->request.path = url.substr(0, question);
  if (question != std::string::npos) c->request.query = url.substr(question + 1);
  // A chunked body is refused: every client of this API knows its body's length.
  if (parser->flags & F_CHUNKED) {
    c->reject_status = 411;
    return -1;
  }
  const BodyLimit limit = c->limits.body_limit
                              ? c->limits.body_limit(c->request)
                              : BodyLimit{c->limits.max_body_bytes, "max-body-bytes"};
  if (parser->content_length != ULLONG_MAX &&
      parser->content_length > std::min(limit.bytes, c->limits.max_body_bytes)) {
    c->reject_status = 413;
    c->reject_setting = limit.setting;
    return -1;
  }
  const std::string* expect = c->request.Header("expect");
  if (expect && (*expect == "100-continue" || *expect == "100-Continue")) {
    WriteRaw(c, "HTTP/1.1 100 Continue\r\n\r\n");
  }
  return 0;
}

int OnBody(http_parser* parser, const char* at, size_t length) {
  ConnectionOf(parser)->request.body.append(at, length);
  return 0;
}

int OnMessageComplete(http_parser* parser) {
  Connection* c = ConnectionOf(parser);
  c->request_complete = true;
  c->in_request = false;
  uv_timer_stop(&c->read_timer);
  http_parser_pause(parser, 1);  // the next pipelined request waits for this one's answer
  return 0;
}

// A parser callback the heap refused memory to stops the parser (HPE_CB_*) and the request is
// refused 503, instead of the exception unwinding through http_parser's C frames into libuv's.
int RefusedForMemory(http_parser* parser) noexcept {
  ConnectionOf(parser)->reject_status = 503;
  return -1;
}
template <int (*Callback)(http_parser*)>
int Contained(http_parser* parser) noexcept {
  try {
    return Callback(parser);
  } catch (const std::bad_alloc&) {
    return RefusedForMemory(parser);
  }
}
template <int (*Callback)(http_parser*, const char*, size_t)>
int Contained(http_parser* parser, const char* at, size_t length) noexcept {
  try {
    return Callback(parser, at, length);
  } catch (const std::bad_alloc&) {
    return RefusedForMemory(parser);
  }
}

const http_parser_settings& ParserSettings() {
  static const http_parser_settings settings = [] {
    http_parser_settings s;
    http_parser_settings_init(&s);
    s.on_message_begin = Contained<OnMessageBegin>;
    s.on_url = Contained<OnUrl>;
    s.on_header_field = Contained<OnHeaderField>;
    s.on_header_value = Contained<OnHeaderValue>;
    s.on_headers_complete = Contained<OnHeadersComplete>;
    s.on_body = Contained<OnBody>;
    s.on_message_complete = Contained<OnMessageComplete>;
    return s;
  }();
  return settings;
}

struct WriteRequest {
  uv_write_t request{};
  std::string bytes;
  std::shared_ptr<Connection> connection;  // alive until the write completes
  bool close_after = false;
};

void WriteBytes(Connection* c, std::string bytes, bool close_after) {
  if (c->closing) return;
  auto* write = new WriteRequest();
  write->bytes = std::move(bytes);
  write->connection = c->shared_from_this();
  write->close_after = close_after;
  uv_buf_t buffer = uv_buf_init(write->bytes.data(), static_cast<unsigned>(write->bytes.size()));
  const int rc = uv_write(&write->request, reinterpret_cast<uv_stream_t*>(&c->socket), &buffer, 1,
                          [](uv_write_t* request, int status) {
                            auto* done = reinterpret_cast<WriteRequest*>(request);
                            if (status < 0 || done->close_after) {
                              done->connection->Close();
                            } else {
                              Connection* c = done->connection.get();
                              ContainedFor(c, "writing", [c] { c->OnAnswerWritten(); });
                            }
                            delete done;
                          });
  if (rc < 0) {
    delete write;
    c->Close();
  }
}

void WriteRaw(Connection* c, std::string bytes) { WriteBytes(c, std::move(bytes), false); }

}  // namespace

// Runs the connection's timer for `ms` (0: stops it; the idle timer, if it ran, ends too).
void Connection::StartTimer(uint64_t ms) {
  if (ms == 0) {
    uv_timer_stop(&read_timer);
    return;
  }
  uv_timer_start(
      &read_timer,
      [](uv_timer_t* timer) {
        auto* c = static_cast<Connection*>(timer->data);
        ContainedFor(c, "timing out", [c] { c->OnTimer(); });
      },
      ms, 0);
}

// A request arriving, or a refused client drained: for the read timeout, or, draining without
// one, the idle timeout (a refused client that never closes would otherwise stay for good).
void Connection::ArmReadTimer() {
  if (closing) return;
  StartTimer(draining && limits.read_timeout_ms == 0 ? limits.idle_timeout_ms
                                                     : limits.read_timeout_ms);
}

// Between requests (after the accept, after an answer kept alive). A client that neither
// sends nor closes would otherwise hold its descriptor and buffers for good.
void Connection::ArmIdleTimer() {
  if (closing || busy || draining || in_request) return;
  StartTimer(limits.idle_timeout_ms);
}

void Connection::OnTimer() {
  std::shared_ptr<Connection> keep = shared_from_this();
  if (closing || busy) return;
  const bool idle = !draining && !in_request;
  // An answer still being written (a large snapshot to a slow reader) is not idleness while
  // the client takes it; one that stopped reading for a whole period is let go.
  const size_t unsent = socket.write_queue_size;
  if (idle && unsent > 0 && unsent != unsent_at_idle_check) {
    unsent_at_idle_check = unsent;
    ArmIdleTimer();
    return;
  }
  if (draining || idle) {  // a refused client that never closed, or an idle one
    Close();
    return;
  }
  reject_status = 408;
  RefuseMalformed(HPE_OK);
}

void Connection::StartReading() {
  if (reading || closing) return;
  reading = true;
  uv_read_start(
      reinterpret_cast<uv_stream_t*>(&socket),
      [](uv_handle_t*, size_t suggested, uv_buf_t* buffer) {
        // Refused, libuv reports UV_ENOBUFS to the read callback, which closes.
        buffer->base = new (std::nothrow) char[suggested];
        buffer->len = buffer->base != nullptr ? suggested : 0;
      },
      [](uv_stream_t* stream, ssize_t nread, const uv_buf_t* buffer) {
        auto* c = static_cast<Connection*>(stream->data);
        std::shared_ptr<Connection> keep = c->shared_from_this();
        ContainedFor(c, "reading", [&] { c->Read(nread, buffer); });
        delete[] buffer->base;
      });
}

void Connection::Read(ssize_t nread, const uv_buf_t* buffer) {
  if (nread > 0 && !draining && !last_answered)
    input.append(buffer->base, static_cast<size_t>(nread));
  if (nread < 0) {
    // The client closed or the socket failed: an answer in progress is dropped.
    if (nread == UV_ENOBUFS) LogClosedForMemory("reading");  // its read buffer was refused
    Close();
    return;
  }
  if (busy && input.size() > limits.max_read_ahead_bytes) StopReading();
  ParseInput();
}

void Connection::StopReading() {
  if (!reading) return;
  reading = false;
  uv_read_stop(reinterpret_cast<uv_stream_t*>(&socket));
}

void Connection::ParseInput() {
  // parsing: an answer given inside Dispatch, the loop goes on
  if (parsing || draining || last_answered) return;
  parsing = true;
  // The bytes parsed go from `input` once the loop ends, not after each request: erasing each
  // one's moved the rest down every time, so many small pipelined requests read ahead cost
  // time growing with the square of their bytes, holding the loop.
  size_t consumed = 0;
  const auto forget_parsed = [&] {
    input.erase(0, consumed);
    // What a busy connection read ahead (up to max_read_ahead_bytes) is not kept as capacity.
    if (input.empty() && input.capacity() > kKeptInputCapacity) std::string().swap(input);
  };
  while (!busy && !closing && !last_answered && consumed < input.size()) {
    // Between requests only: no answer is queued while one request is read, so a request begun
    // under the bound is read to its end.
    if (!in_request && TooManyAnswersUnsent()) {
      waiting_for_client_to_read = true;
      StopReading();
      forget_parsed();
      parsing = false;
      return;  // OnAnswerWritten resumes; the idle timer lets go of a client that never reads
    }
    const size_t parsed = http_parser_execute(&parser, &ParserSettings(), input.data() + consumed,
                                              input.size() - consumed);
    consumed += parsed;
    const http_errno error = HTTP_PARSER_ERRNO(&parser);
    if (request_complete) {
      request_complete = false;
      http_parser_pause(&parser, 0);
      Dispatch();
      continue;
    }
    if (error != HPE_OK) {
      RefuseMalformed(error);  // (which drops the input)
      return;
    }
    if (parsed == 0) break;  // needs more bytes
  }
  forget_parsed();
  parsing = false;
  if (!busy && !closing) StartReading();
}

bool Connection::TooManyAnswersUnsent() const {
  return socket.write_queue_size > kMaxUnsentAnswerBytes;
}

// A write finished: a connection that stopped for its unsent answers goes on once the client
// has taken enough of them.
void Connection::OnAnswerWritten() {
  if (!waiting_for_client_to_read || closing || TooManyAnswersUnsent()) return;
  waiting_for_client_to_read = false;
  ParseInput();  // restarts reading once the input buffered is parsed
}

void Connection::RefuseMalformed(http_errno error) {
  // http_parser's own header limit (80 KiB) counts as ours when max-header-bytes is larger.
  if (error == HPE_HEADER_OVERFLOW) reject_status = 431;
  HttpResponse response;
  switch (reject_status) {
    case 411:
      response = ErrorResponse(411, "INVALID_ARGUMENT",
                               "a chunked request body is not accepted: send Content-Length");
      break;
    case 408:
      response = ErrorResponse(408, "INVALID_ARGUMENT",
                               "the request did not arrive within request-read-timeout-seconds");
      break;
    case 413:
      response = ErrorResponse(
          413, "INVALID_ARGUMENT",
          std::string("the request body is larger than ") + reject_setting + " allows");
      break;
    case 431:
      response = ErrorResponse(431, "INVALID_ARGUMENT",
                               "the request line and headers are larger than max-header-bytes");
      break;
    case 400:
      response = ErrorResponse(400, "INVALID_ARGUMENT",
                               "malformed HTTP: a header name holds a character other than "
                               "letters, digits and !#$%&'*+-.^_`|~");
      break;
    case 503:
      response = ErrorResponse(503, "RESOURCE_EXHAUSTED",
                               "the daemon ran out of memory reading the request");
      break;
    default:
      response = ErrorResponse(400, "INVALID_ARGUMENT",
                               std::string("malformed HTTP: ") + http_errno_description(error));
  }
  if (LogEnabled(LogLevel::kDebug)) {  // (its fields allocate: only when written)
    Log(LogLevel::kDebug, "http request refused",
        {{"status", response.status}, {"parser_error", http_errno_name(error)}});
  }
  if (server->count_refusal_) server->count_refusal_(response.status);
  // What arrived of the refused request (up to a whole body but a byte, for a 408) and after it
  // would be held while the client is drained, up to request-read-timeout-seconds more. Freed,
  // not emptied: a string emptied (or assigned an empty one) keeps its buffer.
  std::string().swap(input);
  { const HttpRequest refused = std::move(request); }
  request = HttpRequest();
  header_field.clear();
  parsing = false;
  WriteBytes(this, SerializeResponse(response, false), false);
  ShutdownAndDrain();
}

// After a refusal the rest of what the client sent is unread: closing now would reset the
// connection (RST) and could destroy the answer before the client reads it. So send FIN after
// the answer, discard input, and close when the client does.
void Connection::ShutdownAndDrain() {
  draining = true;
  ArmReadTimer();  // a client that never closes is closed after the read timeout
  if (SendFin(/*close_after=*/false)) StartReading();
}

namespace {
struct ShutdownRequest {
  uv_shutdown_t request{};
  std::shared_ptr<Connection> connection;  // alive until the shutdown completes
  bool close_after = false;
};
}  // namespace

// FIN once the answers queued are written (libuv's shutdown waits for them), then the close if
// `close_after`; a failure closes at once. False if the connection is closing now.
bool Connection::SendFin(bool close_after) {
  auto* fin = new (std::nothrow)
      ShutdownRequest{.connection = shared_from_this(), .close_after = close_after};
  if (fin == nullptr) {  // the heap refused it: closed at once (what is queued may be lost)
    Close();
    return false;
  }
  if (close_after) {
    last_answered = true;
    // What the client still sends is read and thrown away until the close: left unread (reading
    // stopped while answers waited, or read ahead), it would make the close a reset, which can
    // destroy answers the client has not read yet.
    StartReading();
  }
  const int rc = uv_shutdown(&fin->request, reinterpret_cast<uv_stream_t*>(&socket),
                             [](uv_shutdown_t* request, int status) {
                               auto* done = reinterpret_cast<ShutdownRequest*>(request);
                               if (status < 0 || done->close_after) done->connection->Close();
                               delete done;
                             });
  if (rc < 0) {
    delete fin;
    Close();
    return false;
  }
  return true;
}

void Connection::Dispatch() {
  busy = true;
  started_ns = NowNs();
  active_method = request.method;
  active_path = request.path;
  head_request = request.method == "HEAD";
  close_after_answer = !http_should_keep_alive(&parser) || server->shutting_down_;
  server->handler_(std::move(request), Responder(shared_from_this()));
}

void Connection::Answer(HttpResponse response, bool keep_alive) {
  if (LogEnabled(LogLevel::kDebug)) {
    Log(LogLevel::kDebug, "http request",
        {{"method", active_method},
         {"path", active_path},
         {"status", response.status},
         {"duration_ms", static_cast<double>(NowNs() - started_ns) / 1e6}});
  }
  WriteBytes(this, SerializeResponse(response, keep_alive, !head_request), !keep_alive);
  busy = false;
  last_answered = !keep_alive;
  unsent_at_idle_check = 0;
  // Closed once written; until then the idle timer lets go of a client that stops reading.
  if (keep_alive) ParseInput();
  ArmIdleTimer();  // unless the next request has begun
}

void Connection::Close() {
  if (closing) return;
  closing = true;
  gone = true;
  reading = false;
  const auto closed = [](uv_handle_t* handle) {
    auto* c = static_cast<Connection*>(handle->data);
    if (--c->open_handles == 0) c->server->Forget(c);
  };
  uv_close(reinterpret_cast<uv_handle_t*>(&read_timer), closed);
  uv_close(reinterpret_cast<uv_handle_t*>(&socket), closed);
}

std::function<bool()> Responder::ClientGoneProbe() const {
  return [connection = connection_] { return !connection || connection->gone.load(); };
}

void Responder::Respond(HttpResponse response) {
  Connection* c = connection_.get();
  if (!c || c->closing) return;  // the client went away meanwhile
  const bool keep_alive = !c->close_after_answer && !c->server->shutting_down();
  // (Called from libuv's callbacks: contained here.)
  ContainedFor(c, "answering", [&] { c->Answer(std::move(response), keep_alive); });
  connection_.reset();
}

HttpServer::HttpServer(uv_loop_t* loop, HttpLimits limits, Handler handler)
    : loop_(loop), limits_(limits), handler_(std::move(handler)) {}

HttpServer::~HttpServer() = default;

std::string HttpServer::Listen(const std::string& host, int port) {
  sockaddr_storage address{};
  if (uv_ip4_addr(host.c_str(), port, reinterpret_cast<sockaddr_in*>(&address)) != 0 &&
      uv_ip6_addr(host.c_str(), port, reinterpret_cast<sockaddr_in6*>(&address)) != 0) {
    return "listen: '" + host + "' is not an IP address";
  }
  uv_tcp_init(loop_, &listener_);
  listener_.data = this;
  listening_ = true;
  int rc = uv_tcp_bind(&listener_, reinterpret_cast<const sockaddr*>(&address), 0);
  if (rc == 0) rc = uv_listen(reinterpret_cast<uv_stream_t*>(&listener_), 511, OnConnection);
  if (rc != 0) {
    return "listen: cannot listen on " + host + ":" + std::to_string(port) + ": " + uv_strerror(rc);
  }
  sockaddr_storage bound{};
  int length = sizeof bound;
  uv_tcp_getsockname(&listener_, reinterpret_cast<sockaddr*>(&bound), &length);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return {};
}

void HttpServer::OnConnection(uv_stream_t* listener, int status) {
  auto* server = static_cast<HttpServer*>(listener->data);
  if (status < 0 || server->shutting_down_) return;
  if (server->connections_.size() >= server->limits_.max_connections) {
    server->RefuseConnection();
    return;
  }
  try {
    server->Accept(listener);
  } catch (const std::bad_alloc&) {  // taken and closed, as past max-connections
    server->RefuseConnection();
  }
}

void HttpServer::Accept(uv_stream_t* listener) {
  auto connection = std::make_shared<Connection>();
  connection->server = this;
  connection->limits = limits_;
  http_parser_init(&connection->parser, HTTP_REQUEST);
  connection->parser.data = connection.get();
  // Held before its handles join the loop: what may throw comes first.
  connections_.insert(connection);
  uv_tcp_init(loop_, &connection->socket);
  connection->socket.data = connection.get();
  uv_timer_init(loop_, &connection->read_timer);
  connection->read_timer.data = connection.get();
  connection->open_handles = 2;
  if (uv_accept(listener, reinterpret_cast<uv_stream_t*>(&connection->socket)) != 0) {
    connection->Close();
    return;
  }
  uv_tcp_nodelay(&connection->socket, 1);
  connection->StartReading();
  connection->ArmIdleTimer();
}

// Taken, then closed: libuv has accepted the socket before calling OnConnection, and one left
// untaken would stay open, with libuv watching the listener no more until it is taken.
void HttpServer::RefuseConnection() noexcept {
  ++connections_refused_;
  auto* socket = new (std::nothrow) uv_tcp_t();
  uv_close_cb closed = [](uv_handle_t* handle) { delete reinterpret_cast<uv_tcp_t*>(handle); };
  if (socket == nullptr) {
    // Out of memory even for this: the server's spare handle takes it. (Left untaken, libuv
    // would watch the listener no more: the server would accept nothing, even once memory is
    // back.) In use, the connection is taken once it is closed.
    if (spare_socket_in_use_) {
      refusal_waiting_ = true;
      return;
    }
    spare_socket_in_use_ = true;
    socket = &spare_socket_;
    socket->data = this;
    closed = [](uv_handle_t* handle) {
      auto* server = static_cast<HttpServer*>(handle->data);
      server->spare_socket_in_use_ = false;
      if (std::exchange(server->refusal_waiting_, false)) {
        --server->connections_refused_;  // counted when it came
        server->RefuseConnection();
      }
    };
  }
  uv_tcp_init(loop_, socket);
  uv_accept(reinterpret_cast<uv_stream_t*>(&listener_), reinterpret_cast<uv_stream_t*>(socket));
  uv_close(reinterpret_cast<uv_handle_t*>(socket), closed);
  try {
    Log(LogLevel::kDebug, "http connection refused (max-connections open, or out of memory)",
        {{"max_connections", limits_.max_connections}});
  } catch (...) {  // the log's own memory refused: the count says it
  }
}

void HttpServer::Forget(Connection* connection) {
  for (auto it = connections_.begin(); it != connections_.end(); ++it) {
    if (it->get() == connection) {
      connections_.erase(it);
      break;
    }
  }
  MaybeFinishShutdown();
}

void HttpServer::Shutdown(std::function<void()> done) {
  shutting_down_ = true;
  shutdown_done_ = std::move(done);
  if (listening_) {
    listening_ = false;
    uv_close(reinterpret_cast<uv_handle_t*>(&listener_), [](uv_handle_t* handle) {
      static_cast<HttpServer*>(handle->data)->MaybeFinishShutdown();
    });
  }
  // Idle connections close now; busy ones after their answer (which says Connection: close);
  // those still writing an answer once it is written (the idle timer lets go of a client that
  // stopped reading).
  // A refused client being drained has its FIN already, and its timer. (Iterated in place:
  // closing removes a connection only in its close callback, and nothing here allocates, so
  // a signal's callback running this cannot throw into libuv.)
  for (const auto& connection : connections_) {
    if (connection->busy || connection->draining) continue;
    if (connection->socket.write_queue_size > 0) {
      connection->SendFin(/*close_after=*/true);
    } else {
      connection->Close();
    }
  }
  MaybeFinishShutdown();
}

void HttpServer::CloseEveryConnectionNotBusy() {
  for (const auto& connection : connections_) {  // in place, as in Shutdown
    if (!connection->busy) connection->Close();
  }
}

void HttpServer::MaybeFinishShutdown() {
  if (!shutting_down_ || !connections_.empty() || !shutdown_done_) return;
  auto done = std::move(shutdown_done_);
  shutdown_done_ = nullptr;
  done();
}

}  // namespace kvrouterd

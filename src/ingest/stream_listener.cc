#include "ingest/stream_listener.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "wire/endpoint.h"
#include "wire/flatbuffers_codec.h"
#include "wire/framing.h"

namespace kvrouter {

namespace {

// A Unix socket's file outlives a listener that never closed it (a process killed by SIGKILL,
// a crash: libuv removes it on a close), and binding the path again then fails with EADDRINUSE
// though nobody listens. Such a file is removed: a socket to which a connection is refused.
// Anything else at the path (a socket someone listens on, a regular file) is left alone, and
// the bind fails as before.
void RemoveStaleUnixSocket(const std::string& path) {
  struct stat st {};
  sockaddr_un addr{};
  if (lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode) ||
      path.size() >= sizeof(addr.sun_path)) {
    return;
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  // Non-blocking: a listener whose backlog is full answers EAGAIN, and is left alone.
  const bool nobody_listens =
      connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 &&
      errno == ECONNREFUSED;
  close(fd);
  if (nobody_listens) unlink(path.c_str());
}

}  // namespace

// A libuv stream handle of either kind, TCP or Unix socket.
union StreamHandle {
  uv_handle_t handle;
  uv_stream_t stream;
  uv_tcp_t tcp;
  uv_pipe_t pipe;

  // Initialized on `loop` (allocates nothing), owned by `owner`.
  void Init(uv_loop_t* loop, bool unix_socket, void* owner) {
    if (unix_socket) {
      uv_pipe_init(loop, &pipe, 0);
    } else {
      uv_tcp_init(loop, &tcp);
    }
    handle.data = owner;
  }
};

struct StreamListeners::Listener {
  StreamListeners* owner = nullptr;
  uint64_t source_id = 0;
  std::shared_ptr<SourceCounters> counters;
  bool unix_socket = false;
  StreamHandle io;
  // A connection the heap had no memory for is accepted into this and closed at once: libuv
  // listens again only once a connection is accepted, so leaving it unaccepted would stall the
  // listener for good. Allocated with the listener, so turning away allocates nothing.
  StreamHandle turn_away{};
  bool turning_away = false;        // turn_away is closing
  bool connection_waiting = false;  // one arrived meanwhile (libuv holds it until accepted)
  bool closing = false;
  int open_handles = 1;  // deleted when the last of its handles has closed
};

struct StreamListeners::Connection {
  StreamListeners* owner;
  std::shared_ptr<SourceCounters> counters;
  FrameReader reader;
  std::vector<char> read_buffer = std::vector<char>(64 * 1024);
  StreamHandle io;
  Connection(StreamListeners* o, std::shared_ptr<SourceCounters> c, uint32_t max_frame)
      : owner(o), counters(std::move(c)), reader(max_frame) {}
};

absl::StatusOr<uint64_t> StreamListeners::Listen(const std::string& endpoint, std::string* bound) {
  auto where = ParseStreamEndpoint(endpoint);
  if (!where.ok()) return where.status();
  uint64_t id = 0;
  std::string bound_endpoint;
  absl::Status status = loop_.Run([&] { return ListenOnLoop(*where, &bound_endpoint, id); });
  if (!status.ok()) return status;
  if (bound != nullptr) *bound = bound_endpoint;
  return id;
}

absl::Status StreamListeners::ListenOnLoop(const StreamEndpoint& where, std::string* bound,
                                           uint64_t& id) {
  auto* listener = new Listener;
  listener->owner = this;
  listener->unix_socket = where.unix_socket;
  int rc = 0;
  listener->io.Init(&loop_.loop, where.unix_socket, listener);
  if (where.unix_socket) {
    RemoveStaleUnixSocket(where.host_or_path);
    rc = uv_pipe_bind(&listener->io.pipe, where.host_or_path.c_str());
  } else {
    sockaddr_storage addr{};
    rc = uv_ip4_addr(where.host_or_path.c_str(), where.port, reinterpret_cast<sockaddr_in*>(&addr));
    if (rc != 0) {
      rc = uv_ip6_addr(where.host_or_path.c_str(), where.port,
                       reinterpret_cast<sockaddr_in6*>(&addr));
    }
    if (rc == 0) rc = uv_tcp_bind(&listener->io.tcp, reinterpret_cast<sockaddr*>(&addr), 0);
  }
  if (rc == 0) rc = uv_listen(&listener->io.stream, 128, &StreamListeners::OnConnection);
  if (rc != 0) {
    CloseListener(listener);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", where.host_or_path, ": ", uv_strerror(rc)));
  }
  // Refused memory from here on, the listener closes again before the loop can hear a
  // connection on it: a refused command leaves nothing behind (a source may stay registered).
  try {
    Register(*listener, where, *bound, id);
  } catch (...) {
    CloseListener(listener);
    throw;
  }
  return absl::OkStatus();
}

void StreamListeners::Register(Listener& listener, const StreamEndpoint& where, std::string& bound,
                               uint64_t& id) {
  if (where.unix_socket) {
    bound = "unix://" + where.host_or_path;
  } else {
    sockaddr_storage name{};
    int len = sizeof(name);
    uv_tcp_getsockname(&listener.io.tcp, reinterpret_cast<sockaddr*>(&name), &len);
    char host[64] = {};
    int port = 0;
    bool ipv6 = name.ss_family == AF_INET6;
    if (ipv6) {
      auto* a6 = reinterpret_cast<sockaddr_in6*>(&name);
      uv_ip6_name(a6, host, sizeof(host));
      port = ntohs(a6->sin6_port);
    } else {
      auto* a4 = reinterpret_cast<sockaddr_in*>(&name);
      uv_ip4_name(a4, host, sizeof(host));
      port = ntohs(a4->sin_port);
    }
    // An IPv6 address is bracketed, so that its colons are not taken for the port's.
    bound =
        ipv6 ? absl::StrCat("tcp://[", host, "]:", port) : absl::StrCat("tcp://", host, ":", port);
  }
  listener.counters = loop_.NewSource(id, IngestSourceKind::kListener, bound);
  listener.source_id = id;
  listeners_.push_back(&listener);
}

void StreamListeners::OnConnection(uv_stream_t* server, int status) {
  auto* listener = static_cast<Listener*>(server->data);
  if (status < 0) return;
  listener->owner->Arrive(*listener);
}

void StreamListeners::Arrive(Listener& listener) {
  if (listener.turning_away) {  // accepted once the one before it has closed (OnTurnedAway)
    listener.connection_waiting = true;
    return;
  }
  // Refused memory for the connection, its events are lost (counted as a gap) and it is turned
  // away, so that the next one is heard.
  if (!ContainRefusal([&] { Accept(listener); }, [&] { listener.counters->Gap(1); })) {
    TurnAway(listener);
  }
}

void StreamListeners::TurnAway(Listener& listener) {
  listener.turn_away.Init(&loop_.loop, listener.unix_socket, &listener);
  uv_accept(&listener.io.stream, &listener.turn_away.stream);  // closed whether or not it took
  listener.turning_away = true;
  ++listener.open_handles;
  uv_close(&listener.turn_away.handle, &StreamListeners::OnTurnedAway);
}

void StreamListeners::OnTurnedAway(uv_handle_t* handle) {
  auto* listener = static_cast<Listener*>(handle->data);
  listener->turning_away = false;
  if (ListenerHandleClosed(listener)) return;  // it was closed meanwhile: deleted
  if (listener->closing || !listener->connection_waiting) return;
  listener->connection_waiting = false;
  listener->owner->Arrive(*listener);
}

void StreamListeners::CloseListener(Listener* listener) {
  if (listener->closing) return;
  listener->closing = true;
  uv_close(&listener->io.handle,
           [](uv_handle_t* handle) { ListenerHandleClosed(static_cast<Listener*>(handle->data)); });
}

bool StreamListeners::ListenerHandleClosed(Listener* listener) {
  if (--listener->open_handles > 0) return false;
  delete listener;
  return true;
}

void StreamListeners::Accept(Listener& listener) {
  auto* conn = new Connection(this, listener.counters, loop_.options.max_frame_bytes);
  try {  // tracked before it is accepted: nothing below allocates
    connections_.push_back(conn);
  } catch (...) {
    delete conn;
    throw;
  }
  conn->io.Init(&loop_.loop, listener.unix_socket, conn);
  if (uv_accept(&listener.io.stream, &conn->io.stream) != 0) {
    CloseConnection(conn);
    return;
  }
  Bump(conn->counters->connections);
  uv_read_start(
      &conn->io.stream,
      [](uv_handle_t* h, size_t, uv_buf_t* buf) {
        auto* c = static_cast<Connection*>(h->data);
        *buf = uv_buf_init(c->read_buffer.data(), c->read_buffer.size());
      },
      &StreamListeners::OnRead);
}

void StreamListeners::CloseConnection(Connection* conn) {
  connections_.remove(conn);
  CloseAndDelete(&conn->io.handle, conn);
}

void StreamListeners::OnRead(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf) {
  auto* conn = static_cast<Connection*>(stream->data);
  // A frame the heap refused memory to is lost, and with it maybe the frame boundaries (a chunk
  // not appended): counted as a gap, and the connection closed as after a bad header.
  ContainRefusal([&] { conn->owner->Read(conn, nread, buf); },
                 [&] {
                   conn->counters->Gap(1);
                   conn->owner->CloseConnection(conn);
                 });
}

void StreamListeners::Read(Connection* conn, ssize_t nread, const uv_buf_t* buf) {
  if (nread < 0) {  // EOF or error
    // A frame cut by the close (the publisher died or gave up mid-frame) is lost: counted.
    if (const size_t cut = conn->reader.buffered_bytes(); cut > 0 && conn->reader.status().ok()) {
      conn->counters->Reject(
          IngestReject::kBadFlatBuffers,
          absl::StrCat("the connection closed inside a frame (", cut, " bytes of it received)"));
    }
    conn->owner->CloseConnection(conn);
    return;
  }
  if (nread == 0) return;
  const absl::Status status = conn->reader.Append(
      std::span(reinterpret_cast<const uint8_t*>(buf->base), static_cast<size_t>(nread)));
  while (auto frame = conn->reader.Next()) conn->owner->HandleFrame(*frame, *conn->counters);
  if (!status.ok()) {
    // The frame boundaries are lost: nothing after this header can be trusted.
    conn->counters->Reject(IngestReject::kFrameTooLarge, std::string(status.message()));
    conn->owner->CloseConnection(conn);
  }
}

void StreamListeners::HandleFrame(const std::vector<uint8_t>& frame, SourceCounters& source) {
  uint64_t publish_time_ns = 0;
  auto events = DecodeEventBatch(frame, &publish_time_ns);
  if (!events.ok()) {
    source.Reject(IngestReject::kBadFlatBuffers, std::string(events.status().message()));
  } else {
    loop_.Apply(*events, source);
    source.RecordLag(publish_time_ns);
  }
  Bump(source.messages);
}

void StreamListeners::CloseAll() {
  for (Listener* l : listeners_) CloseListener(l);
  listeners_.clear();
  for (Connection* c : connections_) CloseAndDelete(&c->io.handle, c);
  connections_.clear();
}

}  // namespace kvrouter

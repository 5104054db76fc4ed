// The publisher side of kvrouter's native event stream: a blocking socket that sends
// length-prefixed EventBatch frames to an ingest listener (tcp:// or unix://).
#include <netdb.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>

#include "capi_internal.h"
#include "wire/endpoint.h"
#include "wire/framing.h"

using namespace kvrouter::capi;

struct kvr_publisher {
  int fd = -1;
  ~kvr_publisher() {
    if (fd >= 0) ::close(fd);
  }
};

namespace {

std::string ErrnoText() { return std::strerror(errno); }

// A connected socket, or -1 with `why` set.
int ConnectUnix(const std::string& path, std::string& why) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    why = "socket path too long";
    return -1;
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    why = ErrnoText();
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

int ConnectTcp(const std::string& host, const std::string& port, std::string& why) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* results = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &results); rc != 0) {
    why = gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = results; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd >= 0 && ::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      why = ErrnoText();
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(results);
  return fd;
}

// Writes every byte; MSG_NOSIGNAL so a closed peer is an error, not a SIGPIPE.
bool SendAll(int fd, const uint8_t* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

extern "C" {

KVR_API kvr_status kvr_publisher_connect(const char* endpoint, kvr_publisher** out,
                                         kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, endpoint, "endpoint")) return s;
    if (kvr_status s = RequireNonNull(err, out, "out")) return s;
    const std::string where = endpoint;
    auto parsed = kvrouter::ParseStreamEndpoint(where);
    if (!parsed.ok()) return FromStatus(err, parsed.status());
    std::string why;
    const int fd = parsed->unix_socket
                       ? ConnectUnix(parsed->host_or_path, why)
                       : ConnectTcp(parsed->host_or_path, std::to_string(parsed->port), why);
    if (fd < 0) return Fail(err, KVR_UNAVAILABLE, "cannot connect to " + where + ": " + why);
    auto publisher = std::make_unique<kvr_publisher>();
    publisher->fd = fd;
    *out = publisher.release();
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_publisher_send_encoded(kvr_publisher* publisher, const void* data,
                                              size_t size, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, publisher, "publisher")) return s;
    if (kvr_status s = RequireNonNull(err, data, "data")) return s;
    auto frame = kvrouter::FrameBatch(std::span(static_cast<const uint8_t*>(data), size));
    if (!frame.ok()) return FromStatus(err, frame.status());
    if (publisher->fd < 0 || !SendAll(publisher->fd, frame->data(), frame->size())) {
      return Fail(err, KVR_UNAVAILABLE, "send failed: " + ErrnoText());
    }
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_publisher_send(kvr_publisher* publisher, const kvr_event_batch* batch,
                                      kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, publisher, "publisher")) return s;
    kvr_buffer* encoded = nullptr;
    if (kvr_status s = kvr_event_batch_encode(batch, &encoded, err)) return s;
    std::unique_ptr<kvr_buffer, decltype(&kvr_buffer_free)> owned(encoded, &kvr_buffer_free);
    return kvr_publisher_send_encoded(publisher, encoded->bytes.data(), encoded->bytes.size(), err);
  });
}

KVR_API void kvr_publisher_free(kvr_publisher* publisher) { delete publisher; }

}  // extern "C"

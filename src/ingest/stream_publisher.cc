#include "ingest/stream_publisher.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "wire/endpoint.h"
#include "wire/framing.h"

namespace kvrouter {
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

absl::StatusOr<std::unique_ptr<StreamPublisher>> StreamPublisher::Connect(
    const std::string& endpoint) {
  auto parsed = ParseStreamEndpoint(endpoint);
  if (!parsed.ok()) return parsed.status();
  std::string why;
  const int fd = parsed->unix_socket
                     ? ConnectUnix(parsed->host_or_path, why)
                     : ConnectTcp(parsed->host_or_path, std::to_string(parsed->port), why);
  if (fd < 0)
    return absl::UnavailableError(absl::StrCat("cannot connect to ", endpoint, ": ", why));
  return std::unique_ptr<StreamPublisher>(new StreamPublisher(fd));
}

StreamPublisher::~StreamPublisher() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status StreamPublisher::Send(std::span<const uint8_t> payload) {
  auto frame = FrameBatch(payload);
  if (!frame.ok()) return frame.status();
  if (fd_ < 0 || !SendAll(fd_, frame->data(), frame->size())) {
    return absl::UnavailableError("send failed: " + ErrnoText());
  }
  return absl::OkStatus();
}

}  // namespace kvrouter

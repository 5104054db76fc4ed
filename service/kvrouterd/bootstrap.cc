#include "kvrouterd/bootstrap.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cctype>
#include <charconv>
#include <cstring>

#include "kvrouterd/options.h"

namespace kvrouterd {
namespace {

std::string_view TrimSpaces(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) {
    text.remove_prefix(1);
  }
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) {
    text.remove_suffix(1);
  }
  return text;
}

// A socket connected to host:port with `timeout` on connect, send and receive; -1 and `*error`
// if no address of the host answers.
int ConnectTo(const std::string& host, int port, std::chrono::milliseconds timeout,
              std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &addresses); rc != 0) {
    *error = "cannot resolve " + host + ": " + gai_strerror(rc);
    return -1;
  }
  timeval tv{};
  tv.tv_sec = timeout.count() / 1000;
  tv.tv_usec = (timeout.count() % 1000) * 1000;
  int fd = -1;
  for (addrinfo* a = addresses; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    // On Linux SO_SNDTIMEO bounds connect(2) too.
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      *error = "cannot connect to " + host + ":" + service + ": " + std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(addresses);
  return fd;
}

bool SendAll(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// Everything until the peer closes (the request said Connection: close); false on a timeout
// or error.
bool ReceiveAll(int fd, std::string* out) {
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n == 0) return true;
    if (n < 0) return false;
    out->append(buffer, static_cast<size_t>(n));
  }
}

// The value of header `name` (case-insensitive) in `head`, if present.
std::optional<std::string_view> HeaderValue(std::string_view head, std::string_view name) {
  size_t pos = head.find("\r\n");
  while (pos != std::string_view::npos && pos + 2 < head.size()) {
    const size_t start = pos + 2;
    const size_t end = std::min(head.find("\r\n", start), head.size());
    const std::string_view line = head.substr(start, end - start);
    const size_t colon = line.find(':');
    if (colon == name.size() &&
        std::equal(name.begin(), name.end(), line.begin(), [](char a, char b) {
          return std::tolower(static_cast<unsigned char>(a)) ==
                 std::tolower(static_cast<unsigned char>(b));
        })) {
      return TrimSpaces(line.substr(colon + 1));
    }
    pos = end;
  }
  return std::nullopt;
}

}  // namespace

// Splits a whole HTTP/1.1 answer into the snapshot: "" on success, else why not.
std::string ParseSnapshotAnswer(const std::string& answer, PeerSnapshot* out) {
  const size_t head_end = answer.find("\r\n\r\n");
  if (head_end == std::string::npos || answer.rfind("HTTP/1.", 0) != 0) {
    return "not an HTTP answer";
  }
  const std::string_view head(answer.data(), head_end);
  // "HTTP/1.x NNN": the status line must hold a status before we read it.
  if (head.size() < 12 || head[8] != ' ') return "not an HTTP answer";
  if (head.substr(9, 3) != "200") return "answered " + std::string(head.substr(9, 3));
  size_t body_size = answer.size() - head_end - 4;
  if (const auto length = HeaderValue(head, "Content-Length")) {
    size_t declared = 0;
    const auto [end, ec] =
        std::from_chars(length->data(), length->data() + length->size(), declared);
    if (ec != std::errc() || end != length->data() + length->size() || declared > body_size) {
      return "the snapshot was cut short";
    }
    body_size = declared;
  }
  if (const auto sequences = HeaderValue(head, kStreamSequencesHeader)) {
    auto parsed = ParseStreamSequences(*sequences);
    if (!parsed) return "bad " + std::string(kStreamSequencesHeader) + " header";
    out->sequences = std::move(*parsed);
  }
  out->bytes = answer.substr(head_end + 4, body_size);
  return {};
}

std::string FormatStreamSequences(const StreamSequences& sequences) {
  std::string text;
  for (const auto& [stream, sequence] : sequences) {
    if (!text.empty()) text += ", ";
    text += stream + "=" + std::to_string(sequence);
  }
  return text;
}

std::optional<StreamSequences> ParseStreamSequences(std::string_view text) {
  StreamSequences out;
  while (!TrimSpaces(text).empty()) {
    const size_t comma = std::min(text.find(','), text.size());
    const std::string_view item = TrimSpaces(text.substr(0, comma));
    text = comma < text.size() ? text.substr(comma + 1) : std::string_view();
    const size_t eq = item.find('=');
    if (eq == 0 || eq == std::string_view::npos) return std::nullopt;
    const std::string_view digits = item.substr(eq + 1);
    uint64_t sequence = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), sequence);
    if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty()) {
      return std::nullopt;
    }
    out[std::string(item.substr(0, eq))] = sequence;
  }
  return out;
}

std::string ParsePeerUrl(std::string_view url, std::string* host, int* port) {
  constexpr std::string_view kScheme = "http://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    return "expected http://HOST:PORT, got '" + std::string(url) + "'";
  }
  std::string_view authority = url.substr(kScheme.size());
  if (!authority.empty() && authority.back() == '/') authority.remove_suffix(1);
  if (authority.find('/') != std::string_view::npos) {
    return "expected http://HOST:PORT without a path, got '" + std::string(url) + "'";
  }
  std::string error = ParseHostPort(authority, host, port);
  if (error.empty() && (host->empty() || *port == 0))
    error = "no host or port in '" + std::string(url) + "'";
  return error;
}

std::optional<PeerSnapshot> FetchPeerSnapshot(const std::string& peer_url,
                                              std::chrono::milliseconds timeout,
                                              std::string* error) {
  std::string host;
  int port = 0;
  if (*error = ParsePeerUrl(peer_url, &host, &port); !error->empty()) return std::nullopt;
  const int fd = ConnectTo(host, port, timeout, error);
  if (fd < 0) return std::nullopt;
  const std::string request = "GET /v1/snapshot HTTP/1.1\r\nHost: " + host +
                              "\r\nConnection: close\r\nAccept: application/octet-stream\r\n\r\n";
  std::string answer;
  const bool received = SendAll(fd, request) && ReceiveAll(fd, &answer);
  close(fd);
  if (!received) {
    *error = peer_url + ": no complete answer within " + std::to_string(timeout.count()) + " ms";
    return std::nullopt;
  }
  PeerSnapshot snapshot;
  if (std::string why = ParseSnapshotAnswer(answer, &snapshot); !why.empty()) {
    *error = peer_url + "/v1/snapshot: " + why;
    return std::nullopt;
  }
  return snapshot;
}

}  // namespace kvrouterd

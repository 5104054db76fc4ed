#include "wire/endpoint.h"

#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvrouter {
namespace {

const std::string kTcp = "tcp://";
const std::string kUnix = "unix://";

// The port after the last colon of a tcp endpoint, and where that colon is.
struct TcpPort {
  size_t colon = 0;
  int port = 0;
};

std::optional<TcpPort> FindTcpPort(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon < kTcp.size() ||
      !absl::SimpleAtoi(endpoint.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return std::nullopt;
  }
  return TcpPort{colon, port};
}

}  // namespace

absl::StatusOr<StreamEndpoint> ParseStreamEndpoint(const std::string& endpoint) {
  StreamEndpoint out;
  if (absl::StartsWith(endpoint, kUnix)) {
    out.unix_socket = true;
    out.host_or_path = endpoint.substr(kUnix.size());
    if (out.host_or_path.empty()) return absl::InvalidArgumentError("unix:// needs a path");
    return out;
  }
  if (!absl::StartsWith(endpoint, kTcp)) {
    return absl::InvalidArgumentError(
        absl::StrCat("endpoint '", endpoint, "' is neither tcp://HOST:PORT nor unix://PATH"));
  }
  const std::optional<TcpPort> port = FindTcpPort(endpoint);
  if (!port) {
    return absl::InvalidArgumentError(absl::StrCat("endpoint '", endpoint, "' has no valid port"));
  }
  out.port = port->port;
  std::string host = endpoint.substr(kTcp.size(), port->colon - kTcp.size());
  // tcp://[::1]:PORT: the brackets only delimit an IPv6 address.
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  out.host_or_path = std::move(host);
  return out;
}

std::string RankEndpoint(const std::string& endpoint, uint32_t offset) {
  if (offset == 0) return endpoint;
  if (absl::StartsWith(endpoint, kTcp)) {
    if (const std::optional<TcpPort> port = FindTcpPort(endpoint)) {
      return absl::StrCat(endpoint.substr(0, port->colon + 1),
                          port->port + static_cast<int>(offset));
    }
  }
  return absl::StrCat(endpoint, "_dp", offset);
}

absl::Status CheckEngineEndpoint(const std::string& endpoint, uint32_t dp_size,
                                 const std::string& what) {
  if (absl::StartsWith(endpoint, "ipc://") && endpoint.size() > 6) return absl::OkStatus();
  if (!absl::StartsWith(endpoint, kTcp)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", endpoint, "' is neither tcp://HOST:PORT nor ipc://PATH"));
  }
  const std::optional<TcpPort> port = FindTcpPort(endpoint);
  if (!port || port->port == 0 || port->colon == kTcp.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " '", endpoint, "' needs a host and a port in 1..65535 (tcp://HOST:PORT)"));
  }
  if (dp_size > 0 && static_cast<uint64_t>(port->port) + (dp_size - 1) > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", endpoint, "': rank r is on port ",
                                                   port->port, " + r, and ", dp_size,
                                                   " ranks would need ports past 65535"));
  }
  return absl::OkStatus();
}

std::string WithoutUserInfo(const std::string& url) {
  const size_t scheme_end = url.find("://");
  if (scheme_end == std::string::npos) return url;
  const size_t host_start = scheme_end + 3;
  const size_t at = url.find('@', host_start);
  if (at == std::string::npos || at > url.find('/', host_start)) return url;
  return url.substr(0, host_start) + url.substr(at + 1);
}

}  // namespace kvrouter

// Endpoint strings, parsed in one place: where kvrouter's native stream listens or connects
// (tcp://HOST:PORT, unix://PATH), the per-rank endpoints of a data-parallel engine, and NATS
// URLs as they are reported. Strings only: no sockets.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace kvrouter {

// A native stream endpoint: "tcp://HOST:PORT" (PORT 0-65535; an IPv6 HOST in brackets,
// tcp://[::1]:PORT) or "unix://PATH".
struct StreamEndpoint {
  bool unix_socket = false;
  std::string host_or_path;  // the host without its brackets, or the socket's path
  int port = 0;
};

// InvalidArgument, naming the endpoint, for anything else (another scheme, no or a bad port,
// an empty path).
absl::StatusOr<StreamEndpoint> ParseStreamEndpoint(const std::string& endpoint);

// The endpoint of rank `offset` of an engine publishing on `endpoint`: vLLM binds rank r of a
// tcp endpoint on port + r and appends "_dp<r>" to any other.
std::string RankEndpoint(const std::string& endpoint, uint32_t offset);

// Whether an engine's ZMQ endpoint (its publisher's or its replay socket's) can be connected to
// for ranks 0 .. dp_size - 1: "tcp://HOST:PORT" with PORT 1-65535 and PORT + dp_size - 1 no
// more than 65535 (rank r is on port + r), or "ipc://PATH" (rank r at PATH_dp<r>).
// InvalidArgument naming `what` and the endpoint otherwise.
absl::Status CheckEngineEndpoint(const std::string& endpoint, uint32_t dp_size,
                                 const std::string& what);

// `url` without its user:password@ part, for reporting where a source is.
std::string WithoutUserInfo(const std::string& url);

}  // namespace kvrouter

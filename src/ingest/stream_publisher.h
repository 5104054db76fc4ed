// The publisher side of kvrouter's native event stream: a blocking socket that sends
// length-prefixed EventBatch frames (wire/framing.h) to an ingest listener (tcp:// or unix://).
// Plain POSIX sockets: no loop, no thread; one publisher is used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvrouter {

class StreamPublisher {
 public:
  // InvalidArgument for an endpoint ParseStreamEndpoint refuses; Unavailable, saying why, when
  // nothing accepts the connection.
  static absl::StatusOr<std::unique_ptr<StreamPublisher>> Connect(const std::string& endpoint);
  ~StreamPublisher();
  StreamPublisher(const StreamPublisher&) = delete;
  StreamPublisher& operator=(const StreamPublisher&) = delete;

  // Sends `payload` (an encoded EventBatch, not verified here) as one frame, whole.
  // InvalidArgument for a payload over the frame limit; Unavailable when the peer is gone.
  absl::Status Send(std::span<const uint8_t> payload);

 private:
  explicit StreamPublisher(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace kvrouter

// Which transports this build has (CMake options KVR_WITH_ZMQ and KVR_WITH_NATS, passed as
// compile definitions of kvrouter_ingest).
#include "ingest/ingest_service.h"

namespace kvrouter {

absl::Status TransportAvailable(IngestTransport transport) {
  switch (transport) {
    case IngestTransport::kLoop:
      if (KVR_WITH_ZMQ || KVR_WITH_NATS) return absl::OkStatus();
      return absl::UnimplementedError(
          "live KV event ingestion is not in this build of libkvrouter: it was configured with "
          "-DKVR_WITH_ZMQ=OFF and -DKVR_WITH_NATS=OFF (the ingest loop comes with either ON)");
    case IngestTransport::kZmq:
      if (KVR_WITH_ZMQ) return absl::OkStatus();
      return absl::UnimplementedError(
          "vLLM/SGLang engine subscriptions (ZMQ) are not in this build of libkvrouter: it was "
          "configured with -DKVR_WITH_ZMQ=OFF");
    case IngestTransport::kNats:
      if (KVR_WITH_NATS) return absl::OkStatus();
      return absl::UnimplementedError(
          "NATS subscriptions and replica sync are not in this build of libkvrouter: it was "
          "configured with -DKVR_WITH_NATS=OFF");
  }
  return absl::InvalidArgumentError("unknown ingest transport");
}

}  // namespace kvrouter

// libFuzzer harness: a native event stream (length-prefixed FlatBuffers EventBatches) delivered
// in arbitrary chunks must be reassembled, verified and rejected without crashing, and every
// batch that verifies must apply to a Router without crashing. Each frame is also tried as a
// replica sync message (the other FlatBuffers root that arrives from the network).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "core/router.h"
#include "wire/flatbuffers_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static std::unique_ptr<kvrouter::Router> router =
      *kvrouter::Router::Create(kvrouter::RouterOptions{.block_size = 4});
  kvrouter::FrameReader reader(1u << 20);
  if (size == 0) return 0;
  // The first byte picks the chunk size, so the fuzzer explores frame splits too; the rest is
  // the stream.
  const size_t chunk = 1 + data[0] % 64;
  for (size_t offset = 1; offset < size; offset += chunk) {
    const size_t n = size - offset < chunk ? size - offset : chunk;
    const absl::Status status = reader.Append(std::span(data + offset, n));
    while (auto frame = reader.Next()) {
      if (auto change = kvrouter::DecodeReplicaChange(*frame); change.ok()) {
        (void)router->ApplyReplicaChange(change->origin, change->View());
      }
      auto events = kvrouter::DecodeEventBatch(*frame);
      if (!events.ok()) continue;
      for (const kvrouter::KvEvent& event : *events) (void)router->ApplyEvent(event);
    }
    if (!status.ok()) break;
  }
  // The whole input as one unframed batch, too.
  (void)kvrouter::DecodeEventBatch(std::span(data, size));
  return 0;
}

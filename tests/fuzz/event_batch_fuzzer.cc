// libFuzzer harness: bytes given to kvr_router_apply_event_batch (a FlatBuffers EventBatch from
// a caller). Anything must be rejected or applied without crashing, and whatever was applied
// must leave an index whose snapshot rebuilds the same state in a new replica.
#include <cstddef>
#include <cstdint>

#include "fuzz_router.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrouter::fuzz;
  kvr_router* router = NewFleetRouter();
  kvr_error* err = nullptr;
  const kvr_status status = kvr_router_apply_event_batch(router, data, size, &err);
  // A rejection always says why.
  if (status != KVR_OK && (err == nullptr || kvr_error_message(err)[0] == '\0')) {
    Require(false, "a rejected batch without a message", err);
  }
  kvr_error_free(err);
  RequireSnapshotRoundTrip(router);
  kvr_router_free(router);
  return 0;
}

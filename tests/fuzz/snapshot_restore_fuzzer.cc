// libFuzzer harness: bytes given to kvr_router_restore (an IndexSnapshot from a peer or a file).
// Anything must be rejected or loaded without crashing. A buffer that fails verification
// changes nothing; one that verifies but contradicts itself (a block under a parent it never
// stored) loads what it can and says how much it could not. Either way the router's index must
// then snapshot and restore to the same state.
#include <cstddef>
#include <cstdint>

#include "fuzz_router.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrouter::fuzz;
  kvr_router* router = NewFleetRouter();
  kvr_error* err = nullptr;
  if (kvr_router_restore(router, data, size, &err) != KVR_OK) {
    Require(kvr_error_message(err)[0] != '\0', "a rejected snapshot without a message", err);
  }
  kvr_error_free(err);
  RequireSnapshotRoundTrip(router);
  kvr_router_free(router);
  return 0;
}

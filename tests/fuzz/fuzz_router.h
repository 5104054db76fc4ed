// What the C ABI harnesses share: a router with a small fixed fleet (block size 4, workers 1-3
// of two data-parallel ranks each), and the check that a router's index survives a snapshot.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kvrouter.h"

namespace kvrouter::fuzz {

inline constexpr uint32_t kBlockSize = 4;
inline constexpr uint64_t kWorkers = 3;

// Aborts, so the fuzzer reports the input, when a call that must succeed does not.
inline void Require(bool ok, const char* what, kvr_error* err) {
  if (ok) return;
  std::fprintf(stderr, "%s failed: %s\n", what, kvr_error_message(err));
  std::abort();
}

inline kvr_router* NewFleetRouter() {
  kvr_router_options options;
  kvr_router_options_init(&options, sizeof options);
  options.block_size = kBlockSize;
  kvr_router* router = nullptr;
  kvr_error* err = nullptr;
  Require(kvr_router_new(&options, &router, &err) == KVR_OK, "kvr_router_new", err);
  for (uint64_t id = 1; id <= kWorkers; ++id) {
    kvr_worker_config worker;
    kvr_worker_config_init(&worker, sizeof worker);
    worker.worker_id = id;
    worker.dp_size = 2;
    Require(kvr_router_add_worker(router, &worker, &err) == KVR_OK, "kvr_router_add_worker", err);
  }
  return router;
}

inline uint64_t Digest(kvr_router* router) {
  uint64_t digest = 0;
  kvr_error* err = nullptr;
  Require(kvr_router_state_digest(router, &digest, &err) == KVR_OK, "kvr_router_state_digest", err);
  return digest;
}

// The router's snapshot must load into a fresh router of the same fleet and give it the same
// state: whatever the input left in the index can be carried to a new replica.
inline void RequireSnapshotRoundTrip(kvr_router* router) {
  kvr_buffer* snapshot = nullptr;
  kvr_error* err = nullptr;
  Require(kvr_router_snapshot(router, &snapshot, &err) == KVR_OK, "kvr_router_snapshot", err);
  kvr_router* copy = NewFleetRouter();
  Require(kvr_router_restore(copy, kvr_buffer_data(snapshot), kvr_buffer_size(snapshot), &err) ==
              KVR_OK,
          "kvr_router_restore of the router's own snapshot", err);
  Require(Digest(copy) == Digest(router), "snapshot round trip (digests differ)", nullptr);
  kvr_router_free(copy);
  kvr_buffer_free(snapshot);
}

}  // namespace kvrouter::fuzz

// libFuzzer harness: replica sync messages (SequenceChange buffers from other router replicas,
// over NATS or a caller's bus). The input is a sequence of messages, each a 2-byte length then
// its bytes. Every message must decode or be rejected without crashing; one that decodes must
// encode back to a buffer that decodes to the same change; applying it must not crash. At the
// end every origin seen resets, and then no booking of another replica may remain.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <span>
#include <string>

#include "core/router.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {
namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "%s\n", what);
  std::abort();
}

std::unique_ptr<Router> NewRouter() {
  auto router = Router::Create(RouterOptions{.block_size = 4});
  if (!router.ok()) Fail("Router::Create");
  for (uint64_t id = 1; id <= 3; ++id) {
    if (!(*router)->AddWorker(WorkerConfig{.worker_id = id, .dp_size = 2, .block_size = 4}).ok())
      Fail("AddWorker");
  }
  return *std::move(router);
}

bool SameChange(const ReplicaChange& a, const ReplicaChange& b) {
  return a.origin == b.origin && a.kind == b.kind && a.request_id == b.request_id &&
         a.worker == b.worker && a.block_ids == b.block_ids &&
         a.prefill_tokens == b.prefill_tokens &&
         a.expected_output_tokens == b.expected_output_tokens &&
         a.heartbeat_interval_ms == b.heartbeat_interval_ms && a.booked_ms_ago == b.booked_ms_ago &&
         a.announced_bookings == b.announced_bookings;
}

}  // namespace
}  // namespace kvrouter

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrouter;
  std::unique_ptr<Router> router = NewRouter();
  std::set<std::string> origins;
  for (size_t pos = 0; pos + 2 <= size;) {
    size_t length = data[pos] | size_t{data[pos + 1]} << 8;
    pos += 2;
    if (length > size - pos) length = size - pos;
    const std::span<const uint8_t> message(data + pos, length);
    pos += length;
    auto change = DecodeReplicaChange(message);
    if (!change.ok()) continue;
    const std::vector<uint8_t> again = EncodeReplicaChange(change->origin, change->View());
    auto decoded = DecodeReplicaChange(again);
    if (!decoded.ok() || !SameChange(*change, *decoded))
      Fail("a replica change does not round-trip");
    const auto applied = router->ApplyReplicaChange(change->origin, change->View());
    if (std::getenv("KVR_FUZZ_VERBOSE") != nullptr) {  // to replay a finding by hand
      std::string blocks;
      for (uint64_t b : change->block_ids) blocks += std::to_string(b) + " ";
      std::fprintf(stderr, "%s: kind %d id '%s' on %lu.%u blocks [%s] prefill %lu -> %s\n",
                   change->origin.c_str(), static_cast<int>(change->kind),
                   change->request_id.c_str(), change->worker.worker_id, change->worker.dp_rank,
                   blocks.c_str(), change->prefill_tokens,
                   applied.ok() ? (*applied ? "applied" : "ignored")
                                : std::string(applied.status().message()).c_str());
    }
    origins.insert(change->origin);
  }
  for (const std::string& origin : origins) {
    SequenceChange reset;
    reset.kind = SequenceChange::Kind::kReset;
    const auto applied = router->ApplyReplicaChange(origin, reset);
    if (std::getenv("KVR_FUZZ_VERBOSE") != nullptr) {
      std::fprintf(stderr, "%s: reset -> %s\n", origin.c_str(),
                   applied.ok() ? "ok" : std::string(applied.status().message()).c_str());
    }
  }
  for (const WorkerLoad& load : router->Loads()) {
    if (load.active_blocks != 0 || load.active_prefill_tokens != 0) {
      std::fprintf(stderr, "%lu.%u: %lu blocks, %lu prefill tokens\n", load.worker.worker_id,
                   load.worker.dp_rank, load.active_blocks, load.active_prefill_tokens);
      Fail("bookings of reset replicas remain");
    }
  }
  if (router->active_requests() != 0) Fail("requests of reset replicas remain");
  return 0;
}

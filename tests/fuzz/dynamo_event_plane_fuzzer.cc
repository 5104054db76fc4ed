// libFuzzer harness: a message of Dynamo's KV event plane (msgpack on NATS, as
// ai-dynamo-runtime's KvEventPublisher sends). It must decode or be rejected without crashing,
// and the events of one that decodes must apply to a router, or be rejected, without crashing.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "core/router.h"
#include "wire/engine_events.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrouter;
  static std::unique_ptr<Router> router = [] {
    auto created = *Router::Create(RouterOptions{.block_size = 4});
    // The workers of the seeds (worker 7, rank 1) and a few more.
    for (uint64_t id = 0; id <= 8; ++id) {
      (void)created->AddWorker(WorkerConfig{.worker_id = id, .dp_size = 2, .block_size = 4});
    }
    return created;
  }();
  auto message = DecodeDynamoEventPlane(std::span(data, size));
  if (!message.ok()) return 0;
  for (const KvEvent& event : message->events) (void)router->ApplyEvent(event);
  return 0;
}

// How the simulated engines' KV events reach a policy's router (`kvrouter replay --transport`):
//
//   inprocess  kvr_router_apply_stored / _removed, called directly;
//   stream     kvrouter's native stream: FlatBuffers event batches sent by a kvr_publisher
//              over a Unix socket to a kvr_ingest listener (what a custom engine does);
//   zmq        vLLM's wire format: each engine publishes msgpack KV event batches on a ZMQ PUB
//              socket, [topic, 8-byte sequence, payload], and the router's kvr_ingest
//              subscribes to every engine as a vLLM worker (what a real vLLM fleet does);
//   nats       FlatBuffers event batches published on a NATS server, each engine on a subject
//              of its own, and the router's kvr_ingest subscribed to them all with one
//              wildcard (what engines sharing a message bus with several gateways do).
//
// The wire paths are asynchronous (the ingest loop applies events on its own thread), so
// before every routing decision the policy calls Sync(), which waits until the router has
// handled everything sent so far. The router then sees exactly what it would in process, and
// a replay gives the same table whatever the transport: the test that the wire path loses,
// reorders and misreads nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kvrouter.h"
#include "replay/sim_engine.h"

namespace kvrouter::replay {

enum class Transport { kInProcess, kStream, kZmq, kNats };

// "inprocess", "stream", "zmq" or "nats"; throws std::invalid_argument naming the known ones.
Transport ParseTransport(const std::string& name);

// A transport and where it goes: the NATS server's url ("nats://127.0.0.1:4222") for kNats.
struct EventTransport {
  Transport kind = Transport::kInProcess;
  std::string nats_url;
};

// What the router made of the events (counted the same way on every path).
struct EventCounts {
  uint64_t stored = 0;
  uint64_t removed = 0;
  uint64_t rejected = 0;  // events the router refused
};

class EventPath {
 public:
  virtual ~EventPath() = default;
  virtual void Stored(uint32_t worker, const StoredRun& run) = 0;
  virtual void Removed(uint32_t worker, std::span<const uint64_t> block_hashes, Tier tier) = 0;
  // Returns once the router has handled every event sent before the call.
  virtual void Sync() {}
  virtual EventCounts counts() = 0;
};

// `router` (with the fleet's workers 0..workers-1 registered) must outlive the path. Throws
// std::runtime_error if the transport cannot be set up (a NATS server that cannot be reached,
// or a build without NATS).
std::unique_ptr<EventPath> MakeEventPath(const EventTransport& transport, kvr_router* router,
                                         uint32_t workers, uint32_t block_size);

}  // namespace kvrouter::replay

// Router replica sync (shared/reference/dynamo-router.md §7.5), apart from its transport: the
// booking changes of other replicas applied to this router, and this router's own changes
// handed to a transport (NATS: nats_subscription.cc) to publish. Each replica's load view then
// includes the others' requests; the KV index needs no sync (every replica ingests the
// workers' events itself).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "core/router.h"
#include "ingest/source_counters.h"

namespace kvrouter {

// One message of another replica (a replica change, wire/flatbuffers_codec.h): applied to
// `router` and counted on `source` (an undecodable message as kBadFlatBuffers, one the router
// refuses, such as an unknown worker or a duplicate booking, as kIndexRejected).
void ApplyReplicaMessage(Router& router, std::span<const uint8_t> payload, SourceCounters& source);

// From now on every change to the router's own bookings is encoded and handed to `publish`,
// from the thread that made it, as `replica_id` (Router::SetSequenceObserver: joining, the
// router announces itself). `publish` returns whether the transport took the message; each
// outcome is counted on `counters` (published, publish_failures). Returns the observer's token
// for Router::ClearSequenceObserver.
uint64_t PublishBookings(Router& router, const std::string& replica_id,
                         std::function<bool(std::span<const uint8_t>)> publish,
                         std::shared_ptr<SourceCounters> counters);

}  // namespace kvrouter

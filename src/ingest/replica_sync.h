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

#include "absl/status/statusor.h"
#include "core/router.h"
#include "ingest/source_counters.h"

namespace kvrouter {

// The longest heartbeat interval and liveness timeout accepted (one hour), in milliseconds.
inline constexpr uint32_t kMaxReplicaLivenessMs = kMaxHeartbeatIntervalMs;

// One message of another replica (a replica change, wire/flatbuffers_codec.h) applied to
// `router`. An undecodable message is counted on the router (Router::CountRejectedReplicaChange)
// and its decoding error returned (`decoded` false); otherwise what Router::ApplyReplicaChange
// returns (an unknown worker or a duplicate booking is an error, counted by the router).
struct ReplicaMessageResult {
  bool decoded = false;
  SequenceChange::Kind kind = SequenceChange::Kind::kAdded;  // when decoded
  absl::StatusOr<bool> applied = false;
};
ReplicaMessageResult ApplyReplicaMessage(Router& router, std::span<const uint8_t> payload);
// The same, counted on `source` too (an undecodable message as kBadFlatBuffers, one the router
// refuses as kIndexRejected; a heartbeat is a message but not an event applied).
void ApplyReplicaMessage(Router& router, std::span<const uint8_t> payload, SourceCounters& source);

// The largest message the transport takes now (0: no limit). Asked at every change: a
// connection may meet a server with a smaller limit when it reconnects (a cluster member).
using MessageLimit = std::function<size_t()>;

// A change encoded to publish within a message limit (EncodeReplicaChangeToFit).
struct EncodedChange {
  std::vector<uint8_t> bytes;
  bool trimmed = false;  // block ids were left out to fit
  bool fits = true;      // within the limit (false: too large even without block ids)
};

// From now on every change to the router's own bookings is encoded and handed to `publish`,
// from the thread that made it, as `replica_id` (Router::SetSequenceObserver: joining, the
// router announces itself). Returns the observer's token for Router::ClearSequenceObserver.
// `limit` (none: no limit) is the transport's largest message: a booking whose encoding is
// larger goes with the tail of its block ids left out (EncodeReplicaChangeToFit).
uint64_t PublishReplicaChanges(
    Router& router, const std::string& replica_id,
    std::function<void(const EncodedChange&, SequenceChange::Kind)> publish,
    MessageLimit limit = {});
// The same with a `publish` that returns whether the transport took the message; each outcome
// is counted on `counters` (published, publish_failures, bookings_trimmed), heartbeats' only
// when they fail: `published` counts booking changes. A change too large for the transport even
// without its block ids is dropped and counted as a failure.
uint64_t PublishBookings(Router& router, const std::string& replica_id,
                         std::function<bool(std::span<const uint8_t>)> publish,
                         std::shared_ptr<SourceCounters> counters, MessageLimit limit = {});

// `change` encoded as `origin` publishes it, in at most `max_bytes` (0: no limit) when it can
// be: a booking too large for the transport (a long prompt in small blocks: 131,072 block ids
// fill NATS's default 1 MiB) keeps its request, worker and prefill tokens and as many of its
// leading block ids as fit. Peers then count its prefix blocks only, an under-count of its
// load, where an Added that can never be published would leave it out, and cut every
// announcement of the origin's bookings short, for as long as it lives.
EncodedChange EncodeReplicaChangeToFit(std::string_view origin, const SequenceChange& change,
                                       size_t max_bytes);

// What a transport's message keeps for itself (NATS: headers): a change is at most its
// largest message (NATS: the server's max_payload) less this.
inline constexpr size_t kReplicaMessageRoom = 512;
// The smallest message a replica sync transport must take (a NATS max_payload of 4 KiB): less
// kReplicaMessageRoom, every change fits in it with the longest request and replica ids
// (kMaxRequestIdBytes, kMaxReplicaIdBytes) and the block ids of a short prompt.
inline constexpr size_t kMinReplicaTransportMessage = 4096;

// The largest replica change a transport takes: its largest message less kReplicaMessageRoom
// (half of it, if that is smaller). While it reconnects, what is published waits for a server
// not known yet, which may take less than the last one: the smallest the sync accepts (NATS:
// a message larger than the server's max_payload closes the connection for good). A
// `max_message` of 0 (not known) counts as the smallest accepted too: never "no limit".
size_t ReplicaMessageLimit(size_t max_message, bool reconnecting);

}  // namespace kvrouter

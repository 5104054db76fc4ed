#include "ingest/replica_sync.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {

ReplicaMessageResult ApplyReplicaMessage(Router& router, std::span<const uint8_t> payload) {
  absl::StatusOr<ReplicaChange> change = DecodeReplicaChange(payload);
  if (!change.ok()) {
    router.CountRejectedReplicaChange();
    return {.decoded = false, .applied = change.status()};
  }
  return {.decoded = true,
          .kind = change->kind,
          .applied = router.ApplyReplicaChange(change->origin, change->View())};
}

void ApplyReplicaMessage(Router& router, std::span<const uint8_t> payload, SourceCounters& source) {
  const ReplicaMessageResult result = ApplyReplicaMessage(router, payload);
  if (!result.decoded) {
    source.Reject(IngestReject::kBadFlatBuffers, std::string(result.applied.status().message()));
  } else if (result.applied.ok()) {
    if (result.kind != SequenceChange::Kind::kHeartbeat) Bump(source.events_applied);
  } else {  // an unknown worker, a duplicate booking
    source.Reject(IngestReject::kIndexRejected, std::string(result.applied.status().message()));
  }
  Bump(source.messages);
}

EncodedChange EncodeReplicaChangeToFit(std::string_view origin, const SequenceChange& change,
                                       size_t max_bytes) {
  EncodedChange out{.bytes = EncodeReplicaChange(origin, change)};
  if (max_bytes == 0 || out.bytes.size() <= max_bytes) return out;
  if (change.block_ids.empty()) {
    out.fits = false;
    return out;
  }
  // Each block id is 8 bytes of the encoding; what is left is the rest of it, whose size does
  // not depend on their number but for alignment padding (a few bytes: the loop absorbs it).
  const size_t rest = out.bytes.size() - change.block_ids.size() * sizeof(uint64_t);
  size_t keep = max_bytes > rest ? (max_bytes - rest) / sizeof(uint64_t) : 0;
  SequenceChange trimmed = change;
  out.trimmed = true;
  for (;;) {
    keep = std::min(keep, change.block_ids.size());
    trimmed.block_ids = change.block_ids.first(keep);
    out.bytes = EncodeReplicaChange(origin, trimmed);
    out.fits = out.bytes.size() <= max_bytes;
    if (out.fits || keep == 0) return out;
    --keep;
  }
}

size_t ReplicaMessageLimit(size_t max_message, bool reconnecting) {
  if (max_message == 0) {  // not known: no server yet
    max_message = kMinReplicaTransportMessage;
  } else if (reconnecting) {
    max_message = std::min(max_message, kMinReplicaTransportMessage);
  }
  return max_message > 2 * kReplicaMessageRoom ? max_message - kReplicaMessageRoom
                                               : max_message / 2;
}

uint64_t PublishReplicaChanges(
    Router& router, const std::string& replica_id,
    std::function<void(const EncodedChange&, SequenceChange::Kind)> publish, MessageLimit limit) {
  return router.SetSequenceObserver(
      replica_id, [replica_id, publish = std::move(publish),
                   limit = std::move(limit)](const SequenceChange& c) {
        publish(EncodeReplicaChangeToFit(replica_id, c, limit ? limit() : 0), c.kind);
      });
}

uint64_t PublishBookings(Router& router, const std::string& replica_id,
                         std::function<bool(std::span<const uint8_t>)> publish,
                         std::shared_ptr<SourceCounters> counters, MessageLimit limit) {
  return PublishReplicaChanges(
      router, replica_id,
      [publish = std::move(publish), counters = std::move(counters)](const EncodedChange& change,
                                                                     SequenceChange::Kind kind) {
        if (!change.fits) {
          // Too large even trimmed (a server whose messages are shorter than its ids): it never
          // will fit, so it is dropped and counted, not repaired by announcements that would
          // fail the same way at every change.
          Bump(counters->publish_failures);
          return;
        }
        if (!publish(change.bytes)) {
          Bump(counters->publish_failures);
          // Lost to the peers: the router announces every booking again once a later change
          // gets through.
          throw ChangeNotPublished{};
        }
        if (kind != SequenceChange::Kind::kHeartbeat) Bump(counters->published);
        if (change.trimmed) Bump(counters->bookings_trimmed);
      },
      std::move(limit));
}

}  // namespace kvrouter

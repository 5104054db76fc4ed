#include "ingest/replica_sync.h"

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

uint64_t PublishReplicaChanges(
    Router& router, const std::string& replica_id,
    std::function<void(std::span<const uint8_t>, SequenceChange::Kind)> publish) {
  return router.SetSequenceObserver(
      replica_id, [replica_id, publish = std::move(publish)](const SequenceChange& c) {
        const std::vector<uint8_t> bytes = EncodeReplicaChange(replica_id, c);
        publish(bytes, c.kind);
      });
}

uint64_t PublishBookings(Router& router, const std::string& replica_id,
                         std::function<bool(std::span<const uint8_t>)> publish,
                         std::shared_ptr<SourceCounters> counters) {
  return PublishReplicaChanges(router, replica_id,
                               [publish = std::move(publish), counters = std::move(counters)](
                                   std::span<const uint8_t> bytes, SequenceChange::Kind kind) {
                                 if (!publish(bytes)) {
                                   Bump(counters->publish_failures);
                                   // Lost to the peers: the router announces every booking
                                   // again once a later change gets through.
                                   throw ChangeNotPublished{};
                                 } else if (kind != SequenceChange::Kind::kHeartbeat) {
                                   Bump(counters->published);
                                 }
                               });
}

}  // namespace kvrouter

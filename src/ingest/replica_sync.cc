#include "ingest/replica_sync.h"

#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {

void ApplyReplicaMessage(Router& router, std::span<const uint8_t> payload, SourceCounters& source) {
  absl::StatusOr<ReplicaChange> change = DecodeReplicaChange(payload);
  if (!change.ok()) {
    source.Reject(IngestReject::kBadFlatBuffers, std::string(change.status().message()));
  } else if (auto applied = router.ApplyReplicaChange(change->origin, change->View());
             applied.ok()) {
    Bump(source.events_applied);
  } else {  // an unknown worker, a duplicate booking
    source.Reject(IngestReject::kIndexRejected, std::string(applied.status().message()));
  }
  Bump(source.messages);
}

uint64_t PublishBookings(Router& router, const std::string& replica_id,
                         std::function<bool(std::span<const uint8_t>)> publish,
                         std::shared_ptr<SourceCounters> counters) {
  return router.SetSequenceObserver(
      replica_id, [replica_id, publish = std::move(publish),
                   counters = std::move(counters)](const SequenceChange& c) {
        const std::vector<uint8_t> bytes = EncodeReplicaChange(replica_id, c);
        Bump(publish(bytes) ? counters->published : counters->publish_failures);
      });
}

}  // namespace kvrouter

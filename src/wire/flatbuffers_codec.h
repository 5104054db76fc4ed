// kvrouter's native wire format (schema/kv_events.fbs, schema/index_snapshot.fbs): encoding and
// decoding of KV event batches, index snapshots and replica changes. The length-prefixed framing
// that carries them over byte streams is wire/framing.h.
//
// Every buffer from outside is untrusted: decoding runs the FlatBuffers verifier first, with
// limits that scale with the buffer's size, then checks what the verifier cannot (enum values
// and union members this build does not know, a decoded size no honest buffer could produce).
// A buffer that fails any check decodes to nothing, with an InvalidArgument status naming the
// reason and, for a bad event, its index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/active_sequences.h"
#include "core/types.h"
#include "wire/framing.h"

namespace kvrouter {

// The largest index snapshot DecodeIndexSnapshot accepts. Snapshots come from files or a peer's
// bootstrap stream, not from engine frames, so they may be bigger than one frame; FlatBuffers
// itself cannot address more than 2 GiB.
inline constexpr size_t kMaxSnapshotBytes = size_t{1} << 30;
// The IndexSnapshot.format_version this build writes, and the newest it reads.
inline constexpr uint32_t kIndexSnapshotFormatVersion = 1;

// An EventBatch buffer (file identifier "KVEB") holding `events` in order, stamped with its
// publication time (nanoseconds since the Unix epoch; 0 = unstamped).
std::vector<uint8_t> EncodeEventBatch(std::span<const KvEvent> events,
                                      uint64_t publish_time_ns = 0);
// The same, or ResourceExhausted if it would be larger than `max_bytes` (stopped as it passes
// them): for events a caller gave, unbounded (within the process's own, bounded messages,
// EncodeEventBatch will do).
absl::StatusOr<std::vector<uint8_t>> EncodeEventBatchWithin(std::span<const KvEvent> events,
                                                            uint64_t publish_time_ns,
                                                            size_t max_bytes);

// The events of an EventBatch buffer, in order. `bytes` need not be aligned. When
// `publish_time_ns` is given, it receives the batch's publication time (0 if unstamped).
absl::StatusOr<std::vector<KvEvent>> DecodeEventBatch(std::span<const uint8_t> bytes,
                                                      uint64_t* publish_time_ns = nullptr);

struct IndexSnapshot {
  uint32_t block_size = 0;
  std::vector<KvEvent> events;  // RadixIndex::DumpEvents(), to be applied in order
};

// An IndexSnapshot buffer (file identifier "KVIS") of an index with `block_size` tokens per
// block whose DumpEvents() returned `events`; ResourceExhausted if it would be larger than
// `max_bytes` (by default what DecodeIndexSnapshot accepts: a larger one could not be
// restored), stopped as it passes them.
absl::StatusOr<std::vector<uint8_t>> EncodeIndexSnapshot(uint32_t block_size,
                                                         std::span<const KvEvent> events,
                                                         size_t max_bytes = kMaxSnapshotBytes);

// Also rejects a snapshot with no or a newer format version, or a block size of 0.
absl::StatusOr<IndexSnapshot> DecodeIndexSnapshot(std::span<const uint8_t> bytes);

// A router's booking change for its replicas (schema/replica_events.fbs), owning its data.
struct ReplicaChange {
  std::string origin;
  SequenceChange::Kind kind = SequenceChange::Kind::kAdded;
  std::string request_id;
  WorkerKey worker;
  std::vector<uint64_t> block_ids;
  uint64_t prefill_tokens = 0;
  uint32_t expected_output_tokens = 0;
  uint32_t heartbeat_interval_ms = 0;
  uint32_t booked_ms_ago = 0;
  uint32_t announced_bookings = 0;

  // A view for Router::ApplyReplicaChange, valid while this lives.
  SequenceChange View() const;
};

// A SequenceChange buffer (file identifier "KVSC") of `change`, published by `origin`.
std::vector<uint8_t> EncodeReplicaChange(std::string_view origin, const SequenceChange& change);

// Also rejects a change without origin or request id, or of a kind this build does not know.
absl::StatusOr<ReplicaChange> DecodeReplicaChange(std::span<const uint8_t> bytes);

}  // namespace kvrouter

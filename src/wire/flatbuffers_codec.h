// kvrouter's native wire format (schema/kv_events.fbs, schema/index_snapshot.fbs): encoding and
// decoding of KV event batches and index snapshots, and the length-prefixed framing that carries
// them over byte streams (TCP, Unix sockets).
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

namespace kvrouter {

// The largest frame FrameReader accepts, and the largest event batch DecodeEventBatch accepts.
inline constexpr uint32_t kMaxFrameBytes = 64u << 20;
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

// The events of an EventBatch buffer, in order. `bytes` need not be aligned. When
// `publish_time_ns` is given, it receives the batch's publication time (0 if unstamped).
absl::StatusOr<std::vector<KvEvent>> DecodeEventBatch(std::span<const uint8_t> bytes,
                                                      uint64_t* publish_time_ns = nullptr);

struct IndexSnapshot {
  uint32_t block_size = 0;
  std::vector<KvEvent> events;  // RadixIndex::DumpEvents(), to be applied in order
};

// An IndexSnapshot buffer (file identifier "KVIS") of an index with `block_size` tokens per
// block whose DumpEvents() returned `events`.
std::vector<uint8_t> EncodeIndexSnapshot(uint32_t block_size, std::span<const KvEvent> events);

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

  // A view for Router::ApplyReplicaChange, valid while this lives.
  SequenceChange View() const;
};

// A SequenceChange buffer (file identifier "KVSC") of `change`, published by `origin`.
std::vector<uint8_t> EncodeReplicaChange(std::string_view origin, const SequenceChange& change);

// Also rejects a change without origin or request id, or of a kind this build does not know.
absl::StatusOr<ReplicaChange> DecodeReplicaChange(std::span<const uint8_t> bytes);

// Stream framing: a 4-byte little-endian payload length, then the payload. This is also the
// layout of a FlatBuffers "size-prefixed" buffer, so a publisher may equally send buffers
// finished with FlatBufferBuilder::FinishSizePrefixed.
inline constexpr size_t kFrameHeaderBytes = 4;

// `payload` with its length header. Fails on a payload longer than kMaxFrameBytes.
absl::StatusOr<std::vector<uint8_t>> FrameBatch(std::span<const uint8_t> payload);

// Reassembles frames from a byte stream delivered in chunks of any size.
//
//   FrameReader reader;
//   on read(chunk): status = reader.Append(chunk);
//                   while (auto frame = reader.Next()) Decode(*frame);
//                   if (!status.ok()) drop the connection;
//
// A header announcing more than the limit fails the stream for good: the bytes that follow
// cannot be trusted to be a frame boundary. Frames completed before that bad header are still
// returned by Next(). Drained after every Append(), it holds at most one frame plus one chunk.
class FrameReader {
 public:
  explicit FrameReader(uint32_t max_frame_bytes = kMaxFrameBytes);

  // Buffers `chunk` and checks every frame header it completes. Once failed, returns the same
  // error and buffers nothing more.
  absl::Status Append(std::span<const uint8_t> chunk);

  // The payload of the next complete frame, or nullopt when more bytes are needed.
  std::optional<std::vector<uint8_t>> Next();

  // Bytes received but not yet returned as frames.
  size_t buffered_bytes() const { return buffer_.size() - read_pos_; }
  const absl::Status& status() const { return status_; }

 private:
  absl::Status CheckHeaders();
  void Compact();

  uint32_t max_frame_bytes_;
  std::vector<uint8_t> buffer_;
  size_t read_pos_ = 0;         // start of the next frame Next() returns
  size_t checked_end_ = 0;      // end of the last frame whose header was checked
  uint64_t stream_offset_ = 0;  // stream position of buffer_[0], for error messages
  absl::Status status_;
};

}  // namespace kvrouter

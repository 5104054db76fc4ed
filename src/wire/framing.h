// Stream framing of kvrouter's native event stream (TCP, Unix sockets): each payload (an
// EventBatch, wire/flatbuffers_codec.h) behind its length. Bytes only: no FlatBuffers, no sockets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvrouter {

// The largest frame FrameReader accepts, and the largest event batch DecodeEventBatch accepts.
inline constexpr uint32_t kMaxFrameBytes = 64u << 20;

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
// returned by Next(). Drained after every Append(), it holds at most one frame plus one chunk,
// and keeps no more room than that for long: room a large frame needed (up to the limit) is
// given back once its frame is returned and the buffer is empty, or on the next Append, so one
// large frame does not pin its size for the connection's life (kKeptCapacity is kept).
class FrameReader {
 public:
  explicit FrameReader(uint32_t max_frame_bytes = kMaxFrameBytes);

  // Buffers `chunk` and checks every frame header it completes. Once failed, returns the same
  // error and buffers nothing more.
  absl::Status Append(std::span<const uint8_t> chunk);

  // The payload of the next complete frame, or nullopt when more bytes are needed.
  std::optional<std::vector<uint8_t>> Next();

  // Room kept for reuse however much a frame needed before: a buffer larger than this and
  // four times what it must hold is given back.
  static constexpr size_t kKeptCapacity = size_t{1} << 20;

  // Bytes received but not yet returned as frames.
  size_t buffered_bytes() const { return buffer_.size() - read_pos_; }
  // The buffer's room (its capacity), what the reader costs in memory.
  size_t capacity_bytes() const { return buffer_.capacity(); }
  const absl::Status& status() const { return status_; }

 private:
  absl::Status CheckHeaders();
  void Compact(size_t incoming);

  uint32_t max_frame_bytes_;
  std::vector<uint8_t> buffer_;
  size_t read_pos_ = 0;         // start of the next frame Next() returns
  size_t checked_end_ = 0;      // end of the last frame whose header was checked
  uint64_t stream_offset_ = 0;  // stream position of buffer_[0], for error messages
  absl::Status status_;
};

}  // namespace kvrouter

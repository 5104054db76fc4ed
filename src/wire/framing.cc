#include "wire/framing.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace kvrouter {

namespace {

void StoreLe32(uint32_t value, uint8_t* out) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}

uint32_t LoadLe32(const uint8_t* in) {
  return uint32_t{in[0]} | uint32_t{in[1]} << 8 | uint32_t{in[2]} << 16 | uint32_t{in[3]} << 24;
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> FrameBatch(std::span<const uint8_t> payload) {
  if (payload.size() > kMaxFrameBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "payload of %d bytes is over the %d-byte frame limit", payload.size(), kMaxFrameBytes));
  }
  std::vector<uint8_t> frame(kFrameHeaderBytes + payload.size());
  StoreLe32(static_cast<uint32_t>(payload.size()), frame.data());
  std::copy(payload.begin(), payload.end(), frame.begin() + kFrameHeaderBytes);
  return frame;
}

FrameReader::FrameReader(uint32_t max_frame_bytes) : max_frame_bytes_(max_frame_bytes) {}

absl::Status FrameReader::Append(std::span<const uint8_t> chunk) {
  if (!status_.ok()) return status_;
  Compact(chunk.size());
  buffer_.insert(buffer_.end(), chunk.begin(), chunk.end());
  status_ = CheckHeaders();
  return status_;
}

std::optional<std::vector<uint8_t>> FrameReader::Next() {
  // Frames are contiguous, so the header at read_pos_ has been checked iff it lies before
  // checked_end_; a header that failed the check never does.
  if (read_pos_ >= checked_end_ || read_pos_ + kFrameHeaderBytes > buffer_.size()) {
    return std::nullopt;
  }
  const size_t begin = read_pos_ + kFrameHeaderBytes;
  const size_t end = begin + LoadLe32(&buffer_[read_pos_]);
  if (end > buffer_.size()) return std::nullopt;
  std::vector<uint8_t> frame(buffer_.begin() + begin, buffer_.begin() + end);
  read_pos_ = end;
  if (read_pos_ == buffer_.size()) {  // drained (so checked_end_ == read_pos_ too): start over
    stream_offset_ += read_pos_;
    read_pos_ = 0;
    checked_end_ = 0;
    if (buffer_.capacity() > kKeptCapacity) {
      std::vector<uint8_t>().swap(buffer_);  // a large frame's room, given back
    } else {
      buffer_.clear();
    }
  }
  return frame;
}

// Checks each header as soon as it is complete, so an absurd length is reported before its
// frame would be buffered.
absl::Status FrameReader::CheckHeaders() {
  while (checked_end_ + kFrameHeaderBytes <= buffer_.size()) {
    const uint32_t length = LoadLe32(&buffer_[checked_end_]);
    if (length > max_frame_bytes_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("frame at stream offset %d announces %d bytes, over the %d-byte limit",
                          stream_offset_ + checked_end_, length, max_frame_bytes_));
    }
    checked_end_ += kFrameHeaderBytes + length;
  }
  return absl::OkStatus();
}

// Drops the frames already returned, before `incoming` more bytes are appended. Done before
// appending rather than after each Next(), so the bytes of a partial frame move at most once per
// frame returned. Room a large frame needed that the rest no longer does is given back.
void FrameReader::Compact(size_t incoming) {
  if (read_pos_ != 0) {
    buffer_.erase(buffer_.begin(), buffer_.begin() + read_pos_);
    stream_offset_ += read_pos_;
    checked_end_ -= read_pos_;
    read_pos_ = 0;
  }
  const size_t needed = buffer_.size() + incoming;
  if (buffer_.capacity() > kKeptCapacity && buffer_.capacity() / 4 > needed) {
    std::vector<uint8_t> smaller;
    smaller.reserve(std::max(needed, kKeptCapacity / 4));
    smaller.assign(buffer_.begin(), buffer_.end());
    buffer_.swap(smaller);
  }
}

}  // namespace kvrouter

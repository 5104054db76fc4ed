// Stream framing: FrameBatch and FrameReader, with chunks cut at every byte boundary and
// absurd lengths rejected.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {
namespace {

using Bytes = std::vector<uint8_t>;

Bytes Frame(const Bytes& payload) {
  absl::StatusOr<Bytes> frame = FrameBatch(payload);
  EXPECT_TRUE(frame.ok()) << frame.status();
  return frame.ok() ? *frame : Bytes{};
}

// Three payloads (one empty) and the stream that carries them.
struct Stream {
  std::vector<Bytes> payloads;
  Bytes bytes;
};

Stream ThreeFrames() {
  Stream s;
  s.payloads = {Bytes{1, 2, 3}, Bytes{}, Bytes(300, 0xab)};
  for (size_t i = 0; i < s.payloads[2].size(); ++i) s.payloads[2][i] = static_cast<uint8_t>(i);
  for (const Bytes& p : s.payloads) {
    Bytes frame = Frame(p);
    s.bytes.insert(s.bytes.end(), frame.begin(), frame.end());
  }
  return s;
}

// Feeds `bytes` cut at `cuts` (ascending offsets) and returns every frame read.
std::vector<Bytes> ReadAll(FrameReader& reader, std::span<const uint8_t> bytes,
                           const std::vector<size_t>& cuts) {
  std::vector<Bytes> frames;
  size_t begin = 0;
  auto feed = [&](size_t end) {
    EXPECT_TRUE(reader.Append(bytes.subspan(begin, end - begin)).ok());
    while (auto frame = reader.Next()) frames.push_back(*std::move(frame));
    begin = end;
  };
  for (size_t cut : cuts) feed(cut);
  feed(bytes.size());
  return frames;
}

TEST(FrameBatchTest, PrefixesTheLittleEndianLength) {
  const Bytes frame = Frame(Bytes(258, 9));
  ASSERT_EQ(frame.size(), 262u);
  EXPECT_EQ(Bytes(frame.begin(), frame.begin() + 4), (Bytes{2, 1, 0, 0}));
  EXPECT_EQ(Bytes(frame.begin() + 4, frame.end()), Bytes(258, 9));
  EXPECT_EQ(Frame({}), (Bytes{0, 0, 0, 0}));
}

TEST(FrameBatchTest, RejectsAPayloadOverTheLimit) {
  const Bytes payload(size_t{kMaxFrameBytes} + 1);
  absl::StatusOr<Bytes> frame = FrameBatch(payload);
  EXPECT_EQ(frame.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FrameReaderTest, ReadsAStreamInOneChunk) {
  const Stream s = ThreeFrames();
  FrameReader reader;
  EXPECT_EQ(ReadAll(reader, s.bytes, {}), s.payloads);
  EXPECT_EQ(reader.buffered_bytes(), 0u);
}

TEST(FrameReaderTest, ReadsAStreamCutAtAnyOneByte) {
  const Stream s = ThreeFrames();
  for (size_t cut = 0; cut <= s.bytes.size(); ++cut) {
    SCOPED_TRACE(cut);
    FrameReader reader;
    EXPECT_EQ(ReadAll(reader, s.bytes, {cut}), s.payloads);
    EXPECT_EQ(reader.buffered_bytes(), 0u);
  }
}

TEST(FrameReaderTest, ReadsAStreamCutAtAnyTwoBytes) {
  const Stream s = ThreeFrames();
  for (size_t a = 0; a <= s.bytes.size(); ++a) {
    for (size_t b = a; b <= s.bytes.size(); ++b) {
      FrameReader reader;
      ASSERT_EQ(ReadAll(reader, s.bytes, {a, b}), s.payloads) << a << "," << b;
    }
  }
}

TEST(FrameReaderTest, ReadsAStreamOneByteAtATime) {
  const Stream s = ThreeFrames();
  std::vector<size_t> cuts;
  for (size_t i = 1; i < s.bytes.size(); ++i) cuts.push_back(i);
  FrameReader reader;
  EXPECT_EQ(ReadAll(reader, s.bytes, cuts), s.payloads);
}

TEST(FrameReaderTest, ReadsALongStreamInRandomChunks) {
  std::mt19937 rng(7);
  Stream s;
  for (int i = 0; i < 200; ++i) {
    Bytes payload(rng() % 100);
    for (uint8_t& b : payload) b = static_cast<uint8_t>(rng());
    Bytes frame = Frame(payload);
    s.bytes.insert(s.bytes.end(), frame.begin(), frame.end());
    s.payloads.push_back(std::move(payload));
  }
  std::vector<size_t> cuts;
  for (size_t at = rng() % 50; at < s.bytes.size(); at += rng() % 50) cuts.push_back(at);
  FrameReader reader;
  EXPECT_EQ(ReadAll(reader, s.bytes, cuts), s.payloads);
}

TEST(FrameReaderTest, HoldsAPartialFrameUntilItCompletes) {
  const Bytes frame = Frame(Bytes{7, 8, 9});
  FrameReader reader;
  ASSERT_TRUE(reader.Append(std::span(frame).first(5)).ok());
  EXPECT_FALSE(reader.Next().has_value());
  EXPECT_EQ(reader.buffered_bytes(), 5u);
  ASSERT_TRUE(reader.Append(std::span(frame).subspan(5)).ok());
  EXPECT_EQ(reader.Next(), (Bytes{7, 8, 9}));
  EXPECT_FALSE(reader.Next().has_value());
}

// One large frame must not pin its size for the connection's life: the room it needed is given
// back once it is returned, at once when nothing else is buffered, else when the next bytes
// come (then only what the rest needs is kept). It was kept until the connection closed.
TEST(FrameReaderTest, GivesBackTheRoomOfALargeFrame) {
  Bytes large(8u << 20);
  for (size_t i = 0; i < large.size(); ++i) large[i] = static_cast<uint8_t>(i * 7);
  const Bytes frame = Frame(large);
  const Bytes small = Frame(Bytes{1, 2, 3});
  constexpr size_t kChunk = 64 * 1024;

  FrameReader alone;  // the large frame, then nothing: given back as it is returned
  for (size_t at = 0; at < frame.size(); at += kChunk) {
    const size_t end = std::min(frame.size(), at + kChunk);
    ASSERT_TRUE(alone.Append(std::span(frame).subspan(at, end - at)).ok());
  }
  EXPECT_GE(alone.capacity_bytes(), large.size());
  EXPECT_EQ(alone.Next(), large);
  EXPECT_LE(alone.capacity_bytes(), FrameReader::kKeptCapacity);
  ASSERT_TRUE(alone.Append(small).ok());  // and it goes on
  EXPECT_EQ(alone.Next(), (Bytes{1, 2, 3}));

  FrameReader followed;  // the large frame and the start of a small one in the same chunk
  Bytes stream = frame;
  stream.insert(stream.end(), small.begin(), small.begin() + 5);
  ASSERT_TRUE(followed.Append(stream).ok());
  EXPECT_EQ(followed.Next(), large);
  EXPECT_FALSE(followed.Next().has_value());
  ASSERT_TRUE(followed.Append(std::span(small).subspan(5)).ok());
  EXPECT_LE(followed.capacity_bytes(), FrameReader::kKeptCapacity);
  EXPECT_EQ(followed.Next(), (Bytes{1, 2, 3}));
  EXPECT_EQ(followed.buffered_bytes(), 0u);
}

TEST(FrameReaderTest, RejectsAnAbsurdLengthAndStaysFailed) {
  FrameReader reader;
  const Bytes good = Frame(Bytes{1, 2});
  Bytes stream = good;
  stream.insert(stream.end(), {0xff, 0xff, 0xff, 0xff, 0, 0});  // announces 4 GiB - 1
  absl::Status status = reader.Append(stream);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "stream offset 6 announces 4294967295 bytes"))
      << status;
  // The frame before the bad header is still delivered; nothing after it ever is.
  EXPECT_EQ(reader.Next(), (Bytes{1, 2}));
  EXPECT_FALSE(reader.Next().has_value());
  EXPECT_EQ(reader.Append(good), status);
  EXPECT_FALSE(reader.Next().has_value());
  EXPECT_EQ(reader.status(), status);
}

TEST(FrameReaderTest, RejectsALengthOverACustomLimitSplitAcrossChunks) {
  FrameReader reader(/*max_frame_bytes=*/16);
  ASSERT_TRUE(reader.Append(Frame(Bytes(16, 1))).ok());
  EXPECT_EQ(reader.Next(), Bytes(16, 1));
  const Bytes header = {17, 0, 0, 0};
  ASSERT_TRUE(reader.Append(std::span(header).first(3)).ok());  // not a whole header yet
  absl::Status status = reader.Append(std::span(header).subspan(3));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "stream offset 20 announces 17 bytes")) << status;
}

TEST(FrameReaderTest, CarriesEventBatchesEndToEnd) {
  const KvEvent event{.worker = {3, 1},
                      .tier = Tier::kDisk,
                      .event_id = 42,
                      .data = RemovedEvent{.block_hashes = {1, 2, 3}}};
  const Bytes frame = Frame(EncodeEventBatch(std::span(&event, 1)));
  // Cut right after the header, so the payload sits at an unaligned offset in the stream.
  FrameReader reader;
  std::vector<Bytes> frames = ReadAll(reader, frame, {kFrameHeaderBytes + 1});
  ASSERT_EQ(frames.size(), 1u);
  absl::StatusOr<std::vector<KvEvent>> decoded = DecodeEventBatch(frames[0]);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ASSERT_EQ(decoded->size(), 1u);
  EXPECT_EQ((*decoded)[0].event_id, 42u);
  EXPECT_EQ(std::get<RemovedEvent>((*decoded)[0].data).block_hashes,
            (std::vector<uint64_t>{1, 2, 3}));
}

}  // namespace
}  // namespace kvrouter

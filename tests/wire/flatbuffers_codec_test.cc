// The FlatBuffers codec: round trips of every event kind and field, rejection of malformed and
// hostile buffers (always InvalidArgument, never a crash), and index snapshots through a real
// RadixIndex.
#include "wire/flatbuffers_codec.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/radix_index.h"
#include "core/types.h"
#include "wire/index_snapshot_generated.h"
#include "wire/kv_events_generated.h"

namespace kvrouter {
namespace {

namespace fb = ::flatbuffers;

// ---- Helpers ---------------------------------------------------------------------------------

// Every field of an event as text, so a failed comparison shows what differs.
std::string Describe(const KvEvent& e) {
  std::string out = absl::StrCat("worker=", e.worker.worker_id, "/", e.worker.dp_rank,
                                 " tier=", std::string(TierName(e.tier)), " id=", e.event_id, " ");
  if (const auto* s = std::get_if<StoredEvent>(&e.data)) {
    absl::StrAppend(&out, "stored parent=",
                    s->parent_hash ? absl::StrCat(*s->parent_hash) : std::string("none"),
                    " blocks=[", absl::StrJoin(s->block_hashes, ","), "] local=[",
                    absl::StrJoin(s->local_hashes, ","), "] tokens=[",
                    absl::StrJoin(s->token_ids, ","), "] mm=[");
    for (const auto& block : s->block_mm_hashes) {
      absl::StrAppend(&out, "[", absl::StrJoin(block, ","), "]");
    }
    absl::StrAppend(&out, "] lora='", s->lora_name, "' ns='", s->cache_namespace,
                    "' eagle=", s->eagle);
  } else if (const auto* r = std::get_if<RemovedEvent>(&e.data)) {
    absl::StrAppend(&out, "removed [", absl::StrJoin(r->block_hashes, ","), "]");
  } else if (const auto* ss = std::get_if<SlidingStoredEvent>(&e.data)) {
    absl::StrAppend(&out, "sliding stored group=", ss->group, " window=", ss->window_tokens,
                    " blocks=[", absl::StrJoin(ss->block_hashes, ","), "] sequence=[",
                    absl::StrJoin(ss->sequence_hashes, ","), "]");
  } else if (const auto* sr = std::get_if<SlidingRemovedEvent>(&e.data)) {
    absl::StrAppend(&out, "sliding removed group=", sr->group, " [",
                    absl::StrJoin(sr->block_hashes, ","), "]");
  } else {
    absl::StrAppend(&out, "cleared");
  }
  return out;
}

std::vector<std::string> Describe(const std::vector<KvEvent>& events) {
  std::vector<std::string> out;
  for (const KvEvent& e : events) out.push_back(Describe(e));
  return out;
}

KvEvent Event(WorkerKey worker, Tier tier, uint64_t id, decltype(KvEvent::data) data) {
  return KvEvent{.worker = worker, .tier = tier, .event_id = id, .data = std::move(data)};
}

// One event of every kind, with every field set somewhere and left empty elsewhere.
std::vector<KvEvent> AllKindsOfEvents() {
  constexpr uint64_t kMax64 = std::numeric_limits<uint64_t>::max();
  constexpr uint32_t kMax32 = std::numeric_limits<uint32_t>::max();
  StoredEvent full{.parent_hash = 0,  // a parent hash of 0 is a parent, not "none"
                   .block_hashes = {11, kMax64},
                   .local_hashes = {21, 22},
                   .token_ids = {1, 2, 3, 4, 5, kMax32, 7, 8, 9, 10},
                   .block_mm_hashes = {{101, 102}, {}},
                   .lora_name = "adapter-ß",
                   .cache_namespace = "tenant/a",
                   .eagle = true};
  StoredEvent bare{.block_hashes = {31}, .token_ids = {1, 2, 3, 4}};
  StoredEvent with_parent{.parent_hash = kMax64, .block_hashes = {41, 42}, .local_hashes = {1, 2}};
  return {
      Event({kMax64, kMax32}, Tier::kDevice, kMax64, full),
      Event({1, 0}, Tier::kHostPinned, 0, bare),
      Event({2, 3}, Tier::kDisk, 7, with_parent),
      Event({3, 1}, Tier::kExternal, 8, RemovedEvent{.block_hashes = {41, 11}}),
      Event({4, 0}, Tier::kDevice, 9, RemovedEvent{}),
      Event({5, 2}, Tier::kDevice, 10, ClearedEvent{}),
      Event({6, 0}, Tier::kDevice, 11, StoredEvent{}),
      Event({7, 1}, Tier::kDevice, 12,
            SlidingStoredEvent{.group = -1,
                               .window_tokens = kMax32,
                               .block_hashes = {kMax64, 5},
                               .sequence_hashes = {6, 0}}),
      Event({7, 0}, Tier::kDevice, 13,
            SlidingStoredEvent{.group = 3, .window_tokens = 4096, .block_hashes = {8}}),
      Event({8, 0}, Tier::kDevice, 14,
            SlidingRemovedEvent{.group = std::numeric_limits<int64_t>::min(),
                                .block_hashes = {9, kMax64}}),
  };
}

// `bytes` copied `offset` bytes into a buffer, as a frame sits inside a stream's read buffer:
// decoding must not assume the payload is aligned.
std::vector<uint8_t> Shifted(const std::vector<uint8_t>& bytes, size_t offset) {
  std::vector<uint8_t> out(offset, 0);
  out.insert(out.end(), bytes.begin(), bytes.end());
  return out;
}

void ExpectInvalid(const absl::Status& status, const std::string& message_part = "") {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), message_part))
      << status << "\n  expected to contain: " << message_part;
}

// A batch built field by field, for contents our encoder would never write.
struct RawEvent {
  wire::Tier tier = wire::Tier::Device;
  wire::EventData type = wire::EventData::Cleared;
  bool with_table = true;
};

fb::Offset<fb::Vector<fb::Offset<wire::KvEvent>>> RawEvents(fb::FlatBufferBuilder& fbb,
                                                            const std::vector<RawEvent>& raw) {
  std::vector<fb::Offset<wire::KvEvent>> events;
  for (const RawEvent& r : raw) {
    fb::Offset<void> table = r.with_table ? wire::CreateCleared(fbb).Union() : 0;
    events.push_back(wire::CreateKvEvent(fbb, 1, 0, r.tier, 0, r.type, table));
  }
  return fbb.CreateVector(events);
}

std::vector<uint8_t> Bytes(const fb::FlatBufferBuilder& fbb) {
  return {fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize()};
}

std::vector<uint8_t> RawBatch(const std::vector<RawEvent>& raw) {
  fb::FlatBufferBuilder fbb;
  wire::FinishEventBatchBuffer(fbb, wire::CreateEventBatch(fbb, RawEvents(fbb, raw)));
  return Bytes(fbb);
}

std::vector<uint8_t> RawSnapshot(uint32_t format_version, uint32_t block_size,
                                 const std::vector<RawEvent>& raw = {}) {
  fb::FlatBufferBuilder fbb;
  auto events = RawEvents(fbb, raw);
  wire::FinishIndexSnapshotBuffer(
      fbb, wire::CreateIndexSnapshot(fbb, format_version, block_size, events));
  return Bytes(fbb);
}

// ---- Event batches: round trips --------------------------------------------------------------

TEST(EventBatchTest, RoundTripsEveryKindAndField) {
  const std::vector<KvEvent> events = AllKindsOfEvents();
  absl::StatusOr<std::vector<KvEvent>> decoded = DecodeEventBatch(EncodeEventBatch(events));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(Describe(*decoded), Describe(events));
}

TEST(EventBatchTest, RoundTripsEachEventAlone) {
  for (const KvEvent& event : AllKindsOfEvents()) {
    absl::StatusOr<std::vector<KvEvent>> decoded =
        DecodeEventBatch(EncodeEventBatch(std::span(&event, 1)));
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ASSERT_EQ(decoded->size(), 1u);
    EXPECT_EQ(Describe((*decoded)[0]), Describe(event));
  }
}

TEST(EventBatchTest, RoundTripsAnEmptyBatch) {
  absl::StatusOr<std::vector<KvEvent>> decoded = DecodeEventBatch(EncodeEventBatch({}));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(decoded->empty());
}

TEST(EventBatchTest, RoundTripsThePublishTime) {
  const std::vector<KvEvent> events = AllKindsOfEvents();
  uint64_t publish_time_ns = 0;
  ASSERT_TRUE(
      DecodeEventBatch(EncodeEventBatch(events, 1764421200123456789u), &publish_time_ns).ok());
  EXPECT_EQ(publish_time_ns, 1764421200123456789u);
}

// A batch from a writer that predates the field decodes as unstamped. FlatBuffers leaves a
// default-valued field out, so an unstamped batch is byte for byte what such a writer sends.
TEST(EventBatchTest, AnUnstampedBatchHasNoPublishTime) {
  const std::vector<KvEvent> events = AllKindsOfEvents();
  uint64_t publish_time_ns = 42;
  ASSERT_TRUE(DecodeEventBatch(EncodeEventBatch(events), &publish_time_ns).ok());
  EXPECT_EQ(publish_time_ns, 0u);
  EXPECT_LT(EncodeEventBatch(events).size(), EncodeEventBatch(events, 1).size());
}

TEST(EventBatchTest, RoundTripsEveryTier) {
  for (Tier tier : {Tier::kDevice, Tier::kHostPinned, Tier::kDisk, Tier::kExternal}) {
    const KvEvent event = Event({1, 0}, tier, 1, RemovedEvent{.block_hashes = {5}});
    absl::StatusOr<std::vector<KvEvent>> decoded =
        DecodeEventBatch(EncodeEventBatch(std::span(&event, 1)));
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ((*decoded)[0].tier, tier);
  }
}

TEST(EventBatchTest, DecodesFromAnUnalignedAddress) {
  const std::vector<KvEvent> events = AllKindsOfEvents();
  const std::vector<uint8_t> bytes = EncodeEventBatch(events);
  const std::vector<uint8_t> shifted = Shifted(bytes, 1);
  absl::StatusOr<std::vector<KvEvent>> decoded = DecodeEventBatch(std::span(shifted).subspan(1));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(Describe(*decoded), Describe(events));
}

// ---- Replica changes ---------------------------------------------------------------------------

TEST(ReplicaChangeTest, RoundTripsEveryField) {
  const std::vector<uint64_t> ids = {7, 8, 9};
  const SequenceChange change{.kind = SequenceChange::Kind::kAdded,
                              .request_id = "req-1",
                              .worker = {42, 3},
                              .block_ids = ids,
                              .prefill_tokens = 123,
                              .expected_output_tokens = 456,
                              .booked_ms_ago = 789};
  absl::StatusOr<ReplicaChange> decoded = DecodeReplicaChange(EncodeReplicaChange("gw-a", change));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->origin, "gw-a");
  EXPECT_EQ(decoded->kind, SequenceChange::Kind::kAdded);
  EXPECT_EQ(decoded->request_id, "req-1");
  EXPECT_EQ(decoded->worker, (WorkerKey{42, 3}));
  EXPECT_EQ(decoded->block_ids, ids);
  EXPECT_EQ(decoded->prefill_tokens, 123u);
  EXPECT_EQ(decoded->expected_output_tokens, 456u);
  EXPECT_EQ(decoded->booked_ms_ago, 789u);
  EXPECT_EQ(decoded->View().booked_ms_ago, 789u);
  for (auto kind : {SequenceChange::Kind::kPrefillCompleted, SequenceChange::Kind::kFreed}) {
    SequenceChange release;
    release.kind = kind;
    release.request_id = "req-1";
    decoded = DecodeReplicaChange(EncodeReplicaChange("gw-a", release));
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->kind, kind);
    EXPECT_TRUE(decoded->block_ids.empty());
  }
}

TEST(ReplicaChangeTest, AResetSaysHowManyBookingsFollow) {
  SequenceChange reset;
  reset.kind = SequenceChange::Kind::kReset;
  reset.heartbeat_interval_ms = 1000;
  reset.announced_bookings = 70'000;
  absl::StatusOr<ReplicaChange> decoded = DecodeReplicaChange(EncodeReplicaChange("gw-a", reset));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->kind, SequenceChange::Kind::kReset);
  EXPECT_EQ(decoded->announced_bookings, 70'000u);
  EXPECT_EQ(decoded->View().announced_bookings, 70'000u);
  EXPECT_EQ(decoded->heartbeat_interval_ms, 1000u);
}

TEST(ReplicaChangeTest, AHeartbeatCarriesItsIntervalAndNoRequest) {
  SequenceChange beat;
  beat.kind = SequenceChange::Kind::kHeartbeat;
  beat.heartbeat_interval_ms = 250;
  absl::StatusOr<ReplicaChange> decoded = DecodeReplicaChange(EncodeReplicaChange("gw-a", beat));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->kind, SequenceChange::Kind::kHeartbeat);
  EXPECT_EQ(decoded->heartbeat_interval_ms, 250u);
  EXPECT_TRUE(decoded->request_id.empty());
  EXPECT_EQ(decoded->View().heartbeat_interval_ms, 250u);
}

TEST(ReplicaChangeTest, RejectsWhatIsNotAUsableChange) {
  SequenceChange change;
  change.request_id = "r";
  ExpectInvalid(DecodeReplicaChange(EncodeReplicaChange("", change)).status(), "origin");
  change.request_id = "";
  ExpectInvalid(DecodeReplicaChange(EncodeReplicaChange("a", change)).status(), "request id");
  ExpectInvalid(DecodeReplicaChange(EncodeEventBatch({})).status(), "not a replica change");
  change.request_id = "r";
  const std::vector<uint8_t> bytes = EncodeReplicaChange("a", change);
  // A truncation either fails or only cut alignment padding (and decodes the same).
  size_t rejected = 0;
  for (size_t length = 0; length < bytes.size(); ++length) {
    absl::StatusOr<ReplicaChange> cut = DecodeReplicaChange(std::span(bytes).first(length));
    if (!cut.ok()) {
      ++rejected;
      continue;
    }
    EXPECT_EQ(cut->origin, "a") << length;
    EXPECT_EQ(cut->request_id, "r") << length;
    EXPECT_GE(length, bytes.size() - 3) << "only padding can go";
  }
  EXPECT_GE(rejected, bytes.size() - 3);
}

// ---- Event batches: malformed buffers --------------------------------------------------------

TEST(EventBatchTest, RejectsEmptyAndTinyBuffers) {
  ExpectInvalid(DecodeEventBatch({}).status(), "too short");
  const uint8_t seven[7] = {};
  ExpectInvalid(DecodeEventBatch(seven).status(), "too short");
}

TEST(EventBatchTest, RejectsRandomBytes) {
  std::mt19937_64 rng(42);
  for (int i = 0; i < 2000; ++i) {
    std::vector<uint8_t> bytes(rng() % 512);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
    // Half of them carry the right identifier, to get past it into the verifier.
    if (i % 2 == 0 && bytes.size() >= 8) std::memcpy(bytes.data() + 4, "KVEB", 4);
    ExpectInvalid(DecodeEventBatch(bytes).status());
  }
}

// The FlatBuffers verifier checks that a vector's length is aligned, not its elements. Moving a
// uint64 vector's offset 4 bytes on makes a valid-looking vector (length: the low half of the
// first element) whose elements sit 4 bytes off alignment; decoding must read them safely.
TEST(EventBatchTest, ReadsMisalignedVectorElementsSafely) {
  const KvEvent event{.data = RemovedEvent{.block_hashes = {1, 0xaaaa, 0xbbbb}}};
  std::vector<uint8_t> bytes = EncodeEventBatch(std::span(&event, 1));
  const auto* vector = reinterpret_cast<const uint8_t*>(
      wire::GetEventBatch(bytes.data())->events()->Get(0)->data_as_Removed()->block_hashes());
  const size_t vector_pos = static_cast<size_t>(vector - bytes.data());
  bool moved = false;
  for (size_t field = 0; field + 4 <= vector_pos && !moved; field += 4) {
    uint32_t offset;
    std::memcpy(&offset, bytes.data() + field, 4);
    if (field + offset != vector_pos) continue;
    offset += 4;
    std::memcpy(bytes.data() + field, &offset, 4);
    moved = true;
  }
  ASSERT_TRUE(moved);
  absl::StatusOr<std::vector<KvEvent>> decoded = DecodeEventBatch(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(std::get<RemovedEvent>((*decoded)[0].data).block_hashes,
            std::vector<uint64_t>{0xaaaa'0000'0000ULL});
}

// Corrupting a few bytes of a valid buffer may leave it valid (a hash changes) but must never
// crash or read out of bounds (the sanitizer builds check the latter).
TEST(EventBatchTest, SurvivesRandomCorruption) {
  const std::vector<uint8_t> valid = EncodeEventBatch(AllKindsOfEvents());
  std::mt19937_64 rng(7);
  int rejected = 0;
  for (int i = 0; i < 5000; ++i) {
    std::vector<uint8_t> bytes = valid;
    for (int n = 1 + static_cast<int>(rng() % 3); n > 0; --n) {
      bytes[rng() % bytes.size()] = static_cast<uint8_t>(rng());
    }
    absl::Status status = DecodeEventBatch(bytes).status();
    if (status.ok()) continue;
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    ++rejected;
  }
  EXPECT_GT(rejected, 0);
}

TEST(EventBatchTest, RejectsEveryTruncation) {
  const std::vector<uint8_t> bytes = EncodeEventBatch(AllKindsOfEvents());
  for (size_t length = 0; length < bytes.size(); ++length) {
    SCOPED_TRACE(length);
    ExpectInvalid(DecodeEventBatch(std::span(bytes).first(length)).status());
  }
}

TEST(EventBatchTest, RejectsEveryTruncationOfAnUnalignedCopy) {
  const std::vector<uint8_t> bytes = EncodeEventBatch(AllKindsOfEvents());
  const std::vector<uint8_t> shifted = Shifted(bytes, 3);
  for (size_t length = 0; length < bytes.size(); ++length) {
    SCOPED_TRACE(length);
    ExpectInvalid(DecodeEventBatch(std::span(shifted).subspan(3, length)).status());
  }
}

TEST(EventBatchTest, RejectsAWrongFileIdentifier) {
  std::vector<uint8_t> bytes = EncodeEventBatch(AllKindsOfEvents());
  std::memcpy(bytes.data() + 4, "XXXX", 4);
  ExpectInvalid(DecodeEventBatch(bytes).status(), "file identifier \"XXXX\", expected \"KVEB\"");
}

TEST(EventBatchTest, RejectsASnapshotAndViceVersa) {
  const std::vector<KvEvent> events = AllKindsOfEvents();
  ExpectInvalid(DecodeEventBatch(*EncodeIndexSnapshot(16, events)).status(), "not an event batch");
  ExpectInvalid(DecodeIndexSnapshot(EncodeEventBatch(events)).status(), "not an index snapshot");
}

TEST(EventBatchTest, RejectsAVectorLengthPastTheEnd) {
  std::vector<uint8_t> bytes = EncodeEventBatch(AllKindsOfEvents());
  const wire::Stored* stored =
      wire::GetEventBatch(bytes.data())->events()->Get(0)->data_as_Stored();
  ASSERT_NE(stored, nullptr);
  // A vector is its uint32 length followed by its elements: claim far more than the buffer holds.
  const auto* length = reinterpret_cast<const uint8_t*>(stored->token_ids());
  const uint32_t huge = 0x10000000;
  std::memcpy(bytes.data() + (length - bytes.data()), &huge, sizeof(huge));
  ExpectInvalid(DecodeEventBatch(bytes).status(), "failed FlatBuffers verification");
}

TEST(EventBatchTest, RejectsAnOffsetPastTheEnd) {
  std::vector<uint8_t> bytes = EncodeEventBatch(AllKindsOfEvents());
  const uint32_t past_end = static_cast<uint32_t>(bytes.size());
  std::memcpy(bytes.data(), &past_end, sizeof(past_end));  // the root table's offset
  ExpectInvalid(DecodeEventBatch(bytes).status(), "failed FlatBuffers verification");
}

TEST(EventBatchTest, RejectsABufferOverTheSizeLimit) {
  const std::vector<uint8_t> bytes(size_t{kMaxFrameBytes} + 1);
  ExpectInvalid(DecodeEventBatch(bytes).status(), "over the 67108864-byte limit");
}

TEST(EventBatchTest, RejectsAnUnknownTierNamingTheEvent) {
  const std::vector<uint8_t> bytes = RawBatch({{}, {.tier = static_cast<wire::Tier>(9)}});
  ExpectInvalid(DecodeEventBatch(bytes).status(), "event 1: unknown tier 9");
}

TEST(EventBatchTest, RejectsAnUnknownEventType) {
  const std::vector<uint8_t> bytes = RawBatch({{.type = static_cast<wire::EventData>(7)}});
  ExpectInvalid(DecodeEventBatch(bytes).status(), "event 0: unknown event type 7");
}

TEST(EventBatchTest, RejectsAnEventWithoutData) {
  const std::vector<uint8_t> bytes = RawBatch({{}, {}, {.type = wire::EventData::NONE}});
  ExpectInvalid(DecodeEventBatch(bytes).status(), "event 2: no event data");
}

TEST(EventBatchTest, RejectsAnEventTypeWithoutItsTable) {
  const std::vector<uint8_t> bytes =
      RawBatch({{.type = wire::EventData::Removed, .with_table = false}});
  ExpectInvalid(DecodeEventBatch(bytes).status(), "event 0: Removed event without its table");
}

// Many events pointing at one big table: valid FlatBuffers, but it would make the decoder
// allocate far more than it received.
TEST(EventBatchTest, RejectsDataReferencedManyTimes) {
  fb::FlatBufferBuilder fbb;
  auto removed = wire::CreateRemoved(fbb, fbb.CreateVector(std::vector<uint64_t>(1000, 7)));
  auto event = wire::CreateKvEvent(fbb, 1, 0, wire::Tier::Device, 0, wire::EventData::Removed,
                                   removed.Union());
  auto events = fbb.CreateVector(std::vector<fb::Offset<wire::KvEvent>>(1000, event));
  wire::FinishEventBatchBuffer(fbb, wire::CreateEventBatch(fbb, events));
  ExpectInvalid(DecodeEventBatch(Bytes(fbb)).status(), "referenced more than once");
}

// ---- Index snapshots -------------------------------------------------------------------------

std::vector<uint32_t> Tokens(uint32_t first, size_t count) {
  std::vector<uint32_t> tokens(count);
  for (size_t i = 0; i < count; ++i) tokens[i] = first + static_cast<uint32_t>(i);
  return tokens;
}

// An index with shared prefixes, several workers and ranks, every tier, LoRA and namespace
// blocks, removals (one leaving an orphan) and a cleared worker.
void Populate(RadixIndex& index) {
  const uint32_t bs = index.block_size();
  auto stored = [&](WorkerKey w, Tier tier, std::optional<uint64_t> parent,
                    std::vector<uint64_t> hashes, uint32_t first_token, std::string lora = "") {
    StoredEvent s{.parent_hash = parent,
                  .block_hashes = hashes,
                  .token_ids = Tokens(first_token, hashes.size() * bs),
                  .lora_name = std::move(lora)};
    ASSERT_TRUE(index.Apply(Event(w, tier, 0, std::move(s))).ok());
  };
  stored({1, 0}, Tier::kDevice, std::nullopt, {100, 101, 102}, 0);
  stored({1, 0}, Tier::kDevice, 101, {110, 111}, 1000);
  stored({1, 1}, Tier::kHostPinned, std::nullopt, {200, 201}, 0);
  stored({2, 0}, Tier::kDisk, std::nullopt, {300, 301, 302, 303}, 0);
  stored({2, 0}, Tier::kExternal, std::nullopt, {400}, 5000, "adapter");
  stored({3, 0}, Tier::kDevice, std::nullopt, {500, 501}, 7000);
  ASSERT_TRUE(index.Apply(Event({1, 0}, Tier::kDevice, 0, RemovedEvent{{101}})).ok());
  ASSERT_TRUE(index.Apply(Event({2, 0}, Tier::kDisk, 0, RemovedEvent{{303}})).ok());
  ASSERT_TRUE(index.Apply(Event({3, 0}, Tier::kDevice, 0, ClearedEvent{})).ok());
}

TEST(IndexSnapshotTest, RebuildsAnIdenticalIndex) {
  RadixIndex original(RadixIndexOptions{.block_size = 4});
  ASSERT_NO_FATAL_FAILURE(Populate(original));
  const std::vector<uint8_t> bytes =
      *EncodeIndexSnapshot(original.block_size(), original.DumpEvents());

  absl::StatusOr<IndexSnapshot> snapshot = DecodeIndexSnapshot(bytes);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(snapshot->block_size, 4u);
  EXPECT_EQ(Describe(snapshot->events), Describe(original.DumpEvents()));

  RadixIndex replica(RadixIndexOptions{.block_size = snapshot->block_size});
  for (const KvEvent& event : snapshot->events) {
    ApplyResult result = replica.Apply(event);
    EXPECT_TRUE(result.ok()) << result.message;
  }
  EXPECT_EQ(replica.StateDigest(), original.StateDigest());
}

// An encoding over its limit is refused as it passes it, not written whole: FlatBuffers cannot
// address past 2 GiB (its 32-bit offsets would wrap into a corrupt buffer), and nothing decodes
// a snapshot over kMaxSnapshotBytes or a batch over a frame.
TEST(IndexSnapshotTest, AnEncodingOverItsLimitIsRefused) {
  RadixIndex index(RadixIndexOptions{.block_size = 4});
  ASSERT_NO_FATAL_FAILURE(Populate(index));
  const std::vector<KvEvent> events = index.DumpEvents();
  const size_t whole = EncodeIndexSnapshot(4, events)->size();
  const absl::StatusOr<std::vector<uint8_t>> refused = EncodeIndexSnapshot(4, events, whole / 2);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("index snapshot"), std::string_view::npos);
  EXPECT_TRUE(EncodeIndexSnapshot(4, events, whole).ok());  // the limit itself fits

  const size_t batch = EncodeEventBatch(events, 7).size();
  EXPECT_EQ(EncodeEventBatchWithin(events, 7, batch / 2).status().code(),
            absl::StatusCode::kResourceExhausted);
  const absl::StatusOr<std::vector<uint8_t>> fits = EncodeEventBatchWithin(events, 7, batch);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(*fits, EncodeEventBatch(events, 7));
}

TEST(IndexSnapshotTest, RoundTripsAnEmptyIndex) {
  RadixIndex empty;
  absl::StatusOr<IndexSnapshot> snapshot =
      DecodeIndexSnapshot(*EncodeIndexSnapshot(empty.block_size(), empty.DumpEvents()));
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(snapshot->block_size, empty.block_size());
  EXPECT_TRUE(snapshot->events.empty());
}

TEST(IndexSnapshotTest, RejectsAMissingOrNewerFormatVersion) {
  ASSERT_TRUE(DecodeIndexSnapshot(RawSnapshot(1, 16)).ok());
  ExpectInvalid(DecodeIndexSnapshot(RawSnapshot(0, 16)).status(), "format version 0");
  ExpectInvalid(DecodeIndexSnapshot(RawSnapshot(2, 16)).status(), "format version 2");
}

TEST(IndexSnapshotTest, RejectsABlockSizeOfZero) {
  ExpectInvalid(DecodeIndexSnapshot(RawSnapshot(1, 0)).status(), "block size of 0");
}

TEST(IndexSnapshotTest, RejectsEveryTruncation) {
  RadixIndex index(RadixIndexOptions{.block_size = 4});
  ASSERT_NO_FATAL_FAILURE(Populate(index));
  const std::vector<uint8_t> bytes = *EncodeIndexSnapshot(4, index.DumpEvents());
  for (size_t length = 0; length < bytes.size(); ++length) {
    SCOPED_TRACE(length);
    ExpectInvalid(DecodeIndexSnapshot(std::span(bytes).first(length)).status());
  }
}

TEST(IndexSnapshotTest, NamesTheBadEvent) {
  const std::vector<uint8_t> bytes =
      RawSnapshot(1, 16, {{}, {}, {}, {.tier = static_cast<wire::Tier>(200)}});
  ExpectInvalid(DecodeIndexSnapshot(bytes).status(), "index snapshot event 3: unknown tier 200");
}

}  // namespace
}  // namespace kvrouter

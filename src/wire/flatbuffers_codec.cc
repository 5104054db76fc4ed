#include "wire/flatbuffers_codec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "flatbuffers/flatbuffers.h"
#include "wire/index_snapshot_generated.h"
#include "wire/kv_events_generated.h"
#include "wire/replica_events_generated.h"

namespace kvrouter {
namespace {

namespace fb = ::flatbuffers;

// The wire enum is a copy of kvrouter::Tier, so converting is a cast once the value is known.
static_assert(static_cast<int>(wire::Tier::Device) == static_cast<int>(Tier::kDevice));
static_assert(static_cast<int>(wire::Tier::HostPinned) == static_cast<int>(Tier::kHostPinned));
static_assert(static_cast<int>(wire::Tier::Disk) == static_cast<int>(Tier::kDisk));
static_assert(static_cast<int>(wire::Tier::External) == static_cast<int>(Tier::kExternal));
static_assert(static_cast<int>(wire::Tier::MAX) == kNumTiers - 1);

// ---------------------------------------------------------------------------------------------
// Encoding

// Empty vectors and strings are left out: absent and empty decode alike, and absent is smaller.
template <typename T>
fb::Offset<fb::Vector<T>> VectorOrAbsent(fb::FlatBufferBuilder& fbb, const std::vector<T>& v) {
  return v.empty() ? 0 : fbb.CreateVector(v);
}

fb::Offset<fb::String> StringOrAbsent(fb::FlatBufferBuilder& fbb, const std::string& s) {
  return s.empty() ? 0 : fbb.CreateString(s);
}

fb::Offset<fb::Vector<fb::Offset<wire::BlockMmHashes>>> EncodeMmHashes(
    fb::FlatBufferBuilder& fbb, const std::vector<std::vector<uint64_t>>& block_mm_hashes) {
  if (block_mm_hashes.empty()) return 0;
  std::vector<fb::Offset<wire::BlockMmHashes>> blocks;
  blocks.reserve(block_mm_hashes.size());
  for (const std::vector<uint64_t>& hashes : block_mm_hashes) {
    blocks.push_back(wire::CreateBlockMmHashes(fbb, VectorOrAbsent(fbb, hashes)));
  }
  return fbb.CreateVector(blocks);
}

struct EncodedData {
  wire::EventData type;
  fb::Offset<void> table;
};

EncodedData EncodeData(fb::FlatBufferBuilder& fbb, const StoredEvent& e) {
  // Children first: FlatBuffers builds back to front and forbids nesting a table under way.
  auto block_hashes = VectorOrAbsent(fbb, e.block_hashes);
  auto local_hashes = VectorOrAbsent(fbb, e.local_hashes);
  auto token_ids = VectorOrAbsent(fbb, e.token_ids);
  auto mm_hashes = EncodeMmHashes(fbb, e.block_mm_hashes);
  auto lora_name = StringOrAbsent(fbb, e.lora_name);
  auto cache_namespace = StringOrAbsent(fbb, e.cache_namespace);
  std::optional<wire::BlockHash> parent;
  if (e.parent_hash.has_value()) parent.emplace(*e.parent_hash);
  auto stored = wire::CreateStored(fbb, parent ? &*parent : nullptr, block_hashes, local_hashes,
                                   token_ids, mm_hashes, lora_name, cache_namespace, e.eagle);
  return {wire::EventData::Stored, stored.Union()};
}

EncodedData EncodeData(fb::FlatBufferBuilder& fbb, const RemovedEvent& e) {
  auto removed = wire::CreateRemoved(fbb, VectorOrAbsent(fbb, e.block_hashes));
  return {wire::EventData::Removed, removed.Union()};
}

EncodedData EncodeData(fb::FlatBufferBuilder& fbb, const ClearedEvent&) {
  return {wire::EventData::Cleared, wire::CreateCleared(fbb).Union()};
}

EncodedData EncodeData(fb::FlatBufferBuilder& fbb, const SlidingStoredEvent& e) {
  auto block_hashes = VectorOrAbsent(fbb, e.block_hashes);
  auto sequence_hashes = VectorOrAbsent(fbb, e.sequence_hashes);
  auto stored =
      wire::CreateSlidingStored(fbb, e.group, e.window_tokens, block_hashes, sequence_hashes);
  return {wire::EventData::SlidingStored, stored.Union()};
}

EncodedData EncodeData(fb::FlatBufferBuilder& fbb, const SlidingRemovedEvent& e) {
  auto removed = wire::CreateSlidingRemoved(fbb, e.group, VectorOrAbsent(fbb, e.block_hashes));
  return {wire::EventData::SlidingRemoved, removed.Union()};
}

using EventsOffset = fb::Offset<fb::Vector<fb::Offset<wire::KvEvent>>>;

// The events, or ResourceExhausted (naming `what`) once the buffer passes `max_bytes`: checked
// after each event, well before FlatBuffers' 2 GiB, past which its 32-bit offsets would wrap
// (its asserts compiled out, the buffer would be corrupt, not refused).
absl::StatusOr<EventsOffset> EncodeEvents(fb::FlatBufferBuilder& fbb,
                                          std::span<const KvEvent> events, size_t max_bytes,
                                          const char* what) {
  std::vector<fb::Offset<wire::KvEvent>> offsets;
  offsets.reserve(events.size());
  for (const KvEvent& event : events) {
    EncodedData data = std::visit([&](const auto& d) { return EncodeData(fbb, d); }, event.data);
    offsets.push_back(wire::CreateKvEvent(fbb, event.worker.worker_id, event.worker.dp_rank,
                                          static_cast<wire::Tier>(event.tier), event.event_id,
                                          data.type, data.table));
    if (fbb.GetSize() > max_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("%s of %d events is over the %d-byte limit (%d events took %d bytes)",
                          what, events.size(), max_bytes, offsets.size(), fbb.GetSize()));
    }
  }
  return fbb.CreateVector(offsets);
}

std::vector<uint8_t> Bytes(const fb::FlatBufferBuilder& fbb) {
  const uint8_t* data = fbb.GetBufferPointer();
  return std::vector<uint8_t>(data, data + fbb.GetSize());
}

// The finished buffer, or ResourceExhausted if the vector and root added after the events took
// it past `max_bytes`.
absl::StatusOr<std::vector<uint8_t>> BytesWithin(const fb::FlatBufferBuilder& fbb, size_t max_bytes,
                                                 const char* what) {
  if (fbb.GetSize() > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat("%s of %d bytes is over the %d-byte limit",
                                                        what, fbb.GetSize(), max_bytes));
  }
  return Bytes(fbb);
}

// ---------------------------------------------------------------------------------------------
// Verification

// The verifier counts nested tables: the schemas nest 4 (root, event, stored, mm hashes). The
// margin leaves room for evolution; the limit only has to stop runaway recursion.
constexpr fb::uoffset_t kMaxVerifierDepth = 16;

// FlatBuffers reads scalars in place, so the buffer must be 8-byte aligned in memory (the
// verifier only checks alignment relative to the buffer's start). Bytes cut out of a stream at
// an arbitrary offset need not be, so those are copied once into aligned storage.
class AlignedBytes {
 public:
  explicit AlignedBytes(std::span<const uint8_t> bytes) : view_(bytes) {
    if (bytes.empty() || reinterpret_cast<uintptr_t>(bytes.data()) % alignof(uint64_t) == 0) {
      return;
    }
    copy_.resize((bytes.size() + sizeof(uint64_t) - 1) / sizeof(uint64_t));
    std::memcpy(copy_.data(), bytes.data(), bytes.size());
    view_ = {reinterpret_cast<const uint8_t*>(copy_.data()), bytes.size()};
  }
  std::span<const uint8_t> view() const { return view_; }

 private:
  std::span<const uint8_t> view_;
  std::vector<uint64_t> copy_;
};

struct RootKind {
  const char* identifier;
  const char* name;
  const char* article;  // for "not a(n) <name>"
  size_t max_bytes;
};
constexpr RootKind kEventBatchKind{"KVEB", "event batch", "an", kMaxFrameBytes};
constexpr RootKind kSnapshotKind{"KVIS", "index snapshot", "an", kMaxSnapshotBytes};
constexpr RootKind kReplicaChangeKind{"KVSC", "replica change", "a", kMaxFrameBytes};

// The size and identifier checks come before the verifier only to give a precise message.
absl::Status CheckEnvelope(std::span<const uint8_t> bytes, const RootKind& kind) {
  if (bytes.size() > kind.max_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat("%s of %d bytes is over the %d-byte limit",
                                                      kind.name, bytes.size(), kind.max_bytes));
  }
  if (bytes.size() < fb::kFileIdentifierLength + sizeof(fb::uoffset_t)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s of %d bytes is too short to be a FlatBuffer", kind.name, bytes.size()));
  }
  if (!fb::BufferHasIdentifier(bytes.data(), kind.identifier)) {
    absl::string_view found(reinterpret_cast<const char*>(bytes.data()) + sizeof(fb::uoffset_t),
                            fb::kFileIdentifierLength);
    return absl::InvalidArgumentError(
        absl::StrFormat("not %s %s: file identifier \"%s\", expected \"%s\"", kind.article,
                        kind.name, absl::CHexEscape(found), kind.identifier));
  }
  return absl::OkStatus();
}

template <typename Root>
absl::StatusOr<const Root*> VerifiedRoot(std::span<const uint8_t> bytes, const RootKind& kind) {
  if (absl::Status s = CheckEnvelope(bytes, kind); !s.ok()) return s;
  fb::Verifier::Options options;
  options.max_depth = kMaxVerifierDepth;
  // Every table reference takes its own 4-byte offset in a buffer that shares nothing, so this
  // never rejects a valid buffer, and it bounds the work a buffer of repeated references costs.
  options.max_tables = static_cast<fb::uoffset_t>(bytes.size() / sizeof(fb::uoffset_t));
  fb::Verifier verifier(bytes.data(), bytes.size(), options);
  if (!verifier.VerifyBuffer<Root>(kind.identifier)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s of %d bytes failed FlatBuffers verification (truncated, corrupt or nested too deep)",
        kind.name, bytes.size()));
  }
  return fb::GetRoot<Root>(bytes.data());
}

// The verified root of `bytes` (aligned first, when they are not): valid while this lives.
template <typename Root>
class Verified {
 public:
  Verified(std::span<const uint8_t> bytes, const RootKind& kind)
      : aligned_(bytes), root_(VerifiedRoot<Root>(aligned_.view(), kind)) {}
  bool ok() const { return root_.ok(); }
  absl::Status status() const { return root_.status(); }
  const Root& operator*() const { return **root_; }
  const Root* operator->() const { return *root_; }

 private:
  AlignedBytes aligned_;
  absl::StatusOr<const Root*> root_;
};

// ---------------------------------------------------------------------------------------------
// Decoding (of verified buffers: every offset and length is known to stay inside the buffer)

// Decodes events while charging each table, vector and string the bytes it needs at least on the
// wire. A buffer that shares nothing can never overspend its own size; one whose offsets repeat
// the same data (to make the decoder allocate far more than it received) does, and is rejected.
class Decoder {
 public:
  explicit Decoder(size_t buffer_bytes) : budget_(buffer_bytes) {}

  absl::StatusOr<std::vector<KvEvent>> Events(const fb::Vector<fb::Offset<wire::KvEvent>>* in) {
    std::vector<KvEvent> out;
    if (in == nullptr) return out;
    if (!ChargeVector(in)) return absl::InvalidArgumentError(kOverspentMessage);
    for (fb::uoffset_t i = 0; i < in->size(); ++i) {
      absl::Status s = Event(*in->Get(i), out.emplace_back());
      if (s.ok() && overspent_) s = absl::InvalidArgumentError(kOverspentMessage);
      if (!s.ok()) {
        return absl::InvalidArgumentError(absl::StrFormat("event %d: %s", i, s.message()));
      }
    }
    return out;
  }

 private:
  static constexpr const char* kOverspentMessage =
      "decodes to more data than the buffer holds (a table, vector or string is referenced more "
      "than once)";
  static constexpr size_t kTableBytes = sizeof(fb::soffset_t);  // a table's offset to its vtable

  absl::Status Event(const wire::KvEvent& in, KvEvent& out) {
    Charge(kTableBytes);
    if (static_cast<uint8_t>(in.tier()) > static_cast<uint8_t>(wire::Tier::MAX)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("unknown tier %d", static_cast<int>(in.tier())));
    }
    out.worker = {in.worker_id(), in.dp_rank()};
    out.tier = static_cast<Tier>(in.tier());
    out.event_id = in.event_id();
    return Data(in, out);
  }

  absl::Status Data(const wire::KvEvent& in, KvEvent& out) {
    const auto type = static_cast<int>(in.data_type());
    if (in.data_type() == wire::EventData::NONE) return absl::InvalidArgumentError("no event data");
    if (type > static_cast<int>(wire::EventData::MAX)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("unknown event type %d (from a newer schema?)", type));
    }
    // The verifier accepts a union whose type is set but whose table is absent.
    if (in.data() == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s event without its table", wire::EnumNameEventData(in.data_type())));
    }
    Charge(kTableBytes);
    if (const wire::Stored* stored = in.data_as_Stored()) {
      Stored(*stored, out.data.emplace<StoredEvent>());
    } else if (const wire::Removed* removed = in.data_as_Removed()) {
      Copy(removed->block_hashes(), out.data.emplace<RemovedEvent>().block_hashes);
    } else if (const wire::SlidingStored* sliding = in.data_as_SlidingStored()) {
      auto& event = out.data.emplace<SlidingStoredEvent>();
      event.group = sliding->group();
      event.window_tokens = sliding->window_tokens();
      Copy(sliding->block_hashes(), event.block_hashes);
      Copy(sliding->sequence_hashes(), event.sequence_hashes);
    } else if (const wire::SlidingRemoved* sliding_removed = in.data_as_SlidingRemoved()) {
      auto& event = out.data.emplace<SlidingRemovedEvent>();
      event.group = sliding_removed->group();
      Copy(sliding_removed->block_hashes(), event.block_hashes);
    } else {
      out.data.emplace<ClearedEvent>();
    }
    return absl::OkStatus();
  }

  void Stored(const wire::Stored& in, StoredEvent& out) {
    if (in.parent() != nullptr) out.parent_hash = in.parent()->value();
    Copy(in.block_hashes(), out.block_hashes);
    Copy(in.local_hashes(), out.local_hashes);
    Copy(in.token_ids(), out.token_ids);
    if (const auto* blocks = in.block_mm_hashes(); blocks != nullptr && ChargeVector(blocks)) {
      out.block_mm_hashes.reserve(blocks->size());
      for (const wire::BlockMmHashes* block : *blocks) {
        Charge(kTableBytes);
        Copy(block->hashes(), out.block_mm_hashes.emplace_back());
        if (overspent_) return;
      }
    }
    Copy(in.lora_name(), out.lora_name);
    Copy(in.cache_namespace(), out.cache_namespace);
    out.eagle = in.eagle();
  }

  // Copies bytes rather than reading elements: the verifier (2.0.8) checks that a vector's
  // length is aligned but not its elements, so a hostile buffer can misalign 8-byte elements,
  // and reading those as uint64_t would be undefined behaviour.
  template <typename T>
  void Copy(const fb::Vector<T>* in, std::vector<T>& out) {
    if (in == nullptr || !ChargeVector(in) || in->size() == 0) return;
    out.resize(in->size());
    std::memcpy(out.data(), in->Data(), out.size() * sizeof(T));
    if constexpr (!FLATBUFFERS_LITTLEENDIAN) {
      for (T& value : out) value = fb::EndianScalar(value);
    }
  }

  void Copy(const fb::String* in, std::string& out) {
    // Length, bytes and the terminating NUL the verifier insists on.
    if (in != nullptr && Charge(sizeof(fb::uoffset_t) + in->size() + 1)) out = in->str();
  }

  template <typename T>
  bool ChargeVector(const fb::Vector<T>* in) {
    return Charge(sizeof(fb::uoffset_t) + size_t{in->size()} * sizeof(T));
  }

  bool Charge(size_t bytes) {
    if (overspent_ || bytes > budget_) {
      overspent_ = true;
      return false;
    }
    budget_ -= bytes;
    return true;
  }

  size_t budget_;
  bool overspent_ = false;
};

}  // namespace

std::vector<uint8_t> EncodeEventBatch(std::span<const KvEvent> events, uint64_t publish_time_ns) {
  fb::FlatBufferBuilder fbb;
  auto offsets = EncodeEvents(fbb, events, SIZE_MAX, "an event batch");
  wire::FinishEventBatchBuffer(fbb, wire::CreateEventBatch(fbb, *offsets, publish_time_ns));
  return Bytes(fbb);
}

absl::StatusOr<std::vector<uint8_t>> EncodeEventBatchWithin(std::span<const KvEvent> events,
                                                            uint64_t publish_time_ns,
                                                            size_t max_bytes) {
  fb::FlatBufferBuilder fbb;
  auto offsets = EncodeEvents(fbb, events, max_bytes, "an event batch");
  if (!offsets.ok()) return offsets.status();
  wire::FinishEventBatchBuffer(fbb, wire::CreateEventBatch(fbb, *offsets, publish_time_ns));
  return BytesWithin(fbb, max_bytes, "an event batch");
}

absl::StatusOr<std::vector<KvEvent>> DecodeEventBatch(std::span<const uint8_t> bytes,
                                                      uint64_t* publish_time_ns) {
  const Verified<wire::EventBatch> batch(bytes, kEventBatchKind);
  if (!batch.ok()) return batch.status();
  absl::StatusOr<std::vector<KvEvent>> events = Decoder(bytes.size()).Events(batch->events());
  if (events.ok() && publish_time_ns != nullptr) *publish_time_ns = batch->publish_time_ns();
  return events;
}

absl::StatusOr<std::vector<uint8_t>> EncodeIndexSnapshot(uint32_t block_size,
                                                         std::span<const KvEvent> events,
                                                         size_t max_bytes) {
  fb::FlatBufferBuilder fbb;
  auto offsets = EncodeEvents(fbb, events, max_bytes, "an index snapshot");
  if (!offsets.ok()) return offsets.status();
  wire::FinishIndexSnapshotBuffer(
      fbb, wire::CreateIndexSnapshot(fbb, kIndexSnapshotFormatVersion, block_size, *offsets));
  return BytesWithin(fbb, max_bytes, "an index snapshot");
}

absl::StatusOr<IndexSnapshot> DecodeIndexSnapshot(std::span<const uint8_t> bytes) {
  const Verified<wire::IndexSnapshot> root(bytes, kSnapshotKind);
  if (!root.ok()) return root.status();
  const wire::IndexSnapshot& snapshot = *root;
  if (snapshot.format_version() == 0 || snapshot.format_version() > kIndexSnapshotFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("index snapshot format version %d: this build reads 1 to %d",
                        snapshot.format_version(), kIndexSnapshotFormatVersion));
  }
  if (snapshot.block_size() == 0) {
    return absl::InvalidArgumentError("index snapshot with a block size of 0");
  }
  absl::StatusOr<std::vector<KvEvent>> events = Decoder(bytes.size()).Events(snapshot.events());
  if (!events.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("index snapshot ", events.status().message()));
  }
  return IndexSnapshot{snapshot.block_size(), *std::move(events)};
}

// ---------------------------------------------------------------------------------------------
// Replica changes

static_assert(static_cast<int>(wire::SequenceChangeKind::Added) ==
              static_cast<int>(SequenceChange::Kind::kAdded));
static_assert(static_cast<int>(wire::SequenceChangeKind::PrefillCompleted) ==
              static_cast<int>(SequenceChange::Kind::kPrefillCompleted));
static_assert(static_cast<int>(wire::SequenceChangeKind::Freed) ==
              static_cast<int>(SequenceChange::Kind::kFreed));
static_assert(static_cast<int>(wire::SequenceChangeKind::Reset) ==
              static_cast<int>(SequenceChange::Kind::kReset));
static_assert(static_cast<int>(wire::SequenceChangeKind::SyncRequest) ==
              static_cast<int>(SequenceChange::Kind::kSyncRequest));
static_assert(static_cast<int>(wire::SequenceChangeKind::Heartbeat) ==
              static_cast<int>(SequenceChange::Kind::kHeartbeat));

SequenceChange ReplicaChange::View() const {
  return {.kind = kind,
          .request_id = request_id,
          .worker = worker,
          .block_ids = block_ids,
          .prefill_tokens = prefill_tokens,
          .expected_output_tokens = expected_output_tokens,
          .heartbeat_interval_ms = heartbeat_interval_ms,
          .booked_ms_ago = booked_ms_ago,
          .announced_bookings = announced_bookings};
}

std::vector<uint8_t> EncodeReplicaChange(std::string_view origin, const SequenceChange& change) {
  fb::FlatBufferBuilder fbb;
  auto origin_offset = fbb.CreateString(origin.data(), origin.size());
  auto request_id = fbb.CreateString(change.request_id.data(), change.request_id.size());
  auto block_ids = change.block_ids.empty()
                       ? 0
                       : fbb.CreateVector(change.block_ids.data(), change.block_ids.size());
  wire::FinishSequenceChangeBuffer(
      fbb, wire::CreateSequenceChange(
               fbb, origin_offset, static_cast<wire::SequenceChangeKind>(change.kind), request_id,
               change.worker.worker_id, change.worker.dp_rank, block_ids, change.prefill_tokens,
               change.expected_output_tokens, change.heartbeat_interval_ms, change.booked_ms_ago,
               change.announced_bookings));
  return Bytes(fbb);
}

absl::StatusOr<ReplicaChange> DecodeReplicaChange(std::span<const uint8_t> bytes) {
  const Verified<wire::SequenceChange> root(bytes, kReplicaChangeKind);
  if (!root.ok()) return root.status();
  const wire::SequenceChange& in = *root;
  if (in.kind() > wire::SequenceChangeKind::MAX) {
    return absl::InvalidArgumentError(
        absl::StrFormat("replica change of unknown kind %d", static_cast<int>(in.kind())));
  }
  const bool names_a_request = NamesARequest(static_cast<SequenceChange::Kind>(in.kind()));
  if (in.origin() == nullptr || in.origin()->size() == 0 ||
      (names_a_request && (in.request_id() == nullptr || in.request_id()->size() == 0))) {
    return absl::InvalidArgumentError("replica change without its origin or request id");
  }
  ReplicaChange out{.origin = in.origin()->str(),
                    .kind = static_cast<SequenceChange::Kind>(in.kind()),
                    .request_id = in.request_id() != nullptr ? in.request_id()->str() : "",
                    .worker = {in.worker_id(), in.dp_rank()},
                    .block_ids = {},
                    .prefill_tokens = in.prefill_tokens(),
                    .expected_output_tokens = in.expected_output_tokens(),
                    .heartbeat_interval_ms = in.heartbeat_interval_ms(),
                    .booked_ms_ago = in.booked_ms_ago(),
                    .announced_bookings = in.announced_bookings()};
  if (in.block_ids() != nullptr) {
    out.block_ids.assign(in.block_ids()->begin(), in.block_ids()->end());
  }
  return out;
}

}  // namespace kvrouter

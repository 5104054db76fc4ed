#include "wire/engine_events.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <msgpack.hpp>  // MSGPACK_NO_BOOST is set by the build
#include <new>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/hashing.h"

namespace kvrouter {
namespace {

using msgpack::object;
namespace mtype = msgpack::type;

// Thrown inside the decoder, turned into InvalidArgument at its edge: the decoder walks deep
// nested shapes, and an exception keeps each step a plain expression.
struct DecodeError {
  std::string message;
};

[[noreturn]] void Reject(std::string message) { throw DecodeError{std::move(message)}; }

bool IsNil(const object& o) { return o.type == mtype::NIL; }

std::string_view AsStr(const object& o, const char* what) {
  if (o.type != mtype::STR) Reject(absl::StrCat(what, " is not a string"));
  return {o.via.str.ptr, o.via.str.size};
}

std::optional<std::string> OptStr(const object* o, const char* what) {
  if (o == nullptr || IsNil(*o)) return std::nullopt;
  return std::string(AsStr(*o, what));
}

int64_t AsInt(const object& o, const char* what) {
  if (o.type == mtype::POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<uint64_t>(INT64_MAX)) Reject(absl::StrCat(what, " too large"));
    return static_cast<int64_t>(o.via.u64);
  }
  if (o.type == mtype::NEGATIVE_INTEGER) return o.via.i64;
  Reject(absl::StrCat(what, " is not an integer"));
}

std::optional<int64_t> OptInt(const object* o, const char* what) {
  if (o == nullptr || IsNil(*o)) return std::nullopt;
  return AsInt(*o, what);
}

// A block hash in any of the forms engines send. Signed values keep their bit pattern, so the
// same hash always maps to the same key; digests keep their last 8 bytes, big-endian, which is
// vLLM's int.from_bytes(digest, "big") & (2**64 - 1).
uint64_t AsHash(const object& o, const char* what) {
  switch (o.type) {
    case mtype::POSITIVE_INTEGER:
      return o.via.u64;
    case mtype::NEGATIVE_INTEGER:
      return static_cast<uint64_t>(o.via.i64);
    case mtype::BIN: {
      const uint32_t size = o.via.bin.size;
      if (size < 8) Reject(absl::StrCat(what, " is a digest of ", size, " bytes (< 8)"));
      uint64_t value = 0;
      for (uint32_t i = size - 8; i < size; ++i) {
        value = (value << 8) | static_cast<uint8_t>(o.via.bin.ptr[i]);
      }
      return value;
    }
    default:
      Reject(absl::StrCat(what, " is not an integer or bytes"));
  }
}

std::span<const object> AsArray(const object& o, const char* what) {
  if (o.type != mtype::ARRAY) Reject(absl::StrCat(what, " is not an array"));
  return {o.via.array.ptr, o.via.array.size};
}

std::vector<uint64_t> AsHashes(const object& o, const char* what) {
  std::vector<uint64_t> out;
  for (const object& h : AsArray(o, what)) out.push_back(AsHash(h, what));
  return out;
}

uint32_t AsToken(const object& o) {
  const int64_t v = AsInt(o, "token id");
  if (v < 0 || v > UINT32_MAX) Reject(absl::StrCat("token id ", v, " out of range"));
  return static_cast<uint32_t>(v);
}

// Plain token ids, or SGLang's EAGLE bigram pages: one [t_i, t_i+1] pair per token position,
// consecutive pairs overlapping by one token. Those unfold to t_0 .. t_n (n pairs, n + 1
// tokens): each block's window then ends with its look-ahead token, the router's eagle form.
std::vector<uint32_t> AsTokens(const object& o, bool& bigram) {
  const std::span<const object> items = AsArray(o, "token_ids");
  std::vector<uint32_t> out;
  bigram = !items.empty() && items[0].type == mtype::ARRAY;
  if (!bigram) {
    out.reserve(items.size());
    for (const object& t : items) out.push_back(AsToken(t));
    return out;
  }
  out.reserve(items.size() + 1);
  for (size_t i = 0; i < items.size(); ++i) {
    const std::span<const object> pair = AsArray(items[i], "bigram token pair");
    if (pair.size() != 2)
      Reject(absl::StrCat("bigram token pair ", i, " has ", pair.size(), " elements, not 2"));
    const uint32_t first = AsToken(pair[0]);
    if (i > 0 && first != out.back()) {
      Reject(absl::StrCat("bigram token pair ", i, " does not continue pair ", i - 1));
    }
    if (i == 0) out.push_back(first);
    out.push_back(AsToken(pair[1]));
  }
  return out;
}

bool IsHexDigest(std::string_view s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
         });
}

// The tag Dynamo's vLLM front end puts before a cache salt it passes down (and newer SGLang
// writes into extra_keys), so that a salt cannot be mistaken for a LoRA name.
constexpr std::string_view kTaggedSaltPrefix = "dynamo-cache-salt:";

// vLLM's extra_keys: one entry per block, nil or a tuple of (in this order) the LoRA name, the
// multimodal items in the block ([identifier, offset] pairs since vLLM 0.19, bare identifier
// strings before), the cache salt (a request's first block only) and prompt-embedding digests
// (bytes). Keeps each block's bare strings and the routing hashes of its multimodal items.
void ReadExtraKeys(const object& o, EngineEvent& out) {
  for (const object& block : AsArray(o, "extra_keys")) {
    std::vector<std::string>& keys = out.extra_keys.emplace_back();
    std::vector<uint64_t>& mm = out.block_mm_hashes.emplace_back();
    if (block.type != mtype::ARRAY) continue;
    for (const object& key : AsArray(block, "extra_keys entry")) {
      if (key.type == mtype::STR) {
        keys.emplace_back(key.via.str.ptr, key.via.str.size);
      } else if (key.type == mtype::ARRAY && key.via.array.size >= 1 &&
                 key.via.array.ptr[0].type == mtype::STR) {
        const object& id = key.via.array.ptr[0];
        if (auto h = MmHashOfIdentifier({id.via.str.ptr, id.via.str.size})) mm.push_back(*h);
      }
    }
  }
  // Legacy (bare) multimodal identifiers are told from the other bare strings as Dynamo does:
  // vLLM's digests are 64 hex characters, and nothing else is read as one.
  for (size_t b = 0; b < out.extra_keys.size(); ++b) {
    bool lora_skipped = false;
    for (const std::string& key : out.extra_keys[b]) {
      if (!lora_skipped && out.lora_name && key == *out.lora_name) {
        lora_skipped = true;
      } else if (IsHexDigest(key)) {
        out.block_mm_hashes[b].push_back(*MmHashOfIdentifier(key));
      }
    }
  }
  bool any_mm = false;
  for (const auto& mm : out.block_mm_hashes) any_mm |= !mm.empty();
  if (!any_mm) out.block_mm_hashes.clear();
}

// The cache salt in a vLLM store's extra_keys: vLLM adds it to the first block of a request
// only, so only a store with no parent can carry it, in its first entry. It is the bare string
// there that is neither the LoRA name (the first string equal to lora_name: a salt may equal
// it) nor a multimodal digest; a Dynamo-tagged salt loses its tag.
std::optional<std::string> SaltFromExtraKeys(const EngineEvent& e) {
  if (e.parent_hash || e.extra_keys.empty()) return std::nullopt;
  bool lora_skipped = false;
  for (const std::string& key : e.extra_keys[0]) {
    if (!lora_skipped && e.lora_name && key == *e.lora_name) {
      lora_skipped = true;
      continue;
    }
    if (key.starts_with(kTaggedSaltPrefix)) {
      if (key.size() > kTaggedSaltPrefix.size()) return key.substr(kTaggedSaltPrefix.size());
      continue;
    }
    if (!key.empty() && !IsHexDigest(key)) return key;
  }
  return std::nullopt;
}

// Field access that works the same on positional and tagged-map events.
class Fields {
 public:
  // `names` lists the positional order after the tag.
  Fields(const object& event, std::span<const std::string_view> names)
      : event_(event), names_(names) {}

  const object* Get(std::string_view name) const {
    if (event_.type == mtype::MAP) {
      for (uint32_t i = 0; i < event_.via.map.size; ++i) {
        const auto& kv = event_.via.map.ptr[i];
        if (kv.key.type == mtype::STR &&
            std::string_view(kv.key.via.str.ptr, kv.key.via.str.size) == name) {
          return &kv.val;
        }
      }
      return nullptr;  // missing (omitted default): as nil
    }
    for (size_t i = 0; i < names_.size(); ++i) {
      if (names_[i] != name) continue;
      const size_t position = i + 1;  // element 0 is the tag
      return position < event_.via.array.size ? &event_.via.array.ptr[position] : nullptr;
    }
    return nullptr;
  }

  const object& Require(std::string_view name) const {
    const object* o = Get(name);
    if (o == nullptr) Reject(absl::StrCat("missing field ", std::string(name)));
    return *o;
  }

 private:
  const object& event_;
  std::span<const std::string_view> names_;
};

constexpr std::string_view kStoredFields[] = {"block_hashes",
                                              "parent_block_hash",
                                              "token_ids",
                                              "block_size",
                                              "lora_id",
                                              "medium",
                                              "lora_name",
                                              "extra_keys",
                                              "group_idx",
                                              "kv_cache_spec_kind",
                                              "kv_cache_spec_sliding_window"};
constexpr std::string_view kRemovedFields[] = {"block_hashes", "medium", "group_idx"};

void ReadMedium(const Fields& fields, EngineEvent& out) {
  out.medium = OptStr(fields.Get("medium"), "medium");
  out.tier = TierFromMedium(out.medium.value_or(""));
}

// SGLang's salted store (BlockStoredWithMetadata) appends a metadata map {"cache_salt": ...}:
// right after medium (where vLLM has lora_name) up to 0.5.x, after every positional field in
// later versions, or under the key "metadata" when events are maps.
void ReadSglangMetadata(const object& event, EngineEvent& out) {
  std::span<const object> candidates;
  if (event.type == mtype::ARRAY) {
    candidates = {event.via.array.ptr + 1, event.via.array.size - 1};
  } else if (const object* m = Fields(event, {}).Get("metadata")) {
    candidates = {m, 1};
  }
  for (const object& o : candidates) {
    if (o.type != mtype::MAP) continue;
    for (uint32_t k = 0; k < o.via.map.size; ++k) {
      const auto& kv = o.via.map.ptr[k];
      if (kv.key.type == mtype::STR && kv.val.type == mtype::STR &&
          std::string_view(kv.key.via.str.ptr, kv.key.via.str.size) == "cache_salt") {
        out.cache_salt = std::string(kv.val.via.str.ptr, kv.val.via.str.size);
      }
    }
  }
}

EngineEvent DecodeStored(const object& event) {
  const Fields fields(event, kStoredFields);
  EngineEvent out;
  out.kind = EngineEventKind::kStored;
  out.block_hashes = AsHashes(fields.Require("block_hashes"), "block hash");
  if (const object* parent = fields.Get("parent_block_hash"); parent && !IsNil(*parent)) {
    out.parent_hash = AsHash(*parent, "parent_block_hash");
  }
  out.token_ids = AsTokens(fields.Require("token_ids"), out.bigram);
  if (auto bs = OptInt(fields.Get("block_size"), "block_size")) {
    if (*bs < 0 || *bs > UINT32_MAX) Reject(absl::StrCat("block_size ", *bs, " out of range"));
    // 0: vLLM's offloading connector announcing copies without tokens (no size to check).
    if (*bs > 0) out.block_size = static_cast<uint32_t>(*bs);
  }
  out.lora_id = OptInt(fields.Get("lora_id"), "lora_id");
  ReadMedium(fields, out);
  if (const object* lora = fields.Get("lora_name"); lora && lora->type == mtype::STR) {
    out.lora_name = std::string(AsStr(*lora, "lora_name"));
  }
  if (const object* keys = fields.Get("extra_keys"); keys && keys->type == mtype::ARRAY) {
    ReadExtraKeys(*keys, out);
  }
  if (const object* group = fields.Get("group_idx"); group && group->type != mtype::MAP) {
    out.group_idx = OptInt(group, "group_idx");
  }
  if (const object* kind = fields.Get("kv_cache_spec_kind"); kind && kind->type == mtype::STR) {
    out.kv_cache_spec_kind = std::string(AsStr(*kind, "kv_cache_spec_kind"));
  }
  // A window out of range is left unsaid: the group's events are then ignored (and counted),
  // and the full-attention events beside them still apply.
  if (const object* window = fields.Get("kv_cache_spec_sliding_window");
      window != nullptr && window->type == mtype::POSITIVE_INTEGER && window->via.u64 > 0 &&
      window->via.u64 <= UINT32_MAX) {
    out.sliding_window = static_cast<uint32_t>(window->via.u64);
  }
  ReadSglangMetadata(event, out);
  if (const object* salt = fields.Get("cache_salt"); salt && salt->type == mtype::STR) {
    out.cache_salt = std::string(AsStr(*salt, "cache_salt"));  // a map event's own field
  }
  if (!out.cache_salt) out.cache_salt = SaltFromExtraKeys(out);
  if (out.cache_salt && out.cache_salt->empty()) out.cache_salt.reset();
  return out;
}

EngineEvent DecodeRemoved(const object& event) {
  const Fields fields(event, kRemovedFields);
  EngineEvent out;
  out.kind = EngineEventKind::kRemoved;
  out.block_hashes = AsHashes(fields.Require("block_hashes"), "block hash");
  ReadMedium(fields, out);
  out.group_idx = OptInt(fields.Get("group_idx"), "group_idx");
  return out;
}

std::string_view TagOf(const object& event) {
  if (event.type == mtype::ARRAY) {
    if (event.via.array.size == 0) Reject("event is an empty array");
    return AsStr(event.via.array.ptr[0], "event tag");
  }
  if (event.type == mtype::MAP) {
    const std::string_view names[] = {"type"};
    return AsStr(Fields(event, names).Require("type"), "event tag");
  }
  Reject("event is neither an array nor a map");
}

// nullopt, with `unknown` set to why, for an event of a type this decoder does not know.
std::optional<EngineEvent> DecodeEvent(const object& event, std::string& unknown) {
  const std::string_view tag = TagOf(event);
  if (tag == "BlockStored") return DecodeStored(event);
  if (tag == "BlockRemoved") return DecodeRemoved(event);
  if (tag == "AllBlocksCleared") return EngineEvent{};  // kind defaults to kCleared
  unknown = absl::StrCat("unknown event tag '", std::string(tag), "'");
  return std::nullopt;
}

double AsTimestamp(const object& o) {
  if (o.type == mtype::FLOAT64 || o.type == mtype::FLOAT32) return o.via.f64;
  if (o.type == mtype::POSITIVE_INTEGER) return static_cast<double>(o.via.u64);
  if (o.type == mtype::NEGATIVE_INTEGER) return static_cast<double>(o.via.i64);
  Reject("ts is not a number");
}

std::optional<uint32_t> AsDpRank(const object* o) {
  const auto rank = OptInt(o, "data_parallel_rank");
  if (!rank) return std::nullopt;
  if (*rank < 0 || *rank > UINT32_MAX) Reject(absl::StrCat("dp rank ", *rank, " out of range"));
  return static_cast<uint32_t>(*rank);
}

EngineBatch DecodeBatch(const object& root) {
  EngineBatch batch;
  const object* events = nullptr;
  if (root.type == mtype::ARRAY) {
    const auto items = AsArray(root, "batch");
    if (items.size() < 2) Reject("batch array has fewer than 2 elements");
    batch.timestamp = AsTimestamp(items[0]);
    events = &items[1];
    if (items.size() >= 3) batch.dp_rank = AsDpRank(&items[2]);
  } else if (root.type == mtype::MAP) {
    const std::string_view names[] = {"ts", "events", "data_parallel_rank"};
    const Fields fields(root, names);
    batch.timestamp = AsTimestamp(fields.Require("ts"));
    events = &fields.Require("events");
    batch.dp_rank = AsDpRank(fields.Get("data_parallel_rank"));
    if (!batch.dp_rank) batch.dp_rank = AsDpRank(fields.Get("attn_dp_rank"));
  } else {
    Reject("batch is neither an array nor a map");
  }
  size_t index = 0;
  for (const object& event : AsArray(*events, "events")) {
    try {
      std::string unknown;
      if (std::optional<EngineEvent> decoded = DecodeEvent(event, unknown)) {
        decoded->position = index;
        batch.events.push_back(std::move(*decoded));
      } else {
        batch.skipped.push_back({.event_index = index,
                                 .reason = absl::StrCat("event ", index, ": ", unknown),
                                 .kind = ConversionReject::Kind::kUnknownType});
      }
    } catch (DecodeError& e) {
      e.message = absl::StrCat("event ", index, ": ", e.message);
      throw;
    }
    ++index;
  }
  return batch;
}

// ---- Dynamo's event plane ----------------------------------------------------------------

const object& AsMap(const object& o, const char* what) {
  if (o.type != mtype::MAP) Reject(absl::StrCat(what, " is not a map"));
  return o;
}

uint64_t AsU64(const object& o, const char* what) {
  if (o.type != mtype::POSITIVE_INTEGER) Reject(absl::StrCat(what, " is not an unsigned integer"));
  return o.via.u64;
}

// Dynamo's StorageTier in snake case ("device", "host_pinned", "disk", "external"); engine
// media names mean what they mean elsewhere.
Tier TierOfStorage(std::string_view name) {
  return name == "host_pinned" ? Tier::kHostPinned : TierFromMedium(name);
}

StoredEvent DynamoStored(const object& o) {
  const Fields stored(AsMap(o, "stored"), {});
  StoredEvent out;
  if (const object* parent = stored.Get("parent_hash"); parent != nullptr && !IsNil(*parent)) {
    out.parent_hash = AsHash(*parent, "parent_hash");
  }
  // Each block's tokens_hash is Dynamo's local hash (LoRA, salt and multimodal content already
  // in it; kvrouter's hashing is the same function): no tokens travel.
  for (const object& b : AsArray(stored.Require("blocks"), "blocks")) {
    const Fields block(AsMap(b, "block"), {});
    out.block_hashes.push_back(AsHash(block.Require("block_hash"), "block_hash"));
    out.local_hashes.push_back(AsHash(block.Require("tokens_hash"), "tokens_hash"));
  }
  return out;
}

// One RouterEvent: {worker_id, storage_tier, event: {event_id, data, dp_rank}}, data being
// {"stored": ...}, {"removed": {block_hashes}} or "cleared".
KvEvent DynamoRouterEvent(const object& o) {
  const Fields router_event(AsMap(o, "router event"), {});
  KvEvent out;
  out.worker.worker_id = AsU64(router_event.Require("worker_id"), "worker_id");
  if (auto tier = OptStr(router_event.Get("storage_tier"), "storage_tier")) {
    out.tier = TierOfStorage(*tier);
  }
  const Fields event(AsMap(router_event.Require("event"), "event"), {});
  out.event_id = AsU64(event.Require("event_id"), "event_id");
  if (auto rank = OptInt(event.Get("dp_rank"), "dp_rank")) {
    if (*rank < 0 || *rank > UINT32_MAX) Reject(absl::StrCat("dp_rank ", *rank, " out of range"));
    out.worker.dp_rank = static_cast<uint32_t>(*rank);
  }
  const object& data = event.Require("data");
  if (data.type == mtype::STR) {
    if (AsStr(data, "data") != "cleared") {
      Reject(absl::StrCat("unknown event data '", std::string(AsStr(data, "data")), "'"));
    }
    out.data = ClearedEvent{};
    return out;
  }
  const Fields variant(AsMap(data, "data"), {});
  if (data.via.map.size != 1) Reject("event data has more than one variant");
  if (const object* stored = variant.Get("stored")) {
    out.data = DynamoStored(*stored);
  } else if (const object* removed = variant.Get("removed")) {
    const Fields r(AsMap(*removed, "removed"), {});
    out.data = RemovedEvent{.block_hashes = AsHashes(r.Require("block_hashes"), "block_hashes")};
  } else {
    Reject("unknown event variant (neither stored, removed nor cleared)");
  }
  return out;
}

// msgpack of `bytes`, with limits that keep a garbage header from reserving memory for
// billions of objects: no container can have more elements than there are bytes.
msgpack::object_handle Unpack(std::span<const uint8_t> bytes, const char* what) {
  const size_t n = bytes.size();
  const msgpack::unpack_limit limits(n, n, n, n, n, /*depth=*/32);
  size_t offset = 0;
  msgpack::object_handle handle = msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), n,
                                                  offset, nullptr, nullptr, limits);
  if (offset != n) Reject(absl::StrCat(n - offset, " trailing bytes after the ", what));
  return handle;
}

// The message is not one msgpack value at all (as opposed to msgpack of the wrong shape).
struct NotMsgpack {
  std::string message;
};

DynamoMessage DecodeDynamo(std::span<const uint8_t> message) {
  msgpack::object_handle envelope_handle;
  try {
    envelope_handle = Unpack(message, "envelope");
  } catch (const DecodeError& e) {
    throw NotMsgpack{e.message};
  } catch (const std::bad_alloc&) {  // not bad input: the caller's containment counts the loss
    throw;
  } catch (const std::exception& e) {  // msgpack's own errors (parse_error, ...)
    throw NotMsgpack{e.what()};
  }
  const Fields envelope(AsMap(envelope_handle.get(), "envelope"), {});
  DynamoMessage out;
  out.publisher_id = AsU64(envelope.Require("publisher_id"), "publisher_id");
  out.sequence = AsU64(envelope.Require("sequence"), "sequence");
  if (auto at = OptInt(envelope.Get("published_at"), "published_at")) {
    out.published_at_ms = static_cast<uint64_t>(std::max<int64_t>(0, *at));
  }
  const object& payload = envelope.Require("payload");
  if (payload.type != mtype::BIN) Reject("payload is not bytes");
  const msgpack::object_handle events_handle =
      Unpack(std::span(reinterpret_cast<const uint8_t*>(payload.via.bin.ptr), payload.via.bin.size),
             "payload");
  for (const object& e : AsArray(events_handle.get(), "payload")) {
    out.events.push_back(DynamoRouterEvent(e));
  }
  return out;
}

}  // namespace

absl::StatusOr<DynamoMessage> DecodeDynamoEventPlane(std::span<const uint8_t> message) {
  try {
    return DecodeDynamo(message);
  } catch (const NotMsgpack& e) {
    return absl::DataLossError(absl::StrCat("not msgpack: ", e.message));
  } catch (const DecodeError& e) {
    return absl::InvalidArgumentError(absl::StrCat("Dynamo event plane: ", e.message));
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat("not msgpack: ", e.what()));
  }
}

std::string BlockSizeMismatch(size_t event_index, uint32_t engine_block_size,
                              uint32_t router_block_size) {
  return absl::StrCat(
      "event ", event_index, " has block size ", engine_block_size, "; the router's is ",
      router_block_size, ". Engines must use the router's block size: start SGLang with ",
      "--page-size ", router_block_size, " (its default page size, 1, publishes one-token ",
      "blocks) and vLLM with --block-size ", router_block_size);
}

absl::StatusOr<EngineBatch> DecodeEnginePayload(std::span<const uint8_t> payload) {
  try {
    return DecodeBatch(Unpack(payload, "batch").get());
  } catch (const DecodeError& e) {
    return absl::InvalidArgumentError(absl::StrCat("engine batch: ", e.message));
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("msgpack: ", e.what()));
  }
}

std::optional<uint64_t> MmHashOfIdentifier(std::string_view identifier) {
  if (identifier.empty()) return std::nullopt;
  if (IsHexDigest(identifier)) {
    uint64_t value = 0;
    for (char c : identifier.substr(0, 16)) {
      const int digit = c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
      value = (value << 4) | static_cast<uint64_t>(digit);
    }
    return value;
  }
  return HashBytes({reinterpret_cast<const uint8_t*>(identifier.data()), identifier.size()},
                   /*seed=*/0);
}

std::string_view SaltedBlocks::Of(uint64_t engine_hash) const {
  const auto it = salt_of_.find(engine_hash);
  return it == salt_of_.end() ? std::string_view() : std::string_view(salts_[it->second.salt].text);
}

// The id of `salt`, named first if it is new (in a free slot, or a new one). Refused, nothing
// changed but capacity.
uint32_t SaltedBlocks::IdOf(std::string_view salt) {
  if (auto known = ids_.find(salt); known != ids_.end()) return known->second;
  if (free_.empty()) {
    free_.reserve(salts_.size() + 1);  // so that Release never allocates
    salts_.emplace_back();
    free_.push_back(static_cast<uint32_t>(salts_.size() - 1));
  }
  const uint32_t id = free_.back();
  std::string text(salt);
  ids_.emplace(text, id);
  salts_[id].text = std::move(text);  // moves into an empty string: allocates nothing
  free_.pop_back();
  return id;
}

void SaltedBlocks::Release(uint32_t id) noexcept {
  Salt& salt = salts_[id];
  if (--salt.blocks > 0) return;
  ids_.erase(ids_.find(std::string_view(salt.text)));
  std::string().swap(salt.text);
  free_.push_back(id);  // reserved
}

namespace {
uint8_t TierBit(Tier tier) { return static_cast<uint8_t>(1u << static_cast<unsigned>(tier)); }
}  // namespace

void SaltedBlocks::Record(std::span<const uint64_t> engine_hashes, std::string_view salt,
                          Tier tier) {
  const uint32_t id = IdOf(salt);
  ++salts_[id].blocks;  // held while the blocks are recorded: Release below cannot free it
  for (uint64_t h : engine_hashes) {
    // A refused insert leaves the blocks recorded so far; the salt is released below if it has
    // none.
    try {
      auto [it, added] = salt_of_.try_emplace(h, Block{.salt = id});
      it->second.tiers |= TierBit(tier);
      if (!added) {
        if (it->second.salt == id) continue;
        Release(it->second.salt);
        it->second.salt = id;
      }
      ++salts_[id].blocks;
    } catch (...) {
      Release(id);
      throw;
    }
  }
  Release(id);
}

void SaltedBlocks::Copied(std::span<const uint64_t> engine_hashes, Tier tier) noexcept {
  if (salt_of_.empty()) return;
  for (uint64_t h : engine_hashes) {
    if (const auto it = salt_of_.find(h); it != salt_of_.end()) it->second.tiers |= TierBit(tier);
  }
}

void SaltedBlocks::Forget(std::span<const uint64_t> engine_hashes, Tier tier) noexcept {
  if (salt_of_.empty()) return;
  for (uint64_t h : engine_hashes) {
    const auto it = salt_of_.find(h);
    if (it == salt_of_.end()) continue;
    it->second.tiers &= static_cast<uint8_t>(~TierBit(tier));
    if (it->second.tiers != 0) continue;  // another tier still holds it
    const uint32_t id = it->second.salt;
    salt_of_.erase(it);
    Release(id);
  }
}

void SaltedBlocks::Clear() {
  salt_of_.clear();
  salts_.clear();
  free_.clear();
  ids_.clear();
}

std::optional<uint64_t> DecodeSequence(std::span<const uint8_t> bytes) {
  if (bytes.size() != 8) return std::nullopt;
  uint64_t value = 0;
  for (uint8_t b : bytes) value = (value << 8) | b;
  return value;
}

bool IsFullAttentionKind(std::string_view kind) {
  // vLLM's KVCacheSpecKind: the kinds that keep every block of the prefix (its own indexer
  // takes these three as full attention); MLA models (DeepSeek V2/V3, Kimi K2) store as
  // "mla_attention".
  return kind == "full_attention" || kind == "mla_attention" || kind == "sink_full_attention";
}

KvCacheGroups::Kind KindOfStore(std::string_view kind, std::optional<uint32_t> window_tokens) {
  if (IsFullAttentionKind(kind)) return KvCacheGroups::Kind::kFullAttention;
  // vLLM's SlidingWindowSpec and SlidingWindowMLASpec: both kept by its SlidingWindowManager.
  if ((kind == "sliding_window" || kind == "sliding_window_mla") && window_tokens) {
    return KvCacheGroups::Kind::kSlidingWindow;
  }
  return KvCacheGroups::Kind::kOther;
}

void KvCacheGroups::Record(const Group& group) {
  for (Group& known : groups_) {
    if (known.index == group.index) {
      known = group;
      return;
    }
  }
  if (groups_.size() < kMaxGroups) groups_.push_back(group);
}

bool KvCacheGroups::HasFullAttention() const {
  return std::any_of(groups_.begin(), groups_.end(),
                     [](const Group& g) { return g.kind == Kind::kFullAttention; });
}

std::optional<KvCacheGroups::Group> KvCacheGroups::Find(std::optional<int64_t> group) const {
  if (!group) return std::nullopt;
  for (const Group& known : groups_) {
    if (known.index == *group) return known;
  }
  return std::nullopt;
}

namespace {

// The group `e` is of: a store's by its kind (recorded in `groups`), a removal's (it names its
// group only) or a kindless store's by what `groups` learnt of its group; full attention when
// nothing says otherwise.
KvCacheGroups::Group GroupOf(const EngineEvent& e, KvCacheGroups* groups) {
  if (e.kv_cache_spec_kind) {
    const KvCacheGroups::Group group{.index = e.group_idx.value_or(-1),
                                     .kind = KindOfStore(*e.kv_cache_spec_kind, e.sliding_window),
                                     .window_tokens = e.sliding_window.value_or(0)};
    if (groups != nullptr && e.group_idx) groups->Record(group);
    return group;
  }
  if (groups != nullptr) {
    if (std::optional<KvCacheGroups::Group> known = groups->Find(e.group_idx)) return *known;
  }
  return {.index = e.group_idx.value_or(-1)};
}

}  // namespace

ConvertedBatch ToKvEvents(const EngineBatch& batch, uint64_t worker_id, uint32_t default_dp_rank,
                          uint32_t router_block_size, bool eagle, uint64_t first_event_id,
                          SaltedBlocks* salted, KvCacheGroups* groups) {
  ConvertedBatch out;
  out.skipped_other_groups = ApplyKvEvents(
      batch, worker_id, default_dp_rank, router_block_size, eagle, first_event_id, salted, groups,
      [&](KvEvent& event) { out.events.push_back(std::move(event)); },
      [&](ConversionReject& reject) {
        // The unknown types are the batch's own `skipped`.
        if (reject.kind == ConversionReject::Kind::kBlockSize) {
          out.block_size_mismatches.push_back(std::move(reject));
        }
      });
  return out;
}

size_t ApplyKvEvents(const EngineBatch& batch, uint64_t worker_id, uint32_t default_dp_rank,
                     uint32_t router_block_size, bool eagle, uint64_t first_event_id,
                     SaltedBlocks* salted, KvCacheGroups* groups,
                     absl::FunctionRef<void(KvEvent&)> apply,
                     absl::FunctionRef<void(ConversionReject&)> reject) {
  size_t skipped_other_groups = 0;
  const WorkerKey worker{worker_id, batch.dp_rank.value_or(default_dp_rank)};
  uint64_t event_id = first_event_id;
  size_t next_skipped = 0;
  // The events of unknown types sent before `position`, rejected in their place.
  auto reject_skipped_before = [&](size_t position) {
    for (;
         next_skipped < batch.skipped.size() && batch.skipped[next_skipped].event_index < position;
         ++next_skipped) {
      ConversionReject skipped = batch.skipped[next_skipped];
      reject(skipped);
    }
  };
  // A store at another block size than the router's is rejected; one without tokens has nothing
  // to hash, so no size to check.
  auto rejected_for_block_size = [&](const EngineEvent& e) {
    if (!e.block_size || *e.block_size == router_block_size || e.token_ids.empty()) return false;
    ConversionReject mismatch{
        .event_index = e.position,
        .reason = BlockSizeMismatch(e.position, *e.block_size, router_block_size),
        .kind = ConversionReject::Kind::kBlockSize};
    reject(mismatch);
    return true;
  };
  std::vector<KvEvent> sliding;  // applied after the rest (see the header)
  // A model whose every layer has a sliding window (vLLM gives it one group) has no full-
  // attention blocks to place them by: its events are ignored, as before windows were modelled.
  auto apply_sliding = [&] {
    for (KvEvent& event : sliding) {
      if (groups != nullptr && !groups->HasFullAttention()) {
        ++skipped_other_groups;
        continue;
      }
      event.event_id = event_id++;
      apply(event);
    }
    sliding.clear();
  };
  for (const EngineEvent& e : batch.events) {
    reject_skipped_before(e.position);
    const KvCacheGroups::Group group = GroupOf(e, groups);
    if (group.kind == KvCacheGroups::Kind::kOther) {
      ++skipped_other_groups;
      continue;
    }
    KvEvent event;
    event.worker = worker;
    event.tier = e.tier;
    if (group.kind == KvCacheGroups::Kind::kSlidingWindow && e.kind != EngineEventKind::kCleared) {
      // What a sliding window holds matters on the device only, where a request resumes.
      if (e.tier != Tier::kDevice) {
        ++skipped_other_groups;
        continue;
      }
      if (e.kind == EngineEventKind::kStored) {
        if (rejected_for_block_size(e)) continue;
        SlidingStoredEvent stored;
        stored.group = group.index;
        stored.window_tokens = group.window_tokens;
        stored.block_hashes = e.block_hashes;
        event.data = std::move(stored);
      } else {
        event.data = SlidingRemovedEvent{.group = group.index, .block_hashes = e.block_hashes};
      }
      sliding.push_back(std::move(event));
      continue;
    }
    // The windows' blocks stored before a clear go before it, not onto what follows it.
    if (e.kind == EngineEventKind::kCleared) apply_sliding();
    event.event_id = event_id++;
    switch (e.kind) {
      case EngineEventKind::kStored: {
        if (rejected_for_block_size(e)) continue;
        StoredEvent stored;
        stored.parent_hash = e.parent_hash;
        stored.block_hashes = e.block_hashes;
        stored.token_ids = e.token_ids;  // no local hashes: the router hashes the tokens
        stored.block_mm_hashes = e.block_mm_hashes;
        stored.lora_name = e.lora_name.value_or("");
        stored.eagle = eagle || e.bigram;
        if (e.cache_salt) {
          stored.cache_namespace = *e.cache_salt;
        } else if (salted != nullptr && e.parent_hash) {
          stored.cache_namespace = salted->Of(*e.parent_hash);
        }
        if (salted != nullptr && !e.token_ids.empty() && !stored.cache_namespace.empty()) {
          salted->Record(e.block_hashes, stored.cache_namespace, e.tier);
        } else if (salted != nullptr && e.token_ids.empty()) {
          salted->Copied(e.block_hashes, e.tier);  // a copy of held blocks to another tier
        }
        event.data = std::move(stored);
        break;
      }
      case EngineEventKind::kRemoved:
        // The salts of the blocks it removes are the caller's to forget (SaltedBlocks): a
        // removal of one of two copies leaves the block, and its salt with it.
        event.data = RemovedEvent{.block_hashes = e.block_hashes};
        break;
      case EngineEventKind::kCleared:
        if (salted != nullptr) salted->Clear();
        event.data = ClearedEvent{};
        break;
    }
    apply(event);
  }
  reject_skipped_before(SIZE_MAX);
  apply_sliding();
  return skipped_other_groups;
}

}  // namespace kvrouter

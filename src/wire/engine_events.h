// Decoding of the KV events vLLM and SGLang publish over ZMQ (shared/reference/workloads.md
// §3-§4): multipart messages [topic, 8-byte big-endian sequence, msgpack(EventBatch)].
//
// The payload layout changed under its consumers several times, so the decoder accepts every
// known form: the outer batch as a positional array ([ts, events] or [ts, events, dp_rank]) or
// a map ({ts, events, data_parallel_rank}); each event as a positional array whose element 0 is
// the tag, or a map with a "type" key; trailing fields missing or extra; block hashes as
// unsigned or signed integers (SGLang's are signed int64) or raw digest bytes (vLLM with
// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the last 8 bytes, big-endian, which is what the
// integer form of the same digest would be). Pure functions: no sockets, no router.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "core/id_hash.h"
#include "core/types.h"

namespace kvrouter {

enum class EngineEventKind : uint8_t { kStored, kRemoved, kCleared };

// One event as the engine said it, before it is turned into a router event.
struct EngineEvent {
  EngineEventKind kind = EngineEventKind::kCleared;
  std::vector<uint64_t> block_hashes;    // signed hashes reinterpreted as two's complement
  std::optional<uint64_t> parent_hash;   // stored only
  std::vector<uint32_t> token_ids;       // stored only
  std::optional<uint32_t> block_size;    // stored only, when the engine said
  std::optional<std::string> medium;     // as sent; missing = device
  std::optional<std::string> lora_name;  // vLLM >= #27577
  std::optional<int64_t> lora_id;
  std::optional<int64_t> group_idx;  // KV-cache group in hybrid models
  // The cache salt the engine folded into these blocks' identity: SGLang's metadata map
  // ({"cache_salt": ...}, every page of a salted request), or read from vLLM's extra_keys
  // (first block of a request only; see SaltFromExtraKeys). Becomes the router's namespace.
  std::optional<std::string> cache_salt;
  // vLLM: per block, the bare string members of its extra_keys tuple (LoRA name, cache salt,
  // legacy multimodal identifiers); empty when the engine sent none.
  std::vector<std::vector<std::string>> extra_keys;
  // vLLM: per block, the multimodal items its extra_keys name, as Dynamo's routing hashes
  // (MmHashOfIdentifier); empty when none. They enter that block's local hash.
  std::vector<std::vector<uint64_t>> block_mm_hashes;
  // SGLang with EAGLE: token_ids came as bigram pairs [[t0,t1],[t1,t2],...] and were unfolded
  // to t0, t1, ..., tn (each block one look-ahead token longer: the router's eagle window).
  bool bigram = false;
  std::optional<std::string> kv_cache_spec_kind;  // hybrid models: IsFullAttentionKind indexes
  std::optional<uint32_t> sliding_window;         // kv_cache_spec_sliding_window: tokens, > 0
  Tier tier = Tier::kDevice;                      // TierFromMedium(medium)
  // Its index among the batch's events as sent, those skipped included (what rejects name).
  size_t position = 0;
};

// Why an engine event is not applied: of a type this decoder does not know (a newer engine's),
// or stored at a block size the router does not index.
struct ConversionReject {
  enum class Kind : uint8_t { kUnknownType, kBlockSize };
  size_t event_index = 0;  // among the batch's events as sent (EngineEvent::position)
  std::string reason;      // e.g. "event 1: unknown event tag 'BlockUpdated'"
  Kind kind = Kind::kUnknownType;
};

struct EngineBatch {
  double timestamp = 0;
  std::optional<uint32_t> dp_rank;  // absent in the oldest layouts, or nil
  std::vector<EngineEvent> events;
  // Events of a type this decoder does not know (a newer engine's), left out of `events`, in
  // order (kUnknownType). The others still apply.
  std::vector<ConversionReject> skipped;
};

// Decodes one msgpack EventBatch payload. InvalidArgument (naming what is wrong) for garbage
// or a shape no known version produces, including a known event of the wrong shape. An event
// with an unknown tag is skipped (EngineBatch::skipped), not the batch. A refused allocation
// is no verdict on the bytes: std::bad_alloc propagates, for the caller to count the message
// lost (as it does when applying it is refused).
absl::StatusOr<EngineBatch> DecodeEnginePayload(std::span<const uint8_t> payload);

// Dynamo's routing hash of a multimodal identifier from vLLM's extra_keys: a 64-character hex
// digest (vLLM's own processor) is its first 16 hex digits; any other non-empty identifier is
// XXH3-64 of its bytes (seed 0). Queries pass the same values as kvr_hash_options.mm_hashes.
std::optional<uint64_t> MmHashOfIdentifier(std::string_view identifier);

// The 8-byte big-endian sequence number of a ZMQ message; nullopt unless exactly 8 bytes.
std::optional<uint64_t> DecodeSequence(std::span<const uint8_t> bytes);

// Why a stored event of `engine_block_size` is not indexed by a router of `router_block_size`,
// and how to run SGLang and vLLM so that it is.
std::string BlockSizeMismatch(size_t event_index, uint32_t engine_block_size,
                              uint32_t router_block_size);

struct ConvertedBatch {
  std::vector<KvEvent> events;
  std::vector<ConversionReject> block_size_mismatches;
  // Events of a KV-cache group neither full attention nor a sliding window (hybrid models):
  // not indexed.
  size_t skipped_other_groups = 0;
};

// vLLM folds a request's cache salt into the identity of its first block only (the others
// inherit it through the parent chain), so a store that continues a salted sequence carries no
// salt. The router's namespace salts every block (as Dynamo's does), so each publisher
// remembers which of its engine blocks were stored salted, and a continuation takes its
// parent's salt. Only salted blocks are kept, with the tiers that hold them, and only the salts
// some kept block has: a block is forgotten when it leaves its last tier (a block offloaded to
// the host keeps its salt for when it is loaded back), and a clear forgets them all. The caller
// forgets the blocks a removal takes (Forget): a removal of one of several copies of a block on
// one tier (engine_subscription's BlockCopies) leaves it, salt and all, so ToKvEvents, which
// cannot tell, forgets nothing.
class SaltedBlocks {
 public:
  // The salt block `engine_hash` was stored under; empty if none is known.
  std::string_view Of(uint64_t engine_hash) const;
  // The blocks were stored on `tier` under `salt`.
  void Record(std::span<const uint64_t> engine_hashes, std::string_view salt, Tier tier);
  // The blocks were copied to `tier` (a store without tokens): those with a salt keep it while
  // that copy stays. Allocates nothing.
  void Copied(std::span<const uint64_t> engine_hashes, Tier tier) noexcept;
  // The blocks left `tier`. Allocates nothing.
  void Forget(std::span<const uint64_t> engine_hashes, Tier tier) noexcept;
  void Clear();
  size_t size() const { return salt_of_.size(); }
  // Distinct salts held: those of the blocks kept, no more.
  size_t salts() const { return ids_.size(); }

 private:
  struct Salt {
    std::string text;
    uint64_t blocks = 0;  // in salt_of_; a free slot has none
  };
  uint32_t IdOf(std::string_view salt);
  void Release(uint32_t id) noexcept;

  struct Block {
    uint32_t salt = 0;  // index in salts_
    uint8_t tiers = 0;  // bit 1 << tier for each tier that holds it
  };
  // Not absl's tables: one refused growth corrupts them (core/fail_safe_map.h); a single insert
  // into libstdc++'s is all or nothing.
  std::unordered_map<uint64_t, Block> salt_of_;  // engine hash -> its salt, its tiers
  std::vector<Salt> salts_;
  std::vector<uint32_t> free_;  // slots of salts_ no block has; room for every slot reserved
  std::unordered_map<std::string, uint32_t, IdHash, std::equal_to<>> ids_;
};

// Whether a store of this kv_cache_spec_kind holds full-attention blocks, which the router
// indexes: "full_attention", "mla_attention" (DeepSeek-style models), "sink_full_attention".
// The others (sliding windows, chunked local attention, Mamba state, cross attention, unknown
// kinds) keep only part of a prefix.
bool IsFullAttentionKind(std::string_view kind);

// The KV-cache groups of a hybrid model (full attention, sliding window, Mamba state) a
// publisher's stores named, and what the router does with each. vLLM publishes every group's
// blocks under the same hashes, and its removals name their group by index only (BlockRemoved
// has group_idx, not the kind): a sliding-window group evicts its copy of a block long before
// the full-attention group does, and that removal must not take the indexed block. A removal
// of a group not seen in a store is applied as full attention's (a model without groups, or a
// store not heard).
class KvCacheGroups {
 public:
  // Groups remembered at most (an engine has a handful; garbage must not grow this).
  static constexpr size_t kMaxGroups = 64;
  enum class Kind : uint8_t {
    kFullAttention,  // indexed (IsFullAttentionKind)
    kSlidingWindow,  // its blocks limit the full-attention hit (SlidingStoredEvent)
    kOther,          // not indexed: chunked local attention, Mamba state, unknown kinds, ...
  };
  struct Group {
    int64_t index = 0;
    Kind kind = Kind::kFullAttention;
    uint32_t window_tokens = 0;  // kSlidingWindow only
  };
  // A store of this group was heard.
  void Record(const Group& group);
  // What a store said of `group`; nullopt if none did (or `group` is nullopt).
  std::optional<Group> Find(std::optional<int64_t> group) const;
  // Whether a store said some group is full attention.
  bool HasFullAttention() const;
  void Clear() { groups_.clear(); }

 private:
  std::vector<Group> groups_;  // a few: searched in order
};

// How a store of this kind (and window) is taken: full attention; a sliding window ("sliding_
// window", "sliding_window_mla") when the engine said the window; else other.
KvCacheGroups::Kind KindOfStore(std::string_view kind, std::optional<uint32_t> window_tokens);

// One message of Dynamo's KV event plane, as dynamo.llm.KvEventPublisher (ai-dynamo-runtime
// 1.6.1) publishes it on NATS subject namespace.<ns>.component.<c>.endpoint.<e>.kv-events: a
// msgpack map {publisher_id, sequence, published_at (ms), topic, payload}, the payload the
// msgpack bytes of an array of RouterEvents {worker_id, storage_tier, residency_domain,
// event: {event_id, data, dp_rank}} whose data is {"stored": {parent_hash, start_position,
// blocks: [{block_hash, tokens_hash, mm_extra_info}]}}, {"removed": {block_hashes}} or
// "cleared". Stored blocks carry Dynamo's local hash (tokens_hash), never tokens.
struct DynamoMessage {
  uint64_t publisher_id = 0;
  uint64_t sequence = 0;  // per publisher, from 0
  uint64_t published_at_ms = 0;
  std::vector<KvEvent> events;
};

// DataLoss when `message` is not one msgpack value; InvalidArgument, naming what is wrong, for
// msgpack of another shape. std::bad_alloc propagates (as DecodeEnginePayload's).
absl::StatusOr<DynamoMessage> DecodeDynamoEventPlane(std::span<const uint8_t> message);

// Router events of `batch` for `worker_id`. The rank is the batch's dp rank when it has one,
// else `default_dp_rank` (the publisher's socket; the engine subscription drops a batch that
// names another rank than its socket's before it gets here). Stored events carry token ids and no
// local hashes, so the router computes its own hashes from the tokens (dual key: engine hashes link
// blocks, local hashes match prompts). A stored event announcing a block size other than
// `router_block_size` is not converted but listed as a mismatch. `eagle`: the model's blocks
// use eagle windows (each block's tokens include one look-ahead token, the bigram form); bigram
// token pages (EngineEvent::bigram) are eagle windows whatever `eagle` says. A stored event's
// cache salt becomes the router event's cache namespace; `salted` (the publisher's memory, may
// be null) lends a continuation its parent's salt. A store without tokens (vLLM's offloading
// connector) is applied as a copy to its tier of blocks the worker already holds. Events of a
// sliding-window KV-cache group become SlidingStoredEvent and SlidingRemovedEvent, after the
// batch's other events (a batch stores a block's sliding-window copy before its full-attention
// one, and the sliding store is placed by the latter); events of the other groups that are not
// full attention are left out (stores by their kind; removals by their group, as `groups`, the
// publisher's memory, may be null, knows it).
ConvertedBatch ToKvEvents(const EngineBatch& batch, uint64_t worker_id, uint32_t default_dp_rank,
                          uint32_t router_block_size, bool eagle, uint64_t first_event_id,
                          SaltedBlocks* salted = nullptr, KvCacheGroups* groups = nullptr);

// As ToKvEvents, handing each event to `apply` as soon as it is converted, before the next one
// is (what applying it does to `salted`, a removal's Forget, then comes before the next event's
// conversion reads and records salts, in the batch's order; sliding-window events last, in
// their order), and each event not applied (a
// block size mismatch, or one of EngineBatch::skipped) to `reject` where it stands among them,
// so that a caller counting rejects as they come names the batch's last one last. Returns the
// events of other KV-cache groups, which are not indexed (by design: not rejects).
size_t ApplyKvEvents(const EngineBatch& batch, uint64_t worker_id, uint32_t default_dp_rank,
                     uint32_t router_block_size, bool eagle, uint64_t first_event_id,
                     SaltedBlocks* salted, KvCacheGroups* groups,
                     absl::FunctionRef<void(KvEvent&)> apply,
                     absl::FunctionRef<void(ConversionReject&)> reject);

}  // namespace kvrouter

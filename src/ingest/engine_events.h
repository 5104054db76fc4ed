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
#include <vector>

#include "absl/status/statusor.h"
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
  std::optional<int64_t> group_idx;       // KV-cache group in hybrid models
  std::optional<std::string> cache_salt;  // SGLang's trailing metadata map
  // vLLM: per block, the string members of its extra_keys tuple (LoRA name, cache salt, ...);
  // empty when the engine sent none. Kept for inspection; they do not enter local hashes.
  std::vector<std::vector<std::string>> extra_keys;
  std::optional<std::string> kv_cache_spec_kind;  // hybrid models: only "full_attention" indexes
  Tier tier = Tier::kDevice;                      // TierFromMedium(medium)
};

struct EngineBatch {
  double timestamp = 0;
  std::optional<uint32_t> dp_rank;  // absent in the oldest layouts, or nil
  std::vector<EngineEvent> events;
};

// Decodes one msgpack EventBatch payload. InvalidArgument (naming what is wrong) for garbage,
// a shape no known version produces, or an unknown event tag.
absl::StatusOr<EngineBatch> DecodeEnginePayload(std::span<const uint8_t> payload);

// The 8-byte big-endian sequence number of a ZMQ message; nullopt unless exactly 8 bytes.
std::optional<uint64_t> DecodeSequence(std::span<const uint8_t> bytes);

// Why an engine event cannot become a router event.
struct ConversionReject {
  size_t event_index = 0;
  std::string reason;
};

struct ConvertedBatch {
  std::vector<KvEvent> events;
  std::vector<ConversionReject> block_size_mismatches;
  // Events of a KV-cache group other than full attention (hybrid models): not indexed.
  size_t skipped_other_groups = 0;
};

// Router events of `batch` for `worker_id`. The rank is the batch's dp rank when it has one,
// else `default_dp_rank` (the publisher's socket). Stored events carry token ids and no local
// hashes, so the router computes its own hashes from the tokens (dual key: engine hashes link
// blocks, local hashes match prompts). A stored event announcing a block size other than
// `router_block_size` is not converted but listed as a mismatch. `eagle`: the model's blocks
// use eagle windows (each block's tokens include one look-ahead token, the bigram form).
ConvertedBatch ToKvEvents(const EngineBatch& batch, uint64_t worker_id, uint32_t default_dp_rank,
                          uint32_t router_block_size, bool eagle, uint64_t first_event_id);

}  // namespace kvrouter

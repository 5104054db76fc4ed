// Vocabulary shared by every part of the core: who holds a block (a worker's data-parallel
// rank), where it is held (a storage tier), and the KV events engines publish.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace kvrouter {

// One data-parallel rank of one worker: the unit every index and load tracker keys on.
struct WorkerKey {
  uint64_t worker_id = 0;
  uint32_t dp_rank = 0;

  friend bool operator==(const WorkerKey&, const WorkerKey&) = default;
  friend auto operator<=>(const WorkerKey&, const WorkerKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const WorkerKey& w) {
    return H::combine(std::move(h), w.worker_id, w.dp_rank);
  }
};

// Where a cached block lives. Lower tiers are worth less: their blocks must be copied back to
// the device before use. The order is the order in which matching continues (§2.6).
enum class Tier : uint8_t { kDevice = 0, kHostPinned = 1, kDisk = 2, kExternal = 3 };
inline constexpr int kNumTiers = 4;

// Engine "medium" strings (case-insensitive): GPU/DEVICE -> device; CPU/CPU_PINNED/CPU_TIER1
// -> host pinned; CPU_TIER2/DISK/NVME/STORAGE -> disk; EXTERNAL/NETWORK/REMOTE/SHARED/
// SHARED_STORAGE -> external.
// Anything else, including an empty or missing medium, is the device (as in Dynamo).
Tier TierFromMedium(std::string_view medium);
constexpr std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kHostPinned:
      return "host_pinned";
    case Tier::kDisk:
      return "disk";
    case Tier::kExternal:
      return "external";
  }
  return "unknown";
}

// Blocks newly cached by one worker, consecutive along one sequence.
struct StoredEvent {
  // Engine hash of the block before the first one; none when the first block starts a prompt.
  std::optional<uint64_t> parent_hash;
  // The engine's own hash of every block: opaque, used only to find parents and apply removals.
  std::vector<uint64_t> block_hashes;
  // The router's local hash of every block, when the publisher computed them. When empty, they
  // are computed from token_ids (block_size tokens per block, one more in eagle mode) with the
  // options below.
  std::vector<uint64_t> local_hashes;
  std::vector<uint32_t> token_ids;
  std::vector<std::vector<uint64_t>> block_mm_hashes;
  std::string lora_name;
  std::string cache_namespace;
  bool eagle = false;
};

// Blocks evicted by one worker, by engine hash.
struct RemovedEvent {
  std::vector<uint64_t> block_hashes;
};

// Every block of the event's data-parallel rank is gone (e.g. a prefix-cache reset); the
// worker's other ranks keep theirs.
struct ClearedEvent {};

// Blocks one sliding-window KV-cache group of a hybrid model (Gemma-2/3, gpt-oss, Mistral with
// interleaved windows: layers that attend to the last `window_tokens` tokens only) now holds
// for a worker rank, by engine hash. The engine keeps a block in such a group only while some
// request's window may need it, so a prefix is cached there only where the group also holds
// the blocks just before the hit point (SlidingWindows). Each block is one the rank holds in
// full attention (its place in the tree is found by its engine hash), unless sequence_hashes
// gives the blocks' sequence hashes (hashing.h), as a dump does.
struct SlidingStoredEvent {
  int64_t group = 0;           // the engine's KV-cache group index
  uint32_t window_tokens = 0;  // the group's window; > 0
  std::vector<uint64_t> block_hashes;
  std::vector<uint64_t> sequence_hashes;  // empty, or one per block hash
};

// Blocks a sliding-window group evicted, by engine hash.
struct SlidingRemovedEvent {
  int64_t group = 0;
  std::vector<uint64_t> block_hashes;
};

struct KvEvent {
  WorkerKey worker;
  Tier tier = Tier::kDevice;
  uint64_t event_id = 0;
  std::variant<StoredEvent, RemovedEvent, ClearedEvent, SlidingStoredEvent, SlidingRemovedEvent>
      data;
};

}  // namespace kvrouter

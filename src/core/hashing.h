// Dynamo-compatible block hashing (reference: shared/reference/dynamo-router.md §1).
//
// A prompt is cut into complete blocks of `block_size` tokens (a trailing partial block is
// ignored). Each block gets a *local* hash: XXH3-64 over its tokens as little-endian u32,
// followed by the block's multimodal hashes (sorted, little-endian u64), with a seed of 1337
// salted by the LoRA adapter name and the cache namespace. In eagle mode a block's window is
// one token longer (block_size + 1) but blocks still start every block_size tokens. Local
// hashes are chained into *sequence* hashes, which identify a whole prefix.
//
// Every function here is pure and thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace kvrouter {

inline constexpr uint64_t kHashSeed = 1337;

// Per-request inputs that change a block's local hash.
struct BlockHashOptions {
  std::string_view lora_name;        // empty = base model
  std::string_view cache_namespace;  // empty = no namespace
  bool eagle = false;                // window of block_size + 1 tokens
  // Multimodal hashes per block index. A block past the end, or with an empty list, has none.
  std::span<const std::vector<uint64_t>> block_mm_hashes;
};

// XXH3-64 of raw bytes with Dynamo's seed.
uint64_t HashBytes(std::span<const uint8_t> bytes, uint64_t seed = kHashSeed);

// The seed used for local block hashes: 1337 + XXH3(lora, 0) + XXH3(namespace, 1), wrapping;
// an empty name adds nothing.
uint64_t LocalHashSeed(std::string_view lora_name, std::string_view cache_namespace);

// Number of complete blocks `num_tokens` tokens make.
size_t NumCompleteBlocks(size_t num_tokens, uint32_t block_size, bool eagle);

// Local hashes of every complete block. block_size == 0 yields no blocks.
std::vector<uint64_t> ComputeLocalBlockHashes(std::span<const uint32_t> tokens, uint32_t block_size,
                                              const BlockHashOptions& options = {});

// Same, appending into `out` (cleared first) so hot paths can reuse its capacity.
void ComputeLocalBlockHashesInto(std::span<const uint32_t> tokens, uint32_t block_size,
                                 const BlockHashOptions& options, std::vector<uint64_t>& out);

// Local hash of exactly one block whose tokens are `block_tokens` (its whole window).
uint64_t ComputeBlockHash(std::span<const uint32_t> block_tokens, uint64_t seed,
                          std::span<const uint64_t> mm_hashes = {});

// seq[0] = local[0]; seq[i] = XXH3-64(LE64(seq[i-1]) || LE64(local[i]), 1337).
uint64_t NextSequenceHash(uint64_t previous_sequence_hash, uint64_t local_hash);
std::vector<uint64_t> ComputeSequenceHashes(std::span<const uint64_t> local_hashes);
void ComputeSequenceHashesInto(std::span<const uint64_t> local_hashes, std::vector<uint64_t>& out);

}  // namespace kvrouter

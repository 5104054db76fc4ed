#include "core/hashing.h"

#include <algorithm>
#include <bit>
#include <cstring>

// Header-only mode lets the compiler inline XXH3 for the 64-byte inputs a 16-token block makes;
// a call into the shared libxxhash costs more than the hash itself at that size.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvrouter {
namespace {

constexpr uint64_t kLoraSaltSeed = 0;
constexpr uint64_t kNamespaceSaltSeed = 1;

uint64_t HashString(std::string_view s, uint64_t seed) {
  return XXH3_64bits_withSeed(s.data(), s.size(), seed);
}

void AppendLe32(std::vector<uint8_t>& buf, uint32_t v) {
  for (int i = 0; i < 4; ++i) buf.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

void AppendLe64(std::vector<uint8_t>& buf, uint64_t v) {
  for (int i = 0; i < 8; ++i) buf.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// Tokens are hashed as little-endian u32. On little-endian hosts the token array already has
// that layout, so it is hashed in place without a copy.
uint64_t HashTokensInPlace(std::span<const uint32_t> tokens, uint64_t seed) {
  if constexpr (std::endian::native == std::endian::little) {
    return XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(), seed);
  } else {
    std::vector<uint8_t> buf;
    buf.reserve(tokens.size_bytes());
    for (uint32_t t : tokens) AppendLe32(buf, t);
    return XXH3_64bits_withSeed(buf.data(), buf.size(), seed);
  }
}

}  // namespace

uint64_t HashBytes(std::span<const uint8_t> bytes, uint64_t seed) {
  return XXH3_64bits_withSeed(bytes.data(), bytes.size(), seed);
}

uint64_t LocalHashSeed(std::string_view lora_name, std::string_view cache_namespace) {
  uint64_t seed = kHashSeed;
  if (!lora_name.empty()) seed += HashString(lora_name, kLoraSaltSeed);
  if (!cache_namespace.empty()) seed += HashString(cache_namespace, kNamespaceSaltSeed);
  return seed;
}

size_t NumCompleteBlocks(size_t num_tokens, uint32_t block_size, bool eagle) {
  if (block_size == 0) return 0;
  if (!eagle) return num_tokens / block_size;
  return num_tokens == 0 ? 0 : (num_tokens - 1) / block_size;
}

uint64_t ComputeBlockHash(std::span<const uint32_t> block_tokens, uint64_t seed,
                          std::span<const uint64_t> mm_hashes) {
  if (mm_hashes.empty()) return HashTokensInPlace(block_tokens, seed);
  std::vector<uint64_t> sorted(mm_hashes.begin(), mm_hashes.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<uint8_t> buf;
  buf.reserve(block_tokens.size_bytes() + sorted.size() * 8);
  for (uint32_t t : block_tokens) AppendLe32(buf, t);
  for (uint64_t h : sorted) AppendLe64(buf, h);
  return XXH3_64bits_withSeed(buf.data(), buf.size(), seed);
}

void ComputeLocalBlockHashesInto(std::span<const uint32_t> tokens, uint32_t block_size,
                                 const BlockHashOptions& options, std::vector<uint64_t>& out) {
  out.clear();
  const size_t n = NumCompleteBlocks(tokens.size(), block_size, options.eagle);
  out.reserve(n);
  const uint64_t seed = LocalHashSeed(options.lora_name, options.cache_namespace);
  const size_t window = block_size + (options.eagle ? 1 : 0);
  for (size_t i = 0; i < n; ++i) {
    auto block = tokens.subspan(i * block_size, window);
    std::span<const uint64_t> mm;
    if (i < options.block_mm_hashes.size()) mm = options.block_mm_hashes[i];
    out.push_back(ComputeBlockHash(block, seed, mm));
  }
}

std::vector<uint64_t> ComputeLocalBlockHashes(std::span<const uint32_t> tokens, uint32_t block_size,
                                              const BlockHashOptions& options) {
  std::vector<uint64_t> out;
  ComputeLocalBlockHashesInto(tokens, block_size, options, out);
  return out;
}

uint64_t NextSequenceHash(uint64_t previous_sequence_hash, uint64_t local_hash) {
  // 16 bytes: LE64(previous) || LE64(local). The chain is a serial dependency, so the packing
  // must stay off it: on little-endian hosts it is two plain stores.
  uint64_t words[2] = {previous_sequence_hash, local_hash};
  if constexpr (std::endian::native != std::endian::little) {
    words[0] = __builtin_bswap64(words[0]);
    words[1] = __builtin_bswap64(words[1]);
  }
  uint8_t buf[16];
  std::memcpy(buf, words, sizeof(buf));
  return XXH3_64bits_withSeed(buf, sizeof(buf), kHashSeed);
}

void ComputeSequenceHashesInto(std::span<const uint64_t> local_hashes, std::vector<uint64_t>& out) {
  out.clear();
  out.reserve(local_hashes.size());
  for (size_t i = 0; i < local_hashes.size(); ++i) {
    out.push_back(i == 0 ? local_hashes[0] : NextSequenceHash(out.back(), local_hashes[i]));
  }
}

std::vector<uint64_t> ComputeSequenceHashes(std::span<const uint64_t> local_hashes) {
  std::vector<uint64_t> out;
  ComputeSequenceHashesInto(local_hashes, out);
  return out;
}

}  // namespace kvrouter

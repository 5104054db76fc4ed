// Block hashing and tiers through the C ABI.
#include "core/hashing.h"

#include "capi_internal.h"

using namespace kvrouter::capi;

extern "C" {

KVR_API kvr_tier kvr_tier_from_medium(const char* medium) {
  return static_cast<kvr_tier>(kvrouter::TierFromMedium(OrEmpty(medium)));
}

KVR_API kvr_status kvr_hash_options_init(kvr_hash_options* options, size_t size) {
  return InitVersioned(options, size);
}

KVR_API kvr_status kvr_compute_block_hashes(const uint32_t* tokens, size_t num_tokens,
                                            uint32_t block_size, const kvr_hash_options* opts,
                                            uint64_t* out, size_t cap, size_t* len,
                                            kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckArray(err, tokens, num_tokens, "tokens")) return s;
    if (block_size == 0) return Fail(err, KVR_INVALID_ARGUMENT, "block_size must be > 0");
    kvr_hash_options options;
    if (kvr_status s = ReadVersioned(err, opts, options)) return s;
    if (kvr_status s = CheckFlags(err, options.flags, kKnownHashFlags, "kvr_hash_options.flags")) {
      return s;
    }
    std::vector<std::vector<uint64_t>> mm;
    if (kvr_status s =
            ReadMmHashes(err, options.mm_hashes, options.mm_counts, options.mm_num_blocks, mm)) {
      return s;
    }
    // The output's size is known from the counts: a short buffer is refused before hashing.
    const size_t needed =
        kvrouter::NumCompleteBlocks(num_tokens, block_size, (options.flags & KVR_HASH_EAGLE) != 0);
    if (kvr_status s = RefuseShortBuffer(err, needed, out, cap, len, "block hashes")) return s;
    kvrouter::BlockHashOptions hash_options{.lora_name = OrEmpty(options.lora_name),
                                            .cache_namespace = OrEmpty(options.cache_namespace),
                                            .eagle = (options.flags & KVR_HASH_EAGLE) != 0,
                                            .block_mm_hashes = mm};
    const auto hashes =
        kvrouter::ComputeLocalBlockHashes(std::span(tokens, num_tokens), block_size, hash_options);
    return CopyOut(err, hashes, out, cap, len, "block hashes");
  });
}

KVR_API kvr_status kvr_compute_sequence_hashes(const uint64_t* local_hashes, size_t num_hashes,
                                               uint64_t* out, size_t cap, size_t* len,
                                               kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckArray(err, local_hashes, num_hashes, "local_hashes")) return s;
    // One hash per local hash: a short buffer is refused before hashing.
    if (kvr_status s = RefuseShortBuffer(err, num_hashes, out, cap, len, "sequence hashes")) {
      return s;
    }
    const auto hashes = kvrouter::ComputeSequenceHashes(std::span(local_hashes, num_hashes));
    return CopyOut(err, hashes, out, cap, len, "sequence hashes");
  });
}

}  // extern "C"

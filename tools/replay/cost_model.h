// The simulated engine's cost model: how long one continuous-batching step takes.
//
// Reference hardware and model: one NVIDIA H100 SXM 80 GB serving Llama-3.1-8B in bf16 with a
// vLLM-like engine (chunked prefill, prefix caching, 16-token blocks). Every constant below is a
// back-of-the-envelope figure from public specifications, not a measurement; together they give
// the right orders of magnitude (prefill ~25 k tokens/s, decode step ~6 ms at batch 1), which is
// what comparing routing policies needs. To model other setups, override them with the replay's
// flags of the same names (--step_overhead_s, --prefill_per_token_s, ...).
//
// One step serves every running sequence that is decoding (one token each) and spends the rest of
// the token budget (max_num_batched_tokens) on prefill chunks. Its duration is
//
//   step = step_overhead
//        + prefill_per_token       · prefill_tokens                  (GEMMs: linear in new tokens)
//        + attention_per_pair      · Σ_chunks n·(c + (n+1)/2)        (each new token attends to
//                                                                     its whole context)
//        + decode_per_sequence     · decode_sequences
//        + decode_per_context_token· Σ_decoding context lengths      (KV cache reads)
//
// where a chunk computes n new tokens after c tokens that were already cached or computed.
// Sources of the defaults:
//   step_overhead 6 ms: reading 16 GB of weights at 3.35 TB/s is 4.8 ms, plus ~1 ms of
//     scheduling and kernel launches (measured vLLM decode steps at batch 1 are 6-8 ms).
//   prefill_per_token 40 µs: 2 × 8.0 G parameters = 16 GFLOP per token at ~400 TFLOP/s
//     (about 40 % of the H100's 989 dense bf16 TFLOP/s) ≈ 25 k tokens/s.
//   attention_per_pair 1.3 ns: 4 × 32 layers × 4096 = 524 kFLOP per (query, key) pair at
//     ~400 TFLOP/s.
//   decode_per_sequence 50 µs: sampling and per-sequence bookkeeping.
//   decode_per_context_token 40 ns: 128 KiB of K and V per token (2 × 32 layers × 8 KV heads ×
//     128 dims × 2 bytes) read at 3.35 TB/s.
//   KV capacity 25,000 blocks of 16 tokens (400 k tokens): 0.9 × 80 GB minus 16 GB of weights
//     and ~5 GB of activations leaves ~51 GB, at 128 KiB per token.
//   max_num_batched_tokens 8192 and max_num_seqs 256: vLLM's defaults for an API server.
//   host_reload_per_block 41.9 µs (with a host tier, --host_capacity_blocks): copying one
//     16-token block back from host memory, 16 × 128 KiB = 2 MiB at ~50 GB/s (PCIe Gen5 x16);
//     other block sizes scale it (2.62 µs per token) unless --host_reload_per_block_s is given.
//     Charged to the step that admits the request, serially (a real engine overlaps part of it).
#pragma once

#include <cstdint>

namespace kvrouter::replay {

// Seconds to copy one token's KV (128 KiB) from host memory to the GPU at ~50 GB/s.
inline constexpr double kHostReloadPerTokenS = 2.62e-6;

struct CostModel {
  double step_overhead_s = 6e-3;
  double prefill_per_token_s = 40e-6;
  double attention_per_pair_s = 1.3e-9;
  double decode_per_sequence_s = 50e-6;
  double decode_per_context_token_s = 40e-9;
  double host_reload_per_block_s = 16 * kHostReloadPerTokenS;
};

// Tokens of KV cache one worker holds by default (see above); divided by the block size it is
// the default --kv_capacity_blocks.
inline constexpr uint64_t kDefaultKvCapacityTokens = 400'000;

// What one step does; the engine fills it while composing the batch.
struct StepShape {
  uint64_t prefill_tokens = 0;
  double attention_pairs = 0;  // Σ over chunks of AttentionPairs(n, c)
  uint64_t decode_sequences = 0;
  uint64_t decode_context_tokens = 0;
  uint64_t reload_blocks = 0;  // copied back from the host tier
};

// (query, key) pairs of causal attention when n new tokens follow c earlier ones.
double AttentionPairs(uint64_t new_tokens, uint64_t context_before);

// Seconds of one step.
double StepSeconds(const CostModel& model, const StepShape& shape);

// Seconds to prefill n new tokens after c cached ones in a step of its own (no decodes): what
// the cost model charges a request that has the GPU to itself.
double IsolatedPrefillSeconds(const CostModel& model, uint64_t new_tokens, uint64_t context_before);

}  // namespace kvrouter::replay

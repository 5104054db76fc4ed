#include "replay/cost_model.h"

namespace kvrouter::replay {

double AttentionPairs(uint64_t new_tokens, uint64_t context_before) {
  const double n = static_cast<double>(new_tokens);
  return n * static_cast<double>(context_before) + n * (n + 1) / 2;
}

double StepSeconds(const CostModel& model, const StepShape& shape) {
  return model.step_overhead_s +
         model.prefill_per_token_s * static_cast<double>(shape.prefill_tokens) +
         model.attention_per_pair_s * shape.attention_pairs +
         model.decode_per_sequence_s * static_cast<double>(shape.decode_sequences) +
         model.decode_per_context_token_s * static_cast<double>(shape.decode_context_tokens) +
         model.host_reload_per_block_s * static_cast<double>(shape.reload_blocks);
}

double IsolatedPrefillSeconds(const CostModel& model, uint64_t new_tokens,
                              uint64_t context_before) {
  return StepSeconds(model,
                     StepShape{.prefill_tokens = new_tokens,
                               .attention_pairs = AttentionPairs(new_tokens, context_before)});
}

}  // namespace kvrouter::replay

// A simulated inference engine (one worker): continuous batching with chunked prefill over a
// finite prefix-cached KV pool, timed by the cost model, publishing KV events like vLLM.
//
// Life of a request on an engine:
//   Enqueue → waits (FIFO) → admitted when a step has token budget left, fewer than max_num_seqs
//   run, and its blocks fit: the cached prefix is referenced (a prefix-cache hit; the last prompt
//   token is always computed), the rest of the prompt and the whole output get private blocks
//   (output room is reserved up front, so nothing is ever preempted; with
//   EngineLimits::preemption, below, it is allocated as it goes). The private blocks must fit in
//   free blocks plus
//   unreferenced cached ones other than the request's own hits (referencing those takes them
//   off the evictable pool); until they do, the request waits at the head of the queue, and
//   those behind it wait too (FIFO, no overtaking) → prefilled in chunks → each full prompt block
//   whose KV is computed joins the cache and is published as BlockStored (token ids, engine hash,
//   parent hash) → the step that computes the last prompt chunk emits the first token → one token
//   per step after that → after output_length tokens the request ends and releases its blocks.
// Evicting an unreferenced block to make room publishes BlockRemoved.
//
// With a host tier (EngineLimits::host_capacity_blocks), an evicted block is offloaded to host
// memory first: published as a host-tier copy (BlockStored, tier host), then BlockRemoved from the
// device; the host pool evicts its least recently used blocks for room (BlockRemoved, tier
// host). At admission the blocks that continue the device prefix hit on the host are reloaded:
// they take device blocks, cost the cost model's host_reload_per_block_s each in the admitting
// step instead of a prefill, rejoin the device cache (BlockStored) and count as cached tokens.
//
// With preemption (EngineLimits::preemption), blocks are allocated as vLLM V1 allocates them: a
// request is admitted when its prompt's blocks fit (plus a reserve of 1 % of the capacity while
// other requests run, like vLLM's watermark), and a decoding request takes one more private block
// when its next token crosses a block boundary. When none is free or evictable, the most recently
// admitted running request is preempted (recompute preemption: it may be the one asking): its
// private blocks are freed, its cached prompt blocks stay cached, evictable once nobody else
// references them (no event: they are still there), and it goes back to the front of the queue.
// Re-admitted, it prefills its prompt and the tokens it had generated again (the prompt part can
// hit the prefix cache, its own blocks included), and the step that ends that prefill samples its
// next token; its first token is not emitted again. A step that preempted admits nobody (as
// vLLM's scheduler).
//
// Output tokens are not cached: their ids are synthetic, no later request of a trace can hit
// them, and vLLM would only evict them again.
//
// Engine block hashes are the engine's own (XXH3-64 chained through the parent, with a seed of
// its own), unrelated to the router's hashes: like a real engine's, they are opaque to the router,
// which hashes the token ids the events carry (dual key, architecture.md).
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <span>
#include <vector>

#include "replay/cost_model.h"
#include "replay/kv_cache.h"
#include "replay/trace/mooncake_trace.h"

namespace kvrouter::replay {

// One request of the replay, shared by the fleet (routing, metrics) and an engine (progress).
struct Request {
  uint32_t index = 0;  // position in the trace: the request id is derived from it
  const trace::TraceRecord* record = nullptr;
  double arrival_s = 0;
  uint32_t prompt_tokens = 0;
  uint32_t output_tokens = 1;  // at least one: the first token ends the prefill
  uint32_t worker = 0;

  // Engine progress.
  std::vector<uint32_t> tokens;        // the prompt, while it is being prefilled
  std::vector<uint64_t> block_hashes;  // engine hashes of the prompt's full blocks, while running
  uint32_t cached_tokens = 0;          // prefix-cache hit at admission (device and host)
  uint32_t host_cached_tokens = 0;     // of which reloaded from the host tier
  uint32_t reload_tokens = 0;          // host hits still to be copied back (the next step)
  uint32_t computed_tokens = 0;        // prompt tokens with KV (cached or prefilled)
  uint32_t held_blocks = 0;            // leading full blocks referenced in the cache
  uint64_t private_blocks = 0;
  uint32_t generated = 0;
  // With preemption: output tokens to prefill again with the prompt after a preemption (the ones
  // generated before it), 0 once recomputed; and how often the request was preempted.
  uint32_t resumed_tokens = 0;
  uint32_t preemptions = 0;
  double first_token_s = -1;
  double finish_s = -1;
};

struct EngineLimits {
  uint32_t block_size = 16;
  uint64_t kv_capacity_blocks = kDefaultKvCapacityTokens / 16;
  uint32_t max_num_batched_tokens = 8192;
  uint32_t max_num_seqs = 256;
  uint64_t host_capacity_blocks = 0;  // the host-memory tier; 0: none
  // Allocate output blocks as decoding goes and preempt under pressure (vLLM V1) instead of
  // reserving the whole output at admission.
  bool preemption = false;
};

// Where a block is cached: the GPU, or host memory (with EngineLimits::host_capacity_blocks).
enum class Tier { kDevice, kHost };

// Consecutive blocks of one prompt that became cached in one step: a vLLM BlockStored event.
// On the host tier it is a copy (vLLM's offloading connector): blocks the worker holds on the
// device, named by hash only (no parent, no tokens), now held on the host too.
struct StoredRun {
  Tier tier = Tier::kDevice;
  bool has_parent = false;
  uint64_t parent_hash = 0;
  std::span<const uint64_t> block_hashes;
  std::span<const uint32_t> token_ids;  // block_size tokens per block
};

// What an engine tells the world. Called synchronously, at the simulated time of the change.
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  virtual void OnStored(uint32_t worker, const StoredRun& run) = 0;
  virtual void OnRemoved(uint32_t worker, std::span<const uint64_t> block_hashes, Tier tier) = 0;
  virtual void OnFirstToken(Request& request) = 0;
  virtual void OnFinished(Request& request) = 0;
};

// Engine hashes of the full blocks of `tokens` (chained; the first block has no parent).
void EngineBlockHashes(std::span<const uint32_t> tokens, uint32_t block_size,
                       std::vector<uint64_t>& out);

// Blocks a request occupies once admitted with nothing cached: prompt and output.
uint64_t BlocksNeeded(uint64_t prompt_tokens, uint64_t output_tokens, uint32_t block_size);

class SimEngine {
 public:
  static constexpr double kIdle = std::numeric_limits<double>::infinity();

  SimEngine(uint32_t worker, const EngineLimits& limits, const CostModel& cost,
            EngineObserver& observer);

  void Enqueue(Request* request);
  // Starts a step at `now` if the engine is idle and has work. Returns whether it did.
  bool MaybeStartStep(double now);
  // Completes the running step (at step_end()): commits prefill chunks, emits tokens, ends
  // finished requests. The engine is idle afterwards; call MaybeStartStep(step_end) next.
  void FinishStep();

  double step_end() const { return step_end_; }
  bool stepping() const { return step_end_ != kIdle; }
  size_t in_flight() const { return waiting_.size() + running_.size(); }
  // Prompt tokens of the requests that have not produced their first token (waiting or
  // prefilling): the prefill backlog as a gateway sees it, whole prompts until the first token.
  uint64_t pending_prompt_tokens() const { return pending_prompt_tokens_; }
  uint64_t prefill_tokens_computed() const { return prefill_tokens_computed_; }
  uint64_t steps() const { return steps_; }
  // With EngineLimits::preemption: requests preempted, and the tokens (prompt and output)
  // prefilled again by requests re-admitted after a preemption.
  uint64_t preemptions() const { return preemptions_; }
  uint64_t recompute_tokens() const { return recompute_tokens_; }
  const PrefixCache& cache() const { return cache_; }
  const HostPool& host() const { return host_; }

 private:
  struct Chunk {
    Request* request;
    uint32_t tokens;      // 0: a decode step of this request
    bool reload = false;  // tokens copied back from the host tier, not computed
  };

  // Tokens to prefill before the request decodes: its prompt, and after a preemption the output
  // tokens it had generated.
  static uint32_t PrefillTarget(const Request& r) { return r.prompt_tokens + r.resumed_tokens; }
  bool TryAdmit(Request& request);
  bool AllocateDecodeBlock(Request& request);
  void Preempt(Request& request);
  void PlanRunning(uint32_t& budget, StepShape& shape);
  void PlanAdmissions(uint32_t& budget, StepShape& shape);
  void PlanPrefill(Request& request, uint32_t& budget, StepShape& shape);
  void CommitPrefill(Request& request, uint32_t tokens);
  void EmitStored(Request& request, size_t first_block, size_t end_block);
  void PublishEvictions();
  void Finish(Request& request);

  const uint32_t worker_;
  const EngineLimits limits_;
  const CostModel cost_;
  EngineObserver& observer_;
  PrefixCache cache_;
  HostPool host_;

  std::deque<Request*> waiting_;
  std::vector<Request*> running_;  // admission order
  std::vector<Chunk> step_;        // what the current step computes
  double step_end_ = kIdle;
  double now_ = 0;  // the end of the step being finished
  uint64_t prefill_tokens_computed_ = 0;
  uint64_t pending_prompt_tokens_ = 0;
  uint64_t steps_ = 0;
  uint64_t preemptions_ = 0;
  uint64_t recompute_tokens_ = 0;
  bool preempted_in_step_ = false;                  // the step being planned preempted a request
  std::vector<uint64_t> evicted_;                   // scratch
  std::vector<uint64_t> offloaded_, host_evicted_;  // scratch
};

}  // namespace kvrouter::replay

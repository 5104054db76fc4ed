#include "replay/sim_engine.h"

#include <xxhash.h>

#include <algorithm>

namespace kvrouter::replay {
namespace {

// The engine's hash seed for a first block; any constant differing from the router's works.
constexpr uint64_t kEngineRootSeed = 0x5eed'0f'e1'91'4e'00ULL;

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Frees a vector's memory (`v = {}` would keep its capacity): an hour of trace holds ~150 M
// prompt tokens, which must not stay allocated after each request's prefill.
template <typename T>
void FreeMemory(std::vector<T>& v) {
  std::vector<T>().swap(v);
}

}  // namespace

void EngineBlockHashes(std::span<const uint32_t> tokens, uint32_t block_size,
                       std::vector<uint64_t>& out) {
  const size_t blocks = tokens.size() / block_size;
  out.resize(blocks);
  uint64_t parent = kEngineRootSeed;
  for (size_t b = 0; b < blocks; ++b) {
    parent =
        XXH3_64bits_withSeed(tokens.data() + b * block_size, block_size * sizeof(uint32_t), parent);
    out[b] = parent;
  }
}

uint64_t BlocksNeeded(uint64_t prompt_tokens, uint64_t output_tokens, uint32_t block_size) {
  return CeilDiv(prompt_tokens + output_tokens, block_size);
}

SimEngine::SimEngine(uint32_t worker, const EngineLimits& limits, const CostModel& cost,
                     EngineObserver& observer)
    : worker_(worker),
      limits_(limits),
      cost_(cost),
      observer_(observer),
      cache_(limits.kv_capacity_blocks),
      host_(limits.host_capacity_blocks) {}

void SimEngine::Enqueue(Request* request) {
  request->worker = worker_;
  pending_prompt_tokens_ += request->prompt_tokens;
  waiting_.push_back(request);
}

bool SimEngine::MaybeStartStep(double now) {
  if (stepping() || (waiting_.empty() && running_.empty())) return false;
  step_.clear();
  preempted_in_step_ = false;
  StepShape shape;
  uint32_t budget = limits_.max_num_batched_tokens;
  // As vLLM's scheduler: running requests first (decodes, then ongoing prefills), then new ones.
  PlanRunning(budget, shape);
  PlanAdmissions(budget, shape);
  if (step_.empty()) return false;  // only when waiting requests cannot fit (see TryAdmit)
  step_end_ = now + StepSeconds(cost_, shape);
  ++steps_;
  return true;
}

void SimEngine::PlanRunning(uint32_t& budget, StepShape& shape) {
  // Decodes first (one token each, and never more sequences than tokens in the budget), so a
  // long prefill cannot stall the requests that are already streaming. With preemption a decode
  // may need a block and preempt the newest running request for it: always one not planned in
  // this step yet (the later decodes and every prefill come after), or this one.
  for (size_t i = 0; i < running_.size(); ++i) {
    Request* request = running_[i];
    if (request->computed_tokens < PrefillTarget(*request) || budget == 0) continue;
    if (limits_.preemption && !AllocateDecodeBlock(*request)) continue;  // preempted itself
    --budget;
    ++shape.decode_sequences;
    shape.decode_context_tokens += request->prompt_tokens + request->generated;
    step_.push_back({request, 0});
  }
  for (Request* request : running_) {
    if (request->computed_tokens < PrefillTarget(*request)) PlanPrefill(*request, budget, shape);
  }
}

// A decode step computes the KV of the request's last generated token: with preemption, its
// block is allocated when that token starts one (vLLM's allocate_slots).
bool SimEngine::AllocateDecodeBlock(Request& request) {
  const uint64_t needed = CeilDiv(request.prompt_tokens + request.generated, limits_.block_size);
  if (request.held_blocks + request.private_blocks >= needed) return true;
  while (!cache_.CanAllocate(1)) {
    Request& victim = *running_.back();
    Preempt(victim);
    if (&victim == &request) return false;
  }
  evicted_.clear();
  cache_.AllocatePrivate(1, evicted_);
  PublishEvictions();
  ++request.private_blocks;
  return true;
}

// vLLM V1's recompute preemption of the most recently admitted running request (running_'s last).
// Its cached prompt blocks are only released: they stay cached (and published), evictable once
// nobody references them, so no event is due; its private blocks (the prompt's uncommitted ones,
// its output's) were never published.
void SimEngine::Preempt(Request& request) {
  cache_.Release(std::span<const uint64_t>(request.block_hashes.data(), request.held_blocks),
                 request.private_blocks);
  request.held_blocks = 0;
  request.private_blocks = 0;
  request.computed_tokens = 0;
  request.reload_tokens = 0;
  request.resumed_tokens = request.generated;
  ++request.preemptions;
  ++preemptions_;
  preempted_in_step_ = true;
  running_.pop_back();
  waiting_.push_front(&request);
}

void SimEngine::PlanAdmissions(uint32_t& budget, StepShape& shape) {
  // As vLLM's scheduler, a step that had to preempt admits nobody.
  if (preempted_in_step_) return;
  while (budget > 0 && !waiting_.empty() && running_.size() < limits_.max_num_seqs) {
    Request& request = *waiting_.front();
    if (!TryAdmit(request)) break;  // first come, first served: no overtaking
    waiting_.pop_front();
    running_.push_back(&request);
    PlanPrefill(request, budget, shape);
  }
}

void SimEngine::PlanPrefill(Request& request, uint32_t& budget, StepShape& shape) {
  // Host hits are copied back first, in a step of their own for this request: the prefill that
  // follows them needs their KV. A copy takes no token budget, only transfer time.
  if (request.reload_tokens > 0) {
    shape.reload_blocks += request.reload_tokens / limits_.block_size;
    step_.push_back({&request, request.reload_tokens, /*reload=*/true});
    request.reload_tokens = 0;
    return;
  }
  const uint32_t chunk = std::min(budget, PrefillTarget(request) - request.computed_tokens);
  if (chunk == 0) return;
  budget -= chunk;
  shape.prefill_tokens += chunk;
  shape.attention_pairs += AttentionPairs(chunk, request.computed_tokens);
  step_.push_back({&request, chunk});
}

bool SimEngine::TryAdmit(Request& request) {
  const uint32_t block_size = limits_.block_size;
  // A request that did not fit keeps its tokens and hashes for the next try (only the
  // head of the queue ever tries).
  if (request.tokens.empty()) {
    trace::ExpandTokensInto(*request.record, block_size, request.tokens);
    EngineBlockHashes(request.tokens, block_size, request.block_hashes);
  }
  // The last token to prefill is always computed (its logits give the next token), so a prompt
  // cached in full still recomputes its last block; after a preemption that token is an output
  // one, and every full prompt block can hit.
  const uint32_t target = PrefillTarget(request);
  const size_t usable = std::min<size_t>(request.block_hashes.size(), (target - 1) / block_size);
  const size_t hits = std::min(cache_.MatchPrefix(request.block_hashes), usable);
  // The host tier may continue the device hit: those blocks are reloaded into private blocks.
  const size_t host_hits =
      host_.capacity() == 0
          ? 0
          : host_.MatchPrefix(
                std::span<const uint64_t>(request.block_hashes).subspan(hits, usable - hits));
  // With preemption, the blocks of what it prefills (the output's come as it decodes), and a
  // reserve while others run (vLLM's watermark: room for their next decode blocks). Alone, it
  // always fits: CheckCapacity made sure its prompt and output do.
  const uint64_t needed = (limits_.preemption ? CeilDiv(target, block_size)
                                              : BlocksNeeded(request.prompt_tokens,
                                                             request.output_tokens, block_size)) -
                          hits;
  const uint64_t reserve =
      limits_.preemption && !running_.empty() ? limits_.kv_capacity_blocks / 100 : 0;
  const std::span<const uint64_t> hit_hashes(request.block_hashes.data(), hits);
  // Its own hits cannot make its room: acquiring them takes them off the evictable pool. If it
  // does not fit it waits (at the head of the queue) for running requests to free blocks.
  if (!cache_.CanAdmit(hit_hashes, needed + reserve)) return false;
  cache_.Acquire(hit_hashes);
  // Host hits become the most recently used first, so that offloading this admission's device
  // evictions does not push them out of the host before they are copied back.
  if (host_hits > 0) {
    host_.Touch(std::span<const uint64_t>(request.block_hashes).subspan(hits, host_hits));
  }
  evicted_.clear();
  cache_.AllocatePrivate(needed, evicted_);
  PublishEvictions();
  request.held_blocks = static_cast<uint32_t>(hits);
  request.private_blocks = needed;
  request.computed_tokens = static_cast<uint32_t>(hits * block_size);
  request.reload_tokens = static_cast<uint32_t>(host_hits * block_size);
  // The hit rate is the first admission's (where the router sent it); a re-admission's hits
  // only spare part of the recompute.
  if (request.preemptions == 0) {
    request.host_cached_tokens = request.reload_tokens;
    request.cached_tokens = request.computed_tokens + request.host_cached_tokens;
  }
  return true;
}

// Blocks evicted from the device (evicted_) go to the host tier when there is one: each is
// published as a host copy while the device still holds it, the host's own evictions follow,
// then the device removal.
void SimEngine::PublishEvictions() {
  if (evicted_.empty()) return;
  offloaded_.clear();
  host_evicted_.clear();
  host_.Offload(evicted_, offloaded_, host_evicted_);
  if (!offloaded_.empty()) {
    observer_.OnStored(worker_,
                       StoredRun{.tier = Tier::kHost, .block_hashes = offloaded_, .token_ids = {}});
  }
  if (!host_evicted_.empty()) observer_.OnRemoved(worker_, host_evicted_, Tier::kHost);
  observer_.OnRemoved(worker_, evicted_, Tier::kDevice);
}

void SimEngine::FinishStep() {
  now_ = step_end_;
  step_end_ = kIdle;
  for (const Chunk& chunk : step_) {
    Request& request = *chunk.request;
    if (chunk.tokens > 0) {
      CommitPrefill(request, chunk.tokens);
      if (chunk.reload) {
        prefill_tokens_computed_ -= chunk.tokens;  // copied, not computed
        if (request.preemptions > 0) recompute_tokens_ -= chunk.tokens;
        continue;  // never the last prompt token (always computed)
      }
      if (request.computed_tokens < PrefillTarget(request)) continue;
      FreeMemory(request.tokens);
      if (request.resumed_tokens > 0) {
        // The recompute after a preemption is done: its step samples the next token, as a
        // decode would have (the first token was emitted before the preemption).
        request.resumed_tokens = 0;
        ++request.generated;
      } else {
        // The step that computes the last prompt token samples the first output token.
        request.generated = 1;
        request.first_token_s = now_;
        pending_prompt_tokens_ -= request.prompt_tokens;
        observer_.OnFirstToken(request);
      }
    } else {
      ++request.generated;
    }
    if (request.generated >= request.output_tokens) Finish(request);
  }
  std::erase_if(running_, [](const Request* r) { return r->finish_s >= 0; });
  step_.clear();
}

void SimEngine::CommitPrefill(Request& request, uint32_t tokens) {
  const uint32_t block_size = limits_.block_size;
  // Full prompt blocks computed (a recompute's output tokens are never cached).
  const size_t prompt_blocks = request.block_hashes.size();
  const size_t first_block = std::min<size_t>(request.computed_tokens / block_size, prompt_blocks);
  request.computed_tokens += tokens;
  prefill_tokens_computed_ += tokens;
  if (request.preemptions > 0) recompute_tokens_ += tokens;
  const size_t end_block = std::min<size_t>(request.computed_tokens / block_size, prompt_blocks);
  if (end_block > first_block) EmitStored(request, first_block, end_block);
}

void SimEngine::EmitStored(Request& request, size_t first_block, size_t end_block) {
  const uint32_t block_size = limits_.block_size;
  size_t run_start = first_block;
  auto flush = [&](size_t run_end) {
    if (run_end == run_start) return;
    StoredRun run;
    run.has_parent = run_start > 0;
    run.parent_hash = run.has_parent ? request.block_hashes[run_start - 1] : 0;
    run.block_hashes =
        std::span<const uint64_t>(request.block_hashes).subspan(run_start, run_end - run_start);
    run.token_ids = std::span<const uint32_t>(request.tokens)
                        .subspan(run_start * block_size, (run_end - run_start) * block_size);
    observer_.OnStored(worker_, run);
  };
  for (size_t b = first_block; b < end_block; ++b) {
    ++request.held_blocks;
    --request.private_blocks;
    // A block another request cached meanwhile is shared, not stored again: it ends the run.
    if (!cache_.Commit(request.block_hashes[b])) {
      flush(b);
      run_start = b + 1;
    }
  }
  flush(end_block);
}

void SimEngine::Finish(Request& request) {
  request.finish_s = now_;
  cache_.Release(std::span<const uint64_t>(request.block_hashes.data(), request.held_blocks),
                 request.private_blocks);
  FreeMemory(request.block_hashes);
  request.held_blocks = 0;
  request.private_blocks = 0;
  observer_.OnFinished(request);
}

}  // namespace kvrouter::replay

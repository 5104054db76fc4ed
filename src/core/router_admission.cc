// The Router's admission: the routing entry points (FindBestMatch, FindBestMatchAsync,
// AddRequest, MarkPrefillCompleted, Free, ...) and the admission queue behind them: whether a
// request must wait, enqueueing it, draining the queue when capacity frees up, cancelling a
// waiting request, and running the callbacks once the gate is released.
#include <algorithm>
#include <condition_variable>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/router.h"
#include "core/router_internal.h"

namespace kvrouter {

using router_internal::AsAbsl;
using router_internal::FindMatch;
using router_internal::IsAllowed;
using router_internal::OverlapOf;

// ---------------------------------------------------------------------------------------------
// Admission queue (under gate_)

bool Router::MustWaitLocked(const Prepared& prepared) const {
  if (!options_.queue_threshold || !prepared.allowed_worker_ids.empty()) return false;
  std::vector<RankPressure> ranks;
  for (const WorkerLoad& load : active_.Loads()) {
    // A pinned request waits for its own rank(s) only.
    if (!IsCandidateLocked(prepared, load.worker)) continue;
    const WorkerConfig* config = registry_.Find(load.worker.worker_id);
    ranks.push_back(RankPressure{
        .active_prefill_tokens = load.active_prefill_tokens,
        .max_num_batched_tokens = config != nullptr ? config->max_num_batched_tokens : 0});
  }
  return AllOverThreshold(ranks, *options_.queue_threshold);
}

void Router::EnqueueLocked(std::unique_ptr<Prepared> prepared, RouteCallback done) {
  // WSPT favours the request with the least uncached work on its best rank.
  uint64_t best_cached = 0;
  for (const WorkerMatch& match : prepared->matches) {
    if (!registry_.HasRank(match.worker) ||
        !IsAllowed(match.worker.worker_id, prepared->allowed_worker_ids)) {
      continue;
    }
    best_cached = std::max(best_cached,
                           CachedTokens(EffectiveOverlapBlocks(OverlapOf(match), prepared->config),
                                        options_.block_size));
  }
  const double arrival =
      static_cast<double>(clock_.Now() - queue_origin_) / static_cast<double>(kNanosPerSecond);
  const double key =
      QueueKey(options_.queue_policy, QueueKeyInputs{.priority_jump = prepared->priority_jump,
                                                     .arrival_offset_seconds = arrival,
                                                     .prompt_tokens = prepared->prompt_tokens,
                                                     .best_cached_tokens = best_cached});
  auto pending = std::make_unique<Pending>();
  pending->ticket = next_ticket_++;
  pending->prepared = std::move(*prepared);
  pending->done = std::move(done);
  const std::string id = pending->prepared.request_id;
  const uint64_t tokens = pending->prepared.prompt_tokens;
  queue_.Push(id, key, tokens, std::move(pending));
}

void Router::DrainQueueLocked(Completions& completions) {
  // Head-of-line: stop at the first request that still has to wait (as Dynamo does).
  while (!queue_.empty() && !MustWaitLocked(queue_.Front().item->prepared)) {
    auto entry = queue_.PopFront();
    auto result = DecideLocked(entry.item->prepared);
    CountDecision(result);
    if (result.ok()) result->queued = true;
    completions.push_back({std::move(entry.item->done), std::move(result)});
  }
}

bool Router::CancelLocked(std::string_view request_id, uint64_t ticket, absl::Status why,
                          Completions& completions) {
  const auto* entry = queue_.Find(request_id);
  if (entry == nullptr || (ticket != 0 && entry->item->ticket != ticket)) return false;
  auto removed = queue_.Remove(request_id);
  completions.push_back({std::move(removed->item->done), std::move(why)});
  return true;
}

bool Router::ReleaseLocked(std::string_view request_id, std::string_view why,
                           Completions& completions) {
  if (CancelLocked(request_id, 0, absl::CancelledError(AsAbsl(why)), completions)) return true;
  if (!FreeBookingLocked(request_id)) return false;
  DrainQueueLocked(completions);
  return true;
}

void Router::Run(Completions& completions) {
  for (Completion& c : completions) c.done(std::move(c.result));
  completions.clear();
}

// ---------------------------------------------------------------------------------------------
// Routing entry points

uint64_t Router::Submit(std::span<const uint32_t> tokens, const RouteOptions& options,
                        RouteCallback done, bool as_plan) {
  // Reused per thread so the hot path does not allocate its hash and match buffers. It is only
  // used until the decision is made, before any callback runs.
  thread_local Prepared scratch;
  const std::optional<Nanos> started = StartTimingIfSampled();
  if (auto status = Prepare(tokens, options, options.with_admission, scratch); !status.ok()) {
    done(status);
    return 0;
  }
  scratch.hold_as_plan = as_plan;
  Completions completions;
  uint64_t ticket = 0;
  {
    std::lock_guard lock(gate_);
    // Only a request that books may age plans and sessions: a preview changes nothing.
    if (options.with_admission) {
      if (MaybeSweepLocked()) DrainQueueLocked(completions);
    }
    ApplySessionLocked(scratch, /*use=*/options.with_admission);
    absl::Status id_status =
        options.with_admission ? CheckNewRequestIdLocked(options.request_id) : absl::OkStatus();
    if (id_status.ok()) id_status = CheckPinLocked(scratch);
    if (!id_status.ok()) {
      completions.push_back({std::move(done), std::move(id_status)});
    } else if (options.with_admission && MustWaitLocked(scratch)) {
      ticket = next_ticket_;
      EnqueueLocked(std::make_unique<Prepared>(std::move(scratch)), std::move(done));
    } else {
      auto result = DecideLocked(scratch);
      CountDecision(result);
      if (result.ok()) FinishTiming(started);
      completions.push_back({std::move(done), std::move(result)});
    }
  }
  Run(completions);
  return ticket;
}

absl::StatusOr<RouteDecision> Router::FindBestMatch(std::span<const uint32_t> tokens,
                                                    const RouteOptions& options) {
  return Route(tokens, options, /*as_plan=*/false);
}

absl::StatusOr<RouteDecision> Router::Route(std::span<const uint32_t> tokens,
                                            const RouteOptions& options, bool as_plan) {
  struct Waiter {
    std::mutex mu;
    std::condition_variable_any cv;
    std::optional<absl::StatusOr<RouteDecision>> result;
  } waiter;
  // Notifying under the waiter's mutex: once the caller sees the result it may return and
  // destroy `waiter`, which it can only do after this callback has let go of the mutex.
  auto done = [&waiter](absl::StatusOr<RouteDecision> result) {
    std::lock_guard lock(waiter.mu);
    waiter.result = std::move(result);
    waiter.cv.notify_all();
  };
  const uint64_t ticket = Submit(tokens, options, done, as_plan);

  std::unique_lock lock(waiter.mu);
  const auto ready = [&waiter] { return waiter.result.has_value(); };
  if (ready()) return std::move(*waiter.result);
  const bool admitted = options.queue_timeout ? waiter.cv.wait_for(lock, options.stop_token,
                                                                   *options.queue_timeout, ready)
                                              : waiter.cv.wait(lock, options.stop_token, ready);
  if (!admitted) {
    lock.unlock();
    absl::Status why = options.stop_token.stop_requested()
                           ? absl::CancelledError("cancelled while waiting for admission")
                           : absl::DeadlineExceededError("timed out while waiting for admission");
    Completions completions;
    {
      std::lock_guard gate(gate_);
      CancelLocked(options.request_id, ticket, std::move(why), completions);
    }
    Run(completions);
    lock.lock();
    // Either the cancellation above or an admission that won the race has set the result.
    waiter.cv.wait(lock, ready);
  }
  return std::move(*waiter.result);
}

void Router::FindBestMatchAsync(std::span<const uint32_t> tokens, const RouteOptions& options,
                                RouteCallback done) {
  Submit(tokens, options, std::move(done));
}

bool Router::CancelPending(std::string_view request_id) {
  Completions completions;
  bool cancelled;
  {
    std::lock_guard lock(gate_);
    cancelled =
        CancelLocked(request_id, 0, absl::CancelledError("cancelled while waiting"), completions);
  }
  Run(completions);
  return cancelled;
}

absl::Status Router::AddRequest(std::string_view request_id, std::span<const uint32_t> tokens,
                                WorkerKey worker, const RouteOptions& options) {
  RouteOptions booking = options;
  booking.request_id = request_id;
  booking.with_admission = true;
  Prepared prepared;
  if (auto status = Prepare(tokens, booking, /*for_booking=*/true, prepared); !status.ok()) {
    return status;
  }
  std::lock_guard lock(gate_);
  if (auto status = CheckNewRequestIdLocked(request_id); !status.ok()) return status;
  if (!active_.HasWorker(worker)) {
    return absl::NotFoundError(
        absl::StrCat("unknown worker ", worker.worker_id, " dp_rank ", worker.dp_rank));
  }
  const WorkerMatch* match = FindMatch(prepared.matches, worker);
  const Candidate candidate{.worker = worker, .overlap = match ? OverlapOf(*match) : TierOverlap{}};
  const CandidateCost priced =
      ScoreCandidate(candidate, prepared.prompt_tokens, options_.block_size, prepared.config,
                     candidate.active_prefill_tokens);
  return BookLocked(prepared, priced);
}

bool Router::MarkPrefillCompleted(std::string_view request_id) {
  if (IsReplicaRequestId(request_id)) return false;  // a replica's booking: only it may
  Completions completions;
  bool changed;
  {
    std::lock_guard lock(gate_);
    changed = MarkPrefillCompletedLocked(request_id);
    if (changed) DrainQueueLocked(completions);
  }
  Run(completions);
  return changed;
}

bool Router::Free(std::string_view request_id) {
  if (IsReplicaRequestId(request_id)) return false;
  Completions completions;
  bool freed;
  {
    std::lock_guard lock(gate_);
    // A client that gives up before admission frees a request that is still waiting.
    freed = ReleaseLocked(request_id, "freed while waiting for admission", completions);
    // A request freed before its plan was committed (or aborted) needs no plan any more.
    plans_.Erase(request_id);
  }
  Run(completions);
  return freed;
}

absl::StatusOr<bool> Router::RecordOutputTokens(std::string_view request_id,
                                                uint64_t output_tokens) {
  if (!options_.track_output_blocks) {
    return absl::FailedPreconditionError(
        "output tokens are not tracked (create the router with track_output_blocks)");
  }
  if (IsReplicaRequestId(request_id)) return false;
  std::lock_guard lock(gate_);
  return active_.SetOutputTokens(request_id, output_tokens, options_.block_size);
}

}  // namespace kvrouter

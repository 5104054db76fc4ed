// The Router's admission: the routing entry points (FindBestMatch, FindBestMatchAsync,
// AddRequest, MarkPrefillCompleted, Free, ...) and the admission queue behind them: whether a
// request must wait, enqueueing it, draining the queue when capacity frees up, cancelling a
// waiting request, and running the callbacks once the gate is released.
//
// A refused allocation (std::bad_alloc) leaves the router as if the call had not been made: a
// decision books whole or not at all (router_selection.cc), a callback's place among the
// completions is made before the decision or the dequeue it reports, and a queued request stays
// queued until its decision succeeds.
#include <algorithm>
#include <condition_variable>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/router.h"
#include "core/router_internal.h"

namespace kvrouter {

using router_internal::AsAbsl;
using router_internal::FindMatch;
using router_internal::IsAllowed;
using router_internal::OverlapOf;

namespace {
absl::Status QueueClosedStatus() {
  return absl::CancelledError("the admission queue is closed: the router is shutting down");
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// Admission queue (under gate_)

bool Router::MustWaitLocked(const Prepared& prepared) const {
  if (!options_.queue_threshold || prepared.allowed_worker_ids) return false;
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

void Router::EnqueueLocked(std::unique_ptr<Prepared> prepared, RouteCallback& done) {
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
  std::string id = prepared->request_id;
  auto pending = std::make_unique<Pending>();
  pending->ticket = next_ticket_;
  pending->prepared = std::move(*prepared);
  pending->done = std::move(done);
  const uint64_t tokens = pending->prepared.prompt_tokens;
  try {
    queue_.Push(std::move(id), key, tokens, std::move(pending));  // all or nothing
  } catch (...) {
    done = std::move(pending->done);  // the caller answers the request
    throw;
  }
  done = nullptr;
  ++next_ticket_;
}

void Router::DrainQueueLocked(Completions& completions) {
  try {
    // Head-of-line: stop at the first request that still has to wait (as Dynamo does). Its
    // session steers it as the binding stands now (bound, rebound or dropped since it came).
    while (!queue_.empty()) {
      Prepared& head = queue_.Front().item->prepared;
      ApplySessionLocked(head);
      if (MustWaitLocked(head)) break;
      // Decided in place, dequeued once decided: nothing from the reserve on allocates but
      // the decision, which books whole or not at all.
      completions.reserve(completions.size() + 1);
      auto result = DecideLocked(head);
      auto entry = queue_.PopFront();
      CountDecision(result);
      if (result.ok()) result->queued = true;
      completions.push_back({std::move(entry.item->done), std::move(result)});
    }
  } catch (const std::bad_alloc&) {
    // The head stays queued, its decision not taken: the next drain (a release, a new worker,
    // RecheckQueue) tries again. The call that drained has done what it was asked.
  }
}

bool Router::CancelLocked(std::string_view request_id, uint64_t ticket, absl::Status why,
                          Completions& completions) {
  const auto* entry = queue_.Find(request_id);
  if (entry == nullptr || (ticket != 0 && entry->item->ticket != ticket)) return false;
  completions.reserve(completions.size() + 1);
  auto removed = queue_.Remove(request_id);
  completions.push_back({std::move(removed->item->done), std::move(why)});
  return true;
}

bool Router::ReleaseLocked(std::string_view request_id, std::string_view why,
                           Completions& completions) {
  // The status only for a waiting request: a release of a booking allocates nothing.
  if (queue_.Contains(request_id)) {
    return CancelLocked(request_id, 0, absl::CancelledError(AsAbsl(why)), completions);
  }
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
  Completions completions;
  uint64_t ticket = 0;
  try {
    ticket = Admit(tokens, options, done, as_plan, completions);
  } catch (const std::bad_alloc&) {
    // Refused: this request is neither booked nor queued, and hears so; those the sweep
    // admitted hear of it too.
    Run(completions);
    if (done) done(OutOfMemoryStatus());
    throw;
  } catch (...) {  // not expected here: those admitted still hear of it
    Run(completions);
    throw;
  }
  Run(completions);
  return ticket;
}

uint64_t Router::Admit(std::span<const uint32_t> tokens, const RouteOptions& options,
                       RouteCallback& done, bool as_plan, Completions& completions) {
  // Reused per thread so the hot path does not allocate its hash and match buffers. It is only
  // used until the decision is made, before any callback runs.
  thread_local Prepared scratch;
  const std::optional<Nanos> started = StartTimingIfSampled();
  // The callback's place first: once booked, a decision must reach its caller.
  completions.reserve(1);
  if (auto status = Prepare(tokens, options, options.with_admission, scratch); !status.ok()) {
    completions.push_back({std::exchange(done, nullptr), std::move(status)});
    return 0;
  }
  scratch.hold_as_plan = as_plan;
  std::unique_lock lock(gate_);
  // Only a request that books may age plans and sessions: a preview changes nothing.
  if (options.with_admission) {
    if (MaybeSweepLocked()) DrainQueueLocked(completions);
  }
  // Priced outside the gate first; if what was priced changed meanwhile, decided again wholly
  // under it, from the steering and the checks on.
  for (bool outside = true;; outside = false) {
    // Steering changes nothing; a booking uses the binding once it is made (DecideLocked).
    ApplySessionLocked(scratch);
    completions.reserve(completions.size() + 1);
    // A plan retried while this call decided (a gateway's retry racing the first): the plan
    // booked meanwhile is the answer, as Plan gives it once booked.
    if (const RouteDecision* planned =
            scratch.hold_as_plan ? LivePlanLocked(options.request_id) : nullptr) {
      decisions_.fetch_add(1, std::memory_order_relaxed);
      completions.push_back({std::exchange(done, nullptr), *planned});
      return 0;
    }
    absl::Status id_status =
        options.with_admission ? CheckNewRequestIdLocked(options.request_id) : absl::OkStatus();
    if (id_status.ok()) id_status = CheckPinLocked(scratch);
    if (!id_status.ok()) {
      completions.push_back({std::exchange(done, nullptr), std::move(id_status)});
      return 0;
    }
    if (options.with_admission && MustWaitLocked(scratch)) {
      if (queue_closed_) {
        completions.push_back({std::exchange(done, nullptr), QueueClosedStatus()});
        return 0;
      }
      const uint64_t ticket = next_ticket_;
      EnqueueLocked(std::make_unique<Prepared>(std::move(scratch)), done);
      return ticket;
    }
    std::optional<absl::StatusOr<RouteDecision>> result =
        outside ? DecidePricedOutsideLocked(scratch, lock) : DecideLocked(scratch);
    if (!result) continue;
    CountDecision(*result);
    if (result->ok()) FinishTiming(started);
    completions.push_back({std::exchange(done, nullptr), std::move(*result)});
    return 0;
  }
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
  try {
    Submit(tokens, options, std::move(done));
  } catch (const std::bad_alloc&) {
    // Submit has answered `done` with ResourceExhausted: the callback is the only answer.
  }
}

size_t Router::CloseQueue() {
  const absl::Status closed = QueueClosedStatus();  // copied below without allocating
  Completions completions;
  size_t cancelled = 0;
  {
    std::lock_guard lock(gate_);
    // Every caller's place first: once out of the queue, a request must hear why; refused, the
    // queue is left as it was (open).
    completions.reserve(queue_.size());
    queue_closed_ = true;
    for (; !queue_.empty(); ++cancelled) {
      completions.push_back({std::move(queue_.PopFront().item->done), closed});
    }
  }
  Run(completions);
  return cancelled;
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
  Completions completions;
  absl::Status status;
  {
    std::lock_guard lock(gate_);
    // Lost requests may go (and those waiting behind them be admitted) before this one books.
    if (MaybeSweepLocked()) DrainQueueLocked(completions);
    status = AddRequestLocked(request_id, worker, prepared, options);
  }
  Run(completions);
  return status;
}

absl::Status Router::AddRequestLocked(std::string_view request_id, WorkerKey worker,
                                      const Prepared& prepared, const RouteOptions& options) {
  if (auto status = CheckNewRequestIdLocked(request_id); !status.ok()) return status;
  if (!active_.HasWorker(worker)) return UnknownRankError(worker);
  const WorkerMatch* match = FindMatch(prepared.matches, worker);
  const Candidate candidate{.worker = worker, .overlap = match ? OverlapOf(*match) : TierOverlap{}};
  const CandidateCost priced =
      ScoreCandidate(candidate, prepared.prompt_tokens, options_.block_size, prepared.config,
                     candidate.active_prefill_tokens);
  // A plan left under this id lost its booking with its worker: this booking is not that
  // plan's.
  return BookLocked(prepared, priced, [&] { plans_.Erase(request_id); });
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

// Staged routing (reference §6.2) and session affinity (§6.1) on the Router: Preview, Plan,
// Commit and Abort with the plans' deadlines and the lazy sweep of plans and sessions; the
// session bindings themselves are a SessionTable (session_table.h).
#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/router.h"
#include "core/router_internal.h"

namespace kvrouter {

using router_internal::AsAbsl;

// ---------------------------------------------------------------------------------------------
// Staged routing: preview, plan, commit, abort (reference §6.2)

absl::StatusOr<RouteDecision> Router::Preview(std::span<const uint32_t> tokens,
                                              const RouteOptions& options) {
  const std::optional<Nanos> started = StartTimingIfSampled();
  RouteOptions look = options;
  look.with_admission = false;
  Prepared prepared;
  if (auto status = Prepare(tokens, look, /*for_booking=*/false, prepared); !status.ok()) {
    return status;
  }
  std::unique_lock lock(gate_);
  ApplySessionLocked(prepared);
  std::optional<absl::StatusOr<RouteDecision>> result = DecidePricedOutsideLocked(prepared, lock);
  if (!result) {
    ApplySessionLocked(prepared);
    result = DecideLocked(prepared);
  }
  if (result->ok()) FinishTiming(started);
  return *std::move(result);
}

absl::StatusOr<RouteDecision> Router::Plan(std::span<const uint32_t> tokens,
                                           const RouteOptions& options,
                                           std::optional<WorkerKey> previewed) {
  if (options.request_id.empty()) {
    return absl::InvalidArgumentError("a request id is required to plan a request");
  }
  Completions completions;
  {
    std::lock_guard lock(gate_);
    // Planning twice (a retried gateway call) returns the plan already booked.
    if (const RouteDecision* planned = LivePlanLocked(options.request_id)) {
      decisions_.fetch_add(1, std::memory_order_relaxed);
      return *planned;
    }
    if (plans_.Find(options.request_id) != nullptr) {
      // Stale (past its deadline, or its worker removed): free what is left and plan afresh.
      plans_.Erase(options.request_id);
      if (FreeBookingLocked(options.request_id)) DrainQueueLocked(completions);
    }
  }
  Run(completions);
  RouteOptions plan = options;
  plan.with_admission = true;
  if (previewed) plan.preferred = previewed;
  return Route(tokens, plan, /*as_plan=*/true);
}

const RouteDecision* Router::LivePlanLocked(std::string_view request_id) {
  const auto* planned = plans_.Find(request_id);
  if (planned == nullptr || planned->DueAt(clock_.Now()) || !active_.HasRequest(request_id)) {
    return nullptr;
  }
  return &planned->decision;
}

absl::Status Router::Commit(std::string_view request_id) {
  Completions completions;
  absl::Status status;
  try {
    std::lock_guard lock(gate_);
    if (MaybeSweepLocked()) DrainQueueLocked(completions);
    auto* planned = plans_.Find(request_id);
    // This plan's own deadline is checked exactly, whenever the last sweep ran.
    if (planned != nullptr && planned->DueAt(clock_.Now())) {
      FreeBookingLocked(request_id);
      plans_.Erase(request_id);
      planned = nullptr;
      DrainQueueLocked(completions);
    }
    if (planned == nullptr) {
      // Committed before (or booked without a plan): nothing left to do.
      status = active_.HasRequest(request_id)
                   ? absl::OkStatus()
                   : absl::NotFoundError(
                         absl::StrCat("no plan for request '", AsAbsl(request_id),
                                      "' (never planned, aborted, freed, or past its deadline)"));
    } else if (!active_.HasRequest(request_id)) {
      // The booking went with its worker (removed) or expired: nothing to dispatch to. The
      // record stays (so a retried commit says the same) until abort, free, a new plan or
      // the deadline.
      status = absl::FailedPreconditionError(
          absl::StrCat("the plan for request '", AsAbsl(request_id),
                       "' lost its booking (its worker was removed); plan again"));
    } else {
      // Throws with nothing left when refused; the plan stays, to be committed again.
      CommitDecisionLocked(*planned->payload, planned->decision.worker);
      plans_.Erase(request_id);
    }
  } catch (...) {
    Run(completions);  // requests the sweep admitted still hear of it
    throw;
  }
  Run(completions);
  return status;
}

bool Router::Abort(std::string_view request_id) {
  if (IsReplicaRequestId(request_id)) return false;
  Completions completions;
  bool freed;
  {
    std::lock_guard lock(gate_);
    const bool had_plan = plans_.Erase(request_id);
    freed = ReleaseLocked(request_id, "aborted while waiting for admission", completions);
    freed = freed || had_plan;
  }
  Run(completions);
  return freed;
}

bool Router::MaybeSweepLocked() {
  // Sweeping scans every plan and session, so a busy router does it at most this often; each
  // lookup checks its own entry's deadline or TTL exactly anyway.
  const Nanos now = clock_.Now();
  const Nanos interval = std::min(plans_.deadline(), kNanosPerSecond);
  if (now - last_sweep_ < interval) return false;
  last_sweep_ = now;
  sessions_.Reclaim();
  // Lost requests too (at most once per their check interval): what they held may be what a
  // queued request waits for.
  const size_t requests = active_.MaybeExpire();
  return ExpirePlansLocked() + requests > 0;
}

size_t Router::ExpirePlansLocked() {
  return plans_.ExpireDue(clock_.Now(),
                          [this](std::string_view request_id) { FreeBookingLocked(request_id); });
}

size_t Router::ExpirePlans() {
  Completions completions;
  size_t expired;
  {
    std::lock_guard lock(gate_);
    expired = ExpirePlansLocked();
    if (expired > 0) DrainQueueLocked(completions);
  }
  Run(completions);
  return expired;
}

absl::Status Router::SetPlanDeadline(double seconds) {
  if (!std::isfinite(seconds) || seconds <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan deadline must be finite and > 0 seconds, got ", seconds));
  }
  std::lock_guard lock(gate_);
  plans_.set_deadline(SecondsToNanos(seconds));
  return absl::OkStatus();
}

size_t Router::plan_count() const {
  std::lock_guard lock(gate_);
  return plans_.size();
}

// ---------------------------------------------------------------------------------------------
// Session affinity (reference §6.1): the SessionTable under gate_

void Router::ApplySessionLocked(Prepared& prepared) {
  prepared.pin = prepared.own_pin;
  prepared.preferred = prepared.own_preferred;
  // An explicit pin outranks the session; a binding the request may not use is no target.
  sessions_.Steer(
      prepared.session_id, prepared.session_mode, /*use=*/false,
      [&](WorkerKey bound) {
        return active_.HasWorker(bound) && IsCandidateLocked(prepared, bound);
      },
      prepared.pin, prepared.preferred);
}

void Router::UseSessionLocked(const Prepared& prepared) {
  // Steer with `use` only erases or rewrites the binding (and resolves into copies here).
  std::optional<WorkerPin> pin = prepared.pin;
  std::optional<WorkerKey> preferred = prepared.preferred;
  sessions_.Steer(
      prepared.session_id, prepared.session_mode, /*use=*/true,
      [&](WorkerKey bound) {
        return active_.HasWorker(bound) && IsCandidateLocked(prepared, bound);
      },
      pin, preferred);
}

std::optional<WorkerKey> Router::SessionBinding(std::string_view session_id) const {
  std::lock_guard lock(gate_);
  return sessions_.Binding(session_id);
}

bool Router::CloseSession(std::string_view session_id) {
  std::lock_guard lock(gate_);
  return sessions_.Close(session_id);
}

size_t Router::ReclaimExpiredSessions() {
  std::lock_guard lock(gate_);
  return sessions_.Reclaim();
}

size_t Router::session_count() const {
  std::lock_guard lock(gate_);
  return sessions_.size();
}

}  // namespace kvrouter

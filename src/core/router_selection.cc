// The Router's decision for one request: Prepare hashes the prompt and looks it up in the
// index (no router lock held); then, under the admission gate, SelectLocked prices every
// eligible rank, BookLocked books the winner, CommitDecisionLocked leaves what a dispatch leaves
// behind (the approximate-index record, the session binding), and DecideLocked composes them
// into a RouteDecision.
//
// Pricing is most of a decision at a thousand ranks, and it needs no lock: the entry points
// (Admit, Preview) take the candidates under the gate, price them outside it, and pick and
// book under it again, if the winner's load has not changed meanwhile
// (DecidePricedOutsideLocked); else they decide again wholly under the gate. One caller
// decides exactly as under the gate alone; concurrent callers price in parallel.
//
// A refused allocation (std::bad_alloc) leaves the router as if the decision had not been asked
// for: everything that can be refused comes before the booking or is undone with it
// (DecideLocked). (Messages may use absl::StrCat, which passes a bad_alloc on; not
// absl::StrFormat, which cannot through Debian's libabsl: std::terminate.)
#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/hashing.h"
#include "core/router.h"
#include "core/router_internal.h"

namespace kvrouter {

using router_internal::AsAbsl;
using router_internal::IsAllowed;
using router_internal::OverlapOf;

// ---------------------------------------------------------------------------------------------
// Preparing a request (no router lock held)

void Router::LookUp(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out,
                    size_t computable_blocks) {
  if (index_) {
    index_->FindMatches(local_hashes, out, computable_blocks);
  } else {
    approx_->FindMatches(local_hashes, out);
  }
}

absl::Status Router::CheckPrehashed(std::span<const uint32_t> tokens,
                                    const PromptOptions& prompt) const {
  if (!prompt.prehashed) return absl::OkStatus();
  if (!tokens.empty()) {
    return absl::InvalidArgumentError(
        "a prompt is given either as tokens or as local hashes, not both");
  }
  const uint64_t num_tokens = prompt.prehashed->num_tokens;
  const size_t blocks =
      NumCompleteBlocks(num_tokens, options_.block_size, prompt.eagle || options_.eagle);
  if (prompt.prehashed->local_hashes.size() != blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a prompt of ", num_tokens, " tokens has ", blocks, " complete blocks of ",
        options_.block_size, (prompt.eagle || options_.eagle) ? " (eagle windows)" : "", ", but ",
        prompt.prehashed->local_hashes.size(), " local hashes were given"));
  }
  return absl::OkStatus();
}

absl::Status Router::Prepare(std::span<const uint32_t> tokens, const RouteOptions& options,
                             bool for_booking, Prepared& out) {
  auto config = ApplyOverrides(options_.selection, options.overrides);
  if (!config.ok()) return config.status();
  if (for_booking && options.request_id.empty()) {
    return absl::InvalidArgumentError("a request id is required to book a request");
  }
  if (!std::isfinite(options.priority_jump)) {
    return absl::InvalidArgumentError("priority_jump must be finite");
  }
  if (!options.session_id.empty() &&
      !(std::isfinite(options.session_ttl_seconds) && options.session_ttl_seconds > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_ttl_seconds must be > 0, got ", options.session_ttl_seconds));
  }
  out.request_id.assign(options.request_id);
  out.config = *config;
  out.with_admission = options.with_admission;
  if (absl::Status hashed = CheckPrehashed(tokens, options.prompt); !hashed.ok()) return hashed;
  out.prompt_tokens =
      options.prompt.prehashed ? options.prompt.prehashed->num_tokens : tokens.size();
  out.expected_output_tokens = options.expected_output_tokens;
  out.priority_jump = options.priority_jump;
  if (!options.allowed_worker_ids) {
    out.allowed_worker_ids.reset();  // out may be a reused one
  } else {
    std::vector<uint64_t>& allowed =
        out.allowed_worker_ids ? *out.allowed_worker_ids : out.allowed_worker_ids.emplace();
    allowed.assign(options.allowed_worker_ids->begin(), options.allowed_worker_ids->end());
  }
  out.pin = out.own_pin = options.pin;
  out.preferred = out.own_preferred = options.preferred;
  out.session_id.assign(options.session_id);
  out.session_mode = options.session_mode;
  out.session_ttl_seconds = options.session_ttl_seconds;
  out.hold_as_plan = false;

  const BlockHashOptions hash_options{.lora_name = options.prompt.lora_name,
                                      .cache_namespace = options.prompt.cache_namespace,
                                      .eagle = options.prompt.eagle || options_.eagle,
                                      .block_mm_hashes = options.prompt.block_mm_hashes};
  if (options.prompt.prehashed) {
    const std::span<const uint64_t> given = options.prompt.prehashed->local_hashes;
    out.local_hashes.assign(given.begin(), given.end());
  } else {
    ComputeLocalBlockHashesInto(tokens, options_.block_size, hash_options, out.local_hashes);
  }
  // Without assumed KV reuse the blocks are booked under random identities instead.
  if (out.config.assume_kv_reuse) {
    ComputeTrackingIdsInto(out.local_hashes, out.tracking_ids);
  } else {
    out.tracking_ids.clear();
  }
  // The approximate index records a booking as synthetic stored events keyed by sequence hash.
  if (approx_ && for_booking) {
    ComputeSequenceHashesInto(out.local_hashes, out.sequence_hashes);
  } else {
    out.sequence_hashes.clear();
  }
  // An engine computes at least the prompt's last token (vLLM: its cache serves at most
  // tokens - 1), which is where a hybrid model's sliding windows are searched from.
  const size_t computable = out.prompt_tokens == 0
                                ? 0
                                : NumCompleteBlocks(out.prompt_tokens - 1, options_.block_size,
                                                    options.prompt.eagle || options_.eagle);
  LookUp(out.local_hashes, out.matches, computable);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Selection and booking (under gate_)

bool Router::IsCandidateLocked(const Prepared& prepared, WorkerKey worker) const {
  if (!IsAllowed(worker.worker_id, prepared.allowed_worker_ids)) return false;
  if (!prepared.pin) return true;
  return worker.worker_id == prepared.pin->worker_id &&
         (!prepared.pin->dp_rank || worker.dp_rank == *prepared.pin->dp_rank);
}

absl::Status Router::CheckPinLocked(const Prepared& prepared) const {
  if (!prepared.pin) return absl::OkStatus();
  const WorkerPin& pin = *prepared.pin;
  if (!IsAllowed(pin.worker_id, prepared.allowed_worker_ids)) {
    return absl::InvalidArgumentError(absl::StrCat("pinned worker ", pin.worker_id,
                                                   " is not in allowed_worker_ids (the pin and "
                                                   "the allowed set contradict each other)"));
  }
  if (registry_.Find(pin.worker_id) == nullptr) {
    return absl::NotFoundError(absl::StrCat("pinned worker ", pin.worker_id, " is not registered"));
  }
  if (pin.dp_rank && !active_.HasWorker(WorkerKey{pin.worker_id, *pin.dp_rank})) {
    return absl::NotFoundError(
        absl::StrCat("pinned worker ", pin.worker_id, " has no dp_rank ", *pin.dp_rank));
  }
  return absl::OkStatus();
}

PotentialLoadQuery Router::LoadQueryOf(const Prepared& prepared) {
  return PotentialLoadQuery{.block_ids = prepared.tracking_ids,
                            .random_identities = !prepared.config.assume_kv_reuse,
                            .num_blocks = prepared.local_hashes.size(),
                            .prompt_tokens = prepared.prompt_tokens,
                            .track_prefill_tokens = prepared.config.track_prefill_tokens};
}

void Router::AlignMatchesLocked(const Prepared& prepared,
                                std::vector<const WorkerMatch*>& match_of_rank) const {
  active_.AlignToRanks(
      std::span<const WorkerMatch>(prepared.matches),
      [](const WorkerMatch& match) { return match.worker; }, match_of_rank);
}

void Router::PotentialLoadsLocked(const Prepared& prepared, std::vector<PotentialLoad>& out) {
  std::vector<const WorkerMatch*> match_of_rank;
  AlignMatchesLocked(prepared, match_of_rank);
  const auto cached_tokens = [&](size_t position, WorkerKey) -> uint64_t {
    const WorkerMatch* match = match_of_rank[position];
    if (match == nullptr) return 0;
    return CachedTokens(EffectiveOverlapBlocks(OverlapOf(*match), prepared.config),
                        options_.block_size);
  };
  active_.PotentialLoads(LoadQueryOf(prepared), cached_tokens, out);
}

absl::Status Router::CandidatesLocked(const Prepared& prepared, RankCandidates& out) const {
  std::vector<const WorkerMatch*> match_of_rank;
  AlignMatchesLocked(prepared, match_of_rank);
  std::vector<LoadWithPrompt> loads;
  active_.LoadsWithPrompt(LoadQueryOf(prepared), loads);

  out.candidates.clear();
  out.versions.clear();
  out.candidates.reserve(loads.size());
  out.versions.reserve(loads.size());
  for (size_t position = 0; position < loads.size(); ++position) {
    const LoadWithPrompt& load = loads[position];
    if (!IsCandidateLocked(prepared, load.current.worker)) continue;
    const WorkerMatch* match = match_of_rank[position];
    // Field by field, in place (as in LoadsWithPrompt: no copy to stall on).
    Candidate& candidate = out.candidates.emplace_back();
    candidate.worker = load.current.worker;
    candidate.overlap = match ? OverlapOf(*match) : TierOverlap{};
    candidate.active_prefill_tokens = load.current.active_prefill_tokens;
    candidate.active_blocks = load.current.active_blocks;
    candidate.new_blocks = load.new_blocks;
    candidate.active_requests = load.current.active_requests;
    candidate.prefill_tokens_per_second = load.current.prefill_tokens_per_second;
    out.versions.push_back(load.version);
  }
  if (out.candidates.empty() && !loads.empty() && prepared.allowed_worker_ids) {
    return absl::UnavailableError(
        prepared.allowed_worker_ids->empty()
            ? "no worker is allowed (allowed_worker_ids is an empty list)"
            : "none of the allowed workers is registered (allowed_worker_ids names only "
              "unknown ids)");
  }
  return absl::OkStatus();
}

absl::Status Router::PriceRanks(const Prepared& prepared, const RankCandidates& ranks,
                                Selection& out) const {
  const SelectionInput input{.prompt_tokens = prepared.prompt_tokens,
                             .block_size = options_.block_size,
                             .candidates = ranks.candidates,
                             .allowed_worker_ids = {}};
  return PriceCandidates(input, prepared.config, out);
}

void Router::PickLocked(const Prepared& prepared, Selection& priced) {
  PickCandidate(prepared.config, *random_, priced);
  // A preferred rank (previewed, or a soft session binding) wins while it is still a candidate.
  if (prepared.preferred) {
    for (size_t i = 0; i < priced.costs.size(); ++i) {
      if (priced.costs[i].worker == *prepared.preferred) priced.chosen = i;
    }
  }
}

absl::Status Router::SelectLocked(const Prepared& prepared, Selection& out) {
  RankCandidates ranks;
  if (auto status = CandidatesLocked(prepared, ranks); !status.ok()) return status;
  if (auto status = PriceRanks(prepared, ranks, out); !status.ok()) return status;
  PickLocked(prepared, out);
  return absl::OkStatus();
}

absl::Status Router::BookLocked(const Prepared& prepared, const CandidateCost& chosen,
                                absl::FunctionRef<void()> complete) {
  std::vector<uint64_t> random_ids;
  std::span<const uint64_t> block_ids = prepared.tracking_ids;
  if (!prepared.config.assume_kv_reuse) {
    // Fresh identities: this request's blocks are never counted as shared with another's.
    random_ids.resize(prepared.local_hashes.size());
    for (uint64_t& id : random_ids) id = random_->NextU64();
    block_ids = random_ids;
  }
  const uint64_t prefill_tokens =
      prepared.config.track_prefill_tokens ? prepared.prompt_tokens - chosen.cached_tokens : 0;
  const SequenceRequest request{.request_id = prepared.request_id,
                                .worker = chosen.worker,
                                .block_ids = block_ids,
                                .prefill_tokens = prefill_tokens,
                                .expected_output_tokens = prepared.expected_output_tokens,
                                .prompt_tokens = prepared.prompt_tokens};
  // Booking writes no approximate-index record: that is left for the dispatch
  // (CommitDecisionLocked), so a plan that is aborted leaves no trace in the index.
  return AddBookingLocked(request, complete);
}

void Router::CommitDecisionLocked(const Prepared& prepared, WorkerKey worker) {
  // The binding first: undone when the approximate index's record is refused.
  std::optional<SessionTable::Previous> previous;
  if (!prepared.session_id.empty()) {
    previous = sessions_.Bind(prepared.session_id, worker, prepared.session_ttl_seconds);
  }
  if (approx_) {
    try {
      approx_->RecordRoutingDecision(worker, prepared.local_hashes, prepared.sequence_hashes);
    } catch (...) {
      if (previous) sessions_.Restore(prepared.session_id, *previous);
      throw;
    }
  }
}

// A plan is kept until it is committed or aborted, so it keeps only what a retried Plan and
// a Commit read: the decision with its chosen candidate alone (a thousand candidates of 160
// bytes each at 1,000 ranks), and of the prepared request what the dispatch leaves behind.
RouteDecision Router::PlanRecordOf(RouteDecision& decision) {
  std::vector<CandidateCost> all = std::move(decision.candidates);
  RouteDecision kept = decision;
  kept.candidates.assign(1, all[decision.chosen]);
  kept.chosen = 0;
  decision.candidates = std::move(all);
  return kept;
}

std::unique_ptr<Router::Prepared> Router::WhatCommitNeeds(const Prepared& prepared) const {
  auto kept = std::make_unique<Prepared>();
  kept->request_id = prepared.request_id;
  if (approx_) {
    kept->local_hashes = prepared.local_hashes;
    kept->sequence_hashes = prepared.sequence_hashes;
  }
  kept->session_id = prepared.session_id;
  kept->session_ttl_seconds = prepared.session_ttl_seconds;
  return kept;
}

absl::StatusOr<RouteDecision> Router::DecideLocked(const Prepared& prepared) {
  if (auto status = CheckPinLocked(prepared); !status.ok()) return status;
  Selection selection;
  if (auto status = SelectLocked(prepared, selection); !status.ok()) return status;
  return BookSelectionLocked(prepared, selection);
}

std::optional<absl::StatusOr<RouteDecision>> Router::DecidePricedOutsideLocked(
    const Prepared& prepared, std::unique_lock<AdaptiveMutex>& gate) {
  // Reused per thread, as Admit's Prepared is: only until this decision is made. (The costs
  // are not: they move into the decision.)
  thread_local RankCandidates ranks;
  Selection selection;
  if (auto status = CheckPinLocked(prepared); !status.ok()) return status;
  if (auto status = CandidatesLocked(prepared, ranks); !status.ok()) return status;
  // What must be as it was for the pick to stand (beside the winner's load): nothing queued or
  // dequeued meanwhile (a request now waiting must not be overtaken), the session bound where
  // it was (it steered this request).
  const auto queue_state = std::make_pair(next_ticket_, queue_.size());
  const std::optional<WorkerKey> binding =
      prepared.session_id.empty() ? std::nullopt : sessions_.Binding(prepared.session_id);
  gate.unlock();
  const absl::Status priced = PriceRanks(prepared, ranks, selection);
  if (pricing_pause_) pricing_pause_();
  gate.lock();
  // A failure may be stale (a worker added meanwhile): decided again under the gate, as is a
  // decision that collided with another caller's.
  if (!priced.ok()) return std::nullopt;
  const auto again = [this] {
    decisions_priced_again_.fetch_add(1, std::memory_order_relaxed);
    return std::nullopt;
  };
  if (std::make_pair(next_ticket_, queue_.size()) != queue_state ||
      (!prepared.session_id.empty() && sessions_.Binding(prepared.session_id) != binding) ||
      (prepared.with_admission && !CheckNewRequestIdLocked(prepared.request_id).ok())) {
    return again();
  }
  PickLocked(prepared, selection);
  // The winner's load must be the one priced. Other ranks' loads may have moved: one that grew
  // rarely matters (it was already dearer; only the credit decay's baseline, the least prefill
  // in flight, can shift with it), and one that shrank is missed as if this request had come a
  // moment earlier. Under softmax (temperature > 0) the draw is from the distribution priced.
  if (!active_.LoadUnchanged(selection.winner().worker, ranks.versions[selection.chosen])) {
    return again();
  }
  return BookSelectionLocked(prepared, selection);
}

absl::StatusOr<RouteDecision> Router::BookSelectionLocked(const Prepared& prepared,
                                                          Selection& selection) {
  // Stays valid when the costs move into the decision (their buffer moves with them).
  const CandidateCost& winner = selection.winner();
  RouteDecision decision;
  decision.moved_from_preferred = prepared.preferred && winner.worker != *prepared.preferred;
  decision.potential_decode_blocks = winner.decode_blocks;
  if (const WorkerConfig* config = registry_.Find(winner.worker.worker_id)) {
    decision.total_kv_blocks = config->total_kv_blocks;
  }
  decision.worker = winner.worker;
  decision.device_overlap_blocks = winner.overlap.device_blocks;
  decision.effective_overlap_blocks = winner.effective_overlap_blocks;
  decision.cached_tokens = winner.cached_tokens;
  decision.prompt_tokens = prepared.prompt_tokens;
  decision.prompt_blocks = static_cast<uint32_t>(prepared.local_hashes.size());
  decision.booked = prepared.with_admission;
  decision.chosen = selection.chosen;
  decision.candidates = std::move(selection.costs);
  if (!prepared.with_admission) return decision;
  // Booked whole or not at all: the booking, then what completes it, which a refused
  // allocation undoes with the booking (BookLocked); what a plan keeps is made before either.
  absl::Status status;
  if (prepared.hold_as_plan) {
    decision.planned = true;
    RouteDecision record = PlanRecordOf(decision);
    std::unique_ptr<Prepared> payload = WhatCommitNeeds(prepared);
    status = BookLocked(prepared, winner, [&] {
      // Replaces a plan that lost its booking (its worker removed) under the same id.
      plans_.Add(prepared.request_id, std::move(record), clock_.Now(), std::move(payload));
      UseSessionLocked(prepared);
    });
  } else {
    // Booking without a plan is a dispatch at once (FindBestMatch with admission).
    status = BookLocked(prepared, winner, [&] {
      CommitDecisionLocked(prepared, winner.worker);
      // A plan left under this id lost its booking with its worker (else the id would still
      // be active): the new booking is not that plan's, so a retried plan must not answer
      // with it.
      plans_.Erase(prepared.request_id);
    });
  }
  if (!status.ok()) return status;
  return decision;
}

absl::Status Router::CheckNewRequestIdLocked(std::string_view request_id) const {
  if (request_id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a request id of ", request_id.size(),
                                                   " bytes (at most ", kMaxRequestIdBytes, ")"));
  }
  if (IsReplicaRequestId(request_id)) {
    return absl::InvalidArgumentError(
        "request ids starting with byte 0x1E are reserved (they name replicas' bookings)");
  }
  if (active_.HasRequest(request_id) || queue_.Contains(request_id)) {
    return absl::AlreadyExistsError(absl::StrCat("request id '", AsAbsl(request_id),
                                                 "' is already active or waiting for admission"));
  }
  return absl::OkStatus();
}

}  // namespace kvrouter

// Router replicas (reference §7.5) on the Router: telling the observer of every change to
// this router's own bookings, announcing them to a joining replica, and applying other
// replicas' changes under names of their own. Encoding and transport are above the core
// (ingest/replica_sync.*).
#include <algorithm>
#include <cstdint>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/router.h"
#include "core/router_internal.h"

namespace kvrouter {

using router_internal::AsAbsl;

// ---------------------------------------------------------------------------------------------
// Router replicas

absl::Status ValidateReplicaId(std::string_view replica_id) {
  if (replica_id.empty()) return absl::InvalidArgumentError("the replica id is empty");
  if (replica_id.find('\x1f') != std::string_view::npos) {
    return absl::InvalidArgumentError("a replica id must not contain byte 0x1F");
  }
  if (replica_id.size() > kMaxReplicaIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a replica id of ", replica_id.size(),
                                                   " bytes (at most ", kMaxReplicaIdBytes, ")"));
  }
  return absl::OkStatus();
}

namespace {

// A change that names only its request (prefill completed, freed).
SequenceChange ChangeOf(SequenceChange::Kind kind, std::string_view request_id) {
  SequenceChange change;
  change.kind = kind;
  change.request_id = request_id;
  return change;
}

// A booking, as the change that announces it (with its age when announced again: its peers
// expire it when this router does).
SequenceChange AddedChange(const SequenceRequest& booking) {
  constexpr Nanos kNanosPerMilli = 1'000'000;
  const Nanos age_ms = std::max<Nanos>(booking.booked_ago, 0) / kNanosPerMilli;
  return {.kind = SequenceChange::Kind::kAdded,
          .request_id = booking.request_id,
          .worker = booking.worker,
          .block_ids = booking.block_ids,
          .prefill_tokens = booking.prefill_tokens,
          .expected_output_tokens = booking.expected_output_tokens,
          .booked_ms_ago = static_cast<uint32_t>(std::min<Nanos>(age_ms, UINT32_MAX))};
}

// The name a replica's booking has here: the mark, the origin, a separator, its own id.
constexpr char kReplicaIdSeparator = '\x1f';
std::string ReplicaRequestId(std::string_view origin, std::string_view request_id) {
  return absl::StrCat(absl::string_view(&kReplicaRequestIdMark, 1), AsAbsl(origin),
                      absl::string_view(&kReplicaIdSeparator, 1), AsAbsl(request_id));
}

// Whether `booking` is a name ReplicaRequestId gave a booking of `origin`; allocates nothing.
bool IsBookingOf(std::string_view booking, std::string_view origin) {
  return booking.size() > origin.size() + 1 && booking.front() == kReplicaRequestIdMark &&
         booking.substr(1, origin.size()) == origin &&
         booking[origin.size() + 1] == kReplicaIdSeparator;
}

}  // namespace

absl::Status Router::AddBookingLocked(const SequenceRequest& request,
                                      absl::FunctionRef<void()> complete) {
  if (absl::Status status = active_.AddRequest(request); !status.ok()) return status;
  try {
    complete();
  } catch (...) {
    active_.Free(request.request_id);  // allocates nothing
    throw;
  }
  NotifyLocked(AddedChange(request));
  return absl::OkStatus();
}

bool Router::MarkPrefillCompletedLocked(std::string_view request_id) {
  if (!active_.MarkPrefillCompleted(request_id)) return false;
  NotifyLocked(ChangeOf(SequenceChange::Kind::kPrefillCompleted, request_id));
  return true;
}

bool Router::FreeBookingLocked(std::string_view request_id) {
  if (!active_.Free(request_id)) return false;
  NotifyLocked(ChangeOf(SequenceChange::Kind::kFreed, request_id));
  return true;
}

void Router::NotifyLocked(const SequenceChange& change) {
  // Joins left waiting past their due time (no heartbeat came) are answered before it too.
  if ((reannounce_pending_ || JoinAnswerDueLocked()) &&
      change.kind != SequenceChange::Kind::kReset) {
    // A change the observer lost left the other replicas with a wrong view of this one's
    // bookings: announcing them all again (a Reset, then each booking) repairs it. Before this
    // change, not after: a peer ends an announcement at the origin's next change of another
    // kind, so a Heartbeat or SyncRequest sent after a Reset whose bookings were lost would
    // have it drop them. Not before a Reset: a farewell says there are none.
    AnnounceBookingsLocked();
    // The announcement says what a booking change says. Any other change goes after it, even
    // if a booking of it was lost: peers then end it, dropping only what they were not told
    // (a booking that cannot be published at all must not stop every later change).
    if (NamesARequest(change.kind)) return;
  }
  if (!observer_.Notify(change)) LostNotificationLocked();
}

void Router::LostNotificationLocked() {
  ++replica_changes_unpublished_;
  reannounce_pending_ = true;
}

uint64_t Router::SetSequenceObserver(std::string replica_id, SequenceObserver observer) {
  std::lock_guard lock(gate_);
  // The observer replaced or cleared says farewell first, on its own transport: its peers drop
  // what they hold under its replica id, which nothing would free once it is gone (the new one
  // publishes under its own id, or nothing is published).
  if (observer_.active()) SayFarewellLocked();
  const uint64_t token = observer_.Set(std::move(replica_id), std::move(observer));
  if (token == 0) {
    ForgetPendingAnnouncementLocked();  // nobody to repair
    return 0;
  }
  JoinReplicasLocked();
  return token;
}

bool Router::RejoinReplicas(uint64_t token) {
  std::lock_guard lock(gate_);
  if (!observer_.IsCurrent(token)) return false;
  JoinReplicasLocked();
  return true;
}

void Router::JoinReplicasLocked() {
  AnnounceBookingsLocked();
  NotifyLocked(ChangeOf(SequenceChange::Kind::kSyncRequest, ""));
}

void Router::SilenceSequenceObserverForTesting() {
  std::lock_guard lock(gate_);
  (void)observer_.Set("", nullptr);  // keeps the replica id, as clearing does
  ForgetPendingAnnouncementLocked();
}

bool Router::ClearSequenceObserver(uint64_t token, bool farewell) {
  std::lock_guard lock(gate_);
  if (farewell && observer_.IsCurrent(token)) SayFarewellLocked();
  const bool cleared = observer_.Clear(token);
  if (!observer_.active()) ForgetPendingAnnouncementLocked();  // nobody to repair
  return cleared;
}

void Router::SayFarewellLocked() {
  observer_.Promise(0);  // a Reset promising nothing: its peers stop tracking it at once
  NotifyLocked(ChangeOf(SequenceChange::Kind::kReset, ""));
}

void Router::AnnounceBookingsLocked() {
  // Never throws: it runs after the change it follows was committed. What the observer loses
  // on the way (or the heap refuses: a booking's copy) is lost like any change, and the whole
  // is announced again later. A booking lost is left out and the others still go: peers end
  // the announcement at this router's next change, dropping only what they were not told.
  ForgetPendingAnnouncementLocked();
  last_announcement_ = clock_.Now();
  const auto is_local = [](std::string_view id) { return !IsReplicaRequestId(id); };
  SequenceChange reset = ChangeOf(SequenceChange::Kind::kReset, "");
  reset.announced_bookings =
      static_cast<uint32_t>(std::min<size_t>(active_.CountRequests(is_local), UINT32_MAX));
  try {
    if (!observer_.Notify(reset)) {
      LostNotificationLocked();
      return;
    }
    active_.ForEachRequest(is_local, [&](const SequenceRequest& booking) {
      bool published = false;
      try {
        published = observer_.Notify(AddedChange(booking));
      } catch (const std::bad_alloc&) {
      }
      if (!published) LostNotificationLocked();
    });
  } catch (const std::bad_alloc&) {
    LostNotificationLocked();
  }
}

bool Router::DropReplicaBookingsLocked(std::string_view origin) {
  // Allocates nothing: an expiry under refused memory never leaves an origin untracked with
  // its bookings still held.
  (void)announcements_.End(origin);
  return active_.FreeIf([&](std::string_view booking) { return IsBookingOf(booking, origin); }) > 0;
}

bool Router::ResetReplicaLocked(std::string_view origin, uint32_t count) {
  bool dropped = false;
  if (count > 0) {
    try {
      ReplicaAnnouncements::Names held;
      active_.ForEachRequest(
          [&](std::string_view booking) { return IsBookingOf(booking, origin); },
          [&](const SequenceRequest& booking) { held.emplace(booking.request_id); });
      // Holding nothing from it, there is nothing to keep: its bookings are simply added.
      if (held.empty()) return DropReplicaBookingsLocked(origin);
      if (!announcements_.Announcing(origin) && announcements_.full()) {
        dropped = DropNotAnnouncedLocked(announcements_.EndOldest());  // stalled: ended
      }
      announcements_.Begin(origin, count, std::move(held));
      return dropped;
    } catch (const std::bad_alloc&) {
      // Its bookings go at once, as from a sender that does not say how many follow.
    }
  }
  return DropReplicaBookingsLocked(origin) || dropped;
}

absl::StatusOr<bool> Router::AddReplicaBookingLocked(std::string_view origin, const std::string& id,
                                                     const SequenceChange& change, bool& released) {
  const SequenceRequest booking{.request_id = id,
                                .worker = change.worker,
                                .block_ids = change.block_ids,
                                .prefill_tokens = change.prefill_tokens,
                                .expected_output_tokens = change.expected_output_tokens,
                                .prompt_tokens = 0,  // output is not replicated
                                .booked_ago = MillisToNanos(change.booked_ms_ago)};
  if (!announcements_.Announcing(origin)) {
    absl::Status status = active_.AddRequest(booking);  // may throw: nothing changed
    if (!status.ok()) return status;
    return true;
  }
  // Announced: it replaces the copy held from before the announcement. Refused (a repeat, an
  // unknown rank), it changes nothing, nor counts among those announced.
  const bool held = active_.HasRequest(id);
  if (held && !announcements_.HeldBefore(origin, id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("replica booking '", AsAbsl(change.request_id), "' announced twice"));
  }
  if (!active_.HasWorker(change.worker)) return UnknownRankError(change.worker);
  if (held) released |= active_.Free(id);
  absl::Status status;
  try {
    status = active_.AddRequest(booking);
  } catch (const std::bad_alloc&) {
    // Its old copy is gone: as a booking the origin did not announce again.
    status = absl::ResourceExhaustedError("memory refused for a replica's booking announced again");
  }
  if (announcements_.Announced(origin, id)) released |= EndAnnouncementLocked(origin);
  if (!status.ok()) return status;
  return true;
}

bool Router::EndAnnouncementLocked(std::string_view origin) {
  return DropNotAnnouncedLocked(announcements_.End(origin));
}

bool Router::DropNotAnnouncedLocked(const ReplicaAnnouncements::Names& not_announced_again) {
  bool dropped = false;
  for (const std::string& name : not_announced_again) dropped |= active_.Free(name);
  return dropped;
}

absl::StatusOr<bool> Router::ApplyReplicaChange(std::string_view origin,
                                                const SequenceChange& change) {
  const bool names_a_request = NamesARequest(change.kind);
  absl::Status valid = ValidateReplicaId(origin);
  if (valid.ok() && names_a_request && change.request_id.empty()) {
    valid = absl::InvalidArgumentError("a replica change needs a request id");
  }
  // Summed into its rank's load: a peer's absurd figure must not wrap the sum (two of 2^63
  // made the rank look idle).
  if (valid.ok() && change.prefill_tokens > kMaxReplicaPrefillTokens) {
    valid = absl::InvalidArgumentError(absl::StrCat("a replica booking of ", change.prefill_tokens,
                                                    " prefill tokens (at most 2^32)"));
  }
  if (!valid.ok()) {
    std::lock_guard lock(gate_);
    ++replica_changes_rejected_;
    return valid;
  }
  const std::string id = ReplicaRequestId(origin, change.request_id);
  Completions completions;
  absl::StatusOr<bool> changed = false;
  {
    std::lock_guard lock(gate_);
    if (observer_.IsOwnOrigin(origin)) return false;  // our own change, echoed back
    const bool ask_again = TrackLivenessLocked(origin, change);
    // Load a booking replaced or dropped by an announcement released, or lost requests expired.
    bool released = MaybeSweepLocked();
    // The origin sends nothing between its announced bookings: any other change ends them (a
    // Reset begins a new announcement instead, over every booking held from the origin).
    if (change.kind != SequenceChange::Kind::kAdded &&
        change.kind != SequenceChange::Kind::kReset) {
      released |= EndAnnouncementLocked(origin);
    }
    switch (change.kind) {
      case SequenceChange::Kind::kAdded:
        changed = AddReplicaBookingLocked(origin, id, change, released);
        break;
      case SequenceChange::Kind::kPrefillCompleted:
        changed = active_.MarkPrefillCompleted(id);
        break;
      case SequenceChange::Kind::kFreed:
        changed = active_.Free(id);
        break;
      case SequenceChange::Kind::kReset:
        // A replica joining or announcing again (its bookings follow) or leaving: either way
        // its bookings so far go, once those that follow have come.
        changed = ResetReplicaLocked(origin, change.announced_bookings);
        break;
      case SequenceChange::Kind::kSyncRequest:
        AnswerSyncRequestLocked(change.request_id);
        break;
      case SequenceChange::Kind::kHeartbeat:  // its liveness is all it changes
        break;
    }
    if (ask_again) AskToAnnounceAgainLocked(origin);
    AnnounceIfAnswerDueLocked();
    ++(changed.ok() ? replica_changes_applied_ : replica_changes_rejected_);
    // Capacity a replica released may admit requests waiting here.
    if (released || (changed.ok() && *changed && change.kind != SequenceChange::Kind::kAdded)) {
      DrainQueueLocked(completions);
    }
  }
  Run(completions);
  return changed;
}

bool Router::TrackLivenessLocked(std::string_view origin, const SequenceChange& change) {
  const Nanos now = clock_.Now();
  // A peer promising a longer interval than any replica may keep (UINT32_MAX ms: 149 days,
  // never expired in practice) is held to the longest.
  const Nanos interval =
      MillisToNanos(std::min(change.heartbeat_interval_ms, kMaxHeartbeatIntervalMs));
  const bool promises_heartbeats = change.heartbeat_interval_ms > 0;
  if (change.kind == SequenceChange::Kind::kReset) {
    // Its whole state follows (or it left): an expiry here no longer matters.
    liveness_.Restarted(origin, promises_heartbeats);
    if (promises_heartbeats) liveness_.Beat(origin, interval, now);
    return false;
  }
  // A heartbeat, or any change carrying the interval its origin beats at: a receiver that
  // missed the heartbeats still learns to expire the origin.
  if (change.kind == SequenceChange::Kind::kHeartbeat || promises_heartbeats) {
    return liveness_.Beat(origin, interval, now);
  }
  liveness_.Heard(origin, now);
  return false;
}

void Router::AskToAnnounceAgainLocked(std::string_view origin) {
  // This router dropped the origin's bookings (it expired it), but the origin lives on: it was
  // cut off or stalled past the timeout. Without a publisher here, they stay dropped until the
  // origin announces them for a reason of its own (it restarts, or another replica asks).
  if (observer_.active()) NotifyLocked(ChangeOf(SequenceChange::Kind::kSyncRequest, origin));
}

void Router::AnswerSyncRequestLocked(std::string_view asked) {
  if (!observer_.active()) return;
  if (asked.empty()) {
    // A replica joined: tell it (and everyone) what is booked here. After a server restart
    // every replica rejoins at about the same time (RejoinReplicas), and answering each joiner
    // at once would announce every booking once per joiner: N^2 announcements for N replicas,
    // under this lock. A router that beats answers joins close together with one announcement.
    const Nanos now = clock_.Now();
    if (!CanDeferJoinAnswerLocked(now)) {
      AnnounceBookingsLocked();
      return;
    }
    // Made by the next heartbeat. Not before this router's next change, as a repair is: this
    // is no announcement cut short, and changes going first change nothing the Reset will not
    // replace (a busy router changes its bookings every few milliseconds: it would announce
    // for every join). Should the heartbeat not come (a caller that beats by hand stopped),
    // the first change (this router's or a replica's) or expiry check past one and a half
    // intervals makes it: half an interval of slack for a heartbeat timer running late.
    if (!join_answer_due_) {
      const Nanos interval = MillisToNanos(observer_.promised_interval_ms());
      join_answer_due_ = now + interval + interval / 2;
    }
  } else if (observer_.IsOwnOrigin(asked)) {
    // A peer had expired this router. Announced with the next heartbeat or change, not now:
    // after an outage every peer asks at about the same time, and one announcement answers
    // them all.
    reannounce_pending_ = true;
  }
}

bool Router::CanDeferJoinAnswerLocked(Nanos now) const {
  // Longer intervals would leave a joiner without this router's bookings too long.
  constexpr Nanos kMaxJoinAnswerDeferral = 2 * kNanosPerSecond;
  const Nanos interval = MillisToNanos(observer_.promised_interval_ms());
  const auto within_interval = [&](const std::optional<Nanos>& when) {
    return when && *when <= now && now - *when < interval;
  };
  return interval > 0 && interval <= kMaxJoinAnswerDeferral && within_interval(last_heartbeat_) &&
         within_interval(last_announcement_);
}

bool Router::JoinAnswerDueLocked() const {
  return join_answer_due_ && clock_.Now() >= *join_answer_due_;  // no clock read otherwise
}

void Router::AnnounceIfAnswerDueLocked() {
  if (observer_.active() && JoinAnswerDueLocked()) AnnounceBookingsLocked();
}

void Router::ForgetPendingAnnouncementLocked() {
  reannounce_pending_ = false;
  join_answer_due_.reset();
}

bool Router::PublishHeartbeat(uint32_t interval_ms) {
  std::lock_guard lock(gate_);
  if (!observer_.active()) return false;
  observer_.Promise(interval_ms);
  last_heartbeat_ = clock_.Now();
  if (join_answer_due_) AnnounceBookingsLocked();  // the joins of the last interval
  NotifyLocked(ChangeOf(SequenceChange::Kind::kHeartbeat, ""));
  return true;
}

size_t Router::ExpireSilentReplicas(Nanos timeout) {
  Completions completions;
  size_t expired = 0;
  {
    std::lock_guard lock(gate_);
    AnnounceIfAnswerDueLocked();
    for (const std::string& origin : liveness_.TakeSilent(clock_.Now(), timeout)) {
      DropReplicaBookingsLocked(origin);
      ++expired;
    }
    replicas_expired_ += expired;
    // Capacity a dead replica held may admit requests waiting here.
    if (expired > 0) DrainQueueLocked(completions);
  }
  Run(completions);
  return expired;
}

size_t Router::ForgetReplicas() {
  Completions completions;
  size_t dropped = 0;
  {
    std::lock_guard lock(gate_);
    dropped = active_.FreeIf(IsReplicaRequestId);  // allocates nothing
    liveness_.Forget();
    announcements_.ForgetAll();
    if (dropped > 0) DrainQueueLocked(completions);
  }
  Run(completions);
  return dropped;
}

Router::ReplicaStats Router::replica_stats() const {
  std::lock_guard lock(gate_);
  return {.changes_applied = replica_changes_applied_,
          .changes_rejected = replica_changes_rejected_ +
                              replica_changes_undecodable_.load(std::memory_order_relaxed),
          .active_requests = active_.CountRequests(IsReplicaRequestId),
          .live = liveness_.live(),
          .expired = replicas_expired_,
          .changes_unpublished = replica_changes_unpublished_,
          .announcing = announcements_.size()};
}

void Router::CountRejectedReplicaChange() {
  replica_changes_undecodable_.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace kvrouter

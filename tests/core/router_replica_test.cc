// Router replica sync in the core: two routers over the same workers, each publishing its
// booking changes through SetSequenceObserver and applying the other's with
// ApplyReplicaChange. The transport here is a queue the test drains by hand; over the wire it
// is NATS (tests/ingest/replica_sync_test.cc).
#include <gtest/gtest.h>

#include <deque>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/router.h"

namespace kvrouter {
namespace {

constexpr uint32_t kBlockSize = 4;

std::vector<uint32_t> Tokens(size_t blocks, uint32_t first) {
  std::vector<uint32_t> tokens(blocks * kBlockSize);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = first + static_cast<uint32_t>(i);
  return tokens;
}

WorkerConfig Worker(uint64_t id, uint64_t max_batched = 0) {
  return WorkerConfig{.worker_id = id,
                      .total_kv_blocks = 10'000,
                      .max_num_batched_tokens = max_batched,
                      .block_size = kBlockSize};
}

// A change copied out of the observer (its views die with the call).
struct Published {
  SequenceChange::Kind kind;
  std::string request_id;
  WorkerKey worker;
  std::vector<uint64_t> block_ids;
  uint64_t prefill_tokens;
  uint32_t expected_output_tokens;
  uint32_t heartbeat_interval_ms;
  uint32_t booked_ms_ago = 0;
  uint32_t announced_bookings = 0;

  // A copy of what an observer was told (its views end with the call).
  static Published Of(const SequenceChange& c) {
    return {c.kind,
            std::string(c.request_id),
            c.worker,
            std::vector<uint64_t>(c.block_ids.begin(), c.block_ids.end()),
            c.prefill_tokens,
            c.expected_output_tokens,
            c.heartbeat_interval_ms,
            c.booked_ms_ago,
            c.announced_bookings};
  }
  SequenceChange View() const {
    return {.kind = kind,
            .request_id = request_id,
            .worker = worker,
            .block_ids = block_ids,
            .prefill_tokens = prefill_tokens,
            .expected_output_tokens = expected_output_tokens,
            .heartbeat_interval_ms = heartbeat_interval_ms,
            .booked_ms_ago = booked_ms_ago,
            .announced_bookings = announced_bookings};
  }
};

// The liveness timeout b applies.
constexpr Nanos kTimeout = 10 * kNanosPerSecond;

class RouterReplicaTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(RouterOptions{}); }

  void Make(RouterOptions options, uint64_t max_batched = 0) {
    options.block_size = kBlockSize;
    options.clock = &clock_;
    a_ = *Router::Create(options);
    b_ = *Router::Create(options);
    for (uint64_t w : {1, 2}) {
      ASSERT_TRUE(a_->AddWorker(Worker(w, max_batched)).ok());
      ASSERT_TRUE(b_->AddWorker(Worker(w, max_batched)).ok());
    }
    a_token_ = a_->SetSequenceObserver("a", [this](const SequenceChange& c) {
      if (refuse_nth_ > 0 && --refuse_nth_ == 0) refuse_to_publish_ = 1;
      if (!refuse_id_.empty() && c.request_id == refuse_id_) throw std::bad_alloc();
      if (refuse_to_publish_ > 0) {
        --refuse_to_publish_;
        throw std::bad_alloc();  // as encoding the change would when memory runs out
      }
      Record(c);
    });
    // A new observer first announces: Reset, a's bookings (none yet), SyncRequest.
    EXPECT_EQ(from_a_.size(), 2u);
    Deliver();
  }

  void Record(const SequenceChange& c) { from_a_.push_back(Published::Of(c)); }

  // Delivers what `a` published so far to `b`; returns how many changes applied.
  int Deliver() {
    int applied = 0;
    while (!from_a_.empty()) applied += DeliverOne() ? 1 : 0;
    return applied;
  }

  // Delivers the first change `a` published and not yet delivered; whether it changed b.
  bool DeliverOne() {
    absl::StatusOr<bool> changed = b_->ApplyReplicaChange("a", from_a_.front().View());
    from_a_.pop_front();
    EXPECT_TRUE(changed.ok()) << changed.status();
    return changed.value_or(false);
  }

  // A replica "c" joins: its SyncRequest has `a` announce its bookings (Reset, then each).
  void AskAToAnnounce() {
    // Past a's heartbeat interval (1 s in these tests) since it last announced (joining): it
    // answers at once.
    clock_.AdvanceSeconds(1.5);
    ASSERT_TRUE(a_->ApplyReplicaChange("c", {.kind = SequenceChange::Kind::kSyncRequest}).ok());
    ASSERT_FALSE(from_a_.empty());
    ASSERT_EQ(from_a_.front().kind, SequenceChange::Kind::kReset);
  }

  static WorkerLoad LoadOf(const Router& router, uint64_t worker) {
    for (const WorkerLoad& load : router.Loads()) {
      if (load.worker.worker_id == worker) return load;
    }
    return {};
  }

  // a books both workers past the busy rule (more than 10 prefill tokens in flight), then b
  // routes a request that must wait in its queue; `admitted` is set once b admits it.
  void QueueBehindTheOthersBookings(bool& admitted, bool heartbeat = false) {
    RouterOptions options;
    options.queue_threshold = 1.0;
    Make(options, /*max_batched=*/10);
    if (heartbeat) {
      ASSERT_TRUE(a_->PublishHeartbeat(1000));
    }
    ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}, {}).ok());
    ASSERT_TRUE(a_->AddRequest("r2", Tokens(3, 100), {2, 0}, {}).ok());
    Deliver();
    b_->FindBestMatchAsync(Tokens(3, 500), {.with_admission = true, .request_id = "waits"},
                           [&](absl::StatusOr<RouteDecision> d) { admitted = d.ok(); });
  }

  // b publishes too (what it says is kept in from_b_, never delivered on its own); the
  // announcement it makes on joining is dropped.
  void LetBPublish() {
    b_->SetSequenceObserver(
        "b", [this](const SequenceChange& c) { from_b_.push_back(Published::Of(c)); });
    from_b_.clear();
  }

  // a beats and books r1, b hears both, then a falls silent past b's timeout.
  void ExpireAHoldingR1() {
    ASSERT_TRUE(a_->PublishHeartbeat(1000));
    ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}, {}).ok());
    Deliver();
    clock_.AdvanceSeconds(11);
    ASSERT_EQ(b_->ExpireSilentReplicas(kTimeout), 1u);
    ASSERT_EQ(LoadOf(*b_, 1).active_requests, 0u);
  }

  ManualClock clock_;
  std::unique_ptr<Router> a_, b_;
  uint64_t a_token_ = 0;
  std::deque<Published> from_a_, from_b_;
  int refuse_to_publish_ = 0;  // a's observer throws std::bad_alloc this many times
  int refuse_nth_ = 0;         // ... or refuses its n-th publication from now
  std::string refuse_id_;      // ... and every change naming this request
};

TEST_F(RouterReplicaTest, AChangeLostForMemoryIsCountedAndRepairedByTheNextOneThatGetsThrough) {
  // The booking is made; only its publication is lost. The call must not fail for it.
  refuse_to_publish_ = 1;
  ASSERT_TRUE(a_->FindBestMatch(Tokens(5, 0), {.with_admission = true, .request_id = "r1"}).ok());
  EXPECT_TRUE(from_a_.empty());
  EXPECT_EQ(a_->replica_stats().changes_unpublished, 1u);
  EXPECT_EQ(b_->replica_stats().active_requests, 0u);

  // The next change is a's whole picture instead, itself included: Reset, r1, r2.
  ASSERT_TRUE(a_->FindBestMatch(Tokens(5, 100), {.with_admission = true, .request_id = "r2"}).ok());
  ASSERT_EQ(from_a_.size(), 3u);
  EXPECT_EQ(from_a_[0].kind, SequenceChange::Kind::kReset);
  EXPECT_EQ(from_a_[0].announced_bookings, 2u);
  Deliver();
  EXPECT_EQ(b_->replica_stats().active_requests, 2u);

  // A lost free: b keeps r1 until the next change repairs it.
  refuse_to_publish_ = 1;
  EXPECT_TRUE(a_->Free("r1"));
  EXPECT_EQ(a_->replica_stats().changes_unpublished, 2u);
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  Deliver();
  EXPECT_EQ(b_->replica_stats().active_requests, 1u);
  for (uint64_t w : {1, 2}) {
    EXPECT_EQ(LoadOf(*b_, w).active_blocks, LoadOf(*a_, w).active_blocks) << "worker " << w;
  }
  // Repaired: the next change is sent alone.
  EXPECT_TRUE(a_->Free("r2"));
  EXPECT_EQ(from_a_.size(), 1u);
}

// A transport back from an outage rejoins: every booking announced again, then a SyncRequest;
// a peer that missed a change meanwhile then holds what the origin holds. A stale token (the
// observer replaced) changes nothing.
TEST_F(RouterReplicaTest, RejoiningAnnouncesEveryBookingAndAsksThePeers) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}, {}).ok());
  ASSERT_TRUE(a_->AddRequest("r2", Tokens(2, 100), {2, 0}, {}).ok());
  from_a_.clear();  // lost in the outage
  ASSERT_TRUE(a_->RejoinReplicas(a_token_));
  std::vector<SequenceChange::Kind> kinds;
  for (const Published& change : from_a_) kinds.push_back(change.kind);
  EXPECT_EQ(kinds, (std::vector<SequenceChange::Kind>{
                       SequenceChange::Kind::kReset, SequenceChange::Kind::kAdded,
                       SequenceChange::Kind::kAdded, SequenceChange::Kind::kSyncRequest}));
  Deliver();
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  EXPECT_EQ(LoadOf(*b_, 2).active_requests, 1u);
  EXPECT_FALSE(a_->RejoinReplicas(a_token_ + 1));
  EXPECT_TRUE(from_a_.empty());
}

// How many announcements (Resets) `a` published since the last call.
int CountResets(std::deque<Published>& published) {
  int resets = 0;
  for (const Published& change : published) resets += change.kind == SequenceChange::Kind::kReset;
  published.clear();
  return resets;
}

// Joins close together share one announcement of a router that beats: the first after an
// announcement older than its interval is answered at once, later ones with its next
// heartbeat (after a server restart every replica rejoins at about the same time, and each
// answering every joiner at once made N^2 announcements); the router's own changes meanwhile go
// alone (a busy router would otherwise announce for every join). A router that does not beat
// answers each at once: nothing else would come.
TEST_F(RouterReplicaTest, JoinsCloseTogetherShareTheNextHeartbeatsAnnouncement) {
  const auto join = [&](const char* who) {
    ASSERT_TRUE(a_->ApplyReplicaChange(who, {.kind = SequenceChange::Kind::kSyncRequest}).ok());
  };
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  join("c");
  join("d");
  EXPECT_EQ(CountResets(from_a_), 2);  // not beating: each at once
  clock_.AdvanceSeconds(2);
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  join("e");
  EXPECT_EQ(CountResets(from_a_), 1);  // at once: nothing announced within the interval
  clock_.AdvanceSeconds(0.5);
  join("f");
  ASSERT_TRUE(a_->AddRequest("r2", Tokens(2, 100), {2, 0}).ok());
  join("g");
  ASSERT_EQ(from_a_.size(), 1u);  // within the interval: with the next heartbeat
  EXPECT_EQ(from_a_.front().kind, SequenceChange::Kind::kAdded);  // r2, alone
  from_a_.clear();
  clock_.AdvanceSeconds(0.5);
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  ASSERT_EQ(from_a_.size(), 4u);  // Reset, r1, r2, then the heartbeat
  EXPECT_EQ(from_a_.back().kind, SequenceChange::Kind::kHeartbeat);
  EXPECT_EQ(CountResets(from_a_), 1);
  clock_.AdvanceSeconds(1.5);
  join("h");
  EXPECT_EQ(CountResets(from_a_), 1);  // the last heartbeat a whole interval ago: at once
}

// A deferred answer never waits past one and a half intervals for a heartbeat that does not
// come: the next change (a replica's or a's own) or expiry check after that makes the
// announcement. Nor is an answer
// deferred for a router whose last heartbeat is older than its interval, or whose interval is
// longer than 2 s.
TEST_F(RouterReplicaTest, AJoinWaitsAtMostOneAndAHalfIntervalsForAHeartbeat) {
  const auto join = [&](const char* who) {
    ASSERT_TRUE(a_->ApplyReplicaChange(who, {.kind = SequenceChange::Kind::kSyncRequest}).ok());
  };
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  clock_.AdvanceSeconds(2);  // a's announcement on joining is old
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  join("c");
  ASSERT_EQ(CountResets(from_a_), 1);
  join("d");
  ASSERT_EQ(CountResets(from_a_), 0);
  clock_.AdvanceSeconds(1.4);
  ASSERT_TRUE(a_->ApplyReplicaChange("c", {.kind = SequenceChange::Kind::kHeartbeat}).ok());
  EXPECT_EQ(CountResets(from_a_), 0);  // not due yet
  clock_.AdvanceSeconds(0.2);
  ASSERT_TRUE(a_->ApplyReplicaChange("c", {.kind = SequenceChange::Kind::kHeartbeat}).ok());
  EXPECT_EQ(CountResets(from_a_), 1);  // due: made without the heartbeat
  ASSERT_TRUE(a_->ApplyReplicaChange("c", {.kind = SequenceChange::Kind::kHeartbeat}).ok());
  EXPECT_EQ(CountResets(from_a_), 0);  // once

  // Through the expiry check too. The last heartbeat was 1.6 s ago: a join now is answered
  // at once, so beat again first.
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  join("e");
  EXPECT_EQ(CountResets(from_a_), 0);  // announced 0 s ago: deferred
  clock_.AdvanceSeconds(1.5);
  EXPECT_EQ(a_->ExpireSilentReplicas(kTimeout), 0u);
  EXPECT_EQ(CountResets(from_a_), 1);

  // And through a's own next change: the announcement first, then the change.
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  join("e2");
  clock_.AdvanceSeconds(1.5);
  from_a_.clear();
  ASSERT_TRUE(a_->AddRequest("r2", Tokens(2, 100), {2, 0}).ok());
  ASSERT_EQ(from_a_.size(), 3u);  // Reset, r1, r2: the announcement says what r2's Added says
  EXPECT_EQ(from_a_.front().kind, SequenceChange::Kind::kReset);
  EXPECT_EQ(from_a_.front().announced_bookings, 2u);
  EXPECT_NE(from_a_[1].request_id, from_a_[2].request_id);  // r2 not published twice
  from_a_.clear();

  // A heartbeat older than its interval: the router may have stopped beating.
  clock_.AdvanceSeconds(1);
  join("f");
  EXPECT_EQ(CountResets(from_a_), 1);
  join("g");
  EXPECT_EQ(CountResets(from_a_), 1);
  // An interval over 2 s would leave a joiner without these bookings too long.
  ASSERT_TRUE(a_->PublishHeartbeat(5000));
  join("h");
  join("i");
  EXPECT_EQ(CountResets(from_a_), 2);
  // A new observer has promised nothing: each join at once until it beats.
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  a_token_ = a_->SetSequenceObserver("a", [this](const SequenceChange& c) { Record(c); });
  from_a_.clear();
  join("j");
  EXPECT_EQ(CountResets(from_a_), 1);
}

// An answer waiting for the next heartbeat goes with the observer: a farewell is not preceded
// by it, and a new observer's join announcement answers instead.
TEST_F(RouterReplicaTest, AWaitingAnswerGoesWithItsObserver) {
  const auto join = [&](const char* who) {
    ASSERT_TRUE(a_->ApplyReplicaChange(who, {.kind = SequenceChange::Kind::kSyncRequest}).ok());
  };
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  join("c");  // a announced on joining, 0 s ago: deferred
  from_a_.clear();
  ASSERT_TRUE(a_->ClearSequenceObserver(a_token_, /*farewell=*/true));
  ASSERT_EQ(from_a_.size(), 1u);  // the farewell alone
  EXPECT_EQ(from_a_.front().kind, SequenceChange::Kind::kReset);
  EXPECT_EQ(from_a_.front().announced_bookings, 0u);
  from_a_.clear();

  a_token_ = a_->SetSequenceObserver("a", [this](const SequenceChange& c) { Record(c); });
  EXPECT_EQ(CountResets(from_a_), 1);  // its join announces r1
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  join("d");
  EXPECT_EQ(CountResets(from_a_), 0);
  ASSERT_TRUE(a_->RejoinReplicas(a_token_));  // announces: answers d too
  EXPECT_EQ(CountResets(from_a_), 1);
  clock_.AdvanceSeconds(2);
  ASSERT_TRUE(a_->ApplyReplicaChange("c", {.kind = SequenceChange::Kind::kHeartbeat}).ok());
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  EXPECT_EQ(CountResets(from_a_), 0);  // nothing left waiting
}

// Every replica rejoins at once (a NATS server restarted): each announces its bookings and asks
// the others for theirs. Answered at once, each of N replicas would announce its bookings N
// times; a replica that beats announces them at most once more, with its next heartbeat, also
// while requests come and go between the joins, and every replica still ends up holding every
// other's bookings, also one that missed the first round.
TEST(RouterReplicaMeshTest, ASimultaneousRejoinAnnouncesEachReplicasBookingsAtMostTwice) {
  constexpr int kReplicas = 8;
  constexpr size_t kBookingsEach = 20;
  ManualClock clock;
  std::vector<std::unique_ptr<Router>> routers;
  std::vector<uint64_t> tokens;
  std::deque<std::pair<int, Published>> bus;  // (origin, change)
  std::vector<bool> listening(kReplicas, true);
  size_t added = 0;                              // Addeds of the bookings below
  std::vector<int> announcements(kReplicas, 0);  // Resets
  for (int r = 0; r < kReplicas; ++r) {
    routers.push_back(*Router::Create({.block_size = kBlockSize, .clock = &clock}));
    for (uint64_t w : {1, 2}) ASSERT_TRUE(routers[r]->AddWorker(Worker(w)).ok());
    tokens.push_back(
        routers[r]->SetSequenceObserver(std::to_string(r), [&, r](const SequenceChange& c) {
          added += c.kind == SequenceChange::Kind::kAdded && c.request_id.front() == 'r';
          announcements[r] += c.kind == SequenceChange::Kind::kReset;
          bus.emplace_back(r, Published::Of(c));
        }));
  }
  const auto deliver = [&] {
    while (!bus.empty()) {
      const auto [origin, change] = bus.front();
      bus.pop_front();
      for (int r = 0; r < kReplicas; ++r) {
        if (r == origin || !listening[r]) continue;
        ASSERT_TRUE(routers[r]->ApplyReplicaChange(std::to_string(origin), change.View()).ok());
      }
    }
  };
  const auto beat_all = [&] {
    for (auto& router : routers) ASSERT_TRUE(router->PublishHeartbeat(1000));
  };
  // Every replica books a request and frees it, as a busy gateway does between the joins.
  int traffic = 0;
  const auto book_and_free_everywhere = [&] {
    for (auto& router : routers) {
      const std::string id = "t" + std::to_string(++traffic);
      ASSERT_TRUE(router->AddRequest(id, Tokens(1, 90000), {1, 0}).ok());
      ASSERT_TRUE(router->Free(id));
    }
  };
  beat_all();
  deliver();
  // Replica 0 is cut off: the bookings made meanwhile, and the others' rejoining, never reach
  // it.
  listening[0] = false;
  for (int r = 0; r < kReplicas; ++r) {
    for (size_t b = 0; b < kBookingsEach; ++b) {
      const std::string id = "r" + std::to_string(r) + "-" + std::to_string(b);
      const auto first = static_cast<uint32_t>(1000 * r + 10 * b);
      ASSERT_TRUE(routers[r]->AddRequest(id, Tokens(2, first), {1u + b % 2, 0}).ok());
    }
  }
  deliver();
  clock.AdvanceSeconds(0.5);
  added = 0;
  std::fill(announcements.begin(), announcements.end(), 0);
  for (int r = 1; r < kReplicas; ++r) {
    ASSERT_TRUE(routers[r]->RejoinReplicas(tokens[r]));
    deliver();
    book_and_free_everywhere();
    deliver();
  }
  listening[0] = true;
  ASSERT_TRUE(routers[0]->RejoinReplicas(tokens[0]));
  deliver();
  // Each announced on rejoining; every join it heard came within its heartbeat interval of
  // that announcement: answered with the next heartbeat (answered at once, 1,140 Addeds).
  EXPECT_EQ(added, kReplicas * kBookingsEach);
  EXPECT_EQ(announcements, std::vector<int>(kReplicas, 1));
  EXPECT_EQ(routers[0]->replica_stats().active_requests, 0u);
  clock.AdvanceSeconds(0.5);
  beat_all();
  deliver();
  // Each but replica 0, which heard none of the others' joins, announced once more.
  EXPECT_EQ(added, (2 * kReplicas - 1) * kBookingsEach);
  std::vector<int> twice(kReplicas, 2);
  twice[0] = 1;
  EXPECT_EQ(announcements, twice);
  for (int r = 0; r < kReplicas; ++r) {
    EXPECT_EQ(routers[r]->replica_stats().active_requests, (kReplicas - 1) * kBookingsEach)
        << "replica " << r;
  }
}

TEST_F(RouterReplicaTest, ABookingOnOneReplicaIsLoadOnTheOther) {
  auto decision = a_->FindBestMatch(Tokens(5, 0), {.with_admission = true, .request_id = "r1"});
  ASSERT_TRUE(decision.ok()) << decision.status();
  const uint64_t chosen = decision->worker.worker_id;
  ASSERT_EQ(from_a_.size(), 1u);
  EXPECT_EQ(from_a_.front().kind, SequenceChange::Kind::kAdded);
  EXPECT_EQ(from_a_.front().request_id, "r1");
  EXPECT_EQ(from_a_.front().block_ids.size(), 5u);
  EXPECT_EQ(from_a_.front().prefill_tokens, 20u);
  ASSERT_EQ(Deliver(), 1);

  const WorkerLoad load = LoadOf(*b_, chosen);
  EXPECT_EQ(load.active_requests, 1u);
  EXPECT_EQ(load.active_blocks, 5u);
  EXPECT_EQ(load.active_prefill_tokens, 20u);
  EXPECT_EQ(b_->active_requests(), 1u);
  // So b sends a request with the same prompt size to the other, idle worker.
  auto other = b_->FindBestMatch(Tokens(5, 1000), {});
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->worker.worker_id, chosen);
}

TEST_F(RouterReplicaTest, SharedPrefixBlocksAreCountedOncePerWorker) {
  // Replicas compute the same block identities for the same prompt, so a's request and b's
  // own request with the same prefix on the same worker share their blocks in b's view.
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(4, 0), {1, 0}, {}).ok());
  Deliver();
  ASSERT_TRUE(b_->AddRequest("mine", Tokens(6, 0), {1, 0}, {}).ok());
  EXPECT_EQ(LoadOf(*b_, 1).active_blocks, 6u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 2u);
}

TEST_F(RouterReplicaTest, PrefillCompletedAndFreeFollow) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {2, 0}, {}).ok());
  Deliver();
  EXPECT_EQ(LoadOf(*b_, 2).active_prefill_tokens, 12u);
  EXPECT_TRUE(a_->MarkPrefillCompleted("r1"));
  EXPECT_EQ(Deliver(), 1);
  EXPECT_EQ(LoadOf(*b_, 2).active_prefill_tokens, 0u);
  EXPECT_EQ(LoadOf(*b_, 2).active_blocks, 3u);
  EXPECT_TRUE(a_->Free("r1"));
  EXPECT_EQ(Deliver(), 1);
  EXPECT_EQ(LoadOf(*b_, 2).active_requests, 0u);
  EXPECT_EQ(b_->active_requests(), 0u);
  // Idempotent: the same free again changes nothing.
  EXPECT_FALSE(
      *b_->ApplyReplicaChange("a", {.kind = SequenceChange::Kind::kFreed, .request_id = "r1"}));
}

// What a peer says is bounded: a booking of more prefill tokens than any request has is
// refused (two of 2^63 wrapped the rank's sum to 0, the rank looking idle), and an interval
// longer than an hour counts as an hour (UINT32_MAX ms kept a dead peer for 149 days).
TEST_F(RouterReplicaTest, APeersAbsurdFiguresAreRefusedOrBounded) {
  SequenceChange huge{.kind = SequenceChange::Kind::kAdded,
                      .request_id = "big",
                      .worker = {1, 0},
                      .prefill_tokens = uint64_t{1} << 63};
  const absl::StatusOr<bool> refused = b_->ApplyReplicaChange("a", huge);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 0u);
  EXPECT_EQ(b_->replica_stats().changes_rejected, 1u);
  huge.prefill_tokens = kMaxReplicaPrefillTokens;  // the most: taken
  EXPECT_TRUE(*b_->ApplyReplicaChange("a", huge));
  EXPECT_EQ(LoadOf(*b_, 1).active_prefill_tokens, kMaxReplicaPrefillTokens);

  SequenceChange beat{.kind = SequenceChange::Kind::kHeartbeat,
                      .heartbeat_interval_ms = std::numeric_limits<uint32_t>::max()};
  ASSERT_TRUE(b_->ApplyReplicaChange("a", beat).ok());
  clock_.AdvanceSeconds(3 * 3600);  // three of the longest intervals: still alive
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 0u);
  clock_.AdvanceSeconds(1);
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 1u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 0u);
}

// An observer replaced or cleared says farewell on its way out: peers drop what they hold under
// its replica id, which nothing would free once it is gone (the new observer books under
// another id; none publishes nothing). Before, b held r1 twice after a's rename, and for good
// (until the request expiry) after a stopped publishing.
TEST_F(RouterReplicaTest, AReplacedOrClearedObserverSaysFarewellFirst) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}, {}).ok());
  Deliver();
  ASSERT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  std::deque<Published> from_a2;
  a_->SetSequenceObserver("a2",
                          [&](const SequenceChange& c) { from_a2.push_back(Published::Of(c)); });
  ASSERT_EQ(from_a_.size(), 1u);  // the farewell, through the old observer
  EXPECT_EQ(from_a_.front().kind, SequenceChange::Kind::kReset);
  EXPECT_EQ(from_a_.front().heartbeat_interval_ms, 0u);
  Deliver();
  for (const Published& c : from_a2) ASSERT_TRUE(b_->ApplyReplicaChange("a2", c.View()).ok());
  from_a2.clear();
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);  // once, under a2
  a_->SetSequenceObserver("", nullptr);
  ASSERT_EQ(from_a2.size(), 1u);
  EXPECT_EQ(from_a2.front().kind, SequenceChange::Kind::kReset);
  ASSERT_TRUE(b_->ApplyReplicaChange("a2", from_a2.front().View()).ok());
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 0u);
  EXPECT_EQ(a_->active_requests(), 1u);  // a's own booking stays
}

TEST_F(RouterReplicaTest, PlansPublishTheirBookingAndTheirRelease) {
  auto plan = a_->Plan(Tokens(2, 0), {.with_admission = true, .request_id = "p"});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(a_->Abort("p"));
  ASSERT_EQ(from_a_.size(), 2u);
  EXPECT_EQ(from_a_[0].kind, SequenceChange::Kind::kAdded);
  EXPECT_EQ(from_a_[1].kind, SequenceChange::Kind::kFreed);
  // A preview books nothing, so it publishes nothing.
  ASSERT_TRUE(a_->Preview(Tokens(2, 0), {}).ok());
  EXPECT_EQ(from_a_.size(), 2u);
}

TEST_F(RouterReplicaTest, LocalIdsCannotReachReplicaBookings) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(2, 0), {1, 0}, {}).ok());
  Deliver();
  // The reserved mark cannot start a local id, and local calls cannot free a replica's booking.
  const std::string forged = std::string(1, kReplicaRequestIdMark) + "a\x1f" + "r1";
  EXPECT_EQ(b_->AddRequest(forged, Tokens(2, 0), {1, 0}, {}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(b_->Free(forged));
  EXPECT_FALSE(b_->Abort(forged));
  EXPECT_FALSE(b_->MarkPrefillCompleted(forged));
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  // A local request may reuse a replica's request id: they are different requests.
  EXPECT_TRUE(b_->AddRequest("r1", Tokens(2, 50), {2, 0}, {}).ok());
  EXPECT_EQ(b_->active_requests(), 2u);
}

TEST_F(RouterReplicaTest, ReplicaChangesAreNeverPublishedAgain) {
  std::vector<std::string> from_b;
  b_->SetSequenceObserver("b", [&](const SequenceChange& c) {
    if (c.kind == SequenceChange::Kind::kAdded || c.kind == SequenceChange::Kind::kFreed) {
      from_b.emplace_back(c.request_id);
    }
  });
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(2, 0), {1, 0}, {}).ok());
  Deliver();
  ASSERT_TRUE(b_->AddRequest("own", Tokens(2, 9), {1, 0}, {}).ok());
  EXPECT_EQ(from_b, std::vector<std::string>{"own"});
  // b's own changes echoed back (NATS delivers to every subscriber) are ignored.
  EXPECT_FALSE(
      *b_->ApplyReplicaChange("b", {.kind = SequenceChange::Kind::kFreed, .request_id = "own"}));
  EXPECT_EQ(b_->active_requests(), 2u);
  // Stopping: no more calls.
  b_->SetSequenceObserver("b", nullptr);
  EXPECT_TRUE(b_->Free("own"));
  EXPECT_EQ(from_b.size(), 1u);
}

// A replica that joins late announces nothing but asks: every peer answers with a Reset and
// its bookings, so the newcomer sees the fleet's load at once.
TEST_F(RouterReplicaTest, AJoiningReplicaLearnsTheOthersBookings) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  ASSERT_TRUE(a_->AddRequest("r2", Tokens(2, 100), {2, 0}).ok());
  from_a_.clear();  // b missed them (it was not there yet)
  std::deque<Published> from_b;
  b_->SetSequenceObserver("b", [&](const SequenceChange& c) {
    from_b.push_back({c.kind, std::string(c.request_id), c.worker, {}, 0, 0});
  });
  ASSERT_EQ(from_b.size(), 2u);
  EXPECT_EQ(from_b[0].kind, SequenceChange::Kind::kReset);
  EXPECT_EQ(from_b[1].kind, SequenceChange::Kind::kSyncRequest);
  EXPECT_FALSE(*a_->ApplyReplicaChange("b", from_b[1].View()));  // a answers through its observer
  ASSERT_EQ(from_a_.size(), 3u);                                 // Reset, Added r1, Added r2
  EXPECT_EQ(from_a_[0].kind, SequenceChange::Kind::kReset);
  EXPECT_EQ(Deliver(), 2);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  EXPECT_EQ(LoadOf(*b_, 1).active_blocks, 3u);
  EXPECT_EQ(LoadOf(*b_, 2).active_requests, 1u);
}

// A replica restarted under the same id (its old bookings still held by its peers, their frees
// lost) replaces them all as it starts publishing.
TEST_F(RouterReplicaTest, ARestartedReplicaReplacesItsStaleBookings) {
  ASSERT_TRUE(a_->AddRequest("old-1", Tokens(3, 0), {1, 0}).ok());
  ASSERT_TRUE(a_->AddRequest("old-2", Tokens(3, 50), {2, 0}).ok());
  Deliver();
  EXPECT_EQ(b_->active_requests(), 2u);
  // The process restarts: a new router under the same replica id, with one new booking.
  RouterOptions options;
  options.block_size = kBlockSize;
  options.clock = &clock_;
  a_ = *Router::Create(options);
  for (uint64_t w : {1, 2}) ASSERT_TRUE(a_->AddWorker(Worker(w)).ok());
  ASSERT_TRUE(a_->AddRequest("new", Tokens(1, 900), {2, 0}).ok());
  a_->SetSequenceObserver("a", [this](const SequenceChange& c) { Record(c); });
  Deliver();
  EXPECT_EQ(b_->active_requests(), 1u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 0u);
  EXPECT_EQ(LoadOf(*b_, 2).active_blocks, 1u);
}

// Whoever installed an observer can only take down its own: a publisher installed later (by
// the application, or another ingest object) survives the first one's shutdown.
// An announcement reaches b one message at a time; at no moment in between does b hold fewer
// of a's bookings than a has (it dropped them all at the Reset, and for that moment routed as
// if a's workers were idle: ReplicaSyncTest's flake in CI75).
TEST_F(RouterReplicaTest, AnAnnouncementNeverLeavesTheReceiverWithoutTheOriginsBookings) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  ASSERT_TRUE(a_->AddRequest("r2", Tokens(2, 100), {2, 0}).ok());
  ASSERT_TRUE(a_->MarkPrefillCompleted("r2"));
  Deliver();
  AskAToAnnounce();
  ASSERT_EQ(from_a_.size(), 3u);  // Reset, r1, r2
  EXPECT_EQ(from_a_.front().announced_bookings, 2u);
  while (!from_a_.empty()) {
    const SequenceChange::Kind kind = from_a_.front().kind;
    DeliverOne();
    for (uint64_t w : {1, 2}) {
      const WorkerLoad here = LoadOf(*b_, w), there = LoadOf(*a_, w);
      EXPECT_EQ(here.active_requests, there.active_requests) << "worker " << w << " " << int(kind);
      EXPECT_EQ(here.active_blocks, there.active_blocks) << "worker " << w << " " << int(kind);
      EXPECT_EQ(here.active_prefill_tokens, there.active_prefill_tokens) << "worker " << w;
    }
  }
  EXPECT_EQ(b_->replica_stats().active_requests, 2u);
  EXPECT_EQ(b_->replica_stats().changes_rejected, 0u);  // none taken for a duplicate
}

// A free b never heard of (lost on the way): the booking stays through the announcement's
// Reset, and goes with its last booking, not announced again.
TEST_F(RouterReplicaTest, BookingsNotAnnouncedAgainGoWhenTheAnnouncementEnds) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  ASSERT_TRUE(a_->AddRequest("gone", Tokens(2, 100), {2, 0}).ok());
  Deliver();
  ASSERT_TRUE(a_->Free("gone"));
  from_a_.clear();  // lost
  AskAToAnnounce();
  ASSERT_EQ(from_a_.size(), 2u);  // Reset, r1
  EXPECT_FALSE(DeliverOne());
  EXPECT_EQ(LoadOf(*b_, 2).active_requests, 1u);  // until the announcement ends
  EXPECT_TRUE(DeliverOne());
  EXPECT_EQ(LoadOf(*b_, 2).active_requests, 0u);
  EXPECT_EQ(LoadOf(*b_, 2).active_blocks, 0u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  EXPECT_EQ(b_->active_requests(), 1u);
}

// The announcement's last booking lost on the way: a's next change of any other kind ends it
// (a sends nothing between its announced bookings).
TEST_F(RouterReplicaTest, AnAnnouncementCutShortEndsAtTheOriginsNextChange) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  ASSERT_TRUE(a_->AddRequest("gone", Tokens(2, 100), {2, 0}).ok());
  Deliver();
  ASSERT_TRUE(a_->Free("gone"));
  from_a_.clear();  // lost
  ASSERT_TRUE(a_->AddRequest("r3", Tokens(1, 900), {2, 0}).ok());
  from_a_.clear();  // lost too
  AskAToAnnounce();
  ASSERT_EQ(from_a_.size(), 3u);  // Reset, r1 and r3 in some order
  from_a_.pop_back();             // lost
  Deliver();
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  Deliver();
  // "gone" went with the heartbeat; of r1 and r3, the one announced is held.
  EXPECT_EQ(b_->active_requests(), 1u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests + LoadOf(*b_, 2).active_requests, 1u);
  EXPECT_EQ(LoadOf(*b_, 2).active_blocks, LoadOf(*b_, 2).active_requests);  // r3 (1 block) or none
}

// A restarted replica reusing a request id on another worker: the announced booking replaces
// the copy held from before, not doubled and not refused as a duplicate.
TEST_F(RouterReplicaTest, ABookingAnnouncedAgainReplacesItsOldCopy) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  Deliver();
  RouterOptions options;
  options.block_size = kBlockSize;
  options.clock = &clock_;
  a_ = *Router::Create(options);
  for (uint64_t w : {1, 2}) ASSERT_TRUE(a_->AddWorker(Worker(w)).ok());
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(5, 300), {2, 0}).ok());
  a_->SetSequenceObserver("a", [this](const SequenceChange& c) { Record(c); });
  ASSERT_EQ(from_a_.size(), 3u);  // Reset, r1, SyncRequest
  EXPECT_FALSE(DeliverOne());
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);  // the old copy, for now
  EXPECT_TRUE(DeliverOne());
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 0u);
  EXPECT_EQ(LoadOf(*b_, 2).active_requests, 1u);
  EXPECT_EQ(LoadOf(*b_, 2).active_blocks, 5u);
  Deliver();
  EXPECT_EQ(b_->active_requests(), 1u);
  EXPECT_EQ(b_->replica_stats().changes_rejected, 0u);
}

// A Reset that does not say how many bookings follow (a sender older than the count, or a
// replica announcing none) drops the origin's bookings at once, as a farewell does.
TEST_F(RouterReplicaTest, AResetAnnouncingNoBookingsDropsThemAtOnce) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  Deliver();
  EXPECT_TRUE(*b_->ApplyReplicaChange(
      "a", {.kind = SequenceChange::Kind::kReset, .heartbeat_interval_ms = 1000}));
  EXPECT_EQ(b_->active_requests(), 0u);
}

// Announcements under way are bounded: past ReplicaAnnouncements::kMaxAnnouncing origins in the
// middle of one (stalled, or ids a peer makes up), the oldest is ended to make room, its
// bookings not announced again dropped. An origin holding nothing needs no announcement.
TEST_F(RouterReplicaTest, AnnouncementsUnderWayAreBounded) {
  const SequenceChange reset{.kind = SequenceChange::Kind::kReset, .announced_bookings = 5};
  ASSERT_FALSE(*b_->ApplyReplicaChange("empty", reset));
  EXPECT_EQ(b_->replica_stats().announcing, 0u);  // it held nothing
  for (size_t i = 0; i < ReplicaAnnouncements::kMaxAnnouncing; ++i) {
    const std::string origin = "p" + std::to_string(i);
    ASSERT_TRUE(*b_->ApplyReplicaChange(
        origin, {.kind = SequenceChange::Kind::kAdded, .request_id = "x", .worker = {2, 0}}));
    ASSERT_FALSE(*b_->ApplyReplicaChange(origin, reset));
  }
  EXPECT_EQ(b_->replica_stats().announcing, ReplicaAnnouncements::kMaxAnnouncing);
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  Deliver();
  AskAToAnnounce();
  EXPECT_TRUE(DeliverOne());  // a's Reset: p0's announcement ended, its booking dropped
  EXPECT_EQ(LoadOf(*b_, 2).active_requests, ReplicaAnnouncements::kMaxAnnouncing - 1);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);  // a's kept through its own announcement
  EXPECT_EQ(b_->replica_stats().announcing, ReplicaAnnouncements::kMaxAnnouncing);
  Deliver();
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  // Every way an origin's tracking ends takes its announcement with it.
  ASSERT_TRUE(b_->ApplyReplicaChange("p1", {.kind = SequenceChange::Kind::kHeartbeat}).ok());
  ASSERT_TRUE(b_->ApplyReplicaChange("p2", {.kind = SequenceChange::Kind::kReset}).ok());
  EXPECT_EQ(b_->replica_stats().announcing, ReplicaAnnouncements::kMaxAnnouncing - 3);
  // p0, p1 and p2 hold nothing now (their bookings were not announced again); a holds r1.
  EXPECT_EQ(b_->ForgetReplicas(), ReplicaAnnouncements::kMaxAnnouncing - 3 + 1);
  EXPECT_EQ(b_->replica_stats().announcing, 0u);
}

// A silent replica expired in the middle of its announcement: the announcement goes with it.
TEST_F(RouterReplicaTest, AnExpiredReplicasAnnouncementEndsWithIt) {
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  Deliver();
  AskAToAnnounce();
  DeliverOne();  // the Reset alone
  EXPECT_EQ(b_->replica_stats().announcing, 1u);
  clock_.AdvanceSeconds(11);
  ASSERT_EQ(b_->ExpireSilentReplicas(kTimeout), 1u);
  EXPECT_EQ(b_->replica_stats().announcing, 0u);
  EXPECT_EQ(b_->active_requests(), 0u);
}

// A booking announced twice in one announcement is a repeat, refused as outside one, and it
// does not count among those announced (the announcement would end early, dropping bookings
// still to come). A booking on a rank b does not know is refused and changes nothing.
TEST_F(RouterReplicaTest, ARefusedBookingInAnAnnouncementChangesNothing) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  ASSERT_TRUE(a_->AddRequest("r2", Tokens(2, 100), {2, 0}).ok());
  Deliver();
  AskAToAnnounce();
  ASSERT_EQ(from_a_.size(), 3u);
  const Published first = from_a_[1];
  EXPECT_FALSE(DeliverOne());  // Reset
  EXPECT_TRUE(DeliverOne());   // the first booking
  const uint64_t digest = b_->StateDigest();
  absl::StatusOr<bool> again = b_->ApplyReplicaChange("a", first.View());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  Published elsewhere = from_a_.front();
  elsewhere.worker = {9, 0};
  absl::StatusOr<bool> unknown = b_->ApplyReplicaChange("a", elsewhere.View());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  EXPECT_EQ(b_->StateDigest(), digest);
  EXPECT_EQ(b_->replica_stats().announcing, 1u);
  EXPECT_TRUE(DeliverOne());  // the second booking: the announcement's last
  EXPECT_EQ(b_->replica_stats().announcing, 0u);
  EXPECT_EQ(b_->active_requests(), 2u);
}

// An announcement whose booking the observer lost (memory refused) is cut short at the
// sender. What a sends next must not end it at the receiver before the rest has come: a
// announces again before its next change. Before, the heartbeat went right after the cut one,
// and b dropped a's live bookings and admitted its waiting request.
TEST_F(RouterReplicaTest, AnAnnouncementCutShortAtTheSenderIsRepairedBeforeItsNextChange) {
  bool admitted = false;
  QueueBehindTheOthersBookings(admitted, /*heartbeat=*/true);
  ASSERT_FALSE(admitted);
  refuse_nth_ = 2;  // the Reset goes, the first booking is lost, the second goes
  AskAToAnnounce();
  ASSERT_EQ(from_a_.size(), 2u);
  ASSERT_TRUE(a_->PublishHeartbeat(1000));  // announces again first, whole this time
  ASSERT_EQ(from_a_.size(), 6u);            // the cut one; Reset, r1, r2; the heartbeat
  EXPECT_EQ(from_a_[2].kind, SequenceChange::Kind::kReset);
  EXPECT_EQ(from_a_[5].kind, SequenceChange::Kind::kHeartbeat);
  while (!from_a_.empty()) {
    DeliverOne();
    EXPECT_EQ(b_->replica_stats().active_requests, 2u);
    EXPECT_FALSE(admitted);
  }
}

// A booking the observer can never publish (e.g. past the transport's largest message): every
// change of a is an announcement, cut at that booking, and the others still go; the changes
// that are not bookings (a heartbeat) still go too and end it at b, so a booking a freed is
// dropped there. Before, the heartbeat was withheld behind the cut announcement, and b held a's
// freed booking for as long as the unpublishable one lived.
TEST_F(RouterReplicaTest, ABookingThatCannotBePublishedDoesNotHoldTheOthersBack) {
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  ASSERT_TRUE(a_->AddRequest("huge", Tokens(2, 100), {2, 0}).ok());
  Deliver();
  refuse_id_ = "huge";
  AskAToAnnounce();  // Reset(2), r1; huge lost
  Deliver();
  ASSERT_TRUE(a_->Free("r1"));  // announced instead: Reset(1); huge lost again
  Deliver();
  ASSERT_TRUE(a_->PublishHeartbeat(1000));  // Reset(1), then the heartbeat, which ends it
  Deliver();
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 0u);  // r1, freed at a, is gone at b
  EXPECT_EQ(b_->replica_stats().announcing, 0u);
  refuse_id_.clear();
  ASSERT_TRUE(a_->PublishHeartbeat(1000));  // the repair gets through whole
  Deliver();
  EXPECT_EQ(LoadOf(*b_, 2).active_requests, 1u);
  EXPECT_EQ(b_->active_requests(), 1u);
}

// Every booking is published under its request id and its router's replica id, and a change
// must fit the transport's messages: both are bounded (a request id of a megabyte failed every
// publication, and every announcement of its router's bookings, while it lived).
TEST_F(RouterReplicaTest, RequestAndReplicaIdsAreBounded) {
  const std::string longest(kMaxRequestIdBytes, 'r');
  EXPECT_TRUE(a_->AddRequest(longest, Tokens(1, 0), {1, 0}).ok());
  const std::string too_long(kMaxRequestIdBytes + 1, 'r');
  EXPECT_EQ(a_->AddRequest(too_long, Tokens(1, 0), {1, 0}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->FindBestMatch(Tokens(1, 0), {.with_admission = true, .request_id = too_long})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->Plan(Tokens(1, 0), {.request_id = too_long}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateReplicaId(std::string(kMaxReplicaIdBytes, 'g')).ok());
  EXPECT_EQ(ValidateReplicaId(std::string(kMaxReplicaIdBytes + 1, 'g')).code(),
            absl::StatusCode::kInvalidArgument);
}

// An announcer counts its own bookings only: those it holds from other replicas are theirs to
// announce.
TEST_F(RouterReplicaTest, AnAnnouncementCountsTheAnnouncersOwnBookingsOnly) {
  LetBPublish();
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  Deliver();  // b holds a's r1
  ASSERT_TRUE(b_->AddRequest("mine", Tokens(2, 50), {2, 0}).ok());
  from_b_.clear();
  ASSERT_TRUE(b_->ApplyReplicaChange("c", {.kind = SequenceChange::Kind::kSyncRequest}).ok());
  ASSERT_EQ(from_b_.size(), 2u);  // Reset, mine
  EXPECT_EQ(from_b_[0].announced_bookings, 1u);
}

// A booking dropped at the end of an announcement (its free was lost) releases capacity, which
// admits a request waiting in b's queue then, as the free itself would have.
TEST_F(RouterReplicaTest, ABookingDroppedByAnAnnouncementAdmitsWaitingRequests) {
  bool admitted = false;
  QueueBehindTheOthersBookings(admitted);
  ASSERT_FALSE(admitted);
  ASSERT_TRUE(a_->Free("r1"));
  from_a_.clear();  // lost
  AskAToAnnounce();
  Deliver();
  EXPECT_TRUE(admitted);
  EXPECT_EQ(b_->pending_count(), 0u);
}

TEST_F(RouterReplicaTest, ClearingAReplacedObserverLeavesTheNewOneAlone) {
  int first = 0, second = 0;
  const uint64_t first_token =
      b_->SetSequenceObserver("b", [&](const SequenceChange&) { ++first; });
  const uint64_t second_token =
      b_->SetSequenceObserver("b", [&](const SequenceChange&) { ++second; });
  EXPECT_NE(first_token, second_token);
  EXPECT_FALSE(b_->ClearSequenceObserver(first_token));
  const int announced = second;
  ASSERT_TRUE(b_->AddRequest("r", Tokens(1, 0), {1, 0}).ok());
  EXPECT_EQ(second, announced + 1);
  EXPECT_TRUE(b_->ClearSequenceObserver(second_token));
  ASSERT_TRUE(b_->Free("r"));
  EXPECT_EQ(second, announced + 1);
  // Cleared, b still knows its id: its own changes echoed back are not taken for a peer's.
  EXPECT_FALSE(*b_->ApplyReplicaChange(
      "b", {.kind = SequenceChange::Kind::kAdded, .request_id = "r", .worker = {1, 0}}));
  EXPECT_EQ(b_->active_requests(), 0u);
}

TEST_F(RouterReplicaTest, BadChangesAreRefusedAndChangeNothing) {
  const uint64_t digest = b_->StateDigest();
  const std::vector<uint64_t> ids = {1, 2};
  const SequenceChange unknown_worker{
      .kind = SequenceChange::Kind::kAdded, .request_id = "x", .worker = {9, 0}, .block_ids = ids};
  EXPECT_EQ(b_->ApplyReplicaChange("a", unknown_worker).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(b_->ApplyReplicaChange("", {.request_id = "x"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->ApplyReplicaChange("a", {.request_id = ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // An origin with 0x1F could pass for another origin's prefix.
  EXPECT_EQ(b_->ApplyReplicaChange("a\x1f"
                                   "x",
                                   {.request_id = "y"})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->StateDigest(), digest);
  const SequenceChange added{
      .kind = SequenceChange::Kind::kAdded, .request_id = "x", .worker = {1, 0}, .block_ids = ids};
  EXPECT_TRUE(*b_->ApplyReplicaChange("a", added));
  EXPECT_EQ(b_->ApplyReplicaChange("a", added).status().code(), absl::StatusCode::kAlreadyExists);
  // The same id from another replica is another request.
  EXPECT_TRUE(*b_->ApplyReplicaChange("c", added));
  EXPECT_EQ(b_->active_requests(), 2u);
}

TEST_F(RouterReplicaTest, AReplicaFreeingCapacityAdmitsWaitingRequests) {
  bool admitted = false;
  QueueBehindTheOthersBookings(admitted);
  EXPECT_FALSE(admitted);
  EXPECT_EQ(b_->pending_count(), 1u);
  EXPECT_TRUE(a_->MarkPrefillCompleted("r2"));
  Deliver();
  EXPECT_TRUE(admitted);
  EXPECT_EQ(b_->pending_count(), 0u);
}

TEST_F(RouterReplicaTest, ReplicaBookingsExpireLikeLocalOnes) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(2, 0), {1, 0}, {}).ok());
  Deliver();
  clock_.AdvanceSeconds(301);  // a replica that died never frees: expiry reclaims its load
  EXPECT_EQ(b_->ExpireStale(), 1u);
  EXPECT_EQ(b_->active_requests(), 0u);
}

// A booking a peer learns late (announced again, here to a replica that missed it) carries its
// age: the peer expires it when its origin does, not a whole expiry after hearing of it.
TEST_F(RouterReplicaTest, ABookingAnnouncedAgainKeepsItsAge) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(2, 0), {1, 0}, {}).ok());
  ASSERT_EQ(from_a_.size(), 1u);
  EXPECT_EQ(from_a_.front().booked_ms_ago, 0u);  // announced as it is made
  from_a_.clear();                               // b missed it
  clock_.AdvanceSeconds(200);
  EXPECT_FALSE(*a_->ApplyReplicaChange("b", {.kind = SequenceChange::Kind::kSyncRequest}));
  ASSERT_EQ(from_a_.size(), 2u);  // Reset, r1
  EXPECT_EQ(from_a_[1].booked_ms_ago, 200'000u);
  Deliver();
  ASSERT_EQ(b_->active_requests(), 1u);
  clock_.AdvanceSeconds(101);  // 301 s after a booked it, 101 s after b heard of it
  EXPECT_EQ(a_->ExpireStale(), 1u);
  EXPECT_EQ(b_->ExpireStale(), 1u);
  EXPECT_EQ(b_->active_requests(), 0u);
}

// The prefill rate is learnt from the time between booking and first token, given the work
// queued ahead. A booking a peer hears of only later, announced again, has neither: its
// completion teaches the peer nothing (it made the peer's rate 400 times too fast: its prompt
// "prefilled" in the 10 ms since the re-announcement). One heard of at once teaches as usual.
TEST_F(RouterReplicaTest, ABookingAnnouncedAgainTeachesNoPrefillRate) {
  ASSERT_TRUE(a_->AddRequest("late", Tokens(3, 0), {1, 0}, {}).ok());
  from_a_.clear();  // b missed it
  clock_.AdvanceSeconds(4);
  EXPECT_FALSE(*a_->ApplyReplicaChange("b", {.kind = SequenceChange::Kind::kSyncRequest}));
  Deliver();
  clock_.AdvanceSeconds(0.01);
  EXPECT_TRUE(a_->MarkPrefillCompleted("late"));
  EXPECT_EQ(Deliver(), 1);
  EXPECT_EQ(LoadOf(*b_, 1).active_prefill_tokens, 0u);
  EXPECT_EQ(LoadOf(*b_, 1).prefill_tokens_per_second, 0);
  EXPECT_DOUBLE_EQ(LoadOf(*a_, 1).prefill_tokens_per_second, 12 / 4.01);

  ASSERT_TRUE(a_->AddRequest("heard", Tokens(3, 100), {2, 0}, {}).ok());
  Deliver();
  clock_.AdvanceSeconds(2);
  EXPECT_TRUE(a_->MarkPrefillCompleted("heard"));
  Deliver();
  EXPECT_DOUBLE_EQ(LoadOf(*b_, 2).prefill_tokens_per_second, 12 / 2.0);
}

// ---- Liveness: a replica that dies for good has its bookings dropped by its peers ----------

TEST_F(RouterReplicaTest, ASilentReplicaThatSentHeartbeatsLosesItsBookings) {
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  ASSERT_EQ(from_a_.size(), 1u);
  EXPECT_EQ(from_a_.front().kind, SequenceChange::Kind::kHeartbeat);
  EXPECT_EQ(from_a_.front().heartbeat_interval_ms, 1000u);
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}, {}).ok());
  Deliver();
  EXPECT_EQ(b_->replica_stats().live, 1u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);

  clock_.AdvanceSeconds(10);  // silent for exactly the timeout: still alive
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 0u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  clock_.AdvanceSeconds(0.5);
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 1u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 0u);
  EXPECT_EQ(b_->active_requests(), 0u);
  const Router::ReplicaStats stats = b_->replica_stats();
  EXPECT_EQ(stats.live, 0u);
  EXPECT_EQ(stats.expired, 1u);
  EXPECT_EQ(stats.active_requests, 0u);
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 0u);  // counted once
}

TEST_F(RouterReplicaTest, AnyChangeFromAReplicaKeepsItAlive) {
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  Deliver();
  clock_.AdvanceSeconds(8);
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}, {}).ok());
  Deliver();  // heard 0 s ago
  clock_.AdvanceSeconds(8);
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 0u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
}

TEST_F(RouterReplicaTest, AReplicaThatNeverSentAHeartbeatIsNeverExpired) {
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}, {}).ok());
  Deliver();
  clock_.AdvanceSeconds(100);
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 0u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  EXPECT_EQ(b_->replica_stats().live, 0u);
}

TEST_F(RouterReplicaTest, EveryChangeAfterAHeartbeatCarriesItsInterval) {
  ASSERT_TRUE(a_->AddRequest("r0", Tokens(3, 0), {1, 0}, {}).ok());
  ASSERT_TRUE(a_->PublishHeartbeat(700));
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 100), {1, 0}, {}).ok());
  ASSERT_TRUE(a_->Free("r1"));
  ASSERT_EQ(from_a_.size(), 4u);
  EXPECT_EQ(from_a_[0].heartbeat_interval_ms, 0u);  // promised nothing yet
  for (size_t i = 1; i < 4; ++i) EXPECT_EQ(from_a_[i].heartbeat_interval_ms, 700u) << i;
  from_a_.clear();
  // A new publisher promises nothing until it beats: its announcement carries no interval.
  a_->SetSequenceObserver("a", [this](const SequenceChange& c) { Record(c); });
  ASSERT_FALSE(from_a_.empty());
  for (const Published& change : from_a_) EXPECT_EQ(change.heartbeat_interval_ms, 0u);
}

// b never heard a's heartbeat (lost, or b joined after it); a's booking carries the interval,
// so a's bookings still go when a falls silent.
TEST_F(RouterReplicaTest, AReplicaWhoseHeartbeatWasMissedIsExpiredFromItsChanges) {
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  from_a_.clear();  // lost on the way
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}, {}).ok());
  Deliver();
  EXPECT_EQ(b_->replica_stats().live, 1u);
  clock_.AdvanceSeconds(11);
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 1u);
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 0u);
}

TEST_F(RouterReplicaTest, ASlowSendersOwnIntervalStretchesTheTimeout) {
  ASSERT_TRUE(a_->PublishHeartbeat(5000));  // three intervals (15 s) exceed the 10 s timeout
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}, {}).ok());
  Deliver();
  clock_.AdvanceSeconds(14);
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 0u);
  clock_.AdvanceSeconds(2);
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 1u);
}

// a restarts (a new observer announces its bookings, Reset first) and beats: b holds them
// again, and does not ask a for them (a restart announces everything itself).
TEST_F(RouterReplicaTest, AnExpiredReplicaThatRestartsIsLoadAgain) {
  LetBPublish();
  ExpireAHoldingR1();
  a_->SetSequenceObserver("a", [this](const SequenceChange& c) { Record(c); });
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  Deliver();
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  EXPECT_EQ(b_->replica_stats().live, 1u);
  ASSERT_EQ(from_b_.size(), 1u);  // its answer to a's SyncRequest: a Reset, nothing booked
  EXPECT_EQ(from_b_.front().kind, SequenceChange::Kind::kReset);
}

// a stalled (or was cut off) past b's timeout: b dropped its bookings, and when a is heard
// again b asks a alone to announce them, which a does with its next heartbeat.
TEST_F(RouterReplicaTest, AReplicaExpiredWhileAliveIsAskedToAnnounceItsBookingsAgain) {
  LetBPublish();
  ExpireAHoldingR1();

  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  Deliver();
  ASSERT_EQ(from_b_.size(), 1u);
  EXPECT_EQ(from_b_.front().kind, SequenceChange::Kind::kSyncRequest);
  EXPECT_EQ(from_b_.front().request_id, "a");
  // Asked twice (every peer asks after an outage), a announces once, with its next heartbeat.
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(a_->ApplyReplicaChange("b", from_b_.front().View()).ok());
  }
  from_b_.clear();
  EXPECT_TRUE(from_a_.empty());
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  ASSERT_EQ(from_a_.size(), 3u);  // Reset, Added r1, then the heartbeat
  EXPECT_EQ(from_a_[0].kind, SequenceChange::Kind::kReset);
  EXPECT_EQ(from_a_[2].kind, SequenceChange::Kind::kHeartbeat);
  Deliver();
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  EXPECT_EQ(b_->replica_stats().live, 1u);
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  EXPECT_EQ(from_a_.size(), 1u);  // answered: the next heartbeat goes alone
  Deliver();
  EXPECT_TRUE(from_b_.empty());  // b asks once per expiry
}

// b's request is lost on the way (core NATS keeps nothing), or refused for memory: b asks
// again once a has not answered for three of its heartbeat intervals.
TEST_F(RouterReplicaTest, AReplicaAskedInVainIsAskedAgain) {
  LetBPublish();
  ExpireAHoldingR1();
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  Deliver();
  ASSERT_EQ(from_b_.size(), 1u);
  from_b_.clear();  // lost
  clock_.AdvanceSeconds(2);
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  Deliver();
  EXPECT_TRUE(from_b_.empty());  // asked 2 s ago: not yet
  clock_.AdvanceSeconds(1.5);
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  Deliver();
  ASSERT_EQ(from_b_.size(), 1u);
  EXPECT_EQ(from_b_.front().kind, SequenceChange::Kind::kSyncRequest);
  ASSERT_TRUE(a_->ApplyReplicaChange("b", from_b_.front().View()).ok());
  from_b_.clear();
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  Deliver();
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 1u);
  clock_.AdvanceSeconds(10);
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  Deliver();
  EXPECT_TRUE(from_b_.empty());  // answered: never asked again
}

TEST_F(RouterReplicaTest, ASyncRequestNamingAnotherReplicaIsNotAnswered) {
  const Published ask_c{SequenceChange::Kind::kSyncRequest, "c", {}, {}, 0, 0, 0};
  ASSERT_TRUE(a_->ApplyReplicaChange("b", ask_c.View()).ok());
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  EXPECT_EQ(from_a_.size(), 1u);  // the heartbeat alone
}

// A replica that stops publishing says farewell with a Reset promising nothing: its peers drop
// its bookings and stop tracking it, and never count it as expired.
TEST_F(RouterReplicaTest, AFarewellIsNotCountedAsAnExpiry) {
  ASSERT_TRUE(a_->PublishHeartbeat(1000));
  ASSERT_TRUE(a_->AddRequest("r1", Tokens(3, 0), {1, 0}, {}).ok());
  Deliver();
  ASSERT_EQ(b_->replica_stats().live, 1u);
  ASSERT_TRUE(a_->ClearSequenceObserver(a_token_, /*farewell=*/true));
  ASSERT_EQ(from_a_.size(), 1u);
  EXPECT_EQ(from_a_.front().kind, SequenceChange::Kind::kReset);
  EXPECT_EQ(from_a_.front().heartbeat_interval_ms, 0u);
  Deliver();
  EXPECT_EQ(LoadOf(*b_, 1).active_requests, 0u);
  EXPECT_EQ(b_->replica_stats().live, 0u);
  clock_.AdvanceSeconds(100);
  EXPECT_EQ(b_->ExpireSilentReplicas(kTimeout), 0u);
  EXPECT_EQ(b_->replica_stats().expired, 0u);
}

TEST_F(RouterReplicaTest, ADeadReplicasCapacityAdmitsRequestsWaitingHere) {
  bool admitted = false;
  QueueBehindTheOthersBookings(admitted, /*heartbeat=*/true);
  EXPECT_FALSE(admitted);
  clock_.AdvanceSeconds(11);  // a died: its bookings go, and b's request is admitted
  ASSERT_EQ(b_->ExpireSilentReplicas(kTimeout), 1u);
  EXPECT_TRUE(admitted);
  EXPECT_EQ(b_->pending_count(), 0u);
}

TEST_F(RouterReplicaTest, NoHeartbeatWithoutAnObserver) {
  EXPECT_FALSE(b_->PublishHeartbeat(1000));
}

}  // namespace
}  // namespace kvrouter

// Staged routing on the core Router: preview (changes nothing), plan / commit / abort with a
// deadline, query-only decisions, explicit pins, allowed sets and session affinity.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/router.h"

namespace kvrouter {
namespace {

constexpr uint32_t kBlockSize = 4;

std::vector<uint32_t> Tokens(size_t blocks, uint32_t first = 0) {
  std::vector<uint32_t> tokens(blocks * kBlockSize);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = first + static_cast<uint32_t>(i);
  return tokens;
}

WorkerConfig Worker(uint64_t id, uint32_t dp_size = 1) {
  return WorkerConfig{.worker_id = id,
                      .dp_start = 0,
                      .dp_size = dp_size,
                      .total_kv_blocks = 1000 + id,
                      .max_num_batched_tokens = 0,
                      .block_size = kBlockSize};
}

RouteOptions Request(std::string_view id) { return RouteOptions{.request_id = id}; }

class RouterLifecycleTest : public ::testing::Test {
 protected:
  void Make(RouterOptions options = {}, int workers = 3) {
    options.block_size = kBlockSize;
    options.clock = &clock_;
    options.random_seed = 11;
    options.plan_deadline_seconds = 5;
    auto router = Router::Create(std::move(options));
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = std::move(*router);
    for (int i = 1; i <= workers; ++i) ASSERT_TRUE(router_->AddWorker(Worker(i)).ok());
  }

  uint64_t ActiveBlocks() {
    uint64_t blocks = 0;
    for (const auto& load : router_->Loads()) blocks += load.active_blocks;
    return blocks;
  }

  ManualClock clock_;
  std::unique_ptr<Router> router_;
};

TEST_F(RouterLifecycleTest, PreviewReportsSignalsAndBooksNothing) {
  Make();
  const auto tokens = Tokens(6);
  auto preview = router_->Preview(tokens, Request("p"));
  ASSERT_TRUE(preview.ok()) << preview.status();
  EXPECT_FALSE(preview->booked);
  EXPECT_EQ(preview->potential_decode_blocks, 6u);
  EXPECT_EQ(preview->total_kv_blocks, 1000 + preview->worker.worker_id);
  EXPECT_EQ(router_->active_requests(), 0u);
}

TEST_F(RouterLifecycleTest, TenThousandPreviewsLeaveTheDigestUnchanged) {
  Make(RouterOptions{.use_kv_events = false});  // approximate: previews must not record
  const auto tokens = Tokens(8);
  // State worth protecting: a committed request, an open plan, a session, a pin.
  ASSERT_TRUE(router_->Plan(tokens, Request("committed")).ok());
  ASSERT_TRUE(router_->Commit("committed").ok());
  RouteOptions with_session = Request("session-req");
  with_session.session_id = "s1";
  ASSERT_TRUE(router_->Plan(Tokens(3, 500), with_session).ok());
  ASSERT_TRUE(router_->Commit("session-req").ok());
  ASSERT_TRUE(router_->Plan(Tokens(2, 900), Request("open-plan")).ok());

  const uint64_t before = router_->StateDigest();
  const size_t sessions = router_->session_count();
  for (int i = 0; i < 10'000; ++i) {
    RouteOptions options = Request("preview");
    if (i % 3 == 1) options.session_id = i % 2 ? "s1" : "new-session";
    if (i % 3 == 2) options.pin = WorkerPin{.worker_id = static_cast<uint64_t>(1 + i % 3)};
    options.session_mode = i % 4 < 2 ? SessionMode::kHard : SessionMode::kSoft;
    ASSERT_TRUE(router_->Preview(Tokens(1 + i % 7, i % 5), options).ok());
  }
  EXPECT_EQ(router_->StateDigest(), before);
  EXPECT_EQ(router_->session_count(), sessions);
  EXPECT_EQ(router_->plan_count(), 1u);
}

TEST_F(RouterLifecycleTest, QueryOnlyRoutingWritesNothingInApproximateMode) {
  Make(RouterOptions{.use_kv_events = false});
  const auto tokens = Tokens(5);
  const uint64_t before = router_->StateDigest();
  ASSERT_TRUE(router_->FindBestMatch(tokens, Request("q")).ok());  // no admission: query-only
  ASSERT_TRUE(router_->Preview(tokens, Request("q")).ok());
  EXPECT_EQ(router_->StateDigest(), before);
  EXPECT_EQ(router_->IndexStats().cached_blocks, 0u);
}

TEST_F(RouterLifecycleTest, ApproximateModeRecordsAtCommitNotAtPlan) {
  Make(RouterOptions{.use_kv_events = false});
  const auto tokens = Tokens(5);
  auto plan = router_->Plan(tokens, Request("r"));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->planned);
  EXPECT_EQ(router_->IndexStats().cached_blocks, 0u);
  ASSERT_TRUE(router_->Commit("r").ok());
  EXPECT_GT(router_->IndexStats().cached_blocks, 0u);
  auto again = router_->Preview(tokens, Request("x"));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->device_overlap_blocks, 5u);
  EXPECT_EQ(again->worker, plan->worker);
}

TEST_F(RouterLifecycleTest, AbortedPlanLeavesNoTraceInTheApproximateIndex) {
  Make(RouterOptions{.use_kv_events = false});
  const uint64_t before = router_->StateDigest();
  ASSERT_TRUE(router_->Plan(Tokens(5), Request("r")).ok());
  EXPECT_TRUE(router_->Abort("r"));
  EXPECT_EQ(router_->StateDigest(), before);
}

TEST_F(RouterLifecycleTest, PlanKeepsThePreviewedWorkerWhileEligible) {
  Make();
  const auto tokens = Tokens(4);
  // Worker 3 is not the cheapest once loaded, but the plan keeps it.
  ASSERT_TRUE(router_->AddRequest("load", Tokens(50, 7000), WorkerKey{3, 0}).ok());
  auto plan = router_->Plan(tokens, Request("r"), WorkerKey{3, 0});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->worker, (WorkerKey{3, 0}));
  EXPECT_FALSE(plan->moved_from_preferred);
  EXPECT_TRUE(plan->booked);
}

TEST_F(RouterLifecycleTest, PlanPicksAgainWhenThePreviewedWorkerIsGone) {
  Make();
  const auto tokens = Tokens(4);
  auto preview = router_->Preview(tokens, Request("r"));
  ASSERT_TRUE(preview.ok());
  ASSERT_TRUE(router_->RemoveWorker(preview->worker.worker_id).ok());
  auto plan = router_->Plan(tokens, Request("r"), preview->worker);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_NE(plan->worker, preview->worker);
  EXPECT_TRUE(plan->moved_from_preferred);
}

TEST_F(RouterLifecycleTest, EveryStepIsIdempotent) {
  Make();
  const auto tokens = Tokens(4);
  auto first = router_->Plan(tokens, Request("r"));
  auto second = router_->Plan(tokens, Request("r"));
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(first->worker, second->worker);
  EXPECT_EQ(router_->active_requests(), 1u);
  EXPECT_TRUE(router_->Commit("r").ok());
  EXPECT_TRUE(router_->Commit("r").ok());
  EXPECT_EQ(router_->active_requests(), 1u);
  EXPECT_TRUE(router_->Abort("r"));
  EXPECT_FALSE(router_->Abort("r"));
  EXPECT_EQ(router_->Commit("r").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ActiveBlocks(), 0u);
}

// No booking leaks, path by path.
TEST_F(RouterLifecycleTest, PlanThenCommitThenFreeLeaksNothing) {
  Make();
  ASSERT_TRUE(router_->Plan(Tokens(4), Request("r")).ok());
  ASSERT_TRUE(router_->Commit("r").ok());
  EXPECT_TRUE(router_->Free("r"));
  EXPECT_EQ(router_->active_requests(), 0u);
  EXPECT_EQ(router_->plan_count(), 0u);
  EXPECT_EQ(ActiveBlocks(), 0u);
}

TEST_F(RouterLifecycleTest, PlanThenAbortLeaksNothing) {
  Make();
  ASSERT_TRUE(router_->Plan(Tokens(4), Request("r")).ok());
  EXPECT_TRUE(router_->Abort("r"));
  EXPECT_EQ(router_->active_requests(), 0u);
  EXPECT_EQ(router_->plan_count(), 0u);
  EXPECT_EQ(ActiveBlocks(), 0u);
}

TEST_F(RouterLifecycleTest, PlanThenFreeDropsThePlan) {
  Make();
  ASSERT_TRUE(router_->Plan(Tokens(4), Request("r")).ok());
  EXPECT_TRUE(router_->Free("r"));
  EXPECT_EQ(router_->plan_count(), 0u);
  EXPECT_EQ(router_->Commit("r").code(), absl::StatusCode::kNotFound);
}

TEST_F(RouterLifecycleTest, UncommittedPlanIsDroppedAfterItsDeadline) {
  Make();
  ASSERT_TRUE(router_->Plan(Tokens(4), Request("r")).ok());
  clock_.AdvanceSeconds(4.9);
  EXPECT_EQ(router_->ExpirePlans(), 0u);
  clock_.AdvanceSeconds(0.2);
  // Checked lazily: the next commit finds the plan gone and its booking freed.
  EXPECT_EQ(router_->Commit("r").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(router_->active_requests(), 0u);
  EXPECT_EQ(ActiveBlocks(), 0u);
}

TEST_F(RouterLifecycleTest, ReplanningAnExpiredPlanFreesItsOldBooking) {
  Make();
  ASSERT_TRUE(router_->Plan(Tokens(4), Request("r")).ok());
  clock_.AdvanceSeconds(6);
  ASSERT_TRUE(router_->Plan(Tokens(4), Request("r")).ok());
  EXPECT_EQ(router_->active_requests(), 1u);
  EXPECT_EQ(ActiveBlocks(), 4u);
  EXPECT_TRUE(router_->Abort("r"));
  EXPECT_EQ(ActiveBlocks(), 0u);
}

TEST_F(RouterLifecycleTest, PlanWhoseWorkerWasRemovedCannotCommit) {
  Make();
  auto plan = router_->Plan(Tokens(4), Request("r"));
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(router_->RemoveWorker(plan->worker.worker_id).ok());
  EXPECT_EQ(router_->Commit("r").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(router_->Commit("r").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(router_->Abort("r"));
  EXPECT_EQ(router_->plan_count(), 0u);
  EXPECT_EQ(router_->active_requests(), 0u);
}

TEST_F(RouterLifecycleTest, PlanWaitingInTheQueueIsAbortedCleanly) {
  Make(RouterOptions{.queue_threshold = 0.0}, 1);
  ASSERT_TRUE(
      router_->FindBestMatch(Tokens(4), RouteOptions{.with_admission = true, .request_id = "busy"})
          .ok());
  RouteOptions waiting = Request("r");
  waiting.queue_timeout = std::chrono::milliseconds(10);
  EXPECT_EQ(router_->Plan(Tokens(4, 100), waiting).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(router_->plan_count(), 0u);
  EXPECT_EQ(router_->pending_count(), 0u);
  EXPECT_TRUE(router_->Free("busy"));
  EXPECT_EQ(ActiveBlocks(), 0u);
}

// A request whose free was lost holds its load until it expires; the next routing call past the
// expiry drops it, so a request it kept waiting is admitted and its id may be used again.
TEST_F(RouterLifecycleTest, ALostRequestPastItsExpiryIsDroppedByTheNextRoutingCall) {
  Make(RouterOptions{.queue_threshold = 0.0, .request_expiry_seconds = 2}, 1);
  const RouteOptions lost{.with_admission = true, .request_id = "lost"};
  ASSERT_TRUE(router_->FindBestMatch(Tokens(4), lost).ok());
  RouteOptions next{.with_admission = true, .request_id = "next"};
  next.queue_timeout = std::chrono::milliseconds(10);
  EXPECT_EQ(router_->FindBestMatch(Tokens(4, 100), next).status().code(),
            absl::StatusCode::kDeadlineExceeded);  // the worker is busy with "lost"
  clock_.AdvanceSeconds(2.5);
  EXPECT_TRUE(router_->FindBestMatch(Tokens(4, 100), next).ok());
  EXPECT_EQ(router_->active_requests(), 1u);
  EXPECT_TRUE(router_->Free("next"));
  clock_.AdvanceSeconds(0.5);
  EXPECT_TRUE(router_->FindBestMatch(Tokens(4), lost).ok());  // booked anew, not a duplicate
  EXPECT_TRUE(router_->Free("lost"));
  EXPECT_EQ(ActiveBlocks(), 0u);
}

// Lost requests that expire when a booking sweeps make room for the request waiting behind them,
// whichever call books: here a direct booking (AddRequest), as kvr_router_add_request makes.
// (Before, AddRequest's own lazy expiry freed them and admitted nobody: the waiter timed out.)
TEST_F(RouterLifecycleTest, LostRequestsExpiredByADirectBookingAdmitTheirWaiter) {
  Make(RouterOptions{.queue_threshold = 0.0, .request_expiry_seconds = 10}, 2);
  const RouteOptions admit{.with_admission = true};
  RouteOptions lost1 = admit, lost2 = admit;
  lost1.request_id = "lost1";
  lost2.request_id = "lost2";
  ASSERT_TRUE(router_->FindBestMatch(Tokens(4), lost1).ok());
  ASSERT_TRUE(router_->FindBestMatch(Tokens(4, 100), lost2).ok());  // both workers busy now
  RouteOptions waiting = admit;
  waiting.request_id = "waiter";
  waiting.queue_timeout = std::chrono::seconds(10);
  std::future<absl::StatusOr<RouteDecision>> waiter = std::async(
      std::launch::async, [&] { return router_->FindBestMatch(Tokens(4, 200), waiting); });
  while (router_->pending_count() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  clock_.AdvanceSeconds(10.5);
  ASSERT_TRUE(router_->AddRequest("direct", Tokens(4, 300), WorkerKey{2, 0}, {}).ok());
  ASSERT_EQ(waiter.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_TRUE(waiter.get().ok());
  EXPECT_EQ(router_->active_requests(), 2u);  // the waiter's and the direct booking
}

TEST_F(RouterLifecycleTest, PinRestrictsToTheWorkerOrRank) {
  Make({}, 2);
  ASSERT_TRUE(router_->AddWorker(Worker(7, 4)).ok());
  RouteOptions options = Request("r");
  options.pin = WorkerPin{.worker_id = 7, .dp_rank = 2};
  auto exact = router_->Preview(Tokens(3), options);
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->worker, (WorkerKey{7, 2}));
  options.pin = WorkerPin{.worker_id = 7};
  auto any_rank = router_->Preview(Tokens(3), options);
  ASSERT_TRUE(any_rank.ok());
  EXPECT_EQ(any_rank->worker.worker_id, 7u);
  EXPECT_EQ(any_rank->candidates.size(), 4u);
  options.pin = WorkerPin{.worker_id = 9};
  EXPECT_EQ(router_->Preview(Tokens(3), options).status().code(), absl::StatusCode::kNotFound);
  options.pin = WorkerPin{.worker_id = 7, .dp_rank = 9};
  EXPECT_EQ(router_->Preview(Tokens(3), options).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RouterLifecycleTest, PinOutsideTheAllowedSetIsAnError) {
  Make();
  const std::vector<uint64_t> allowed = {1, 2};
  RouteOptions options = Request("r");
  options.allowed_worker_ids = allowed;
  options.pin = WorkerPin{.worker_id = 3};
  auto result = router_->Plan(Tokens(3), options);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("allowed"), std::string::npos);
  EXPECT_EQ(router_->active_requests(), 0u);
}

TEST_F(RouterLifecycleTest, AllowedSetRestrictsAndBypassesTheQueue) {
  Make(RouterOptions{.queue_threshold = 0.0}, 3);
  ASSERT_TRUE(
      router_->FindBestMatch(Tokens(4), RouteOptions{.with_admission = true, .request_id = "busy"})
          .ok());
  ASSERT_TRUE(router_
                  ->FindBestMatch(Tokens(4, 50),
                                  RouteOptions{.with_admission = true, .request_id = "busy2"})
                  .ok());
  ASSERT_TRUE(router_
                  ->FindBestMatch(Tokens(4, 90),
                                  RouteOptions{.with_admission = true, .request_id = "busy3"})
                  .ok());
  const std::vector<uint64_t> allowed = {2};
  RouteOptions options = Request("r");
  options.allowed_worker_ids = allowed;
  auto plan = router_->Plan(Tokens(3, 300), options);  // would queue without the allowed set
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->worker.worker_id, 2u);
  EXPECT_FALSE(plan->queued);
}

TEST_F(RouterLifecycleTest, HardSessionBindsAtCommitAndPinsLaterRequests) {
  Make();
  RouteOptions options = Request("a");
  options.session_id = "s";
  auto first = router_->Plan(Tokens(3), options);
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(router_->SessionBinding("s").has_value());  // not before dispatch
  ASSERT_TRUE(router_->Commit("a").ok());
  ASSERT_EQ(router_->SessionBinding("s"), first->worker);
  for (int i = 0; i < 20; ++i) {
    const std::string id = "b" + std::to_string(i);
    options.request_id = id;
    auto next = router_->Plan(Tokens(3, 1000 * (i + 1)), options);
    ASSERT_TRUE(next.ok());
    EXPECT_EQ(next->worker, first->worker);
    ASSERT_TRUE(router_->Commit(options.request_id).ok());
  }
}

// A request of a hard session waiting in the queue is steered by the binding as it stands
// when it is admitted: its bound worker removed meanwhile, it waits for and goes to another
// and the session is bound there, as a request arriving after the removal would. It kept the
// pin it had when queued and failed with "pinned worker ... is not registered" at once.
TEST_F(RouterLifecycleTest, AQueuedSessionRequestIsSteeredByTheBindingWhenAdmitted) {
  Make(RouterOptions{.queue_threshold = 0.0}, 2);  // a worker with any prefill in flight is busy
  RouteOptions first = Request("a");
  first.with_admission = true;
  first.session_id = "s";
  auto bound = router_->FindBestMatch(Tokens(3), first);
  ASSERT_TRUE(bound.ok()) << bound.status();
  ASSERT_EQ(router_->SessionBinding("s"), bound->worker);
  auto other = router_->FindBestMatch(Tokens(4, 50),
                                      RouteOptions{.with_admission = true, .request_id = "busy"});
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_NE(other->worker, bound->worker);
  std::optional<absl::StatusOr<RouteDecision>> answer;
  RouteOptions waits = first;
  waits.request_id = "q";
  router_->FindBestMatchAsync(Tokens(3, 300), waits,
                              [&](absl::StatusOr<RouteDecision> d) { answer = std::move(d); });
  ASSERT_EQ(router_->pending_count(), 1u);
  ASSERT_TRUE(router_->RemoveWorker(bound->worker.worker_id).ok());
  EXPECT_FALSE(answer.has_value()) << answer->status();  // the other worker is busy: it waits
  EXPECT_EQ(router_->pending_count(), 1u);
  ASSERT_TRUE(router_->Free("busy"));
  ASSERT_TRUE(answer.has_value());
  ASSERT_TRUE(answer->ok()) << answer->status();
  EXPECT_EQ((*answer)->worker, other->worker);
  EXPECT_EQ(router_->SessionBinding("s"), other->worker);
}

TEST_F(RouterLifecycleTest, HardSessionWhoseWorkerIsGoneRebinds) {
  Make();
  RouteOptions options = Request("a");
  options.session_id = "s";
  auto first = router_->Plan(Tokens(3), options);
  ASSERT_TRUE(first.ok() && router_->Commit("a").ok());
  ASSERT_TRUE(router_->RemoveWorker(first->worker.worker_id).ok());
  options.request_id = "b";
  auto second = router_->Plan(Tokens(3), options);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(second->worker, first->worker);
  EXPECT_FALSE(router_->SessionBinding("s").has_value());  // dropped, rebound at commit
  ASSERT_TRUE(router_->Commit("b").ok());
  EXPECT_EQ(router_->SessionBinding("s"), second->worker);
}

TEST_F(RouterLifecycleTest, SoftSessionPrefersTheBindingAndRebindsElsewhere) {
  Make();
  RouteOptions options = Request("a");
  options.session_id = "s";
  options.session_mode = SessionMode::kSoft;
  auto first = router_->Plan(Tokens(3), options);
  ASSERT_TRUE(first.ok() && router_->Commit("a").ok());
  options.request_id = "b";
  auto kept = router_->Plan(Tokens(3, 400), options);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->worker, first->worker);
  // A pin elsewhere (dispatch to another worker) rebinds the soft session at commit.
  const uint64_t other = first->worker.worker_id == 1 ? 2 : 1;
  options.request_id = "c";
  options.pin = WorkerPin{.worker_id = other};
  auto moved = router_->Plan(Tokens(3, 800), options);
  ASSERT_TRUE(moved.ok());
  ASSERT_TRUE(router_->Commit("c").ok());
  EXPECT_EQ(router_->SessionBinding("s"), (WorkerKey{other, 0}));
}

TEST_F(RouterLifecycleTest, SessionTtlSlidesAndExpiredBindingsAreReclaimed) {
  Make();
  RouteOptions options = Request("a");
  options.session_id = "s";
  options.session_ttl_seconds = 10;
  ASSERT_TRUE(router_->Plan(Tokens(3), options).ok());
  ASSERT_TRUE(router_->Commit("a").ok());
  clock_.AdvanceSeconds(8);
  // Previews neither refresh nor create.
  ASSERT_TRUE(router_->Preview(Tokens(3), options).ok());
  options.session_id = "other";
  ASSERT_TRUE(router_->Preview(Tokens(3), options).ok());
  EXPECT_EQ(router_->session_count(), 1u);
  options.session_id = "s";
  options.request_id = "b";
  ASSERT_TRUE(router_->Plan(Tokens(3), options).ok());  // use: refreshed
  clock_.AdvanceSeconds(8);
  EXPECT_TRUE(router_->SessionBinding("s").has_value());
  clock_.AdvanceSeconds(3);
  EXPECT_FALSE(router_->SessionBinding("s").has_value());
  EXPECT_EQ(router_->ReclaimExpiredSessions(), 1u);
  EXPECT_EQ(router_->session_count(), 0u);
}

}  // namespace
}  // namespace kvrouter

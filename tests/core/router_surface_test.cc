// What the Router does for every front end that the C layer used to do itself: applying a batch
// of events with one aggregated error, counting decisions and rejected inputs, the preconditions
// of restoring a snapshot, the index digest replicas compare, and the router-wide options (eagle
// hashing, entropy seeding, a worker's block size of 0).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/clock.h"
#include "core/hashing.h"
#include "core/router.h"
#include "test_data.h"

namespace kvrouter {
namespace {

constexpr uint32_t kBlockSize = 4;

std::vector<uint32_t> Tokens(size_t blocks, uint32_t first = 0) {
  return testing::BlockTokens(blocks, kBlockSize, first);
}

// `worker` cached `tokens` (whole blocks) as one sequence from the root; engine hashes are the
// sequence hashes.
KvEvent Stored(uint64_t worker, const std::vector<uint32_t>& tokens) {
  StoredEvent stored;
  stored.block_hashes = ComputeSequenceHashes(ComputeLocalBlockHashes(tokens, kBlockSize, {}));
  stored.token_ids = tokens;
  return KvEvent{.worker = {worker, 0}, .data = stored};
}

KvEvent Removed(uint64_t worker, uint64_t engine_hash) {
  return KvEvent{.worker = {worker, 0}, .data = RemovedEvent{.block_hashes = {engine_hash}}};
}

// A stored event whose parent no rank holds.
KvEvent Orphan(uint64_t worker) {
  StoredEvent stored;
  stored.parent_hash = 0xDEAD;
  stored.block_hashes = {1};
  stored.token_ids = Tokens(1, 900);
  return KvEvent{.worker = {worker, 0}, .data = stored};
}

class RouterSurfaceTest : public ::testing::Test {
 protected:
  void Make(RouterOptions options = {}, int workers = 2) {
    options.block_size = kBlockSize;
    options.clock = &clock_;
    auto router = Router::Create(std::move(options));
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = std::move(*router);
    for (int i = 1; i <= workers; ++i) {
      ASSERT_TRUE(
          router_->AddWorker({.worker_id = static_cast<uint64_t>(i), .block_size = 0}).ok());
    }
  }

  uint64_t Decisions() const { return router_->counters().decisions; }

  ManualClock clock_;
  std::unique_ptr<Router> router_;
};

// ---------------------------------------------------------------------------------------------
// Event batches

TEST_F(RouterSurfaceTest, EventStatusMapsEachOutcome) {
  EXPECT_TRUE(EventStatus({}).ok());
  const absl::Status missing =
      EventStatus({.error = EventError::kBlockNotFound, .message = "gone"});
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.message(), "gone");
  EXPECT_EQ(EventStatus({.error = EventError::kParentBlockNotFound}).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(EventStatus({.error = EventError::kInvalidBlock}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EventStatus({.error = EventError::kInvalidBlockSequence}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RouterSurfaceTest, ABatchAppliesEveryGoodEventAndReportsTheFirstBadOne) {
  Make();
  const std::vector<KvEvent> batch = {Stored(1, Tokens(2)), Orphan(1), Stored(2, Tokens(3, 100)),
                                      Removed(2, 0xBEEF), Stored(2, Tokens(1, 500))};
  const absl::Status status = router_->ApplyEvents(batch);
  // The first rejection's code and position, and how many of the batch were rejected.
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_EQ(status.message().rfind("event 1: ", 0), 0u) << status;
  EXPECT_NE(status.message().find("(2 of 5 events rejected, the others applied)"),
            std::string_view::npos)
      << status;
  // Every good event applied, the ones after a rejection too.
  EXPECT_EQ(router_->IndexStats().cached_blocks, 2u + 3u + 1u);
  EXPECT_EQ(router_->counters().event_batches_rejected, 0u);
}

TEST_F(RouterSurfaceTest, ABatchOfGoodEventsOrNoneIsOk) {
  Make();
  EXPECT_TRUE(router_->ApplyEvents({}).ok());
  const std::vector<KvEvent> batch = {Stored(1, Tokens(2)), Stored(2, Tokens(2))};
  EXPECT_TRUE(router_->ApplyEvents(batch).ok());
  EXPECT_EQ(router_->IndexStats().cached_blocks, 4u);
}

TEST_F(RouterSurfaceTest, ABatchInApproximateModeStopsAtTheFirstEvent) {
  Make({.use_kv_events = false});
  const std::vector<KvEvent> batch = {Stored(1, Tokens(2)), Stored(2, Tokens(2))};
  const absl::Status status = router_->ApplyEvents(batch);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("event 0: "), std::string_view::npos) << status;
  EXPECT_NE(status.message().find("(1 of 2 events rejected"), std::string_view::npos) << status;
  EXPECT_TRUE(router_->ApplyEvents({}).ok());
}

TEST_F(RouterSurfaceTest, RejectedBatchesAndReplicaChangesAreCounted) {
  Make();
  router_->CountRejectedBatch();
  router_->CountRejectedBatch();
  EXPECT_EQ(router_->counters().event_batches_rejected, 2u);

  // An undecodable replica change counts with the ones the router refuses.
  SequenceChange unknown_rank{
      .kind = SequenceChange::Kind::kAdded, .request_id = "r", .worker = {99, 0}};
  EXPECT_FALSE(router_->ApplyReplicaChange("peer", unknown_rank).ok());
  router_->CountRejectedReplicaChange();
  EXPECT_EQ(router_->replica_stats().changes_rejected, 2u);
  EXPECT_EQ(router_->replica_stats().changes_applied, 0u);
}

// ---------------------------------------------------------------------------------------------
// Decisions

TEST_F(RouterSurfaceTest, DecisionsCountEverySuccessfulRoutingCallButNotPreviews) {
  Make();
  const auto prompt = Tokens(3);
  ASSERT_TRUE(router_->FindBestMatch(prompt, {}).ok());
  EXPECT_EQ(Decisions(), 1u);
  ASSERT_TRUE(router_->Preview(prompt, {}).ok());
  EXPECT_EQ(Decisions(), 1u);

  int called = 0;
  router_->FindBestMatchAsync(prompt, {}, [&](absl::StatusOr<RouteDecision> result) {
    EXPECT_TRUE(result.ok());
    ++called;
  });
  EXPECT_EQ(called, 1);
  EXPECT_EQ(Decisions(), 2u);

  // A plan is a decision; planning the same id again returns it and counts again, as the C
  // layer counted every successful kvr_plan_route.
  const RouteOptions plan{.request_id = "p"};
  ASSERT_TRUE(router_->Plan(prompt, plan).ok());
  ASSERT_TRUE(router_->Plan(prompt, plan).ok());
  EXPECT_EQ(Decisions(), 4u);

  // A failed call is no decision: a duplicate id, no eligible rank.
  const RouteOptions admit{.with_admission = true, .request_id = "p"};
  EXPECT_EQ(router_->FindBestMatch(prompt, admit).status().code(),
            absl::StatusCode::kAlreadyExists);
  const uint64_t nobody[] = {42};
  EXPECT_FALSE(router_->FindBestMatch(prompt, {.allowed_worker_ids = nobody}).ok());
  EXPECT_EQ(Decisions(), 4u);
}

TEST_F(RouterSurfaceTest, ARequestAdmittedFromTheQueueCountsOnceWhenAdmitted) {
  Make({.queue_threshold = 0.0}, /*workers=*/0);
  ASSERT_TRUE(router_->AddWorker({.worker_id = 1, .max_num_batched_tokens = 8}).ok());
  ASSERT_TRUE(router_->FindBestMatch(Tokens(4), {.with_admission = true, .request_id = "a"}).ok());
  std::optional<absl::StatusOr<RouteDecision>> queued;
  router_->FindBestMatchAsync(Tokens(4, 100), {.with_admission = true, .request_id = "b"},
                              [&](absl::StatusOr<RouteDecision> result) { queued = result; });
  ASSERT_FALSE(queued.has_value());
  EXPECT_EQ(router_->pending_count(), 1u);
  EXPECT_EQ(Decisions(), 1u);
  ASSERT_TRUE(router_->MarkPrefillCompleted("a"));
  ASSERT_TRUE(queued.has_value());
  ASSERT_TRUE(queued->ok());
  EXPECT_TRUE((*queued)->queued);
  EXPECT_EQ(Decisions(), 2u);
}

// ---------------------------------------------------------------------------------------------
// Snapshots

TEST_F(RouterSurfaceTest, RestoringASnapshotChecksItsBlockSizeAndAnEmptyIndex) {
  Make();
  ASSERT_TRUE(router_->ApplyEvents(std::vector<KvEvent>{Stored(1, Tokens(3))}).ok());
  const std::vector<KvEvent> dump = router_->DumpIndexEvents();

  auto fresh = Router::Create({.block_size = kBlockSize});
  ASSERT_TRUE(fresh.ok());
  const absl::Status wrong_size = (*fresh)->RestoreSnapshot(kBlockSize * 2, dump);
  EXPECT_EQ(wrong_size.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong_size.message().find("block size 8 differs from the router's 4"),
            std::string_view::npos)
      << wrong_size;
  EXPECT_EQ((*fresh)->IndexStats().cached_blocks, 0u);

  ASSERT_TRUE((*fresh)->RestoreSnapshot(kBlockSize, dump).ok());
  EXPECT_EQ((*fresh)->IndexStats().cached_blocks, 3u);
  // A second restore would replace what the router learnt since: refused.
  const absl::Status again = (*fresh)->RestoreSnapshot(kBlockSize, dump);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find("not empty"), std::string_view::npos) << again;

  auto approximate = Router::Create({.block_size = kBlockSize, .use_kv_events = false});
  ASSERT_TRUE(approximate.ok());
  EXPECT_EQ((*approximate)->RestoreSnapshot(kBlockSize, dump).code(),
            absl::StatusCode::kFailedPrecondition);
}

// ---------------------------------------------------------------------------------------------
// Index digest

// Replicas compare IndexDigest across processes, so it may depend only on which blocks each
// rank holds: not on the order workers were registered or events of different workers arrived,
// nor on how many trees the index is split over.
TEST_F(RouterSurfaceTest, TheIndexDigestDependsOnlyOnWhichRankHoldsWhichBlocks) {
  auto one = Router::Create({.block_size = kBlockSize, .index_shards = 1});
  auto four = Router::Create({.block_size = kBlockSize, .index_shards = 4});
  ASSERT_TRUE(one.ok() && four.ok());
  for (uint64_t w : {1, 2, 3}) ASSERT_TRUE((*one)->AddWorker({.worker_id = w}).ok());
  for (uint64_t w : {3, 1, 2}) ASSERT_TRUE((*four)->AddWorker({.worker_id = w}).ok());
  const std::vector<KvEvent> events = {Stored(1, Tokens(3)), Stored(2, Tokens(2)),
                                       Stored(3, Tokens(4, 100))};
  ASSERT_TRUE((*one)->ApplyEvents(events).ok());
  const std::vector<KvEvent> reversed(events.rbegin(), events.rend());
  ASSERT_TRUE((*four)->ApplyEvents(reversed).ok());
  EXPECT_EQ((*one)->IndexDigest(), (*four)->IndexDigest());

  // One block fewer on worker 2 is another index.
  const uint64_t last_of_two = std::get<StoredEvent>(events[1].data).block_hashes.back();
  ASSERT_TRUE((*four)->ApplyEvent(Removed(2, last_of_two)).ok());
  EXPECT_NE((*one)->IndexDigest(), (*four)->IndexDigest());
}

// A rank whose blocks all went is as one never heard of: a replica that saw them come and go
// agrees with one that started later from a snapshot.
TEST_F(RouterSurfaceTest, ARankHoldingNothingLeavesTheIndexDigestAlone) {
  Make();
  const uint64_t empty = router_->IndexDigest();
  const std::vector<KvEvent> stored = {Stored(1, Tokens(2))};
  ASSERT_TRUE(router_->ApplyEvents(stored).ok());
  EXPECT_NE(router_->IndexDigest(), empty);
  for (uint64_t hash : std::get<StoredEvent>(stored[0].data).block_hashes) {
    ASSERT_TRUE(router_->ApplyEvent(Removed(1, hash)).ok());
  }
  EXPECT_EQ(router_->IndexDigest(), empty);
}

TEST_F(RouterSurfaceTest, AnIndexRestoredFromASnapshotHasTheSameIndexDigest) {
  Make();
  ASSERT_TRUE(
      router_->ApplyEvents(std::vector<KvEvent>{Stored(1, Tokens(3)), Stored(2, Tokens(5, 40))})
          .ok());
  auto fresh = Router::Create({.block_size = kBlockSize, .index_shards = 3});
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE((*fresh)->RestoreSnapshot(kBlockSize, router_->DumpIndexEvents()).ok());
  EXPECT_EQ((*fresh)->IndexDigest(), router_->IndexDigest());
}

TEST_F(RouterSurfaceTest, ABookingChangesTheStateDigestButNotTheIndexDigest) {
  Make();
  ASSERT_TRUE(router_->ApplyEvents(std::vector<KvEvent>{Stored(1, Tokens(3))}).ok());
  const uint64_t index = router_->IndexDigest();
  const uint64_t state = router_->StateDigest();
  ASSERT_TRUE(router_->FindBestMatch(Tokens(4), {.with_admission = true, .request_id = "r"}).ok());
  EXPECT_EQ(router_->active_requests(), 1u);
  EXPECT_NE(router_->StateDigest(), state);
  EXPECT_EQ(router_->IndexDigest(), index);
}

// Without KV events the index is the decisions the router recorded, so there an admitted
// decision is index content (a query-only one is not).
TEST_F(RouterSurfaceTest, InApproximateModeAnAdmittedDecisionEntersTheIndexDigest) {
  Make(RouterOptions{.use_kv_events = false});
  const uint64_t empty = router_->IndexDigest();
  ASSERT_TRUE(router_->FindBestMatch(Tokens(3), {}).ok());
  EXPECT_EQ(router_->IndexDigest(), empty);
  ASSERT_TRUE(router_->FindBestMatch(Tokens(3), {.with_admission = true, .request_id = "r"}).ok());
  EXPECT_NE(router_->IndexDigest(), empty);
}

// ---------------------------------------------------------------------------------------------
// Router-wide options

TEST_F(RouterSurfaceTest, AnEagleRouterHashesEveryPromptWithEagleWindows) {
  RouterOptions options;
  options.eagle = true;
  Make(options);
  // Cached by an eagle engine: blocks of block_size + 1 tokens.
  const std::vector<uint32_t> prompt = Tokens(4);
  StoredEvent stored;
  stored.token_ids = prompt;
  stored.eagle = true;
  const auto local = ComputeLocalBlockHashes(prompt, kBlockSize, {.eagle = true});
  stored.block_hashes = ComputeSequenceHashes(local);
  ASSERT_TRUE(router_->ApplyEvent({.worker = {1, 0}, .data = stored})->ok());
  ASSERT_EQ(local.size(), 3u);

  // A request that does not ask for eagle hashing matches all the same.
  auto decision = router_->FindBestMatch(prompt, {});
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->worker.worker_id, 1u);
  EXPECT_EQ(decision->device_overlap_blocks, 3u);

  Make();  // without the option the same request hashes otherwise and matches nothing
  ASSERT_TRUE(router_->ApplyEvent({.worker = {1, 0}, .data = stored})->ok());
  EXPECT_EQ(router_->FindBestMatch(prompt, {})->device_overlap_blocks, 0u);
}

TEST_F(RouterSurfaceTest, EntropySeededRoutersDrawDifferently) {
  // With temperature every pick is a draw; two routers seeded alike pick alike, two seeded
  // from entropy (almost surely) do not over many draws.
  const auto picks = [&](RouterOptions options) {
    options.selection.temperature = 1.0;
    Make(options, /*workers=*/8);
    std::string out;
    for (int i = 0; i < 64; ++i) {
      out += std::to_string(router_->FindBestMatch(Tokens(1, i * 10), {})->worker.worker_id);
    }
    return out;
  };
  RouterOptions seeded;
  seeded.random_seed = 5;
  EXPECT_EQ(picks(seeded), picks(seeded));
  RouterOptions entropy = seeded;
  entropy.seed_from_entropy = true;
  EXPECT_NE(picks(entropy), picks(entropy));
}

TEST_F(RouterSurfaceTest, AWorkerBlockSizeOfZeroIsTheRouters) {
  Make({}, /*workers=*/0);
  ASSERT_TRUE(router_->AddWorker({.worker_id = 7, .block_size = 0}).ok());
  ASSERT_EQ(router_->Workers().size(), 1u);
  EXPECT_EQ(router_->Workers()[0].block_size, kBlockSize);
  ASSERT_TRUE(router_->UpdateWorker({.worker_id = 7, .dp_size = 2, .block_size = 0}).ok());
  EXPECT_EQ(router_->Workers()[0].block_size, kBlockSize);
  EXPECT_EQ(router_->AddWorker({.worker_id = 8, .block_size = kBlockSize + 1}).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvrouter

// The core of disaggregated serving: per-phase pins, forced decode overrides, prefill routing
// with bootstrap rooms, the empty prefill pool and the conditional policies.
#include "core/disagg_router.h"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "core/clock.h"

namespace kvrouter {
namespace {

constexpr uint32_t kBlockSize = 4;

TEST(PinForPhaseTest, FollowsDynamosFallbacks) {
  const RoutingHints hints{.worker_id = 1,
                           .prefill_worker_id = 2,
                           .decode_worker_id = 3,
                           .dp_rank = 4,
                           .prefill_dp_rank = 5};
  auto aggregated = PinForPhase(hints, Phase::kAggregated);
  auto prefill = PinForPhase(hints, Phase::kPrefill);
  auto decode = PinForPhase(hints, Phase::kDecode);
  ASSERT_TRUE(aggregated && prefill && decode);
  EXPECT_EQ(aggregated->worker_id, 1u);
  EXPECT_EQ(aggregated->dp_rank, 4u);
  EXPECT_EQ(prefill->worker_id, 2u);
  EXPECT_EQ(prefill->dp_rank, 5u);
  EXPECT_EQ(decode->worker_id, 3u);
  EXPECT_EQ(decode->dp_rank, 4u);
  const RoutingHints only_backend{.worker_id = 9};
  EXPECT_EQ(PinForPhase(only_backend, Phase::kPrefill)->worker_id, 9u);
  EXPECT_EQ(PinForPhase(only_backend, Phase::kDecode)->worker_id, 9u);
  EXPECT_FALSE(PinForPhase(only_backend, Phase::kDecode)->dp_rank.has_value());
  EXPECT_FALSE(PinForPhase(RoutingHints{}, Phase::kAggregated).has_value());
}

TEST(DecodeOverridesTest, ForcesThreeFieldsAndKeepsTheRest) {
  SelectorOverrides request;
  request.temperature = 0.3;
  request.overlap_score_credit = 2.0;
  request.track_prefill_tokens = true;
  const SelectorOverrides decode = DecodeOverrides(request);
  EXPECT_EQ(decode.overlap_score_credit, 0.0);
  EXPECT_EQ(decode.assume_kv_reuse, false);
  EXPECT_EQ(decode.track_prefill_tokens, false);
  EXPECT_EQ(decode.temperature, 0.3);
}

class DisaggRouterTest : public ::testing::Test {
 protected:
  std::unique_ptr<Router> MakePool() {
    auto router = Router::Create(RouterOptions{.block_size = kBlockSize, .clock = &clock_});
    EXPECT_TRUE(router.ok());
    return std::move(*router);
  }
  void AddWorker(Router& pool, uint64_t id, uint64_t total_kv_blocks = 1000) {
    ASSERT_TRUE(pool.AddWorker(WorkerConfig{.worker_id = id,
                                            .dp_start = 0,
                                            .dp_size = 1,
                                            .total_kv_blocks = total_kv_blocks,
                                            .max_num_batched_tokens = 0,
                                            .block_size = kBlockSize})
                    .ok());
  }
  ManualClock clock_;
  std::vector<uint32_t> tokens_ = std::vector<uint32_t>(8 * kBlockSize, 1);
};

TEST_F(DisaggRouterTest, RemotePrefillBooksAndGivesABootstrapRoom) {
  auto prefill = MakePool();
  auto decode = MakePool();
  AddWorker(*prefill, 1);
  AddWorker(*decode, 2);
  DisaggRouter disagg(*prefill, *decode, DisaggOptions{});
  auto route = disagg.RoutePrefill(tokens_, RouteOptions{.request_id = "r"});
  ASSERT_TRUE(route.ok()) << route.status();
  EXPECT_TRUE(route->remote());
  EXPECT_GE(route->bootstrap_room, 0);
  EXPECT_EQ(prefill->active_requests(), 1u);
  auto decoded = disagg.RouteDecode(tokens_, RouteOptions{.request_id = "r"}, true);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->worker.worker_id, 2u);
  EXPECT_EQ(decode->Loads()[0].active_prefill_tokens, 0u);  // prefill tracking forced off
}

TEST_F(DisaggRouterTest, CreateChecksOptionsAndBlockSizes) {
  auto prefill = MakePool();
  auto decode = MakePool();
  EXPECT_TRUE(DisaggRouter::Create(*prefill, *decode, DisaggOptions{}).ok());
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const DisaggOptions& bad :
       {DisaggOptions{.max_local_prefill_ratio = -0.5}, DisaggOptions{.prefill_busy_threshold = -1},
        DisaggOptions{.prefill_busy_threshold = nan}}) {
    EXPECT_EQ(DisaggRouter::Create(*prefill, *decode, bad).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  auto other = Router::Create(RouterOptions{.block_size = kBlockSize * 2});
  ASSERT_TRUE(other.ok());
  const auto mismatch = DisaggRouter::Create(*prefill, **other, DisaggOptions{});
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.status().message().find("block sizes differ"), std::string_view::npos);
}

TEST_F(DisaggRouterTest, PrefillWorkerBusyRefusesANegativeThreshold) {
  auto prefill = MakePool();
  auto decode = MakePool();
  AddWorker(*prefill, 1);
  DisaggRouter disagg(*prefill, *decode, DisaggOptions{});
  EXPECT_EQ(disagg.PrefillWorkerBusy(tokens_, {}, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(disagg.PrefillWorkerBusy(tokens_, {}, std::numeric_limits<double>::quiet_NaN())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  auto idle = disagg.PrefillWorkerBusy(tokens_, {}, 0.5);
  ASSERT_TRUE(idle.ok());
  EXPECT_FALSE(*idle);
}

TEST_F(DisaggRouterTest, EmptyPrefillPoolRunsAggregatedUnlessEnforced) {
  auto prefill = MakePool();
  auto decode = MakePool();
  AddWorker(*decode, 2);
  DisaggRouter lenient(*prefill, *decode, DisaggOptions{});
  auto route = lenient.RoutePrefill(tokens_, RouteOptions{.request_id = "r"});
  ASSERT_TRUE(route.ok());
  EXPECT_EQ(route->placement, PrefillPlacement::kNoPrefillWorkers);
  DisaggRouter strict(*prefill, *decode, DisaggOptions{.enforce = true});
  EXPECT_EQ(strict.RoutePrefill(tokens_, RouteOptions{.request_id = "r"}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(DisaggRouterTest, IslBoundingNeedsAnOpenDecodeGuard) {
  auto prefill = MakePool();
  auto decode = MakePool();
  AddWorker(*prefill, 1);
  AddWorker(*decode, 2, /*total_kv_blocks=*/100);
  DisaggRouter unguarded(*prefill, *decode, DisaggOptions{.policy = DisaggPolicy::kIslBounding});
  auto remote = unguarded.RoutePrefill(tokens_, RouteOptions{.request_id = "a"});
  ASSERT_TRUE(remote.ok());
  EXPECT_TRUE(remote->remote());
  DisaggRouter guarded(
      *prefill, *decode,
      DisaggOptions{.policy = DisaggPolicy::kIslBounding, .decode_busy_threshold = 0.5});
  auto local = guarded.RoutePrefill(tokens_, RouteOptions{.request_id = "b"});
  ASSERT_TRUE(local.ok());
  EXPECT_EQ(local->placement, PrefillPlacement::kShortIsl);
  EXPECT_EQ(prefill->active_requests(), 1u);  // only "a"
}

}  // namespace
}  // namespace kvrouter

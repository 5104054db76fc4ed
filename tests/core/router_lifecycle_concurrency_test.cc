// Plan / commit / abort / free and previews from many threads at once: every booking ends up
// freed, no plan is left behind, and sessions stay consistent (run under TSan by CI).
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "core/hashing.h"
#include "core/router.h"

namespace kvrouter {
namespace {

constexpr uint32_t kBlockSize = 4;

TEST(RouterLifecycleConcurrencyTest, StagedRoutingFromManyThreadsLeaksNothing) {
  auto created = Router::Create(RouterOptions{.block_size = kBlockSize, .random_seed = 3});
  ASSERT_TRUE(created.ok());
  Router& router = **created;
  for (uint64_t id = 1; id <= 4; ++id) {
    ASSERT_TRUE(router
                    .AddWorker(WorkerConfig{.worker_id = id,
                                            .dp_start = 0,
                                            .dp_size = 2,
                                            .total_kv_blocks = 1000,
                                            .max_num_batched_tokens = 0,
                                            .block_size = kBlockSize})
                    .ok());
  }
  constexpr int kThreads = 4;
  constexpr int kRequests = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&router, t] {
      std::vector<uint32_t> tokens(6 * kBlockSize);
      for (int i = 0; i < kRequests; ++i) {
        for (size_t k = 0; k < tokens.size(); ++k) tokens[k] = static_cast<uint32_t>(k + i % 7);
        const std::string id = std::to_string(t) + "-" + std::to_string(i);
        const std::string session = "s" + std::to_string(i % 5);
        RouteOptions options{.request_id = id};
        options.session_id = session;
        options.session_mode = i % 2 ? SessionMode::kSoft : SessionMode::kHard;
        auto preview = router.Preview(tokens, options);
        ASSERT_TRUE(preview.ok());
        auto plan = router.Plan(tokens, options, preview->worker);
        ASSERT_TRUE(plan.ok()) << plan.status();
        switch (i % 3) {
          case 0:
            EXPECT_TRUE(router.Commit(id).ok());
            router.MarkPrefillCompleted(id);
            router.Free(id);
            break;
          case 1:
            router.Abort(id);
            break;
          default:
            router.Free(id);  // before commit
            EXPECT_FALSE(router.Commit(id).ok());
            break;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(router.active_requests(), 0u);
  EXPECT_EQ(router.plan_count(), 0u);
  for (const auto& load : router.Loads()) {
    EXPECT_EQ(load.active_blocks, 0u);
    EXPECT_EQ(load.active_prefill_tokens, 0u);
  }
  EXPECT_LE(router.session_count(), 5u);
}

// Routes that queue from many threads while another closes the queue: every call ends (those
// waiting cancelled, the later ones that would wait cancelled at once, the others routed), and
// freeing what was booked leaves nothing behind (run under TSan by CI).
TEST(RouterLifecycleConcurrencyTest, ClosingTheQueueEndsEveryWaitingCall) {
  auto created = Router::Create(RouterOptions{.block_size = kBlockSize, .queue_threshold = 0.0});
  ASSERT_TRUE(created.ok());
  Router& router = **created;
  ASSERT_TRUE(router
                  .AddWorker(WorkerConfig{.worker_id = 1,
                                          .dp_start = 0,
                                          .dp_size = 1,
                                          .total_kv_blocks = 1000,
                                          .max_num_batched_tokens = 1,
                                          .block_size = kBlockSize})
                  .ok());
  const std::vector<uint32_t> tokens(4 * kBlockSize, 7);
  ASSERT_TRUE(router.FindBestMatch(tokens, {.with_admission = true, .request_id = "busy"}).ok());
  constexpr int kThreads = 4;
  constexpr int kRequests = 50;
  std::atomic<int> cancelled = 0, routed = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRequests; ++i) {
        const std::string id = std::to_string(t) + "-" + std::to_string(i);
        auto decision = router.FindBestMatch(tokens, {.with_admission = true, .request_id = id});
        if (decision.ok()) {
          ++routed;
          router.Free(id);
        } else {
          EXPECT_EQ(decision.status().code(), absl::StatusCode::kCancelled) << decision.status();
          ++cancelled;
        }
      }
    });
  }
  // "busy" holds the only worker: the threads' first requests wait.
  while (router.pending_count() == 0) std::this_thread::yield();
  const size_t closed = router.CloseQueue();
  EXPECT_GE(closed, 1u);
  EXPECT_LE(closed, static_cast<size_t>(kThreads));
  router.Free("busy");  // would have admitted a waiter, had the queue been open
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(routed.load() + cancelled.load(), kThreads * kRequests);
  EXPECT_GE(cancelled.load(), 1);
  EXPECT_EQ(router.pending_count(), 0u);
  EXPECT_EQ(router.active_requests(), 0u);
  EXPECT_EQ(router.CloseQueue(), 0u);
}

// Two restores of a snapshot at once into an empty router: one loads it, the other finds the
// index no longer empty (before, both passed the emptiness check and both applied their events,
// answering OK twice).
TEST(RouterLifecycleConcurrencyTest, OfTwoRestoresAtOnceOneLoadsTheSnapshot) {
  auto source = Router::Create(RouterOptions{.block_size = kBlockSize});
  ASSERT_TRUE(source.ok());
  for (uint32_t chain = 0; chain < 200; ++chain) {
    std::vector<uint32_t> tokens(10 * kBlockSize);
    for (size_t k = 0; k < tokens.size(); ++k) tokens[k] = chain * 1000 + static_cast<uint32_t>(k);
    StoredEvent stored;
    stored.token_ids = tokens;
    stored.block_hashes = ComputeSequenceHashes(ComputeLocalBlockHashes(tokens, kBlockSize));
    ASSERT_TRUE((*source)->ApplyEvent({.worker = {1 + chain % 3, 0}, .data = stored})->ok());
  }
  const std::vector<KvEvent> snapshot = (*source)->DumpIndexEvents();
  for (int round = 0; round < 20; ++round) {
    auto created = Router::Create(RouterOptions{.block_size = kBlockSize});
    ASSERT_TRUE(created.ok());
    Router& router = **created;
    std::atomic<int> ready{0};
    absl::Status results[2];
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < 2) {
        }
        results[t] = router.RestoreSnapshot(kBlockSize, snapshot);
      });
    }
    for (auto& thread : threads) thread.join();
    const int loaded = results[0].ok() + results[1].ok();
    ASSERT_EQ(loaded, 1) << results[0] << " / " << results[1];
    const absl::Status& refused = results[0].ok() ? results[1] : results[0];
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_EQ(router.IndexDigest(), (*source)->IndexDigest());
  }
}

}  // namespace
}  // namespace kvrouter

// The ingest service's life cycle against callers on several threads: sources may be added
// before Start, from any thread, while another thread starts or stops the service
// (include/kvrouter.h: kvr_ingest_add_engine_worker, _listen, _start and _stop are concurrent).
// Before Start a command runs on its caller's thread; these tests would have two of them touch
// the same loop state at once, or one run while Start hands the loop to its thread (seen by
// ThreadSanitizer, which CI runs this suite under; a plain build may crash or lose a source).
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <thread>
#include <vector>

#include "core/router.h"
#include "ingest/ingest_service.h"

namespace kvrouter {
namespace {

constexpr uint64_t kWorkers = 8;

class IngestLifecycleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto router = Router::Create(RouterOptions{.block_size = 16});
    ASSERT_TRUE(router.ok());
    router_ = std::move(*router);
    auto service = IngestService::Create(router_.get(), {});
    ASSERT_TRUE(service.ok());
    ingest_ = std::move(*service);
  }

  // Each of kWorkers threads adds one engine worker (nothing listens at the endpoint: the
  // connection is attempted in the background) while `other` runs on a thread of its own;
  // returns how many adds succeeded.
  int AddWorkersWhile(const std::function<void()>& other) {
    std::atomic<int> added = 0;
    std::atomic<bool> go = false;
    std::vector<std::thread> threads;
    for (uint64_t w = 1; w <= kWorkers; ++w) {
      threads.emplace_back([&, w] {
        while (!go.load()) std::this_thread::yield();
        auto id = ingest_->AddEngineWorker({.endpoint = "tcp://127.0.0.1:9", .worker_id = w});
        if (id.ok()) {
          ++added;
        } else {
          EXPECT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
        }
      });
    }
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      other();
    });
    go = true;
    for (std::thread& t : threads) t.join();
    return added.load();
  }

  std::unique_ptr<Router> router_;
  std::unique_ptr<IngestService> ingest_;
};

TEST_F(IngestLifecycleTest, SourcesAddedFromManyThreadsWhileTheServiceStarts) {
  const int added = AddWorkersWhile([&] { EXPECT_TRUE(ingest_->Start().ok()); });
  EXPECT_EQ(added, static_cast<int>(kWorkers));
  EXPECT_EQ(ingest_->Sources().size(), kWorkers);
  // Every one is a live source of the running loop: removing each works.
  for (uint64_t w = 1; w <= kWorkers; ++w) {
    EXPECT_TRUE(ingest_->RemoveEngineWorker(w, /*clear_index=*/false).ok()) << "worker " << w;
  }
  ingest_->Stop();
}

TEST_F(IngestLifecycleTest, SourcesAddedFromManyThreadsWhileTheUnstartedServiceStops) {
  const int added = AddWorkersWhile([&] { ingest_->Stop(); });
  // Those added before the stop were closed by it; the others were refused.
  EXPECT_LE(added, static_cast<int>(kWorkers));
  EXPECT_EQ(ingest_->Start().code(), absl::StatusCode::kFailedPrecondition);
  auto late = ingest_->AddEngineWorker({.endpoint = "tcp://127.0.0.1:9", .worker_id = 99});
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvrouter

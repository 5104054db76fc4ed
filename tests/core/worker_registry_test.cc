#include "core/worker_registry.h"

#include <gtest/gtest.h>

#include <limits>

namespace kvrouter {
namespace {

WorkerConfig Config(uint64_t id, uint32_t dp_start = 0, uint32_t dp_size = 1) {
  return WorkerConfig{.worker_id = id,
                      .dp_start = dp_start,
                      .dp_size = dp_size,
                      .total_kv_blocks = 1000,
                      .max_num_batched_tokens = 8192,
                      .block_size = 16};
}

TEST(WorkerRegistryTest, AddsFindsAndListsWorkers) {
  WorkerRegistry registry(16);
  ASSERT_TRUE(registry.Add(Config(7, 2, 2)).ok());
  ASSERT_TRUE(registry.Add(Config(3)).ok());
  EXPECT_EQ(registry.size(), 2u);
  ASSERT_NE(registry.Find(7), nullptr);
  EXPECT_EQ(registry.Find(7)->max_num_batched_tokens, 8192u);
  EXPECT_TRUE(registry.HasRank({.worker_id = 7, .dp_rank = 3}));
  EXPECT_FALSE(registry.HasRank({.worker_id = 7, .dp_rank = 1}));
  EXPECT_FALSE(registry.HasRank({.worker_id = 8, .dp_rank = 0}));
  const auto workers = registry.Workers();
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(workers[0].worker_id, 3u);
  EXPECT_EQ(RanksOf(Config(7, 2, 2)), (std::vector<WorkerKey>{{.worker_id = 7, .dp_rank = 2},
                                                              {.worker_id = 7, .dp_rank = 3}}));
}

TEST(WorkerRegistryTest, RejectsABlockSizeOtherThanTheRouters) {
  WorkerRegistry registry(16);
  WorkerConfig config = Config(1);
  config.block_size = 32;
  const absl::Status status = registry.Add(config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("block size 32"), std::string_view::npos) << status;
  EXPECT_NE(status.message().find("16"), std::string_view::npos) << status;
  config.block_size = 0;
  EXPECT_EQ(registry.Add(config).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.size(), 0u);
}

TEST(WorkerRegistryTest, RejectsBadRankRanges) {
  WorkerRegistry registry(16);
  EXPECT_EQ(registry.Add(Config(1, 0, 0)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Add(Config(1, std::numeric_limits<uint32_t>::max(), 2)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(registry.Add(Config(1, std::numeric_limits<uint32_t>::max(), 1)).ok());
}

TEST(WorkerRegistryTest, DuplicateAddAndUnknownUpdateOrRemoveAreErrors) {
  WorkerRegistry registry(16);
  ASSERT_TRUE(registry.Add(Config(1)).ok());
  EXPECT_EQ(registry.Add(Config(1)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.ChangesOf(Config(2)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Remove(2).status().code(), absl::StatusCode::kNotFound);
  auto removed = registry.Remove(1);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, Config(1));
  EXPECT_EQ(registry.Remove(1).status().code(), absl::StatusCode::kNotFound);
}

TEST(WorkerRegistryTest, AnUpdatesChangesAreReportedThenMadeByReplace) {
  WorkerRegistry registry(16);
  ASSERT_TRUE(registry.Add(Config(5, 0, 3)).ok());     // ranks 0 1 2
  auto changes = registry.ChangesOf(Config(5, 2, 2));  // ranks 2 3
  ASSERT_TRUE(changes.ok());
  EXPECT_EQ(changes->removed, (std::vector<WorkerKey>{{.worker_id = 5, .dp_rank = 0},
                                                      {.worker_id = 5, .dp_rank = 1}}));
  EXPECT_EQ(changes->added, (std::vector<WorkerKey>{{.worker_id = 5, .dp_rank = 3}}));
  EXPECT_EQ(registry.Find(5)->dp_start, 0u);  // nothing changed yet
  registry.Replace(Config(5, 2, 2));
  EXPECT_EQ(registry.Find(5)->dp_start, 2u);

  WorkerConfig bigger = Config(5, 2, 2);
  bigger.max_num_batched_tokens = 1 << 20;
  changes = registry.ChangesOf(bigger);
  ASSERT_TRUE(changes.ok());
  EXPECT_TRUE(changes->removed.empty() && changes->added.empty());
  registry.Replace(bigger);
  EXPECT_EQ(registry.Find(5)->max_num_batched_tokens, 1u << 20);
}

}  // namespace
}  // namespace kvrouter

#include "core/scheduler_queue.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvrouter {
namespace {

std::vector<std::string> DrainIds(PendingQueue<int>& queue) {
  std::vector<std::string> order;
  while (!queue.empty()) order.push_back(queue.PopFront().request_id);
  return order;
}

TEST(SchedulerQueueTest, FcfsAdmitsEarliestArrivalFirst) {
  PendingQueue<int> queue;
  for (int i : {0, 1, 2}) {
    queue.Push("r" + std::to_string(i),
               QueueKey(QueuePolicy::kFcfs, {.arrival_offset_seconds = double(i)}), 10, int{i});
  }
  EXPECT_EQ(DrainIds(queue), (std::vector<std::string>{"r0", "r1", "r2"}));
}

TEST(SchedulerQueueTest, LcfsAdmitsLatestArrivalFirst) {
  PendingQueue<int> queue;
  for (int i : {0, 1, 2}) {
    queue.Push("r" + std::to_string(i),
               QueueKey(QueuePolicy::kLcfs, {.arrival_offset_seconds = double(i)}), 10, int{i});
  }
  EXPECT_EQ(DrainIds(queue), (std::vector<std::string>{"r2", "r1", "r0"}));
}

TEST(SchedulerQueueTest, WsptAdmitsShortestUncachedWorkFirst) {
  PendingQueue<int> queue;
  // Uncached work: 1000, 100, 500 - 450 = 50 tokens.
  queue.Push("long", QueueKey(QueuePolicy::kWspt, {.prompt_tokens = 1000}), 1000, 0);
  queue.Push("short", QueueKey(QueuePolicy::kWspt, {.prompt_tokens = 100}), 100, 0);
  queue.Push("mostly-cached",
             QueueKey(QueuePolicy::kWspt, {.prompt_tokens = 500, .best_cached_tokens = 450}), 500,
             0);
  EXPECT_EQ(DrainIds(queue), (std::vector<std::string>{"mostly-cached", "short", "long"}));
}

TEST(SchedulerQueueTest, PriorityJumpMovesARequestAhead) {
  PendingQueue<int> queue;
  queue.Push("early", QueueKey(QueuePolicy::kFcfs, {.arrival_offset_seconds = 1}), 1, 0);
  queue.Push("late-urgent",
             QueueKey(QueuePolicy::kFcfs, {.priority_jump = 10, .arrival_offset_seconds = 5}), 1,
             0);
  queue.Push("negative-jump-ignored",
             QueueKey(QueuePolicy::kFcfs, {.priority_jump = -50, .arrival_offset_seconds = 2}), 1,
             0);
  EXPECT_EQ(DrainIds(queue),
            (std::vector<std::string>{"late-urgent", "early", "negative-jump-ignored"}));
  // WSPT weighs the jump: (1 + 3) / 400 = 0.01 beats 1 / 200 = 0.005.
  EXPECT_GT(QueueKey(QueuePolicy::kWspt, {.priority_jump = 3, .prompt_tokens = 400}),
            QueueKey(QueuePolicy::kWspt, {.prompt_tokens = 200}));
}

TEST(SchedulerQueueTest, EqualKeysKeepArrivalOrder) {
  PendingQueue<int> queue;
  for (const char* id : {"a", "b", "c", "d"}) queue.Push(id, 1.0, 1, 0);
  EXPECT_EQ(DrainIds(queue), (std::vector<std::string>{"a", "b", "c", "d"}));
}

TEST(SchedulerQueueTest, CountsPendingRequestsAndTokens) {
  PendingQueue<int> queue;
  EXPECT_TRUE(queue.Push("a", 3, 100, 1));
  EXPECT_TRUE(queue.Push("b", 2, 40, 2));
  EXPECT_FALSE(queue.Push("a", 9, 7, 3));  // duplicate id
  EXPECT_EQ(queue.size(), 2u);
  EXPECT_EQ(queue.pending_tokens(), 140u);
  ASSERT_NE(queue.Find("b"), nullptr);
  EXPECT_EQ(queue.Find("b")->item, 2);
  auto removed = queue.Remove("b");
  ASSERT_TRUE(removed.has_value());
  EXPECT_EQ(removed->item, 2);
  EXPECT_FALSE(queue.Remove("b").has_value());
  EXPECT_EQ(queue.pending_tokens(), 100u);
  EXPECT_EQ(queue.PopFront().item, 1);
  EXPECT_EQ(queue.pending_tokens(), 0u);
  EXPECT_TRUE(queue.empty());
}

TEST(SchedulerQueueTest, ThresholdIsAFractionOfMaxBatchedTokens) {
  EXPECT_FALSE(IsOverThreshold({.active_prefill_tokens = 200, .max_num_batched_tokens = 100}, 2));
  EXPECT_TRUE(IsOverThreshold({.active_prefill_tokens = 201, .max_num_batched_tokens = 100}, 2));
  // Not reported: Dynamo's default of 10,000,000.
  EXPECT_FALSE(IsOverThreshold({.active_prefill_tokens = 10'000'000}, 1));
  EXPECT_TRUE(IsOverThreshold({.active_prefill_tokens = 10'000'001}, 1));

  const std::vector<RankPressure> mixed = {
      {.active_prefill_tokens = 500, .max_num_batched_tokens = 100},
      {.active_prefill_tokens = 50, .max_num_batched_tokens = 100}};
  EXPECT_FALSE(AllOverThreshold(mixed, 1));
  EXPECT_TRUE(AllOverThreshold(mixed, 0.4));
  EXPECT_FALSE(AllOverThreshold({}, 0));  // no eligible rank is "not busy"
}

TEST(SchedulerQueueTest, ParsesPolicyNames) {
  EXPECT_EQ(*ParseQueuePolicy("FCFS"), QueuePolicy::kFcfs);
  EXPECT_EQ(*ParseQueuePolicy("lcfs"), QueuePolicy::kLcfs);
  EXPECT_EQ(*ParseQueuePolicy("Wspt"), QueuePolicy::kWspt);
  EXPECT_EQ(ParseQueuePolicy("sjf").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QueuePolicyName(QueuePolicy::kWspt), "wspt");
}

}  // namespace
}  // namespace kvrouter

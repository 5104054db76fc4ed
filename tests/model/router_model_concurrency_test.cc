// The calls of router_model_test.cc from several threads at once: gateway threads admit, plan,
// commit, abort, complete and free requests with ids of their own, while an operator thread
// adds, resizes and removes workers and an engine thread publishes events. A thread cannot
// predict answers that depend on the others, so during the run only what holds whatever the
// interleaving is checked (a decision names a worker that was registered at some point, and
// the statuses are among those the call may return); once every thread has stopped and every
// request is freed, the invariants of the model: no request active, no load on any rank,
// the workers the operator left, and a snapshot that restores to the same state. Run under
// ThreadSanitizer in CI (label `concurrency`).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "router_model.h"

namespace kvrouter::model {
namespace {

constexpr int kGatewayThreads = 3;
constexpr int kStepsPerThread = 1500;

bool OneOf(kvr_status status, std::initializer_list<kvr_status> allowed) {
  return std::find(allowed.begin(), allowed.end(), status) != allowed.end();
}

void Gateway(kvr_router* router, int thread, std::atomic<int>& unexpected,
             std::atomic<int>& booked) {
  std::mt19937_64 rng(100 + thread);
  const auto uniform = [&](size_t n) {
    return std::uniform_int_distribution<size_t>(0, n - 1)(rng);
  };
  const auto expect = [&](const Outcome& out, std::initializer_list<kvr_status> allowed) {
    if (!OneOf(out.status, allowed)) {
      ADD_FAILURE() << "thread " << thread << ": " << kvr_status_str(out.status) << ": "
                    << out.message;
      ++unexpected;
    }
  };
  for (int step = 0; step < kStepsPerThread; ++step) {
    const std::string id = "t" + std::to_string(thread) + "-" + std::to_string(uniform(20));
    const std::vector<uint32_t>& prompt = Prompts()[uniform(Prompts().size())];
    kvr_request_options options;
    kvr_request_options_init(&options, sizeof options);
    options.flags = KVR_REQUEST_ADMIT;
    options.request_id = id.c_str();
    switch (uniform(6)) {
      case 0: {
        kvr_route_result result;
        kvr_route_result_init(&result, sizeof result);
        const Outcome out = Try([&](kvr_error** err) {
          return kvr_find_best_match(router, prompt.data(), prompt.size(), &options, &result,
                                     nullptr, 0, nullptr, err);
        });
        expect(out, {KVR_OK, KVR_ALREADY_EXISTS, KVR_UNAVAILABLE});
        booked += out.ok();
        break;
      }
      case 1: {
        kvr_routing_hints hints;
        kvr_routing_hints_init(&hints, sizeof hints);
        const std::string session = "s" + std::to_string(uniform(3));
        hints.session_id = session.c_str();
        kvr_route_signals signals;
        kvr_route_signals_init(&signals, sizeof signals);
        expect(Try([&](kvr_error** err) {
                 return kvr_plan_route(router, prompt.data(), prompt.size(), &options, &hints,
                                       nullptr, &signals, err);
               }),
               {KVR_OK, KVR_ALREADY_EXISTS, KVR_UNAVAILABLE, KVR_NOT_FOUND});
        break;
      }
      case 2:
        expect(Try([&](kvr_error** err) { return kvr_commit_route(router, id.c_str(), err); }),
               {KVR_OK, KVR_NOT_FOUND, KVR_FAILED_PRECONDITION});
        break;
      case 3:
        expect(Try([&](kvr_error** err) {
                 return kvr_router_mark_prefill_completed(router, id.c_str(), err);
               }),
               {KVR_OK});
        break;
      case 4:
        expect(
            Try([&](kvr_error** err) { return kvr_abort_route(router, id.c_str(), nullptr, err); }),
            {KVR_OK});
        break;
      case 5:
        expect(
            Try([&](kvr_error** err) { return kvr_router_free_request(router, id.c_str(), err); }),
            {KVR_OK});
        break;
    }
  }
  // Every id this thread may have booked, freed.
  for (int n = 0; n < 20; ++n) {
    const std::string id = "t" + std::to_string(thread) + "-" + std::to_string(n);
    expect(Try([&](kvr_error** err) { return kvr_router_free_request(router, id.c_str(), err); }),
           {KVR_OK});
    expect(Try([&](kvr_error** err) { return kvr_abort_route(router, id.c_str(), nullptr, err); }),
           {KVR_OK});
  }
}

TEST(RouterModelConcurrencyTest, ThreadsLeaveTheStateTheModelExpects) {
  kvr_router* router = NewRouter();
  Model model;  // the workers, as the operator thread leaves them
  for (uint64_t id = 1; id <= 3; ++id) {
    ASSERT_TRUE(AddWorker(router, id, 2).ok());
    model.workers[id] = 2;
  }
  std::atomic<int> unexpected{0};
  std::atomic<int> booked{0};
  std::atomic<bool> stop{false};
  std::thread operator_thread([&] {
    std::mt19937_64 rng(7);
    while (!stop.load()) {
      const uint64_t id = 1 + rng() % kMaxWorkerId;
      const uint32_t dp_size = 1 + rng() % kMaxDpSize;
      const bool known = model.workers.count(id) > 0;
      Outcome out;
      switch (rng() % 3) {
        case 0:
          out = AddWorker(router, id, dp_size);
          if (out.ok()) model.workers[id] = dp_size;
          if (out.ok() == known) ++unexpected;
          break;
        case 1:
          out = UpdateWorker(router, id, dp_size);
          if (out.ok()) model.workers[id] = dp_size;
          if (out.ok() != known) ++unexpected;
          break;
        case 2:
          // Keep at least one worker most of the time, so requests get booked.
          if (model.workers.size() <= 1) break;
          out = Try([&](kvr_error** err) { return kvr_router_remove_worker(router, id, err); });
          if (out.ok()) model.workers.erase(id);
          if (out.ok() != known) ++unexpected;
          break;
      }
      std::this_thread::yield();
    }
  });
  std::thread engine_thread([&] {
    std::mt19937_64 rng(8);
    while (!stop.load()) {
      const std::vector<uint32_t>& prompt = Prompts()[rng() % Prompts().size()];
      const Rank rank{1 + rng() % kMaxWorkerId, static_cast<uint32_t>(rng() % kMaxDpSize)};
      const size_t blocks = prompt.size() / kBlockSize;
      const Outcome out = rng() % 4 == 0 ? RemoveBlocks(router, rank, prompt, 0, 1 + rng() % blocks)
                                         : StoreBlocks(router, rank, prompt, 0, 1 + rng() % blocks,
                                                       KVR_TIER_DEVICE);
      if (!OneOf(out.status, {KVR_OK, KVR_NOT_FOUND})) ++unexpected;
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> gateways;
  for (int t = 0; t < kGatewayThreads; ++t) {
    gateways.emplace_back(Gateway, router, t, std::ref(unexpected), std::ref(booked));
  }
  for (std::thread& t : gateways) t.join();
  stop = true;
  operator_thread.join();
  engine_thread.join();
  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_GT(booked.load(), kGatewayThreads * kStepsPerThread / 20);

  const kvr_metrics metrics = Metrics(router);
  EXPECT_EQ(metrics.requests_active, 0u);
  EXPECT_EQ(metrics.workers, model.workers.size());
  size_t ranks = 0;
  for (const auto& [id, dp_size] : model.workers) ranks += dp_size;
  const std::map<Rank, kvr_potential_load> loads = Loads(router);
  EXPECT_EQ(loads.size(), ranks);
  for (const auto& [rank, load] : loads) {
    EXPECT_TRUE(model.Registered(rank));
    EXPECT_EQ(load.active_requests, 0u);
    EXPECT_EQ(load.active_prefill_tokens, 0u);
    EXPECT_EQ(load.active_blocks, 0u);
  }
  kvr_router* copy = RestoredCopy(router, model.workers);
  EXPECT_EQ(IndexView(copy), IndexView(router));
  kvr_router_free(copy);
  kvr_router_free(router);
}

}  // namespace
}  // namespace kvrouter::model

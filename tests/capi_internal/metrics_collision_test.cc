// kvr_metrics.decisions_priced_again through the C ABI. A decision is priced outside the
// router's lock; here, while the first of two calls is priced, a second books a request on the
// worker the first chose (the one that caches the prompt), so the first must decide again: it
// would otherwise book on load it no longer sees. The pause that lets the test act mid-decision is
// the core's (Router::SetPricingPauseForTesting), reached behind the kvr_router handle; everything
// else is what a C caller does.
#include <gtest/gtest.h>

#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "capi/capi_internal.h"
#include "kvrouter.h"

namespace {

constexpr uint32_t kBlockSize = 16;

// Two idle workers; worker 0 caches `prompt`.
kvr_router* TwoWorkersOneCaching(const std::vector<uint32_t>& prompt) {
  kvr_router_options options;
  kvr_router_options_init(&options, sizeof options);
  options.block_size = kBlockSize;
  kvr_router* router = nullptr;
  EXPECT_EQ(kvr_router_new(&options, &router, nullptr), KVR_OK);
  for (uint64_t id : {0, 1}) {
    kvr_worker_config worker;
    kvr_worker_config_init(&worker, sizeof worker);
    worker.worker_id = id;
    EXPECT_EQ(kvr_router_add_worker(router, &worker, nullptr), KVR_OK);
  }
  std::vector<uint64_t> engine_hashes(prompt.size() / kBlockSize);
  for (size_t i = 0; i < engine_hashes.size(); ++i) engine_hashes[i] = 1000 + i;
  kvr_stored_event stored;
  kvr_stored_event_init(&stored, sizeof stored);
  stored.worker_id = 0;
  stored.block_hashes = engine_hashes.data();
  stored.num_blocks = engine_hashes.size();
  stored.token_ids = prompt.data();
  stored.num_tokens = prompt.size();
  EXPECT_EQ(kvr_router_apply_stored(router, &stored, nullptr), KVR_OK);
  return router;
}

// Books request `id`; returns the worker it went to, or -1 if the call failed.
int64_t Admit(kvr_router* router, const std::vector<uint32_t>& prompt, const char* id) {
  kvr_request_options options;
  kvr_request_options_init(&options, sizeof options);
  options.flags |= KVR_REQUEST_ADMIT;
  options.request_id = id;
  kvr_route_result result;
  kvr_route_result_init(&result, sizeof result);
  if (kvr_find_best_match(router, prompt.data(), prompt.size(), &options, &result, nullptr, 0,
                          nullptr, nullptr) != KVR_OK) {
    return -1;
  }
  return static_cast<int64_t>(result.worker_id);
}

kvr_metrics Metrics(kvr_router* router) {
  kvr_metrics metrics;
  kvr_metrics_init(&metrics, sizeof metrics);
  EXPECT_EQ(kvr_router_get_metrics(router, &metrics, nullptr), KVR_OK);
  return metrics;
}

std::string Prometheus(kvr_router* router) {
  size_t len = 0;
  kvr_router_metrics_prometheus(router, nullptr, 0, &len, nullptr);
  std::string text(len, '\0');
  EXPECT_EQ(kvr_router_metrics_prometheus(router, text.data(), len, &len, nullptr), KVR_OK);
  return text;
}

TEST(MetricsCollisionTest, ADecisionPricedAgainIsCounted) {
  std::vector<uint32_t> prompt(4 * kBlockSize);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<uint32_t>(i);
  kvr_router* router = TwoWorkersOneCaching(prompt);
  ASSERT_EQ(Admit(router, prompt, "alone"), 0) << "the worker that caches the prompt";
  ASSERT_EQ(kvr_router_free_request(router, "alone", nullptr), KVR_OK);
  EXPECT_EQ(Metrics(router).decisions_priced_again, 0u) << "one caller never collides";

  // "b" is booked while "a" is priced: a long-lived thread and latches, not a thread started
  // inside the pause (ThreadSanitizer's runtime has crashed on that form).
  std::latch priced(1), booked(1);
  int64_t other = -1;
  std::thread other_caller([&] {
    priced.wait();
    other = Admit(router, prompt, "b");
    booked.count_down();
  });
  bool paused = false;
  router->router->SetPricingPauseForTesting([&] {
    if (std::exchange(paused, true)) return;  // the first decision only
    priced.count_down();
    booked.wait();
  });
  EXPECT_GE(Admit(router, prompt, "a"), 0);
  other_caller.join();
  router->router->SetPricingPauseForTesting(nullptr);
  // "b" took the worker "a" had priced as its winner: what makes "a" decide again.
  EXPECT_EQ(other, 0);

  const kvr_metrics metrics = Metrics(router);
  EXPECT_EQ(metrics.decisions, 3u);
  EXPECT_EQ(metrics.decisions_priced_again, 1u);
  const std::string text = Prometheus(router);
  EXPECT_NE(text.find("# TYPE kvrouter_decisions_priced_again_total counter\n"), std::string::npos);
  EXPECT_NE(text.find("\nkvrouter_decisions_priced_again_total 1\n"), std::string::npos) << text;
  kvr_router_free(router);
}

}  // namespace

// The Router under concurrent callers (run under ThreadSanitizer in CI): selection and booking
// share one gate, so concurrent requests see each other's bookings; the queue admits waiting
// callers from whichever thread frees capacity.
#include <gtest/gtest.h>

#include <atomic>
#include <deque>
#include <latch>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/hashing.h"
#include "core/router.h"

namespace kvrouter {
namespace {

constexpr uint32_t kBlockSize = 16;

std::vector<uint32_t> Prompt(size_t tokens, uint32_t first = 0) {
  std::vector<uint32_t> out(tokens);
  for (size_t i = 0; i < tokens; ++i) out[i] = first + static_cast<uint32_t>(i);
  return out;
}

std::unique_ptr<Router> MakeRouter(int workers, std::optional<double> threshold = std::nullopt,
                                   uint64_t max_batched = 0) {
  RouterOptions options;
  options.block_size = kBlockSize;
  options.queue_threshold = threshold;
  options.random_seed = 1;
  auto router = Router::Create(options);
  EXPECT_TRUE(router.ok()) << router.status();
  for (int i = 0; i < workers; ++i) {
    EXPECT_TRUE((*router)
                    ->AddWorker(WorkerConfig{.worker_id = static_cast<uint64_t>(i),
                                             .max_num_batched_tokens = max_batched,
                                             .block_size = kBlockSize})
                    .ok());
  }
  return std::move(*router);
}

// 1,000 identical requests arrive at once at 8 idle workers. Had selection not seen the
// bookings made just before it, they would all pick the same (cheapest-looking) worker; with one
// gate each booking raises that worker's cost and the next request goes elsewhere.
TEST(RouterConcurrencyTest, ThousandConcurrentIdenticalRequestsSpread) {
  constexpr int kWorkers = 8;
  constexpr int kRequests = 1000;
  auto router = MakeRouter(kWorkers);
  const auto prompt = Prompt(512);
  std::vector<std::atomic<int>> per_worker(kWorkers);
  std::atomic<int> failures{0};
  std::latch start(kRequests);
  std::vector<std::thread> threads;
  threads.reserve(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      const std::string id = "req-" + std::to_string(i);
      RouteOptions options{.with_admission = true, .request_id = id};
      start.arrive_and_wait();
      auto decision = router->FindBestMatch(prompt, options);
      if (!decision.ok()) {
        ++failures;
        return;
      }
      ++per_worker[decision->worker.worker_id];
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(router->active_requests(), static_cast<size_t>(kRequests));
  const int fair_share = kRequests / kWorkers;
  int total = 0;
  for (int w = 0; w < kWorkers; ++w) {
    total += per_worker[w].load();
    EXPECT_LE(per_worker[w].load(), 2 * fair_share) << "worker " << w;
    EXPECT_GT(per_worker[w].load(), 0) << "worker " << w;
  }
  EXPECT_EQ(total, kRequests);
}

// Workers 0 and 1, idle, on a router drawing from `seed`.
std::unique_ptr<Router> TwoIdleWorkers(uint64_t seed) {
  std::unique_ptr<Router> router =
      Router::Create(RouterOptions{.block_size = kBlockSize, .random_seed = seed}).value();
  for (uint64_t id : {0, 1}) EXPECT_TRUE(router->AddWorker({.worker_id = id}).ok());
  return router;
}

// Decides `first` on `router`, and, while it is priced outside the gate, `meanwhile` on
// another thread (booked before `first` picks): the two decisions, in that order.
std::pair<absl::StatusOr<RouteDecision>, absl::StatusOr<RouteDecision>> DecideWhileAnotherBooks(
    Router& router, std::span<const uint32_t> prompt, const RouteOptions& first,
    const RouteOptions& meanwhile) {
  absl::StatusOr<RouteDecision> other = absl::UnknownError("not run");
  std::latch priced(1), booked(1);
  std::thread other_caller([&] {
    priced.wait();
    other = router.FindBestMatch(prompt, meanwhile);
    booked.count_down();
  });
  bool paused = false;
  router.SetPricingPauseForTesting([&] {
    if (std::exchange(paused, true)) return;  // the first decision only
    priced.count_down();
    booked.wait();
  });
  absl::StatusOr<RouteDecision> decided = router.FindBestMatch(prompt, first);
  other_caller.join();
  router.SetPricingPauseForTesting(nullptr);
  return {std::move(decided), std::move(other)};
}

// A decision is priced outside the gate, then picked and booked under it. Here a second
// request is booked while the first is being priced: both prompts are the same and both
// workers idle, so the first's pick is a coin toss, and had it booked what it priced it would
// join the second on its worker about half the time. The winner's load changed, so it
// decides again under the gate and goes to the other worker.
TEST(RouterConcurrencyTest, ARequestBookedWhileAnotherIsPricedIsSeenByIt) {
  const auto prompt = Prompt(64);
  for (uint64_t seed = 1; seed <= 16; ++seed) {
    const std::unique_ptr<Router> router = TwoIdleWorkers(seed);
    const auto [first, second] =
        DecideWhileAnotherBooks(*router, prompt, {.with_admission = true, .request_id = "a"},
                                {.with_admission = true, .request_id = "b"});
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_NE(first->worker, second->worker) << "seed " << seed;
    EXPECT_EQ(router->active_requests(), 2u);
  }
}

// A plan retried while the first call is being priced (a gateway's retry racing it): the retry
// books first, and the first call answers with that plan, as a retry after it would; it answered
// ALREADY_EXISTS for an id with a live plan.
TEST(RouterConcurrencyTest, APlanRetriedWhileTheFirstIsPricedAnswersBothWithThePlan) {
  const auto prompt = Prompt(64);
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    const std::unique_ptr<Router> router = TwoIdleWorkers(seed);
    const RouteOptions plan{.with_admission = true, .request_id = "r"};
    absl::StatusOr<RouteDecision> retried = absl::UnknownError("not run");
    bool paused = false;
    router->SetPricingPauseForTesting([&] {
      if (std::exchange(paused, true)) return;  // the first call only
      std::thread([&] { retried = router->Plan(prompt, plan); }).join();
    });
    const absl::StatusOr<RouteDecision> first = router->Plan(prompt, plan);
    router->SetPricingPauseForTesting(nullptr);
    ASSERT_TRUE(retried.ok()) << retried.status();
    ASSERT_TRUE(first.ok()) << "seed " << seed << ": " << first.status();
    EXPECT_EQ(first->worker, retried->worker);
    EXPECT_EQ(router->active_requests(), 1u);
    EXPECT_TRUE(router->Commit("r").ok());
  }
}

// A worker removed while a request is priced is never booked: the request goes to a worker
// still there (had it booked what it priced, it would have failed half the time).
TEST(RouterConcurrencyTest, AWorkerRemovedWhileARequestIsPricedIsNotChosen) {
  const auto prompt = Prompt(64);
  for (uint64_t seed = 1; seed <= 16; ++seed) {
    const std::unique_ptr<Router> router = TwoIdleWorkers(seed);
    router->SetPricingPauseForTesting(
        [&] { std::thread([&] { EXPECT_TRUE(router->RemoveWorker(0).ok()); }).join(); });
    auto decision = router->FindBestMatch(prompt, {.with_admission = true, .request_id = "a"});
    ASSERT_TRUE(decision.ok()) << decision.status();
    EXPECT_EQ(decision->worker.worker_id, 1u) << "seed " << seed;
    EXPECT_EQ(router->active_requests(), 1u);
  }
}

// A hard session's request whose bound worker leaves while it is priced goes where it would
// had the worker left before it came: the binding is dropped, the request routed to the other
// worker, and the session bound there (it failed with "pinned worker is not registered" when
// the steering priced first was kept).
TEST(RouterConcurrencyTest, ASessionsWorkerRemovedWhileItsRequestIsPricedIsSteeredAround) {
  const auto prompt = Prompt(64);
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    const std::unique_ptr<Router> router = TwoIdleWorkers(seed);
    const RouteOptions first{.with_admission = true, .request_id = "a", .session_id = "s"};
    auto bound = router->FindBestMatch(prompt, first);
    ASSERT_TRUE(bound.ok()) << bound.status();
    router->SetPricingPauseForTesting([&] {
      std::thread([&] { EXPECT_TRUE(router->RemoveWorker(bound->worker.worker_id).ok()); }).join();
    });
    const RouteOptions next{.with_admission = true, .request_id = "b", .session_id = "s"};
    auto decision = router->FindBestMatch(prompt, next);
    ASSERT_TRUE(decision.ok()) << decision.status() << " (seed " << seed << ")";
    EXPECT_NE(decision->worker, bound->worker);
    EXPECT_EQ(router->SessionBinding("s"), decision->worker);
  }
}

// Two requests of one session at once: the one that books second follows the binding the
// first made while it was priced, as it would had it come after (agents' parallel calls).
TEST(RouterConcurrencyTest, ASessionBoundWhileItsNextRequestIsPricedSteersIt) {
  const auto prompt = Prompt(64);
  for (uint64_t seed = 1; seed <= 16; ++seed) {
    const std::unique_ptr<Router> router = TwoIdleWorkers(seed);
    const auto [decision, other] = DecideWhileAnotherBooks(
        *router, prompt, {.with_admission = true, .request_id = "a", .session_id = "s"},
        {.with_admission = true, .request_id = "b", .session_id = "s"});
    ASSERT_TRUE(decision.ok()) << decision.status();
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_EQ(decision->worker, other->worker) << "seed " << seed;
    EXPECT_EQ(router->SessionBinding("s"), other->worker);
  }
}

// Many callers block in the queue while others finish their requests: everyone is admitted
// exactly once, nothing is left booked or waiting, and nobody deadlocks.
TEST(RouterConcurrencyTest, QueuedCallersAreAllAdmittedAsLoadDrains) {
  constexpr int kWorkers = 3;
  constexpr int kCallers = 64;
  // Busy above 1.0 × 100 tokens; each prompt is 160 tokens, so one request fills a worker.
  auto router = MakeRouter(kWorkers, 1.0, 100);
  // One blocker per worker makes every worker busy, so every caller has to queue.
  for (int w = 0; w < kWorkers; ++w) {
    const std::string id = "blocker-" + std::to_string(w);
    ASSERT_TRUE(router
                    ->FindBestMatch(Prompt(160, 999'000u + w),
                                    RouteOptions{.with_admission = true, .request_id = id})
                    .ok());
  }
  std::atomic<int> admitted{0}, queued{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kCallers; ++i) {
    threads.emplace_back([&, i] {
      const std::string id = "c" + std::to_string(i);
      auto decision = router->FindBestMatch(Prompt(160, 1000u * i),
                                            RouteOptions{.with_admission = true, .request_id = id});
      ASSERT_TRUE(decision.ok()) << decision.status();
      ++admitted;
      if (decision->queued) ++queued;
      std::this_thread::yield();
      router->MarkPrefillCompleted(id);
      router->Free(id);
      router->Free(id);  // idempotent, even racing with other threads
    });
  }
  while (router->pending_count() < static_cast<size_t>(kCallers)) std::this_thread::yield();
  EXPECT_EQ(router->pending_tokens(), 160u * kCallers);
  for (int w = 0; w < kWorkers; ++w) router->Free("blocker-" + std::to_string(w));
  for (auto& t : threads) t.join();
  EXPECT_EQ(admitted.load(), kCallers);
  EXPECT_EQ(queued.load(), kCallers);
  EXPECT_EQ(router->pending_count(), 0u);
  EXPECT_EQ(router->active_requests(), 0u);
  for (const auto& load : router->Loads()) {
    EXPECT_EQ(load.active_blocks, 0u);
    EXPECT_EQ(load.active_prefill_tokens, 0u);
  }
}

// Timeouts and cancellations racing with admissions: every caller gets exactly one answer, and
// the router ends with exactly the requests that were admitted and not yet freed.
TEST(RouterConcurrencyTest, TimeoutsRaceWithAdmissions) {
  auto router = MakeRouter(2, 1.0, 100);
  constexpr int kCallers = 40;
  std::atomic<int> ok{0}, gave_up{0};
  std::atomic<bool> done{false};
  std::thread freer([&] {
    int round = 0;
    while (!done.load()) {
      for (int i = 0; i < kCallers; ++i) router->Free("t" + std::to_string(i));
      if (++round % 8 == 0) router->RecheckQueue();
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int i = 0; i < kCallers; ++i) {
    threads.emplace_back([&, i] {
      const std::string id = "t" + std::to_string(i);
      RouteOptions options{.with_admission = true, .request_id = id};
      options.queue_timeout = std::chrono::microseconds(50 + 37 * i);
      auto decision = router->FindBestMatch(Prompt(160, 7u * i), options);
      if (decision.ok()) {
        ++ok;
      } else {
        // Timed out, or cancelled by the freer's Free of a request still waiting.
        EXPECT_TRUE(decision.status().code() == absl::StatusCode::kDeadlineExceeded ||
                    decision.status().code() == absl::StatusCode::kCancelled)
            << decision.status();
        ++gave_up;
      }
    });
  }
  for (auto& t : threads) t.join();
  done = true;
  freer.join();
  EXPECT_EQ(ok.load() + gave_up.load(), kCallers);
  EXPECT_EQ(router->pending_count(), 0u);
  for (int i = 0; i < kCallers; ++i) router->Free("t" + std::to_string(i));
  EXPECT_EQ(router->active_requests(), 0u);
}

// KV events applied while requests are routed and booked (index writer vs router readers).
TEST(RouterConcurrencyTest, EventsAndRoutingRunTogether) {
  auto router = MakeRouter(4);
  std::atomic<bool> done{false};
  std::thread writer([&] {
    uint64_t n = 0;
    while (!done.load()) {
      const auto tokens = Prompt(64, static_cast<uint32_t>(n % 16) * 64);
      StoredEvent stored;
      stored.token_ids = tokens;
      stored.block_hashes = ComputeSequenceHashes(ComputeLocalBlockHashes(tokens, kBlockSize));
      KvEvent event{.worker = {.worker_id = n % 4}, .event_id = n, .data = stored};
      ASSERT_TRUE(router->ApplyEvent(event).ok());
      if (n % 7 == 0) {
        KvEvent removed{.worker = {.worker_id = n % 4},
                        .event_id = n,
                        .data = RemovedEvent{.block_hashes = stored.block_hashes}};
        ASSERT_TRUE(router->ApplyEvent(removed).ok());
      }
      ++n;
    }
  });
  std::vector<std::thread> routers;
  for (int t = 0; t < 4; ++t) {
    routers.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        const std::string id = std::to_string(t) + "-" + std::to_string(i);
        auto d = router->FindBestMatch(Prompt(64, static_cast<uint32_t>(i % 16) * 64),
                                       RouteOptions{.with_admission = true, .request_id = id});
        ASSERT_TRUE(d.ok()) << d.status();
        if (i % 3 == 0) {
          ASSERT_TRUE(router->PotentialLoads(Prompt(32)).ok());
        }
        router->Free(id);
      }
    });
  }
  for (auto& t : routers) t.join();
  done = true;
  writer.join();
  EXPECT_EQ(router->active_requests(), 0u);
}

// Router replica sync under concurrency: threads book and free on replica `a`, whose observer
// queues the changes; a carrier thread applies them to `b` while other threads route on `b`,
// and the observer is swapped mid-run. Once the queue drains, `b` holds exactly a's bookings.
TEST(RouterConcurrencyTest, ReplicaChangesApplyWhileBothReplicasRoute) {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 200;
  auto a = MakeRouter(4);
  auto b = MakeRouter(4);
  struct Copied {
    SequenceChange::Kind kind;
    std::string id;
    WorkerKey worker;
    std::vector<uint64_t> ids;
    uint64_t prefill;
  };
  std::mutex mu;
  std::deque<Copied> queue;
  auto observer = [&](const SequenceChange& c) {
    std::lock_guard lock(mu);
    queue.push_back({c.kind, std::string(c.request_id), c.worker,
                     std::vector<uint64_t>(c.block_ids.begin(), c.block_ids.end()),
                     c.prefill_tokens});
  };
  a->SetSequenceObserver("a", observer);
  std::atomic<bool> producing{true};
  std::atomic<int> apply_errors{0};
  auto drain = [&] {
    std::deque<Copied> batch;
    {
      std::lock_guard lock(mu);
      batch.swap(queue);
    }
    for (const Copied& c : batch) {
      const SequenceChange change{.kind = c.kind,
                                  .request_id = c.id,
                                  .worker = c.worker,
                                  .block_ids = c.ids,
                                  .prefill_tokens = c.prefill};
      if (!b->ApplyReplicaChange("a", change).ok()) apply_errors.fetch_add(1);
    }
  };
  std::thread carrier([&] {
    while (producing.load()) drain();
  });
  std::thread b_router([&] {
    for (int i = 0; producing.load(); ++i) {
      (void)b->FindBestMatch(Prompt(64, static_cast<uint32_t>(i)), {});
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::string id = std::to_string(t) + "-" + std::to_string(i);
        auto d = a->FindBestMatch(Prompt(64, static_cast<uint32_t>(i)),
                                  {.with_admission = true, .request_id = id});
        ASSERT_TRUE(d.ok());
        if (i % 2 == 0) a->Free(id);  // half stay booked
        if (t == 0 && i == kPerThread / 2) a->SetSequenceObserver("a", observer);  // a swap
      }
    });
  }
  for (auto& t : threads) t.join();
  producing = false;
  carrier.join();
  b_router.join();
  drain();
  EXPECT_EQ(apply_errors.load(), 0);
  EXPECT_EQ(a->active_requests(), static_cast<size_t>(kThreads * kPerThread / 2));
  EXPECT_EQ(b->replica_stats().active_requests, a->active_requests());
  EXPECT_EQ(b->active_requests(), a->active_requests());
}

}  // namespace
}  // namespace kvrouter

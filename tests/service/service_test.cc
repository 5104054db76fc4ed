// kvrouterd's Service in process, without the HTTP server: what needs a hook between two
// library calls (a worker removed between a route's plan and its commit).
#include "kvrouterd/service.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

namespace kvrouterd {
namespace {

using nlohmann::json;

std::unique_ptr<Service> MakeService(const std::vector<uint64_t>& worker_ids, Config config = {}) {
  for (const uint64_t id : worker_ids) {
    WorkerSpec worker;
    worker.worker_id = id;
    config.workers.push_back(worker);
  }
  std::string error;
  std::unique_ptr<Service> service = Service::Create(config, &error);
  EXPECT_NE(service, nullptr) << error;
  return service;
}

// As the daemon routes: the call arrives (numbered: a later free or abort of its id cancels it),
// runs, and departs.
HttpResponse Route(Service& service, const std::string& id) {
  HttpRequest request;
  request.method = "POST";
  request.path = "/v1/route";
  request.body = json{{"request_id", id}, {"token_ids", {1, 2, 3}}}.dump();
  const RouteMatch match = MatchRoute(request.method, request.path);
  RoutingCall call = service.ArriveRouting(nullptr);
  HttpResponse answer = service.Handle(*match.route, request, "", &call);
  service.DepartRouting(call);
  return answer;
}

HttpResponse Free(Service& service, const std::string& id) {
  HttpRequest request;
  request.method = "DELETE";
  request.path = "/v1/requests/" + id;
  const RouteMatch match = MatchRoute(request.method, request.path);
  return service.Handle(*match.route, request, match.param);
}

// POST /v1/route plans and commits in one: a worker removed between the two leaves the plan
// nothing to commit to (FAILED_PRECONDITION), and the route is planned again rather than
// answered 409 "plan again" to a caller that never planned.
TEST(ServiceTest, ARouteWhoseWorkerGoesBeforeItsCommitIsPlannedAgain) {
  std::unique_ptr<Service> service = MakeService({1, 2});
  ASSERT_NE(service, nullptr);
  int calls = 0;
  uint64_t removed = 0;
  service->SetBetweenPlanAndCommitForTest([&](uint64_t worker_id) {
    if (calls++ == 0) {
      removed = worker_id;
      service->RemoveWorker(worker_id);
    }
  });
  const HttpResponse routed = Route(*service, "r1");
  ASSERT_EQ(routed.status, 200) << routed.body;
  EXPECT_EQ(calls, 2);
  const json decision = json::parse(routed.body);
  EXPECT_NE(decision["worker_id"], removed);
  EXPECT_EQ(decision["booked"], true);
}

HttpResponse Get(Service& service, const std::string& path) {
  HttpRequest request;
  request.method = "GET";
  request.path = path;
  const RouteMatch match = MatchRoute(request.method, request.path);
  return service.Handle(*match.route, request, match.param);
}

// A route that waited in the admission queue says so ("queued"), though the plan it is answered
// with, made again after its first plan's worker went, was admitted at once (before, only the
// last plan's signals were reported: "queued": false after a wait).
TEST(ServiceTest, ARoutePlannedAgainAfterWaitingInTheQueueSaysItWaited) {
  Config config;
  config.router.queue_threshold = 0;  // queue while every rank has a request
  for (const uint64_t id : {1, 2}) {
    WorkerSpec worker;
    worker.worker_id = id;
    worker.max_num_batched_tokens = 1;
    config.workers.push_back(worker);
  }
  std::unique_ptr<Service> service = MakeService({}, config);
  ASSERT_NE(service, nullptr);
  std::map<std::string, uint64_t> worker_of;
  for (const std::string id : {"a1", "a2"}) {
    const HttpResponse routed = Route(*service, id);
    ASSERT_EQ(routed.status, 200) << routed.body;
    worker_of[id] = json::parse(routed.body)["worker_id"];
  }
  ASSERT_NE(worker_of["a1"], worker_of["a2"]);
  int calls = 0;
  service->SetBetweenPlanAndCommitForTest([&](uint64_t worker_id) {
    if (calls++ > 0) return;
    // Admitted onto a1's worker once a1 was freed: that worker goes, and a2's is freed, so
    // the plan made again is admitted at once.
    EXPECT_EQ(worker_id, worker_of["a1"]);
    service->RemoveWorker(worker_id);
    EXPECT_EQ(Free(*service, "a2").status, 200);
  });
  HttpResponse routed;
  std::thread waiter([&] { routed = Route(*service, "b"); });
  bool waiting = false;
  for (int i = 0; i < 2000 && !waiting; ++i) {
    waiting = Get(*service, "/metrics").body.find("kvrouter_queue_pending_requests 1\n") !=
              std::string::npos;
    if (!waiting) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(waiting) << "b never waited in the queue";
  EXPECT_EQ(Free(*service, "a1").status, 200);
  waiter.join();
  ASSERT_EQ(routed.status, 200) << routed.body;
  EXPECT_EQ(calls, 2);
  const json decision = json::parse(routed.body);
  EXPECT_EQ(decision["worker_id"], worker_of["a2"]);
  EXPECT_EQ(decision["queued"], true);
  EXPECT_EQ(decision["booked"], true);
}

// Planned again at most Service::kMaxReplans times: a worker that goes every time still ends in
// 409 FAILED_PRECONDITION, and the id is free again.
TEST(ServiceTest, ARouteIsPlannedAgainOnlySoOften) {
  std::unique_ptr<Service> service = MakeService({1});
  ASSERT_NE(service, nullptr);
  int calls = 0;
  service->SetBetweenPlanAndCommitForTest([&](uint64_t worker_id) {
    ++calls;
    service->RemoveWorker(worker_id);
    WorkerSpec back;
    back.worker_id = worker_id;
    service->AddWorker(back);
  });
  const HttpResponse refused = Route(*service, "r1");
  EXPECT_EQ(refused.status, 409) << refused.body;
  EXPECT_EQ(json::parse(refused.body)["error"]["status"], "FAILED_PRECONDITION");
  EXPECT_EQ(calls, Service::kMaxReplans + 1);
  service->SetBetweenPlanAndCommitForTest(nullptr);
  EXPECT_EQ(Route(*service, "r1").status, 200);
}

// A DELETE of the id between a route's plan and its commit wins, as documented: the route books
// nothing and is answered 409 CANCELLED (it was 404 NOT_FOUND: the freed plan was not there to
// commit), and the id is free again.
TEST(ServiceTest, ARouteFreedBetweenItsPlanAndItsCommitIsCancelled) {
  std::unique_ptr<Service> service = MakeService({1});
  ASSERT_NE(service, nullptr);
  HttpResponse freed;
  service->SetBetweenPlanAndCommitForTest([&](uint64_t) { freed = Free(*service, "r1"); });
  const HttpResponse cancelled = Route(*service, "r1");
  EXPECT_EQ(freed.status, 200) << freed.body;
  EXPECT_EQ(json::parse(freed.body)["request_id"], "r1");
  EXPECT_EQ(cancelled.status, 409) << cancelled.body;
  EXPECT_EQ(json::parse(cancelled.body)["error"]["status"], "CANCELLED");
  service->SetBetweenPlanAndCommitForTest(nullptr);
  const HttpResponse again = Route(*service, "r1");
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(json::parse(again.body)["replayed"], false);
}

// A plan that outlived its deadline before its commit (a stalled routing thread) was not
// freed by anyone: the route is planned again, not answered CANCELLED.
TEST(ServiceTest, ARoutePlanPastItsDeadlineBeforeItsCommitIsPlannedAgain) {
  Config config;
  config.plan_deadline_seconds = 0.2;
  std::unique_ptr<Service> service = MakeService({1}, config);
  ASSERT_NE(service, nullptr);
  int calls = 0;
  service->SetBetweenPlanAndCommitForTest([&](uint64_t) {
    if (calls++ == 0) std::this_thread::sleep_for(std::chrono::milliseconds(400));
  });
  const HttpResponse routed = Route(*service, "r1");
  EXPECT_EQ(routed.status, 200) << routed.body;
  EXPECT_GE(calls, 2);
}

// Every plan outlives its deadline before its commit: after Service::kMaxReplans more, 503
// UNAVAILABLE (the routing threads are stalled), not a 404 for a request nobody freed.
TEST(ServiceTest, ARouteWhosePlansAllOutliveTheirDeadlineIsUnavailable) {
  Config config;
  config.plan_deadline_seconds = 0.05;
  std::unique_ptr<Service> service = MakeService({1}, config);
  ASSERT_NE(service, nullptr);
  int calls = 0;
  service->SetBetweenPlanAndCommitForTest([&](uint64_t) {
    ++calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });
  const HttpResponse refused = Route(*service, "r1");
  EXPECT_EQ(refused.status, 503) << refused.body;
  EXPECT_EQ(calls, Service::kMaxReplans + 1);
  service->SetBetweenPlanAndCommitForTest(nullptr);
  EXPECT_EQ(Route(*service, "r1").status, 200);  // nothing was left booked under the id
}

// While it lives, the process can open no file descriptor: the soft limit is lowered to the
// lowest number free (every one below it is open).
class NoDescriptorLeft {
 public:
  NoDescriptorLeft() {
    if (getrlimit(RLIMIT_NOFILE, &saved_) != 0) return;
    const int lowest_free = dup(STDERR_FILENO);
    if (lowest_free < 0) return;
    close(lowest_free);
    rlimit limited = saved_;
    limited.rlim_cur = static_cast<rlim_t>(lowest_free);
    limited_ = setrlimit(RLIMIT_NOFILE, &limited) == 0;
  }
  ~NoDescriptorLeft() {
    if (limited_) setrlimit(RLIMIT_NOFILE, &saved_);
  }
  bool limited() const { return limited_; }
  NoDescriptorLeft(const NoDescriptorLeft&) = delete;
  NoDescriptorLeft& operator=(const NoDescriptorLeft&) = delete;

 private:
  rlimit saved_{};
  bool limited_ = false;
};

// A change is checked on a throwaway router first; its ingest object (an epoll and an eventfd)
// is made only for a worker with events: a daemon out of descriptors refused to change a
// worker's ranks alone ("uv_loop_init: too many open files").
TEST(ServiceTest, AWorkersRanksChangeWithNoDescriptorLeft) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // UndefinedBehaviorSanitizer's vptr check probes memory through a pipe: with no descriptor
  // left it reports every virtual call as invalid. The plain build runs this test.
  GTEST_SKIP() << "the sanitizers need descriptors of their own";
#endif
  std::unique_ptr<Service> service = MakeService({1});
  ASSERT_NE(service, nullptr);
  WorkerSpec wider;
  wider.worker_id = 1;
  wider.dp_size = 2;
  WorkerSpec subscribed = wider;
  subscribed.events.emplace().endpoint = "tcp://127.0.0.1:5557";
  std::string ranks_refused, events_refused;
  json updated;
  {
    const NoDescriptorLeft limit;
    ASSERT_TRUE(limit.limited());
    try {
      updated = service->UpdateWorker(wider);
    } catch (const std::exception& e) {
      ranks_refused = e.what();
    }
    try {
      service->UpdateWorker(subscribed);
    } catch (const std::exception& e) {
      events_refused = e.what();
    }
  }
  EXPECT_EQ(ranks_refused, "");
  EXPECT_EQ(updated["dp_size"], 2);
  // Events need descriptors: refused with the reason, the worker left as it was.
  EXPECT_EQ(events_refused.rfind("worker 1: ", 0), 0u) << events_refused;
  EXPECT_NE(events_refused.find("too many open files"), std::string::npos) << events_refused;
  EXPECT_EQ(service->UpdateWorker(wider)["events"], nullptr);
}

}  // namespace
}  // namespace kvrouterd

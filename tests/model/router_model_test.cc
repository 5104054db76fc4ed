// The router against the model of router_model.h, one call at a time: every status the model
// can predict is checked, and after every call the invariants:
//   - the router's workers and active requests are the model's (kvr_router_get_metrics);
//   - every registered rank, and only those, has a load, and its active request count is the
//     model's; a rank with no request has no prefill tokens and no blocks booked, so loads
//     return to zero when every request is freed and nothing stays booked on a removed worker;
//   - calls that only look (preview, routing without admission, overlap scores, loads,
//     metrics, snapshot) change nothing (the state digest);
// and at intervals, that a snapshot restored into a new router gives the same index, and once
// nothing is booked, the same digest.
#include "router_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>

namespace kvrouter::model {
namespace {

class ModelRun {
 public:
  explicit ModelRun(uint64_t seed) : rng_(seed), router_(NewRouter()) {}
  ~ModelRun() { kvr_router_free(router_); }

  void Run(int steps) {
    for (int step = 0; step < steps && !::testing::Test::HasFailure(); ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      step_ = step;
      Step();
      history_.emplace_back(step, last_);
      CheckInvariants();
      if (step % 97 == 96) CheckSnapshot();
    }
    FreeEverything();
    CheckInvariants();
    CheckSnapshot();
    // The run exercised what it checks: requests were booked, by every path.
    EXPECT_GT(booked_, steps / 20) << "admitted or planned requests";
    EXPECT_GT(committed_, 0);
  }
  // Commits of plans that had lost their worker.
  int orphaned_seen() const { return orphaned_seen_; }

 private:
  size_t Uniform(size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }
  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }

  uint64_t AnyWorkerId() { return 1 + Uniform(kMaxWorkerId); }
  Rank AnyRank() { return Rank{AnyWorkerId(), static_cast<uint32_t>(Uniform(kMaxDpSize))}; }
  const std::vector<uint32_t>& AnyPrompt() { return Prompts()[Uniform(Prompts().size())]; }
  // What happened to a request id so far, for failure messages.
  std::string HistoryOf(const std::string& id) const {
    std::string out;
    for (const auto& [step, what] : history_) {
      if (what.ends_with(" " + id) || what.find(" " + id + " ") != std::string::npos) {
        out += "\n  step " + std::to_string(step) + ": " + what;
      }
    }
    return out;
  }

  std::string AnyRequestId() {
    // Mostly ids the model knows (to free or commit them), sometimes new ones.
    if (!model_.requests.empty() && Chance(0.6)) {
      auto it = model_.requests.begin();
      std::advance(it, Uniform(model_.requests.size()));
      return it->first;
    }
    return "r" + std::to_string(Uniform(40));
  }

  void Step() {
    switch (Uniform(16)) {
      case 0:
        return AddWorkerStep();
      case 1:
        return Chance(0.5) ? UpdateWorkerStep() : RemoveWorkerStep();
      case 2:
      case 3:
        return StoreStep();
      case 4:
        return RemoveBlocksStep();
      case 5:
        return ClearStep();
      case 6:
        return LookStep();
      case 7:
      case 8:
        return AdmitStep();
      case 9:
        return BookElsewhereStep();
      case 10:
        return PrefillCompletedStep();
      case 11:
      case 12:
        return FreeStep();
      case 13:
        return PlanStep();
      case 14:
        return CommitStep();
      case 15:
        return AbortStep();
    }
  }

  void AddWorkerStep() {
    const uint64_t id = AnyWorkerId();
    const uint32_t dp_size = 1 + static_cast<uint32_t>(Uniform(kMaxDpSize));
    last_ = "add worker " + std::to_string(id);
    SCOPED_TRACE(last_);
    const Outcome out = AddWorker(router_, id, dp_size);
    if (model_.workers.count(id)) {
      EXPECT_EQ(out.status, KVR_ALREADY_EXISTS) << out.message;
      return;
    }
    ASSERT_TRUE(out.ok()) << out.message;
    model_.workers[id] = dp_size;
  }

  void UpdateWorkerStep() {
    const uint64_t id = AnyWorkerId();
    const uint32_t dp_size = 1 + static_cast<uint32_t>(Uniform(kMaxDpSize));
    last_ = "update worker " + std::to_string(id) + " to " + std::to_string(dp_size) + " ranks";
    SCOPED_TRACE(last_);
    const Outcome out = UpdateWorker(router_, id, dp_size);
    if (!model_.workers.count(id)) {
      EXPECT_EQ(out.status, KVR_NOT_FOUND) << out.message;
      return;
    }
    ASSERT_TRUE(out.ok()) << out.message;
    model_.workers[id] = dp_size;
    model_.DropRequestsOffRanks();
  }

  void RemoveWorkerStep() {
    const uint64_t id = AnyWorkerId();
    last_ = "remove worker " + std::to_string(id);
    SCOPED_TRACE(last_);
    const Outcome out =
        Try([&](kvr_error** err) { return kvr_router_remove_worker(router_, id, err); });
    if (!model_.workers.count(id)) {
      EXPECT_EQ(out.status, KVR_NOT_FOUND) << out.message;
      return;
    }
    ASSERT_TRUE(out.ok()) << out.message;
    model_.workers.erase(id);
    model_.DropRequestsOffRanks();
  }

  // Blocks of a prompt, from its start or after a block the rank may hold (then the parent may
  // be unknown: KVR_NOT_FOUND). Events name any worker: unregistered ones are indexed too.
  void StoreStep() {
    const std::vector<uint32_t>& prompt = AnyPrompt();
    const size_t blocks = prompt.size() / kBlockSize;
    const size_t first = Chance(0.5) ? 0 : Uniform(blocks);
    const size_t count = 1 + Uniform(blocks - first);
    const kvr_tier tier = Chance(0.8) ? KVR_TIER_DEVICE : KVR_TIER_HOST_PINNED;
    last_ = "store";
    SCOPED_TRACE(last_);
    const Outcome out = StoreBlocks(router_, AnyRank(), prompt, first, count, tier);
    EXPECT_TRUE(out.ok() || (first > 0 && out.status == KVR_NOT_FOUND)) << out.message;
  }

  void RemoveBlocksStep() {
    const std::vector<uint32_t>& prompt = AnyPrompt();
    const size_t blocks = prompt.size() / kBlockSize;
    const size_t first = Uniform(blocks);
    last_ = "remove blocks";
    SCOPED_TRACE(last_);
    const Outcome out =
        RemoveBlocks(router_, AnyRank(), prompt, first, 1 + Uniform(blocks - first));
    EXPECT_TRUE(out.ok() || out.status == KVR_NOT_FOUND) << out.message;
  }

  void ClearStep() {
    const Rank rank = AnyRank();
    last_ = "clear";
    SCOPED_TRACE(last_);
    EXPECT_TRUE(Try([&](kvr_error** err) {
                  return kvr_router_apply_cleared(router_, rank.worker_id, rank.dp_rank, 0, err);
                }).ok());
  }

  // Calls that only look must change nothing.
  void LookStep() {
    const std::vector<uint32_t>& prompt = AnyPrompt();
    last_ = "look";
    SCOPED_TRACE(last_);
    const uint64_t before = Digest(router_);
    kvr_route_signals signals;
    kvr_route_signals_init(&signals, sizeof signals);
    const Outcome preview = Try([&](kvr_error** err) {
      return kvr_preview_route(router_, prompt.data(), prompt.size(), nullptr, nullptr, &signals,
                               err);
    });
    CheckDecision(preview, Rank{signals.worker_id, signals.dp_rank});
    kvr_route_result result;
    kvr_route_result_init(&result, sizeof result);
    const Outcome route = Try([&](kvr_error** err) {
      return kvr_find_best_match(router_, prompt.data(), prompt.size(), nullptr, &result, nullptr,
                                 0, nullptr, err);
    });
    CheckDecision(route, Rank{result.worker_id, result.dp_rank});
    EXPECT_EQ(result.booked, 0u);
    std::vector<kvr_overlap> overlaps(64);
    size_t len = 0;
    EXPECT_TRUE(Try([&](kvr_error** err) {
                  return kvr_router_overlap_scores(router_, prompt.data(), prompt.size(), nullptr,
                                                   overlaps.data(), overlaps.size(), &len, err);
                }).ok());
    kvr_buffer* snapshot = nullptr;
    EXPECT_TRUE(
        Try([&](kvr_error** err) { return kvr_router_snapshot(router_, &snapshot, err); }).ok());
    kvr_buffer_free(snapshot);
    EXPECT_EQ(Digest(router_), before) << "a call that only looks changed the router";
  }

  // A routing decision names a registered rank, or says there is none.
  void CheckDecision(const Outcome& out, Rank chosen) {
    if (model_.workers.empty()) {
      EXPECT_EQ(out.status, KVR_UNAVAILABLE) << out.message;
      return;
    }
    ASSERT_TRUE(out.ok()) << out.message;
    EXPECT_TRUE(model_.Registered(chosen)) << chosen.worker_id << "." << chosen.dp_rank;
  }

  kvr_request_options AdmitOptions(const std::string& id) {
    kvr_request_options options;
    kvr_request_options_init(&options, sizeof options);
    options.flags = KVR_REQUEST_ADMIT;
    options.request_id = id.c_str();
    options.expected_output_tokens = static_cast<uint32_t>(Uniform(64));
    return options;
  }

  void AdmitStep() {
    const std::string id = AnyRequestId();
    const std::vector<uint32_t>& prompt = AnyPrompt();
    last_ = "admit " + id;
    SCOPED_TRACE(last_);
    const kvr_request_options options = AdmitOptions(id);
    kvr_route_result result;
    kvr_route_result_init(&result, sizeof result);
    const Outcome out = Try([&](kvr_error** err) {
      return kvr_find_best_match(router_, prompt.data(), prompt.size(), &options, &result, nullptr,
                                 0, nullptr, err);
    });
    if (model_.requests.count(id) && !model_.workers.empty()) {
      EXPECT_EQ(out.status, KVR_ALREADY_EXISTS) << out.message;
      return;
    }
    CheckDecision(out, Rank{result.worker_id, result.dp_rank});
    if (!out.ok()) return;
    EXPECT_EQ(result.booked, 1u);
    EXPECT_EQ(result.queued, 0u);  // the router does not queue (default threshold)
    model_.Book(id, Rank{result.worker_id, result.dp_rank}, false);
    ++booked_;
  }

  // A request booked on a rank the gateway chose itself.
  void BookElsewhereStep() {
    const std::string id = AnyRequestId();
    const Rank rank = AnyRank();
    const std::vector<uint32_t>& prompt = AnyPrompt();
    last_ = "add request " + id;
    SCOPED_TRACE(last_);
    const kvr_request_options options = AdmitOptions(id);
    const Outcome out = Try([&](kvr_error** err) {
      return kvr_router_add_request(router_, prompt.data(), prompt.size(), rank.worker_id,
                                    rank.dp_rank, &options, err);
    });
    const bool known_id = model_.requests.count(id) > 0;
    if (!model_.Registered(rank) || known_id) {
      // Either check may come first when both fail.
      EXPECT_TRUE((!model_.Registered(rank) && out.status == KVR_NOT_FOUND) ||
                  (known_id && out.status == KVR_ALREADY_EXISTS))
          << kvr_status_str(out.status) << ": " << out.message;
    } else {
      ASSERT_TRUE(out.ok()) << out.message;
      model_.Book(id, rank, false);
    }
  }

  void PrefillCompletedStep() {
    const std::string id = AnyRequestId();
    last_ = "prefill completed " + id;
    SCOPED_TRACE(last_);
    EXPECT_TRUE(Try([&](kvr_error** err) {
                  return kvr_router_mark_prefill_completed(router_, id.c_str(), err);
                }).ok());
  }

  void FreeStep() {
    const std::string id = AnyRequestId();
    last_ = "free " + id;
    SCOPED_TRACE(last_);
    EXPECT_TRUE(Try([&](kvr_error** err) {
                  return kvr_router_free_request(router_, id.c_str(), err);
                }).ok());
    model_.Forget(id);
  }

  // A plan, half the time with a hard session affinity: a session bound to a registered rank
  // must get that rank.
  void PlanStep() {
    const std::string id = AnyRequestId();
    const std::vector<uint32_t>& prompt = AnyPrompt();
    const std::string session = "s" + std::to_string(Uniform(4));
    const bool with_session = Chance(0.5);
    last_ = "plan " + id + (with_session ? " in session " + session : "");
    SCOPED_TRACE(last_);
    std::optional<Rank> bound;
    if (with_session) {
      uint64_t worker = 0;
      uint32_t rank = 0;
      if (Try([&](kvr_error** err) {
            return kvr_router_session_binding(router_, session.c_str(), &worker, &rank, err);
          }).ok() &&
          model_.Registered(Rank{worker, rank})) {
        bound = Rank{worker, rank};
      }
    }
    const kvr_request_options options = AdmitOptions(id);
    kvr_routing_hints hints;
    kvr_routing_hints_init(&hints, sizeof hints);
    if (with_session) hints.session_id = session.c_str();
    kvr_route_signals signals;
    kvr_route_signals_init(&signals, sizeof signals);
    const Outcome out = Try([&](kvr_error** err) {
      return kvr_plan_route(router_, prompt.data(), prompt.size(), &options, &hints, nullptr,
                            &signals, err);
    });
    const Rank chosen{signals.worker_id, signals.dp_rank};
    auto known = model_.requests.find(id);
    if (known != model_.requests.end() && !model_.workers.empty()) {
      if (known->second.plan) {  // idempotent: the same plan
        ASSERT_TRUE(out.ok()) << out.message;
        EXPECT_TRUE(chosen == known->second.rank);
      } else {
        EXPECT_EQ(out.status, KVR_ALREADY_EXISTS) << out.message << HistoryOf(id);
      }
      return;
    }
    CheckDecision(out, chosen);
    if (!out.ok()) return;
    EXPECT_EQ(signals.booked, 1u);
    if (bound) {
      EXPECT_TRUE(chosen == *bound) << "a hard session left its bound rank";
    }
    model_.Book(id, chosen, true);
    ++booked_;
  }

  void CommitStep() {
    const std::string id = AnyRequestId();
    last_ = "commit " + id;
    SCOPED_TRACE(last_);
    const Outcome out =
        Try([&](kvr_error** err) { return kvr_commit_route(router_, id.c_str(), err); });
    auto it = model_.requests.find(id);
    if (it == model_.requests.end()) {
      // A plan that lost its booking says so; else there is none (never made, aborted, freed).
      orphaned_seen_ += model_.orphaned_plans.count(id);
      EXPECT_EQ(out.status,
                model_.orphaned_plans.count(id) ? KVR_FAILED_PRECONDITION : KVR_NOT_FOUND)
          << out.message << HistoryOf(id);
      return;
    }
    if (!it->second.plan) {
      // A committed request commits again; one admitted without a plan has none to commit.
      EXPECT_TRUE(out.ok() || out.status == KVR_NOT_FOUND) << out.message;
      return;
    }
    ASSERT_TRUE(out.ok()) << out.message;
    it->second.plan = false;
    ++committed_;
  }

  void AbortStep() {
    const std::string id = AnyRequestId();
    last_ = "abort " + id;
    SCOPED_TRACE(last_);
    int freed = -1;
    EXPECT_TRUE(Try([&](kvr_error** err) {
                  return kvr_abort_route(router_, id.c_str(), &freed, err);
                }).ok());
    EXPECT_EQ(freed, model_.requests.count(id) || model_.orphaned_plans.count(id) ? 1 : 0)
        << HistoryOf(id);
    model_.Forget(id);
  }

  void FreeEverything() {
    for (const auto& [id, request] : model_.requests) {
      EXPECT_TRUE(Try([&](kvr_error** err) {
                    return kvr_router_free_request(router_, id.c_str(), err);
                  }).ok());
    }
    model_.requests.clear();
  }

  void CheckInvariants() {
    const kvr_metrics metrics = Metrics(router_);
    EXPECT_EQ(metrics.workers, model_.workers.size());
    EXPECT_EQ(metrics.requests_active, model_.requests.size());
    const std::map<Rank, kvr_potential_load> loads = Loads(router_);
    const std::map<Rank, uint64_t> per_rank = model_.RequestsPerRank();
    size_t ranks = 0;
    for (const auto& [id, dp_size] : model_.workers) ranks += dp_size;
    EXPECT_EQ(loads.size(), ranks);
    for (const auto& [rank, load] : loads) {
      ASSERT_TRUE(model_.Registered(rank))
          << "a load on unregistered rank " << rank.worker_id << "." << rank.dp_rank;
      const auto it = per_rank.find(rank);
      const uint64_t expected = it == per_rank.end() ? 0 : it->second;
      EXPECT_EQ(load.active_requests, expected) << rank.worker_id << "." << rank.dp_rank;
      if (expected == 0) {
        EXPECT_EQ(load.active_prefill_tokens, 0u) << rank.worker_id << "." << rank.dp_rank;
        EXPECT_EQ(load.active_blocks, 0u) << rank.worker_id << "." << rank.dp_rank;
      }
    }
  }

  void CheckSnapshot() {
    kvr_router* copy = RestoredCopy(router_, model_.workers);
    EXPECT_EQ(IndexView(copy), IndexView(router_));
    if (model_.requests.empty()) {
      // Nothing booked: the copy's state is the router's but for session bindings, which a
      // snapshot does not carry, and plans that lost their booking with their worker (kept
      // until their deadline, so that a commit can say so); close and abort them first.
      for (const std::string& id : model_.orphaned_plans) {
        EXPECT_TRUE(Try([&](kvr_error** err) {
                      return kvr_abort_route(router_, id.c_str(), nullptr, err);
                    }).ok());
      }
      model_.orphaned_plans.clear();
      for (int s = 0; s < 4; ++s) {
        const std::string session = "s" + std::to_string(s);
        EXPECT_TRUE(Try([&](kvr_error** err) {
                      return kvr_router_close_session(router_, session.c_str(), err);
                    }).ok());
      }
      EXPECT_EQ(Digest(copy), Digest(router_));
    }
    kvr_router_free(copy);
  }

  std::mt19937_64 rng_;
  kvr_router* router_;
  Model model_;
  std::string last_;
  int step_ = 0;
  int booked_ = 0;
  int committed_ = 0;
  int orphaned_seen_ = 0;
  std::vector<std::pair<int, std::string>> history_;
};

TEST(RouterModelTest, RandomCallSequencesKeepTheModelsState) {
  int orphaned_seen = 0;
  for (uint64_t seed = 1; seed <= 6 && !::testing::Test::HasFailure(); ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    ModelRun run(seed);
    run.Run(3000);
    orphaned_seen += run.orphaned_seen();
  }
  EXPECT_GT(orphaned_seen, 0) << "no run committed a plan that had lost its worker";
}

}  // namespace
}  // namespace kvrouter::model

namespace kvrouter::model {
namespace {

kvr_request_options Admit(const char* id) {
  kvr_request_options options;
  kvr_request_options_init(&options, sizeof options);
  options.flags = KVR_REQUEST_ADMIT;
  options.request_id = id;
  return options;
}

// Found by the model run: a plan whose worker is removed must not outlive its booking and
// answer for a later request that reuses the id.
TEST(RouterModelTest, APlanDroppedWithItsWorkerDoesNotAnswerForItsIdLater) {
  kvr_router* router = NewRouter();
  ASSERT_TRUE(AddWorker(router, 1, 1).ok());
  const std::vector<uint32_t>& prompt = Prompts()[0];
  const kvr_request_options options = Admit("x");
  kvr_route_signals signals;
  kvr_route_signals_init(&signals, sizeof signals);
  ASSERT_TRUE(Try([&](kvr_error** err) {
                return kvr_plan_route(router, prompt.data(), prompt.size(), &options, nullptr,
                                      nullptr, &signals, err);
              }).ok());
  ASSERT_TRUE(Try([&](kvr_error** err) { return kvr_router_remove_worker(router, 1, err); }).ok());
  ASSERT_TRUE(AddWorker(router, 2, 1).ok());
  kvr_route_result result;
  kvr_route_result_init(&result, sizeof result);
  ASSERT_TRUE(Try([&](kvr_error** err) {
                return kvr_find_best_match(router, prompt.data(), prompt.size(), &options, &result,
                                           nullptr, 0, nullptr, err);
              }).ok());
  EXPECT_EQ(result.worker_id, 2u);
  const Outcome again = Try([&](kvr_error** err) {
    return kvr_plan_route(router, prompt.data(), prompt.size(), &options, nullptr, nullptr,
                          &signals, err);
  });
  EXPECT_EQ(again.status, KVR_ALREADY_EXISTS)
      << again.message << " (worker " << signals.worker_id << ")";
  EXPECT_EQ(Metrics(router).requests_active, 1u);
  kvr_router_free(router);
}

}  // namespace
}  // namespace kvrouter::model

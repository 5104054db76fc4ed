// A model-based test of the router through its C ABI: random sequences of calls (workers added,
// updated and removed; stored, removed and cleared events; previews, admitted routes, requests
// booked elsewhere, prefill completions, frees; plans, commits and aborts with session
// affinity; snapshots) run against a reference model kept here, which knows what the router
// must hold: the workers and their ranks, and every request booked, on which rank, and whether
// as a plan. What the model does not follow (the index) is checked by round trips instead.
//
// The single-threaded test (router_model_test.cc) checks every answer and every invariant after
// each call; the concurrent one (router_model_concurrency_test.cc) runs the same operations from
// several threads, each with requests of its own, and checks what must hold once they stop.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvrouter.h"

namespace kvrouter::model {

inline constexpr uint32_t kBlockSize = 4;
inline constexpr uint64_t kMaxWorkerId = 6;  // worker ids 1..6
inline constexpr uint32_t kMaxDpSize = 3;

struct Rank {
  uint64_t worker_id = 0;
  uint32_t dp_rank = 0;
  friend auto operator<=>(const Rank&, const Rank&) = default;
};

// A call's outcome: the status, with the message when it failed.
struct Outcome {
  kvr_status status = KVR_OK;
  std::string message;
  bool ok() const { return status == KVR_OK; }
};

// Runs `call` with an error slot, freeing the error.
template <typename Call>
Outcome Try(Call&& call) {
  kvr_error* err = nullptr;
  Outcome out;
  out.status = call(&err);
  if (err != nullptr) out.message = kvr_error_message(err);
  kvr_error_free(err);
  return out;
}

// Prompts sharing prefixes: three stems, and prompts continuing them, so that stored events
// on one make cache hits on others. Tokens are distinct per block of content.
const std::vector<std::vector<uint32_t>>& Prompts();

// The engine's hash of block `block` of `prompt`: a function of the tokens up to and including
// it, so prompts sharing a prefix share its blocks' hashes, as in a real engine.
uint64_t EngineHash(const std::vector<uint32_t>& prompt, size_t block);

// The router's state as the model knows it.
struct Model {
  std::map<uint64_t, uint32_t> workers;  // id -> dp_size
  struct Request {
    Rank rank;
    bool plan = false;  // booked by kvr_plan_route, not yet committed
  };
  std::map<std::string, Request> requests;
  // Plans whose booking went with their worker: the router keeps them (a commit says so)
  // until they are aborted, freed, planned again, replaced by a new booking, or expire.
  std::set<std::string> orphaned_plans;

  bool Registered(Rank r) const {
    auto it = workers.find(r.worker_id);
    return it != workers.end() && r.dp_rank < it->second;
  }
  // Requests booked on ranks that no longer exist are dropped with them.
  void DropRequestsOffRanks() {
    std::erase_if(requests, [&](const auto& entry) {
      if (Registered(entry.second.rank)) return false;
      if (entry.second.plan) orphaned_plans.insert(entry.first);
      return true;
    });
  }
  // A new booking (or a free, an abort) under `id` ends whatever the id held before.
  void Book(const std::string& id, Rank rank, bool plan) {
    orphaned_plans.erase(id);
    requests[id] = Request{rank, plan};
  }
  void Forget(const std::string& id) {
    orphaned_plans.erase(id);
    requests.erase(id);
  }
  std::map<Rank, uint64_t> RequestsPerRank() const {
    std::map<Rank, uint64_t> out;
    for (const auto& [id, request] : requests) ++out[request.rank];
    return out;
  }
};

// Helpers over the C ABI.
kvr_router* NewRouter();
Outcome AddWorker(kvr_router* router, uint64_t id, uint32_t dp_size);
Outcome UpdateWorker(kvr_router* router, uint64_t id, uint32_t dp_size);
Outcome StoreBlocks(kvr_router* router, Rank rank, const std::vector<uint32_t>& prompt,
                    size_t first, size_t count, kvr_tier tier);
Outcome RemoveBlocks(kvr_router* router, Rank rank, const std::vector<uint32_t>& prompt,
                     size_t first, size_t count);
uint64_t Digest(kvr_router* router);
kvr_metrics Metrics(kvr_router* router);
// Every registered rank's load (kvr_router_potential_loads of a one-block prompt).
std::map<Rank, kvr_potential_load> Loads(kvr_router* router);
// Every rank's match of every prompt, as a comparable string (the index seen from outside).
std::string IndexView(kvr_router* router);
// A new router with `workers`, restored from `router`'s snapshot.
kvr_router* RestoredCopy(kvr_router* router, const std::map<uint64_t, uint32_t>& workers);

}  // namespace kvrouter::model

// The daemon's state behind the API: one router and its ingest (through the public C ABI
// only), the workers as configured (with their addresses and event subscriptions), the booked
// request ids, and the daemon's own counters. Every endpoint of docs/kvrouterd.md is one method
// here; they may run on any thread (routing calls run on the thread pool).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvrouter.h"
#include "kvrouterd/api_json.h"
#include "kvrouterd/booking_table.h"
#include "kvrouterd/bootstrap.h"
#include "kvrouterd/http_server.h"
#include "kvrouterd/options.h"

namespace kvrouterd {

// A routing call (route, plan) from its arrival on, for Service::Handle: it may wait for a
// routing thread before it runs, and that wait counts (a free or abort meanwhile cancels it,
// its queue timeout runs from the arrival).
struct RoutingCall {
  uint64_t arrival = BookingTable::kNoArrival;
  BookingTable::Clock::time_point arrived = BookingTable::Clock::now();
  std::function<bool()> client_gone;  // thread-safe; true once the client closed the connection
  bool started = false;               // Book began (on a routing thread)
};

// What the library says of `config`'s router and ingest options, plan deadline and workers
// (their ranks, an id given twice, their event subscriptions' ranks and endpoints), asked of a
// router and an ingest object made for the purpose and dropped (nothing starts or connects):
// empty if it takes them. A reload must not let through what the next start would refuse.
std::string CheckLibraryOptions(const Config& config);

// The HTTP server's connections, for /metrics.
struct ConnectionCounts {
  size_t open = 0;
  uint64_t refused = 0;  // closed as soon as accepted: max-connections were open
};

class Service {
 public:
  // Creates the router and its ingest, opens the event sources and adds the configured
  // workers. nullptr with `*error` set if any of it fails.
  static std::unique_ptr<Service> Create(const Config& config, std::string* error);
  ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // Answers one matched request; never throws (errors become error answers). `call`: a route
  // or plan's arrival (ArriveRouting); without one it arrives now.
  HttpResponse Handle(const RouteSpec& route, const HttpRequest& request, const std::string& param,
                      RoutingCall* call = nullptr);
  // A route or plan arrived (on the loop, before it waits for a routing thread); DepartRouting
  // once it is answered.
  RoutingCall ArriveRouting(std::function<bool()> client_gone);
  void DepartRouting(const RoutingCall& call);
  // The daemon's HTTP connections, for kvrouterd_http_connections and
  // kvrouterd_http_connections_refused_total (called on the loop).
  void SetConnectionCounts(std::function<ConnectionCounts()> counts) {
    connection_counts_ = std::move(counts);
  }
  // Counts an answer for kvrouterd_http_requests_total; `pattern` is the route's ("unmatched":
  // no route's, "unparsed": a request the HTTP server refused).
  void CountAnswer(const std::string& pattern, int status);

  // SIGHUP: applies the new config's worker set as a diff against the lines in effect, and its
  // log level; logs what changed and what needs a restart. `next` passed ValidateConfig and
  // CheckLibraryOptions. False if a worker's change failed (undone, logged, tried again by the
  // next reload): the reload counts as an error.
  bool Reload(const Config& next);
  // Counts a reload for kvrouterd_reloads_total (a config that does not parse is a failure).
  void CountReload(bool ok);
  // SIGTERM: routing calls that have not started yet (waiting for a routing thread) are refused
  // (503), and /healthz would answer 503 "stopping" (but the HTTP server reads no new request
  // once stopping, so none is asked: docs/kvrouterd.md, "Stopping").
  void BeginShutdown() { stopping_ = true; }
  // Cancels the requests being booked now, e.g. waiting in the admission queue (their callers
  // get 409). The daemon calls it repeatedly once shutdown-timeout-seconds have passed, so that
  // a call that entered the queue after one round is cancelled by the next.
  void CancelWaiting();
  // Closes every event source and joins the ingest thread.
  void StopIngest();
  // Drops requests past request-expiry-seconds (a free that never came) and plans past their
  // deadline, admitting whom the queue held behind them; returns how many requests. The library
  // has no timer: the daemon calls this every second.
  size_t ExpireLostRequests();

  // How often a route is planned again when its worker was removed between its plan and its
  // commit (then answered 409 FAILED_PRECONDITION).
  static constexpr int kMaxReplans = 2;
  // Tests only: called on a route's routing thread between its plan and its commit, with the
  // planned worker (to remove it there).
  void SetBetweenPlanAndCommitForTest(std::function<void(uint64_t worker_id)> hook) {
    between_plan_and_commit_for_test_ = std::move(hook);
  }

  // The endpoints, as the routes table names them. Public for the unit tests.
  nlohmann::json AddWorker(const WorkerSpec& worker);
  nlohmann::json UpdateWorker(const WorkerSpec& worker);
  void RemoveWorker(uint64_t worker_id);

 private:
  explicit Service(const Config& config);
  std::string Open(const Config& config);

  HttpResponse Dispatch(Endpoint endpoint, const HttpRequest& request, const std::string& param,
                        RoutingCall* call);
  HttpResponse Book(const HttpRequest& request, bool commit, RoutingCall* call);
  // A session TTL past max-session-ttl-seconds taken as that (the library refuses one that is
  // not > 0, NaN included, and would keep a binding of 1e300 s for 146 years).
  void CapSessionTtl(RouteInput& input) const {
    if (input.hints.session_ttl_seconds > max_session_ttl_seconds_) {
      input.hints.session_ttl_seconds = max_session_ttl_seconds_;
    }
  }
  HttpResponse Preview(const HttpRequest& request);
  HttpResponse Commit(const std::string& id);
  HttpResponse Abort(const std::string& id);
  HttpResponse PrefillCompleted(const std::string& id);
  HttpResponse RecordOutput(const std::string& id, const HttpRequest& request);
  HttpResponse Free(const std::string& id);
  HttpResponse ListWorkers();
  HttpResponse GetWorker(const std::string& param);
  HttpResponse PutWorker(const std::string& param, const HttpRequest& request);
  HttpResponse GetSession(const std::string& id);
  HttpResponse CloseSession(const std::string& id);
  HttpResponse GetSnapshot();
  HttpResponse PutSnapshot(const HttpRequest& request);
  HttpResponse Digest();
  HttpResponse Metrics();
  HttpResponse Healthz();

  std::vector<WorkerSpec> ApplyWorkerDiff(const std::vector<WorkerSpec>& wanted, bool* all_applied);
  std::string AddressOf(uint64_t worker_id);
  // Throws ApiError if the library would refuse the worker's event subscription (its ranks,
  // its endpoints) or, with `ranks_too`, its ranks in the router, asked of a router and an
  // ingest made for the purpose (LibraryCheck): nothing connects.
  void CheckWorker(const WorkerSpec& worker, bool ranks_too);
  void Subscribe(const WorkerSpec& worker);
  // Consumes a JetStream stream of KV events (throws ApiError as the other calls do).
  void SubscribeJetStream(const JetStreamSpec& spec);
  void RelayToJetStream(const JetStreamSpec& spec);
  // One ingest source's counters (0: every source's), as kvr_ingest_get_stats gives them.
  kvr_ingest_stats SourceStats(uint64_t source_id);
  // The event sources' ranks whose cached state is unknown (the relay's resync left out).
  uint32_t RanksStateUnknown();
  // Loads a snapshot file into the (empty) index (throws ApiError as the other calls do).
  void RestoreSnapshotFile(const std::string& path);
  // --bootstrap-from: restores the first answering peer's snapshot and sets `streams` to
  // start after the peer's positions (throws ApiError if the library refuses the snapshot).
  void BootstrapFromPeer(const std::vector<std::string>& peers,
                         std::vector<JetStreamSpec>* streams);
  StreamSequences AppliedStreamSequences();
  // False if the library refused (logged): for undoing, which must not throw.
  bool Unsubscribe(uint64_t worker_id);
  // Throws ApiError with what the library refused; a worker not subscribed is no error.
  void UnsubscribeOrThrow(uint64_t worker_id);
  WorkerSpec RestoreSubscription(const WorkerSpec& previous, bool unsubscribed, bool subscribed);
  std::string OwnMetrics();

  kvr_router* router_ = nullptr;
  kvr_ingest* ingest_ = nullptr;
  double request_expiry_seconds_;
  double plan_deadline_seconds_;
  double max_session_ttl_seconds_;
  uint32_t block_size_;  // the router's: CheckWorker checks workers against it
  BookingTable bookings_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> routing_waiting_{0};  // calls arrived and not started: for a thread
  std::atomic<int64_t> routing_running_{0};  // calls started and not departed: on a thread
  std::function<ConnectionCounts()> connection_counts_;
  std::function<void(uint64_t worker_id)> between_plan_and_commit_for_test_;
  // (stream, source id) of every JetStream source, for the snapshot's positions. Written
  // only while the service opens, before any request.
  std::vector<std::pair<std::string, uint64_t>> jetstream_sources_;
  // The JetStream relay's source, if any: its state_unknown (a resync under way) says the
  // streams' consumers are behind, not that this router's index is (/healthz leaves it out).
  // Written only while the service opens.
  std::optional<uint64_t> relay_source_id_;

  std::mutex workers_mutex_;  // held across a worker change's library calls: one at a time
  std::map<uint64_t, WorkerSpec> workers_;
  Config config_;  // the last config applied (Reload diffs against its workers)

  std::mutex counters_mutex_;
  std::map<std::pair<std::string, int>, uint64_t> http_requests_;
  uint64_t reloads_ok_ = 0;
  uint64_t reloads_failed_ = 0;
};

}  // namespace kvrouterd

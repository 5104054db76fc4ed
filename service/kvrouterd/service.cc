#include "kvrouterd/service.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>

#include "kvrouterd/log.h"

namespace kvrouterd {
namespace {

using nlohmann::json;
using Clock = BookingTable::Clock;

// `seconds` from now. Saturates at 2^62 ns (about 146 years), the library's rule
// (SecondsToNanos): a longer span (1e10 s meant as "never") would not fit int64 nanoseconds.
Clock::duration Span(double seconds) {
  constexpr double kLongestNanos = 4611686018427387904.0;  // 2^62
  double nanos = seconds * 1e9;
  if (!(nanos == nanos)) nanos = 0;  // NaN
  nanos = std::clamp(nanos, -kLongestNanos, kLongestNanos);
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::nanoseconds(static_cast<int64_t>(nanos)));
}

Clock::time_point After(double seconds) { return Clock::now() + Span(seconds); }

// Runs `f` when it goes out of scope.
template <typename F>
struct AtExit {
  F f;
  ~AtExit() { f(); }
};
template <typename F>
AtExit(F) -> AtExit<F>;

json RequestIdAnswer(const std::string& id) { return {{"request_id", id}}; }

// A Prometheus text from one of the library's *_prometheus functions, sized by a first call.
template <typename Object>
std::string PrometheusText(Object* object,
                           kvr_status (*render)(Object*, char*, size_t, size_t*, kvr_error**)) {
  std::string text;
  size_t needed = 0;
  kvr_status status = render(object, nullptr, 0, &needed, nullptr);
  for (int attempt = 0; attempt < 4 && status == KVR_BUFFER_TOO_SMALL; ++attempt) {
    text.resize(needed + 4096);  // room for a few more series appearing meanwhile
    status = render(object, text.data(), text.size(), &needed, nullptr);
  }
  if (status != KVR_OK) return {};
  text.resize(needed > 0 ? needed - 1 : 0);  // without the NUL
  return text;
}

kvr_worker_config RouterWorker(const WorkerSpec& worker) {
  kvr_worker_config config;
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = worker.worker_id;
  config.dp_start = worker.dp_start;
  config.dp_size = worker.dp_size;
  config.total_kv_blocks = worker.total_kv_blocks;
  config.max_num_batched_tokens = worker.max_num_batched_tokens;
  return config;
}

bool SameRouterConfig(const WorkerSpec& a, const WorkerSpec& b) {
  return a.dp_start == b.dp_start && a.dp_size == b.dp_size &&
         a.total_kv_blocks == b.total_kv_blocks &&
         a.max_num_batched_tokens == b.max_num_batched_tokens;
}

std::string WorkerNotFound(uint64_t id) {
  return "worker " + std::to_string(id) + " is not registered";
}

// A worker's event subscription as the C ABI takes it; valid while `worker` lives.
struct EngineWorker {
  explicit EngineWorker(const WorkerSpec& worker) {
    kvr_engine_worker_init(&config, sizeof config);
    config.engine = worker.events->engine;
    config.endpoint = worker.events->endpoint.c_str();
    config.worker_id = worker.worker_id;
    config.dp_start = worker.dp_start;
    config.dp_size = worker.dp_size;
    config.topic = worker.events->topic.empty() ? nullptr : worker.events->topic.c_str();
    config.replay_endpoint =
        worker.events->replay_endpoint.empty() ? nullptr : worker.events->replay_endpoint.c_str();
  }
  kvr_engine_worker config;
};

// A router and an ingest made only to ask the library what it takes: nothing given to them runs
// or connects. The ingest is stopped before it is given anything: kvr_ingest_add_engine_worker
// checks a worker's ranks and endpoints first, then finds the ingest stopped
// (KVR_FAILED_PRECONDITION) and opens no socket.
class LibraryCheck {
 public:
  // Throws ApiError if the library refuses the options: the router's (NULL: its defaults), and
  // the ingest's if given. Without them an ingest object is made only to check a worker with
  // events: a check of ranks alone needs none of the descriptors one takes (a daemon short of
  // them could still change a worker's ranks).
  LibraryCheck(const kvr_router_options* router_options, const kvr_ingest_options* ingest_options) {
    try {
      kvr_error* err = nullptr;
      ThrowIfError(kvr_router_new(router_options, &router_, &err), err);
      if (ingest_options != nullptr) MakeIngest(ingest_options, "");
    } catch (...) {
      Free();
      throw;
    }
  }
  ~LibraryCheck() { Free(); }
  LibraryCheck(const LibraryCheck&) = delete;
  LibraryCheck& operator=(const LibraryCheck&) = delete;

  kvr_router* router() { return router_; }

  // With `ranks_too`, the worker as the router takes it (its ranks; an id given twice is
  // KVR_ALREADY_EXISTS); with events, its subscription's ranks and endpoints as the ingest
  // takes them. Throws ApiError naming the worker if refused.
  void Worker(const WorkerSpec& worker, bool ranks_too) {
    const std::string prefix = "worker " + std::to_string(worker.worker_id) + ": ";
    kvr_error* err = nullptr;
    if (ranks_too) {
      const kvr_worker_config config = RouterWorker(worker);
      const kvr_status status = kvr_router_add_worker(router_, &config, &err);
      Refuse(status, err, prefix);
    }
    if (worker.events) {
      if (ingest_ == nullptr) MakeIngest(nullptr, prefix);
      const EngineWorker engine(worker);
      const kvr_status status =
          kvr_ingest_add_engine_worker(ingest_, &engine.config, nullptr, &err);
      // Stopped: it took what it checks, and opened nothing.
      Refuse(status == KVR_FAILED_PRECONDITION ? KVR_OK : status, err, prefix);
    }
  }

 private:
  static void Refuse(kvr_status status, kvr_error*& err, const std::string& prefix) {
    try {
      ThrowIfError(status, err);
    } catch (const ApiError& e) {
      throw ApiError(e.status(), prefix + e.what());
    }
  }
  // Stopped at once: it checks what it is given and opens nothing. Refused, the error starts
  // with `prefix`.
  void MakeIngest(const kvr_ingest_options* options, const std::string& prefix) {
    kvr_error* err = nullptr;
    kvr_status status = kvr_ingest_new(router_, options, &ingest_, &err);
    Refuse(status, err, prefix);
    status = kvr_ingest_stop(ingest_, &err);
    Refuse(status, err, prefix);
  }
  void Free() {
    kvr_ingest_free(ingest_);
    kvr_router_free(router_);
    ingest_ = nullptr;
    router_ = nullptr;
  }
  kvr_router* router_ = nullptr;
  kvr_ingest* ingest_ = nullptr;
};

}  // namespace

Service::Service(const Config& config)
    : request_expiry_seconds_(config.router.request_expiry_seconds),
      plan_deadline_seconds_(config.plan_deadline_seconds),
      max_session_ttl_seconds_(config.max_session_ttl_seconds),
      block_size_(config.router.block_size),
      bookings_(config.max_tracked_requests),
      config_(config) {}

std::string CheckLibraryOptions(const Config& config) {
  try {
    LibraryCheck check(&config.router, &config.ingest);
    kvr_error* err = nullptr;
    ThrowIfError(kvr_router_set_plan_deadline(check.router(), config.plan_deadline_seconds, &err),
                 err);
    // As a start adds them: one by one, so that an id given twice is refused too.
    for (const WorkerSpec& worker : config.workers) check.Worker(worker, /*ranks_too=*/true);
  } catch (const std::exception& e) {  // ApiError, or bad_alloc: the reload is refused either way
    return e.what();
  }
  return {};
}

std::unique_ptr<Service> Service::Create(const Config& config, std::string* error) {
  std::unique_ptr<Service> service(new Service(config));
  *error = service->Open(config);
  if (!error->empty()) return nullptr;
  return service;
}

// Everything the config asks for at startup; the first failure is the error.
std::string Service::Open(const Config& config) {
  try {
    kvr_error* err = nullptr;
    ThrowIfError(kvr_router_new(&config.router, &router_, &err), err);
    ThrowIfError(kvr_router_set_plan_deadline(router_, config.plan_deadline_seconds, &err), err);
    if (!config.snapshot_file.empty()) RestoreSnapshotFile(config.snapshot_file);
    std::vector<JetStreamSpec> streams = config.jetstream_events;
    if (!config.bootstrap_from.empty()) BootstrapFromPeer(config.bootstrap_from, &streams);
    ThrowIfError(kvr_ingest_new(router_, &config.ingest, &ingest_, &err), err);
    // The relay before any source: it must see every change they make.
    if (config.jetstream_relay) RelayToJetStream(*config.jetstream_relay);
    ThrowIfError(kvr_ingest_start(ingest_, &err), err);
    for (const std::string& endpoint : config.listen_events) {
      char bound[512] = {0};
      ThrowIfError(
          kvr_ingest_listen(ingest_, endpoint.c_str(), nullptr, bound, sizeof bound, nullptr, &err),
          err);
      Log(LogLevel::kInfo, "listening for KV event streams", {{"endpoint", bound}});
    }
    for (const NatsEventsSpec& nats : config.nats_events) {
      ThrowIfError(
          kvr_ingest_subscribe_nats(ingest_, nats.url.c_str(), nats.subject.c_str(), nullptr, &err),
          err);
      Log(LogLevel::kInfo, "subscribed to KV events on NATS",
          {{"url", nats.url}, {"subject", nats.subject}});
    }
    for (const JetStreamSpec& js : streams) SubscribeJetStream(js);
    if (const auto& sync = config.replica_sync) {
      ThrowIfError(kvr_ingest_sync_replicas(ingest_, sync->url.c_str(), sync->subject.c_str(),
                                            sync->replica_id.c_str(), nullptr, &err),
                   err);
      Log(LogLevel::kInfo, "syncing bookings with replicas",
          {{"url", sync->url}, {"subject", sync->subject}, {"replica_id", sync->replica_id}});
    }
    for (const WorkerSpec& worker : config.workers) AddWorker(worker);
  } catch (const std::exception& e) {  // ApiError, or anything else that stops the start
    return e.what();
  }
  return {};
}

Service::~Service() {
  StopIngest();
  kvr_ingest_free(ingest_);
  kvr_router_free(router_);
}

void Service::StopIngest() {
  if (ingest_) kvr_ingest_stop(ingest_, nullptr);
}

HttpResponse Service::Handle(const RouteSpec& route, const HttpRequest& request,
                             const std::string& param, RoutingCall* call) {
  try {
    return Dispatch(route.endpoint, request, param, call);
  } catch (const ApiError& e) {
    return ErrorAnswer(e);
  } catch (const std::exception& e) {
    return ErrorAnswer(ApiError(KVR_INTERNAL, e.what()));
  }
}

RoutingCall Service::ArriveRouting(std::function<bool()> client_gone) {
  RoutingCall call;
  call.arrival = bookings_.Arrive();
  call.arrived = Clock::now();
  call.client_gone = std::move(client_gone);
  ++routing_waiting_;
  return call;
}

void Service::DepartRouting(const RoutingCall& call) {
  --(call.started ? routing_running_ : routing_waiting_);
  bookings_.Depart(call.arrival);
}

HttpResponse Service::Dispatch(Endpoint endpoint, const HttpRequest& request,
                               const std::string& param, RoutingCall* call) {
  switch (endpoint) {
    case Endpoint::kRoute:
      return Book(request, /*commit=*/true, call);
    case Endpoint::kPlan:
      return Book(request, /*commit=*/false, call);
    case Endpoint::kPreview:
      return Preview(request);
    case Endpoint::kCommit:
      return Commit(param);
    case Endpoint::kAbort:
      return Abort(param);
    case Endpoint::kPrefillCompleted:
      return PrefillCompleted(param);
    case Endpoint::kOutput:
      return RecordOutput(param, request);
    case Endpoint::kFree:
      return Free(param);
    case Endpoint::kListWorkers:
      return ListWorkers();
    case Endpoint::kGetWorker:
      return GetWorker(param);
    case Endpoint::kGetSession:
      return GetSession(param);
    case Endpoint::kCloseSession:
      return CloseSession(param);
    case Endpoint::kAddWorker:
      return JsonAnswer(AddWorker(WorkerFromJson(ParseJsonObject(request.body))), 201);
    case Endpoint::kUpdateWorker:
      return PutWorker(param, request);
    case Endpoint::kRemoveWorker: {
      const uint64_t id = IdFromPath(param, "worker id");
      RemoveWorker(id);
      return JsonAnswer({{"worker_id", id}});
    }
    case Endpoint::kGetSnapshot:
      return GetSnapshot();
    case Endpoint::kPutSnapshot:
      return PutSnapshot(request);
    case Endpoint::kDigest:
      return Digest();
    case Endpoint::kMetrics:
      return Metrics();
    case Endpoint::kHealthz:
      return Healthz();
  }
  throw ApiError(KVR_INTERNAL, "unhandled endpoint");
}

// route (plan + commit) and plan: idempotent by request id while booked. A call that was freed
// or aborted (by id) after it arrived, whose client left, or that starts while the daemon
// stops, books nothing.
HttpResponse Service::Book(const HttpRequest& request, bool commit, RoutingCall* call) {
  RoutingCall arrived_now;
  if (call == nullptr) {
    arrived_now = ArriveRouting(nullptr);
    call = &arrived_now;
  }
  AtExit depart{[&] {
    if (call == &arrived_now) DepartRouting(arrived_now);
  }};
  if (!call->started) {
    call->started = true;
    --routing_waiting_;
    ++routing_running_;
  }
  RouteInput input = ParseRouteInput(ParseJsonObject(request.body), /*need_request_id=*/true);
  input.Bind();  // a returned object may have been moved: its views point here now
  CapSessionTtl(input);
  const std::string& id = input.request_id;
  // Checked before booking, and again once the id is claimed (the claim may wait for another
  // call booking the same id).
  const auto refuse_if_stale = [&] {
    if (stopping_) throw ApiError(KVR_UNAVAILABLE, "kvrouterd is stopping");
    if (call->client_gone && call->client_gone()) {
      throw ApiError(KVR_CANCELLED,
                     "request '" + id + "': the client closed its connection before it was routed");
    }
  };
  refuse_if_stale();
  // A retry of an id whose first call still books (in the admission queue, perhaps for good)
  // waits for its answer, but no longer than its own queue timeout, nor once its client left.
  // (A timeout past a century has none: the deadline would overflow the clock.)
  constexpr int64_t kLongestDeadlineMs = int64_t{100} * 365 * 24 * 3600 * 1000;
  BookingTable::Wait wait;
  if (input.options.queue_timeout_ms >= 0 && input.options.queue_timeout_ms <= kLongestDeadlineMs) {
    wait.deadline = call->arrived + std::chrono::milliseconds(input.options.queue_timeout_ms);
  }
  // (Not the daemon stopping: as the first call, a retry waits for shutdown-timeout-seconds,
  // then the shutdown's cancellation of the first call's id ends it, 409.)
  wait.abandoned = [&] { return call->client_gone && call->client_gone(); };
  BookingTable::Claimed claimed = bookings_.Claim(id, Clock::now(), call->arrival, wait);
  if (claimed.outcome == BookingTable::Outcome::kReplay) {
    claimed.decision["replayed"] = true;
    return JsonAnswer(claimed.decision);
  }
  if (claimed.outcome == BookingTable::Outcome::kAbandoned) {
    refuse_if_stale();  // throws: the client left
    throw ApiError(KVR_CANCELLED, "request '" + id + "' was abandoned");
  }
  if (claimed.outcome == BookingTable::Outcome::kTimedOut) {
    throw ApiError(KVR_DEADLINE_EXCEEDED,
                   "request '" + id + "': its queue_timeout_ms ran out while an earlier call " +
                       "with the same id was still routing (waiting in the admission queue)");
  }
  const std::string cancelled =
      "request '" + id + "' was freed or aborted before it was routed (it waited for a routing " +
      "thread or in the admission queue)";
  if (claimed.outcome == BookingTable::Outcome::kCancelled) {
    throw ApiError(KVR_CANCELLED, cancelled);
  }
  try {
    const int64_t queue_timeout_ms = input.options.queue_timeout_ms;
    kvr_route_signals signals;
    kvr_route_signals_init(&signals, sizeof signals);
    // A route that waited in the queue says so, though the plan it is answered with did not.
    // (`moved` compares that plan's rank with the preferred one: the last plan's is right.)
    uint32_t queued = 0;
    // A route is planned and committed at once; its worker removed in between (the commit's
    // FAILED_PRECONDITION) leaves it nothing to dispatch to, so it is planned again, at most
    // kMaxReplans times: the caller never planned, and would only route again.
    for (int replans = 0;; ++replans) {
      refuse_if_stale();
      // The queue timeout runs from the arrival: time spent waiting for a routing thread (or
      // for another call of this id, or in an earlier plan) counts. Once spent, the request is
      // routed only if admitted at once.
      if (queue_timeout_ms >= 0) {
        const int64_t waited =
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - call->arrived)
                .count();
        input.options.queue_timeout_ms =
            std::max<int64_t>(0, queue_timeout_ms - std::max<int64_t>(0, waited));
      }
      kvr_error* err = nullptr;
      ThrowIfError(kvr_plan_route(router_, input.tokens(), input.prompt_length(), &input.options,
                                  &input.hints, input.previewed ? &*input.previewed : nullptr,
                                  &signals, &err),
                   err);
      queued |= signals.queued;
      if (!commit) break;
      const Clock::time_point planned_at = Clock::now();
      if (between_plan_and_commit_for_test_) between_plan_and_commit_for_test_(signals.worker_id);
      const kvr_status status = kvr_commit_route(router_, id.c_str(), &err);
      if (status == KVR_OK) {
        kvr_error_free(err);
        break;
      }
      kvr_abort_route(router_, id.c_str(), nullptr, nullptr);
      // No plan to commit (NOT_FOUND): a free or abort of this id took it, and wins over the
      // route; unless, with no cancellation recorded, the plan outlived its deadline before its
      // commit (a stalled thread): then, as a lost worker, it is planned again. (Within the
      // deadline it was freed, even if the table dropped the record for want of room.)
      if (status == KVR_NOT_FOUND && (bookings_.Cancelled(id, call->arrival) ||
                                      Clock::now() - planned_at < Span(plan_deadline_seconds_))) {
        kvr_error_free(err);
        throw ApiError(KVR_CANCELLED, "request '" + id +
                                          "' was freed or aborted while it was routed (between "
                                          "its plan and its commit)");
      }
      if ((status == KVR_FAILED_PRECONDITION || status == KVR_NOT_FOUND) && replans < kMaxReplans) {
        kvr_error_free(err);
        continue;
      }
      if (status == KVR_NOT_FOUND) {
        kvr_error_free(err);
        throw ApiError(KVR_UNAVAILABLE, "request '" + id +
                                            "': its plans outlived plan-deadline-seconds before "
                                            "their commit, three times (routing threads stalled)");
      }
      ThrowIfError(status, err);
    }
    signals.queued = queued;
    json decision = DecisionJson(id, signals, AddressOf(signals.worker_id), false);
    if (!bookings_.Complete(id, decision, signals.worker_id, signals.dp_rank,
                            After(commit ? request_expiry_seconds_ : plan_deadline_seconds_),
                            call->arrival)) {
      // Freed or aborted while it was booking: released here, then the id is free (Fail).
      kvr_abort_route(router_, id.c_str(), nullptr, nullptr);
      throw ApiError(KVR_CANCELLED, cancelled);
    }
    return JsonAnswer(decision);
  } catch (...) {
    bookings_.Fail(id);
    throw;
  }
}

HttpResponse Service::Preview(const HttpRequest& request) {
  RouteInput input = ParseRouteInput(ParseJsonObject(request.body), /*need_request_id=*/false);
  input.Bind();  // a returned object may have been moved: its views point here now
  CapSessionTtl(input);
  kvr_route_signals signals;
  kvr_route_signals_init(&signals, sizeof signals);
  kvr_error* err = nullptr;
  ThrowIfError(kvr_preview_route(router_, input.tokens(), input.prompt_length(), &input.options,
                                 &input.hints, &signals, &err),
               err);
  return JsonAnswer(DecisionJson(input.request_id, signals, AddressOf(signals.worker_id), false));
}

HttpResponse Service::Commit(const std::string& id) {
  kvr_error* err = nullptr;
  ThrowIfError(kvr_commit_route(router_, id.c_str(), &err), err);
  // The router counts a request's expiry from its booking, the plan: so does the table.
  bookings_.Extend(id, Span(request_expiry_seconds_));
  return JsonAnswer(RequestIdAnswer(id));
}

HttpResponse Service::Abort(const std::string& id) {
  // The table first: a call booking this id meanwhile is then caught by its Complete.
  bookings_.Cancel(id);
  kvr_error* err = nullptr;
  int freed = 0;
  ThrowIfError(kvr_abort_route(router_, id.c_str(), &freed, &err), err);
  json answer = RequestIdAnswer(id);
  answer["freed"] = freed != 0;
  return JsonAnswer(answer);
}

HttpResponse Service::PrefillCompleted(const std::string& id) {
  kvr_error* err = nullptr;
  ThrowIfError(kvr_router_mark_prefill_completed(router_, id.c_str(), &err), err);
  return JsonAnswer(RequestIdAnswer(id));
}

HttpResponse Service::RecordOutput(const std::string& id, const HttpRequest& request) {
  const uint64_t tokens = OutputTokensFromJson(ParseJsonObject(request.body));
  kvr_error* err = nullptr;
  ThrowIfError(kvr_router_record_output(router_, id.c_str(), tokens, &err), err);
  return JsonAnswer(RequestIdAnswer(id));
}

// kvr_router_free_request says nothing of what it freed: "freed" is whether the daemon had the
// id booked (every booking of this router is made through the daemon). The table first: a call
// still waiting to book this id (for a routing thread, in the queue) then never books.
HttpResponse Service::Free(const std::string& id) {
  const bool booked = bookings_.Cancel(id);
  kvr_error* err = nullptr;
  ThrowIfError(kvr_router_free_request(router_, id.c_str(), &err), err);
  json answer = RequestIdAnswer(id);
  answer["freed"] = booked;
  return JsonAnswer(answer);
}

HttpResponse Service::ListWorkers() {
  json list = json::array();
  std::lock_guard<std::mutex> lock(workers_mutex_);
  for (const auto& [id, worker] : workers_) list.push_back(WorkerToJson(worker));
  return JsonAnswer({{"workers", list}});
}

HttpResponse Service::GetWorker(const std::string& param) {
  const uint64_t id = IdFromPath(param, "worker id");
  std::lock_guard<std::mutex> lock(workers_mutex_);
  const auto it = workers_.find(id);
  if (it == workers_.end()) throw ApiError(KVR_NOT_FOUND, WorkerNotFound(id));
  return JsonAnswer(WorkerToJson(it->second));
}

HttpResponse Service::PutWorker(const std::string& param, const HttpRequest& request) {
  const uint64_t id = IdFromPath(param, "worker id");
  json body = ParseJsonObject(request.body);
  // As a decimal string: a JSON number is taken up to 2^53 only, and the path's id may be larger.
  if (!body.contains("worker_id") || body["worker_id"].is_null()) {
    body["worker_id"] = std::to_string(id);
  }
  const WorkerSpec worker = WorkerFromJson(body);
  if (worker.worker_id != id) {
    throw ApiError(KVR_INVALID_ARGUMENT, "worker_id: the body's id differs from the path's");
  }
  return JsonAnswer(UpdateWorker(worker));
}

HttpResponse Service::GetSession(const std::string& id) {
  CheckSessionId(id, "session id");
  uint64_t worker_id = 0;
  uint32_t dp_rank = 0;
  kvr_error* err = nullptr;
  ThrowIfError(kvr_router_session_binding(router_, id.c_str(), &worker_id, &dp_rank, &err), err);
  return JsonAnswer({{"session_id", id}, {"worker_id", worker_id}, {"dp_rank", dp_rank}});
}

// kvr_router_close_session says nothing of whether the session was bound: the answer neither.
HttpResponse Service::CloseSession(const std::string& id) {
  CheckSessionId(id, "session id");
  kvr_error* err = nullptr;
  ThrowIfError(kvr_router_close_session(router_, id.c_str(), &err), err);
  return JsonAnswer({{"session_id", id}});
}

// All or nothing: what the library would refuse is checked first; then the worker is
// subscribed to its events, then added to the router (routable only once nothing can fail).
json Service::AddWorker(const WorkerSpec& worker) {
  std::lock_guard<std::mutex> lock(workers_mutex_);
  if (workers_.count(worker.worker_id)) {
    throw ApiError(KVR_ALREADY_EXISTS,
                   "worker " + std::to_string(worker.worker_id) + " is already registered");
  }
  // (Without events the router's own add below is the check, and changes nothing if refused.)
  CheckWorker(worker, /*ranks_too=*/worker.events.has_value());
  Subscribe(worker);
  const kvr_worker_config config = RouterWorker(worker);
  kvr_error* err = nullptr;
  const kvr_status status = kvr_router_add_worker(router_, &config, &err);
  if (status != KVR_OK && worker.events) Unsubscribe(worker.worker_id);
  ThrowIfError(status, err);
  workers_[worker.worker_id] = worker;
  Log(LogLevel::kInfo, "worker added", WorkerToJson(worker));
  return WorkerToJson(worker);
}

// All or nothing: what the library would refuse is checked before anything changes, and a
// change it refuses while being applied (an ipc path too long to connect to, no socket left)
// is undone: the worker is back as it was, with its requests, but for the index entries of the
// engine it was subscribed to (dropped with that subscription; the engine's replay or its
// next events bring them back).
json Service::UpdateWorker(const WorkerSpec& worker) {
  std::lock_guard<std::mutex> lock(workers_mutex_);
  const auto it = workers_.find(worker.worker_id);
  if (it == workers_.end()) throw ApiError(KVR_NOT_FOUND, WorkerNotFound(worker.worker_id));
  const WorkerSpec previous = it->second;
  // Only what changed is touched: a worker whose ranks stay keeps its requests.
  const bool ranks_change = !SameRouterConfig(previous, worker);
  // The subscription covers the worker's ranks: new ranks need a new one too.
  const bool same_ranks =
      previous.dp_start == worker.dp_start && previous.dp_size == worker.dp_size;
  const bool events_change = previous.events != worker.events || (worker.events && !same_ranks);
  if (ranks_change || events_change) CheckWorker(worker, ranks_change);
  // The subscription first: what may still fail, before the router drops any request.
  bool unsubscribed = false;
  if (events_change) {
    try {
      if (previous.events) {
        UnsubscribeOrThrow(worker.worker_id);  // refused: nothing has changed yet
        unsubscribed = true;
      }
      Subscribe(worker);
    } catch (...) {
      it->second = RestoreSubscription(previous, unsubscribed, /*subscribed=*/false);
      throw;
    }
  }
  if (ranks_change) {
    const kvr_worker_config config = RouterWorker(worker);
    kvr_error* err = nullptr;
    const kvr_status status = kvr_router_update_worker(router_, &config, &err);
    if (status != KVR_OK && events_change) {
      it->second = RestoreSubscription(previous, unsubscribed, worker.events.has_value());
    }
    ThrowIfError(status, err);
    // Ranks that disappeared lost their requests in the router: their ids are free again.
    bookings_.DropRanksOutside(worker.worker_id, worker.dp_start, worker.dp_size);
  }
  it->second = worker;
  Log(LogLevel::kInfo, "worker updated", WorkerToJson(worker));
  return WorkerToJson(worker);
}

// A subscription change refused midway, undone: the new subscription (if `subscribed`) goes, the
// previous one (if `unsubscribed`) comes back. Returns the worker as it now is: `previous`,
// without its events should the library refuse them again.
WorkerSpec Service::RestoreSubscription(const WorkerSpec& previous, bool unsubscribed,
                                        bool subscribed) {
  WorkerSpec now = previous;
  if (subscribed) Unsubscribe(previous.worker_id);
  if (unsubscribed) {
    try {
      Subscribe(previous);
    } catch (const std::exception& e) {
      now.events.reset();
      Log(LogLevel::kError, "a worker's refused update left it unsubscribed",
          {{"worker_id", previous.worker_id}, {"error", e.what()}});
    }
  }
  Log(LogLevel::kWarn, "a worker's update was refused midway and undone", WorkerToJson(now));
  return now;
}

void Service::RemoveWorker(uint64_t worker_id) {
  std::lock_guard<std::mutex> lock(workers_mutex_);
  const auto it = workers_.find(worker_id);
  if (it == workers_.end()) throw ApiError(KVR_NOT_FOUND, WorkerNotFound(worker_id));
  // Unsubscribed first, so that no event re-indexes the worker after it is gone (should the
  // router then refuse the removal, the worker stays, as unsubscribed); a refused
  // unsubscription refuses the removal, or the removed worker would stay subscribed for good.
  if (it->second.events) {
    UnsubscribeOrThrow(worker_id);
    it->second.events.reset();
  }
  kvr_error* err = nullptr;
  ThrowIfError(kvr_router_remove_worker(router_, worker_id, &err), err);
  workers_.erase(it);
  bookings_.DropWorker(worker_id);
  Log(LogLevel::kInfo, "worker removed", {{"worker_id", worker_id}});
}

void Service::CheckWorker(const WorkerSpec& worker, bool ranks_too) {
  if (!ranks_too && !worker.events) return;
  kvr_router_options options;
  kvr_router_options_init(&options, sizeof options);
  options.block_size = block_size_;
  LibraryCheck check(&options, nullptr);
  check.Worker(worker, ranks_too);
}

void Service::Subscribe(const WorkerSpec& worker) {
  if (!worker.events) return;
  const EngineWorker engine(worker);
  kvr_error* err = nullptr;
  ThrowIfError(kvr_ingest_add_engine_worker(ingest_, &engine.config, nullptr, &err), err);
}

void Service::UnsubscribeOrThrow(uint64_t worker_id) {
  kvr_error* err = nullptr;
  const kvr_status status = kvr_ingest_remove_engine_worker(ingest_, worker_id, 1, &err);
  if (status == KVR_NOT_FOUND) {  // not subscribed (a subscription refused earlier): none to drop
    kvr_error_free(err);
    return;
  }
  ThrowIfError(status, err);
}

bool Service::Unsubscribe(uint64_t worker_id) {
  kvr_error* err = nullptr;
  const kvr_status status = kvr_ingest_remove_engine_worker(ingest_, worker_id, 1, &err);
  if (status != KVR_OK) {
    Log(LogLevel::kWarn, "unsubscribing a worker's events failed",
        {{"worker_id", worker_id}, {"error", err ? kvr_error_message(err) : ""}});
  }
  kvr_error_free(err);
  return status == KVR_OK;
}

void Service::RestoreSnapshotFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw ApiError(KVR_NOT_FOUND, "cannot read the snapshot file " + path);
  const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  kvr_error* err = nullptr;
  ThrowIfError(kvr_router_restore(router_, bytes.data(), bytes.size(), &err), err);
  Log(LogLevel::kInfo, "restored the KV index from a snapshot",
      {{"file", path}, {"bytes", std::to_string(bytes.size())}});
}

void Service::BootstrapFromPeer(const std::vector<std::string>& peers,
                                std::vector<JetStreamSpec>* streams) {
  for (const std::string& peer : peers) {
    std::string error;
    std::optional<PeerSnapshot> snapshot;
    try {
      snapshot = FetchPeerSnapshot(peer, std::chrono::seconds(30), &error);
    } catch (const std::exception& e) {  // whatever a peer answers, it is only one peer
      error = e.what();
    }
    if (!snapshot) {
      Log(LogLevel::kWarn, "bootstrap: no snapshot from this peer",
          {{"peer", peer}, {"error", error}});
      continue;
    }
    kvr_error* err = nullptr;
    ThrowIfError(kvr_router_restore(router_, snapshot->bytes.data(), snapshot->bytes.size(), &err),
                 err);
    for (JetStreamSpec& spec : *streams) {
      const auto position = snapshot->sequences.find(spec.stream);
      if (position == snapshot->sequences.end()) continue;
      spec.start_sequence = position->second + 1;
      spec.resume = false;  // this router's own consumer stopped elsewhere: replaced
    }
    Log(LogLevel::kInfo, "bootstrap: restored a peer's snapshot",
        {{"peer", peer},
         {"bytes", snapshot->bytes.size()},
         {"stream_sequences", FormatStreamSequences(snapshot->sequences)}});
    return;
  }
  Log(LogLevel::kWarn, "bootstrap: no peer answered; starting cold from the configured positions",
      {{"peers", peers}});
}

namespace {

// `spec` as the C ABI takes it; valid while `spec` lives.
kvr_jetstream_source ToSource(const JetStreamSpec& spec) {
  kvr_jetstream_source source;
  kvr_jetstream_source_init(&source, sizeof source);
  source.url = spec.url.c_str();
  source.stream = spec.stream.c_str();
  source.subject = spec.subject.c_str();
  source.durable = spec.durable.c_str();
  source.start_sequence = spec.start_sequence;
  source.flags =
      (spec.resume ? KVR_JETSTREAM_RESUME : 0u) | (spec.create ? KVR_JETSTREAM_CREATE_STREAM : 0u);
  source.max_age_seconds = spec.max_age_seconds;
  source.max_bytes = spec.max_bytes;
  return source;
}

}  // namespace

void Service::RelayToJetStream(const JetStreamSpec& spec) {
  const kvr_jetstream_source target = ToSource(spec);
  kvr_error* err = nullptr;
  uint64_t source_id = 0;
  ThrowIfError(kvr_ingest_relay_jetstream(ingest_, &target, &source_id, &err), err);
  relay_source_id_ = source_id;
  Log(LogLevel::kInfo, "relaying the index's changes into JetStream",
      {{"url", spec.url}, {"stream", spec.stream}, {"subject", spec.subject + ".<worker id>"}});
}

void Service::SubscribeJetStream(const JetStreamSpec& spec) {
  const kvr_jetstream_source source = ToSource(spec);
  kvr_error* err = nullptr;
  uint64_t source_id = 0;
  ThrowIfError(kvr_ingest_subscribe_jetstream(ingest_, &source, &source_id, &err), err);
  jetstream_sources_.emplace_back(spec.stream, source_id);
  Log(LogLevel::kInfo, "consuming KV events from JetStream",
      {{"url", spec.url},
       {"stream", spec.stream},
       {"subject", spec.subject},
       {"durable", spec.durable}});
}

std::string Service::AddressOf(uint64_t worker_id) {
  std::lock_guard<std::mutex> lock(workers_mutex_);
  const auto it = workers_.find(worker_id);
  return it == workers_.end() ? std::string() : it->second.address;
}

kvr_ingest_stats Service::SourceStats(uint64_t source_id) {
  kvr_ingest_stats stats;
  kvr_ingest_stats_init(&stats, sizeof stats);
  kvr_error* err = nullptr;
  ThrowIfError(kvr_ingest_get_stats(ingest_, source_id, &stats, &err), err);
  return stats;
}

// Each consumed stream's last sequence applied; a stream consumed twice, the lower.
StreamSequences Service::AppliedStreamSequences() {
  StreamSequences sequences;
  for (const auto& [stream, source_id] : jetstream_sources_) {
    const kvr_ingest_stats stats = SourceStats(source_id);
    const auto [it, added] = sequences.emplace(stream, stats.stream_sequence);
    if (!added) it->second = std::min(it->second, stats.stream_sequence);
  }
  return sequences;
}

HttpResponse Service::GetSnapshot() {
  // The positions first: events applied after them and already in the snapshot are applied
  // again, in order, by a replica starting from it, which leaves its index as it was.
  const StreamSequences sequences = AppliedStreamSequences();
  kvr_buffer* buffer = nullptr;
  kvr_error* err = nullptr;
  ThrowIfError(kvr_router_snapshot(router_, &buffer, &err), err);
  HttpResponse response;
  if (!sequences.empty()) {
    response.headers.emplace_back(kStreamSequencesHeader, FormatStreamSequences(sequences));
  }
  response.content_type = "application/octet-stream";
  response.body.assign(reinterpret_cast<const char*>(kvr_buffer_data(buffer)),
                       kvr_buffer_size(buffer));
  kvr_buffer_free(buffer);
  return response;
}

HttpResponse Service::PutSnapshot(const HttpRequest& request) {
  kvr_error* err = nullptr;
  ThrowIfError(kvr_router_restore(router_, request.body.data(), request.body.size(), &err), err);
  Log(LogLevel::kInfo, "snapshot restored", {{"bytes", request.body.size()}});
  return Digest();
}

HttpResponse Service::Digest() {
  uint64_t state = 0, index = 0;
  kvr_error* err = nullptr;
  ThrowIfError(kvr_router_state_digest(router_, &state, &err), err);
  ThrowIfError(kvr_router_index_digest(router_, &index, &err), err);
  const auto hex = [](uint64_t value) {
    char text[17];
    std::snprintf(text, sizeof text, "%016" PRIx64, value);
    return std::string(text);
  };
  return JsonAnswer({{"digest", hex(state)}, {"index_digest", hex(index)}});
}

HttpResponse Service::Metrics() {
  HttpResponse response;
  response.content_type = "text/plain; version=0.0.4; charset=utf-8";
  response.body = PrometheusText(router_, kvr_router_metrics_prometheus) +
                  PrometheusText(ingest_, kvr_ingest_metrics_prometheus) + OwnMetrics();
  return response;
}

std::string Service::OwnMetrics() {
  std::string text =
      "# HELP kvrouterd_http_requests_total HTTP requests answered, by route pattern (unmatched: "
      "none; unparsed: refused as HTTP) and status code.\n# TYPE kvrouterd_http_requests_total "
      "counter\n";
  {
    std::lock_guard<std::mutex> lock(counters_mutex_);
    for (const auto& [key, count] : http_requests_) {
      text += "kvrouterd_http_requests_total{path=\"" + key.first + "\",code=\"" +
              std::to_string(key.second) + "\"} " + std::to_string(count) + "\n";
    }
    text +=
        "# HELP kvrouterd_reloads_total Configuration reloads (SIGHUP), by result.\n"
        "# TYPE kvrouterd_reloads_total counter\n"
        "kvrouterd_reloads_total{result=\"ok\"} " +
        std::to_string(reloads_ok_) + "\n" + "kvrouterd_reloads_total{result=\"error\"} " +
        std::to_string(reloads_failed_) + "\n";
  }
  text +=
      "# HELP kvrouterd_tracked_requests Booked request ids remembered for idempotent retries.\n"
      "# TYPE kvrouterd_tracked_requests gauge\nkvrouterd_tracked_requests " +
      std::to_string(bookings_.size()) + "\n";
  text +=
      "# HELP kvrouterd_routing_calls_waiting Routing calls (route, plan) received and waiting for "
      "a routing thread.\n# TYPE kvrouterd_routing_calls_waiting gauge\n"
      "kvrouterd_routing_calls_waiting " +
      std::to_string(std::max<int64_t>(0, routing_waiting_.load())) + "\n";
  text +=
      "# HELP kvrouterd_routing_calls_running Routing calls (route, plan) on a routing thread: "
      "routing, waiting in the admission queue or for an earlier call of their id.\n"
      "# TYPE kvrouterd_routing_calls_running gauge\nkvrouterd_routing_calls_running " +
      std::to_string(std::max<int64_t>(0, routing_running_.load())) + "\n";
  if (connection_counts_) {
    const ConnectionCounts counts = connection_counts_();
    text +=
        "# HELP kvrouterd_http_connections Open HTTP connections.\n"
        "# TYPE kvrouterd_http_connections gauge\nkvrouterd_http_connections " +
        std::to_string(counts.open) + "\n";
    text +=
        "# HELP kvrouterd_http_connections_refused_total HTTP connections closed as soon as "
        "accepted, max-connections being open.\n"
        "# TYPE kvrouterd_http_connections_refused_total counter\n"
        "kvrouterd_http_connections_refused_total " +
        std::to_string(counts.refused) + "\n";
  }
  std::lock_guard<std::mutex> lock(workers_mutex_);
  text +=
      "# HELP kvrouterd_workers Workers registered.\n# TYPE kvrouterd_workers gauge\n"
      "kvrouterd_workers " +
      std::to_string(workers_.size()) + "\n";
  return text;
}

HttpResponse Service::Healthz() {
  size_t workers = 0;
  {
    std::lock_guard<std::mutex> lock(workers_mutex_);
    workers = workers_.size();
  }
  if (stopping_) return JsonAnswer({{"status", "stopping"}, {"workers", workers}}, 503);
  // Ranks whose cached blocks are unknown (an engine's or NATS connection lost, a gap) are
  // routed on what the index last knew of them (nothing, if they were cleared) until their
  // engines speak again: "degraded", still 200, since routing goes on and a probe failing for
  // it would take every replica out of service at once.
  const uint32_t unknown = RanksStateUnknown();
  return JsonAnswer({{"status", unknown > 0 ? "degraded" : "ok"},
                     {"workers", workers},
                     {"ranks_state_unknown", unknown}});
}

uint32_t Service::RanksStateUnknown() {
  const uint32_t every_source = SourceStats(0).state_unknown;
  const uint32_t relay = relay_source_id_ ? SourceStats(*relay_source_id_).state_unknown : 0;
  return every_source - std::min(every_source, relay);
}

void Service::CountAnswer(const std::string& pattern, int status) {
  std::lock_guard<std::mutex> lock(counters_mutex_);
  ++http_requests_[{pattern, status}];
}

void Service::CountReload(bool ok) {
  std::lock_guard<std::mutex> lock(counters_mutex_);
  ++(ok ? reloads_ok_ : reloads_failed_);
}

size_t Service::ExpireLostRequests() {
  size_t expired = 0;
  if (kvr_router_expire_requests(router_, &expired, nullptr) != KVR_OK) return 0;
  if (expired > 0) {
    Log(LogLevel::kWarn, "dropped requests never freed, past request-expiry-seconds",
        {{"requests", std::to_string(expired)}});
  }
  return expired;
}

void Service::CancelWaiting() {
  for (const std::string& id : bookings_.PendingIds()) {
    // Marked first, so that a call booking it meanwhile releases what it booked.
    if (!bookings_.CancelPending(id)) continue;
    kvr_abort_route(router_, id.c_str(), nullptr, nullptr);
    Log(LogLevel::kWarn, "cancelled a request still waiting at shutdown", {{"request_id", id}});
  }
}

// The config's worker lines applied as a diff against the lines in effect (the previous
// reload's record). Returns the record now: a line applied; for one whose change failed (each
// undone by AddWorker or UpdateWorker), what the worker really is, or nothing if it is not
// registered, so that the next reload compares the file against what runs and tries again.
// `*all_applied` is false if any change failed.
std::vector<WorkerSpec> Service::ApplyWorkerDiff(const std::vector<WorkerSpec>& wanted,
                                                 bool* all_applied) {
  *all_applied = true;
  std::map<uint64_t, WorkerSpec> in_effect;
  for (const WorkerSpec& worker : config_.workers) in_effect[worker.worker_id] = worker;
  std::map<uint64_t, const WorkerSpec*> target;
  for (const WorkerSpec& worker : wanted) target[worker.worker_id] = &worker;
  // Runs `change`; false (logged) if it failed.
  const auto attempt = [&](const char* what, uint64_t id, auto&& change) {
    try {
      change();
      return true;
    } catch (const std::exception& e) {  // ApiError, or the heap refusing: the change undone
      *all_applied = false;
      Log(LogLevel::kError, std::string("reload: ") + what + " failed; it was undone",
          {{"worker_id", id}, {"error", e.what()}});
      return false;
    }
  };
  const auto record_what_runs = [&](uint64_t id) {
    std::lock_guard<std::mutex> lock(workers_mutex_);
    const auto it = workers_.find(id);
    if (it == workers_.end()) {
      in_effect.erase(id);
    } else {
      in_effect[id] = it->second;
    }
  };
  for (auto it = in_effect.begin(); it != in_effect.end();) {
    const uint64_t id = it->first;
    if (target.count(id)) {
      ++it;
      continue;
    }
    ++it;
    const auto remove = [&] {
      try {
        RemoveWorker(id);
      } catch (const ApiError& e) {
        if (e.status() != KVR_NOT_FOUND) throw;  // else removed already (over HTTP), as wanted
      }
    };
    if (attempt("removing a worker", id, remove)) {
      in_effect.erase(id);
    } else {
      record_what_runs(id);
    }
  }
  for (const auto& [id, worker] : target) {
    const auto current = in_effect.find(id);
    if (current == in_effect.end()) {
      // A failed add records nothing: the id may be a worker added over HTTP, left alone.
      if (attempt("adding a worker", id, [&] { AddWorker(*worker); })) in_effect[id] = *worker;
    } else if (!(current->second == *worker)) {
      if (attempt("updating a worker", id, [&] { UpdateWorker(*worker); })) {
        current->second = *worker;
      } else {
        record_what_runs(id);
      }
    }
  }
  std::vector<WorkerSpec> lines;
  for (auto& [id, worker] : in_effect) lines.push_back(std::move(worker));
  return lines;
}

bool Service::Reload(const Config& next) {
  bool all_applied = true;
  std::vector<WorkerSpec> workers = ApplyWorkerDiff(next.workers, &all_applied);
  if (next.log_level != config_.log_level) {
    SetLogLevel(next.log_level);
    Log(LogLevel::kInfo, "log level changed", {{"log_level", LogLevelName(next.log_level)}});
  }
  // Settings that take effect only at start: a change is logged, and what runs is kept in
  // config_, so that the next reload warns again, and one setting them back does not.
  Config applied = next;
  std::vector<std::string> need_restart;
  const auto restart_only = [&](const char* name, auto Config::*... fields) {
    if (((applied.*fields != config_.*fields) || ...)) {
      need_restart.push_back(name);
      ((applied.*fields = config_.*fields), ...);
    }
  };
  // Plain structs of the library, compared byte for byte.
  if (std::memcmp(&next.router, &config_.router, sizeof next.router) != 0 ||
      next.plan_deadline_seconds != config_.plan_deadline_seconds) {
    need_restart.push_back("router options");
    applied.router = config_.router;
    applied.plan_deadline_seconds = config_.plan_deadline_seconds;
  }
  if (std::memcmp(&next.ingest, &config_.ingest, sizeof next.ingest) != 0) {
    need_restart.push_back("ingest options");
    applied.ingest = config_.ingest;
  }
  restart_only("listen", &Config::listen_host, &Config::listen_port);
  restart_only("listen-events", &Config::listen_events);
  restart_only("nats-events", &Config::nats_events);
  restart_only("replica-sync", &Config::replica_sync);
  restart_only("jetstream-events", &Config::jetstream_events);
  restart_only("jetstream-relay", &Config::jetstream_relay);
  restart_only("routing-threads", &Config::routing_threads);
  restart_only("preview-threads", &Config::preview_threads);
  // The HTTP server's limits and timeouts, and the table of tracked ids, are set up once.
  restart_only("max-header-bytes", &Config::max_header_bytes);
  restart_only("max-body-bytes", &Config::max_body_bytes);
  restart_only("max-json-body-bytes", &Config::max_json_body_bytes);
  restart_only("request-read-timeout-seconds", &Config::request_read_timeout_seconds);
  restart_only("idle-timeout-seconds", &Config::idle_timeout_seconds);
  restart_only("max-connections", &Config::max_connections);
  restart_only("max-tracked-requests", &Config::max_tracked_requests);
  restart_only("max-session-ttl-seconds", &Config::max_session_ttl_seconds);
  if (!need_restart.empty()) {
    Log(LogLevel::kWarn, "reload: these settings changed and apply only after a restart",
        {{"settings", need_restart}});
  }
  config_ = std::move(applied);
  config_.workers = std::move(workers);
  if (all_applied) {
    Log(LogLevel::kInfo, "configuration reloaded", {{"workers", config_.workers.size()}});
  } else {
    Log(LogLevel::kError,
        "configuration reloaded in part: the workers whose change failed (logged) are as they "
        "were, and the next reload tries them again",
        {{"workers", config_.workers.size()}});
  }
  return all_applied;
}

}  // namespace kvrouterd

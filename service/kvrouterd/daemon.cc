#include "kvrouterd/daemon.h"

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <memory>
#include <new>
#include <optional>

#include "kvrouterd/log.h"

namespace kvrouterd {
namespace {

constexpr int kSignals[] = {SIGHUP, SIGTERM, SIGINT};

// Once shutdown-timeout-seconds have passed, the requests still being booked are cancelled, and
// again this often: a call may enter the admission queue just after a round.
constexpr uint64_t kCancelRoundMs = 100;
// How often lost requests and plans are expired (the library has no timer of its own).
constexpr uint64_t kExpiryRoundMs = 1000;

// `seconds` as a timer's milliseconds; nullopt for a span no timer needs (infinite, or past
// 2^62 ns: "never"). `seconds` >= 0 (checked at startup).
std::optional<uint64_t> TimerMillis(double seconds) {
  const double ms = seconds * 1000;
  if (!(ms >= 0) || ms >= 4611686018427.0) return std::nullopt;  // 2^62 ns
  return static_cast<uint64_t>(ms);
}

// A routing call handed to the thread pool; answered on the loop when done.
struct OffLoopWork {
  uv_work_t work{};
  Daemon* daemon = nullptr;
  Service* service = nullptr;
  const RouteSpec* route = nullptr;
  HttpRequest request;
  std::string param;
  Responder responder{nullptr};
  HttpResponse response;
  std::optional<RoutingCall> call;  // route and plan
};

}  // namespace

Daemon::Daemon(std::vector<std::string> args, Config config)
    : args_(std::move(args)), config_(std::move(config)) {
  uv_loop_init(&loop_);
}

Daemon::~Daemon() {
  server_.reset();
  quick_calls_.reset();
  uv_loop_close(&loop_);
}

int Daemon::Run() {
  std::string error;
  service_ = Service::Create(config_, &error);
  if (!service_) {
    Log(LogLevel::kError, "cannot start", {{"error", error}});
    return 1;
  }
  HttpLimits limits;
  limits.max_header_bytes = config_.max_header_bytes;
  limits.max_body_bytes = config_.max_body_bytes;
  // Every body is JSON but a snapshot's, and a JSON body costs several times its size parsed.
  limits.body_limit = [max_body = config_.max_body_bytes,
                       max_json = config_.max_json_body_bytes](const HttpRequest& request) {
    if (request.method == "PUT" && request.path == "/v1/snapshot") {
      return BodyLimit{max_body, "max-body-bytes"};
    }
    return max_json < max_body ? BodyLimit{max_json, "max-json-body-bytes"}
                               : BodyLimit{max_body, "max-body-bytes"};
  };
  // A JSON request pipelined behind a busy one is read whole, to start as soon as its turn
  // comes; a snapshot body (up to max-body-bytes, 64 MiB) waits in the kernel's buffers and is
  // read once it is parsed. So a busy connection holds a few MiB of input, not 64.
  limits.max_read_ahead_bytes =
      config_.max_header_bytes + std::min(config_.max_json_body_bytes, config_.max_body_bytes);
  limits.read_timeout_ms = TimerMillis(config_.request_read_timeout_seconds).value_or(0);
  limits.idle_timeout_ms = TimerMillis(config_.idle_timeout_seconds).value_or(0);
  limits.max_connections = config_.max_connections;
  server_ = std::make_unique<HttpServer>(&loop_, limits,
                                         [this](HttpRequest request, Responder responder) {
                                           HandleRequest(std::move(request), std::move(responder));
                                         });
  service_->SetConnectionCounts([this] {
    return ConnectionCounts{server_->connection_count(), server_->connections_refused()};
  });
  server_->SetRefusalCounter([this](int status) { CountContained("unparsed", status); });
  error = server_->Listen(config_.listen_host, config_.listen_port);
  if (error.empty()) error = WritePortFile();
  if (!error.empty()) {
    Log(LogLevel::kError, "cannot start", {{"error", error}});
    server_->Shutdown([] {});
    uv_run(&loop_, UV_RUN_DEFAULT);
    return 1;
  }
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    uv_signal_init(&loop_, &signals_[i]);
    signals_[i].data = this;
    uv_signal_start(
        &signals_[i],
        [](uv_signal_t* handle, int signum) {
          static_cast<Daemon*>(handle->data)->OnSignal(signum);
        },
        kSignals[i]);
  }
  uv_timer_init(&loop_, &shutdown_timer_);
  shutdown_timer_.data = this;
  uv_timer_init(&loop_, &expiry_timer_);
  expiry_timer_.data = this;
  uv_timer_start(
      &expiry_timer_,
      [](uv_timer_t* timer) {
        try {
          static_cast<Daemon*>(timer->data)->service_->ExpireLostRequests();
        } catch (const std::bad_alloc&) {  // its log line; the next round tries again
        }
      },
      kExpiryRoundMs, kExpiryRoundMs);
  quick_calls_ = std::make_unique<QuickCallPool>(&loop_, config_.preview_threads);
  Log(LogLevel::kInfo, "kvrouterd listening",
      {{"host", config_.listen_host},
       {"port", server_->port()},
       {"version", kvr_version_string()}});
  uv_run(&loop_, UV_RUN_DEFAULT);
  service_->StopIngest();
  service_.reset();
  Log(LogLevel::kInfo, "kvrouterd stopped");
  return 0;
}

// Written to a temporary name and renamed, so that a reader never sees a partial port.
std::string Daemon::WritePortFile() {
  if (config_.port_file.empty()) return {};
  const std::string temporary = config_.port_file + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << server_->port() << "\n";
    if (!out) return "port-file: cannot write '" + temporary + "'";
  }
  if (std::rename(temporary.c_str(), config_.port_file.c_str()) != 0) {
    return "port-file: cannot write '" + config_.port_file + "'";
  }
  return {};
}

void Daemon::HandleRequest(HttpRequest request, Responder responder) {
  RouteMatch match;
  try {
    match = MatchRoute(request.method, request.path);
  } catch (const ApiError& e) {  // a path that cannot be decoded (a bad percent-escape, a NUL)
    responder.Respond(ErrorAnswer(e));
    CountContained("unmatched", 400);
    return;
  }
  if (!match.route) {
    HttpResponse response =
        match.miss_status == 405
            ? ErrorResponse(405, "INVALID_ARGUMENT",
                            request.method + " is not allowed on " + request.path)
            : ErrorResponse(404, "NOT_FOUND", "no such path: " + request.path);
    if (match.miss_status == 405) response.headers.emplace_back("Allow", match.allow);
    const int status = response.status;
    responder.Respond(std::move(response));
    CountContained("unmatched", status);
    return;
  }
  switch (match.route->runs) {
    case RouteSpec::Runs::kOnRoutingThread:
      RunOffLoop(*match.route, std::move(request), std::move(match.param), std::move(responder));
      return;
    case RouteSpec::Runs::kOnQuickCallThread:
      RunOnQuickCallThread(*match.route, std::move(request), std::move(match.param),
                           std::move(responder));
      return;
    case RouteSpec::Runs::kOnLoop:
      break;
  }
  Answer(*match.route, service_->Handle(*match.route, request, match.param), responder);
}

void Daemon::RunOffLoop(const RouteSpec& route, HttpRequest request, std::string param,
                        Responder responder) {
  // Owned here until the thread pool takes it: a refusal below (ArriveRouting allocates) frees
  // it, and with it the responder, which then closes nothing it should not.
  auto owned = std::make_unique<OffLoopWork>();
  OffLoopWork* job = owned.get();
  job->work.data = job;
  job->daemon = this;
  job->service = service_.get();
  job->route = &route;
  job->request = std::move(request);
  job->param = std::move(param);
  job->responder = std::move(responder);
  if (route.endpoint == Endpoint::kRoute || route.endpoint == Endpoint::kPlan) {
    // Known from now on, while it waits for a routing thread: a free of its id cancels it.
    job->call = service_->ArriveRouting(job->responder.ClientGoneProbe());
  }
  job->response.status = 500;  // unless Handle answers
  ++work_in_flight_;
  owned.release();  // uv_queue_work allocates nothing: the job is the pool's from here
  uv_queue_work(
      &loop_, &job->work,
      [](uv_work_t* work) {  // on a thread-pool thread: may wait in the admission queue
        auto* job = static_cast<OffLoopWork*>(work->data);
        // Handle answers its own errors; what escapes it (memory refused while answering one)
        // leaves the 500 set below, not an exception in libuv's worker (std::terminate).
        try {
          job->response = job->service->Handle(*job->route, job->request, job->param,
                                               job->call ? &*job->call : nullptr);
        } catch (...) {
        }
      },
      [](uv_work_t* work, int) {  // back on the loop
        std::unique_ptr<OffLoopWork> job(static_cast<OffLoopWork*>(work->data));
        Daemon* daemon = job->daemon;
        if (job->call) daemon->service_->DepartRouting(*job->call);
        daemon->CompleteOffLoop(*job->route, std::move(job->response), job->responder);
      });
}

void Daemon::RunOnQuickCallThread(const RouteSpec& route, HttpRequest request, std::string param,
                                  Responder responder) {
  // Shared by the call and its completion (std::function needs copyable captures).
  struct Call {
    HttpRequest request;
    std::string param;
    Responder responder;
    HttpResponse response;
  };
  // Answered 500 unless the call says otherwise: what escapes Handle (memory refused while
  // answering an error) still gets an answer.
  auto call = std::make_shared<Call>(
      Call{std::move(request), std::move(param), std::move(responder), HttpResponse{}});
  call->response.status = 500;
  Service* service = service_.get();
  quick_calls_->Submit(
      [call, service, &route] {
        call->response = service->Handle(route, call->request, call->param);
      },
      [this, call, &route] { CompleteOffLoop(route, std::move(call->response), call->responder); });
  ++work_in_flight_;  // once submitted: a refused Submit leaves none in flight (stop waits on it)
}

// Answers first, then counts: counting may need memory (a new pattern and status), and the
// client is answered whether or not the heap allows it (the count is then lost).
void Daemon::Answer(const RouteSpec& route, HttpResponse response, Responder& responder) {
  const int status = response.status;
  responder.Respond(std::move(response));
  CountContained(route.pattern, status);
}

void Daemon::CountContained(const std::string& pattern, int status) noexcept {
  try {
    service_->CountAnswer(pattern, status);
  } catch (const std::bad_alloc&) {  // the count is lost, not the daemon
  }
}

void Daemon::CompleteOffLoop(const RouteSpec& route, HttpResponse response, Responder& responder) {
  Answer(route, std::move(response), responder);
  --work_in_flight_;
  MaybeFinish();
}

void Daemon::OnSignal(int signum) {
  if (signum == SIGHUP) {
    // Called from libuv: an exception (a refused allocation) must fail the reload, not end
    // the daemon. What a reload applied before it stays applied, as the workers' table says.
    try {
      ReloadConfig();
    } catch (const std::exception& e) {
      service_->CountReload(false);
      LogContained(LogLevel::kError, "reload: failed partway", "error", e.what());
    }
  } else if (!stopping_) {
    LogContained(LogLevel::kInfo, "stopping", "signal", signum == SIGTERM ? "SIGTERM" : "SIGINT");
    BeginShutdown();
  }
}

void Daemon::ReloadConfig() {
  if (config_.config_file.empty()) {
    Log(LogLevel::kWarn, "SIGHUP: no config file to reload (--config)");
    return;
  }
  Config next;
  std::string error = ParseCommandLine(args_, &next);
  if (error.empty()) error = ValidateConfig(next);
  if (error.empty()) error = CheckLibraryOptions(next);
  if (!error.empty()) {
    service_->CountReload(false);
    Log(LogLevel::kError, "reload: the configuration is invalid; nothing changed",
        {{"error", error}});
    return;
  }
  Log(LogLevel::kInfo, "reloading", {{"config", next.config_file}});
  const bool all_applied = service_->Reload(next);
  service_->CountReload(all_applied);
  config_ = next;
}

// Stop accepting, let the requests in flight finish (cancelling those still queued after
// shutdown-timeout-seconds, and refusing routing calls that had not started), then leave the
// loop: Run() stops the ingest.
void Daemon::BeginShutdown() {
  stopping_ = true;
  service_->BeginShutdown();
  if (const std::optional<uint64_t> timeout_ms = TimerMillis(config_.shutdown_timeout_seconds)) {
    uv_timer_start(
        &shutdown_timer_,
        [](uv_timer_t* timer) {
          // Past shutdown-timeout-seconds nothing is waited for: queued requests are cancelled,
          // and connections still writing or draining closed (each round, as answers complete).
          auto* daemon = static_cast<Daemon*>(timer->data);
          daemon->server_->CloseEveryConnectionNotBusy();  // allocates nothing
          try {
            daemon->service_->CancelWaiting();
          } catch (const std::bad_alloc&) {  // the next round (kCancelRoundMs) tries again
          }
        },
        *timeout_ms, kCancelRoundMs);
  }
  server_->Shutdown([this] {
    server_closed_ = true;
    MaybeFinish();
  });
}

void Daemon::MaybeFinish() {
  if (!stopping_ || !server_closed_ || work_in_flight_ > 0 || finished_) return;
  finished_ = true;
  if (quick_calls_) quick_calls_->Close();  // idle: no call is in flight
  uv_close(reinterpret_cast<uv_handle_t*>(&shutdown_timer_), nullptr);
  uv_close(reinterpret_cast<uv_handle_t*>(&expiry_timer_), nullptr);
  for (uv_signal_t& signal : signals_) uv_close(reinterpret_cast<uv_handle_t*>(&signal), nullptr);
}

}  // namespace kvrouterd

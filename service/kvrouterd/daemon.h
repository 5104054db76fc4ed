// The process around the Service: the libuv loop, the HTTP server, the signals (SIGHUP
// reloads, SIGTERM/SIGINT stop gracefully) and the thread-pool hand-off of routing calls.
#pragma once

#include <uv.h>

#include <memory>
#include <string>
#include <vector>

#include "kvrouterd/http_server.h"
#include "kvrouterd/options.h"
#include "kvrouterd/quick_call_pool.h"
#include "kvrouterd/service.h"

namespace kvrouterd {

class Daemon {
 public:
  // `args` are the command line (without argv[0]), parsed again on every reload.
  Daemon(std::vector<std::string> args, Config config);
  ~Daemon();

  // Runs until stopped by a signal. Returns the process's exit code.
  int Run();

 private:
  void HandleRequest(HttpRequest request, Responder responder);
  void RunOffLoop(const RouteSpec& route, HttpRequest request, std::string param,
                  Responder responder);
  void RunOnQuickCallThread(const RouteSpec& route, HttpRequest request, std::string param,
                            Responder responder);
  // Counts the answer and sends it.
  void Answer(const RouteSpec& route, HttpResponse response, Responder& responder);
  // Counts an answer given (kvrouterd_http_requests_total); the heap refusing the count loses
  // it, not the daemon (called from libuv's callbacks).
  void CountContained(const std::string& pattern, int status) noexcept;
  // The same for a call run off the loop, which then no longer holds up the shutdown.
  void CompleteOffLoop(const RouteSpec& route, HttpResponse response, Responder& responder);
  void OnSignal(int signum);
  void ReloadConfig();
  void BeginShutdown();
  void MaybeFinish();
  std::string WritePortFile();

  std::vector<std::string> args_;
  Config config_;
  uv_loop_t loop_{};
  std::unique_ptr<Service> service_;
  std::unique_ptr<HttpServer> server_;
  std::unique_ptr<QuickCallPool> quick_calls_;
  uv_signal_t signals_[3]{};
  uv_timer_t shutdown_timer_{};
  uv_timer_t expiry_timer_{};  // lost requests and plans: Service::ExpireLostRequests
  bool stopping_ = false;
  bool server_closed_ = false;
  bool finished_ = false;
  size_t work_in_flight_ = 0;  // calls on a routing or quick-call thread
};

}  // namespace kvrouterd

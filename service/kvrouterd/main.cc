// kvrouterd: the kvrouter router as an HTTP/JSON service (docs/kvrouterd.md).
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvrouter.h"
#include "kvrouter_version.h"
#include "kvrouterd/daemon.h"
#include "kvrouterd/log.h"
#include "kvrouterd/options.h"

namespace {

// What the library cannot check for the daemon's own settings.
std::string Validate(const kvrouterd::Config& config) {
  if (config.max_body_bytes == 0) return "max-body-bytes: must be > 0";
  if (config.max_json_body_bytes == 0) return "max-json-body-bytes: must be > 0";
  if (!(config.request_read_timeout_seconds >= 0)) {
    return "request-read-timeout-seconds: must be >= 0";
  }
  if (!(config.idle_timeout_seconds >= 0)) return "idle-timeout-seconds: must be >= 0";
  if (config.max_header_bytes < 1024 || config.max_header_bytes > 80 * 1024) {
    return "max-header-bytes: must be 1024..81920 (http_parser stops at 80 KiB)";
  }
  if (config.max_tracked_requests == 0) return "max-tracked-requests: must be > 0";
  if (!(config.shutdown_timeout_seconds >= 0)) return "shutdown-timeout-seconds: must be >= 0";
  if (config.routing_threads < 1 || config.routing_threads > 1024) {
    return "routing-threads: must be 1..1024";
  }
  if (config.preview_threads < 1 || config.preview_threads > 64) {
    return "preview-threads: must be 1..64";
  }
  if (!config.snapshot_file.empty() && !config.bootstrap_from.empty()) {
    return "snapshot-file and bootstrap-from: one warm start or the other, not both";
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  kvrouterd::Config config;
  std::string error = kvrouterd::ParseCommandLine(args, &config);
  if (error.empty() && !config.help && !config.version) error = Validate(config);
  if (!error.empty()) {
    std::fprintf(stderr, "kvrouterd: %s\n", error.c_str());
    return 2;
  }
  if (config.help) {
    std::fputs(kvrouterd::HelpText().c_str(), stdout);
    return 0;
  }
  if (config.version) {
    std::printf("kvrouterd %s (libkvrouter %s)\n", KVR_VERSION_STRING, kvr_version_string());
    return 0;
  }
  kvrouterd::SetLogLevel(config.log_level);
  // The thread pool runs the routing calls that may wait in the admission queue; its size is
  // read once, when the pool first starts.
  setenv("UV_THREADPOOL_SIZE", std::to_string(config.routing_threads).c_str(), 1);
  std::signal(SIGPIPE, SIG_IGN);  // a client gone mid-answer is an error return, not a signal
  kvrouterd::Daemon daemon(args, config);
  return daemon.Run();
}

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

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  kvrouterd::Config config;
  std::string error = kvrouterd::ParseCommandLine(args, &config);
  if (error.empty() && !config.help && !config.version) error = kvrouterd::ValidateConfig(config);
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

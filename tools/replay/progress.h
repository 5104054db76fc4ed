// Progress of a replay on stderr, from a counter that simulation threads bump: a one-line bar
// redrawn in place when stderr is a terminal, otherwise (a log, a pipe, CI) a plain line every
// `interval` and a last one at the end, so a long run still shows it is moving.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <thread>

namespace kvrouter::replay {

class ProgressBar {
 public:
  static constexpr std::chrono::milliseconds kLineInterval{10'000};

  // Counts up to `total` on `out` (stderr by default; whether it is a terminal picks the form)
  // while alive, on its own thread: the bar every 100 ms, plain lines every `line_interval`.
  ProgressBar(const std::atomic<uint64_t>& done, uint64_t total, std::FILE* out = stderr,
              std::chrono::milliseconds line_interval = kLineInterval);
  ~ProgressBar();  // clears the bar, or prints the last line
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

 private:
  void Draw() const;
  void PrintLine() const;

  const std::atomic<uint64_t>& done_;
  const uint64_t total_;
  std::FILE* const out_;
  const bool terminal_;
  const std::chrono::steady_clock::time_point started_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread painter_;
};

}  // namespace kvrouter::replay

// A one-line progress bar on stderr, drawn only when stderr is a terminal (so logs and pipes stay
// clean), from a counter that simulation threads bump.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace kvrouter::replay {

class ProgressBar {
 public:
  // Counts up to `total`; draws every 100 ms on its own thread while alive.
  ProgressBar(const std::atomic<uint64_t>& done, uint64_t total);
  ~ProgressBar();  // clears the line
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

 private:
  void Draw() const;

  const std::atomic<uint64_t>& done_;
  const uint64_t total_;
  const bool enabled_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread painter_;
};

}  // namespace kvrouter::replay

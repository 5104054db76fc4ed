#include "kvrouter/progress.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace kvrouter::replay {

ProgressBar::ProgressBar(const std::atomic<uint64_t>& done, uint64_t total)
    : done_(done), total_(total), enabled_(isatty(STDERR_FILENO) == 1 && total > 0) {
  if (!enabled_) return;
  painter_ = std::thread([this] {
    std::unique_lock lock(mu_);
    while (!wake_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; })) {
      Draw();
    }
  });
}

ProgressBar::~ProgressBar() {
  if (!enabled_) return;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  painter_.join();
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
}

void ProgressBar::Draw() const {
  constexpr int kWidth = 40;
  const uint64_t done = std::min(done_.load(std::memory_order_relaxed), total_);
  const int filled = static_cast<int>(kWidth * done / total_);
  std::string bar(filled, '#');
  bar.resize(kWidth, '.');
  std::fprintf(stderr, "\rreplaying [%s] %3d%% (%llu/%llu requests)", bar.c_str(),
               static_cast<int>(100 * done / total_), static_cast<unsigned long long>(done),
               static_cast<unsigned long long>(total_));
  std::fflush(stderr);
}

}  // namespace kvrouter::replay

#include "replay/progress.h"

#include <unistd.h>

#include <algorithm>
#include <string>

namespace kvrouter::replay {

ProgressBar::ProgressBar(const std::atomic<uint64_t>& done, uint64_t total, std::FILE* out,
                         std::chrono::milliseconds line_interval)
    : done_(done),
      total_(total),
      out_(out),
      terminal_(isatty(fileno(out)) == 1),
      started_(std::chrono::steady_clock::now()) {
  if (total_ == 0) return;
  const auto interval = terminal_ ? std::chrono::milliseconds(100) : line_interval;
  painter_ = std::thread([this, interval] {
    std::unique_lock lock(mu_);
    while (!wake_.wait_for(lock, interval, [this] { return stop_; })) {
      if (terminal_) {
        Draw();
      } else {
        PrintLine();
      }
    }
  });
}

ProgressBar::~ProgressBar() {
  if (total_ == 0) return;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  painter_.join();
  if (terminal_) {
    std::fprintf(out_, "\r\033[K");
  } else {
    PrintLine();
  }
  std::fflush(out_);
}

void ProgressBar::Draw() const {
  constexpr int kWidth = 40;
  const uint64_t done = std::min(done_.load(std::memory_order_relaxed), total_);
  const int filled = static_cast<int>(kWidth * done / total_);
  std::string bar(filled, '#');
  bar.resize(kWidth, '.');
  std::fprintf(out_, "\rreplaying [%s] %3d%% (%llu/%llu requests)", bar.c_str(),
               static_cast<int>(100 * done / total_), static_cast<unsigned long long>(done),
               static_cast<unsigned long long>(total_));
  std::fflush(out_);
}

void ProgressBar::PrintLine() const {
  const uint64_t done = std::min(done_.load(std::memory_order_relaxed), total_);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  std::fprintf(out_, "replaying: %llu/%llu requests (%d %%), %.0f s\n",
               static_cast<unsigned long long>(done), static_cast<unsigned long long>(total_),
               static_cast<int>(100 * done / total_), seconds);
  std::fflush(out_);
}

}  // namespace kvrouter::replay

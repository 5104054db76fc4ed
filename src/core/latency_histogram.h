// A fixed-bucket latency histogram that many threads record into without a lock, read as
// Prometheus reads one: cumulative counts per upper bound, a total count and a sum.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "core/clock.h"

namespace kvrouter {

class LatencyHistogram {
 public:
  // Upper bounds, rising: 0.5 µs to 10 ms in 1-2.5-5 steps, where routing decisions fall (a
  // preview on a small index takes well under a microsecond, hashing a 100k-token prompt
  // about a tenth of a millisecond); slower ones only count in the total.
  static constexpr std::array<Nanos, 14> kBoundsNanos = {
      500,     1'000,   2'500,   5'000,     10'000,    25'000,    50'000,
      100'000, 250'000, 500'000, 1'000'000, 2'500'000, 5'000'000, 10'000'000};
  static constexpr size_t kBuckets = kBoundsNanos.size();

  struct Snapshot {
    std::array<uint64_t, kBuckets> at_most{};  // cumulative: samples <= kBoundsNanos[i]
    uint64_t count = 0;                        // every sample (the +Inf bucket)
    uint64_t sum_nanos = 0;
  };

  // Thread-safe. A negative duration (a clock that went back) counts as 0.
  void Record(Nanos duration) {
    const uint64_t nanos = duration > 0 ? static_cast<uint64_t>(duration) : 0;
    size_t bucket = 0;
    while (bucket < kBuckets && static_cast<uint64_t>(kBoundsNanos[bucket]) < nanos) ++bucket;
    if (bucket < kBuckets) buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_relaxed);
    sum_nanos_.fetch_add(nanos, std::memory_order_relaxed);
  }

  // Thread-safe; concurrent records may be seen in some fields and not yet in others.
  Snapshot Read() const {
    Snapshot s;
    uint64_t running = 0;
    for (size_t i = 0; i < kBuckets; ++i) {
      running += buckets_[i].load(std::memory_order_relaxed);
      s.at_most[i] = running;
    }
    s.sum_nanos = sum_nanos_.load(std::memory_order_relaxed);
    // Never below the last bucket, so the exposition stays monotonic while records race.
    s.count = std::max(count_.load(std::memory_order_relaxed), running);
    return s;
  }

 private:
  std::array<std::atomic<uint64_t>, kBuckets> buckets_{};  // samples in (bound[i-1], bound[i]]
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_nanos_{0};
};

}  // namespace kvrouter

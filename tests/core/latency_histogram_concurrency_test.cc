// Records from several threads at once (run under ThreadSanitizer in CI).
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "core/latency_histogram.h"

namespace kvrouter {
namespace {

TEST(LatencyHistogramTest, ConcurrentRecordsAreAllCounted) {
  LatencyHistogram h;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&h, t] {
      for (int i = 0; i < 10'000; ++i) h.Record(1'000 * t);
    });
  }
  for (auto& thread : threads) thread.join();
  const LatencyHistogram::Snapshot s = h.Read();
  EXPECT_EQ(s.count, 40'000u);
  EXPECT_EQ(s.at_most[0], 10'000u);  // t = 0
  EXPECT_EQ(s.at_most[1], 20'000u);  // t = 1: 1 µs
  EXPECT_EQ(s.at_most[2], 30'000u);  // t = 2: under 2.5 µs
  EXPECT_EQ(s.at_most[3], 40'000u);  // t = 3: under 5 µs
  EXPECT_EQ(s.sum_nanos, 10'000u * (0 + 1'000 + 2'000 + 3'000));
}

}  // namespace
}  // namespace kvrouter

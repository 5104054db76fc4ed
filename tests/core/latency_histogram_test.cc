#include "core/latency_histogram.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

TEST(LatencyHistogramTest, EachSampleCountsInEveryBucketAtOrAboveIt) {
  LatencyHistogram h;
  h.Record(500);                                        // on the first bound: in it
  h.Record(501);                                        // just past it: the second
  h.Record(7'000);                                      // between 5 µs and 10 µs
  h.Record(-3);                                         // a clock that went back: 0
  h.Record(LatencyHistogram::kBoundsNanos.back() + 1);  // past the last bound: the total only
  const LatencyHistogram::Snapshot s = h.Read();
  EXPECT_EQ(s.at_most[0], 2u);  // 500 and 0
  EXPECT_EQ(s.at_most[1], 3u);  // + 501
  EXPECT_EQ(s.at_most[3], 3u);  // 5 µs: not yet 7 µs
  EXPECT_EQ(s.at_most[4], 4u);  // 10 µs
  EXPECT_EQ(s.at_most.back(), 4u);
  EXPECT_EQ(s.count, 5u);
  EXPECT_EQ(s.sum_nanos, 500u + 501u + 7'000u + 0u + 10'000'001u);
}

TEST(LatencyHistogramTest, BoundsRise) {
  for (size_t i = 1; i < LatencyHistogram::kBuckets; ++i) {
    EXPECT_LT(LatencyHistogram::kBoundsNanos[i - 1], LatencyHistogram::kBoundsNanos[i]);
  }
}

}  // namespace
}  // namespace kvrouter

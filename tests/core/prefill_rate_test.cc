#include "core/prefill_rate.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

TEST(PrefillRateTest, UnknownUntilTheFirstCompletionUnlessAPriorIsGiven) {
  EXPECT_EQ(PrefillRate().tokens_per_second(), 0);
  EXPECT_EQ(PrefillRate(20'000).tokens_per_second(), 20'000);
}

TEST(PrefillRateTest, TheRateIsTheRatioOfTheSamplesSums) {
  PrefillRate rate(1'000);  // the prior gives way to the first sample
  rate.Add(8'000, 2.0);
  EXPECT_DOUBLE_EQ(rate.tokens_per_second(), 4'000);
  // A long prefill weighs more than a short one: (8,000 + 100) / (2 + 1) ≈ 2,700, not the mean
  // of 4,000 and 100 tokens/s.
  rate.Add(100, 1.0);
  EXPECT_NEAR(rate.tokens_per_second(), 8'100 / 3.0, 10);
}

TEST(PrefillRateTest, RecentSamplesOutweighOldOnes) {
  PrefillRate rate;
  for (int i = 0; i < 1'000; ++i) rate.Add(10'000, 1.0);
  EXPECT_NEAR(rate.tokens_per_second(), 10'000, 1e-6);
  for (int i = 0; i < 512; ++i) rate.Add(2'000, 1.0);  // the fleet slowed down
  EXPECT_LT(rate.tokens_per_second(), 4'000);
}

TEST(PrefillRateTest, SamplesWithoutWorkOrTimeAreIgnored) {
  PrefillRate rate(500);
  rate.Add(0, 1.0);
  rate.Add(100, 0);
  rate.Add(100, -1);
  EXPECT_EQ(rate.tokens_per_second(), 500);
}

}  // namespace
}  // namespace kvrouter

#include "core/prefill_rate.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

TEST(PrefillRatesTest, UnknownUntilTheFirstCompletionUnlessAPriorIsGiven) {
  const RateSamples rank = PrefillRates::NewRank();
  EXPECT_EQ(PrefillRates().RateOf(rank), 0);
  EXPECT_EQ(PrefillRates(20'000).RateOf(rank), 20'000);
  EXPECT_EQ(PrefillRates(20'000).fleet_rate(), 20'000);
}

TEST(PrefillRatesTest, ARankWithManySamplesIsPricedAtItsOwnRate) {
  PrefillRates rates(1'000);
  RateSamples fast = PrefillRates::NewRank();
  RateSamples slow = PrefillRates::NewRank();
  for (int i = 0; i < 200; ++i) {
    rates.Add(fast, 20'000, 1.0);  // 20k tokens/s
    rates.Add(slow, 5'000, 1.0);   // 5k tokens/s
  }
  EXPECT_NEAR(rates.fleet_rate(), 12'500, 50);  // the last sample (slow) weighs most
  // Shrunk towards the fleet by kFleetPriorSamples of its mean sample, against ~16 of its own.
  EXPECT_GT(rates.RateOf(fast), 18'000);
  EXPECT_LT(rates.RateOf(slow), 6'500);
  EXPECT_GT(rates.RateOf(fast), rates.RateOf(slow));
}

TEST(PrefillRatesTest, ARankWithoutSamplesBorrowsTheFleetRate) {
  PrefillRates rates;
  RateSamples seen = PrefillRates::NewRank();
  const RateSamples unseen = PrefillRates::NewRank();
  rates.Add(seen, 8'000, 2.0);
  EXPECT_DOUBLE_EQ(rates.RateOf(unseen), 4'000);
  EXPECT_DOUBLE_EQ(rates.RateOf(seen), 4'000);
}

TEST(PrefillRatesTest, RecentSamplesOutweighOldOnes) {
  PrefillRates rates;
  RateSamples rank = PrefillRates::NewRank();
  for (int i = 0; i < 100; ++i) rates.Add(rank, 10'000, 1.0);
  const double before = rates.RateOf(rank);
  for (int i = 0; i < 32; ++i) rates.Add(rank, 2'000, 1.0);  // the rank slowed down
  EXPECT_NEAR(before, 10'000, 1);
  EXPECT_LT(rates.RateOf(rank), 5'000);
}

TEST(PrefillRatesTest, SamplesWithoutWorkOrTimeAreIgnored) {
  PrefillRates rates;
  RateSamples rank = PrefillRates::NewRank();
  rates.Add(rank, 0, 1.0);
  rates.Add(rank, 100, 0);
  rates.Add(rank, 100, -1);
  EXPECT_TRUE(rank.empty());
  EXPECT_EQ(rates.RateOf(rank), 0);
}

}  // namespace
}  // namespace kvrouter

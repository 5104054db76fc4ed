// ReplicaLiveness alone: which origins are tracked, expired, remembered as expired, and when
// one heard again is to be asked to announce its bookings.
#include "core/replica_liveness.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>

namespace kvrouter {
namespace {

constexpr Nanos kSecond = kNanosPerSecond;
constexpr Nanos kTimeout = 10 * kSecond;

// `n` origins beat at `now`, then fall silent past the timeout: all expired.
void ExpireOrigins(ReplicaLiveness& liveness, int first, int n, Nanos& now) {
  for (int i = first; i < first + n; ++i) liveness.Beat("r" + std::to_string(i), kSecond, now);
  now += kTimeout + kSecond;
  ASSERT_EQ(liveness.TakeSilent(now, kTimeout).size(), static_cast<size_t>(n));
}

// A timeout given in seconds past int64 nanoseconds (a caller's "never") converts to the longest
// duration, not to an out-of-range value (it became INT64_MIN, and three heartbeat intervals
// were left as the timeout).
TEST(ReplicaLivenessTest, ATimeoutOfSecondsBeyondNanosecondsExpiresNothing) {
  EXPECT_EQ(SecondsToNanos(1e10), kLongestNanos);
  EXPECT_EQ(SecondsToNanos(1.7e308), kLongestNanos);
  EXPECT_EQ(SecondsToNanos(-1e300), -kLongestNanos);
  EXPECT_EQ(SecondsToNanos(std::numeric_limits<double>::quiet_NaN()), 0);
  EXPECT_EQ(SecondsToNanos(1.5), 1'500'000'000);
  ReplicaLiveness liveness;
  liveness.Beat("r0", kSecond, kSecond);
  const Nanos later = kSecond + 100 * kSecond;
  EXPECT_TRUE(liveness.TakeSilent(later, SecondsToNanos(1e10)).empty());
  EXPECT_EQ(liveness.TakeSilent(later, kTimeout).size(), 1u);
}

// Without expiry, replica ids that change at every restart would be tracked for ever: past
// kTracked the longest silent one goes.
TEST(ReplicaLivenessTest, TheOriginsTrackedAreBounded) {
  ReplicaLiveness liveness;
  Nanos now = kSecond;
  for (size_t i = 0; i < ReplicaLiveness::kTracked + 10; ++i) {
    liveness.Beat("r" + std::to_string(i), kSecond, now);
    now += kSecond;
  }
  EXPECT_EQ(liveness.live(), ReplicaLiveness::kTracked);
  // The first ten, silent longest, went: past the timeout only the next ones are silent.
  const std::vector<std::string> silent = liveness.TakeSilent(now + kTimeout, kTimeout);
  EXPECT_EQ(std::count(silent.begin(), silent.end(), "r0"), 0);
  EXPECT_EQ(std::count(silent.begin(), silent.end(), "r10"), 1);
}

TEST(ReplicaLivenessTest, AnExpiredOriginHeardAgainIsAskedUntilItAnnounces) {
  ReplicaLiveness liveness;
  Nanos now = kSecond;
  ExpireOrigins(liveness, 0, 1, now);
  EXPECT_TRUE(liveness.Beat("r0", kSecond, now));   // heard again: ask
  EXPECT_FALSE(liveness.Beat("r0", kSecond, now));  // asked just now
  now += 3 * kSecond + 1;
  EXPECT_TRUE(liveness.Beat("r0", kSecond, now));          // no announcement in three intervals
  liveness.Restarted("r0", /*promises_heartbeats=*/true);  // its Reset: it announced
  now += 10 * kSecond;
  EXPECT_FALSE(liveness.Beat("r0", kSecond, now));
  EXPECT_FALSE(liveness.Beat("never-expired", kSecond, now));
}

TEST(ReplicaLivenessTest, AResetWithoutAnIntervalStopsTracking) {
  ReplicaLiveness liveness;
  liveness.Beat("r0", kSecond, kSecond);
  ASSERT_EQ(liveness.live(), 1u);
  liveness.Restarted("r0", /*promises_heartbeats=*/false);  // its farewell
  EXPECT_EQ(liveness.live(), 0u);
  EXPECT_TRUE(liveness.TakeSilent(100 * kSecond, kTimeout).empty());
}

// Past kRemembered, the origins expired first are forgotten first: one expired last is still
// asked when it comes back.
TEST(ReplicaLivenessTest, TheOriginsExpiredFirstAreForgottenFirst) {
  ReplicaLiveness liveness;
  Nanos now = kSecond;
  ExpireOrigins(liveness, 0, 1, now);
  ExpireOrigins(liveness, 1, ReplicaLiveness::kRemembered, now);  // one more than remembered
  EXPECT_FALSE(liveness.Beat("r0", kSecond, now));                // forgotten: the oldest
  EXPECT_TRUE(liveness.Beat("r1", kSecond, now));
  EXPECT_TRUE(liveness.Beat("r" + std::to_string(ReplicaLiveness::kRemembered), kSecond, now));
}

}  // namespace
}  // namespace kvrouter

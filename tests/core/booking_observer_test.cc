// BookingObserver alone: tokens name one installation, a stale token clears nothing, clearing
// keeps the replica id, and replicas' bookings are never passed on.
#include "core/booking_observer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvrouter {
namespace {

SequenceChange Freed(std::string_view request_id) {
  return {.kind = SequenceChange::Kind::kFreed, .request_id = request_id};
}

TEST(BookingObserverTest, NotifiesTheCurrentObserverOfLocalBookingsOnly) {
  BookingObserver observer;
  observer.Notify(Freed("before"));  // nobody listens: nothing happens
  EXPECT_FALSE(observer.active());
  std::vector<std::string> seen;
  observer.Set("a", [&](const SequenceChange& c) { seen.emplace_back(c.request_id); });
  EXPECT_TRUE(observer.active());
  observer.Notify(Freed("local"));
  const std::string replica_booking = std::string(1, kReplicaRequestIdMark) + "b\x1fx";
  observer.Notify(Freed(replica_booking));
  EXPECT_EQ(seen, std::vector<std::string>{"local"});
}

TEST(BookingObserverTest, AStaleTokenDoesNotClearANewerObserver) {
  BookingObserver observer;
  int first = 0;
  int second = 0;
  const uint64_t old_token = observer.Set("a", [&](const SequenceChange&) { ++first; });
  const uint64_t new_token = observer.Set("a", [&](const SequenceChange&) { ++second; });
  EXPECT_NE(old_token, 0u);
  EXPECT_NE(new_token, old_token);
  EXPECT_FALSE(observer.Clear(old_token));
  EXPECT_FALSE(observer.Clear(0));
  observer.Notify(Freed("r"));
  EXPECT_EQ(first, 0);
  EXPECT_EQ(second, 1);
  EXPECT_TRUE(observer.Clear(new_token));
  EXPECT_FALSE(observer.Clear(new_token));
  observer.Notify(Freed("r"));
  EXPECT_EQ(second, 1);
}

TEST(BookingObserverTest, StoppingKeepsTheReplicaIdForEchoes) {
  BookingObserver observer;
  EXPECT_FALSE(observer.IsOwnOrigin("a"));
  observer.Set("a", [](const SequenceChange&) {});
  EXPECT_TRUE(observer.IsOwnOrigin("a"));
  EXPECT_EQ(observer.Set("ignored", nullptr), 0u);  // an empty observer stops publishing
  EXPECT_FALSE(observer.active());
  EXPECT_TRUE(observer.IsOwnOrigin("a"));
  EXPECT_FALSE(observer.IsOwnOrigin("ignored"));
  observer.Set("b", [](const SequenceChange&) {});
  EXPECT_TRUE(observer.IsOwnOrigin("b"));
  EXPECT_FALSE(observer.IsOwnOrigin("a"));
}

}  // namespace
}  // namespace kvrouter

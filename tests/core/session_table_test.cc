// SessionTable alone: binding, how a binding steers a request in each mode, sliding TTLs,
// reclaiming, and a digest that does not depend on the order bindings were made in.
#include "core/session_table.h"

#include <gtest/gtest.h>

#include <optional>

#include "core/clock.h"

namespace kvrouter {
namespace {

constexpr WorkerKey kBound{1, 0};
constexpr WorkerKey kOther{2, 0};

class SessionTableTest : public ::testing::Test {
 protected:
  // Steers a request of `session` and returns the pin and the preference it ends up with.
  struct Steered {
    std::optional<WorkerPin> pin;
    std::optional<WorkerKey> preferred;
  };
  Steered Steer(std::string_view session, SessionMode mode, bool use, bool usable = true,
                Steered request = {}) {
    table_.Steer(
        session, mode, use, [usable](WorkerKey) { return usable; }, request.pin,
        request.preferred);
    return request;
  }

  ManualClock clock_;
  SessionTable table_{clock_};
};

TEST_F(SessionTableTest, AHardBindingPinsAndASoftOnePrefers) {
  table_.Bind("s", kBound, 10);
  const Steered hard = Steer("s", SessionMode::kHard, /*use=*/true);
  ASSERT_TRUE(hard.pin.has_value());
  EXPECT_EQ(hard.pin->worker_id, kBound.worker_id);
  EXPECT_EQ(hard.pin->dp_rank, kBound.dp_rank);
  EXPECT_FALSE(hard.preferred.has_value());

  const Steered soft = Steer("s", SessionMode::kSoft, /*use=*/true);
  EXPECT_FALSE(soft.pin.has_value());
  EXPECT_EQ(soft.preferred, kBound);

  // What the request brings outranks the binding.
  const Steered pinned = Steer("s", SessionMode::kHard, true, true, {.pin = WorkerPin{2}});
  EXPECT_EQ(pinned.pin->worker_id, 2u);
  const Steered preferring = Steer("s", SessionMode::kSoft, true, true, {.preferred = kOther});
  EXPECT_EQ(preferring.preferred, kOther);

  // An unknown session or none steers nothing.
  EXPECT_FALSE(Steer("t", SessionMode::kHard, true).pin.has_value());
  EXPECT_FALSE(Steer("", SessionMode::kHard, true).pin.has_value());
}

TEST_F(SessionTableTest, AnUnusableRankDropsAHardBindingOnlyWhenUsed) {
  table_.Bind("s", kBound, 10);
  // A soft binding to a rank the request may not use is no preference, and stays.
  EXPECT_FALSE(Steer("s", SessionMode::kSoft, true, /*usable=*/false).preferred.has_value());
  EXPECT_EQ(table_.size(), 1u);
  // Without `use` (a preview) a hard binding stays too.
  EXPECT_FALSE(Steer("s", SessionMode::kHard, /*use=*/false, /*usable=*/false).pin.has_value());
  EXPECT_EQ(table_.Binding("s"), kBound);
  // With it the binding goes: the dispatch rebinds the session.
  EXPECT_FALSE(Steer("s", SessionMode::kHard, /*use=*/true, /*usable=*/false).pin.has_value());
  EXPECT_FALSE(table_.Binding("s").has_value());
  EXPECT_EQ(table_.size(), 0u);
}

TEST_F(SessionTableTest, TtlsSlideWithUseButNotWithAPreview) {
  table_.Bind("s", kBound, 10);
  clock_.AdvanceSeconds(8);
  Steer("s", SessionMode::kSoft, /*use=*/false);  // a preview does not restart the TTL
  Steer("s", SessionMode::kSoft, /*use=*/true);   // a routed request does
  clock_.AdvanceSeconds(8);
  EXPECT_EQ(table_.Binding("s"), kBound);  // 16 s after binding, 8 after the last use
  clock_.AdvanceSeconds(2);
  EXPECT_FALSE(table_.Binding("s").has_value());  // expired: invisible at once
  EXPECT_EQ(table_.size(), 1u);                   // and gone once reclaimed
  EXPECT_FALSE(Steer("s", SessionMode::kSoft, true).preferred.has_value());
  EXPECT_EQ(table_.size(), 0u);
}

TEST_F(SessionTableTest, ReclaimDropsOnlyExpiredBindingsAndCloseDropsOne) {
  table_.Bind("short", kBound, 1);
  table_.Bind("long", kOther, 100);
  table_.Bind("closed", kOther, 100);
  EXPECT_TRUE(table_.Close("closed"));
  EXPECT_FALSE(table_.Close("closed"));
  clock_.AdvanceSeconds(2);
  EXPECT_EQ(table_.Reclaim(), 1u);
  EXPECT_EQ(table_.size(), 1u);
  EXPECT_EQ(table_.Binding("long"), kOther);
}

TEST_F(SessionTableTest, TheDigestIsOrderIndependentAndSeesEveryField) {
  SessionTable other(clock_);
  table_.Bind("a", kBound, 5);
  table_.Bind("b", kOther, 5);
  other.Bind("b", kOther, 5);
  other.Bind("a", kBound, 5);
  EXPECT_EQ(table_.StateDigest(), other.StateDigest());
  other.Bind("a", kOther, 5);  // rebound elsewhere
  EXPECT_NE(table_.StateDigest(), other.StateDigest());
  other.Bind("a", kBound, 6);  // another TTL
  EXPECT_NE(table_.StateDigest(), other.StateDigest());
  other.Bind("a", kBound, 5);
  EXPECT_EQ(table_.StateDigest(), other.StateDigest());
  clock_.AdvanceSeconds(1);
  Steer("a", SessionMode::kSoft, /*use=*/true);  // a use moves the last-used time
  EXPECT_NE(table_.StateDigest(), other.StateDigest());
}

}  // namespace
}  // namespace kvrouter

// PlanTable alone: deadlines fixed when a plan is made, exact due checks, expiry that names
// each dropped plan, replacing a plan, and a digest that does not depend on insertion order.
#include "core/plan_table.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/types.h"

namespace kvrouter {
namespace {

struct Decision {
  WorkerKey worker;
};
using Table = PlanTable<std::string, Decision>;

constexpr Nanos kDeadline = 10;

TEST(PlanTableTest, APlanIsDueItsDeadlineAfterItWasMade) {
  Table table(kDeadline);
  table.Add("a", {.worker = {1, 0}}, /*now=*/100, std::make_unique<std::string>("payload"));
  const Table::Entry* plan = table.Find("a");
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(plan->decision.worker, (WorkerKey{1, 0}));
  EXPECT_EQ(*plan->payload, "payload");
  EXPECT_FALSE(plan->DueAt(109));
  EXPECT_TRUE(plan->DueAt(110));
  EXPECT_EQ(table.Find("b"), nullptr);

  // A new deadline applies to plans made from now on only.
  table.set_deadline(kDeadline * 10);
  table.Add("b", {}, 100, nullptr);
  EXPECT_TRUE(table.Find("a")->DueAt(110));
  EXPECT_FALSE(table.Find("b")->DueAt(110));
  EXPECT_EQ(table.deadline(), kDeadline * 10);
}

TEST(PlanTableTest, ExpiryDropsOnlyDuePlansAndNamesEach) {
  Table table(kDeadline);
  table.Add("early", {}, 0, nullptr);
  table.Add("late", {}, 5, nullptr);
  std::vector<std::string> expired;
  EXPECT_EQ(table.ExpireDue(9, [&](std::string_view id) { expired.emplace_back(id); }), 0u);
  EXPECT_EQ(table.ExpireDue(10, [&](std::string_view id) { expired.emplace_back(id); }), 1u);
  EXPECT_EQ(expired, std::vector<std::string>{"early"});
  EXPECT_EQ(table.size(), 1u);
  EXPECT_NE(table.Find("late"), nullptr);
}

TEST(PlanTableTest, AddingAgainReplacesAndEraseSaysWhetherThereWasOne) {
  Table table(kDeadline);
  table.Add("a", {.worker = {1, 0}}, 0, nullptr);
  table.Add("a", {.worker = {2, 0}}, 50, nullptr);
  EXPECT_EQ(table.size(), 1u);
  EXPECT_EQ(table.Find("a")->decision.worker.worker_id, 2u);
  EXPECT_FALSE(table.Find("a")->DueAt(59));
  EXPECT_TRUE(table.Erase("a"));
  EXPECT_FALSE(table.Erase("a"));
  EXPECT_EQ(table.size(), 0u);
}

TEST(PlanTableTest, TheDigestIsOrderIndependentAndSeesWorkerAndDeadline) {
  Table one(kDeadline);
  Table two(kDeadline);
  one.Add("a", {.worker = {1, 0}}, 0, nullptr);
  one.Add("b", {.worker = {2, 0}}, 0, nullptr);
  two.Add("b", {.worker = {2, 0}}, 0, nullptr);
  two.Add("a", {.worker = {1, 0}}, 0, nullptr);
  EXPECT_EQ(one.StateDigest(), two.StateDigest());
  two.Add("a", {.worker = {1, 1}}, 0, nullptr);
  EXPECT_NE(one.StateDigest(), two.StateDigest());
  two.Add("a", {.worker = {1, 0}}, 1, nullptr);
  EXPECT_NE(one.StateDigest(), two.StateDigest());
  two.Add("a", {.worker = {1, 0}}, 0, nullptr);
  EXPECT_EQ(one.StateDigest(), two.StateDigest());
}

}  // namespace
}  // namespace kvrouter

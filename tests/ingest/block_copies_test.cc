#include "ingest/block_copies.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

// vLLM's copies of one block (a fully cached prompt's recomputed last block): each removal
// takes a copy; the last one is the block's. Per rank and tier; a rank's clear forgets them.
TEST(BlockCopies, EachRemovalTakesACopyUntilTheLast) {
  BlockCopies copies;
  const WorkerKey r0{1, 0}, r1{1, 1};
  copies.Add(r0, Tier::kDevice, 42);
  copies.Add(r0, Tier::kDevice, 42);
  copies.Add(r1, Tier::kDevice, 42);
  EXPECT_FALSE(copies.TakeExtra(r0, Tier::kHostPinned, 42));  // another tier: no copy
  EXPECT_TRUE(copies.TakeExtra(r0, Tier::kDevice, 42));
  EXPECT_TRUE(copies.TakeExtra(r0, Tier::kDevice, 42));
  EXPECT_FALSE(copies.TakeExtra(r0, Tier::kDevice, 42));  // the block itself
  EXPECT_EQ(copies.size(), 1u);
  copies.ForgetRank(r1);
  EXPECT_EQ(copies.size(), 0u);
  EXPECT_FALSE(copies.TakeExtra(r1, Tier::kDevice, 42));
}

}  // namespace
}  // namespace kvrouter

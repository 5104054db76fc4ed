// The C ABI when the heap refuses memory, in a binary whose operator new refuses on cue
// (tests/core/refusing_operator_new.h): what must never happen then is a crash or an error
// object that points at freed memory.
#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "kvrouter.h"
#include "refusing_operator_new.h"

namespace {

std::atomic<bool> refusing{false};

// Every allocation is refused while it lives. Nothing in its scope may allocate on purpose
// (gtest's macros do: they come after).
class RefusingEverything {
 public:
  RefusingEverything() { refusing = true; }
  ~RefusingEverything() { refusing = false; }
};

}  // namespace

bool RefuseThisAllocation() noexcept { return refusing.load(std::memory_order_relaxed); }

// An error slot reused from an earlier failure (the header allows it): the new error could not
// be made. The slot must not keep pointing at the old error, which is freed (before, it did,
// and the next failure freed it again).
TEST(CapiAllocationFailureTest, AnErrorThatCannotBeMadeLeavesNoFreedOneBehind) {
  kvr_worker_config config;
  ASSERT_EQ(KVR_OK, kvr_worker_config_init(&config, sizeof config));
  kvr_error* err = nullptr;
  ASSERT_EQ(KVR_INVALID_ARGUMENT, kvr_router_add_worker(nullptr, &config, &err));
  ASSERT_NE(err, nullptr);
  kvr_status refused;
  {
    RefusingEverything refuse;
    refused = kvr_router_add_worker(nullptr, &config, &err);
  }
  EXPECT_EQ(refused, KVR_INVALID_ARGUMENT);  // the status alone: its message had no memory
  EXPECT_EQ(err, nullptr);
  // The slot works on: a later failure reports through it, and freeing it frees once.
  EXPECT_EQ(KVR_INVALID_ARGUMENT, kvr_router_add_worker(nullptr, &config, &err));
  ASSERT_NE(err, nullptr);
  EXPECT_NE(std::string(kvr_error_message(err)).find("router"), std::string::npos);
  kvr_error_free(err);
}

// kvr_tier_from_medium has no status: it must not need memory (a name longer than a short
// string's buffer was copied to compare it; refused, the exception left through C).
TEST(CapiAllocationFailureTest, AMediumNameIsReadWithoutMemory) {
  kvr_tier tier;
  {
    RefusingEverything refuse;
    tier = kvr_tier_from_medium("shared_storage_with_a_long_name");
  }
  EXPECT_EQ(tier, KVR_TIER_DEVICE);  // unknown: the device
  {
    RefusingEverything refuse;
    tier = kvr_tier_from_medium("Shared_Storage");
  }
  EXPECT_EQ(tier, KVR_TIER_EXTERNAL);
}

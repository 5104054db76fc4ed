// The quick-call pool of kvrouterd (service/kvrouterd/quick_call_pool.h): calls run on its
// threads, never the loop's, their completions on the loop's, each once; Close lets the queued
// calls finish and closes the loop handle. Labelled concurrency: ThreadSanitizer runs it too.
#include "kvrouterd/quick_call_pool.h"

#include <gtest/gtest.h>
#include <uv.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

namespace kvrouterd {
namespace {

class QuickCallPoolTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(uv_loop_init(&loop_), 0); }
  void TearDown() override { EXPECT_EQ(uv_loop_close(&loop_), 0) << "a handle left open"; }
  uv_loop_t loop_{};
};

TEST_F(QuickCallPoolTest, CallsRunOnItsThreadsAndCompleteOnTheLoop) {
  constexpr int kCalls = 200;
  const std::thread::id loop_thread = std::this_thread::get_id();
  QuickCallPool pool(&loop_, 3);
  std::atomic<int> on_loop_thread{0};
  std::vector<int> completed;  // touched on the loop thread only
  for (int i = 0; i < kCalls; ++i) {
    auto ran = std::make_shared<std::thread::id>();
    pool.Submit(
        [&, ran] {
          *ran = std::this_thread::get_id();
          if (*ran == loop_thread) ++on_loop_thread;
        },
        [&, ran, i] {
          EXPECT_EQ(std::this_thread::get_id(), loop_thread);
          EXPECT_NE(*ran, loop_thread);
          completed.push_back(i);
          if (completed.size() == kCalls) pool.Close();
        });
  }
  uv_run(&loop_, UV_RUN_DEFAULT);  // returns once Close has closed the handle
  EXPECT_EQ(completed.size(), static_cast<size_t>(kCalls));
  EXPECT_EQ(on_loop_thread.load(), 0);
}

// Close with calls still queued: they run, and their completions too, before the handle goes.
TEST_F(QuickCallPoolTest, CloseFinishesTheQueuedCalls) {
  QuickCallPool pool(&loop_, 1);
  int completed = 0;
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) {
    pool.Submit([&] { ++ran; }, [&] { ++completed; });
  }
  pool.Close();
  uv_run(&loop_, UV_RUN_DEFAULT);
  EXPECT_EQ(ran.load(), 50);
  EXPECT_EQ(completed, 50);
}

// A call that throws still completes (the daemon waits for every call before it stops), and
// the pool thread lives on to run the next.
TEST_F(QuickCallPoolTest, ACallThatThrowsStillCompletes) {
  QuickCallPool pool(&loop_, 1);
  int completed = 0;
  pool.Submit([] { throw std::runtime_error("escaped"); }, [&] { ++completed; });
  pool.Submit([] {},
              [&] {
                if (++completed == 2) pool.Close();
              });
  uv_run(&loop_, UV_RUN_DEFAULT);
  EXPECT_EQ(completed, 2);
}

}  // namespace
}  // namespace kvrouterd

// The threads that make NATS connections again (src/ingest/remake_connector.h): each attempt
// on a thread of its own, so that one held by a server that does not answer holds no other;
// finished threads joined, none started after the stop.
#include "ingest/remake_connector.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ingest/ingest_loop.h"

namespace kvrouter {
namespace {

bool Eventually(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

class RemakeConnectorTest : public ::testing::Test {
 protected:
  // No loop runs here: what a place would post to it is refused.
  RemakeConnectorTest() { loop_.stopped = true; }

  IngestLoop loop_;
};

TEST_F(RemakeConnectorTest, AnAttemptHeldByItsServerHoldsNoOther) {
  std::promise<void> answer;
  std::shared_future<void> answered = answer.get_future().share();
  std::atomic<bool> silent_done{false}, other_done{false}, other_had_a_place{false};
  RemakeConnector connector(loop_);  // last: joins its threads before what they use goes
  connector.Add([&, answered](std::shared_ptr<NatsLoopPlace>) {
    answered.wait();  // a server that says nothing until told to
    silent_done = true;
  });
  connector.Add([&](std::shared_ptr<NatsLoopPlace> place) {
    other_had_a_place = place != nullptr;
    other_done = true;
  });
  EXPECT_TRUE(Eventually([&] { return other_done.load(); }))
      << "the second attempt waited for the first";
  EXPECT_FALSE(silent_done);
  EXPECT_TRUE(other_had_a_place);
  answer.set_value();
  EXPECT_TRUE(Eventually([&] { return silent_done.load(); }));
}

TEST_F(RemakeConnectorTest, FinishedAttemptsDoNotKeepTheirThreads) {
  RemakeConnector connector(loop_);
  for (int i = 0; i < 200; ++i) {
    std::atomic<bool> done{false};
    connector.Add([&](std::shared_ptr<NatsLoopPlace>) { done = true; });
    ASSERT_TRUE(Eventually([&] { return done.load(); }));
    // This attempt's thread, and the last few if a busy machine kept them from counting
    // themselves finished: not one per attempt.
    EXPECT_LT(connector.Threads(), 20u);
  }
}

// The loop closing abandons the place of every attempt under way, but not one the loop took.
TEST_F(RemakeConnectorTest, TheStopAbandonsThePlacesOfTheAttemptsUnderWay) {
  std::promise<void> answer;
  std::shared_future<void> answered = answer.get_future().share();
  std::mutex mutex;
  std::vector<std::shared_ptr<NatsLoopPlace>> places;
  RemakeConnector connector(loop_);
  for (int i = 0; i < 3; ++i) {
    connector.Add([&, answered](std::shared_ptr<NatsLoopPlace> place) {
      {
        std::lock_guard lock(mutex);
        places.push_back(place);
      }
      answered.wait();
    });
  }
  ASSERT_TRUE(Eventually([&] {
    std::lock_guard lock(mutex);
    return places.size() == 3;
  }));
  connector.Taken(places[1]);
  connector.Stop();
  EXPECT_TRUE(places[0]->Detached());
  EXPECT_FALSE(places[1]->Detached()) << "a place the loop took was abandoned";
  EXPECT_TRUE(places[2]->Detached());
  answer.set_value();
}

TEST_F(RemakeConnectorTest, NoAttemptStartsAfterTheStop) {
  std::atomic<bool> ran{false};
  RemakeConnector connector(loop_);
  connector.Stop();
  connector.Add([&](std::shared_ptr<NatsLoopPlace>) { ran = true; });
  EXPECT_EQ(connector.Threads(), 0u);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(ran);
}

}  // namespace
}  // namespace kvrouter

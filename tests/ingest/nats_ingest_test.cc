// NATS as an ingest source: each test starts its own nats-server on 127.0.0.1 (a free port),
// publishes native EventBatches with the NATS C client, and checks the router's index and the
// source's counters. Also: wildcard subjects, a garbage message, a server restart.
#include <gtest/gtest.h>
#include <nats/nats.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/router.h"
#include "ingest/ingest_service.h"
#include "ingest/stream_publisher.h"
#include "nats_ingest_fixture.h"
#include "slow_nats_server.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {
namespace {

constexpr auto kWait = std::chrono::seconds(10);
constexpr uint32_t kBlockSize = 16;

std::vector<uint32_t> Range(uint32_t first, uint32_t n) {
  std::vector<uint32_t> out;
  for (uint32_t i = 0; i < n; ++i) out.push_back(first + i);
  return out;
}

// One event storing `prompt`'s full blocks on worker (id, 0), as an encoded EventBatch.
std::vector<uint8_t> StoreBatch(uint64_t worker, const std::vector<uint32_t>& prompt,
                                uint64_t first_hash, uint64_t event_id) {
  StoredEvent stored;
  for (size_t b = 0; b < prompt.size() / kBlockSize; ++b) {
    stored.block_hashes.push_back(first_hash + b);
  }
  stored.token_ids = prompt;
  const KvEvent event{.worker = {worker, 0}, .event_id = event_id, .data = std::move(stored)};
  return EncodeEventBatch(std::span(&event, 1));
}

class NatsIngestTest : public NatsIngestFixture {
 protected:
  NatsIngestTest() : NatsIngestFixture(kBlockSize) {}

  // A native stream source, made before a connect starts (so that, once it waits, only the
  // batch's way through the loop is left to do).
  void FeedNatively() {
    std::string bound;
    ASSERT_TRUE(ingest_->Listen("tcp://127.0.0.1:0", &bound).ok());
    auto publisher = StreamPublisher::Connect(bound);
    ASSERT_TRUE(publisher.ok()) << publisher.status();
    native_ = *std::move(publisher);
  }
  // A batch on that source applied: the ingest loop serves its sources.
  void ExpectTheLoopAppliesABatch(uint64_t worker) {
    const auto prompt = Range(static_cast<uint32_t>(worker) * 1000, 2 * kBlockSize);
    ASSERT_TRUE(native_->Send(StoreBatch(worker, prompt, worker * 1000, 1)).ok());
    ASSERT_TRUE(Eventually([&] { return DeviceBlocks(prompt, worker) == 2; }));
  }

  // Whether `done` holds within `at_most`.
  template <typename Done>
  static bool Eventually(Done done, std::chrono::milliseconds at_most = 2 * kWait) {
    const auto deadline = std::chrono::steady_clock::now() + at_most;
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return done();
  }

  std::unique_ptr<StreamPublisher> native_;

  // The server restarted on its port with an authorization no subscriber here has: libnats
  // gives their connections up (the same authorization error twice).
  std::unique_ptr<NatsServer> LockTheServer() {
    natsConnection_Destroy(std::exchange(publisher_, nullptr));
    server_->Stop();
    const std::string config = ::testing::TempDir() + "/nats_ingest_authorization.conf";
    std::ofstream(config) << "authorization { user: someone, password: secret }\n";
    auto locked = std::make_unique<NatsServer>(server_->port(), "", config);
    EXPECT_TRUE(locked->Start());
    return locked;
  }

  // A source on kv.> that has applied a batch storing `prompt` (two blocks) on worker 1.
  void SubscribeWithWorker1Holding(const std::vector<uint32_t>& prompt, uint64_t* source) {
    auto subscribed = ingest_->SubscribeNats(server_->url(), "kv.>");
    ASSERT_TRUE(subscribed.ok()) << subscribed.status();
    *source = *subscribed;
    Publish("kv.1", StoreBatch(1, prompt, 70, 1));
    WaitForMessages(*source, 1);
    ASSERT_EQ(2u, DeviceBlocks(prompt, 1));
  }

  uint32_t DeviceBlocks(const std::vector<uint32_t>& prompt, uint64_t worker) {
    auto scores = router_->OverlapScores(prompt);
    if (!scores.ok()) return 0;
    for (const OverlapScore& s : *scores) {
      if (s.worker == WorkerKey{worker, 0}) return s.overlap.device_blocks;
    }
    return 0;
  }
};

// Where a NATS source is, as reported: its url without the credentials.
TEST_F(NatsIngestTest, SourceEndpointHidesCredentials) {
  const std::string url = server_->url();  // nats://127.0.0.1:PORT
  const std::string with_credentials = "nats://user:secret@" + url.substr(7);
  auto source = ingest_->SubscribeNats(with_credentials, "kv.events");
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ(*ingest_->Endpoint(*source), url);
}

TEST_F(NatsIngestTest, BatchesReachTheIndexAndAreCounted) {
  auto source = ingest_->SubscribeNats(server_->url(), "kv.events");
  ASSERT_TRUE(source.ok()) << source.status();
  const auto prompt = Range(100, 3 * kBlockSize);
  Publish("kv.events", StoreBatch(1, prompt, 1000, 1));
  Publish("kv.other", StoreBatch(2, prompt, 2000, 2));  // not subscribed
  const IngestStats stats = WaitForMessages(*source, 1);
  EXPECT_EQ(1u, stats.events_applied);
  EXPECT_EQ(1u, stats.connections);
  EXPECT_EQ(3u, DeviceBlocks(prompt, 1));
  EXPECT_EQ(0u, DeviceBlocks(prompt, 2));
}

TEST_F(NatsIngestTest, WildcardSubjectsAndGarbageIsRejectedAndCounted) {
  auto source = ingest_->SubscribeNats(server_->url(), "kv.*.events");
  ASSERT_TRUE(source.ok()) << source.status();
  const auto a = Range(1, 2 * kBlockSize);
  const auto b = Range(5000, 2 * kBlockSize);
  Publish("kv.w1.events", StoreBatch(1, a, 10, 1));
  Publish("kv.w2.events", {0xde, 0xad, 0xbe, 0xef, 1, 2, 3});  // not an EventBatch
  Publish("kv.w2.events", StoreBatch(2, b, 20, 2));
  const IngestStats stats = WaitForMessages(*source, 3);
  EXPECT_EQ(2u, stats.events_applied);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kBadFlatBuffers)]);
  EXPECT_EQ(2u, DeviceBlocks(a, 1));
  EXPECT_EQ(2u, DeviceBlocks(b, 2));
  const IngestStats total = *ingest_->Stats(0);
  EXPECT_EQ(3u, total.messages);
}

TEST_F(NatsIngestTest, SubscribingBeforeStartWorks) {
  auto router = *Router::Create(RouterOptions{.block_size = kBlockSize});
  auto ingest = *IngestService::Create(router.get(), {});
  auto source = ingest->SubscribeNats(server_->url(), "kv.>");
  ASSERT_TRUE(source.ok()) << source.status();
  ASSERT_TRUE(ingest->Start().ok());
  // The SUB goes out once the loop runs: publish until a batch arrives (bounded).
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  uint64_t attempt = 0;
  while (ingest->Stats(*source)->events_applied == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    ++attempt;
    Publish("kv.a.b", StoreBatch(1, Range(attempt * 100, kBlockSize), attempt, attempt));
    const auto retry = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
    while (ingest->Stats(*source)->events_applied == 0 &&
           std::chrono::steady_clock::now() < retry) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  EXPECT_GE(ingest->Stats(*source)->events_applied, 1u);
  ingest->Stop();
}

TEST_F(NatsIngestTest, UnreachableServerIsUnavailable) {
  const int port = FreePort();
  auto source = ingest_->SubscribeNats("nats://127.0.0.1:" + std::to_string(port), "kv");
  EXPECT_EQ(absl::StatusCode::kUnavailable, source.status().code()) << source.status();
  EXPECT_EQ(absl::StatusCode::kInvalidArgument,
            ingest_->SubscribeNats(server_->url(), "").status().code());
}

// Subscribing waits for the server on the caller's thread: while a server that does not answer
// holds it (libnats' 2 s connect timeout), the loop goes on applying the other sources' events.
// Before, the connect ran on the loop, which then served nothing until the timeout.
TEST_F(NatsIngestTest, SubscribingToASilentServerHoldsOnlyTheCaller) {
  ASSERT_NO_FATAL_FAILURE(FeedNatively());
  SlowNatsServer slow(FreePort());
  ASSERT_TRUE(slow.listening());
  absl::StatusOr<uint64_t> source;
  std::thread subscriber([&] {
    source = ingest_->SubscribeNats("nats://127.0.0.1:" + std::to_string(slow.port()), "kv");
  });
  const bool accepted = slow.Accept(kWait);
  if (accepted) {
    EXPECT_NO_FATAL_FAILURE(ExpectTheLoopAppliesABatch(7));
    EXPECT_TRUE(slow.StillHeld()) << "the batch waited for the connect to end";
  }
  subscriber.join();
  ASSERT_TRUE(accepted);
  EXPECT_EQ(absl::StatusCode::kUnavailable, source.status().code()) << source.status();
}

TEST_F(NatsIngestTest, SurvivesAServerRestart) {
  const auto before = Range(7000, 2 * kBlockSize);
  uint64_t source = 0;
  ASSERT_NO_FATAL_FAILURE(SubscribeWithWorker1Holding(before, &source));

  ASSERT_TRUE(RestartServer());

  // (libnats may report the disconnection after messages published since were applied: those
  // stay all the same, LateDisconnectionReportsKeepWhatCameSinceTheReconnection.)
  // The subscriber resubscribes on its own; until it has, messages are lost, so publish a fresh
  // batch until one arrives (bounded).
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  uint64_t attempt = 0;
  bool arrived = false;
  std::vector<std::vector<uint32_t>> sent;
  while (!arrived && std::chrono::steady_clock::now() < deadline) {
    ++attempt;
    sent.push_back(Range(10000 + static_cast<uint32_t>(attempt) * 100, 2 * kBlockSize));
    Publish("kv.2", StoreBatch(2, sent.back(), 100 + attempt * 10, 100 + attempt));
    const auto retry = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    while (!(arrived = ingest_->Stats(source)->events_applied >= 2) &&
           std::chrono::steady_clock::now() < retry) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  ASSERT_TRUE(arrived);
  bool any = false;
  for (const auto& prompt : sent) any = any || DeviceBlocks(prompt, 2) == 2;
  EXPECT_TRUE(any);
  IngestStats stats = *ingest_->Stats(source);
  EXPECT_EQ(0u, stats.rejected[static_cast<int>(IngestReject::kBadFlatBuffers)]);
  // What was published during the outage is lost without a trace, so worker 1's state is
  // unknown: cleared (it may have evicted those blocks meanwhile) and flagged, never kept.
  EXPECT_EQ(0u, DeviceBlocks(before, 1));
  EXPECT_EQ(1u, stats.state_unknown);
  EXPECT_GE(stats.gaps, 1u);  // one per disconnection noticed
  EXPECT_GE(stats.recoveries, 1u);
  // Until the engine clears it itself: then the index is exact again.
  const KvEvent clear{.worker = {1, 0}, .event_id = 999, .data = ClearedEvent{}};
  Publish("kv.1", EncodeEventBatch(std::span(&clear, 1)));
  // (Not "one more event applied": a batch retried before the restart may be that one.)
  const auto until = std::chrono::steady_clock::now() + kWait;
  while (ingest_->Stats(source)->state_unknown != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  stats = *ingest_->Stats(source);
  EXPECT_EQ(0u, stats.state_unknown);
}

// libnats runs every connection's callbacks, one at a time, on a thread of its own: here held
// by another connection's closed callback until released. (Its state is shared with the
// callback, which may run after a failed test gave up waiting for it.)
class CallbackThreadHold {
 public:
  explicit CallbackThreadHold(const std::string& url) : state_(std::make_shared<State>()) {
    natsOptions* options = nullptr;
    natsConnection* connection = nullptr;
    if (natsOptions_Create(&options) != NATS_OK) return;
    auto* closure = new std::shared_ptr<State>(state_);  // the callback's share
    if (natsOptions_SetURL(options, url.c_str()) == NATS_OK &&
        natsOptions_SetClosedCB(options, &CallbackThreadHold::OnClosed, closure) == NATS_OK &&
        natsConnection_Connect(&connection, options) == NATS_OK) {
      natsConnection_Close(connection);  // its closed callback holds the thread
      natsConnection_Destroy(connection);
    } else {
      delete closure;
    }
    natsOptions_Destroy(options);
  }
  ~CallbackThreadHold() { Release(); }
  CallbackThreadHold(const CallbackThreadHold&) = delete;
  CallbackThreadHold& operator=(const CallbackThreadHold&) = delete;

  bool Holding() {
    std::unique_lock lock(state_->mutex);
    return state_->changed.wait_for(lock, kWait, [&] { return state_->holding; });
  }
  void Release() {
    std::lock_guard lock(state_->mutex);
    state_->released = true;
    state_->changed.notify_all();
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable changed;
    bool holding = false;
    bool released = false;
  };

  static void OnClosed(natsConnection*, void* closure) {
    const std::unique_ptr<std::shared_ptr<State>> share(
        static_cast<std::shared_ptr<State>*>(closure));
    State& state = **share;
    std::unique_lock lock(state.mutex);
    state.holding = true;
    state.changed.notify_all();
    state.changed.wait(lock, [&] { return state.released; });
  }

  std::shared_ptr<State> state_;
};

// libnats reports a lost connection on its callback thread, apart from the messages: the reports
// may reach the loop after messages of the new connections (held back here, over two outages).
// What came since the last reconnection stays; what came before it is cleared and flagged (the
// first message after each loss applied it), and the late reports clear nothing more. Before,
// the first late report cleared everything; and counting the losses as each report ran, the
// second (seeing no new loss) cleared again.
TEST_F(NatsIngestTest, LateDisconnectionReportsKeepWhatCameSinceTheReconnection) {
  const auto before = Range(7000, 2 * kBlockSize);
  uint64_t source = 0;
  ASSERT_NO_FATAL_FAILURE(SubscribeWithWorker1Holding(before, &source));

  CallbackThreadHold hold(server_->url());
  ASSERT_TRUE(hold.Holding());
  // The server restarted; then batches for `worker`, fresh ones, until the subscriber has
  // resubscribed and one is applied (what comes before is lost).
  const auto outage_then_batches = [&](uint64_t worker) {
    EXPECT_TRUE(RestartServer());
    const uint64_t applied = ingest_->Stats(source)->events_applied;
    std::vector<std::vector<uint32_t>> sent;
    EXPECT_TRUE(Eventually([&] {
      const auto n = static_cast<uint32_t>(sent.size());
      sent.push_back(Range(static_cast<uint32_t>(worker) * 10000 + n * 100, 2 * kBlockSize));
      Publish("kv." + std::to_string(worker),
              StoreBatch(worker, sent.back(), worker * 1000 + n * 10, n + 1));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      return ingest_->Stats(source)->events_applied > applied;
    }));
    return sent;
  };
  const auto blocks_of = [&](const std::vector<std::vector<uint32_t>>& prompts, uint64_t worker) {
    uint64_t blocks = 0;
    for (const auto& prompt : prompts) blocks += DeviceBlocks(prompt, worker);
    return blocks;
  };
  const auto first = outage_then_batches(2);
  EXPECT_EQ(0u, DeviceBlocks(before, 1));  // the first message after the loss cleared it
  EXPECT_GE(blocks_of(first, 2), 2u);
  const auto second = outage_then_batches(3);
  EXPECT_EQ(1u, ingest_->Stats(source)->connections);  // nothing reported yet: held

  hold.Release();  // two disconnections and two reconnections are reported
  ASSERT_TRUE(Eventually([&] { return ingest_->Stats(source)->connections >= 3; }));
  // A batch published now is applied after the reports' clears (posted before).
  const auto last = Range(40000, 2 * kBlockSize);
  Publish("kv.4", StoreBatch(4, last, 4000, 1));
  ASSERT_TRUE(Eventually([&] { return DeviceBlocks(last, 4) == 2; }));

  const IngestStats stats = *ingest_->Stats(source);
  // What arrived for worker 3 (all after the second reconnection) stays: a clear takes all.
  EXPECT_GE(blocks_of(second, 3), 2u);
  EXPECT_EQ(0u, blocks_of(first, 2));  // before the second outage: cleared
  EXPECT_EQ(0u, DeviceBlocks(before, 1));
  EXPECT_EQ(2u, stats.state_unknown);  // workers 1 and 2, not 3 nor 4
  EXPECT_EQ(2u, stats.gaps);           // each loss applied once
}

// The server restarted with an authorization the subscriber lacks: libnats gives up on the
// connection for good (the same authorization error twice in a row). The source makes it again,
// backing off while the server refuses (each attempt counted), and once the server takes it
// (restarted open again here) batches apply again. Before, the source stayed closed for good.
TEST_F(NatsIngestTest, AConnectionTheClientGaveUpOnIsMadeAgain) {
  auto source = ingest_->SubscribeNats(server_->url(), "kv.>");
  ASSERT_TRUE(source.ok()) << source.status();
  Publish("kv.1", StoreBatch(1, Range(7000, 2 * kBlockSize), 70, 1));
  WaitForMessages(*source, 1);
  std::unique_ptr<NatsServer> locked = LockTheServer();
  const auto stats = [&] { return *ingest_->Stats(*source); };
  ASSERT_TRUE(Eventually([&] { return stats().consumer_remake_failures >= 1; }))
      << "the connection was never given up and made again";
  EXPECT_EQ(stats().consumer_remakes, 0u);
  EXPECT_EQ(stats().state_unknown, 1u);  // what worker 1 publishes meanwhile is lost
  locked.reset();
  ASSERT_TRUE(server_->Start());
  ASSERT_TRUE(Eventually([&] { return stats().consumer_remakes == 1; }));
  EXPECT_EQ(stats().connections, 2u);
  ASSERT_EQ(NATS_OK, natsConnection_ConnectTo(&publisher_, server_->url().c_str()));
  // The remade subscription's SUB may not have reached the server yet: publish until one
  // arrives (bounded).
  const auto prompt = Range(20000, 2 * kBlockSize);
  for (uint64_t attempt = 1; DeviceBlocks(prompt, 2) == 0 && attempt <= 100; ++attempt) {
    Publish("kv.2", StoreBatch(2, prompt, 200, 100 + attempt));
    (void)Eventually([&] { return DeviceBlocks(prompt, 2) == 2; }, std::chrono::milliseconds(200));
  }
  EXPECT_EQ(DeviceBlocks(prompt, 2), 2u);
  // Worker 1 stays unknown until its engine clears it, as after any outage.
  EXPECT_EQ(stats().state_unknown, 1u);
}

// A remake waits for the server on a thread of its own: while a server that does not answer
// holds it, the loop goes on serving the other sources. Stopping the ingest meanwhile does not
// wait for it either, and when the server answers after all, the connection is closed, not left
// open (the closed loop refuses its attachment), and destroying the ingest joins the thread.
TEST_F(NatsIngestTest, ARemakeWaitingForASilentServerHoldsOnlyItsOwnThread) {
  auto source = ingest_->SubscribeNats(server_->url(), "kv.>");
  ASSERT_TRUE(source.ok()) << source.status();
  {
    // libnats gives the connection up; a remake is refused.
    std::unique_ptr<NatsServer> locked = LockTheServer();
    ASSERT_TRUE(Eventually([&] { return ingest_->Stats(*source)->consumer_remake_failures >= 1; }));
  }
  // The next attempt, seconds later, meets a server that says nothing until told to.
  ASSERT_NO_FATAL_FAILURE(FeedNatively());
  SlowNatsServer slow(server_->port());
  ASSERT_TRUE(slow.listening());
  // Attempts refused meanwhile (a slow machine between the two servers) double the delay, up
  // to 30 s: the wait outlasts the longest.
  ASSERT_TRUE(slow.Accept(std::chrono::seconds(30) + kWait));
  ASSERT_NO_FATAL_FAILURE(ExpectTheLoopAppliesABatch(7));
  EXPECT_TRUE(slow.StillHeld()) << "the batch waited for the remake's connect to end";
  ingest_->Stop();
  EXPECT_TRUE(slow.StillHeld()) << "stopping waited for the remake's connect to end";
  ASSERT_TRUE(slow.Answer(kWait)) << "the connect gave up before the server answered";
  EXPECT_TRUE(slow.ClosedByClient(kWait)) << "the connection answered after the stop was kept";
  ingest_.reset();  // joins the remake's thread
}

// Stop while subscriptions are under way on other threads: each either subscribes whole (the
// stop waits for it) or is refused FAILED_PRECONDITION. Before, the stop could close and destroy
// a connection its caller was still confirming the subscription on (a use after free, or
// Unavailable: "not confirmed by the server").
TEST_F(NatsIngestTest, StopWaitsForTheSubscriptionsUnderWay) {
  constexpr int kThreads = 6;
  std::atomic<int> subscribed = 0;
  std::atomic<bool> go = false;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      for (int n = 0;; ++n) {
        auto id = ingest_->SubscribeNats(server_->url(),
                                         "kv." + std::to_string(t) + "." + std::to_string(n));
        if (!id.ok()) {
          EXPECT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
          return;
        }
        ++subscribed;
      }
    });
  }
  go = true;
  ASSERT_TRUE(Eventually([&] { return subscribed.load() >= kThreads; }));
  ingest_->Stop();
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ingest_->SubscribeNats(server_->url(), "kv.late").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(NatsIngestTest, StopsWhileTheServerIsDown) {
  auto source = ingest_->SubscribeNats(server_->url(), "kv.>");
  ASSERT_TRUE(source.ok()) << source.status();
  natsConnection_Destroy(publisher_);
  publisher_ = nullptr;
  server_->Stop();
  // Whether or not the loop has noticed the disconnection yet (it may be reconnecting),
  // closing must neither hang nor crash.
  const auto started = std::chrono::steady_clock::now();
  ingest_->Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - started, kWait);
  EXPECT_EQ(0u, ingest_->Stats(*source)->messages);
}

}  // namespace
}  // namespace kvrouter

// The JetStream relay on a real nats-server (JetStream on, a temporary store) on 127.0.0.1: a
// relay router takes native batches on a stream listener and republishes every change its
// index applies into a stream; a consumer router reads that stream. After each scenario the
// consumer's index must equal the relay's (index digests): what the relay's index refused is not
// relayed, a server restart loses nothing, an overflowed queue is resynced, and a JetStream
// source's own events are never relayed back.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "core/router.h"
#include "ingest/ingest_service.h"
#include "ingest/stream_publisher.h"
#include "nats_server.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {
namespace {

constexpr uint32_t kBlockSize = 16;
constexpr auto kWait = std::chrono::seconds(20);

bool Eventually(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (!done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return done();
}

// Block `i` of a chain on `rank`, chained to block i - 1 (engine hashes `base` + i).
KvEvent Store(WorkerKey rank, uint64_t base, uint64_t i) {
  StoredEvent stored;
  if (i > 0) stored.parent_hash = base + i - 1;
  stored.block_hashes = {base + i};
  for (uint32_t t = 0; t < kBlockSize; ++t) stored.token_ids.push_back((base + i) * 100 + t);
  return {.worker = rank, .data = std::move(stored)};
}

KvEvent Remove(WorkerKey rank, uint64_t hash) {
  return {.worker = rank, .data = RemovedEvent{.block_hashes = {hash}}};
}

// The (block, rank) entries `router` holds.
size_t Blocks(const Router& router) {
  size_t blocks = 0;
  for (const KvEvent& event : router.DumpIndexEvents()) {
    if (const auto* stored = std::get_if<StoredEvent>(&event.data)) {
      blocks += stored->block_hashes.size();
    }
  }
  return blocks;
}

struct Node {
  std::unique_ptr<Router> router;
  std::unique_ptr<IngestService> ingest;

  explicit Node(IngestOptions options = {}) {
    router = *Router::Create(RouterOptions{.block_size = kBlockSize});
    for (uint64_t w : {1, 2}) {
      EXPECT_TRUE(router->AddWorker({.worker_id = w, .dp_size = 2, .block_size = kBlockSize}).ok());
    }
    ingest = *IngestService::Create(router.get(), options);
    EXPECT_TRUE(ingest->Start().ok());
  }
  IngestStats Stats(uint64_t source) const { return *ingest->Stats(source); }
};

class JetStreamRelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvr-relay-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    store_ = dir;
    port_ = FreePort();
    server_ = std::make_unique<NatsServer>(port_, store_);
    ASSERT_TRUE(server_->Start());
  }
  void TearDown() override {
    publisher_.reset();
    server_.reset();
    std::filesystem::remove_all(store_);
  }

  // The relay: a stream listener (its events are what the test sends) relayed into "KV".
  void StartRelay(Node& relay) {
    Listen(relay);
    Relay(relay);
  }
  void Listen(Node& relay) {
    auto listener = relay.ingest->Listen("tcp://127.0.0.1:0", &endpoint_);
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = *listener;
    auto publisher = StreamPublisher::Connect(endpoint_);
    ASSERT_TRUE(publisher.ok()) << publisher.status();
    publisher_ = std::move(*publisher);
  }
  void Relay(Node& relay) {
    auto relayed = relay.ingest->RelayToJetStream(Target());
    ASSERT_TRUE(relayed.ok()) << relayed.status();
    relay_source_ = *relayed;
  }
  JetStreamSource Target() const {
    return {.url = server_->url(), .stream = "KV", .subject = "kv.relay", .create_stream = true};
  }
  void Consume(Node& consumer) {
    auto id = consumer.ingest->SubscribeJetStream(
        {.url = server_->url(), .stream = "KV", .subject = "kv.relay.>", .durable = "consumer"});
    ASSERT_TRUE(id.ok()) << id.status();
    consumer_source_ = *id;
  }
  void Send(std::vector<KvEvent> events) {
    ASSERT_TRUE(publisher_->Send(EncodeEventBatch(events)).ok());
  }
  // Messages 0..n-1 (from `first`): each stores the next block of a chain on worker 1 rank 0
  // and on worker 2 rank 1.
  void SendChains(uint64_t first, uint64_t n) {
    for (uint64_t i = first; i < first + n; ++i) {
      Send({Store({1, 0}, 1000, i), Store({2, 1}, 5000, i)});
    }
  }
  // The relay has applied what the listener received and the stream acknowledged it all.
  bool RelayCaughtUp(const Node& relay, uint64_t frames) const {
    const IngestStats heard = relay.Stats(listener_);
    const IngestStats relayed = relay.Stats(relay_source_);
    return heard.messages == frames && relayed.state_unknown == 0 &&
           relayed.events_applied + relayed.missed_messages == relayed.messages;
  }
  // The consumer has applied the stream up to the relay's last message, and both indexes
  // agree.
  void ExpectSameIndex(const Node& relay, const Node& consumer) {
    const uint64_t position = relay.Stats(relay_source_).stream_sequence;
    ASSERT_TRUE(Eventually([&] {
      return consumer.Stats(consumer_source_).stream_sequence == position;
    })) << consumer.Stats(consumer_source_).stream_sequence
        << " of " << position;
    EXPECT_EQ(consumer.router->IndexDigest(), relay.router->IndexDigest());
    EXPECT_EQ(Blocks(*consumer.router), Blocks(*relay.router));
  }
  void RestartServer() {
    server_ = std::make_unique<NatsServer>(port_, store_);  // same port, same store
    ASSERT_TRUE(server_->Start());
  }
  // The server restarted, the relay has relayed the `frames` the listener got: its counters.
  void RestartAndCatchUp(const Node& relay, uint64_t frames, IngestStats* relayed) {
    ASSERT_NO_FATAL_FAILURE(RestartServer());
    ASSERT_TRUE(Eventually([&] { return RelayCaughtUp(relay, frames); }));
    *relayed = relay.Stats(relay_source_);
  }

  std::string store_;
  int port_ = 0;
  std::unique_ptr<NatsServer> server_;
  std::string endpoint_;
  uint64_t listener_ = 0;
  uint64_t relay_source_ = 0;
  uint64_t consumer_source_ = 0;
  std::unique_ptr<StreamPublisher> publisher_;
};

TEST_F(JetStreamRelayTest, TheConsumerHoldsWhatTheRelaysIndexApplied) {
  Node relay;
  StartRelay(relay);
  Node consumer;
  Consume(consumer);
  SendChains(0, 10);
  Send({Remove({1, 0}, 1009), Remove({2, 1}, 5009)});
  // Refused by the relay's index (no such parent): relayed all the same, and refused there.
  Send({Store({1, 0}, 90000, 5)});
  Send({{.worker = {2, 1}, .data = ClearedEvent{}}, Store({2, 1}, 7000, 0)});
  ASSERT_TRUE(Eventually([&] { return RelayCaughtUp(relay, 13); }));
  ExpectSameIndex(relay, consumer);
  const IngestStats relayed = relay.Stats(relay_source_);
  EXPECT_EQ(relayed.messages, 25u);  // 21 stores, 2 removals, the clear
  EXPECT_EQ(relay.Stats(listener_).rejected[static_cast<int>(IngestReject::kIndexRejected)], 1u);
  EXPECT_GE(relayed.published, 13u);  // at least one message per frame (one worker each)
  EXPECT_EQ(relayed.gaps, 0u);
  EXPECT_EQ(relayed.lag_samples, relayed.published);
  // Worker 1 holds 9 blocks (one removed), worker 2's rank 1 one block of a new chain.
  EXPECT_EQ(Blocks(*consumer.router), 10u);
}

TEST_F(JetStreamRelayTest, NothingIsLostWhileTheServerRestarts) {
  Node relay;
  StartRelay(relay);
  SendChains(0, 20);
  ASSERT_TRUE(Eventually([&] { return RelayCaughtUp(relay, 20); }));
  server_->Stop();
  SendChains(20, 30);  // queued while the server is away
  ASSERT_TRUE(Eventually([&] { return relay.Stats(listener_).messages == 50; }));
  IngestStats relayed;
  ASSERT_NO_FATAL_FAILURE(RestartAndCatchUp(relay, 50, &relayed));
  EXPECT_EQ(relayed.gaps, 0u);
  EXPECT_EQ(relayed.events_applied, 100u);
  // A consumer that starts now reads the whole stream.
  Node consumer;
  Consume(consumer);
  ExpectSameIndex(relay, consumer);
  EXPECT_EQ(Blocks(*consumer.router), 100u);
}

// A server that refuses the relay's credentials makes the NATS client give its connection up
// for good (its own retries stop). The relay makes it again once the server takes it, and
// publishes what waited: nothing is lost.
TEST_F(JetStreamRelayTest, AConnectionTheClientGaveUpOnIsMadeAgain) {
  Node relay;
  StartRelay(relay);
  SendChains(0, 10);
  ASSERT_TRUE(Eventually([&] { return RelayCaughtUp(relay, 10); }));
  server_->Stop();
  const std::string config = store_ + "/authorization.conf";
  std::ofstream(config) << "authorization { user: someone, password: secret }\n";
  {
    NatsServer locked(port_, store_, config);
    ASSERT_TRUE(locked.Start());
    SendChains(10, 10);  // queued while the server refuses the relay
    ASSERT_TRUE(Eventually([&] {
      return relay.Stats(relay_source_).consumer_remake_failures >= 1;
    })) << "the connection was never given up and made again";
  }
  IngestStats relayed;
  ASSERT_NO_FATAL_FAILURE(RestartAndCatchUp(relay, 20, &relayed));
  EXPECT_EQ(relayed.gaps, 0u);
  EXPECT_EQ(relayed.events_applied, 40u);
  EXPECT_GE(relayed.consumer_remakes, 1u);
  EXPECT_EQ(relayed.stream_sequence, relayed.published) << "a message was stored twice";
  Node consumer;
  Consume(consumer);
  ExpectSameIndex(relay, consumer);
  EXPECT_EQ(Blocks(*consumer.router), 40u);
}

TEST_F(JetStreamRelayTest, AnOverflowedQueueIsResyncedOnceTheServerIsBack) {
  Node relay(IngestOptions{.relay_backlog_bytes = 8 << 10});
  StartRelay(relay);
  Node consumer;
  Consume(consumer);
  SendChains(0, 10);
  ASSERT_TRUE(Eventually([&] { return RelayCaughtUp(relay, 10); }));
  ExpectSameIndex(relay, consumer);
  server_->Stop();
  SendChains(10, 100);
  Send({Remove({1, 0}, 1005)});  // a block the consumer holds: the resync must clear it
  ASSERT_TRUE(Eventually([&] { return relay.Stats(relay_source_).state_unknown == 1; }));
  IngestStats relayed;
  ASSERT_NO_FATAL_FAILURE(RestartAndCatchUp(relay, 111, &relayed));
  EXPECT_GE(relayed.gaps, 1u);
  EXPECT_GT(relayed.missed_messages, 0u);
  EXPECT_GE(relayed.recoveries, 1u);
  ExpectSameIndex(relay, consumer);
}

TEST_F(JetStreamRelayTest, AJetStreamSourcesEventsAreNotRelayedBack) {
  Node relay;
  StartRelay(relay);
  // The relay also consumes its own stream: what it reads there is not published again.
  Consume(relay);
  SendChains(0, 5);
  ASSERT_TRUE(Eventually([&] { return RelayCaughtUp(relay, 5); }));
  const uint64_t position = relay.Stats(relay_source_).stream_sequence;
  ASSERT_TRUE(
      Eventually([&] { return relay.Stats(consumer_source_).stream_sequence == position; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(relay.Stats(relay_source_).messages, 10u);
  EXPECT_EQ(relay.Stats(relay_source_).stream_sequence, position);
}

// A change the index applies in part (a removal naming a block the rank does not hold removes
// the others) is relayed: the consumer, in the same state, applies the same part.
TEST_F(JetStreamRelayTest, APartlyAppliedChangeIsRelayed) {
  Node relay;
  StartRelay(relay);
  Node consumer;
  Consume(consumer);
  SendChains(0, 5);
  Send({{.worker = {1, 0}, .data = RemovedEvent{.block_hashes = {1004, 424242}}}});
  ASSERT_TRUE(Eventually([&] { return RelayCaughtUp(relay, 6); }));
  ExpectSameIndex(relay, consumer);
  EXPECT_EQ(Blocks(*consumer.router), 9u);
}

// A store too big for one NATS message (the server's limit is 1 MiB) goes in parts, each the
// next stretch of its blocks, and counts as one change.
TEST_F(JetStreamRelayTest, AChangeTooBigForOneMessageGoesInParts) {
  Node relay;
  StartRelay(relay);
  Node consumer;
  Consume(consumer);
  constexpr uint64_t kBlocks = 30'000;  // 1.9 MB of tokens
  StoredEvent stored;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    stored.block_hashes.push_back(1'000'000 + i);
    for (uint32_t t = 0; t < kBlockSize; ++t) stored.token_ids.push_back(i * kBlockSize + t);
  }
  Send({{.worker = {1, 0}, .data = std::move(stored)}});
  ASSERT_TRUE(Eventually([&] { return RelayCaughtUp(relay, 1); }));
  const IngestStats relayed = relay.Stats(relay_source_);
  EXPECT_EQ(relayed.messages, 1u);
  EXPECT_EQ(relayed.events_applied, 1u);
  EXPECT_GE(relayed.published, 2u);
  EXPECT_EQ(relayed.missed_messages, 0u);
  ExpectSameIndex(relay, consumer);
  EXPECT_EQ(Blocks(*consumer.router), kBlocks);
}

// What the index held before the relay started (sources added first, a restored snapshot)
// goes out first, as a resync.
TEST_F(JetStreamRelayTest, WhatTheIndexHeldBeforeTheRelayGoesOutFirst) {
  Node relay;
  Listen(relay);
  SendChains(0, 8);
  ASSERT_TRUE(Eventually([&] { return relay.Stats(listener_).messages == 8; }));
  Relay(relay);
  SendChains(8, 2);
  ASSERT_TRUE(Eventually([&] { return RelayCaughtUp(relay, 10); }));
  EXPECT_EQ(relay.Stats(relay_source_).recoveries, 1u);
  Node consumer;
  Consume(consumer);
  ExpectSameIndex(relay, consumer);
  EXPECT_EQ(Blocks(*consumer.router), 20u);
}

// A stream that does not take the relay's subjects is refused at once, not retried forever.
TEST_F(JetStreamRelayTest, AStreamThatDoesNotTakeTheSubjectsIsRefused) {
  Node relay;
  JetStreamSource other = Target();
  other.subject = "elsewhere";
  ASSERT_TRUE(relay.ingest->RelayToJetStream(other).ok());  // creates KV on elsewhere.>
  Node second;
  const auto refused = second.ingest->RelayToJetStream(Target());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("elsewhere.>"), std::string::npos) << refused.status();
}

TEST_F(JetStreamRelayTest, BadConfigurationsAreRefusedClearly) {
  Node relay;
  JetStreamSource target = Target();
  target.subject = "kv.relay.>";
  EXPECT_EQ(relay.ingest->RelayToJetStream(target).status().code(),
            absl::StatusCode::kInvalidArgument);
  target = Target();
  target.durable = "router-a";
  EXPECT_EQ(relay.ingest->RelayToJetStream(target).status().code(),
            absl::StatusCode::kInvalidArgument);
  target = Target();
  target.create_stream = false;
  target.stream = "NOPE";
  EXPECT_EQ(relay.ingest->RelayToJetStream(target).status().code(), absl::StatusCode::kNotFound);
  target = Target();
  target.url = "nats://127.0.0.1:" + std::to_string(FreePort());
  EXPECT_EQ(relay.ingest->RelayToJetStream(target).status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(relay.ingest->RelayToJetStream(Target()).ok());
  EXPECT_EQ(relay.ingest->RelayToJetStream(Target()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvrouter

// Router replica sync over a real nats-server on 127.0.0.1: two routers, each with an ingest
// object syncing on the same subject, see each other's bookings as load; garbage on the subject
// is counted and ignored; one sync per ingest object.
#include "ingest/replica_sync.h"

#include <gtest/gtest.h>
#include <nats/nats.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <thread>

#include "core/router.h"
#include "ingest/ingest_service.h"
#include "nats_server.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {
namespace {

constexpr uint32_t kBlockSize = 16;
constexpr auto kWait = std::chrono::seconds(10);

std::vector<uint32_t> Tokens(size_t blocks, uint32_t first) {
  std::vector<uint32_t> tokens(blocks * kBlockSize);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = first + static_cast<uint32_t>(i);
  return tokens;
}

// Whether `done` held at some moment within kWait. Not asked again once it held: a replica
// that hears another for the first time asks it to announce its bookings, and their Reset
// drops them for the moment before they come again (a second look then saw none: CI75, TSan).
bool Eventually(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

// One router replica: a router over workers 1 and 2, and its ingest object.
struct Replica {
  std::unique_ptr<Router> router;
  std::unique_ptr<IngestService> ingest;
  uint64_t source = 0;

  // Heartbeats off unless asked for: the other tests count every message. `queue_at`: the
  // workers' batch budget, past which routes with admission queue (0: none).
  explicit Replica(const NatsServer& server, const std::string& id,
                   IngestOptions options = {.replica_heartbeat_ms = 0, .replica_timeout_ms = 0},
                   uint64_t queue_at = 0) {
    RouterOptions router_options{.block_size = kBlockSize};
    if (queue_at > 0) router_options.queue_threshold = 1.0;
    router = *Router::Create(router_options);
    for (uint64_t w : {1, 2}) {
      EXPECT_TRUE(
          router
              ->AddWorker(
                  {.worker_id = w, .max_num_batched_tokens = queue_at, .block_size = kBlockSize})
              .ok());
    }
    ingest = *IngestService::Create(router.get(), options);
    EXPECT_TRUE(ingest->Start().ok());
    auto synced = ingest->SyncReplicas(server.url(), "kvrouter.replicas", id);
    EXPECT_TRUE(synced.ok()) << synced.status();
    source = synced.value_or(0);
  }
  ~Replica() { ingest.reset(); }  // stops publishing before the router goes

  uint64_t RequestsOn(uint64_t worker) const {
    for (const WorkerLoad& load : router->Loads()) {
      if (load.worker.worker_id == worker) return load.active_requests;
    }
    return 0;
  }
  uint64_t BlocksOn(uint64_t worker) const {
    for (const WorkerLoad& load : router->Loads()) {
      if (load.worker.worker_id == worker) return load.active_blocks;
    }
    return 0;
  }
  IngestStats Stats() const { return *ingest->Stats(source); }
};

// With its server gone, `a` books long prompts on worker 1 until one goes trimmed for the
// server not known yet: its connection then knows it is away (those before may go whole).
void BookWhileAway(Replica& a) {
  for (int i = 0; a.Stats().bookings_trimmed == 0 && i < 200; ++i) {
    ASSERT_TRUE(
        a.router->AddRequest("away-" + std::to_string(i), Tokens(1'000, 10'000 * (i + 1)), {1, 0})
            .ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(a.Stats().bookings_trimmed, 1u);
}

class ReplicaSyncTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<NatsServer>(FreePort());
    ASSERT_TRUE(server_->Start());
  }
  std::unique_ptr<NatsServer> server_;
};

// A change the transport refuses (the NATS client's buffer full while reconnecting, its
// connection closed: publish returns false) is counted, and repaired as one lost for memory:
// every booking announced again once a later change gets through. Before, the peer kept a
// freed booking until the request expiry.
TEST(ReplicaPublishTest, AChangeTheTransportRefusesIsRepairedByTheNextOneThatGetsThrough) {
  std::unique_ptr<Router> a = *Router::Create(RouterOptions{.block_size = kBlockSize});
  std::unique_ptr<Router> b = *Router::Create(RouterOptions{.block_size = kBlockSize});
  for (Router* r : {a.get(), b.get()}) {
    ASSERT_TRUE(r->AddWorker({.worker_id = 1, .block_size = kBlockSize}).ok());
  }
  auto counters = std::make_shared<SourceCounters>();
  SourceCounters heard;
  std::vector<std::vector<uint8_t>> sent;
  int refuse = 0;
  (void)PublishBookings(
      *a, "a",
      [&](std::span<const uint8_t> bytes) {
        if (refuse > 0) return --refuse, false;
        sent.emplace_back(bytes.begin(), bytes.end());
        return true;
      },
      counters);
  const auto deliver = [&] {
    for (const std::vector<uint8_t>& message : sent) ApplyReplicaMessage(*b, message, heard);
    sent.clear();
  };
  deliver();  // the announcement
  ASSERT_TRUE(a->AddRequest("r1", Tokens(2, 0), {1, 0}).ok());
  deliver();
  ASSERT_EQ(b->replica_stats().active_requests, 1u);
  refuse = 1;
  ASSERT_TRUE(a->Free("r1"));  // refused on the way
  EXPECT_TRUE(sent.empty());
  EXPECT_EQ(counters->publish_failures.load(), 1u);
  EXPECT_EQ(a->replica_stats().changes_unpublished, 1u);
  ASSERT_TRUE(a->PublishHeartbeat(1000));  // gets through: a's whole picture follows
  deliver();
  EXPECT_EQ(b->replica_stats().active_requests, 0u);
}

// A booking too large for the transport keeps its request, worker and prefill tokens and the
// leading block ids that fit; a change that fits goes as it is.
TEST(ReplicaPublishTest, ABookingTooLargeForTheTransportGoesWithItsLeadingBlocks) {
  std::vector<uint64_t> ids(10'000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = 1000 + i;
  const SequenceChange booking{.kind = SequenceChange::Kind::kAdded,
                               .request_id = "long",
                               .worker = {2, 1},
                               .block_ids = ids,
                               .prefill_tokens = 160'000};
  for (const size_t max_bytes : {size_t{4096}, size_t{65'536}}) {
    const EncodedChange fitted = EncodeReplicaChangeToFit("gw-a", booking, max_bytes);
    EXPECT_TRUE(fitted.trimmed);
    EXPECT_TRUE(fitted.fits);
    EXPECT_LE(fitted.bytes.size(), max_bytes);
    absl::StatusOr<ReplicaChange> decoded = DecodeReplicaChange(fitted.bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->request_id, "long");
    EXPECT_EQ(decoded->worker, (WorkerKey{2, 1}));
    EXPECT_EQ(decoded->prefill_tokens, 160'000u);
    ASSERT_GT(decoded->block_ids.size(), (max_bytes - 200) / 8 - 8);  // nearly all that fit
    EXPECT_TRUE(std::equal(decoded->block_ids.begin(), decoded->block_ids.end(), ids.begin()));
  }
  for (const size_t max_bytes : {size_t{0}, size_t{1} << 20}) {
    const EncodedChange whole = EncodeReplicaChangeToFit("gw-a", booking, max_bytes);
    EXPECT_EQ(whole.bytes, EncodeReplicaChange("gw-a", booking));
    EXPECT_FALSE(whole.trimmed);
    EXPECT_TRUE(whole.fits);
  }
}

// Every change but a booking's block ids fits in the smallest limit replica sync accepts, with
// the longest request and replica ids, and room is left for a short prompt's blocks.
TEST(ReplicaPublishTest, TheLongestIdsFitTheSmallestMessageLimit) {
  const std::string origin(kMaxReplicaIdBytes, 'o');
  const std::string request_id(kMaxRequestIdBytes, 'r');
  std::vector<uint64_t> ids(1'000, 7);
  for (const SequenceChange::Kind kind :
       {SequenceChange::Kind::kAdded, SequenceChange::Kind::kPrefillCompleted,
        SequenceChange::Kind::kFreed}) {
    // Every field at its largest: FlatBuffers leaves out the ones at their default.
    const SequenceChange change{.kind = kind,
                                .request_id = request_id,
                                .worker = {UINT64_MAX, UINT32_MAX},
                                .block_ids = ids,
                                .prefill_tokens = UINT64_MAX,
                                .expected_output_tokens = UINT32_MAX,
                                .heartbeat_interval_ms = UINT32_MAX,
                                .booked_ms_ago = UINT32_MAX,
                                .announced_bookings = UINT32_MAX};
    const EncodedChange fitted =
        EncodeReplicaChangeToFit(origin, change, kMinReplicaTransportMessage - kReplicaMessageRoom);
    EXPECT_TRUE(fitted.fits);
    absl::StatusOr<ReplicaChange> decoded = DecodeReplicaChange(fitted.bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_GE(decoded->block_ids.size(), 256u);  // a prompt of 4,096 tokens in blocks of 16
  }
}

// The limit is the transport's largest message less its room; while it reconnects, the
// smallest a sync accepts: what waits in its buffer goes to a server not known yet (NATS closes
// a connection for good on a message larger than its max_payload).
TEST(ReplicaPublishTest, AReconnectingTransportsLimitIsTheSmallestAccepted) {
  const size_t kSmallest = kMinReplicaTransportMessage - kReplicaMessageRoom;
  EXPECT_EQ(ReplicaMessageLimit(1 << 20, /*reconnecting=*/false), (1u << 20) - kReplicaMessageRoom);
  EXPECT_EQ(ReplicaMessageLimit(1 << 20, /*reconnecting=*/true), kSmallest);
  EXPECT_EQ(ReplicaMessageLimit(kMinReplicaTransportMessage, false), kSmallest);
  EXPECT_EQ(ReplicaMessageLimit(kMinReplicaTransportMessage, true), kSmallest);
  EXPECT_EQ(ReplicaMessageLimit(1000, false), 500u);  // a server met later, smaller still
  EXPECT_EQ(ReplicaMessageLimit(1000, true), 500u);
  EXPECT_EQ(ReplicaMessageLimit(0, false), kSmallest);  // not known: never "no limit"
}

// The transport's limit is asked at every change (a reconnection may meet a server with a
// smaller one), and each booking that goes trimmed is counted.
TEST(ReplicaPublishTest, TheLimitIsReadAtEveryChangeAndTrimmedBookingsAreCounted) {
  std::unique_ptr<Router> a = *Router::Create(RouterOptions{.block_size = kBlockSize});
  ASSERT_TRUE(a->AddWorker({.worker_id = 1, .block_size = kBlockSize}).ok());
  auto counters = std::make_shared<SourceCounters>();
  std::vector<size_t> sizes;
  size_t limit = 0;
  (void)PublishBookings(
      *a, "a", [&](std::span<const uint8_t> bytes) { return sizes.push_back(bytes.size()), true; },
      counters, [&] { return limit; });
  sizes.clear();  // the announcement
  const uint64_t announced = counters->published.load();
  ASSERT_TRUE(a->AddRequest("whole", Tokens(1'000, 0), {1, 0}).ok());
  ASSERT_EQ(sizes.size(), 1u);
  EXPECT_GT(sizes.back(), 8'000u);
  EXPECT_EQ(counters->bookings_trimmed.load(), 0u);
  limit = kMinReplicaTransportMessage - kReplicaMessageRoom;
  ASSERT_TRUE(a->AddRequest("trimmed", Tokens(1'000, 100'000), {1, 0}).ok());
  ASSERT_EQ(sizes.size(), 2u);
  EXPECT_LE(sizes.back(), limit);
  EXPECT_EQ(counters->bookings_trimmed.load(), 1u);
  ASSERT_TRUE(a->Free("trimmed"));  // a free carries no block ids: not trimmed
  EXPECT_EQ(counters->bookings_trimmed.load(), 1u);
  EXPECT_EQ(counters->published.load(), announced + 3);
  EXPECT_EQ(counters->publish_failures.load(), 0u);
}

// A change that cannot fit even without block ids is dropped and counted, not repaired: an
// announcement would fail the same way at every change.
TEST(ReplicaPublishTest, AChangeThatCanNeverFitIsDroppedNotRepaired) {
  std::unique_ptr<Router> a = *Router::Create(RouterOptions{.block_size = kBlockSize});
  ASSERT_TRUE(a->AddWorker({.worker_id = 1, .block_size = kBlockSize}).ok());
  auto counters = std::make_shared<SourceCounters>();
  int published = 0;
  (void)PublishBookings(
      *a, "a", [&](std::span<const uint8_t>) { return ++published, true; }, counters,
      [] { return size_t{96}; });
  const int announced = published;
  ASSERT_TRUE(a->AddRequest(std::string(200, 'x'), Tokens(2, 0), {1, 0}).ok());
  EXPECT_EQ(published, announced);
  EXPECT_EQ(counters->publish_failures.load(), 1u);
  EXPECT_EQ(a->replica_stats().changes_unpublished, 0u);  // nothing to repair
  ASSERT_TRUE(a->AddRequest("r2", Tokens(2, 100), {1, 0}).ok());
  EXPECT_EQ(published, announced + 1);  // sent alone: no announcement
}

// Over a server whose messages are at most 4 KiB (the default is 1 MiB), a booking of 1,000
// blocks (8 KB of block ids) reaches the peer, trimmed; before, its publication failed every
// time, and so did every announcement of the origin's bookings while it lived.
TEST(ReplicaSyncSmallPayloadTest, ABookingLargerThanTheServersMessagesReachesThePeer) {
  const std::string config = ::testing::TempDir() + "/nats_replica_small_payload.conf";
  std::ofstream(config) << "max_payload: 4096\n";
  NatsServer server(FreePort(), "", config);
  ASSERT_TRUE(server.Start());
  Replica a(server, "a"), b(server, "b");
  ASSERT_TRUE(a.router->AddRequest("long", Tokens(1'000, 0), {1, 0}).ok());
  ASSERT_TRUE(a.router->AddRequest("short", Tokens(2, 900'000), {2, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 1 && b.RequestsOn(2) == 1; }));
  EXPECT_EQ(a.Stats().publish_failures, 0u);
  // Each publication trimmed counts: b, hearing a for the first time, may ask for an
  // announcement, which sends the booking again.
  EXPECT_GE(a.Stats().bookings_trimmed, 1u);
  EXPECT_EQ(a.router->replica_stats().changes_unpublished, 0u);
}

// A server whose messages are too short for a change with the longest request id is refused
// when the sync starts, not met by changes dropped unseen.
TEST(ReplicaSyncSmallPayloadTest, AServerTooSmallForEveryChangeIsRefusedAtTheStart) {
  const std::string config = ::testing::TempDir() + "/nats_replica_tiny_payload.conf";
  std::ofstream(config) << "max_payload: 4000\n";
  NatsServer server(FreePort(), "", config);
  ASSERT_TRUE(server.Start());
  std::unique_ptr<Router> router = *Router::Create(RouterOptions{.block_size = kBlockSize});
  std::unique_ptr<IngestService> ingest = *IngestService::Create(router.get(), {});
  ASSERT_TRUE(ingest->Start().ok());
  const absl::StatusOr<uint64_t> synced =
      ingest->SyncReplicas(server.url(), "kvrouter.replicas", "a");
  ASSERT_EQ(synced.status().code(), absl::StatusCode::kFailedPrecondition) << synced.status();
  EXPECT_NE(synced.status().message().find("at most 4000 bytes"), std::string::npos)
      << synced.status();
  EXPECT_TRUE(ingest->Sources().empty());
}

// The server's limit is the one of the server the connection has now: replicas that reconnect
// to a server with smaller messages trim to it (before, a booking sized for the first server
// was refused by the client at every try).
TEST(ReplicaSyncSmallPayloadTest, AReconnectionToAServerWithSmallerMessagesTrimsToIt) {
  const int port = FreePort();
  NatsServer large(port);
  ASSERT_TRUE(large.Start());
  Replica a(large, "a"), b(large, "b");
  ASSERT_TRUE(a.router->AddRequest("r1", Tokens(2, 0), {1, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 1; }));
  large.Stop();
  const std::string config = ::testing::TempDir() + "/nats_replica_reconnect_payload.conf";
  std::ofstream(config) << "max_payload: 4096\n";
  NatsServer small(port, "", config);
  ASSERT_TRUE(small.Start());
  ASSERT_TRUE(Eventually([&] { return a.Stats().connections >= 2 && b.Stats().connections >= 2; }));
  // b hears a again (its subscription is back on the server) before the booking that matters:
  // a booking published before would be lost to b for good.
  for (int i = 0; b.RequestsOn(1) < 2 && i < 100; ++i) {
    ASSERT_TRUE(
        a.router->AddRequest("probe-" + std::to_string(i), Tokens(1, 1'000 + i), {1, 0}).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GE(b.RequestsOn(1), 2u);
  ASSERT_TRUE(a.router->AddRequest("long", Tokens(1'000, 100'000), {2, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(2) == 1; }));
  EXPECT_GE(a.Stats().bookings_trimmed, 1u);  // once per publication (announcements too)
  EXPECT_EQ(a.Stats().publish_failures, 0u);
}

// While the connection is away, long bookings go trimmed to the smallest server the sync
// accepts, in case the next server's messages are smaller. One smaller still closes the
// connection for good when the buffered booking reaches it (libnats gives up on a 'Maximum
// Payload Violation'): later changes are counted as failures, and the source closes cleanly
// (libnats' closed callback freed what the source still used: a use-after-free at its removal).
TEST(ReplicaSyncSmallPayloadTest, AConnectionTheServerClosesIsCountedAndClosesCleanly) {
  const int port = FreePort();
  NatsServer large(port);
  ASSERT_TRUE(large.Start());
  Replica a(large, "a");
  large.Stop();
  ASSERT_NO_FATAL_FAILURE(BookWhileAway(a));
  const std::string config = ::testing::TempDir() + "/nats_replica_tiny_after_reconnect.conf";
  std::ofstream(config) << "max_payload: 1024\n";
  NatsServer tiny(port, "", config);
  ASSERT_TRUE(tiny.Start());
  const uint64_t failures = a.Stats().publish_failures;
  ASSERT_TRUE(Eventually([&] {
    (void)a.router->AddRequest("probe", Tokens(1, 7), {2, 0});
    (void)a.router->Free("probe");
    return a.Stats().publish_failures > failures;
  }));
}

// `a`'s server is gone: `a` books until its connection knows it is away, then a server whose
// messages are 1 KiB comes up on `port` (kept in `tiny`): a booking buffered meanwhile makes
// libnats give the connection up, and the source's attempts to make it again fail there (too
// short for replica sync), counted.
void GiveUpOnATinyServer(Replica& a, int port, const std::string& name,
                         std::unique_ptr<NatsServer>& tiny) {
  ASSERT_NO_FATAL_FAILURE(BookWhileAway(a));
  const std::string config = ::testing::TempDir() + "/nats_replica_" + name + ".conf";
  std::ofstream(config) << "max_payload: 1024\n";
  tiny = std::make_unique<NatsServer>(port, "", config);
  ASSERT_TRUE(tiny->Start());
  ASSERT_TRUE(Eventually([&] {
    (void)a.router->AddRequest("probe", Tokens(1, 7), {2, 0});
    (void)a.router->Free("probe");
    return a.Stats().consumer_remake_failures >= 1;
  })) << "the closed connection was never made again";
}

// The connection libnats closed is made again, backing off while the server refuses it (here:
// messages too short for replica sync, each attempt counted), and once a server takes it the
// replica joins again: a peer there holds its bookings. Before, the sync stayed closed for good.
TEST(ReplicaSyncSmallPayloadTest, AConnectionTheServerClosedIsMadeAgain) {
  const int port = FreePort();
  auto large = std::make_unique<NatsServer>(port);
  ASSERT_TRUE(large->Start());
  Replica a(*large, "a");
  ASSERT_TRUE(a.router->AddRequest("kept", Tokens(2, 0), {2, 0}).ok());
  large->Stop();
  std::unique_ptr<NatsServer> tiny;
  ASSERT_NO_FATAL_FAILURE(GiveUpOnATinyServer(a, port, "tiny_then_large", tiny));
  EXPECT_EQ(a.Stats().consumer_remakes, 0u);
  tiny.reset();
  large = std::make_unique<NatsServer>(port);
  ASSERT_TRUE(large->Start());
  Replica b(*large, "b");
  ASSERT_TRUE(Eventually([&] { return a.Stats().consumer_remakes == 1; }));
  const uint64_t booked = a.RequestsOn(1) + a.RequestsOn(2);
  EXPECT_TRUE(Eventually([&] { return b.RequestsOn(1) + b.RequestsOn(2) == booked; }))
      << b.RequestsOn(1) + b.RequestsOn(2) << " of " << booked << " bookings";
  // And a's new bookings reach b as they are made.
  ASSERT_TRUE(a.router->AddRequest("after", Tokens(2, 500), {2, 0}).ok());
  EXPECT_TRUE(Eventually([&] { return b.RequestsOn(1) + b.RequestsOn(2) == booked + 1; }));
}

// A publisher the caller set on the router while the connection was being made again stays:
// the remade connection carries the sync's messages only, and no longer the router's changes.
TEST(ReplicaSyncSmallPayloadTest, APublisherSetWhileTheConnectionIsRemadeIsKept) {
  const int port = FreePort();
  auto large = std::make_unique<NatsServer>(port);
  ASSERT_TRUE(large->Start());
  std::atomic<int> heard{0};  // by a's own publisher, which outlives a's sync
  Replica a(*large, "a");
  large->Stop();
  std::unique_ptr<NatsServer> tiny;
  ASSERT_NO_FATAL_FAILURE(GiveUpOnATinyServer(a, port, "tiny_publisher_kept", tiny));
  (void)a.router->SetSequenceObserver("a-own-bus", [&](const SequenceChange& c) {
    heard += c.request_id == "after";  // (an answer to b's join may come at any time)
  });
  tiny.reset();
  large = std::make_unique<NatsServer>(port);
  ASSERT_TRUE(large->Start());
  Replica b(*large, "b");
  ASSERT_TRUE(Eventually([&] { return a.Stats().consumer_remakes == 1; }));
  ASSERT_TRUE(a.router->AddRequest("after", Tokens(2, 500), {2, 0}).ok());
  EXPECT_GE(heard.load(), 1);  // the caller's publisher has it
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(b.RequestsOn(1) + b.RequestsOn(2), 0u);  // the sync no longer publishes a's
}

// After an outage each replica joins again (its bookings announced, a SyncRequest): what it
// published meanwhile went trimmed (the next server was not known) or reached a server its
// peers had not resubscribed to yet, and nothing else would have repaired it before the
// request expiry. Peers then hold its bookings whole.
TEST(ReplicaSyncRestartTest, AfterAnOutageEachReplicaJoinsAgain) {
  const int port = FreePort();
  NatsServer server(port);
  ASSERT_TRUE(server.Start());
  Replica a(server, "a"), b(server, "b");
  ASSERT_TRUE(a.router->AddRequest("before", Tokens(2, 0), {1, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 1; }));
  server.Stop();
  ASSERT_NO_FATAL_FAILURE(BookWhileAway(a));
  ASSERT_TRUE(server.Start());
  const uint64_t booked = a.RequestsOn(1), blocks = a.BlocksOn(1);
  EXPECT_TRUE(Eventually([&] { return b.RequestsOn(1) == booked && b.BlocksOn(1) == blocks; }))
      << b.RequestsOn(1) << " of " << booked << " requests, " << b.BlocksOn(1) << " of " << blocks
      << " blocks";
}

TEST_F(ReplicaSyncTest, EachReplicaSeesTheOthersBookings) {
  Replica a(*server_, "a"), b(*server_, "b");
  ASSERT_TRUE(a.router->AddRequest("r1", Tokens(4, 0), {1, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 1; }));
  ASSERT_TRUE(b.router->AddRequest("r2", Tokens(2, 500), {2, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return a.RequestsOn(2) == 1; }));
  EXPECT_EQ(a.router->active_requests(), 2u);
  EXPECT_EQ(b.router->active_requests(), 2u);

  EXPECT_TRUE(a.router->Free("r1"));
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 0; }));
  EXPECT_TRUE(b.router->MarkPrefillCompleted("r2"));
  EXPECT_TRUE(b.router->Free("r2"));
  ASSERT_TRUE(Eventually([&] { return a.router->active_requests() == 0; }));

  // Every change was published once and applied by the other, none came back (no echo): a
  // published its Reset and SyncRequest on joining (to nobody), its answer to b's (a Reset,
  // and Added r1 if r1 was booked by then), Added, Freed; b its Reset and SyncRequest,
  // Added, PrefillCompleted, Freed.
  const uint64_t answered_with_r1 = a.Stats().published - 5;
  EXPECT_LE(answered_with_r1, 1u);
  EXPECT_EQ(b.Stats().published, 5u);
  EXPECT_TRUE(Eventually([&] { return a.Stats().events_applied == 5; }));
  EXPECT_EQ(b.Stats().events_applied, 3u + answered_with_r1);
  EXPECT_EQ(a.router->replica_stats().changes_applied, 5u);
  EXPECT_EQ(a.Stats().publish_failures + b.Stats().publish_failures, 0u);
}

TEST_F(ReplicaSyncTest, GarbageAndUnknownWorkersAreCountedAndTheRestApplies) {
  Replica a(*server_, "a");
  natsConnection* other = nullptr;
  ASSERT_EQ(NATS_OK, natsConnection_ConnectTo(&other, server_->url().c_str()));
  const std::vector<uint8_t> garbage = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<uint64_t> ids = {11, 12};
  const std::vector<uint8_t> unknown_worker =
      EncodeReplicaChange("c", {.kind = SequenceChange::Kind::kAdded,
                                .request_id = "x",
                                .worker = {9, 0},
                                .block_ids = ids});
  const std::vector<uint8_t> good = EncodeReplicaChange("c", {.kind = SequenceChange::Kind::kAdded,
                                                              .request_id = "y",
                                                              .worker = {2, 0},
                                                              .block_ids = ids});
  for (const auto* message : {&garbage, &unknown_worker, &good}) {
    ASSERT_EQ(NATS_OK, natsConnection_Publish(other, "kvrouter.replicas", message->data(),
                                              static_cast<int>(message->size())));
  }
  ASSERT_EQ(NATS_OK, natsConnection_Flush(other));
  ASSERT_TRUE(Eventually([&] { return a.Stats().messages == 3; }));
  const IngestStats stats = a.Stats();
  EXPECT_EQ(stats.rejected[static_cast<int>(IngestReject::kBadFlatBuffers)], 1u);
  EXPECT_EQ(stats.rejected[static_cast<int>(IngestReject::kIndexRejected)], 1u);
  EXPECT_EQ(stats.events_applied, 1u);
  EXPECT_EQ(a.RequestsOn(2), 1u);
  // The router counts both rejections too, the undecodable one included (as its metrics say).
  EXPECT_EQ(a.router->replica_stats().changes_rejected, 2u);
  EXPECT_EQ(a.router->replica_stats().changes_applied, 1u);
  natsConnection_Destroy(other);
}

TEST_F(ReplicaSyncTest, OneSyncPerIngestObject) {
  Replica a(*server_, "a");
  EXPECT_EQ(a.ingest->SyncReplicas(server_->url(), "other", "a2").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.ingest->SyncReplicas(server_->url(), "other", "").status().code(),
            absl::StatusCode::kInvalidArgument);
  // Once stopped (a farewell Reset published), the router keeps working and publishes
  // nothing more.
  const uint64_t published = a.Stats().published;  // Reset and SyncRequest, on joining
  EXPECT_EQ(published, 2u);
  a.ingest->Stop();
  EXPECT_EQ(a.Stats().published, published + 1);
  EXPECT_TRUE(a.router->AddRequest("after", Tokens(1, 0), {1, 0}).ok());
  EXPECT_EQ(a.Stats().published, published + 1);
}

// A replica whose sync stops no longer hears its peers: what it held from them goes at once
// (their frees would never come: they stayed until the request expiry), and it tracks none.
TEST_F(ReplicaSyncTest, AReplicaWhoseSyncStopsForgetsThePeersBookings) {
  Replica a(*server_, "a"), b(*server_, "b");
  ASSERT_TRUE(b.router->AddRequest("r1", Tokens(4, 0), {1, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return a.RequestsOn(1) == 1; }));
  a.ingest->Stop();
  EXPECT_EQ(a.RequestsOn(1), 0u);
  EXPECT_EQ(a.router->replica_stats().active_requests, 0u);
  EXPECT_EQ(a.router->replica_stats().live, 0u);
  EXPECT_EQ(b.router->active_requests(), 1u);  // b's own booking stays
}

// Liveness: with heartbeats every 100 ms and a 1 s timeout, a replica that only books once
// stays alive for as long as it runs (its heartbeats keep it so), and its bookings go within
// the timeout once it is gone, without any message saying so (it dies: its publisher is
// removed first, so that stopping its ingest says no farewell).
TEST_F(ReplicaSyncTest, ADeadReplicasBookingsAreDroppedAfterTheTimeout) {
  // (A 400 ms timeout expired the live replica once, on a machine running CI beside it.)
  const IngestOptions live{.replica_heartbeat_ms = 100, .replica_timeout_ms = 1000};
  Replica b(*server_, "b", live);
  auto a = std::make_unique<Replica>(*server_, "a", live);
  ASSERT_TRUE(a->router->AddRequest("r1", Tokens(4, 0), {1, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 1; }));
  ASSERT_TRUE(Eventually([&] { return b.router->replica_stats().live == 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // three timeouts
  EXPECT_EQ(b.RequestsOn(1), 1u);
  EXPECT_EQ(b.router->replica_stats().expired, 0u);
  // Reset and SyncRequest on joining, a Reset answering a's: heartbeats are not counted.
  EXPECT_EQ(b.Stats().published, 3u);

  const auto killed = std::chrono::steady_clock::now();
  a->router->SilenceSequenceObserverForTesting();  // no heartbeat, no farewell, no Free
  a.reset();
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 0; }));
  const auto took = std::chrono::steady_clock::now() - killed;
  // Not before the timeout: counted from a's last heartbeat, one interval (100 ms) before it
  // was silenced, or more when a's timer ran late (allowed for: 400 ms).
  EXPECT_GE(took, std::chrono::milliseconds(1000 - 100 - 400));
  const Router::ReplicaStats stats = b.router->replica_stats();
  EXPECT_EQ(stats.expired, 1u);
  EXPECT_EQ(stats.live, 0u);
  EXPECT_EQ(stats.active_requests, 0u);
}

// A replica's first heartbeat goes out as soon as its sync starts, and every change it
// publishes after it carries its interval: one that dies before its second heartbeat (within
// the 1 s interval here) still has its bookings dropped, three intervals after it fell silent.
TEST_F(ReplicaSyncTest, AReplicaThatDiesBeforeItsSecondHeartbeatIsStillExpired) {
  Replica b(*server_, "b", {.replica_heartbeat_ms = 0, .replica_timeout_ms = 400});
  auto a = std::make_unique<Replica>(
      *server_, "a", IngestOptions{.replica_heartbeat_ms = 1000, .replica_timeout_ms = 0});
  ASSERT_TRUE(a->router->AddRequest("r1", Tokens(4, 0), {1, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 1; }));
  EXPECT_EQ(b.router->replica_stats().live, 1u);  // the heartbeat came before the booking

  a->router->SilenceSequenceObserverForTesting();  // dies: no heartbeat, farewell or Free
  a.reset();
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 0; }));
  EXPECT_EQ(b.router->replica_stats().expired, 1u);
  EXPECT_EQ(b.router->replica_stats().active_requests, 0u);
}

// nats-server gone for longer than the timeout: each replica expires the other and drops its
// bookings, though both live on. Once the server is back, each hears the other again, asks it
// to announce its bookings, and holds them again.
TEST_F(ReplicaSyncTest, BookingsDroppedDuringAnOutageComeBackAfterIt) {
  // Windows wide enough that a loaded machine does not expire a live replica besides.
  const IngestOptions live{.replica_heartbeat_ms = 100, .replica_timeout_ms = 1000};
  Replica a(*server_, "a", live);
  Replica b(*server_, "b", live);
  ASSERT_TRUE(a.router->AddRequest("ra", Tokens(4, 0), {1, 0}).ok());
  ASSERT_TRUE(b.router->AddRequest("rb", Tokens(4, 100), {2, 0}).ok());
  const auto holds_the_others = [](const Replica& r) {
    return r.router->replica_stats().active_requests == 1;
  };
  ASSERT_TRUE(Eventually([&] { return holds_the_others(a) && holds_the_others(b); }));

  server_->Stop();
  ASSERT_TRUE(Eventually([&] {
    return a.router->replica_stats().active_requests == 0 &&
           b.router->replica_stats().active_requests == 0;
  }));
  ASSERT_TRUE(server_->Start());
  EXPECT_TRUE(Eventually([&] { return holds_the_others(a) && holds_the_others(b); }))
      << "a holds " << a.router->replica_stats().active_requests << ", b holds "
      << b.router->replica_stats().active_requests << " of the other's bookings";
  EXPECT_EQ(a.RequestsOn(2), 1u);
  EXPECT_EQ(b.RequestsOn(1), 1u);
  EXPECT_EQ(a.router->replica_stats().expired, 1u);
  EXPECT_EQ(b.router->replica_stats().expired, 1u);
}

// A replica stopped gracefully (its ingest stopped) says farewell: its peers drop its
// bookings at once, long before the liveness timeout (60 s here) could.
TEST_F(ReplicaSyncTest, AStoppedReplicasBookingsGoAtOnce) {
  const IngestOptions live{.replica_heartbeat_ms = 50, .replica_timeout_ms = 60'000};
  Replica b(*server_, "b", live);
  auto a = std::make_unique<Replica>(*server_, "a", live);
  ASSERT_TRUE(a->router->AddRequest("r1", Tokens(4, 0), {1, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 1; }));
  a->ingest->Stop();
  ASSERT_TRUE(Eventually([&] { return b.RequestsOn(1) == 0; }));
  EXPECT_EQ(b.router->replica_stats().active_requests, 0u);
  EXPECT_EQ(b.router->replica_stats().expired, 0u);  // dropped by the farewell, not expired
  EXPECT_EQ(b.router->replica_stats().live, 0u);     // and never will be: no longer tracked
  EXPECT_EQ(a->RequestsOn(1), 1u);                   // its own booking is its own business
}

// A callback the loop thread runs (here a route admitted when a replica's change freed
// capacity) may stop the ingest, while another thread stops it too: both return. Stop held a
// lock while it waited for the loop to end, which the callback's Stop then waited for.
TEST_F(ReplicaSyncTest, AStopFromALoopCallbackWhileAnotherThreadStopsReturns) {
  const IngestOptions options{.replica_heartbeat_ms = 0, .replica_timeout_ms = 0};
  Replica a(*server_, "a", options);
  Replica b(*server_, "b", options, /*queue_at=*/10);
  ASSERT_TRUE(a.router->AddRequest("r1", Tokens(3, 0), {1, 0}).ok());
  ASSERT_TRUE(a.router->AddRequest("r2", Tokens(3, 100), {2, 0}).ok());
  ASSERT_TRUE(Eventually([&] { return b.router->active_requests() == 2; }));
  std::atomic<bool> in_callback = false, callback_stopped = false;
  std::thread::id callback_thread;
  b.router->FindBestMatchAsync(Tokens(3, 500), {.with_admission = true, .request_id = "waits"},
                               [&](absl::StatusOr<RouteDecision>) {
                                 callback_thread = std::this_thread::get_id();
                                 in_callback = true;
                                 // Gives the other thread's Stop time to start waiting.
                                 std::this_thread::sleep_for(std::chrono::milliseconds(200));
                                 b.ingest->Stop();
                                 callback_stopped = true;
                               });
  ASSERT_EQ(b.router->pending_count(), 1u);
  ASSERT_TRUE(a.router->MarkPrefillCompleted("r2"));  // b admits "waits" on its loop thread
  ASSERT_TRUE(Eventually([&] { return in_callback.load(); }));
  std::atomic<bool> stopped = false;
  std::thread stopper([&] {
    b.ingest->Stop();
    stopped = true;
  });
  const bool returned = Eventually([&] { return stopped.load(); }) &&
                        Eventually([&] { return callback_stopped.load(); });
  if (!returned) {
    ADD_FAILURE() << "Stop never returned";
    std::abort();  // the stopper cannot be joined
  }
  stopper.join();
  EXPECT_NE(callback_thread, std::this_thread::get_id());  // b's loop thread ran it
}

}  // namespace
}  // namespace kvrouter

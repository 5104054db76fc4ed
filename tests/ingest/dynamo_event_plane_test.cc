// Dynamo's KV event plane: the messages dynamo.llm.KvEventPublisher (ai-dynamo-runtime 1.6.1)
// publishes on NATS, decoded, and applied by a NATS subscription beside native EventBatches.
// The byte vectors are three messages that publisher sent to a nats-server here (worker 7, dp
// rank 1, kv_block_size 4): stored blocks [1..4] [5..8] under engine hashes 111 and 222; a
// stored block [9..12] under LoRA "adapter-a", parent 222, engine hash 333; the removal of 333.
#include <gtest/gtest.h>
#include <nats/nats.h>

#include <chrono>
#include <string>
#include <thread>
#include <variant>

#include "core/hashing.h"
#include "core/router.h"
#include "ingest/ingest_service.h"
#include "nats_ingest_fixture.h"
#include "slow_nats_server.h"
#include "wire/engine_events.h"

namespace kvrouter {
namespace {

std::vector<uint8_t> FromHex(std::string_view hex) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<uint8_t>(std::stoul(std::string(hex.substr(i, 2)), nullptr, 16)));
  }
  return out;
}

// sequence 0: stored [111, 222], no parent.
constexpr std::string_view kStored =
    "85ac7075626c69736865725f6964cf0002f73c6780987fa873657175656e636500ac7075626c69736865645f61"
    "74cf000001a234567b69a5746f706963a96b762d6576656e7473a77061796c6f6164c4e99184a9776f726b6572"
    "5f696407ac73746f726167655f74696572a6646576696365b07265736964656e63795f646f6d61696ea6776f72"
    "6b6572a56576656e7483a86576656e745f696401a46461746181a673746f72656483ab706172656e745f686173"
    "68c0ae73746172745f706f736974696f6ec0a6626c6f636b739283aa626c6f636b5f686173686fab746f6b656e"
    "735f68617368cfcb38e4d7fb2dca5cad6d6d5f65787472615f696e666fc083aa626c6f636b5f68617368ccdeab"
    "746f6b656e735f68617368cfe8d3ec39b907b74cad6d6d5f65787472615f696e666fc0a764705f72616e6b01";
// sequence 1: stored [333] under LoRA "adapter-a", parent 222.
constexpr std::string_view kStoredLora =
    "85ac7075626c69736865725f6964cf0002f73c6780987fa873657175656e636501ac7075626c69736865645f61"
    "74cf000001a234567b69a5746f706963a96b762d6576656e7473a77061796c6f6164c4ba9184a9776f726b6572"
    "5f696407ac73746f726167655f74696572a6646576696365b07265736964656e63795f646f6d61696ea6776f72"
    "6b6572a56576656e7483a86576656e745f696402a46461746181a673746f72656483ab706172656e745f686173"
    "68ccdeae73746172745f706f736974696f6ec0a6626c6f636b739183aa626c6f636b5f68617368cd014dab746f"
    "6b656e735f68617368cf9799522907da1e6bad6d6d5f65787472615f696e666fc0a764705f72616e6b01";
// sequence 2: removed [333].
constexpr std::string_view kRemoved =
    "85ac7075626c69736865725f6964cf0002f73c6780987fa873657175656e636502ac7075626c69736865645f61"
    "74cf000001a234567b69a5746f706963a96b762d6576656e7473a77061796c6f6164c4739184a9776f726b6572"
    "5f696407ac73746f726167655f74696572a6646576696365b07265736964656e63795f646f6d61696ea6776f72"
    "6b6572a56576656e7483a86576656e745f696403a46461746181a772656d6f76656481ac626c6f636b5f686173"
    "68657391cd014da764705f72616e6b01";
// Derived from kRemoved, not sent by the wheel: its event's data replaced by "cleared" (what
// the decoder takes for an AllBlocksCleared), event id 4; WithSequence renumbers it.
constexpr std::string_view kCleared =
    "85ac7075626c69736865725f6964cf0002f73c6780987fa873657175656e636502ac7075626c69736865645f6174"
    "cf000001a234567b69a5746f706963a96b762d6576656e7473a77061796c6f6164c4609184a9776f726b65725f69"
    "6407ac73746f726167655f74696572a6646576696365b07265736964656e63795f646f6d61696ea6776f726b6572"
    "a56576656e7483a86576656e745f696404a464617461a7636c6561726564a764705f72616e6b01";

constexpr WorkerKey kRank{7, 1};

// The message with its sequence number (a positive fixint, < 128) replaced.
std::vector<uint8_t> WithSequence(std::string_view hex, uint8_t sequence) {
  std::vector<uint8_t> bytes = FromHex(hex);
  const std::vector<uint8_t> key = FromHex("a873657175656e6365");  // the key "sequence"
  auto it = std::search(bytes.begin(), bytes.end(), key.begin(), key.end());
  EXPECT_NE(it, bytes.end());
  *(it + static_cast<std::ptrdiff_t>(key.size())) = sequence;
  return bytes;
}

TEST(DynamoEventPlane, DecodesTheWheelsMessages) {
  auto stored = DecodeDynamoEventPlane(FromHex(kStored));
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->sequence, 0u);
  EXPECT_GT(stored->published_at_ms, 1'700'000'000'000u);
  ASSERT_EQ(stored->events.size(), 1u);
  const KvEvent& e = stored->events[0];
  EXPECT_EQ(e.worker, kRank);
  EXPECT_EQ(e.tier, Tier::kDevice);
  EXPECT_EQ(e.event_id, 1u);
  const auto& s = std::get<StoredEvent>(e.data);
  EXPECT_FALSE(s.parent_hash.has_value());
  EXPECT_EQ(s.block_hashes, (std::vector<uint64_t>{111, 222}));
  // Dynamo's local hashes are kvrouter's, bit for bit.
  const std::vector<uint32_t> tokens{1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_EQ(s.local_hashes, ComputeLocalBlockHashes(tokens, 4));

  auto lora = DecodeDynamoEventPlane(FromHex(kStoredLora));
  ASSERT_TRUE(lora.ok()) << lora.status();
  const auto& l = std::get<StoredEvent>(lora->events[0].data);
  EXPECT_EQ(l.parent_hash, 222u);
  const std::vector<uint32_t> more{9, 10, 11, 12};
  EXPECT_EQ(l.local_hashes, ComputeLocalBlockHashes(more, 4, {.lora_name = "adapter-a"}));

  auto removed = DecodeDynamoEventPlane(FromHex(kRemoved));
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(removed->publisher_id, stored->publisher_id);
  EXPECT_EQ(std::get<RemovedEvent>(removed->events[0].data).block_hashes,
            (std::vector<uint64_t>{333}));
}

TEST(DynamoEventPlane, RejectsWhatIsNotOneWithAReason) {
  // Not msgpack at all (a truncated message): DataLoss.
  std::vector<uint8_t> cut = FromHex(kStored);
  cut.resize(cut.size() / 2);
  EXPECT_TRUE(absl::IsDataLoss(DecodeDynamoEventPlane(cut).status()));
  EXPECT_TRUE(absl::IsDataLoss(DecodeDynamoEventPlane(std::vector<uint8_t>{}).status()));
  // msgpack of another shape: InvalidArgument naming the problem.
  const auto not_a_map = DecodeDynamoEventPlane(FromHex("93010203"));
  EXPECT_TRUE(absl::IsInvalidArgument(not_a_map.status()));
  EXPECT_NE(not_a_map.status().message().find("envelope is not a map"), std::string::npos);
  // {"publisher_id": 1} and nothing else.
  const std::vector<uint8_t> no_sequence = FromHex("81ac7075626c69736865725f696401");
  const auto missing = DecodeDynamoEventPlane(no_sequence);
  EXPECT_NE(missing.status().message().find("missing field sequence"), std::string::npos);
}

// The message as another publisher (a restarted worker's new process) sends it.
std::vector<uint8_t> FromAnotherPublisher(std::string_view hex) {
  std::vector<uint8_t> bytes = FromHex(hex);
  const std::vector<uint8_t> key = FromHex("ac7075626c69736865725f6964cf");  // "publisher_id", u64
  auto it = std::search(bytes.begin(), bytes.end(), key.begin(), key.end());
  EXPECT_NE(it, bytes.end());
  *(it + static_cast<std::ptrdiff_t>(key.size()) + 7) ^= 0x5a;  // its lowest byte
  return bytes;
}

// The message with its event's dp rank (a positive fixint, < 128) replaced.
std::vector<uint8_t> WithDpRank(std::vector<uint8_t> bytes, uint8_t dp_rank) {
  const std::vector<uint8_t> key = FromHex("a764705f72616e6b");  // the key "dp_rank"
  auto it = std::search(bytes.begin(), bytes.end(), key.begin(), key.end());
  EXPECT_NE(it, bytes.end());
  *(it + static_cast<std::ptrdiff_t>(key.size())) = dp_rank;
  return bytes;
}

class DynamoNatsTest : public NatsIngestFixture {
 protected:
  DynamoNatsTest() : NatsIngestFixture(4) {}

  void SetUp() override {
    NatsIngestFixture::SetUp();
    auto source = ingest_->SubscribeNats(server_->url(), "namespace.kvr.>");
    ASSERT_TRUE(source.ok()) << source.status();
    source_ = *source;
  }

  void Publish(const std::vector<uint8_t>& data) {
    NatsIngestFixture::Publish("namespace.kvr.component.worker.endpoint.generate.kv-events", data);
  }

  IngestStats WaitForMessages(uint64_t messages) {
    return NatsIngestFixture::WaitForMessages(source_, messages);
  }

  // The rank's match on the base model's tokens 1..12 (or `tokens`).
  WorkerMatch MatchOfRank(WorkerKey rank = kRank, const std::vector<uint32_t>& tokens = {
                                                      1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}) {
    std::vector<WorkerMatch> matches;
    router_->LookUp(ComputeLocalBlockHashes(tokens, 4), matches);
    for (const WorkerMatch& m : matches) {
      if (m.worker == rank) return m;
    }
    return WorkerMatch{.worker = rank};
  }
  uint32_t Depth(WorkerKey rank = kRank) { return MatchOfRank(rank).device_blocks; }

  // The source's stats once `unknown` ranks are flagged (or 10 s have passed: then a failure).
  // `source` 0: the totals of every source.
  IngestStats WaitForUnknown(uint64_t unknown) { return WaitForUnknown(unknown, source_); }
  IngestStats WaitForUnknown(uint64_t unknown, uint64_t source) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    IngestStats stats = *ingest_->Stats(source);
    while (stats.state_unknown != unknown && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      stats = *ingest_->Stats(source);
    }
    EXPECT_EQ(unknown, stats.state_unknown);
    return stats;
  }

  uint64_t source_ = 0;
};

TEST_F(DynamoNatsTest, AppliesTheWheelsMessagesInOrder) {
  Publish(FromHex(kStored));
  Publish(FromHex(kStoredLora));
  IngestStats stats = WaitForMessages(2);
  EXPECT_EQ(2u, stats.events_applied);
  EXPECT_EQ(2u, Depth());
  // The LoRA block hangs under block 222 with its LoRA hash: not on the base model's path,
  // but held (the rank's tree size counts it).
  EXPECT_EQ(3u, MatchOfRank().tree_size);
  Publish(FromHex(kRemoved));
  stats = WaitForMessages(3);
  EXPECT_EQ(3u, stats.events_applied);
  EXPECT_EQ(0u, stats.gaps);
  EXPECT_EQ(0u, stats.rejected[static_cast<int>(IngestReject::kBadMsgpack)]);
  EXPECT_GE(stats.lag_samples, 3u);
}

TEST_F(DynamoNatsTest, AGapClearsThePublishersRanksAndAnOldSequenceIsStale) {
  Publish(FromHex(kStored));
  WaitForMessages(1);
  EXPECT_EQ(2u, Depth());
  // Sequences 1 to 4 never arrive: the rank's blocks are unknown now, so they are cleared;
  // the message after the gap is applied.
  Publish(WithSequence(kRemoved, 5));
  IngestStats stats = WaitForMessages(2);
  EXPECT_EQ(1u, stats.gaps);
  EXPECT_EQ(4u, stats.missed_messages);
  EXPECT_EQ(1u, stats.recoveries);
  EXPECT_EQ(0u, Depth());
  // A sequence already passed is dropped.
  Publish(FromHex(kStored));
  stats = WaitForMessages(3);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kStaleSequence)]);
  EXPECT_EQ(0u, Depth());
}

TEST_F(DynamoNatsTest, ARankHeardFromANewPublisherIsClearedFirst) {
  Publish(FromHex(kStored));
  Publish(FromHex(kStoredLora));
  WaitForMessages(2);
  EXPECT_EQ(3u, MatchOfRank().tree_size);
  // The worker restarted: its new process publishes under a new id from sequence 0. What the
  // old process held is gone (the LoRA block above), so the rank is cleared before the new
  // one's events apply.
  Publish(FromAnotherPublisher(kStored));
  const IngestStats stats = WaitForMessages(3);
  EXPECT_EQ(1u, stats.restarts);
  EXPECT_EQ(0u, stats.gaps);
  EXPECT_EQ(2u, Depth());
  EXPECT_EQ(2u, MatchOfRank().tree_size);
}

TEST_F(DynamoNatsTest, AGapFlagsTheRanksUntilTheEngineClearsThem) {
  Publish(FromHex(kStored));
  Publish(WithSequence(kRemoved, 5));  // 1..4 lost
  IngestStats stats = WaitForMessages(2);
  EXPECT_EQ(1u, stats.state_unknown);
  // The engine clears the rank (e.g. it reset its prefix cache): the index is exact again.
  Publish(WithSequence(kCleared, 6));
  stats = WaitForMessages(3);
  EXPECT_EQ(0u, stats.state_unknown);
  EXPECT_EQ(1u, stats.gaps);
}

TEST_F(DynamoNatsTest, APublisherFirstHeardAboveZeroFlagsItsRanksUntilTheyAreCleared) {
  // The worker ran before this router subscribed: its messages 0..4 were never heard, so what
  // its rank held then is unknown; what is heard applies, flagged.
  Publish(WithSequence(kStored, 5));
  IngestStats stats = WaitForMessages(1);
  EXPECT_EQ(1u, stats.state_unknown);
  EXPECT_EQ(0u, stats.gaps);  // nothing was lost in transit
  EXPECT_EQ(2u, Depth());
  Publish(WithSequence(kCleared, 6));
  stats = WaitForMessages(2);
  EXPECT_EQ(0u, stats.state_unknown);
  EXPECT_EQ(0u, Depth());
}

// A subscription its server never confirms is removed (its caller gets UNAVAILABLE, no source
// id). What it applied meanwhile stored blocks and flagged their rank (a publisher first heard
// above message 0). No event for them comes through it again: the flag must leave the totals
// with the source (it stayed in state_unknown for good), and the blocks the index (they stayed,
// over-reporting for good once the engine evicts them).
TEST_F(DynamoNatsTest, AnUnconfirmedSubscriptionLeavesNoFlagBehind) {
  SlowNatsServer slow(FreePort());
  ASSERT_TRUE(slow.listening());
  absl::StatusOr<uint64_t> removed;
  std::thread subscriber([&] {
    removed = ingest_->SubscribeNats("nats://127.0.0.1:" + std::to_string(slow.port()), "kv");
  });
  const bool delivered =
      slow.Accept(std::chrono::seconds(10)) && slow.Answer(std::chrono::seconds(10)) &&
      slow.DeliverUnconfirmed(WithSequence(kStored, 5), std::chrono::seconds(10));
  // Applied and flagged while the source is listed, before the confirmation times out (5 s:
  // the connection stays up, so that no loss clears the rank).
  if (delivered) WaitForUnknown(1, /*source=*/0);
  const uint32_t depth = Depth();
  subscriber.join();
  ASSERT_TRUE(delivered);
  EXPECT_EQ(2u, depth);
  EXPECT_EQ(0u, Depth());
  EXPECT_EQ(absl::StatusCode::kUnavailable, removed.status().code()) << removed.status();
  EXPECT_EQ(0u, ingest_->Stats(0)->state_unknown);
  EXPECT_EQ(0u, ingest_->Stats(source_)->state_unknown);
}

// A publisher heard from its message 0 holds nothing on a rank but what its messages store:
// blocks the rank held before (here stored on the router directly, as a snapshot restored from
// before the worker restarted would hold them) are an older process's and must go, on each rank
// the publisher speaks for, when it first does. They stayed, unflagged.
TEST_F(DynamoNatsTest, APublisherHeardFromZeroClearsWhatItsRanksHeldBefore) {
  constexpr WorkerKey kOtherRank{7, 2};
  const std::vector<uint32_t> old_prompt{101, 102, 103, 104, 105, 106, 107, 108};
  for (const WorkerKey rank : {kRank, kOtherRank}) {
    StoredEvent old_blocks{.block_hashes = {901, 902}, .token_ids = old_prompt};
    ASSERT_TRUE(router_->ApplyEvent({.worker = rank, .data = std::move(old_blocks)}).ok());
    ASSERT_EQ(2u, MatchOfRank(rank, old_prompt).device_blocks);
  }
  Publish(FromHex(kStored));  // message 0, dp rank 1
  IngestStats stats = WaitForMessages(1);
  EXPECT_EQ(2u, Depth());
  EXPECT_EQ(0u, MatchOfRank(kRank, old_prompt).device_blocks);
  EXPECT_EQ(2u, MatchOfRank(kRank).tree_size);  // its own blocks only
  // The other rank is the publisher's too, but not spoken for yet: it keeps what it holds.
  EXPECT_EQ(2u, MatchOfRank(kOtherRank, old_prompt).device_blocks);
  // Message 1 speaks for dp rank 2 first: the old blocks go before its own apply.
  Publish(WithDpRank(WithSequence(kStored, 1), 2));
  stats = WaitForMessages(2);
  EXPECT_EQ(2u, Depth(kOtherRank));
  EXPECT_EQ(0u, MatchOfRank(kOtherRank, old_prompt).device_blocks);
  EXPECT_EQ(2u, MatchOfRank(kOtherRank).tree_size);
  // Heard from its start, nothing lost: exact, and no restart.
  EXPECT_EQ(0u, stats.state_unknown);
  EXPECT_EQ(0u, stats.restarts);
  EXPECT_EQ(0u, stats.gaps);
  EXPECT_EQ(2u, Depth());  // the first rank's own blocks stay
}

// A publisher heard from its message 0 that then loses messages: they may have stored blocks
// on a rank it had not spoken for, so that rank is flagged when it first does (it was cleared
// as a fresh one and left unflagged, the lost blocks missing for good); and cleared all the
// same, for what it held before (a restored snapshot's blocks of an older process) is not the
// publisher's (flagging alone kept them).
TEST_F(DynamoNatsTest, ARankFirstHeardAfterAGapIsClearedAndFlagged) {
  constexpr WorkerKey kOtherRank{7, 2};
  const std::vector<uint32_t> old_prompt{101, 102, 103, 104, 105, 106, 107, 108};
  StoredEvent old_blocks{.block_hashes = {901, 902}, .token_ids = old_prompt};
  ASSERT_TRUE(router_->ApplyEvent({.worker = kOtherRank, .data = std::move(old_blocks)}).ok());
  Publish(FromHex(kStored));  // message 0, dp rank 1
  WaitForMessages(1);
  Publish(WithDpRank(WithSequence(kStored, 3), 2));  // 1 and 2 lost; dp rank 2 first heard
  const IngestStats stats = WaitForMessages(2);
  EXPECT_EQ(1u, stats.gaps);
  EXPECT_EQ(2u, stats.state_unknown);  // rank 1 lost with the gap, rank 2 unknown
  EXPECT_EQ(2u, Depth(kOtherRank));    // what is heard applies
  EXPECT_EQ(0u, MatchOfRank(kOtherRank, old_prompt).device_blocks);  // the old blocks went
  EXPECT_EQ(2u, MatchOfRank(kOtherRank).tree_size);
  Publish(WithDpRank(WithSequence(kCleared, 4), 2));
  EXPECT_EQ(1u, WaitForMessages(3).state_unknown);  // rank 2 cleared by its engine: known
}

// A removed worker's engine may never clear its ranks: flagged, they stayed counted in
// state_unknown for good (and a daemon's /healthz said "degraded" until it restarted). Ranks the
// router drops are no longer counted, even as their engine goes on speaking, until added back.
TEST_F(DynamoNatsTest, FlagsOnRanksTheRouterDroppedAreNotCounted) {
  Publish(FromHex(kStored));                         // message 0, dp rank 1
  Publish(WithDpRank(WithSequence(kStored, 3), 2));  // 1 and 2 lost: both ranks flagged
  ASSERT_EQ(2u, WaitForMessages(2).state_unknown);
  WorkerConfig worker{.worker_id = 7, .dp_start = 1, .dp_size = 2, .block_size = 4};
  ASSERT_TRUE(router_->AddWorker(worker).ok());
  worker.dp_size = 1;
  ASSERT_TRUE(router_->UpdateWorker(worker).ok());  // dp rank 2 dropped
  WaitForUnknown(1);
  ASSERT_TRUE(router_->RemoveWorker(7).ok());
  WaitForUnknown(0);
  EXPECT_EQ(0u, Depth());
  // The engine goes on (draining before it stops): applied, still not counted.
  Publish(WithSequence(kStored, 4));
  Publish(WithSequence(kRemoved, 6));  // 5 lost: a gap, the rank cleared and flagged again
  IngestStats stats = WaitForMessages(4);
  EXPECT_EQ(0u, stats.state_unknown);
  EXPECT_EQ(2u, stats.gaps);
  // Added back, its flags count again: the index does not know what the ranks hold. First with
  // dp rank 1 alone: rank 2, which an update dropped, stays dropped.
  worker.dp_size = 1;
  ASSERT_TRUE(router_->AddWorker(worker).ok());
  WaitForUnknown(1);
  worker.dp_size = 2;
  ASSERT_TRUE(router_->UpdateWorker(worker).ok());
  WaitForUnknown(2);
  Publish(WithSequence(kCleared, 7));  // the engine clears dp rank 1
  EXPECT_EQ(1u, WaitForMessages(5).state_unknown);
}

TEST_F(DynamoNatsTest, BadMessagesAreCountedAndTheGoodOnesAroundThemApplied) {
  std::vector<uint8_t> cut = FromHex(kStored);
  cut.resize(40);
  Publish(FromHex("93010203"));  // msgpack, not Dynamo's shape
  Publish(cut);                  // not msgpack, not a batch
  Publish(FromHex(kStored));
  const IngestStats stats = WaitForMessages(3);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kBadMsgpack)]);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kBadFlatBuffers)]);
  EXPECT_EQ(1u, stats.events_applied);
  EXPECT_EQ(2u, Depth());
}

}  // namespace
}  // namespace kvrouter

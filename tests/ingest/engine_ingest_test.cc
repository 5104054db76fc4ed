// End to end: an IngestService subscribed to a ZMQ publisher on 127.0.0.1 (or ipc://) that
// the test drives like a vLLM engine: the wire vectors' payloads, sequence gaps, a restart,
// duplicates, malformed messages, several data-parallel ranks. The publisher is an XPUB so the
// test can wait until the subscription is live instead of sleeping.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zmq.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "core/clock.h"
#include "core/counting_allocator.h"
#include "core/router.h"
#include "ingest/ingest_service.h"
#include "tcp_proxy.h"

namespace kvrouter {
namespace {

using nlohmann::json;
constexpr auto kWait = std::chrono::seconds(10);

std::vector<uint8_t> FromHex(const std::string& hex) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<uint8_t>(std::stoul(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

std::vector<uint8_t> VllmPayload(const std::string& name) {
  std::ifstream in(std::string(KVR_DATA_DIR) + "/vectors/vllm_kv_events_vectors.json");
  const json vectors = json::parse(in);
  for (const json& v : vectors.at("vectors")) {
    if (v.at("name").get<std::string>() == name) {
      return FromHex(v.at("zmq_frames").at("payload_hex").get<std::string>());
    }
  }
  ADD_FAILURE() << "no vector " << name;
  return {};
}

std::vector<uint32_t> Range(uint32_t first, uint32_t last) {
  std::vector<uint32_t> out;
  for (uint32_t t = first; t <= last; ++t) out.push_back(t);
  return out;
}

// Whether `condition` holds within kWait (polled every millisecond).
template <typename Condition>
bool WaitFor(Condition condition) {
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (!condition()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// A fake engine: an XPUB socket bound to `endpoint`.
class FakeEngine {
 public:
  FakeEngine(void* context, const std::string& endpoint) {
    socket_ = zmq_socket(context, ZMQ_XPUB);
    const int linger = 0;
    zmq_setsockopt(socket_, ZMQ_LINGER, &linger, sizeof(linger));
    // A port a closed engine held may take a moment to be free again (ZMQ closes in the
    // background).
    EXPECT_TRUE(WaitFor([&] { return zmq_bind(socket_, endpoint.c_str()) == 0; }))
        << zmq_strerror(zmq_errno());
    char last[256] = {};
    size_t size = sizeof(last);
    zmq_getsockopt(socket_, ZMQ_LAST_ENDPOINT, last, &size);
    endpoint_ = last;
  }
  ~FakeEngine() { zmq_close(socket_); }

  const std::string& endpoint() const { return endpoint_; }

  // Blocks (bounded) until a subscriber's subscription arrives.
  bool WaitForSubscriber() {
    zmq_pollitem_t item{socket_, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, static_cast<long>(kWait / std::chrono::milliseconds(1))) != 1) {
      return false;
    }
    char buffer[256];
    return zmq_recv(socket_, buffer, sizeof(buffer), 0) >= 1 && buffer[0] == 1;
  }

  void Send(uint64_t seq, const std::vector<uint8_t>& payload,
            const std::string& topic = "kv-events") {
    uint8_t seq_bytes[8];
    for (int i = 0; i < 8; ++i) seq_bytes[i] = static_cast<uint8_t>(seq >> (56 - 8 * i));
    zmq_send(socket_, topic.data(), topic.size(), ZMQ_SNDMORE);
    zmq_send(socket_, seq_bytes, 8, ZMQ_SNDMORE);
    zmq_send(socket_, payload.data(), payload.size(), 0);
  }

  void SendParts(const std::vector<std::string>& parts) {
    for (size_t i = 0; i < parts.size(); ++i) {
      zmq_send(socket_, parts[i].data(), parts[i].size(), i + 1 < parts.size() ? ZMQ_SNDMORE : 0);
    }
  }

 private:
  void* socket_ = nullptr;
  std::string endpoint_;
};

class EngineIngestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    context_ = zmq_ctx_new();
    auto router = Router::Create(RouterOptions{.block_size = 16});
    ASSERT_TRUE(router.ok());
    router_ = std::move(*router);
    auto service = IngestService::Create(router_.get(), {});
    ASSERT_TRUE(service.ok());
    ingest_ = std::move(*service);
    ASSERT_TRUE(ingest_->Start().ok());
  }
  void TearDown() override {
    ingest_.reset();
    engines_.clear();
    zmq_ctx_term(context_);
  }

  FakeEngine& Engine(const std::string& endpoint) {
    return *engines_.emplace_back(std::make_unique<FakeEngine>(context_, endpoint));
  }

  uint64_t Subscribe(FakeEngine& engine, uint64_t worker_id, uint32_t dp_size = 1) {
    EngineWorker worker{.endpoint = engine.endpoint(),
                        .worker_id = worker_id,
                        .dp_size = dp_size,
                        .topic = "kv-events"};
    auto id = ingest_->AddEngineWorker(worker);
    EXPECT_TRUE(id.ok()) << id.status();
    EXPECT_TRUE(engine.WaitForSubscriber());
    return id.value_or(0);
  }

  // Waits (bounded) until `messages` have arrived and, since a message is counted when it
  // arrives and its events when they apply, until `applied` events have been applied.
  IngestStats WaitForMessages(uint64_t source, uint64_t messages, uint64_t applied = 0) {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    IngestStats stats = *ingest_->Stats(source);
    while ((stats.messages < messages || stats.events_applied < applied) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      stats = *ingest_->Stats(source);
    }
    EXPECT_EQ(messages, stats.messages);
    return stats;
  }

  // `engine` (worker 5, `source`) stores the first two blocks of kPrompt in message `first`,
  // and with `three` the third in message `first` + 1.
  void StoreBlocks(FakeEngine& engine, uint64_t source, uint64_t first, bool three);

  // The engine clears its cache in message `seq`, the source's `messages`-th: its state is known
  // (empty) again.
  void ExpectTheEnginesClearRestoresTrust(FakeEngine& engine, uint64_t source, uint64_t seq,
                                          uint64_t messages);

  // The engine stores three blocks from message `old_first`, then restarts (empty cache): the
  // first message heard from the new one is `new_seq`, storing the first two blocks. The
  // source's counters after it.
  IngestStats Restart(FakeEngine& engine, uint64_t source, uint64_t old_first, uint64_t new_seq);

  // The leading blocks of `prompt` (under `cache_namespace`) the rank holds on its device.
  uint32_t DeviceBlocks(const std::vector<uint32_t>& prompt, WorkerKey worker,
                        std::string_view cache_namespace = "") {
    auto scores = router_->OverlapScores(
        prompt, RouteOptions{.prompt = {.cache_namespace = cache_namespace}});
    if (!scores.ok()) return 0;
    for (const OverlapScore& s : *scores) {
      if (s.worker == worker) return s.overlap.device_blocks;
    }
    return 0;
  }

  void* context_ = nullptr;
  std::unique_ptr<Router> router_;
  std::unique_ptr<IngestService> ingest_;
  std::vector<std::unique_ptr<FakeEngine>> engines_;
};

const std::vector<uint32_t> kPrompt = Range(1001, 1048);

void EngineIngestTest::ExpectTheEnginesClearRestoresTrust(FakeEngine& engine, uint64_t source,
                                                          uint64_t seq, uint64_t messages) {
  engine.Send(seq, VllmPayload("array_all_cleared"));
  EXPECT_EQ(0u, WaitForMessages(source, messages).state_unknown);
  EXPECT_EQ(0u, DeviceBlocks(kPrompt, {5, 0}));
}

IngestStats EngineIngestTest::Restart(FakeEngine& engine, uint64_t source, uint64_t old_first,
                                      uint64_t new_seq) {
  StoreBlocks(engine, source, old_first, /*three=*/true);
  engine.Send(new_seq, VllmPayload("map_store"));
  const IngestStats stats = WaitForMessages(source, 3);
  EXPECT_EQ(1u, stats.restarts);
  EXPECT_EQ(1u, stats.recoveries);
  EXPECT_EQ(0u, stats.gaps);
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {5, 0}));  // the new engine's: the old third block is gone
  return stats;
}

void EngineIngestTest::StoreBlocks(FakeEngine& engine, uint64_t source, uint64_t first,
                                   bool three) {
  engine.Send(first, VllmPayload("array_store_dp_medium"));
  if (three) engine.Send(first + 1, VllmPayload("array_store_continuation"));
  WaitForMessages(source, three ? 2 : 1);
  ASSERT_EQ(three ? 3u : 2u, DeviceBlocks(kPrompt, {5, 0}));
}

TEST_F(EngineIngestTest, VllmEventsOverTcpReachTheIndex) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  engine.Send(0, VllmPayload("array_store_dp_medium"));
  engine.Send(1, VllmPayload("array_store_continuation"));
  IngestStats stats = WaitForMessages(source, 2, 2);
  EXPECT_EQ(2u, stats.events_applied);
  EXPECT_EQ(0u, stats.gaps);
  EXPECT_EQ(3u, DeviceBlocks(kPrompt, {5, 0}));
  // A message on another topic is filtered by the subscription, not counted.
  engine.Send(2, VllmPayload("array_all_cleared"), "other-topic");
  engine.Send(2, VllmPayload("array_remove_full_schema"));
  stats = WaitForMessages(source, 3);
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {5, 0}));
}

// Workers that come and go: a removed worker's source stays readable until 1,024 newer ones
// were removed, then is forgotten (bounded memory), its counters kept in the totals.
TEST_F(EngineIngestTest, RemovedWorkersAreForgottenBeyondTheLastThousandTheirCountsKept) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t first = Subscribe(engine, 1);
  engine.Send(0, VllmPayload("array_store_dp_medium"));
  WaitForMessages(first, 1, 1);
  ASSERT_TRUE(ingest_->RemoveEngineWorker(1, /*clear_index=*/false).ok());
  EXPECT_TRUE(ingest_->Stats(first).ok());  // removed, still readable
  uint64_t last = 0;
  for (uint64_t w = 2; w <= 1100; ++w) {
    // Nothing listens there: the ZMQ connection is attempted in the background.
    auto id = ingest_->AddEngineWorker({.endpoint = "tcp://127.0.0.1:9", .worker_id = w});
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(ingest_->RemoveEngineWorker(w, /*clear_index=*/false).ok());
    last = *id;
  }
  EXPECT_EQ(ingest_->Sources().size(), 1024u);
  EXPECT_EQ(ingest_->Stats(first).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ingest_->Endpoint(first).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(ingest_->Stats(last).ok());
  const IngestStats totals = *ingest_->Stats(0);
  EXPECT_EQ(totals.messages, 1u);  // the forgotten worker's message still counts
  EXPECT_EQ(totals.events_applied, 1u);
}

// The vectors were published at ts 1750000000.25 (June 2025), so the lag measured from that
// `ts` is at least the time since then: proof that the engine's timestamp is the one used.
TEST_F(EngineIngestTest, LagIsMeasuredFromTheEngineTimestamp) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  const uint64_t since_publish_us = (UnixNowNanos() - 1750000000250000000u) / 1000;
  engine.Send(0, VllmPayload("array_store_dp_medium"));
  const IngestStats stats = WaitForMessages(source, 1, 1);
  EXPECT_EQ(1u, stats.lag_samples);
  EXPECT_GE(stats.lag_last_us, since_publish_us);
  EXPECT_EQ(stats.lag_last_us, stats.lag_max_us);
  EXPECT_EQ(stats.lag_last_us, stats.lag_total_us);
}

TEST_F(EngineIngestTest, GapClearsAndFlagsThenEngineClearRestoresTrust) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  StoreBlocks(engine, source, 0, /*three=*/false);
  // Messages 1..3 are lost: the index can no longer vouch for worker 5.
  engine.Send(4, VllmPayload("map_store_continuation"));
  const IngestStats stats = WaitForMessages(source, 2);
  EXPECT_EQ(1u, stats.gaps);
  EXPECT_EQ(3u, stats.missed_messages);
  EXPECT_EQ(1u, stats.recoveries);
  EXPECT_EQ(1u, stats.state_unknown);
  EXPECT_EQ(0u, DeviceBlocks(kPrompt, {5, 0}));  // cleared, not trusted
  // The continuation's parent was cleared with the rest: refused by the index.
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kIndexRejected)]);
  ExpectTheEnginesClearRestoresTrust(engine, source, 5, 3);
}

// An event the heap refuses (FailAllocationForTesting refuses the index's next allocation: the
// third block extends the rank's run) neither ends the ingest thread nor leaves part of the
// event: the rank is cleared and flagged unknown, as after a gap, until the engine clears.
TEST_F(EngineIngestTest, AnEventRefusedForMemoryClearsAndFlagsTheRank) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  StoreBlocks(engine, source, 0, /*three=*/false);
  FailAllocationForTesting(1);
  engine.Send(1, VllmPayload("array_store_continuation"));
  const IngestStats stats = WaitForMessages(source, 2);
  EXPECT_EQ(0u, FailAllocationForTesting(0));  // the refusal came
  EXPECT_EQ(1u, stats.state_unknown);
  EXPECT_EQ(1u, stats.recoveries);
  EXPECT_EQ(0u, stats.gaps);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kIndexRejected)]);
  EXPECT_EQ(0u, DeviceBlocks(kPrompt, {5, 0}));
  ExpectTheEnginesClearRestoresTrust(engine, source, 2, 3);
}

// Issue 19: an engine restarted while the subscriber reconnected, its first messages lost: its
// lower numbers were dropped as stale and the dead engine's blocks stayed for good.
TEST_F(EngineIngestTest, RestartIsRecognisedWhenItsFirstMessagesWereLost) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  const IngestStats stats = Restart(engine, source, 10, 4);  // the new engine's 0..3 were lost
  EXPECT_EQ(4u, stats.missed_messages);
  EXPECT_EQ(0u, stats.rejected[static_cast<int>(IngestReject::kStaleSequence)]);
  EXPECT_EQ(1u, stats.state_unknown);  // what 0..3 did is unknown
  ExpectTheEnginesClearRestoresTrust(engine, source, 5, 4);
}

TEST_F(EngineIngestTest, PublisherRestartIsRecognised) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  EXPECT_EQ(0u, Restart(engine, source, 0, 0).state_unknown);  // heard from its message 0
}

// An engine heard from its message 0 holds nothing but what its messages store: blocks the
// rank held before (here stored on the router directly, as a snapshot restored from before the
// engines restarted would hold them) are an older engine's and must go. They stayed, unflagged.
TEST_F(EngineIngestTest, AFirstMessageNumberedZeroClearsWhatTheRankHeldBefore) {
  const std::vector<uint32_t> old_prompt = Range(2001, 2032);
  StoredEvent old_blocks{.block_hashes = {901, 902}, .token_ids = old_prompt};
  ASSERT_TRUE(router_->ApplyEvent({.worker = {5, 0}, .data = std::move(old_blocks)}).ok());
  ASSERT_EQ(2u, DeviceBlocks(old_prompt, {5, 0}));
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  engine.Send(0, VllmPayload("array_store_dp_medium"));
  const IngestStats stats = WaitForMessages(source, 1, 1);
  EXPECT_EQ(0u, stats.state_unknown);  // heard from its start: exact
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {5, 0}));
  EXPECT_EQ(0u, DeviceBlocks(old_prompt, {5, 0}));
}

// The kernel's timer of a TCP connection to 127.0.0.1:`remote_port` as /proc/net/tcp shows
// it: (timer kind, seconds left), or nullopt if there is no such established connection.
std::optional<std::pair<int, double>> TcpTimerTowards(int remote_port) {
  std::ifstream table("/proc/net/tcp");
  std::string line;
  std::getline(table, line);  // the header
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state, queues, timer;
    fields >> slot >> local >> remote >> state >> queues >> timer;
    const int port = std::stoi(remote.substr(remote.find(':') + 1), nullptr, 16);
    if (port != remote_port || state != "01") continue;  // 01: ESTABLISHED
    const int kind = std::stoi(timer.substr(0, timer.find(':')), nullptr, 16);
    const long ticks = std::stol(timer.substr(timer.find(':') + 1), nullptr, 16);
    return std::pair{kind, static_cast<double>(ticks) / sysconf(_SC_CLK_TCK)};
  }
  return std::nullopt;
}

// A SUB socket sends nothing once subscribed, so without TCP keepalive a connection whose
// engine host died (or that a partition cut past the engine's retransmissions) stayed
// established for good: no reconnection, no gap, no flag. A dead host cannot be played on
// 127.0.0.1 (the peer's kernel answers the probes), so this checks that the kernel watches the
// subscriber's connection: its keepalive timer runs (kind 2, between 2 s, longer than any
// delayed acknowledgement, and the 15 s idle time). Without keepalive no timer runs once the
// last message is acknowledged.
TEST_F(EngineIngestTest, EngineConnectionsAreWatchedByTcpKeepalive) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const std::string& bound = engine.endpoint();
  const int engine_port = std::stoi(bound.substr(bound.rfind(':') + 1));
  const uint64_t source = Subscribe(engine, 5);
  engine.Send(0, VllmPayload("array_store_dp_medium"));
  WaitForMessages(source, 1, 1);
  std::optional<std::pair<int, double>> timer;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  do {
    timer = TcpTimerTowards(engine_port);
    if (timer && timer->first == 2 && timer->second > 2.0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (std::chrono::steady_clock::now() < deadline);
  ASSERT_TRUE(timer.has_value()) << "no established connection to port " << engine_port;
  EXPECT_EQ(2, timer->first) << "no keepalive timer on the subscriber's connection";
  EXPECT_GT(timer->second, 2.0);
  EXPECT_LE(timer->second, 15.0);
}

TEST_F(EngineIngestTest, MalformedMessagesAreCountedAndTheNextOnesApply) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  engine.SendParts({"kv-events", "only two parts"});
  engine.SendParts({"kv-events", "short", "x"});
  const std::vector<uint8_t> garbage = {0xc1, 0xc1, 0xc1};
  engine.Send(0, garbage);
  engine.Send(1, VllmPayload("array_store_dp_medium"));
  const IngestStats stats = WaitForMessages(source, 4);
  EXPECT_EQ(2u, stats.rejected[static_cast<int>(IngestReject::kBadMessage)]);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kBadMsgpack)]);
  EXPECT_EQ(1u, stats.events_applied);
  EXPECT_EQ(0u, stats.gaps);  // the garbage message still counted in the sequence
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {5, 0}));
}

TEST_F(EngineIngestTest, EachRankHasItsOwnSocketAndSequence) {
  const std::string base = "ipc:///tmp/kvr_ingest_test_" + std::to_string(getpid());
  FakeEngine& rank0 = Engine(base);
  FakeEngine& rank1 = Engine(base + "_dp1");
  EngineWorker worker{.endpoint = base, .worker_id = 9, .dp_size = 2, .topic = "kv-events"};
  auto source = ingest_->AddEngineWorker(worker);
  ASSERT_TRUE(source.ok()) << source.status();
  ASSERT_TRUE(rank0.WaitForSubscriber());
  ASSERT_TRUE(rank1.WaitForSubscriber());
  // The legacy layout has no rank field: the socket's rank applies.
  rank1.Send(0, VllmPayload("legacy_array_store_no_dp"));
  rank0.Send(0, VllmPayload("array_store_dp_medium"));
  const IngestStats stats = WaitForMessages(*source, 2);
  EXPECT_EQ(0u, stats.gaps);  // two sequences, each starting at 0
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {9, 1}));
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {9, 0}));
  unlink((base.substr(6)).c_str());
  unlink((base.substr(6) + "_dp1").c_str());
}

// A batch naming another data-parallel rank than its socket's (a worker registered with the
// wrong dp_start, or the wrong port) is dropped and says why: its events went to the batch's
// rank, while a gap, restart or replay of the socket's sequence cleared and flagged the
// socket's rank, so the blocks stayed where nothing repaired them.
TEST_F(EngineIngestTest, ABatchOfAnotherRankThanItsSocketsIsRejected) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);          // one rank: 0
  engine.Send(0, VllmPayload("map_store_salted_dp1"));   // data_parallel_rank 1
  engine.Send(1, VllmPayload("array_store_dp_medium"));  // rank 0
  const IngestStats stats = WaitForMessages(source, 2, 1);
  EXPECT_EQ(1u, stats.events_applied);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kBadMsgpack)]);
  EXPECT_NE(std::string::npos,
            stats.last_reject.find("a batch of data-parallel rank 1 on the socket of rank 0"))
      << stats.last_reject;
  EXPECT_EQ(0u, stats.gaps);  // it still counts in the sequence
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {5, 0}));
  const auto scores =
      router_->OverlapScores(Range(1001, 1016), {.prompt = {.cache_namespace = "tenant-a"}});
  ASSERT_TRUE(scores.ok());
  for (const OverlapScore& s : *scores) EXPECT_NE(s.worker, (WorkerKey{5, 1}));
}

// vLLM batches [ts, [event]] of one event, packed by hand (msgpack).
class VllmBatch {
 public:
  // ["BlockStored", hashes, parent, tokens, 16, nil, "GPU", nil, extra_keys]: `salt` in the
  // first block's extra keys, as vLLM folds a request's cache salt into its first block only.
  static std::vector<uint8_t> Stored(uint64_t hash, std::optional<uint64_t> parent,
                                     const std::vector<uint32_t>& tokens,
                                     const std::string& salt = "",
                                     const std::string& medium = "GPU", uint32_t block_size = 16) {
    VllmBatch b;
    b.Byte(0x99).Str("BlockStored").Byte(0x91).Uint(hash);
    parent ? b.Uint(*parent) : b.Byte(0xc0);
    b.Byte(0xdc).Be(tokens.size(), 2);
    for (uint32_t t : tokens) b.Uint(t);
    b.Uint(block_size).Byte(0xc0).Str(medium).Byte(0xc0);
    salt.empty() ? b.Byte(0xc0) : b.Byte(0x91).Byte(0x91).Str(salt);
    return b.bytes_;
  }
  // A store of a hybrid model's KV-cache group `group` of `kind`, e.g. "sliding_window".
  static std::vector<uint8_t> StoredInGroup(uint64_t hash, const std::vector<uint32_t>& tokens,
                                            uint32_t group, const std::string& kind) {
    return StoredInGroup(std::vector<uint64_t>{hash}, tokens, group, kind);
  }
  // The same with several blocks and, for a sliding window, its kv_cache_spec_sliding_window
  // (vLLM 0.32's sliding-window store lists only the blocks the group keeps, with the tokens of
  // the whole range).
  static std::vector<uint8_t> StoredInGroup(const std::vector<uint64_t>& hashes,
                                            const std::vector<uint32_t>& tokens, uint32_t group,
                                            const std::string& kind,
                                            std::optional<uint32_t> window = std::nullopt) {
    VllmBatch b;
    b.Byte(window ? 0x9c : 0x9b).Str("BlockStored").Byte(0x90 | hashes.size());
    for (uint64_t h : hashes) b.Uint(h);
    b.Byte(0xc0).Byte(0xdc).Be(tokens.size(), 2);
    for (uint32_t t : tokens) b.Uint(t);
    b.Uint(16).Byte(0xc0).Str("GPU").Byte(0xc0).Byte(0xc0).Uint(group).Str(kind);
    if (window) b.Uint(*window);
    return b.bytes_;
  }
  // A removal naming its group (as vLLM's does: its index, not its kind).
  static std::vector<uint8_t> RemovedInGroup(uint64_t hash, uint32_t group) {
    VllmBatch b;
    b.Byte(0x94).Str("BlockRemoved").Byte(0x91).Uint(hash).Str("GPU").Uint(group);
    return b.bytes_;
  }
  // An event of a type no vLLM has sent yet: [tag].
  static std::vector<uint8_t> Unknown(const std::string& tag) {
    VllmBatch b;
    b.Byte(0x91).Str(tag);
    return b.bytes_;
  }
  static std::vector<uint8_t> Removed(uint64_t hash, const std::string& medium = "GPU") {
    VllmBatch b;
    b.Byte(0x93).Str("BlockRemoved").Byte(0x91).Uint(hash).Str(medium);
    return b.bytes_;
  }

  // One batch of the events of single-event batches, in order (fewer than 16).
  static std::vector<uint8_t> Of(const std::vector<std::vector<uint8_t>>& batches) {
    std::vector<uint8_t> out = {0x92, 0x01, static_cast<uint8_t>(0x90 | batches.size())};
    for (const std::vector<uint8_t>& b : batches) out.insert(out.end(), b.begin() + 3, b.end());
    return out;
  }

 private:
  VllmBatch() { Byte(0x92).Byte(0x01).Byte(0x91); }  // [1, [ ...
  VllmBatch& Byte(uint8_t b) {
    bytes_.push_back(b);
    return *this;
  }
  VllmBatch& Be(uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) Byte(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  VllmBatch& Uint(uint64_t v) {
    if (v < 128) return Byte(static_cast<uint8_t>(v));
    if (v <= 0xffff) return Byte(0xcd).Be(v, 2);
    return Byte(0xcf).Be(v, 8);
  }
  VllmBatch& Str(const std::string& s) {
    Byte(static_cast<uint8_t>(0xa0 | s.size()));  // under 32 bytes
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  std::vector<uint8_t> bytes_;
};

// vLLM holds the last block of a fully cached prompt twice and removes each copy in turn; the
// first removal leaves the block indexed (BlockCopies), and with it its cache salt: a later
// block continuing it is salted too. The salt was forgotten with the first removal, so the
// continuation was indexed unsalted and a salted prompt matched only its first block.
TEST_F(EngineIngestTest, ARemovedCopyOfASaltedBlockKeepsItsSalt) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  const std::vector<uint32_t> first = Range(1001, 1016);
  engine.Send(0, VllmBatch::Stored(21, std::nullopt, first, "tenant-a"));
  engine.Send(1, VllmBatch::Stored(21, std::nullopt, first, "tenant-a"));  // its copy
  engine.Send(2, VllmBatch::Removed(21));                                  // one copy goes
  engine.Send(3, VllmBatch::Stored(22, 21, Range(1017, 1032)));            // salted by its parent
  const IngestStats stats = WaitForMessages(source, 4, 4);
  EXPECT_EQ(0u, stats.rejected[static_cast<int>(IngestReject::kBadMsgpack)]) << stats.last_reject;
  EXPECT_EQ(2u, DeviceBlocks(Range(1001, 1032), {5, 0}, "tenant-a"));
  EXPECT_EQ(0u, DeviceBlocks(Range(1001, 1032), {5, 0}));  // unsalted: no match
}

// One batch evicts a salted block and stores it again (the same prompt recomputed): its salt
// stays for a block continuing it. The batch's stores recorded their salts before any of its
// events applied, so the eviction, applied after, forgot the salt the store had just recorded.
TEST_F(EngineIngestTest, ABlockEvictedAndStoredAgainInOneBatchKeepsItsSalt) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  const std::vector<uint32_t> first = Range(1001, 1016);
  engine.Send(0, VllmBatch::Stored(21, std::nullopt, first, "tenant-a"));
  engine.Send(1, VllmBatch::Of({VllmBatch::Removed(21),
                                VllmBatch::Stored(21, std::nullopt, first, "tenant-a")}));
  engine.Send(2, VllmBatch::Stored(22, 21, Range(1017, 1032)));  // salted by its parent
  const IngestStats stats = WaitForMessages(source, 3, 4);
  EXPECT_EQ(0u, stats.rejected[static_cast<int>(IngestReject::kBadMsgpack)]) << stats.last_reject;
  EXPECT_EQ(2u, DeviceBlocks(Range(1001, 1032), {5, 0}, "tenant-a"));
}

// A batch's rejects are counted in its order: a block size mismatch before a later event the
// index refuses, so the last reject's reason is the later one's. (The mismatches were counted
// after the whole batch had applied.)
TEST_F(EngineIngestTest, ABatchsRejectsAreCountedInItsOrder) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  engine.Send(0,
              VllmBatch::Of({VllmBatch::Stored(21, std::nullopt, Range(1001, 1032), "", "GPU", 32),
                             VllmBatch::Stored(22, 999, Range(1033, 1048))}));
  const IngestStats stats = WaitForMessages(source, 1);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kBlockSize)]);
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kIndexRejected)]);
  EXPECT_EQ(std::string::npos, stats.last_reject.find("block size")) << stats.last_reject;
}

// An engine that dies: its rank is flagged as soon as the connection drops, its blocks kept (a
// blip would change nothing); a successor connected but silent leaves it flagged; the
// successor's first message settles it (numbered 0: a restart, cleared and known). The rank
// was flagged only once a successor's message came, and never if none did: a dead engine's
// blocks stayed, unflagged, for good.
TEST_F(EngineIngestTest, AnEngineWhoseConnectionDropsIsFlaggedUntilItsSuccessorSpeaks) {
  const std::string endpoint = Engine("tcp://127.0.0.1:*").endpoint();
  const uint64_t source = Subscribe(*engines_.back(), 5);
  StoreBlocks(*engines_.back(), source, 0, /*three=*/true);
  EXPECT_EQ(0u, ingest_->Stats(source)->state_unknown);
  engines_.clear();  // the engine dies
  EXPECT_TRUE(WaitFor([&] { return ingest_->Stats(source)->state_unknown == 1; }));
  EXPECT_EQ(3u, DeviceBlocks(kPrompt, {5, 0}));
  FakeEngine& next = Engine(endpoint);
  EXPECT_TRUE(next.WaitForSubscriber());
  EXPECT_TRUE(WaitFor([&] { return ingest_->Stats(source)->connections == 2; }));
  EXPECT_EQ(1u, ingest_->Stats(source)->state_unknown);
  EXPECT_EQ(1u, ingest_->Stats(0)->state_unknown);
  next.SendParts({"kv-events", "not a message"});  // rejected unjudged: settles nothing
  EXPECT_EQ(1u, WaitForMessages(source, 3).state_unknown);
  next.Send(0, VllmPayload("array_store_dp_medium"));
  const IngestStats stats = WaitForMessages(source, 4);
  EXPECT_EQ(0u, stats.state_unknown);
  EXPECT_EQ(1u, stats.restarts);
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {5, 0}));  // the successor's alone
  ASSERT_TRUE(ingest_->RemoveEngineWorker(5, /*clear_index=*/false).ok());
  EXPECT_EQ(0u, ingest_->Stats(0)->state_unknown);
}

// Removed while its connection is down, a rank is no longer counted as unknown.
TEST_F(EngineIngestTest, ARankRemovedWhileDisconnectedIsNoLongerCounted) {
  const uint64_t source = Subscribe(Engine("tcp://127.0.0.1:*"), 5);
  StoreBlocks(*engines_.back(), source, 0, /*three=*/false);
  engines_.clear();
  EXPECT_TRUE(WaitFor([&] { return ingest_->Stats(0)->state_unknown == 1; }));
  ASSERT_TRUE(ingest_->RemoveEngineWorker(5, /*clear_index=*/true).ok());
  EXPECT_EQ(0u, ingest_->Stats(0)->state_unknown);
}

// An event of an unknown type is counted in its place too: after a mismatch before it, so the
// last reject names it; and a mismatch after it names its own position in the batch as sent.
// (Unknown types were counted before the batch applied, and a mismatch's position was counted
// among the known events only.)
TEST_F(EngineIngestTest, AnUnknownEventTypeIsCountedInItsPlaceAmongTheBatchsRejects) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  const std::vector<uint8_t> mismatch =
      VllmBatch::Stored(21, std::nullopt, Range(1001, 1032), "", "GPU", 32);
  engine.Send(0, VllmBatch::Of({mismatch, VllmBatch::Unknown("Foo")}));
  IngestStats stats = WaitForMessages(source, 1);
  EXPECT_EQ("event 1: unknown event tag 'Foo'", stats.last_reject);
  engine.Send(1, VllmBatch::Of({VllmBatch::Unknown("Foo"), mismatch}));
  stats = WaitForMessages(source, 2);
  EXPECT_EQ(0u, stats.last_reject.rfind("event 1 has block size 32", 0)) << stats.last_reject;
  EXPECT_EQ(2u, stats.rejected[static_cast<int>(IngestReject::kBlockSize)]);
  EXPECT_EQ(2u, stats.rejected[static_cast<int>(IngestReject::kBadMsgpack)]);
}

// A hybrid model publishes each KV-cache group's copy of a block under the same hash. Its
// sliding-window store is not indexed, by design, and counted as ignored (it was counted
// nowhere); so is that group's removal, which names its group by index only: it took the
// full-attention block, which the engine still holds, out of the index.
TEST_F(EngineIngestTest, EventsOfOtherKvCacheGroupsAreIgnoredAndCounted) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  engine.Send(
      0, VllmBatch::Of({VllmBatch::StoredInGroup(21, Range(1001, 1016), 1, "sliding_window"),
                        VllmBatch::StoredInGroup(21, Range(1001, 1016), 0, "full_attention")}));
  IngestStats stats = WaitForMessages(source, 1, 1);
  EXPECT_EQ(1u, stats.events_ignored);
  EXPECT_EQ(1u, DeviceBlocks(Range(1001, 1016), {5, 0}));
  engine.Send(1, VllmBatch::RemovedInGroup(21, 1));  // the sliding window moved on
  stats = WaitForMessages(source, 2);
  EXPECT_EQ(2u, stats.events_ignored);
  EXPECT_EQ(1u, DeviceBlocks(Range(1001, 1016), {5, 0}));
  engine.Send(2, VllmBatch::RemovedInGroup(21, 0));  // the full-attention copy goes
  stats = WaitForMessages(source, 3, 2);
  EXPECT_EQ(0u, DeviceBlocks(Range(1001, 1016), {5, 0}));
  EXPECT_EQ(2u, stats.events_ignored);
  for (uint64_t rejected : stats.rejected) EXPECT_EQ(0u, rejected) << stats.last_reject;
  EXPECT_EQ(2u, ingest_->Stats(0)->events_ignored);
}

// A hybrid model whose engine said the window: the sliding-window group's blocks limit where a
// prompt resumes, as in the engine (core/sliding_windows.h). vLLM sends the sliding store first
// in the batch, naming only the blocks the window keeps; it is placed by the full-attention
// store after it. Its removals name their group and leave full attention alone.
TEST_F(EngineIngestTest, ASlidingWindowGroupLimitsTheHitAsTheEngineDoes) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  const std::vector<uint32_t> prompt = Range(1001, 1064);  // four blocks
  engine.Send(
      0, VllmBatch::Of({VllmBatch::StoredInGroup({23, 24}, prompt, 0, "sliding_window",
                                                 32),  // two blocks before a hit point
                        VllmBatch::StoredInGroup({21, 22, 23, 24}, prompt, 1, "full_attention")}));
  IngestStats stats = WaitForMessages(source, 1, 2);
  EXPECT_EQ(0u, stats.events_ignored);
  for (uint64_t rejected : stats.rejected) EXPECT_EQ(0u, rejected) << stats.last_reject;
  std::vector<uint32_t> longer = prompt;
  longer.push_back(7);
  EXPECT_EQ(4u, DeviceBlocks(longer, {5, 0}));
  // Three blocks shared: the window holds block 2 but not block 1 before it, nor block 0: the
  // engine computes the whole prompt, and so the router predicts nothing cached.
  std::vector<uint32_t> shorter(prompt.begin(), prompt.begin() + 48);
  shorter.insert(shorter.end(), 16, 9);
  EXPECT_EQ(0u, DeviceBlocks(shorter, {5, 0}));
  engine.Send(1, VllmBatch::RemovedInGroup(24, 0));  // the window moved on
  stats = WaitForMessages(source, 2, 3);
  EXPECT_EQ(0u, DeviceBlocks(longer, {5, 0}));
  EXPECT_EQ(4u, router_->IndexStats().cached_blocks);  // full attention untouched
  EXPECT_EQ(1u, router_->IndexStats().sliding_blocks);
  // A later request's window holds block 3 again (a store continuing the prefix).
  engine.Send(2, VllmBatch::StoredInGroup({24}, prompt, 0, "sliding_window", 32));
  stats = WaitForMessages(source, 3, 4);
  EXPECT_EQ(4u, DeviceBlocks(longer, {5, 0}));
  for (uint64_t rejected : stats.rejected) EXPECT_EQ(0u, rejected) << stats.last_reject;
}

// vLLM's offloading connector copies a block to the host (a store without tokens), the device
// evicts it, and it is loaded back: its salt stays while the host holds it, so a block
// continuing it is salted too. The salt went with the device's removal, so the continuation
// was indexed unsalted.
TEST_F(EngineIngestTest, AnOffloadedSaltedBlockKeepsItsSaltWhileTheHostHoldsIt) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  engine.Send(0, VllmBatch::Stored(21, std::nullopt, Range(1001, 1016), "tenant-a"));
  engine.Send(1, VllmBatch::Stored(21, std::nullopt, {}, "", "CPU"));  // offloaded
  engine.Send(2, VllmBatch::Removed(21));                              // evicted from the device
  engine.Send(3, VllmBatch::Stored(21, std::nullopt, {}, "", "GPU"));  // loaded back
  engine.Send(4, VllmBatch::Stored(22, 21, Range(1017, 1032)));        // salted by its parent
  const IngestStats stats = WaitForMessages(source, 5, 5);
  EXPECT_EQ(0u, stats.rejected[static_cast<int>(IngestReject::kBadMsgpack)]) << stats.last_reject;
  EXPECT_EQ(2u, DeviceBlocks(Range(1001, 1032), {5, 0}, "tenant-a"));
}

// vLLM's replay socket: a ROUTER that answers a start sequence with (seq, payload) messages
// and the end marker -1.
class FakeReplayServer {
 public:
  FakeReplayServer(void* context, const std::string& endpoint) {
    socket_ = zmq_socket(context, ZMQ_ROUTER);
    const int linger = 0;
    zmq_setsockopt(socket_, ZMQ_LINGER, &linger, sizeof(linger));
    EXPECT_EQ(0, zmq_bind(socket_, endpoint.c_str()));
    char last[256] = {};
    size_t size = sizeof(last);
    zmq_getsockopt(socket_, ZMQ_LAST_ENDPOINT, last, &size);
    endpoint_ = last;
  }
  ~FakeReplayServer() { zmq_close(socket_); }
  const std::string& endpoint() const { return endpoint_; }

  // Waits (bounded) for one request; returns its start sequence, or nullopt.
  std::optional<uint64_t> ReceiveRequest() {
    zmq_pollitem_t item{socket_, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, static_cast<long>(kWait / std::chrono::milliseconds(1))) != 1) {
      return std::nullopt;
    }
    std::vector<std::string> parts;
    int more = 1;
    while (more) {
      zmq_msg_t msg;
      zmq_msg_init(&msg);
      zmq_msg_recv(&msg, socket_, 0);
      parts.emplace_back(static_cast<char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
      more = zmq_msg_more(&msg);
      zmq_msg_close(&msg);
    }
    if (parts.size() != 3 || !parts[1].empty() || parts[2].size() != 8) return std::nullopt;
    identity_ = parts[0];
    uint64_t start = 0;
    for (unsigned char c : parts[2]) start = (start << 8) | c;
    return start;
  }

  void Reply(uint64_t seq, const std::vector<uint8_t>& payload) {
    uint8_t seq_bytes[8];
    for (int i = 0; i < 8; ++i) seq_bytes[i] = static_cast<uint8_t>(seq >> (56 - 8 * i));
    zmq_send(socket_, identity_.data(), identity_.size(), ZMQ_SNDMORE);
    zmq_send(socket_, "", 0, ZMQ_SNDMORE);
    zmq_send(socket_, seq_bytes, 8, ZMQ_SNDMORE);
    zmq_send(socket_, payload.data(), payload.size(), 0);
  }
  void End() { Reply(UINT64_MAX, {}); }

 private:
  void* socket_ = nullptr;
  std::string endpoint_;
  std::string identity_;
};

TEST_F(EngineIngestTest, GapIsRepairedByReplay) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  FakeReplayServer replay(context_, "tcp://127.0.0.1:*");
  auto source = ingest_->AddEngineWorker({.endpoint = engine.endpoint(),
                                          .worker_id = 5,
                                          .topic = "kv-events",
                                          .replay_endpoint = replay.endpoint()});
  ASSERT_TRUE(source.ok()) << source.status();
  ASSERT_TRUE(engine.WaitForSubscriber());
  engine.Send(0, VllmPayload("array_store_dp_medium"));  // blocks 1, 2
  // Lost on the way: 1 = continuation (block 3), 2 = removal of block 3.
  engine.Send(3, VllmPayload("map_store_continuation"));  // block 3 again
  // Asked from the last message heard: its copy proves the same engine answers.
  ASSERT_EQ(0u, replay.ReceiveRequest().value_or(99));
  engine.Send(4, VllmPayload("array_remove_full_schema"));  // live, held during the replay
  replay.Reply(0, VllmPayload("array_store_dp_medium"));
  replay.Reply(1, VllmPayload("array_store_continuation"));
  replay.Reply(2, VllmPayload("array_remove_full_schema"));
  // The engines replay everything they buffered from the sequence asked for, including what
  // arrived live: those replies are not counted again (messages counts each sequence once).
  replay.Reply(3, VllmPayload("map_store_continuation"));
  replay.Reply(4, VllmPayload("array_remove_full_schema"));
  replay.End();
  const IngestStats stats = WaitForMessages(*source, 5, 5);
  EXPECT_EQ(1u, stats.gaps);
  EXPECT_EQ(2u, stats.missed_messages);
  EXPECT_EQ(1u, stats.recoveries);
  EXPECT_EQ(0u, stats.state_unknown);  // repaired, not cleared
  EXPECT_EQ(5u, stats.events_applied);
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {5, 0}));  // the engine's true state after message 4
}

TEST_F(EngineIngestTest, ReplayThatNeverAnswersFallsBackToClearing) {
  auto router = Router::Create(RouterOptions{.block_size = 16});
  auto service = IngestService::Create(router->get(), {.replay_timeout_ms = 100});
  ASSERT_TRUE((*service)->Start().ok());
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  FakeReplayServer silent(context_, "tcp://127.0.0.1:*");
  auto source = (*service)->AddEngineWorker({.endpoint = engine.endpoint(),
                                             .worker_id = 5,
                                             .topic = "kv-events",
                                             .replay_endpoint = silent.endpoint()});
  ASSERT_TRUE(source.ok());
  ASSERT_TRUE(engine.WaitForSubscriber());
  engine.Send(0, VllmPayload("array_store_dp_medium"));
  engine.Send(3, VllmPayload("array_all_cleared"));
  engine.Send(4, VllmPayload("map_store"));
  ASSERT_TRUE(silent.ReceiveRequest().has_value());
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  IngestStats stats = *(*service)->Stats(*source);
  while (stats.events_applied < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    stats = *(*service)->Stats(*source);
  }
  EXPECT_EQ(1u, stats.gaps);
  EXPECT_EQ(2u, stats.recoveries);  // the replay, then the repair from message 0, both silent
  EXPECT_EQ(3u, stats.events_applied);
  EXPECT_EQ(0u, stats.state_unknown);  // flagged, then the engine's own clear (3) restored it
  auto scores = (*router)->OverlapScores(kPrompt);
  ASSERT_TRUE(scores.ok());
  ASSERT_EQ(1u, scores->size());
  EXPECT_EQ(2u, (*scores)[0].overlap.device_blocks);
  service->reset();
}

// An engine (vLLM, SGLang) publishing a ZMQ replay endpoint, subscribed to by the test's
// ingest service.
class ReplayingEngineTest : public EngineIngestTest {
 protected:
  // `timeout_ms`: the ingest's replay timeout.
  void Start(uint32_t timeout_ms = 2000) {
    auto service = IngestService::Create(router_.get(), {.replay_timeout_ms = timeout_ms});
    ASSERT_TRUE(service.ok());
    ingest_ = std::move(*service);
    ASSERT_TRUE(ingest_->Start().ok());
    engine_ = &Engine("tcp://127.0.0.1:*");
    replay_ = std::make_unique<FakeReplayServer>(context_, "tcp://127.0.0.1:*");
    auto source = ingest_->AddEngineWorker({.endpoint = engine_->endpoint(),
                                            .worker_id = 5,
                                            .topic = "kv-events",
                                            .replay_endpoint = replay_->endpoint()});
    ASSERT_TRUE(source.ok()) << source.status();
    source_ = *source;
    ASSERT_TRUE(engine_->WaitForSubscriber());
  }
  void TearDown() override {
    ingest_.reset();
    replay_.reset();
    EngineIngestTest::TearDown();
  }

  FakeEngine* engine_ = nullptr;
  std::unique_ptr<FakeReplayServer> replay_;
  uint64_t source_ = 0;
};

// [ts, []]: a batch with no events.
const std::vector<uint8_t> kEmptyBatch = {0x92, 0x01, 0x90};

// Issue 19: a restarted engine whose numbering already passed the old one's looks like a gap;
// its replay was applied on top of the dead engine's blocks.
TEST_F(ReplayingEngineTest, ARestartThatLooksLikeAGapIsNotReplayedOntoTheOldBlocks) {
  Start();
  StoreBlocks(*engine_, source_, 0, /*three=*/true);
  // A new engine: 0 stores blocks 1 and 2, 1 clears, 2 stores them again; 3 arrives live.
  engine_->Send(3, kEmptyBatch);
  ASSERT_EQ(1u, replay_->ReceiveRequest().value_or(99));  // the check: message 1
  replay_->Reply(1, VllmPayload("array_all_cleared"));    // not the 1 heard
  replay_->Reply(2, VllmPayload("map_store"));
  replay_->End();
  // The repair: the new engine's whole history.
  ASSERT_EQ(0u, replay_->ReceiveRequest().value_or(99));
  replay_->Reply(0, VllmPayload("map_store"));
  replay_->Reply(1, VllmPayload("array_all_cleared"));
  replay_->Reply(2, VllmPayload("map_store"));
  replay_->Reply(3, kEmptyBatch);
  replay_->End();
  const IngestStats stats = WaitForMessages(source_, 6);  // 0, 1, the replayed 0-2, 3
  EXPECT_EQ(1u, stats.restarts);
  EXPECT_EQ(0u, stats.state_unknown);            // the whole history came
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {5, 0}));  // the new engine's, without the old block 3
}

// Issue 19: numbers the engine skipped (nothing lost) made the replay come back short, and the
// worker was cleared.
TEST_F(ReplayingEngineTest, ASkipWithNothingLostIsNoLoss) {
  Start();
  StoreBlocks(*engine_, source_, 0, /*three=*/false);
  engine_->Send(3, VllmPayload("array_store_continuation"));  // 1 and 2 were never published
  ASSERT_EQ(0u, replay_->ReceiveRequest().value_or(99));
  replay_->Reply(0, VllmPayload("array_store_dp_medium"));
  replay_->Reply(3, VllmPayload("array_store_continuation"));
  replay_->End();
  const IngestStats stats = WaitForMessages(source_, 2, 2);
  EXPECT_EQ(1u, stats.gaps);
  EXPECT_EQ(0u, stats.state_unknown);
  EXPECT_EQ(3u, DeviceBlocks(kPrompt, {5, 0}));  // nothing cleared
}

// A replay that fails (here: times out) clears and flags the worker, then the engine's whole
// history, asked for from message 0, repairs it.
TEST_F(ReplayingEngineTest, AFlaggedWorkerIsRepairedByAFullReplay) {
  // Each replay has this long, the repair too: 200 ms could end it as well under a sanitizer.
  Start(/*timeout_ms=*/2000);
  StoreBlocks(*engine_, source_, 0, /*three=*/false);
  engine_->Send(2, VllmPayload("array_remove_full_schema"));  // removes block 3, stored by 1
  ASSERT_EQ(0u, replay_->ReceiveRequest().value_or(99));      // not answered: times out
  ASSERT_EQ(0u, replay_->ReceiveRequest().value_or(99));      // the repair
  replay_->Reply(0, VllmPayload("array_store_dp_medium"));
  replay_->Reply(1, VllmPayload("array_store_continuation"));
  replay_->Reply(2, VllmPayload("array_remove_full_schema"));
  replay_->End();
  const IngestStats stats = WaitForMessages(source_, 4, 4);  // 0, the replayed 0-1, 2
  EXPECT_EQ(2u, stats.recoveries);
  EXPECT_EQ(0u, stats.state_unknown);
  EXPECT_EQ(0u, stats.rejected[static_cast<int>(IngestReject::kIndexRejected)]);
  EXPECT_EQ(2u, DeviceBlocks(kPrompt, {5, 0}));
}

// Issue 19: one unknown event type rejected the whole batch: the clear beside it was lost.
TEST_F(EngineIngestTest, AnUnknownEventTypeIsSkippedAndTheRestOfTheBatchApplies) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  const uint64_t source = Subscribe(engine, 5);
  StoreBlocks(engine, source, 0, /*three=*/false);
  // [1, [["SomethingNew"], ["AllBlocksCleared"]]]
  std::vector<uint8_t> payload = {0x92, 0x01, 0x92, 0x91, 0xac};
  for (char c : std::string("SomethingNew")) payload.push_back(static_cast<uint8_t>(c));
  payload.insert(payload.end(), {0x91, 0xb0});
  for (char c : std::string("AllBlocksCleared")) payload.push_back(static_cast<uint8_t>(c));
  engine.Send(1, payload);
  const IngestStats stats = WaitForMessages(source, 2, 2);
  EXPECT_EQ(0u, DeviceBlocks(kPrompt, {5, 0}));
  EXPECT_EQ(1u, stats.rejected[static_cast<int>(IngestReject::kBadMsgpack)]);
  EXPECT_EQ("event 0: unknown event tag 'SomethingNew'", stats.last_reject);
  EXPECT_EQ(stats.last_reject, ingest_->Stats(0)->last_reject);  // the sum's: the latest
}

TEST_F(EngineIngestTest, RegistrationRules) {
  FakeEngine& engine = Engine("tcp://127.0.0.1:*");
  EngineWorker wrong{.endpoint = engine.endpoint(), .worker_id = 1, .block_size = 32};
  auto refused = ingest_->AddEngineWorker(wrong);
  ASSERT_EQ(absl::StatusCode::kInvalidArgument, refused.status().code());
  EXPECT_NE(std::string::npos, refused.status().message().find("block size 32"));
  EXPECT_NE(std::string::npos, refused.status().message().find("router's block size is 16"));

  const uint64_t source = Subscribe(engine, 5);
  EXPECT_EQ(
      absl::StatusCode::kAlreadyExists,
      ingest_->AddEngineWorker({.endpoint = engine.endpoint(), .worker_id = 5}).status().code());
  engine.Send(0, VllmPayload("array_store_dp_medium"));
  WaitForMessages(source, 1);
  ASSERT_EQ(2u, DeviceBlocks(kPrompt, {5, 0}));
  EXPECT_TRUE(ingest_->RemoveEngineWorker(5, /*clear_index=*/true).ok());
  EXPECT_EQ(0u, DeviceBlocks(kPrompt, {5, 0}));
  EXPECT_EQ(absl::StatusCode::kNotFound, ingest_->RemoveEngineWorker(5, true).code());
  // The worker may register again, e.g. after a move.
  EXPECT_TRUE(ingest_->AddEngineWorker({.endpoint = engine.endpoint(), .worker_id = 5}).ok());
}

}  // namespace
}  // namespace kvrouter

// Throughput of each ingestion path, in events/s (BENCHMARKS.md records the figures), and the
// mean lag (publish time to applied) the backlog of a burst causes. Disabled in normal runs;
// measure with
//   build/.../tests/ingest/ingest_tests --gtest_also_run_disabled_tests
//       --gtest_filter='*Throughput*'
// Each event stores one 16-token block (a fresh prompt), the worst case for the index: every
// event inserts a node.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <nats/nats.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/clock.h"
#include "core/router.h"
#include "ingest/ingest_service.h"
#include "nats_server.h"
#include "wire/engine_events.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {
namespace {

constexpr int kEvents = 200000;
constexpr int kEventsPerBatch = 50;
constexpr uint32_t kBlockSize = 16;

std::vector<KvEvent> Batch(int first) {
  std::vector<KvEvent> events;
  for (int i = first; i < first + kEventsPerBatch; ++i) {
    StoredEvent stored;
    stored.block_hashes = {static_cast<uint64_t>(i) + 1};
    for (uint32_t t = 0; t < kBlockSize; ++t) {
      stored.token_ids.push_back(static_cast<uint32_t>(i) * kBlockSize + t);
    }
    events.push_back(
        KvEvent{.worker = {1, 0}, .event_id = static_cast<uint64_t>(i), .data = std::move(stored)});
  }
  return events;
}

// Every batch of the run.
std::vector<std::vector<KvEvent>> Batches() {
  std::vector<std::vector<KvEvent>> batches;
  for (int i = 0; i < kEvents; i += kEventsPerBatch) batches.push_back(Batch(i));
  return batches;
}

// Overwrites the float64 `ts` of a MsgpackBatch payload (big-endian, after the 0x93 0xcb).
void SetTimestamp(std::vector<uint8_t>& payload, double seconds) {
  uint64_t bits = 0;
  std::memcpy(&bits, &seconds, sizeof(bits));
  for (int b = 0; b < 8; ++b) payload[2 + b] = static_cast<uint8_t>(bits >> (56 - 8 * b));
}

// The same batch as vLLM's msgpack: [ts, [["BlockStored", [hash], nil, tokens, 16, nil, "GPU"]...],
// 0]
std::vector<uint8_t> MsgpackBatch(int first) {
  std::vector<uint8_t> out = {0x93, 0xcb, 0x41, 0xda, 0x13, 0xb8, 0x60, 0x10, 0x00, 0x00};
  out.push_back(0xdc);
  out.push_back(0);
  out.push_back(kEventsPerBatch);
  auto u32 = [&](uint32_t v) {
    out.push_back(0xce);
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(v >> s));
  };
  for (int i = first; i < first + kEventsPerBatch; ++i) {
    out.push_back(0x97);
    const char tag[] = "BlockStored";
    out.push_back(0xab);
    out.insert(out.end(), tag, tag + 11);
    out.push_back(0x91);
    u32(static_cast<uint32_t>(i) + 1);
    out.push_back(0xc0);
    out.push_back(0xdc);
    out.push_back(0);
    out.push_back(kBlockSize);
    for (uint32_t t = 0; t < kBlockSize; ++t) u32(static_cast<uint32_t>(i) * kBlockSize + t);
    out.push_back(kBlockSize);
    out.push_back(0xc0);
    out.push_back(0xa3);
    out.insert(out.end(), {'G', 'P', 'U'});
  }
  out.push_back(0x00);
  return out;
}

struct Harness {
  std::unique_ptr<Router> router = *Router::Create(RouterOptions{.block_size = kBlockSize});
  std::unique_ptr<IngestService> ingest = *IngestService::Create(router.get(), {});

  void WaitFor(uint64_t source, uint64_t events) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (ingest->Stats(source)->events_applied < events &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
};

void Report(const char* path, std::chrono::steady_clock::time_point start, uint64_t events) {
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%-32s %9.0f events/s (%llu events in %.3f s)\n", path, events / seconds,
              static_cast<unsigned long long>(events), seconds);
}

// The lag of a burst: every batch is stamped when sent, so the mean is half the drain time.
void ReportLag(const IngestStats& stats) {
  if (stats.lag_samples == 0) return;
  std::printf("%-32s mean %.1f ms, max %.1f ms over %llu batches\n", "  lag",
              stats.lag_total_us / 1e3 / stats.lag_samples, stats.lag_max_us / 1e3,
              static_cast<unsigned long long>(stats.lag_samples));
}

TEST(IngestThroughput, DISABLED_NativeStreamTcp) {
  Harness h;
  std::string bound;
  const uint64_t source = *h.ingest->Listen("tcp://127.0.0.1:0", &bound);
  ASSERT_TRUE(h.ingest->Start().ok());
  const std::vector<std::vector<KvEvent>> batches = Batches();
  // A plain blocking client, as kvr_publisher is.
  const auto start = std::chrono::steady_clock::now();
  {
    int fd = -1;
    const std::string port = bound.substr(bound.rfind(':') + 1);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(port)));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_EQ(0, ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)));
    for (const auto& batch : batches) {
      // Encoded and stamped as sent, as kvr_publisher_send does.
      const std::vector<uint8_t> f = *FrameBatch(EncodeEventBatch(batch, UnixNowNanos()));
      size_t sent = 0;
      while (sent < f.size()) sent += ::send(fd, f.data() + sent, f.size() - sent, 0);
    }
    h.WaitFor(source, kEvents);
    ::close(fd);
  }
  Report("native stream (TCP, FlatBuffers)", start, kEvents);
  ReportLag(*h.ingest->Stats(source));
  EXPECT_EQ(static_cast<uint64_t>(kEvents), h.ingest->Stats(source)->events_applied);
}

TEST(IngestThroughput, DISABLED_VllmZmq) {
  Harness h;
  void* ctx = zmq_ctx_new();
  void* pub = zmq_socket(ctx, ZMQ_XPUB);
  const int hwm = 0;  // unbounded: measure ingestion, not drops
  zmq_setsockopt(pub, ZMQ_SNDHWM, &hwm, sizeof(hwm));
  ASSERT_EQ(0, zmq_bind(pub, "tcp://127.0.0.1:*"));
  char endpoint[128] = {};
  size_t size = sizeof(endpoint);
  zmq_getsockopt(pub, ZMQ_LAST_ENDPOINT, endpoint, &size);
  ASSERT_TRUE(h.ingest->Start().ok());
  const uint64_t source = *h.ingest->AddEngineWorker({.endpoint = endpoint, .worker_id = 1});
  char sub[64];
  ASSERT_GE(zmq_recv(pub, sub, sizeof(sub), 0), 1);  // the subscription is live
  std::vector<std::vector<uint8_t>> payloads;
  for (int i = 0; i < kEvents; i += kEventsPerBatch) payloads.push_back(MsgpackBatch(i));
  const auto start = std::chrono::steady_clock::now();
  uint64_t seq = 0;
  for (auto& p : payloads) {
    SetTimestamp(p, static_cast<double>(UnixNowNanos()) / 1e9);  // as vLLM's time.time()
    uint8_t seq_bytes[8];
    for (int b = 0; b < 8; ++b) seq_bytes[b] = static_cast<uint8_t>(seq >> (56 - 8 * b));
    ++seq;
    zmq_send(pub, "", 0, ZMQ_SNDMORE);
    zmq_send(pub, seq_bytes, 8, ZMQ_SNDMORE);
    zmq_send(pub, p.data(), p.size(), 0);
  }
  h.WaitFor(source, kEvents);
  Report("vLLM over ZMQ (msgpack)", start, kEvents);
  ReportLag(*h.ingest->Stats(source));
  EXPECT_EQ(static_cast<uint64_t>(kEvents), h.ingest->Stats(source)->events_applied);
  EXPECT_EQ(0u, h.ingest->Stats(source)->gaps);
  h.ingest.reset();
  zmq_close(pub);
  zmq_ctx_term(ctx);
}

// A nats-server on 127.0.0.1, an ingest subscribed to kv.events on it, and a publisher.
struct NatsHarness : Harness {
  NatsServer server{FreePort()};
  natsConnection* conn = nullptr;
  uint64_t source = 0;

  void SetUp() {
    ASSERT_TRUE(server.Start());
    ASSERT_TRUE(ingest->Start().ok());
    source = *ingest->SubscribeNats(server.url(), "kv.events");
    ASSERT_EQ(NATS_OK, natsConnection_ConnectTo(&conn, server.url().c_str()));
  }
  // Stamped as it is sent, so that the lag counts the time spent queued behind others.
  void Publish(const std::vector<KvEvent>& batch) {
    const std::vector<uint8_t> b = EncodeEventBatch(batch, UnixNowNanos());
    ASSERT_EQ(NATS_OK, natsConnection_Publish(conn, "kv.events", b.data(), b.size()));
  }
  ~NatsHarness() {
    natsConnection_Destroy(conn);
    ingest.reset();
  }
};

// Batches published to a real nats-server on 127.0.0.1 by the NATS C client, received by the
// ingest loop's subscription: two extra hops (client to server to subscriber) over TCP.
TEST(IngestThroughput, DISABLED_NativeBatchesOverNats) {
  NatsHarness h;
  ASSERT_NO_FATAL_FAILURE(h.SetUp());
  const std::vector<std::vector<KvEvent>> batches = Batches();
  const auto start = std::chrono::steady_clock::now();
  for (const auto& batch : batches) ASSERT_NO_FATAL_FAILURE(h.Publish(batch));
  ASSERT_EQ(NATS_OK, natsConnection_Flush(h.conn));
  h.WaitFor(h.source, kEvents);
  Report("native batches over NATS", start, kEvents);
  ReportLag(*h.ingest->Stats(h.source));
  EXPECT_EQ(static_cast<uint64_t>(kEvents), h.ingest->Stats(h.source)->events_applied);
}

// Lag in steady state rather than behind a burst: 100,000 events/s (2,000 batches of 50 per
// second, well under the path's capacity) over NATS for 2 s.
TEST(IngestThroughput, DISABLED_PacedNatsLag) {
  constexpr int kBatchesPerSecond = 2000;
  NatsHarness h;
  ASSERT_NO_FATAL_FAILURE(h.SetUp());
  const std::vector<std::vector<KvEvent>> batches = Batches();
  const int num_batches = 2 * kBatchesPerSecond;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < num_batches; ++i) {
    std::this_thread::sleep_until(start +
                                  std::chrono::microseconds(1'000'000 / kBatchesPerSecond) * i);
    ASSERT_NO_FATAL_FAILURE(h.Publish(batches[i]));
    ASSERT_EQ(NATS_OK, natsConnection_Flush(h.conn));  // send now, as a paced publisher would
  }
  h.WaitFor(h.source, static_cast<uint64_t>(num_batches) * kEventsPerBatch);
  Report("NATS paced at 100k events/s", start,
         static_cast<uint64_t>(num_batches) * kEventsPerBatch);
  ReportLag(*h.ingest->Stats(h.source));
}

TEST(IngestThroughput, DISABLED_DecodersAlone) {
  std::vector<std::vector<uint8_t>> fb, mp;
  for (int i = 0; i < kEvents; i += kEventsPerBatch) {
    fb.push_back(EncodeEventBatch(Batch(i)));
    mp.push_back(MsgpackBatch(i));
  }
  auto start = std::chrono::steady_clock::now();
  for (const auto& b : fb) ASSERT_TRUE(DecodeEventBatch(b).ok());
  Report("FlatBuffers decode only", start, kEvents);
  start = std::chrono::steady_clock::now();
  for (const auto& b : mp) ASSERT_TRUE(DecodeEnginePayload(b).ok());
  Report("msgpack decode only", start, kEvents);
}

}  // namespace
}  // namespace kvrouter

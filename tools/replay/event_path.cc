#include "replay/event_path.h"

#include <stdlib.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <msgpack.hpp>
#include <random>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <vector>

#include "replay/abi_call.h"

#if KVR_REPLAY_WITH_NATS
#include <nats/nats.h>
#endif

namespace kvrouter::replay {
namespace {

// A wire path that has not caught up after this long is broken, not slow.
constexpr auto kSyncTimeout = std::chrono::seconds(30);

kvr_tier TierOf(Tier tier) { return tier == Tier::kHost ? KVR_TIER_HOST_PINNED : KVR_TIER_DEVICE; }

// vLLM's name of a tier ("medium").
std::string_view MediumOf(Tier tier) { return tier == Tier::kHost ? "CPU" : "GPU"; }

// The ABI's view of an engine's events (the arrays stay the caller's). A host-tier run is a
// copy: hashes only, no tokens, no parent.
kvr_stored_event StoredEventOf(uint32_t worker, const StoredRun& run, uint64_t event_id) {
  kvr_stored_event event;
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = worker;
  event.event_id = event_id;
  event.tier = TierOf(run.tier);
  if (run.has_parent) {
    event.flags |= KVR_STORED_HAS_PARENT;
    event.parent_hash = run.parent_hash;
  }
  event.block_hashes = run.block_hashes.data();
  event.num_blocks = run.block_hashes.size();
  event.token_ids = run.token_ids.empty() ? nullptr : run.token_ids.data();
  event.num_tokens = run.token_ids.size();
  return event;
}

kvr_removed_event RemovedEventOf(uint32_t worker, std::span<const uint64_t> block_hashes, Tier tier,
                                 uint64_t event_id) {
  kvr_removed_event event;
  kvr_removed_event_init(&event, sizeof event);
  event.worker_id = worker;
  event.event_id = event_id;
  event.tier = TierOf(tier);
  event.block_hashes = block_hashes.data();
  event.num_blocks = block_hashes.size();
  return event;
}

// ---- inprocess ---------------------------------------------------------------------------

class InProcessPath final : public EventPath {
 public:
  explicit InProcessPath(kvr_router* router) : router_(router) {}

  void Stored(uint32_t worker, const StoredRun& run) override {
    const kvr_stored_event event = StoredEventOf(worker, run, next_event_id_++);
    Count(kvr_router_apply_stored(router_, &event, nullptr));
    ++counts_.stored;
  }

  void Removed(uint32_t worker, std::span<const uint64_t> block_hashes, Tier tier) override {
    const kvr_removed_event event = RemovedEventOf(worker, block_hashes, tier, next_event_id_++);
    Count(kvr_router_apply_removed(router_, &event, nullptr));
    ++counts_.removed;
  }

  EventCounts counts() override { return counts_; }

 private:
  // A rejected event is what a real engine stream can produce too (e.g. a removal racing a
  // store): counted and reported, not fatal; the router applies what it can.
  void Count(kvr_status status) {
    if (status != KVR_OK) ++counts_.rejected;
  }

  kvr_router* router_;
  uint64_t next_event_id_ = 1;
  EventCounts counts_;
};

// ---- The wire paths' common part: an ingest object feeding the router ---------------------

// A private directory for sockets, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "kvr_replay_XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class IngestPath : public EventPath {
 public:
  explicit IngestPath(kvr_router* router) {
    CheckAbi("kvr_ingest_new",
             [&](kvr_error** e) { return kvr_ingest_new(router, nullptr, &ingest_, e); });
    try {
      CheckAbi("kvr_ingest_start", [&](kvr_error** e) { return kvr_ingest_start(ingest_, e); });
    } catch (...) {
      kvr_ingest_free(ingest_);  // no destructor runs for a constructor that throws
      throw;
    }
  }
  ~IngestPath() override { kvr_ingest_free(ingest_); }

  // Waits until the ingest has handled (applied or rejected) as many messages as were sent. A
  // message that never comes (a transport that lost it) fails the run after kSyncTimeout, and
  // one more than was sent (someone else's, on a shared bus) fails it at once: either way the
  // router's view is not the engines'.
  void Sync() override {
    const auto deadline = std::chrono::steady_clock::now() + kSyncTimeout;
    uint64_t handled;
    while ((handled = Stats().messages) < sent_messages_) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error("the router's ingest handled " + std::to_string(handled) +
                                 " of the " + std::to_string(sent_messages_) +
                                 " messages sent in 30 s: the transport lost some");
      }
      std::this_thread::yield();
    }
    if (handled > sent_messages_) {
      throw std::runtime_error("the router's ingest handled " + std::to_string(handled) +
                               " messages where " + std::to_string(sent_messages_) +
                               " were sent: another publisher shares its subjects");
    }
  }

  EventCounts counts() override {
    Sync();
    const kvr_ingest_stats stats = Stats();
    EventCounts counts = counts_;
    for (uint64_t rejected : stats.rejected) counts.rejected += rejected;
    return counts;
  }

 protected:
  kvr_ingest_stats Stats() {
    kvr_ingest_stats stats;
    kvr_ingest_stats_init(&stats, sizeof stats);
    CheckAbi("kvr_ingest_get_stats",
             [&](kvr_error** e) { return kvr_ingest_get_stats(ingest_, 0, &stats, e); });
    return stats;
  }

  kvr_ingest* ingest_ = nullptr;
  uint64_t sent_messages_ = 0;
  EventCounts counts_;  // stored and removed sent; rejections come from the ingest's counters
  TempDir dir_;
};

// ---- stream: FlatBuffers batches over a Unix socket ----------------------------------------

// The paths that carry kvrouter's own FlatBuffers EventBatches: one batch per event, as an
// engine publishing as it goes would, handed to Send (which leaves the batch to be cleared). An
// event too large for one message of the transport goes in parts, as an engine would send it:
// a store as consecutive stores, each part's parent the previous part's last block (a copy to
// another tier, without tokens or parent, as copies of fewer blocks), a removal as removals of
// fewer blocks. The router's index ends the same; an event the router rejects counts once per
// part.
class BatchPath : public IngestPath {
 public:
  explicit BatchPath(kvr_router* router) : IngestPath(router) {
    CheckAbi("kvr_event_batch_new", [&](kvr_error** e) { return kvr_event_batch_new(&batch_, e); });
  }
  ~BatchPath() override { kvr_event_batch_free(batch_); }

  void Stored(uint32_t worker, const StoredRun& run) override {
    SendStored(worker, run);
    ++counts_.stored;
  }

  void Removed(uint32_t worker, std::span<const uint64_t> block_hashes, Tier tier) override {
    SendRemoved(worker, block_hashes, tier);
    ++counts_.removed;
  }

 protected:
  // Sends `batch` as engine `worker` publishes it.
  virtual void Send(uint32_t worker, const kvr_event_batch* batch) = 0;
  // The largest message the transport carries, in bytes.
  virtual size_t MaxMessageBytes() const { return std::numeric_limits<size_t>::max(); }

 private:
  // An encoded batch of one event is its token ids and hashes plus a few hundred bytes of
  // FlatBuffers tables and offsets; 1 KiB covers those with room to spare.
  bool FitsOneMessage(size_t tokens, size_t blocks) const {
    return tokens * sizeof(uint32_t) + blocks * sizeof(uint64_t) + 1024 <= MaxMessageBytes();
  }

  void SendStored(uint32_t worker, const StoredRun& run) {
    const size_t blocks = run.block_hashes.size();
    if (blocks > 1 && !FitsOneMessage(run.token_ids.size(), blocks)) {
      const size_t half = blocks / 2, half_tokens = run.token_ids.size() / blocks * half;
      StoredRun first = run, rest = run;
      first.block_hashes = run.block_hashes.first(half);
      first.token_ids = run.token_ids.first(half_tokens);
      rest.block_hashes = run.block_hashes.subspan(half);
      rest.token_ids = run.token_ids.subspan(half_tokens);
      if (!run.token_ids.empty()) {  // a store continues the previous part
        rest.has_parent = true;
        rest.parent_hash = first.block_hashes.back();
      }
      SendStored(worker, first);
      SendStored(worker, rest);
      return;
    }
    const kvr_stored_event event = StoredEventOf(worker, run, next_event_id_++);
    CheckAbi("kvr_event_batch_add_stored",
             [&](kvr_error** e) { return kvr_event_batch_add_stored(batch_, &event, e); });
    SendBatch(worker);
  }

  void SendRemoved(uint32_t worker, std::span<const uint64_t> block_hashes, Tier tier) {
    if (block_hashes.size() > 1 && !FitsOneMessage(0, block_hashes.size())) {
      const size_t half = block_hashes.size() / 2;
      SendRemoved(worker, block_hashes.first(half), tier);
      SendRemoved(worker, block_hashes.subspan(half), tier);
      return;
    }
    const kvr_removed_event event = RemovedEventOf(worker, block_hashes, tier, next_event_id_++);
    CheckAbi("kvr_event_batch_add_removed",
             [&](kvr_error** e) { return kvr_event_batch_add_removed(batch_, &event, e); });
    SendBatch(worker);
  }

  void SendBatch(uint32_t worker) {
    Send(worker, batch_);
    kvr_event_batch_clear(batch_);
    ++sent_messages_;
  }

  kvr_event_batch* batch_ = nullptr;
  uint64_t next_event_id_ = 1;
};

class StreamPath final : public BatchPath {
 public:
  explicit StreamPath(kvr_router* router) : BatchPath(router) {
    const std::string endpoint = "unix://" + dir_.path() + "/events.sock";
    CheckAbi("kvr_ingest_listen", [&](kvr_error** e) {
      return kvr_ingest_listen(ingest_, endpoint.c_str(), nullptr, nullptr, 0, nullptr, e);
    });
    CheckAbi("kvr_publisher_connect", [&](kvr_error** e) {
      return kvr_publisher_connect(endpoint.c_str(), &publisher_, e);
    });
  }
  ~StreamPath() override { kvr_publisher_free(publisher_); }

 private:
  // One stream (one connection) for every engine: the batches name their worker.
  void Send(uint32_t, const kvr_event_batch* batch) override {
    CheckAbi("kvr_publisher_send",
             [&](kvr_error** e) { return kvr_publisher_send(publisher_, batch, e); });
  }

  kvr_publisher* publisher_ = nullptr;
};

// ---- nats: FlatBuffers batches on a NATS server, a subject per engine ----------------------

#if KVR_REPLAY_WITH_NATS
class NatsPath final : public BatchPath {
 public:
  NatsPath(kvr_router* router, const std::string& url) : BatchPath(router) {
    subjects_ = "kvrouter.replay." + UniqueToken() + ".engine.";
    const std::string wildcard = subjects_ + "*";
    CheckAbi("kvr_ingest_subscribe_nats", [&](kvr_error** e) {
      return kvr_ingest_subscribe_nats(ingest_, url.c_str(), wildcard.c_str(), nullptr, e);
    });
    // The engines' side: one connection, so the server keeps their messages in publishing order
    // (a router subscribed once then hears them in that order too).
    const natsStatus status = natsConnection_ConnectTo(&publisher_, url.c_str());
    if (status != NATS_OK) {
      throw std::runtime_error(std::string("the engines cannot connect to the NATS server: ") +
                               natsStatus_GetText(status));
    }
    max_payload_ =
        static_cast<size_t>(std::max<int64_t>(natsConnection_GetMaxPayload(publisher_), 0));
  }
  ~NatsPath() override {
    kvr_ingest_stop(ingest_, nullptr);  // the subscription goes before the engines' connection
    natsConnection_Destroy(publisher_);
  }

 private:
  void Send(uint32_t worker, const kvr_event_batch* batch) override {
    kvr_buffer* encoded = nullptr;
    CheckAbi("kvr_event_batch_encode",
             [&](kvr_error** e) { return kvr_event_batch_encode(batch, &encoded, e); });
    const std::string subject = subjects_ + std::to_string(worker);
    const natsStatus status =
        natsConnection_Publish(publisher_, subject.c_str(), kvr_buffer_data(encoded),
                               static_cast<int>(kvr_buffer_size(encoded)));
    kvr_buffer_free(encoded);
    if (status != NATS_OK) {
      throw std::runtime_error("publishing on " + subject +
                               " failed: " + natsStatus_GetText(status));
    }
  }

  size_t MaxMessageBytes() const override { return max_payload_; }

  // 128 random bits in hex: the subjects are this path's own, so that replays (and the
  // policies of one replay, each with its router) can share a server without hearing each
  // other's engines, whatever their process ids (containers each have a pid 1).
  static std::string UniqueToken() {
    std::random_device entropy;
    char token[33];
    for (int i = 0; i < 4; ++i) std::snprintf(token + 8 * i, 9, "%08x", entropy());
    return token;
  }

  std::string subjects_;  // "kvrouter.replay.<token>.engine.", then the worker
  natsConnection* publisher_ = nullptr;
  size_t max_payload_ = 0;  // the server's, in bytes
};
#endif

// ---- zmq: every engine a vLLM-style ZMQ publisher ------------------------------------------

constexpr char kTopic[] = "kv-events";

class ZmqPath final : public IngestPath {
 public:
  ZmqPath(kvr_router* router, uint32_t workers, uint32_t block_size)
      : IngestPath(router), block_size_(block_size), context_(zmq_ctx_new()) {
    for (uint32_t w = 0; w < workers; ++w) engines_.push_back(Bind(w));
    for (uint32_t w = 0; w < workers; ++w) Subscribe(w);
  }
  ~ZmqPath() override {
    kvr_ingest_stop(ingest_, nullptr);  // the subscribers go before the publishers
    for (Engine& engine : engines_) zmq_close(engine.socket);
    zmq_ctx_term(context_);
  }

  // [ts, [["BlockStored", block_hashes, parent or nil, token_ids, block_size, nil, "GPU"]], 0]
  void Stored(uint32_t worker, const StoredRun& run) override {
    Publish(worker, [&](msgpack::packer<msgpack::sbuffer>& event) {
      event.pack_array(7);
      event.pack(std::string_view("BlockStored"));
      PackHashes(event, run.block_hashes);
      if (run.has_parent) {
        event.pack_uint64(run.parent_hash);
      } else {
        event.pack_nil();
      }
      event.pack_array(static_cast<uint32_t>(run.token_ids.size()));
      for (uint32_t token : run.token_ids) event.pack_uint32(token);
      event.pack_uint32(block_size_);
      event.pack_nil();  // lora_id
      event.pack(MediumOf(run.tier));
    });
    ++counts_.stored;
  }

  // [ts, [["BlockRemoved", block_hashes, "GPU" or "CPU"]], 0]
  void Removed(uint32_t worker, std::span<const uint64_t> block_hashes, Tier tier) override {
    Publish(worker, [&](msgpack::packer<msgpack::sbuffer>& event) {
      event.pack_array(3);
      event.pack(std::string_view("BlockRemoved"));
      PackHashes(event, block_hashes);
      event.pack(MediumOf(tier));
    });
    ++counts_.removed;
  }

 private:
  struct Engine {
    void* socket = nullptr;
    std::string endpoint;
    uint64_t next_seq = 0;
  };

  // An XPUB, so that the subscription's arrival can be waited for instead of slept on.
  Engine Bind(uint32_t worker) {
    Engine engine;
    engine.socket = zmq_socket(context_, ZMQ_XPUB);
    const int unbounded = 0;  // a replay must not drop events
    zmq_setsockopt(engine.socket, ZMQ_SNDHWM, &unbounded, sizeof unbounded);
    engine.endpoint = "ipc://" + dir_.path() + "/engine" + std::to_string(worker);
    if (zmq_bind(engine.socket, engine.endpoint.c_str()) != 0) {
      throw std::runtime_error("zmq_bind " + engine.endpoint + ": " + zmq_strerror(zmq_errno()));
    }
    return engine;
  }

  void Subscribe(uint32_t worker) {
    kvr_engine_worker config;
    kvr_engine_worker_init(&config, sizeof config);
    config.engine = KVR_ENGINE_VLLM;
    config.endpoint = engines_[worker].endpoint.c_str();
    config.worker_id = worker;
    config.block_size = block_size_;
    config.topic = kTopic;
    CheckAbi("kvr_ingest_add_engine_worker", [&](kvr_error** e) {
      return kvr_ingest_add_engine_worker(ingest_, &config, nullptr, e);
    });
    zmq_pollitem_t item{engines_[worker].socket, 0, ZMQ_POLLIN, 0};
    char subscription[64];
    if (zmq_poll(&item, 1, 10'000) != 1 ||
        zmq_recv(engines_[worker].socket, subscription, sizeof subscription, 0) < 1) {
      throw std::runtime_error("the router's ingest did not subscribe to engine " +
                               std::to_string(worker) + " in 10 s");
    }
  }

  static void PackHashes(msgpack::packer<msgpack::sbuffer>& out, std::span<const uint64_t> hashes) {
    out.pack_array(static_cast<uint32_t>(hashes.size()));
    for (uint64_t hash : hashes) out.pack_uint64(hash);
  }

  // One message per event, as vLLM publishes a batch per engine step: [topic, seq, payload].
  template <typename PackEvent>
  void Publish(uint32_t worker, PackEvent pack_event) {
    msgpack::sbuffer payload;
    msgpack::packer<msgpack::sbuffer> packer(payload);
    packer.pack_array(3);
    packer.pack_double(
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
    packer.pack_array(1);
    pack_event(packer);
    packer.pack_uint32(0);  // data-parallel rank
    Engine& engine = engines_[worker];
    uint8_t seq[8];
    for (int i = 0; i < 8; ++i) seq[i] = static_cast<uint8_t>(engine.next_seq >> (56 - 8 * i));
    ++engine.next_seq;
    zmq_send(engine.socket, kTopic, sizeof kTopic - 1, ZMQ_SNDMORE);
    zmq_send(engine.socket, seq, sizeof seq, ZMQ_SNDMORE);
    zmq_send(engine.socket, payload.data(), payload.size(), 0);
    ++sent_messages_;
  }

  const uint32_t block_size_;
  void* context_;
  std::vector<Engine> engines_;
};

}  // namespace

Transport ParseTransport(const std::string& name) {
  if (name == "inprocess") return Transport::kInProcess;
  if (name == "stream") return Transport::kStream;
  if (name == "zmq") return Transport::kZmq;
  if (name == "nats") return Transport::kNats;
  throw std::invalid_argument("unknown --transport \"" + name +
                              "\" (inprocess, stream, zmq or nats)");
}

std::unique_ptr<EventPath> MakeEventPath(const EventTransport& transport, kvr_router* router,
                                         uint32_t workers, uint32_t block_size) {
  switch (transport.kind) {
    case Transport::kInProcess:
      return std::make_unique<InProcessPath>(router);
    case Transport::kStream:
      return std::make_unique<StreamPath>(router);
    case Transport::kZmq:
      return std::make_unique<ZmqPath>(router, workers, block_size);
    case Transport::kNats:
#if KVR_REPLAY_WITH_NATS
      return std::make_unique<NatsPath>(router, transport.nats_url);
#else
      throw std::runtime_error("--transport nats: this build has no NATS (KVR_WITH_NATS=OFF)");
#endif
  }
  throw std::invalid_argument("unknown transport");
}

}  // namespace kvrouter::replay

// fault_publisher: an engine for the fault tests (fault_test.cc), a process of its own that the
// tests start, command, kill and restart. It keeps its true KV cache (fault_model.h), draws its
// messages from it, and publishes them over one transport:
//
//   --mode zmq     as vLLM does: a PUB socket (an XPUB, so that it knows when a subscriber is
//                  there) sending [topic, 8-byte big-endian sequence, msgpack EventBatch], and,
//                  with --replay, a ROUTER socket answering replay requests from its buffer of
//                  the last --buffer messages, as vLLM's replay endpoint does;
//   --mode stream  kvrouter's native stream: length-prefixed FlatBuffers EventBatches
//                  (kvr_event_batch_encode) written to a TCP connection by hand, so that a frame
//                  can be cut;
//   --mode nats    a NATS subject, each message a native EventBatch (--format native) or a
//                  message of Dynamo's KV event plane (--format dynamo: numbered per publisher).
//   --mode jetstream  the same native EventBatches published to a subject of a JetStream stream,
//                  each one retried (with the same Nats-Msg-Id, so the server keeps one copy)
//                  until the server acknowledges it has stored it: what a publisher must do for
//                  nothing to be lost while nats-server restarts. "publish" waits meanwhile.
//
// Commands come one per line on stdin; each is answered with one line on stdout, "ok ..." or
// "err ...":
//
//   publish N [PACE_US]  N messages (PACE_US apart, serving replays meanwhile); "ok sent=S
//                        unheard=U errors=E": U were sent while no subscriber was there (ZMQ:
//                        lost for sure), E refused by the transport; "retries=R": JetStream
//                        publications repeated so far because no acknowledgement came
//   drop N               N messages the engine makes (its cache changes, its replay buffer has
//                        them) whose publication is lost: their numbers are never sent (ZMQ)
//   skip N               N sequence numbers skipped, nothing published (ZMQ)
//   clear                the engine clears its cache (AllBlocksCleared) and says so
//   resync               one message: a clear, then every held block stored again (the
//                        "periodic clear + full state" of docs/ingest.md; stream and NATS)
//   cut BYTES            the next message's frame, only its first BYTES bytes (stream); the
//                        test then kills the process: the frame is never completed
//   wait-sub MS          waits until a subscriber is there (ZMQ)
//   wait-peer MS         waits until a connection to the PUB socket has completed its ZMTP
//                        handshake since it was last bound (ZMQ). Unlike wait-sub, this needs
//                        nothing of the subscriber's application thread: libzmq's I/O threads
//                        shake hands, while a SUB sends its subscription again only once its
//                        owner touches the socket
//   bind                 binds the sockets of a publisher started with --unbound (ZMQ): what it
//                        published before reached nobody
//   rebind               unbinds the PUB socket and binds it again: every subscriber's
//                        connection drops and comes back, the engine unchanged (ZMQ)
//   mute-replay          stops answering replay requests (they are read and ignored)
//   state                "ok N h1 h2 ...": the engine's true state, the hashes it holds
//   quit                 exits (0)
//
// With --journal PATH every message is appended there ("<seq> <message>", fault_model.h's
// text) before it is sent, write(2) by write(2), so that the file survives a SIGKILL.
#include <arpa/inet.h>
#include <fcntl.h>
#include <kvrouter.h>
#include <nats/nats.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#include <zmq.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <msgpack.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fault_model.h"

namespace {

using kvr_fault::Cache;
using kvr_fault::Event;
using kvr_fault::Message;
using Bytes = std::vector<uint8_t>;

struct Options {
  std::string mode;
  std::string endpoint;  // zmq: the PUB endpoint; stream: the listener; nats: the server url
  std::string replay;    // zmq: the replay ROUTER endpoint ("" = none)
  std::string subject;   // nats
  std::string format = "native";  // nats: native or dynamo
  std::string journal;
  size_t buffer = 10000;  // zmq: replay buffer, in messages
  uint64_t worker = 1;
  uint32_t rank = 0;
  uint64_t generation = 1;
  uint64_t seed = 1;
  bool unbound = false;
};

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "fault_publisher: %s\n", why.c_str());
  std::exit(2);
}

void Reply(const std::string& line) {
  std::string out = line + "\n";
  const char* p = out.data();
  size_t left = out.size();
  while (left > 0) {
    const ssize_t n = write(1, p, left);
    if (n <= 0) std::exit(3);  // the test is gone
    p += n;
    left -= static_cast<size_t>(n);
  }
}

double NowSeconds() {
  timeval tv{};
  gettimeofday(&tv, nullptr);
  return static_cast<double>(tv.tv_sec) + static_cast<double>(tv.tv_usec) / 1e6;
}

// ---- Encodings -------------------------------------------------------------------------------

// vLLM's msgpack EventBatch: [ts, [events], dp_rank], events as positional arrays.
Bytes VllmPayload(const Message& message, uint32_t rank) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_array(3);
  pk.pack_double(NowSeconds());
  pk.pack_array(static_cast<uint32_t>(message.size()));
  for (const Event& e : message) {
    switch (e.kind) {
      case Event::Kind::kStored: {
        // BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)
        pk.pack_array(7);
        pk.pack(std::string("BlockStored"));
        pk.pack(e.hashes);
        if (e.parent == 0) {
          pk.pack_nil();
        } else {
          pk.pack(e.parent);
        }
        std::vector<uint32_t> tokens;
        for (uint64_t h : e.hashes) {
          const auto t = kvr_fault::BlockTokens(h);
          tokens.insert(tokens.end(), t.begin(), t.end());
        }
        pk.pack(tokens);
        pk.pack(kvr_fault::kBlockSize);
        pk.pack_nil();
        pk.pack(std::string("GPU"));
        break;
      }
      case Event::Kind::kRemoved:
        pk.pack_array(3);
        pk.pack(std::string("BlockRemoved"));
        pk.pack(e.hashes);
        pk.pack(std::string("GPU"));
        break;
      case Event::Kind::kCleared:
        pk.pack_array(1);
        pk.pack(std::string("AllBlocksCleared"));
        break;
    }
  }
  pk.pack(rank);
  return Bytes(buffer.data(), buffer.data() + buffer.size());
}

// A native EventBatch, through the C ABI's encoder (as a custom engine would).
Bytes NativePayload(const Message& message, uint64_t worker, uint32_t rank, uint64_t& event_id) {
  kvr_event_batch* batch = nullptr;
  if (kvr_event_batch_new(&batch, nullptr) != KVR_OK) Die("kvr_event_batch_new");
  for (const Event& e : message) {
    kvr_status s = KVR_OK;
    switch (e.kind) {
      case Event::Kind::kStored: {
        std::vector<uint32_t> tokens;
        for (uint64_t h : e.hashes) {
          const auto t = kvr_fault::BlockTokens(h);
          tokens.insert(tokens.end(), t.begin(), t.end());
        }
        kvr_stored_event ev;
        kvr_stored_event_init(&ev, sizeof ev);
        ev.worker_id = worker;
        ev.dp_rank = rank;
        ev.event_id = event_id++;
        ev.tier = KVR_TIER_DEVICE;
        if (e.parent != 0) {
          ev.flags = KVR_STORED_HAS_PARENT;
          ev.parent_hash = e.parent;
        }
        ev.block_hashes = e.hashes.data();
        ev.num_blocks = e.hashes.size();
        ev.token_ids = tokens.data();
        ev.num_tokens = tokens.size();
        s = kvr_event_batch_add_stored(batch, &ev, nullptr);
        break;
      }
      case Event::Kind::kRemoved: {
        kvr_removed_event ev;
        kvr_removed_event_init(&ev, sizeof ev);
        ev.worker_id = worker;
        ev.dp_rank = rank;
        ev.event_id = event_id++;
        ev.tier = KVR_TIER_DEVICE;
        ev.block_hashes = e.hashes.data();
        ev.num_blocks = e.hashes.size();
        s = kvr_event_batch_add_removed(batch, &ev, nullptr);
        break;
      }
      case Event::Kind::kCleared:
        s = kvr_event_batch_add_cleared(batch, worker, rank, event_id++, nullptr);
        break;
    }
    if (s != KVR_OK) Die("kvr_event_batch_add_*");
  }
  kvr_buffer* encoded = nullptr;
  if (kvr_event_batch_encode(batch, &encoded, nullptr) != KVR_OK) Die("kvr_event_batch_encode");
  Bytes out(kvr_buffer_data(encoded), kvr_buffer_data(encoded) + kvr_buffer_size(encoded));
  kvr_buffer_free(encoded);
  kvr_event_batch_free(batch);
  return out;
}

// A message of Dynamo's KV event plane (docs/ingest.md): {publisher_id, sequence, published_at,
// topic, payload}, the payload the msgpack bytes of RouterEvents. Stored blocks carry Dynamo's
// local hash (kvrouter's, kvr_compute_block_hashes) and no tokens.
Bytes DynamoMessage(const Message& message, uint64_t publisher_id, uint64_t sequence,
                    uint64_t worker, uint32_t rank, uint64_t& event_id) {
  msgpack::sbuffer inner;
  msgpack::packer<msgpack::sbuffer> pk(inner);
  pk.pack_array(static_cast<uint32_t>(message.size()));
  for (const Event& e : message) {
    pk.pack_map(4);
    pk.pack(std::string("worker_id"));
    pk.pack(worker);
    pk.pack(std::string("storage_tier"));
    pk.pack(std::string("device"));
    pk.pack(std::string("residency_domain"));
    pk.pack(std::string("worker"));
    pk.pack(std::string("event"));
    pk.pack_map(3);
    pk.pack(std::string("event_id"));
    pk.pack(event_id++);
    pk.pack(std::string("data"));
    switch (e.kind) {
      case Event::Kind::kStored: {
        pk.pack_map(1);
        pk.pack(std::string("stored"));
        pk.pack_map(3);
        pk.pack(std::string("parent_hash"));
        if (e.parent == 0) {
          pk.pack_nil();
        } else {
          pk.pack(e.parent);
        }
        pk.pack(std::string("start_position"));
        pk.pack_nil();
        pk.pack(std::string("blocks"));
        pk.pack_array(static_cast<uint32_t>(e.hashes.size()));
        for (uint64_t h : e.hashes) {
          const auto tokens = kvr_fault::BlockTokens(h);
          uint64_t local = 0;
          size_t len = 0;
          if (kvr_compute_block_hashes(tokens.data(), tokens.size(), kvr_fault::kBlockSize, nullptr,
                                       &local, 1, &len, nullptr) != KVR_OK) {
            Die("kvr_compute_block_hashes");
          }
          pk.pack_map(3);
          pk.pack(std::string("block_hash"));
          pk.pack(h);
          pk.pack(std::string("tokens_hash"));
          pk.pack(local);
          pk.pack(std::string("mm_extra_info"));
          pk.pack_nil();
        }
        break;
      }
      case Event::Kind::kRemoved:
        pk.pack_map(1);
        pk.pack(std::string("removed"));
        pk.pack_map(1);
        pk.pack(std::string("block_hashes"));
        pk.pack(e.hashes);
        break;
      case Event::Kind::kCleared:
        pk.pack(std::string("cleared"));
        break;
    }
    pk.pack(std::string("dp_rank"));
    pk.pack(rank);
  }
  msgpack::sbuffer outer;
  msgpack::packer<msgpack::sbuffer> po(outer);
  po.pack_map(5);
  po.pack(std::string("publisher_id"));
  po.pack(publisher_id);
  po.pack(std::string("sequence"));
  po.pack(sequence);
  po.pack(std::string("published_at"));
  po.pack(static_cast<uint64_t>(NowSeconds() * 1000));
  po.pack(std::string("topic"));
  po.pack(std::string("kv-events"));
  po.pack(std::string("payload"));
  po.pack_bin(static_cast<uint32_t>(inner.size()));
  po.pack_bin_body(inner.data(), static_cast<uint32_t>(inner.size()));
  return Bytes(outer.data(), outer.data() + outer.size());
}

void Sequence8(uint64_t seq, uint8_t out[8]) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(seq >> (56 - 8 * i));
}

// ---- The engine ------------------------------------------------------------------------------

class Publisher {
 public:
  explicit Publisher(const Options& o) : o_(o), rng_(o.seed) {
    if (!o_.journal.empty()) {
      journal_ = open(o_.journal.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
      if (journal_ < 0) Die("cannot open the journal " + o_.journal);
    }
    if (o_.mode == "zmq") {
      OpenZmq();
    } else if (o_.mode == "stream") {
      OpenStream();
    } else if (o_.mode == "nats" || o_.mode == "jetstream") {
      OpenNats();
    } else {
      Die("unknown --mode " + o_.mode);
    }
  }

  ~Publisher() {
    if (handshakes_monitor_ != nullptr) {
      zmq_socket_monitor(pub_, nullptr, 0);
      zmq_close(handshakes_monitor_);
    }
    if (pub_ != nullptr) zmq_close(pub_);
    if (replay_ != nullptr) zmq_close(replay_);
    if (context_ != nullptr) zmq_ctx_term(context_);
    if (js_ != nullptr) jsCtx_Destroy(js_);
    if (nats_ != nullptr) {
      natsConnection_FlushTimeout(nats_, 2000);
      natsConnection_Destroy(nats_);
    }
    if (stream_ >= 0) close(stream_);
    if (journal_ >= 0) close(journal_);
  }

  // Runs the commands until "quit" or the end of stdin.
  void Run() {
    std::string pending;
    for (;;) {
      size_t nl;
      while ((nl = pending.find('\n')) != std::string::npos) {
        const std::string line = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        if (line == "quit") {
          Reply("ok");
          return;
        }
        Reply(Command(line));
      }
      if (!WaitForStdin(-1)) return;
      char buf[4096];
      const ssize_t n = read(0, buf, sizeof buf);
      if (n <= 0) return;
      pending.append(buf, static_cast<size_t>(n));
    }
  }

 private:
  std::string Command(const std::string& line) {
    std::istringstream in(line);
    std::string verb;
    in >> verb;
    uint64_t n = 0, pace_us = 0;
    if (verb == "publish") {
      in >> n >> pace_us;
      uint64_t unheard = 0, errors = 0;
      for (uint64_t i = 0; i < n; ++i) {
        const Message m = cache_.Next(rng_, o_.generation, counter_);
        cache_.Apply(m);
        const int outcome = Publish(m);
        if (outcome < 0) ++errors;
        if (outcome == 0) ++unheard;
        if (pace_us > 0) Serve(std::chrono::microseconds(pace_us));
      }
      return "ok sent=" + std::to_string(n) + " unheard=" + std::to_string(unheard) +
             " errors=" + std::to_string(errors) + " retries=" + std::to_string(retries_);
    }
    if (verb == "drop") {
      in >> n;
      for (uint64_t i = 0; i < n; ++i) {
        const Message m = cache_.Next(rng_, o_.generation, counter_);
        cache_.Apply(m);
        const uint64_t seq = seq_++;
        Journal(seq, m);
        Remember(seq, VllmPayload(m, o_.rank));
      }
      return "ok";
    }
    if (verb == "skip") {
      in >> n;
      seq_ += n;
      return "ok";
    }
    if (verb == "clear") {
      const Message m{Event{Event::Kind::kCleared, 0, {}}};
      cache_.Apply(m);
      Publish(m);
      return "ok";
    }
    if (verb == "resync") {
      Message m{Event{Event::Kind::kCleared, 0, {}}};
      const Message stores = cache_.AsStores();
      m.insert(m.end(), stores.begin(), stores.end());
      Publish(m);
      return "ok";
    }
    if (verb == "cut") {
      in >> n;
      if (stream_ < 0) return "err cut needs --mode stream";
      const Message m = cache_.Next(rng_, o_.generation, counter_);  // never completed
      Bytes frame = Frame(NativePayload(m, o_.worker, o_.rank, event_id_));
      frame.resize(std::min<size_t>(n, frame.size() - 1));
      return WriteAll(frame) ? "ok" : "err write";
    }
    if (verb == "wait-sub") {
      in >> n;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(n);
      while (subscribers_ == 0 && std::chrono::steady_clock::now() < deadline) {
        Serve(std::chrono::milliseconds(5));
      }
      return subscribers_ > 0 ? "ok" : "err no subscriber";
    }
    if (verb == "wait-peer") {
      in >> n;
      if (handshakes_monitor_ == nullptr) return "err wait-peer needs a bound --mode zmq publisher";
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(n);
      while (handshakes_ == 0 && std::chrono::steady_clock::now() < deadline) {
        Serve(std::chrono::microseconds(0));
        CountHandshakes(5);
      }
      return handshakes_ > 0 ? "ok" : "err no handshake";
    }
    if (verb == "bind") {
      BindZmq();
      return "ok";
    }
    if (verb == "rebind") {
      if (pub_ == nullptr || !bound_) return "err rebind needs a bound --mode zmq publisher";
      // The same engine, its subscribers' connections dropped: unbinding a TCP endpoint closes
      // the connections it accepted; they connect again once it is bound again.
      zmq_unbind(pub_, o_.endpoint.c_str());
      subscribers_ = 0;
      CountHandshakes(0);  // the old connections', forgotten
      handshakes_ = 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      BindPub();
      return "ok";
    }
    if (verb == "mute-replay") {
      mute_replay_ = true;
      return "ok";
    }
    if (verb == "state") {
      std::string out = "ok " + std::to_string(cache_.size());
      for (uint64_t h : cache_.Hashes()) out += " " + std::to_string(h);
      return out;
    }
    return "err unknown command '" + line + "'";
  }

  // Publishes a message on the transport, journalled first: 1 sent, 0 sent to nobody (ZMQ:
  // no subscriber yet), -1 refused.
  int Publish(const Message& m) {
    if (o_.mode == "zmq") {
      const uint64_t seq = seq_++;
      Journal(seq, m);
      const Bytes payload = VllmPayload(m, o_.rank);
      Remember(seq, payload);
      Serve(std::chrono::microseconds(0));  // take subscriptions in first
      uint8_t s[8];
      Sequence8(seq, s);
      const std::string topic = "kv-events";
      zmq_send(pub_, topic.data(), topic.size(), ZMQ_SNDMORE);
      zmq_send(pub_, s, 8, ZMQ_SNDMORE);
      if (zmq_send(pub_, payload.data(), payload.size(), 0) < 0) return -1;
      return subscribers_ > 0 ? 1 : 0;
    }
    if (o_.mode == "stream") {
      Journal(seq_++, m);
      return WriteAll(Frame(NativePayload(m, o_.worker, o_.rank, event_id_))) ? 1 : -1;
    }
    const uint64_t seq = seq_++;
    Journal(seq, m);
    if (o_.mode == "jetstream")
      return PublishStored(seq, NativePayload(m, o_.worker, o_.rank, event_id_));
    const Bytes data = o_.format == "dynamo"
                           ? DynamoMessage(m, publisher_id_, seq, o_.worker, o_.rank, event_id_)
                           : NativePayload(m, o_.worker, o_.rank, event_id_);
    const natsStatus s = natsConnection_Publish(nats_, o_.subject.c_str(), data.data(),
                                                static_cast<int>(data.size()));
    return s == NATS_OK ? 1 : -1;
  }

  void Journal(uint64_t seq, const Message& m) {
    if (journal_ < 0) return;
    const std::string line = std::to_string(seq) + " " + kvr_fault::Encode(m) + "\n";
    if (write(journal_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      Die("journal write");
    }
  }

  void Remember(uint64_t seq, Bytes payload) {
    history_.emplace_back(seq, std::move(payload));
    while (history_.size() > o_.buffer) history_.pop_front();
  }

  // ---- ZMQ -------------------------------------------------------------------------------

  void OpenZmq() {
    context_ = zmq_ctx_new();
    pub_ = zmq_socket(context_, ZMQ_XPUB);
    const int linger = 1000, verbose = 1, hwm = 0;
    zmq_setsockopt(pub_, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(pub_, ZMQ_XPUB_VERBOSE, &verbose, sizeof verbose);
    zmq_setsockopt(pub_, ZMQ_SNDHWM, &hwm, sizeof hwm);
    if (!o_.replay.empty()) {
      replay_ = zmq_socket(context_, ZMQ_ROUTER);
      zmq_setsockopt(replay_, ZMQ_LINGER, &linger, sizeof linger);
      zmq_setsockopt(replay_, ZMQ_SNDHWM, &hwm, sizeof hwm);
    }
    if (!o_.unbound) BindZmq();
  }

  // The port a killed predecessor held may take a moment to be free again.
  void BindPub() {
    WatchHandshakes();
    for (int attempt = 0; zmq_bind(pub_, o_.endpoint.c_str()) != 0; ++attempt) {
      if (attempt == 200) Die("cannot bind " + o_.endpoint + ": " + zmq_strerror(zmq_errno()));
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
  }

  void BindZmq() {
    if (bound_) return;
    BindPub();
    for (int attempt = 0; replay_ != nullptr && zmq_bind(replay_, o_.replay.c_str()) != 0;
         ++attempt) {
      if (attempt == 200) Die("cannot bind " + o_.replay + ": " + zmq_strerror(zmq_errno()));
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    bound_ = true;
  }

  // Watches the PUB socket's completed handshakes ("wait-peer") over a PAIR socket, from before
  // it is first bound: libzmq reports events only to a monitor already there.
  void WatchHandshakes() {
    if (handshakes_monitor_ != nullptr) return;
    const char* address = "inproc://fault-publisher-handshakes";
    if (zmq_socket_monitor(pub_, address, ZMQ_EVENT_HANDSHAKE_SUCCEEDED) != 0) {
      Die(std::string("zmq_socket_monitor: ") + zmq_strerror(zmq_errno()));
    }
    handshakes_monitor_ = zmq_socket(context_, ZMQ_PAIR);
    const int linger = 0;
    zmq_setsockopt(handshakes_monitor_, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(handshakes_monitor_, address) != 0) {
      Die(std::string("cannot connect to the PUB socket's monitor: ") + zmq_strerror(zmq_errno()));
    }
  }

  // Counts the handshakes reported, waiting up to `timeout_ms` for the first.
  void CountHandshakes(long timeout_ms) {
    zmq_pollitem_t item{handshakes_monitor_, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, timeout_ms) <= 0) return;
    for (;;) {
      // [event id (2 bytes) + value (4 bytes), endpoint]
      uint8_t event[6];
      const int n = zmq_recv(handshakes_monitor_, event, sizeof event, ZMQ_DONTWAIT);
      if (n < 0) return;
      char endpoint[256];  // the second frame, unused
      zmq_recv(handshakes_monitor_, endpoint, sizeof endpoint, 0);
      uint16_t id = 0;
      if (n >= static_cast<int>(sizeof id)) std::memcpy(&id, event, sizeof id);
      if (id == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) ++handshakes_;
    }
  }

  // Serves subscriptions and replay requests for `d` (at least one look).
  void Serve(std::chrono::microseconds d) {
    const auto deadline = std::chrono::steady_clock::now() + d;
    if (pub_ == nullptr) {  // nothing to serve
      std::this_thread::sleep_until(deadline);
      return;
    }
    do {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      zmq_pollitem_t items[2] = {{pub_, 0, ZMQ_POLLIN, 0}, {replay_, 0, ZMQ_POLLIN, 0}};
      const int count = replay_ != nullptr ? 2 : 1;
      const long timeout = left.count() > 0 ? static_cast<long>(left.count()) : 0;
      if (zmq_poll(items, count, timeout) <= 0) continue;
      if (items[0].revents & ZMQ_POLLIN) ReadSubscriptions();
      if (count == 2 && (items[1].revents & ZMQ_POLLIN)) AnswerReplay();
    } while (std::chrono::steady_clock::now() < deadline);
  }

  void ReadSubscriptions() {
    char buf[256];
    int n;
    while ((n = zmq_recv(pub_, buf, sizeof buf, ZMQ_DONTWAIT)) > 0) {
      if (buf[0] == 1) ++subscribers_;
      if (buf[0] == 0 && subscribers_ > 0) --subscribers_;
    }
  }

  // vLLM's replay: [client, "", start] answered with [client, "", seq, payload] for every
  // buffered message from `start` on, then [client, "", -1, ""].
  void AnswerReplay() {
    for (;;) {
      std::vector<Bytes> parts;
      int more = 1;
      while (more) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, replay_, ZMQ_DONTWAIT) < 0) {
          zmq_msg_close(&msg);
          return;
        }
        const auto* d = static_cast<const uint8_t*>(zmq_msg_data(&msg));
        parts.emplace_back(d, d + zmq_msg_size(&msg));
        more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
      }
      if (mute_replay_ || parts.size() != 3 || parts[2].size() != 8) continue;
      uint64_t start = 0;
      for (uint8_t c : parts[2]) start = (start << 8) | c;
      const Bytes& client = parts[0];
      auto send = [&](uint64_t seq, const Bytes& payload) {
        uint8_t s[8];
        Sequence8(seq, s);
        zmq_send(replay_, client.data(), client.size(), ZMQ_SNDMORE);
        zmq_send(replay_, "", 0, ZMQ_SNDMORE);
        zmq_send(replay_, s, 8, ZMQ_SNDMORE);
        zmq_send(replay_, payload.data(), payload.size(), 0);
      };
      for (const auto& [seq, payload] : history_) {
        if (seq >= start) send(seq, payload);
      }
      send(UINT64_MAX, {});
    }
  }

  // ---- Native stream ---------------------------------------------------------------------

  void OpenStream() {
    // tcp://127.0.0.1:PORT
    const size_t colon = o_.endpoint.rfind(':');
    if (o_.endpoint.rfind("tcp://", 0) != 0 || colon == std::string::npos) {
      Die("--endpoint must be tcp://HOST:PORT");
    }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(o_.endpoint.substr(colon + 1))));
    inet_pton(AF_INET, o_.endpoint.substr(6, colon - 6).c_str(), &addr.sin_addr);
    stream_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(stream_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      Die("cannot connect to " + o_.endpoint);
    }
  }

  static Bytes Frame(const Bytes& payload) {
    Bytes frame(4);
    const uint32_t n = static_cast<uint32_t>(payload.size());
    for (int i = 0; i < 4; ++i) frame[i] = static_cast<uint8_t>(n >> (8 * i));
    frame.insert(frame.end(), payload.begin(), payload.end());
    return frame;
  }

  bool WriteAll(const Bytes& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = send(stream_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

  // ---- NATS ------------------------------------------------------------------------------

  void OpenNats() {
    publisher_id_ = kvr_fault::Mix(o_.seed ^ (o_.generation << 32));
    natsOptions* opts = nullptr;
    natsOptions_Create(&opts);
    natsOptions_SetURL(opts, o_.endpoint.c_str());
    natsOptions_SetAllowReconnect(opts, true);
    natsOptions_SetMaxReconnect(opts, -1);
    natsOptions_SetReconnectWait(opts, 100);
    natsStatus s = NATS_ERR;
    for (int attempt = 0; attempt < 100 && s != NATS_OK; ++attempt) {
      s = natsConnection_Connect(&nats_, opts);
      if (s != NATS_OK) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    natsOptions_Destroy(opts);
    if (s != NATS_OK) Die("cannot connect to " + o_.endpoint);
    if (o_.mode == "jetstream" && natsConnection_JetStream(&js_, nats_, nullptr) != NATS_OK) {
      Die("natsConnection_JetStream");
    }
  }

  // JetStream: publishes until the server says it stored the message (1), or gives up after a
  // minute (-1). Every attempt carries the same message id: a retry of a message the server
  // stored but whose acknowledgement was lost is dropped as a duplicate.
  int PublishStored(uint64_t seq, const Bytes& data) {
    const std::string id = "w" + std::to_string(o_.worker) + "-r" + std::to_string(o_.rank) + "-g" +
                           std::to_string(o_.generation) + "-" + std::to_string(seq);
    jsPubOptions options;
    jsPubOptions_Init(&options);
    options.MsgId = id.c_str();
    options.MaxWait = 1000;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(1);
    while (std::chrono::steady_clock::now() < give_up) {
      jsPubAck* ack = nullptr;
      const natsStatus s = js_Publish(&ack, js_, o_.subject.c_str(), data.data(),
                                      static_cast<int>(data.size()), &options, nullptr);
      jsPubAck_Destroy(ack);
      if (s == NATS_OK) return 1;
      ++retries_;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return -1;
  }

  // Whether stdin has a line to read within `timeout_ms` (-1 = forever), serving ZMQ meanwhile.
  bool WaitForStdin(int timeout_ms) {
    for (;;) {
      if (pub_ != nullptr) {
        zmq_pollitem_t items[3] = {
            {nullptr, 0, ZMQ_POLLIN, 0}, {pub_, 0, ZMQ_POLLIN, 0}, {replay_, 0, ZMQ_POLLIN, 0}};
        const int count = replay_ != nullptr ? 3 : 2;
        if (zmq_poll(items, count, timeout_ms) < 0) return false;
        if (items[1].revents & ZMQ_POLLIN) ReadSubscriptions();
        if (count == 3 && (items[2].revents & ZMQ_POLLIN)) AnswerReplay();
        if (items[0].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) return true;
      } else {
        pollfd p{0, POLLIN, 0};
        if (poll(&p, 1, timeout_ms) < 0) return false;
        if (p.revents != 0) return true;
      }
    }
  }

  Options o_;
  std::mt19937_64 rng_;
  Cache cache_;
  uint64_t counter_ = 0;
  uint64_t seq_ = 0;
  uint64_t event_id_ = 1;
  int journal_ = -1;
  // ZMQ
  void* context_ = nullptr;
  void* pub_ = nullptr;
  void* replay_ = nullptr;
  bool bound_ = false;
  bool mute_replay_ = false;
  int subscribers_ = 0;
  void* handshakes_monitor_ = nullptr;  // the PUB socket's completed handshakes
  int handshakes_ = 0;                  // counted so far, since the PUB socket was last bound
  std::deque<std::pair<uint64_t, Bytes>> history_;
  // stream
  int stream_ = -1;
  // NATS
  natsConnection* nats_ = nullptr;
  uint64_t publisher_id_ = 0;
  // JetStream
  jsCtx* js_ = nullptr;
  uint64_t retries_ = 0;  // publications repeated because the server did not acknowledge
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--mode") {
      o.mode = value();
    } else if (a == "--endpoint") {
      o.endpoint = value();
    } else if (a == "--replay") {
      o.replay = value();
    } else if (a == "--subject") {
      o.subject = value();
    } else if (a == "--format") {
      o.format = value();
    } else if (a == "--journal") {
      o.journal = value();
    } else if (a == "--buffer") {
      o.buffer = std::stoul(value());
    } else if (a == "--worker") {
      o.worker = std::stoull(value());
    } else if (a == "--rank") {
      o.rank = static_cast<uint32_t>(std::stoul(value()));
    } else if (a == "--generation") {
      o.generation = std::stoull(value());
    } else if (a == "--seed") {
      o.seed = std::stoull(value());
    } else if (a == "--unbound") {
      o.unbound = true;
    } else {
      Die("unknown argument " + a);
    }
  }
  {
    Publisher publisher(o);
    publisher.Run();
  }
  if (o.mode == "nats" || o.mode == "jetstream") nats_Close();
  return 0;
}

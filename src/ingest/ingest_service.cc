#include "ingest/ingest_service.h"

#include <nats/adapters/libuv.h>
#include <nats/nats.h>
#include <uv.h>
#include <zmq.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <list>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/clock.h"
#include "ingest/block_copies.h"
#include "wire/endpoint.h"
#include "wire/engine_events.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {
namespace {

void Bump(std::atomic<uint64_t>& c, uint64_t n = 1) { c.fetch_add(n, std::memory_order_relaxed); }

// An engine's batch timestamp (vLLM: time.time(), float seconds since the Unix epoch) in
// nanoseconds; 0, meaning unknown, for one that is missing, negative, NaN or past year 2500.
uint64_t UnixNanosFromSeconds(double seconds) {
  constexpr double kYear2500 = 16725225600.0;
  if (!(seconds > 0 && seconds < kYear2500)) return 0;
  return static_cast<uint64_t>(seconds * 1e9);
}

// Live counters of one source; IngestStats is their copy.
struct SourceCounters {
  std::atomic<uint64_t> messages{0};
  std::atomic<uint64_t> events_applied{0};
  std::atomic<uint64_t> rejected[kNumIngestRejects] = {};
  std::atomic<uint64_t> gaps{0};
  std::atomic<uint64_t> missed_messages{0};
  std::atomic<uint64_t> restarts{0};
  std::atomic<uint64_t> recoveries{0};
  std::atomic<uint64_t> connections{0};
  std::atomic<int64_t> state_unknown{0};
  std::atomic<uint64_t> lag_samples{0};
  std::atomic<uint64_t> lag_total_us{0};
  std::atomic<uint64_t> lag_max_us{0};
  std::atomic<uint64_t> lag_last_us{0};
  std::atomic<uint64_t> published{0};
  std::atomic<uint64_t> publish_failures{0};

  // A message published at `publish_time_ns` (Unix epoch; 0 = unknown) has just been applied.
  // A publisher whose clock runs ahead of ours shows a lag of 0, not a negative one.
  void RecordLag(uint64_t publish_time_ns) {
    if (publish_time_ns == 0) return;
    const uint64_t now = UnixNowNanos();
    const uint64_t lag_us = now > publish_time_ns ? (now - publish_time_ns) / 1000 : 0;
    Bump(lag_samples);
    Bump(lag_total_us, lag_us);
    lag_last_us.store(lag_us, std::memory_order_relaxed);
    uint64_t max = lag_max_us.load(std::memory_order_relaxed);
    while (lag_us > max && !lag_max_us.compare_exchange_weak(max, lag_us)) {
    }
  }

  void Reject(IngestReject reason, uint64_t n = 1) {
    rejected[static_cast<int>(reason)].fetch_add(n, std::memory_order_relaxed);
  }
  void AddTo(IngestStats& s) const {
    s.messages += messages.load();
    s.events_applied += events_applied.load();
    for (int i = 0; i < kNumIngestRejects; ++i) s.rejected[i] += rejected[i].load();
    s.gaps += gaps.load();
    s.missed_messages += missed_messages.load();
    s.restarts += restarts.load();
    s.recoveries += recoveries.load();
    s.connections += connections.load();
    s.state_unknown += static_cast<uint64_t>(std::max<int64_t>(0, state_unknown.load()));
    s.lag_samples += lag_samples.load();
    s.lag_total_us += lag_total_us.load();
    s.lag_max_us = std::max(s.lag_max_us, lag_max_us.load());
    s.lag_last_us = std::max(s.lag_last_us, lag_last_us.load());
    s.published += published.load();
    s.publish_failures += publish_failures.load();
  }
};

// Closes a heap-allocated libuv handle and deletes its owner once libuv is done with it.
template <typename Owner>
void CloseAndDelete(uv_handle_t* handle, Owner* owner) {
  handle->data = owner;
  if (uv_is_closing(handle)) return;
  uv_close(handle, [](uv_handle_t* h) { delete static_cast<Owner*>(h->data); });
}

}  // namespace

struct IngestService::Impl {
  struct Listener;
  struct Connection;
  struct Subscription;
  struct NatsSource;

  Router* router;
  IngestOptions options;
  uv_loop_t loop{};
  uv_async_t wake{};
  void* zmq_context = nullptr;

  // Commands for the loop thread.
  std::mutex command_mutex;
  std::deque<std::function<void()>> commands;
  bool running = false;
  bool stopped = false;
  std::thread thread;

  // Source counters by id; the map only grows, so totals include removed sources.
  mutable std::mutex stats_mutex;
  std::map<uint64_t, std::shared_ptr<SourceCounters>> counters;
  std::map<uint64_t, std::string> endpoints;  // as Endpoint() reports them
  uint64_t next_source_id = 1;

  // Loop-thread state (or caller-thread state before Start).
  std::list<Listener*> listeners;
  std::list<Connection*> connections;
  std::map<uint64_t, std::vector<Subscription*>> engine_workers;  // by worker id
  std::list<NatsSource*> nats_sources;
  bool replica_sync_active = false;
  uint64_t next_event_id = 1;

  // A new source id for `endpoint` (what Endpoint(id) reports), with its counters.
  std::shared_ptr<SourceCounters> NewSource(uint64_t& id, std::string endpoint,
                                            std::shared_ptr<SourceCounters> live = nullptr) {
    std::lock_guard lock(stats_mutex);
    id = next_source_id++;
    endpoints[id] = std::move(endpoint);
    return counters[id] = live ? std::move(live) : std::make_shared<SourceCounters>();
  }

  // Runs `command` where loop state may be touched: inline before Start, on the loop after.
  absl::Status Run(std::function<absl::Status()> command) {
    std::unique_lock lock(command_mutex);
    if (stopped) return absl::FailedPreconditionError("the ingest service is stopped");
    // Before Start, or already on the loop thread (a router callback run by an event this loop
    // applied, e.g. a request admitted by a replica's free): waiting for the loop would hang.
    if (!running || std::this_thread::get_id() == thread.get_id()) {
      lock.unlock();
      return command();
    }
    auto done = std::make_shared<std::promise<absl::Status>>();
    auto result = done->get_future();
    commands.push_back([command = std::move(command), done] { done->set_value(command()); });
    uv_async_send(&wake);
    lock.unlock();
    return result.get();
  }

  void RunCommands() {
    std::deque<std::function<void()>> batch;
    {
      std::lock_guard lock(command_mutex);
      batch.swap(commands);
    }
    for (auto& command : batch) command();
  }

  // Applies router events, counting each outcome on `source`.
  void Apply(std::span<const KvEvent> events, SourceCounters& source) {
    for (const KvEvent& event : events) (void)ApplyOne(event, source);
  }

  absl::StatusOr<ApplyResult> ApplyOne(const KvEvent& event, SourceCounters& source) {
    auto result = router->ApplyEvent(event);
    if (result.ok() && result->ok()) {
      Bump(source.events_applied);
    } else {
      source.Reject(IngestReject::kIndexRejected);
    }
    return result;
  }

  void ClearWorker(uint64_t worker_id, uint32_t dp_rank, SourceCounters& source) {
    const KvEvent clear{
        .worker = {worker_id, dp_rank}, .event_id = next_event_id++, .data = ClearedEvent{}};
    (void)router->ApplyEvent(clear);
  }

  // ---- Native stream -------------------------------------------------------------------

  struct Listener {
    Impl* impl = nullptr;
    uint64_t source_id = 0;
    std::shared_ptr<SourceCounters> counters;
    bool unix_socket = false;
    union {
      uv_handle_t handle;
      uv_stream_t stream;
      uv_tcp_t tcp;
      uv_pipe_t pipe;
    };
  };

  struct Connection {
    Impl* impl;
    std::shared_ptr<SourceCounters> counters;
    FrameReader reader;
    std::vector<char> read_buffer = std::vector<char>(64 * 1024);
    union {
      uv_handle_t handle;
      uv_stream_t stream;
      uv_tcp_t tcp;
      uv_pipe_t pipe;
    };
    Connection(Impl* i, std::shared_ptr<SourceCounters> c, uint32_t max_frame)
        : impl(i), counters(std::move(c)), reader(max_frame) {}
  };

  absl::Status ListenOnLoop(const StreamEndpoint& where, std::string* bound, uint64_t& id) {
    auto* listener = new Listener;
    listener->impl = this;
    listener->unix_socket = where.unix_socket;
    int rc = 0;
    if (where.unix_socket) {
      uv_pipe_init(&loop, &listener->pipe, 0);
      rc = uv_pipe_bind(&listener->pipe, where.host_or_path.c_str());
    } else {
      uv_tcp_init(&loop, &listener->tcp);
      sockaddr_storage addr{};
      rc = uv_ip4_addr(where.host_or_path.c_str(), where.port,
                       reinterpret_cast<sockaddr_in*>(&addr));
      if (rc != 0) {
        rc = uv_ip6_addr(where.host_or_path.c_str(), where.port,
                         reinterpret_cast<sockaddr_in6*>(&addr));
      }
      if (rc == 0) rc = uv_tcp_bind(&listener->tcp, reinterpret_cast<sockaddr*>(&addr), 0);
    }
    listener->handle.data = listener;
    if (rc == 0) rc = uv_listen(&listener->stream, 128, &Impl::OnConnection);
    if (rc != 0) {
      CloseAndDelete(&listener->handle, listener);
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", where.host_or_path, ": ", uv_strerror(rc)));
    }
    if (where.unix_socket) {
      *bound = "unix://" + where.host_or_path;
    } else {
      sockaddr_storage name{};
      int len = sizeof(name);
      uv_tcp_getsockname(&listener->tcp, reinterpret_cast<sockaddr*>(&name), &len);
      char host[64] = {};
      int port = 0;
      bool ipv6 = name.ss_family == AF_INET6;
      if (ipv6) {
        auto* a6 = reinterpret_cast<sockaddr_in6*>(&name);
        uv_ip6_name(a6, host, sizeof(host));
        port = ntohs(a6->sin6_port);
      } else {
        auto* a4 = reinterpret_cast<sockaddr_in*>(&name);
        uv_ip4_name(a4, host, sizeof(host));
        port = ntohs(a4->sin_port);
      }
      // An IPv6 address is bracketed, so that its colons are not taken for the port's.
      *bound = ipv6 ? absl::StrCat("tcp://[", host, "]:", port)
                    : absl::StrCat("tcp://", host, ":", port);
    }
    listener->counters = NewSource(id, *bound);
    listener->source_id = id;
    listeners.push_back(listener);
    return absl::OkStatus();
  }

  static void OnConnection(uv_stream_t* server, int status) {
    auto* listener = static_cast<Listener*>(server->data);
    Impl* impl = listener->impl;
    if (status < 0) return;
    auto* conn = new Connection(impl, listener->counters, impl->options.max_frame_bytes);
    if (listener->unix_socket) {
      uv_pipe_init(&impl->loop, &conn->pipe, 0);
    } else {
      uv_tcp_init(&impl->loop, &conn->tcp);
    }
    conn->handle.data = conn;
    if (uv_accept(server, &conn->stream) != 0) {
      CloseAndDelete(&conn->handle, conn);
      return;
    }
    Bump(conn->counters->connections);
    impl->connections.push_back(conn);
    uv_read_start(
        &conn->stream,
        [](uv_handle_t* h, size_t, uv_buf_t* buf) {
          auto* c = static_cast<Connection*>(h->data);
          *buf = uv_buf_init(c->read_buffer.data(), c->read_buffer.size());
        },
        &Impl::OnRead);
  }

  void CloseConnection(Connection* conn) {
    connections.remove(conn);
    CloseAndDelete(&conn->handle, conn);
  }

  static void OnRead(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf) {
    auto* conn = static_cast<Connection*>(stream->data);
    if (nread < 0) {  // EOF or error
      conn->impl->CloseConnection(conn);
      return;
    }
    if (nread == 0) return;
    const absl::Status status = conn->reader.Append(
        std::span(reinterpret_cast<const uint8_t*>(buf->base), static_cast<size_t>(nread)));
    while (auto frame = conn->reader.Next()) conn->impl->HandleFrame(*frame, *conn->counters);
    if (!status.ok()) {
      // The frame boundaries are lost: nothing after this header can be trusted.
      conn->counters->Reject(IngestReject::kFrameTooLarge);
      conn->impl->CloseConnection(conn);
    }
  }

  // A replica's booking change, from the replica sync subject.
  void HandleReplicaMessage(const std::vector<uint8_t>& payload, SourceCounters& source) {
    absl::StatusOr<ReplicaChange> change = DecodeReplicaChange(payload);
    if (!change.ok()) {
      source.Reject(IngestReject::kBadFlatBuffers);
    } else if (router->ApplyReplicaChange(change->origin, change->View()).ok()) {
      Bump(source.events_applied);
    } else {
      source.Reject(IngestReject::kIndexRejected);  // an unknown worker, a duplicate booking
    }
    Bump(source.messages);
  }

  // Counted after it is handled, as engine messages are (see Process).
  void HandleFrame(const std::vector<uint8_t>& frame, SourceCounters& source) {
    ApplyFrame(frame, source);
    Bump(source.messages);
  }

  void ApplyFrame(const std::vector<uint8_t>& frame, SourceCounters& source) {
    uint64_t publish_time_ns = 0;
    auto events = DecodeEventBatch(frame, &publish_time_ns);
    if (!events.ok()) {
      source.Reject(IngestReject::kBadFlatBuffers);
      return;
    }
    Apply(*events, source);
    source.RecordLag(publish_time_ns);
  }

  // ---- Dynamo's event plane (NATS) --------------------------------------------------------

  // Dynamo event-plane publishers heard on one NATS subscription: each numbers its messages
  // from 0. Loop thread only.
  struct DynamoPublisher {
    uint64_t next_sequence = 0;
    uint64_t last_heard = 0;               // the subscription's message count then
    absl::flat_hash_set<WorkerKey> ranks;  // what a gap must clear
  };
  struct DynamoPublishers {
    absl::flat_hash_map<uint64_t, DynamoPublisher> by_id;
    uint64_t messages = 0;
  };
  // Publishers come and go with their workers: past this many, the longest silent is forgotten.
  static constexpr size_t kMaxDynamoPublishers = 4096;

  // A NATS message: a native EventBatch or a message of Dynamo's event plane, told apart by
  // content (a batch is verified first; a Dynamo message is a msgpack map, never a valid batch).
  // Neither: counted as a bad batch, or as bad msgpack when it is msgpack of the wrong shape.
  void HandleNatsEvents(const std::vector<uint8_t>& payload, SourceCounters& source,
                        DynamoPublishers& dynamo) {
    ApplyNatsEvents(payload, source, dynamo);
    Bump(source.messages);  // last: a reader that sees the count sees what it applied
  }

  void ApplyNatsEvents(const std::vector<uint8_t>& payload, SourceCounters& source,
                       DynamoPublishers& dynamo) {
    uint64_t publish_time_ns = 0;
    if (auto events = DecodeEventBatch(payload, &publish_time_ns); events.ok()) {
      Apply(*events, source);
      source.RecordLag(publish_time_ns);
      return;
    }
    auto message = DecodeDynamoEventPlane(payload);
    if (message.ok()) {
      ApplyDynamoMessage(*message, source, dynamo);
    } else {
      source.Reject(absl::IsDataLoss(message.status()) ? IngestReject::kBadFlatBuffers
                                                       : IngestReject::kBadMsgpack);
    }
  }

  void ApplyDynamoMessage(const DynamoMessage& message, SourceCounters& source,
                          DynamoPublishers& dynamo) {
    DynamoPublisher& publisher = PublisherOf(dynamo, message.publisher_id, message.sequence);
    if (message.sequence < publisher.next_sequence) {
      source.Reject(IngestReject::kStaleSequence);
      return;
    }
    if (message.sequence > publisher.next_sequence) {
      // Messages lost (the event plane has no replay): what the publisher's ranks hold is
      // unknown, so they are cleared and learnt again, as for an engine without replay.
      Bump(source.gaps);
      Bump(source.missed_messages, message.sequence - publisher.next_sequence);
      for (const WorkerKey& rank : publisher.ranks)
        ClearWorker(rank.worker_id, rank.dp_rank, source);
      Bump(source.recoveries);
    }
    publisher.next_sequence = message.sequence + 1;
    for (const KvEvent& event : message.events) publisher.ranks.insert(event.worker);
    Apply(message.events, source);
    source.RecordLag(message.published_at_ms * 1'000'000);
  }

  // The publisher's state. One first heard at `sequence` starts there: what it published
  // before this subscription existed is unknowable, not lost.
  static DynamoPublisher& PublisherOf(DynamoPublishers& dynamo, uint64_t id, uint64_t sequence) {
    ++dynamo.messages;
    auto [it, added] = dynamo.by_id.try_emplace(id);
    if (added) {
      it->second.next_sequence = sequence;
      if (dynamo.by_id.size() > kMaxDynamoPublishers) {
        ForgetLongestSilent(dynamo, id);
        it = dynamo.by_id.find(id);
      }
    }
    it->second.last_heard = dynamo.messages;
    return it->second;
  }

  static void ForgetLongestSilent(DynamoPublishers& dynamo, uint64_t keep) {
    auto oldest = dynamo.by_id.end();
    for (auto it = dynamo.by_id.begin(); it != dynamo.by_id.end(); ++it) {
      if (it->first != keep &&
          (oldest == dynamo.by_id.end() || it->second.last_heard < oldest->second.last_heard)) {
        oldest = it;
      }
    }
    dynamo.by_id.erase(oldest);
  }

  // ---- Engine workers over ZMQ -----------------------------------------------------------

  using Parts = std::vector<std::vector<uint8_t>>;
  struct Replay;

  struct Subscription {
    Impl* impl = nullptr;
    std::shared_ptr<SourceCounters> counters;
    EngineWorker worker;
    uint32_t socket_rank = 0;  // the rank this socket's publisher serves
    void* socket = nullptr;
    uv_poll_t poll{};
    std::optional<uint64_t> next_seq;
    bool state_unknown = false;
    Replay* replay = nullptr;  // a replay in progress
    std::deque<Parts> held;    // live messages received during the replay
    SaltedBlocks salted;       // the publisher's blocks stored under a cache salt
    BlockCopies copies;        // the publisher's blocks held more than once
  };

  // A request to vLLM's replay socket: a DEALER speaking to its ROUTER, with a deadline.
  struct Replay {
    Subscription* sub = nullptr;
    void* socket = nullptr;
    uv_poll_t poll{};
    uv_timer_t timer{};
    int open_handles = 2;
    uint64_t until = 0;  // the sequence of the live message that revealed the gap
  };

  absl::Status AddEngineWorkerOnLoop(const EngineWorker& worker, uint64_t& id) {
    if (engine_workers.contains(worker.worker_id)) {
      return absl::AlreadyExistsError(
          absl::StrCat("engine worker ", worker.worker_id, " is already subscribed"));
    }
    if (zmq_context == nullptr) zmq_context = zmq_ctx_new();
    std::vector<Subscription*> subs;
    std::shared_ptr<SourceCounters> source;
    for (uint32_t r = 0; r < worker.dp_size; ++r) {
      auto* sub = new Subscription;
      sub->impl = this;
      sub->worker = worker;
      sub->socket_rank = worker.dp_start + r;
      sub->socket = zmq_socket(zmq_context, ZMQ_SUB);
      const int linger = 0;
      zmq_setsockopt(sub->socket, ZMQ_LINGER, &linger, sizeof(linger));
      zmq_setsockopt(sub->socket, ZMQ_SUBSCRIBE, worker.topic.data(), worker.topic.size());
      const std::string endpoint = RankEndpoint(worker.endpoint, r);
      if (zmq_connect(sub->socket, endpoint.c_str()) != 0) {
        const std::string why = zmq_strerror(zmq_errno());
        zmq_close(sub->socket);
        delete sub;
        for (Subscription* s : subs) CloseSubscription(s);
        return absl::InvalidArgumentError(absl::StrCat("cannot connect to ", endpoint, ": ", why));
      }
      subs.push_back(sub);
    }
    source = NewSource(id, worker.endpoint);
    for (Subscription* sub : subs) {
      sub->counters = source;
      int fd = -1;
      size_t fd_size = sizeof(fd);
      zmq_getsockopt(sub->socket, ZMQ_FD, &fd, &fd_size);
      uv_poll_init(&loop, &sub->poll, fd);
      sub->poll.data = sub;
      uv_poll_start(&sub->poll, UV_READABLE, [](uv_poll_t* p, int, int) {
        auto* s = static_cast<Subscription*>(p->data);
        s->impl->Drain(*s);
      });
    }
    engine_workers[worker.worker_id] = std::move(subs);
    return absl::OkStatus();
  }

  void CloseSubscription(Subscription* sub) {
    if (sub->state_unknown) sub->counters->state_unknown.fetch_sub(1);
    if (sub->replay != nullptr) {
      CloseReplay(sub->replay);
      sub->replay = nullptr;
    }
    zmq_close(sub->socket);
    sub->socket = nullptr;
    if (sub->poll.loop == nullptr) {  // never polled
      delete sub;
      return;
    }
    uv_poll_stop(&sub->poll);
    CloseAndDelete(reinterpret_cast<uv_handle_t*>(&sub->poll), sub);
  }

  absl::Status RemoveEngineWorkerOnLoop(uint64_t worker_id, bool clear_index) {
    auto it = engine_workers.find(worker_id);
    if (it == engine_workers.end()) {
      return absl::NotFoundError(absl::StrCat("engine worker ", worker_id, " is not subscribed"));
    }
    for (Subscription* sub : it->second) {
      if (clear_index) ClearWorker(worker_id, sub->socket_rank, *sub->counters);
      CloseSubscription(sub);
    }
    engine_workers.erase(it);
    return absl::OkStatus();
  }

  // The ZMQ fd only signals edges: read every message queued before returning.
  void Drain(Subscription& sub) {
    for (;;) {
      int events = 0;
      size_t size = sizeof(events);
      if (zmq_getsockopt(sub.socket, ZMQ_EVENTS, &events, &size) != 0) return;
      if (!(events & ZMQ_POLLIN)) return;
      Parts parts;
      if (!ReceiveMultipart(sub.socket, parts)) return;
      Process(sub, std::move(parts));
    }
  }

  // Handles a live message, or holds it while a replay is in flight. A message is counted
  // once it has been handled (applied or rejected), not when it arrives, so that a reader who
  // sees N messages counted also sees their effects in the index.
  void Process(Subscription& sub, Parts parts) {
    if (sub.replay != nullptr) {
      sub.held.push_back(std::move(parts));
      return;
    }
    const size_t held_before = sub.held.size();
    HandleEngineMessage(sub, parts);
    if (sub.held.size() == held_before) Bump(sub.counters->messages);  // not held for a replay
  }

  static bool ReceiveMultipart(void* socket, std::vector<std::vector<uint8_t>>& parts) {
    for (;;) {
      zmq_msg_t msg;
      zmq_msg_init(&msg);
      if (zmq_msg_recv(&msg, socket, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&msg);
        return false;
      }
      const auto* data = static_cast<const uint8_t*>(zmq_msg_data(&msg));
      parts.emplace_back(data, data + zmq_msg_size(&msg));
      const bool more = zmq_msg_more(&msg);
      zmq_msg_close(&msg);
      if (!more) return true;
    }
  }

  void SetUnknown(Subscription& sub, bool unknown) {
    if (sub.state_unknown == unknown) return;
    sub.state_unknown = unknown;
    sub.counters->state_unknown.fetch_add(unknown ? 1 : -1);
  }

  enum class Verdict { kApply, kDrop, kHold };

  void ClearAndFlag(Subscription& sub) {
    ClearWorker(sub.worker.worker_id, sub.socket_rank, *sub.counters);
    sub.salted.Clear();
    sub.copies.Clear();
    Bump(sub.counters->recoveries);
    SetUnknown(sub, true);
  }

  // Checks the message's sequence number against the rank's expectation.
  Verdict TrackSequence(Subscription& sub, uint64_t seq) {
    SourceCounters& c = *sub.counters;
    if (!sub.next_seq || seq == *sub.next_seq) {
      sub.next_seq = seq + 1;
      return Verdict::kApply;
    }
    if (seq > *sub.next_seq) {
      Bump(c.gaps);
      Bump(c.missed_messages, seq - *sub.next_seq);
      if (StartReplay(sub, *sub.next_seq, seq)) return Verdict::kHold;
      // Lost events cannot be recovered: drop what the index believes rather than trust it.
      ClearAndFlag(sub);
      sub.next_seq = seq + 1;
      return Verdict::kApply;
    }
    if (seq == 0) {  // the publisher restarted, with an empty cache
      Bump(c.restarts);
      ClearWorker(sub.worker.worker_id, sub.socket_rank, c);
      sub.salted.Clear();
      sub.copies.Clear();
      Bump(c.recoveries);
      SetUnknown(sub, false);
      sub.next_seq = 1;
      return Verdict::kApply;
    }
    c.Reject(IngestReject::kStaleSequence);
    return Verdict::kDrop;
  }

  void HandleEngineMessage(Subscription& sub, const Parts& parts) {
    const std::optional<uint64_t> seq = parts.size() == 3 ? DecodeSequence(parts[1]) : std::nullopt;
    if (!seq) {
      sub.counters->Reject(IngestReject::kBadMessage);
      return;
    }
    switch (TrackSequence(sub, *seq)) {
      case Verdict::kDrop:
        return;
      case Verdict::kHold:
        sub.held.push_front(parts);
        return;
      case Verdict::kApply:
        ApplyPayload(sub, parts[2]);
        return;
    }
  }

  void ApplyPayload(Subscription& sub, const std::vector<uint8_t>& payload) {
    SourceCounters& c = *sub.counters;
    auto batch = DecodeEnginePayload(payload);
    if (!batch.ok()) {
      c.Reject(IngestReject::kBadMsgpack);
      return;
    }
    ConvertedBatch converted =
        ToKvEvents(*batch, sub.worker.worker_id, sub.socket_rank, router->block_size(),
                   sub.worker.eagle, next_event_id, &sub.salted);
    next_event_id += batch->events.size();
    c.Reject(IngestReject::kBlockSize, converted.block_size_mismatches.size());
    for (KvEvent& event : converted.events) {
      // An engine-side clear makes its state known again.
      if (std::holds_alternative<ClearedEvent>(event.data)) SetUnknown(sub, false);
      ApplyEngineEvent(sub.copies, event, c);
    }
    c.RecordLag(UnixNanosFromSeconds(batch->timestamp));
  }

  // Applies one engine event, keeping `copies` in step (event by event: a batch may store a
  // block and then its copy). A removal takes extra copies first, and those blocks stay
  // indexed; the blocks a store repeats (the index reports them) are copies.
  void ApplyEngineEvent(BlockCopies& copies, KvEvent& event, SourceCounters& c) {
    if (auto* removed = std::get_if<RemovedEvent>(&event.data)) {
      std::erase_if(removed->block_hashes,
                    [&](uint64_t h) { return copies.TakeExtra(event.worker, event.tier, h); });
      if (removed->block_hashes.empty()) {  // applied: each block it named had another copy
        Bump(c.events_applied);
        return;
      }
    } else if (std::holds_alternative<ClearedEvent>(event.data)) {
      copies.ForgetRank(event.worker);
    }
    const auto result = ApplyOne(event, c);
    if (!result.ok()) return;
    for (uint64_t h : result->repeated) copies.Add(event.worker, event.tier, h);
  }

  // ---- Replay (vLLM's replay ROUTER socket) ---------------------------------------------

  // Asks for messages [from, until). False if the worker has no replay endpoint or the
  // request cannot be sent.
  bool StartReplay(Subscription& sub, uint64_t from, uint64_t until) {
    if (sub.worker.replay_endpoint.empty()) return false;
    auto* replay = new Replay;
    replay->sub = &sub;
    replay->until = until;
    replay->socket = zmq_socket(zmq_context, ZMQ_DEALER);
    const int linger = 0;
    zmq_setsockopt(replay->socket, ZMQ_LINGER, &linger, sizeof(linger));
    const std::string endpoint =
        RankEndpoint(sub.worker.replay_endpoint, sub.socket_rank - sub.worker.dp_start);
    uint8_t start[8];
    for (int i = 0; i < 8; ++i) start[i] = static_cast<uint8_t>(from >> (56 - 8 * i));
    // The empty delimiter makes the DEALER look like the REQ client vLLM expects.
    if (zmq_connect(replay->socket, endpoint.c_str()) != 0 ||
        zmq_send(replay->socket, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) != 0 ||
        zmq_send(replay->socket, start, 8, ZMQ_DONTWAIT) != 8) {
      zmq_close(replay->socket);
      delete replay;
      return false;
    }
    int fd = -1;
    size_t fd_size = sizeof(fd);
    zmq_getsockopt(replay->socket, ZMQ_FD, &fd, &fd_size);
    uv_poll_init(&loop, &replay->poll, fd);
    replay->poll.data = replay;
    uv_timer_init(&loop, &replay->timer);
    replay->timer.data = replay;
    sub.replay = replay;
    uv_poll_start(&replay->poll, UV_READABLE, [](uv_poll_t* p, int, int) {
      auto* r = static_cast<Replay*>(p->data);
      r->sub->impl->DrainReplay(*r->sub);
    });
    uv_timer_start(
        &replay->timer,
        [](uv_timer_t* t) {
          auto* r = static_cast<Replay*>(t->data);
          r->sub->impl->FinishReplay(*r->sub);
        },
        options.replay_timeout_ms, 0);
    DrainReplay(sub);  // the fd signals edges: look once now
    return true;
  }

  void DrainReplay(Subscription& sub) {
    while (sub.replay != nullptr) {
      int events = 0;
      size_t size = sizeof(events);
      if (zmq_getsockopt(sub.replay->socket, ZMQ_EVENTS, &events, &size) != 0) return;
      if (!(events & ZMQ_POLLIN)) return;
      Parts parts;
      if (!ReceiveMultipart(sub.replay->socket, parts)) return;
      // [delimiter, (topic,) seq, payload]: newer vLLM adds the topic.
      if (!parts.empty() && parts.front().empty()) parts.erase(parts.begin());
      if (parts.size() == 3) parts.erase(parts.begin());
      const std::optional<uint64_t> seq =
          parts.size() == 2 ? DecodeSequence(parts[0]) : std::nullopt;
      if (!seq) {
        sub.counters->Reject(IngestReject::kBadMessage);
        continue;
      }
      if (*seq == UINT64_MAX) {  // end marker (-1)
        FinishReplay(sub);
        return;
      }
      // vLLM and SGLang replay their whole buffer from the sequence asked for, so the replies
      // go on past the hole with messages that arrived live and are held: those count when
      // the held copy is handled, and a reply counts only if it fills the hole.
      if (*seq == *sub.next_seq && *seq < sub.replay->until) {  // else not what is missing
        sub.next_seq = *seq + 1;
        ApplyPayload(sub, parts[1]);
        Bump(sub.counters->messages);
      }
    }
  }

  // Ends the replay (complete, short or timed out), then handles the held live messages.
  void FinishReplay(Subscription& sub) {
    Replay* replay = sub.replay;
    if (replay == nullptr) return;
    sub.replay = nullptr;
    Bump(sub.counters->recoveries);
    if (*sub.next_seq != replay->until) {  // still missing some: fall back to the clear
      ClearWorker(sub.worker.worker_id, sub.socket_rank, *sub.counters);
      sub.salted.Clear();
      sub.copies.Clear();
      SetUnknown(sub, true);
      sub.next_seq = replay->until;
    }
    CloseReplay(replay);
    std::deque<Parts> held;
    held.swap(sub.held);
    while (!held.empty()) {
      Parts parts = std::move(held.front());
      held.pop_front();
      Process(sub, std::move(parts));  // held again if a new gap started another replay
    }
  }

  static void CloseReplay(Replay* replay) {
    zmq_close(replay->socket);
    replay->socket = nullptr;
    uv_poll_stop(&replay->poll);
    uv_timer_stop(&replay->timer);
    auto closed = [](uv_handle_t* h) {
      auto* r = static_cast<Replay*>(h->data);
      if (--r->open_handles == 0) delete r;
    };
    uv_close(reinterpret_cast<uv_handle_t*>(&replay->poll), closed);
    uv_close(reinterpret_cast<uv_handle_t*>(&replay->timer), closed);
  }

  // ---- NATS ------------------------------------------------------------------------------

  struct NatsSource {
    Impl* impl = nullptr;
    std::shared_ptr<SourceCounters> counters;
    std::shared_ptr<DynamoPublishers> dynamo = std::make_shared<DynamoPublishers>();
    natsConnection* connection = nullptr;
    natsSubscription* subscription = nullptr;
    bool replica_sync = false;    // messages are replica changes, not event batches
    uint64_t observer_token = 0;  // replica sync: the router observer it installed
    uint64_t source_id = 0;
    // Set by libnats once the message handler can no longer run (after unsubscribing).
    std::mutex done_mutex;
    std::condition_variable done_cv;
    bool done = false;
  };

  // On libnats' delivery thread: hands the payload to the loop. After Stop, messages are
  // dropped (the loop is closing; `wake` may be closed).
  static void OnNatsMessage(natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
    auto* source = static_cast<NatsSource*>(closure);
    Impl* impl = source->impl;
    const auto* data = reinterpret_cast<const uint8_t*>(natsMsg_GetData(msg));
    std::vector<uint8_t> payload(data, data + natsMsg_GetDataLength(msg));
    natsMsg_Destroy(msg);
    std::lock_guard lock(impl->command_mutex);
    if (impl->stopped) return;
    impl->commands.push_back([impl, counters = source->counters, dynamo = source->dynamo,
                              payload = std::move(payload), replica_sync = source->replica_sync] {
      if (replica_sync) {
        impl->HandleReplicaMessage(payload, *counters);
      } else {
        impl->HandleNatsEvents(payload, *counters, *dynamo);
      }
    });
    uv_async_send(&impl->wake);
  }

  static void OnNatsConnected(natsConnection*, void* closure) {
    Bump(static_cast<NatsSource*>(closure)->counters->connections);
  }

  static void OnNatsComplete(void* closure) {
    auto* source = static_cast<NatsSource*>(closure);
    std::lock_guard lock(source->done_mutex);
    source->done = true;
    source->done_cv.notify_all();
  }

  // Must run where the loop is (the loop thread, or the caller's before Start): libnats attaches
  // its socket to the loop during the connect.
  // `replica_id` empty: event batches. Otherwise replica sync under that id.
  absl::Status SubscribeNatsOnLoop(const std::string& url, const std::string& subject,
                                   const std::string& replica_id, uint64_t& id,
                                   natsConnection** connection) {
    auto source = std::make_unique<NatsSource>();
    source->impl = this;
    source->counters = std::make_shared<SourceCounters>();
    source->replica_sync = !replica_id.empty();
    if (source->replica_sync && replica_sync_active) {
      return absl::FailedPreconditionError("this ingest object already syncs router replicas");
    }
    natsOptions* opts = nullptr;
    natsStatus s = natsOptions_Create(&opts);
    // A replica does not need its own changes back.
    if (s == NATS_OK && source->replica_sync) s = natsOptions_SetNoEcho(opts, true);
    if (s == NATS_OK) s = natsOptions_SetURL(opts, url.c_str());
    if (s == NATS_OK) s = natsOptions_SetTimeout(opts, 2000);
    if (s == NATS_OK) s = natsOptions_SetAllowReconnect(opts, true);
    if (s == NATS_OK) s = natsOptions_SetMaxReconnect(opts, -1);  // forever
    if (s == NATS_OK) s = natsOptions_SetReconnectWait(opts, 100);
    if (s == NATS_OK) {
      s = natsOptions_SetReconnectedCB(opts, &Impl::OnNatsConnected, source.get());
    }
    if (s == NATS_OK) {
      s = natsOptions_SetEventLoop(opts, &loop, natsLibuv_Attach, natsLibuv_Read, natsLibuv_Write,
                                   natsLibuv_Detach);
    }
    if (s == NATS_OK) {
      const bool on_loop_thread = running;
      if (!on_loop_thread) natsLibuv_SetThreadLocalLoop(&loop);
      s = natsConnection_Connect(&source->connection, opts);
      if (!on_loop_thread) natsLibuv_SetThreadLocalLoop(nullptr);
    }
    natsOptions_Destroy(opts);
    if (s != NATS_OK) {
      const std::string why =
          absl::StrCat("cannot connect to NATS at ", url, ": ", natsStatus_GetText(s), " (",
                       nats_GetLastError(nullptr), ")");
      if (source->connection != nullptr) natsConnection_Destroy(source->connection);
      return absl::UnavailableError(why);
    }
    s = natsConnection_Subscribe(&source->subscription, source->connection, subject.c_str(),
                                 &Impl::OnNatsMessage, source.get());
    if (s == NATS_OK) {
      s = natsSubscription_SetOnCompleteCB(source->subscription, &Impl::OnNatsComplete,
                                           source.get());
    }
    if (s != NATS_OK) {
      const std::string why =
          absl::StrCat("cannot subscribe to '", subject, "' at ", url, ": ", natsStatus_GetText(s));
      CloseNats(source.release());
      return absl::InvalidArgumentError(why);
    }
    Bump(source->counters->connections);
    NewSource(id, WithoutUserInfo(url), source->counters);
    *connection = source->connection;
    source->source_id = id;
    if (source->replica_sync) PublishBookings(*source, subject, replica_id);
    nats_sources.push_back(source.release());
    return absl::OkStatus();
  }

  // From now on every change to the router's own bookings is published on `subject`, from the
  // thread that made it (libnats' publish only buffers; its flusher sends).
  void PublishBookings(NatsSource& source, const std::string& subject,
                       const std::string& replica_id) {
    replica_sync_active = true;
    source.observer_token = router->SetSequenceObserver(
        replica_id, [connection = source.connection, subject, replica_id,
                     counters = source.counters](const SequenceChange& c) {
          const std::vector<uint8_t> bytes = EncodeReplicaChange(replica_id, c);
          const natsStatus s = natsConnection_Publish(connection, subject.c_str(), bytes.data(),
                                                      static_cast<int>(bytes.size()));
          Bump(s == NATS_OK ? counters->published : counters->publish_failures);
        });
  }

  absl::Status RemoveNatsSourceOnLoop(uint64_t source_id) {
    for (auto it = nats_sources.begin(); it != nats_sources.end(); ++it) {
      if ((*it)->source_id != source_id) continue;
      if ((*it)->replica_sync) replica_sync_active = false;
      CloseNats(*it);
      nats_sources.erase(it);
      return absl::OkStatus();
    }
    return absl::NotFoundError(absl::StrCat("no NATS source ", source_id));
  }

  // Unsubscribes, waits (bounded) until the handler can no longer run, closes the connection.
  static void CloseNats(NatsSource* source) {
    // The router's threads publish on the connection: stop them first (once this returns, the
    // observer is not running and will not run again).
    // (Only its own observer: a later kvr_router_set_replica_publisher may have replaced it.)
    if (source->replica_sync) source->impl->router->ClearSequenceObserver(source->observer_token);
    if (source->subscription != nullptr) {
      if (natsSubscription_Unsubscribe(source->subscription) == NATS_OK) {
        std::unique_lock lock(source->done_mutex);
        source->done_cv.wait_for(lock, std::chrono::seconds(5), [&] { return source->done; });
      }
      natsSubscription_Destroy(source->subscription);
    }
    if (source->connection != nullptr) natsConnection_Destroy(source->connection);
    delete source;
  }

  // ---- Shutdown ----------------------------------------------------------------------------

  void CloseEverything() {
    for (Listener* l : listeners) CloseAndDelete(&l->handle, l);
    listeners.clear();
    for (Connection* c : connections) CloseAndDelete(&c->handle, c);
    connections.clear();
    for (auto& [id, subs] : engine_workers) {
      for (Subscription* sub : subs) CloseSubscription(sub);
    }
    engine_workers.clear();
    for (NatsSource* n : nats_sources) CloseNats(n);
    nats_sources.clear();
    if (!uv_is_closing(reinterpret_cast<uv_handle_t*>(&wake))) {
      uv_close(reinterpret_cast<uv_handle_t*>(&wake), nullptr);
    }
  }
};

IngestService::IngestService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<IngestService>> IngestService::Create(Router* router,
                                                                     IngestOptions options) {
  if (router == nullptr) return absl::InvalidArgumentError("router is null");
  if (options.max_frame_bytes == 0 || options.max_frame_bytes > kMaxFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_frame_bytes must be in 1..", kMaxFrameBytes));
  }
  auto impl = std::make_unique<Impl>();
  impl->router = router;
  impl->options = options;
  natsLibuv_Init();
  if (int rc = uv_loop_init(&impl->loop); rc != 0) {
    return absl::InternalError(absl::StrCat("uv_loop_init: ", uv_strerror(rc)));
  }
  impl->wake.data = impl.get();
  uv_async_init(&impl->loop, &impl->wake,
                [](uv_async_t* a) { static_cast<Impl*>(a->data)->RunCommands(); });
  return std::unique_ptr<IngestService>(new IngestService(std::move(impl)));
}

absl::Status IngestService::Start() {
  std::lock_guard lock(impl_->command_mutex);
  if (impl_->running || impl_->stopped) {
    return absl::FailedPreconditionError("the ingest service was already started");
  }
  impl_->running = true;
  impl_->thread = std::thread([impl = impl_.get()] {
    natsLibuv_SetThreadLocalLoop(&impl->loop);  // libnats' adapter acts directly on this thread
    uv_run(&impl->loop, UV_RUN_DEFAULT);
  });
  return absl::OkStatus();
}

void IngestService::Stop() {
  std::unique_lock lock(impl_->command_mutex);
  if (impl_->stopped) return;
  impl_->stopped = true;
  if (impl_->running) {
    // The loop ends by itself once the last handle is closed.
    impl_->commands.push_back([impl = impl_.get()] { impl->CloseEverything(); });
    uv_async_send(&impl_->wake);
    lock.unlock();
    impl_->thread.join();
  } else {
    impl_->CloseEverything();
    lock.unlock();
    uv_run(&impl_->loop, UV_RUN_DEFAULT);  // runs the close callbacks
  }
}

IngestService::~IngestService() {
  Stop();
  uv_loop_close(&impl_->loop);
  if (impl_->zmq_context != nullptr) zmq_ctx_term(impl_->zmq_context);
}

absl::StatusOr<uint64_t> IngestService::Listen(const std::string& endpoint, std::string* bound) {
  auto where = ParseStreamEndpoint(endpoint);
  if (!where.ok()) return where.status();
  uint64_t id = 0;
  std::string bound_endpoint;
  absl::Status status =
      impl_->Run([&] { return impl_->ListenOnLoop(*where, &bound_endpoint, id); });
  if (!status.ok()) return status;
  if (bound != nullptr) *bound = bound_endpoint;
  return id;
}

absl::StatusOr<uint64_t> IngestService::AddEngineWorker(const EngineWorker& worker) {
  const uint32_t router_block_size = impl_->router->block_size();
  if (worker.block_size != 0 && worker.block_size != router_block_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", worker.worker_id, " uses block size ", worker.block_size,
                     " but the router's block size is ", router_block_size,
                     "; every worker must use the router's block size (start SGLang with "
                     "--page-size ",
                     router_block_size, ", vLLM with --block-size ", router_block_size, ")"));
  }
  if (worker.dp_size == 0) return absl::InvalidArgumentError("dp_size must be >= 1");
  if (worker.endpoint.empty()) return absl::InvalidArgumentError("endpoint is empty");
  uint64_t id = 0;
  absl::Status status = impl_->Run([&] { return impl_->AddEngineWorkerOnLoop(worker, id); });
  if (!status.ok()) return status;
  return id;
}

absl::Status IngestService::RemoveEngineWorker(uint64_t worker_id, bool clear_index) {
  return impl_->Run([&] { return impl_->RemoveEngineWorkerOnLoop(worker_id, clear_index); });
}

absl::StatusOr<uint64_t> IngestService::SubscribeNats(const std::string& url,
                                                      const std::string& subject) {
  return SubscribeNatsSource(url, subject, "");
}

absl::StatusOr<uint64_t> IngestService::SyncReplicas(const std::string& url,
                                                     const std::string& subject,
                                                     const std::string& replica_id) {
  if (absl::Status valid = ValidateReplicaId(replica_id); !valid.ok()) return valid;
  return SubscribeNatsSource(url, subject, replica_id);
}

absl::StatusOr<uint64_t> IngestService::SubscribeNatsSource(const std::string& url,
                                                            const std::string& subject,
                                                            const std::string& replica_id) {
  if (url.empty()) return absl::InvalidArgumentError("the NATS url is empty");
  if (subject.empty()) return absl::InvalidArgumentError("the NATS subject is empty");
  uint64_t id = 0;
  natsConnection* connection = nullptr;
  bool running = false;
  absl::Status status = impl_->Run([&] {
    running = impl_->running;
    return impl_->SubscribeNatsOnLoop(url, subject, replica_id, id, &connection);
  });
  if (!status.ok()) return status;
  // Once a PING round trip completes, the server has the SUB: messages published from now on
  // are delivered. It is waited for here, as the loop thread must be free to read the PONG.
  // Before Start, the SUB goes out when the loop starts. (The connection lives until Stop, which
  // is not to be called concurrently with this.)
  if (running) {
    if (natsStatus s = natsConnection_FlushTimeout(connection, 5000); s != NATS_OK) {
      // Not half there: the caller gets no source id, so the source must not outlive this.
      (void)impl_->Run([&] { return impl_->RemoveNatsSourceOnLoop(id); });
      return absl::UnavailableError(
          absl::StrCat("NATS subscription to '", subject,
                       "' not confirmed by the server: ", natsStatus_GetText(s)));
    }
  }
  return id;
}

absl::StatusOr<IngestStats> IngestService::Stats(uint64_t source_id) const {
  std::lock_guard lock(impl_->stats_mutex);
  IngestStats stats;
  if (source_id == 0) {
    for (const auto& [id, c] : impl_->counters) c->AddTo(stats);
    return stats;
  }
  auto it = impl_->counters.find(source_id);
  if (it == impl_->counters.end()) {
    return absl::NotFoundError(absl::StrCat("no ingest source ", source_id));
  }
  it->second->AddTo(stats);
  return stats;
}

absl::StatusOr<std::string> IngestService::Endpoint(uint64_t source_id) const {
  std::lock_guard lock(impl_->stats_mutex);
  auto it = impl_->endpoints.find(source_id);
  if (it == impl_->endpoints.end()) {
    return absl::NotFoundError(absl::StrCat("no ingest source ", source_id));
  }
  return it->second;
}

}  // namespace kvrouter

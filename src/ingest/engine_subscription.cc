#include "ingest/engine_subscription.h"

#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <variant>

#include "absl/strings/str_cat.h"
#include "core/hashing.h"
#include "ingest/block_copies.h"
#include "ingest/sequence_tracker.h"
#include "wire/endpoint.h"
#include "wire/engine_events.h"

namespace kvrouter {
namespace {

using Parts = std::vector<std::vector<uint8_t>>;

// An engine's batch timestamp (vLLM: time.time(), float seconds since the Unix epoch) in
// nanoseconds; 0, meaning unknown, for one that is missing, negative, NaN or past year 2500.
uint64_t UnixNanosFromSeconds(double seconds) {
  constexpr double kYear2500 = 16725225600.0;
  if (!(seconds > 0 && seconds < kYear2500)) return 0;
  return static_cast<uint64_t>(seconds * 1e9);
}

bool ReceiveMultipart(void* socket, Parts& parts) {
  for (;;) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, socket, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&msg);
      return false;
    }
    const auto* data = static_cast<const uint8_t*>(zmq_msg_data(&msg));
    const bool more = zmq_msg_more(&msg);
    try {
      parts.emplace_back(data, data + zmq_msg_size(&msg));
    } catch (...) {  // refused: the part goes back to libzmq all the same
      zmq_msg_close(&msg);
      throw;
    }
    zmq_msg_close(&msg);
    if (!more) return true;
  }
}

// Whether `socket` has a message to read (its fd only signals edges).
bool Readable(void* socket) {
  int events = 0;
  size_t size = sizeof(events);
  return zmq_getsockopt(socket, ZMQ_EVENTS, &events, &size) == 0 && (events & ZMQ_POLLIN);
}

// What tells two payloads apart: a replayed message is compared with the one heard live.
uint64_t Digest(const std::vector<uint8_t>& payload) { return HashBytes(payload); }

// TCP keepalive. A SUB socket sends nothing once it has subscribed, so a connection whose peer
// is gone without a word (its host died, a partition outlived the engine's retransmissions)
// stayed established for good: no reconnection, no gap, no flag, and the index kept the
// engine's blocks. The kernel's probes find such a peer (kKeepaliveIdleSeconds of silence, then
// kKeepaliveProbes unanswered probes kKeepaliveIntervalSeconds apart: about 30 s); libzmq then
// connects again, which the socket monitor sees as a reconnection (RankSequence::Reconnected).
// Not ZMTP heartbeats: a SUB whose queue is full (the loop stalled) stops reading, misses the
// peer's PONGs and drops a live connection, and libzmq up to 4.3.5 can then abort on
// `_input_stopped` (zeromq/libzmq#3937, #4767); the peer's kernel answers probes regardless.
constexpr int kKeepaliveIdleSeconds = 15;
constexpr int kKeepaliveIntervalSeconds = 5;
constexpr int kKeepaliveProbes = 3;

void SetKeepalive(void* socket) {
  const int on = 1;
  zmq_setsockopt(socket, ZMQ_TCP_KEEPALIVE, &on, sizeof(on));
  zmq_setsockopt(socket, ZMQ_TCP_KEEPALIVE_IDLE, &kKeepaliveIdleSeconds,
                 sizeof(kKeepaliveIdleSeconds));
  zmq_setsockopt(socket, ZMQ_TCP_KEEPALIVE_INTVL, &kKeepaliveIntervalSeconds,
                 sizeof(kKeepaliveIntervalSeconds));
  zmq_setsockopt(socket, ZMQ_TCP_KEEPALIVE_CNT, &kKeepaliveProbes, sizeof(kKeepaliveProbes));
}

}  // namespace

struct EngineSubscriptions::Subscription {
  EngineSubscriptions* owner = nullptr;
  std::shared_ptr<SourceCounters> counters;
  uint64_t source_id = 0;  // of the worker, shared by its ranks
  EngineWorker worker;
  uint32_t socket_rank = 0;  // the rank this socket's publisher serves
  void* socket = nullptr;
  // The socket's connection events (zmq_socket_monitor): a handshake after the first is a
  // reconnection, after which the publisher may be another process (RankSequence::Reconnected).
  void* monitor = nullptr;
  uint64_t handshakes = 0;
  uv_poll_t poll{};
  uv_poll_t monitor_poll{};  // a disconnection brings no message to the socket's own poll
  int open_polls = 0;        // the handles CloseSubscription waits for before closing sockets
  RankSequence sequence;
  bool state_unknown = false;
  // The connection to the publisher dropped, and no message of a new one has been handled yet:
  // the engine may be dead (its blocks gone with it) or restarted with an empty cache, so the
  // rank counts as unknown meanwhile, its blocks kept (a blip changes nothing) until the first
  // message after the reconnection is judged (RankSequence::Reconnected).
  bool disconnected = false;
  uint64_t handshakes_at_disconnection = 0;
  uint64_t handshakes_at_replay = 0;  // when the replay in flight (or the last) was asked for
  bool counted_unknown = false;       // counted in counters->state_unknown: unknown or disconnected
  Replay* replay = nullptr;           // a replay in progress
  std::deque<Parts> held;             // live messages received during the replay
  // How many of the held messages, from the front, were received before the replay was asked
  // for (RankSequence::JudgeHeld).
  size_t held_before_request = 0;
  SaltedBlocks salted;   // the publisher's blocks stored under a cache salt
  KvCacheGroups groups;  // the publisher's KV-cache groups, which are full attention
  BlockCopies copies;    // the publisher's blocks held more than once
};

// A request to vLLM's replay socket: a DEALER speaking to its ROUTER, with a deadline.
struct EngineSubscriptions::Replay {
  Subscription* sub = nullptr;
  void* socket = nullptr;
  uv_poll_t poll{};
  uv_timer_t timer{};
  int open_handles = 2;
};

EngineSubscriptions::~EngineSubscriptions() {
  if (zmq_context_ != nullptr) zmq_ctx_term(zmq_context_);
}

absl::StatusOr<uint64_t> EngineSubscriptions::Add(const EngineWorker& worker) {
  const uint32_t router_block_size = loop_.router->block_size();
  if (worker.block_size != 0 && worker.block_size != router_block_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", worker.worker_id, " uses block size ", worker.block_size,
                     " but the router's block size is ", router_block_size,
                     "; every worker must use the router's block size (start SGLang with "
                     "--page-size ",
                     router_block_size, ", vLLM with --block-size ", router_block_size, ")"));
  }
  if (worker.dp_size == 0 || worker.dp_size > kMaxEngineRanks) {
    return absl::InvalidArgumentError(absl::StrCat("dp_size is ", worker.dp_size,
                                                   "; an engine worker has 1..", kMaxEngineRanks,
                                                   " ranks (one ZMQ socket each)"));
  }
  if (worker.dp_start > UINT32_MAX - (worker.dp_size - 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ranks ", worker.dp_start, " + ", worker.dp_size, " overflow 32 bits"));
  }
  if (absl::Status s = CheckEngineEndpoint(worker.endpoint, worker.dp_size, "endpoint"); !s.ok()) {
    return s;
  }
  if (!worker.replay_endpoint.empty()) {
    if (absl::Status s =
            CheckEngineEndpoint(worker.replay_endpoint, worker.dp_size, "replay_endpoint");
        !s.ok()) {
      return s;
    }
  }
  uint64_t id = 0;
  absl::Status status = loop_.Run([&] { return AddOnLoop(worker, id); });
  if (!status.ok()) return status;
  return id;
}

absl::Status EngineSubscriptions::Remove(uint64_t worker_id, bool clear_index) {
  return loop_.Run([&] { return RemoveOnLoop(worker_id, clear_index); });
}

absl::Status EngineSubscriptions::AddOnLoop(const EngineWorker& worker, uint64_t& id) {
  if (workers_.contains(worker.worker_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("engine worker ", worker.worker_id, " is already subscribed"));
  }
  if (zmq_context_ == nullptr) {
    zmq_context_ = zmq_ctx_new();
    // Two sockets a rank (its SUB and the SUB's connection monitor): lift libzmq's default cap
    // of 1023 (a select() era limit; Linux polls with epoll), within what it allows.
    const int limit = zmq_ctx_get(zmq_context_, ZMQ_SOCKET_LIMIT);
    zmq_ctx_set(zmq_context_, ZMQ_MAX_SOCKETS, limit > 0 ? std::min(limit, 16384) : 1023);
  }
  // Its place first, and room for every rank's subscription: a refused allocation below
  // (the command then answers ResourceExhausted) closes what was opened and leaves no entry.
  // Not a structured binding: the cleanup lambda below captures it (clang 14 refuses those).
  const auto entry = workers_.try_emplace(worker.worker_id).first;
  std::vector<Subscription*>& subs = entry->second;
  absl::Status status;
  bool source_made = false;
  const auto abandon = [&] {
    for (Subscription* s : subs) CloseSubscription(s);
    workers_.erase(entry);
    if (source_made) loop_.RetireSource(id);
  };
  try {
    subs.reserve(worker.dp_size);
    status = OpenRanks(worker, subs);
    if (status.ok()) {
      std::shared_ptr<SourceCounters> source =
          loop_.NewSource(id, IngestSourceKind::kEngine, worker.endpoint);
      source_made = true;
      for (Subscription* sub : subs) {
        status = Poll(*sub, source, id);
        if (!status.ok()) break;
      }
      if (status.ok()) return absl::OkStatus();
    }
  } catch (...) {
    abandon();
    throw;
  }
  abandon();
  return status;
}

// A subscription per rank, each connected, into `subs` (reserved); the first failure's status.
absl::Status EngineSubscriptions::OpenRanks(const EngineWorker& worker,
                                            std::vector<Subscription*>& subs) {
  for (uint32_t r = 0; r < worker.dp_size; ++r) {
    auto* sub = new Subscription;
    sub->owner = this;
    sub->worker = worker;
    sub->socket_rank = worker.dp_start + r;
    sub->socket = zmq_socket(zmq_context_, ZMQ_SUB);
    if (sub->socket == nullptr) {  // e.g. the context's socket limit (ZMQ_MAX_SOCKETS)
      const std::string why = zmq_strerror(zmq_errno());
      delete sub;
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot open a ZMQ socket for rank ", worker.dp_start + r, ": ", why));
    }
    subs.push_back(sub);  // reserved; closed by the caller from here on
    const int linger = 0;
    zmq_setsockopt(sub->socket, ZMQ_LINGER, &linger, sizeof(linger));
    SetKeepalive(sub->socket);
    zmq_setsockopt(sub->socket, ZMQ_SUBSCRIBE, worker.topic.data(), worker.topic.size());
    // Watched before it connects: libzmq reports a handshake only to a monitor already there,
    // and a first handshake missed would make the first reconnection look like it.
    if (absl::Status watched = WatchConnections(*sub); !watched.ok()) return watched;
    const std::string endpoint = RankEndpoint(worker.endpoint, r);
    if (zmq_connect(sub->socket, endpoint.c_str()) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot connect to ", endpoint, ": ", zmq_strerror(zmq_errno())));
    }
  }
  return absl::OkStatus();
}

absl::Status EngineSubscriptions::Poll(Subscription& sub, std::shared_ptr<SourceCounters> source,
                                       uint64_t id) {
  sub.counters = std::move(source);
  sub.source_id = id;
  // The socket's messages, and its monitor's connection events (a disconnection brings no
  // message): both wake the same drain, which reads connection events where it reads them.
  for (auto [socket, poll] : {std::pair{sub.socket, &sub.poll}, {sub.monitor, &sub.monitor_poll}}) {
    int fd = -1;
    size_t fd_size = sizeof(fd);
    zmq_getsockopt(socket, ZMQ_FD, &fd, &fd_size);
    // Refused (e.g. the kernel's epoll watches used up), the handle is left uninitialised.
    int error = uv_poll_init(&loop_.loop, poll, fd);
    if (error == 0) {
      ++sub.open_polls;
      poll->data = &sub;
      error = uv_poll_start(poll, UV_READABLE, [](uv_poll_t* p, int, int) {
        auto* s = static_cast<Subscription*>(p->data);
        s->owner->OnReadable(*s);
      });
    }
    if (error != 0) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot poll the ZMQ socket of rank ",
                                                       sub.socket_rank, ": ", uv_strerror(error)));
    }
  }
  return absl::OkStatus();
}

void EngineSubscriptions::CloseSubscription(Subscription* sub) {
  if (sub->counted_unknown) sub->counters->state_unknown.fetch_sub(1);
  if (sub->replay != nullptr) {
    CloseReplay(sub->replay);
    sub->replay = nullptr;
  }
  // Off the loop before the socket closes: zmq_close hands the socket, and the fd the loop
  // polls, to ZMQ's reaper thread, which may close the fd while libuv still touches it (uv_close
  // of a poll handle stops it again, epoll_ctl on the fd). So the socket closes only once libuv
  // is done with the handle, in its close callback.
  if (sub->open_polls == 0) {  // never polled
    CloseSockets(sub);
    return;
  }
  for (uv_poll_t* poll : {&sub->poll, &sub->monitor_poll}) {
    if (poll->loop == nullptr) continue;  // never initialised
    uv_poll_stop(poll);
    poll->data = sub;
    uv_close(reinterpret_cast<uv_handle_t*>(poll), [](uv_handle_t* h) {
      auto* closing = static_cast<Subscription*>(h->data);
      if (--closing->open_polls == 0) CloseSockets(closing);
    });
  }
}

absl::Status EngineSubscriptions::RemoveOnLoop(uint64_t worker_id, bool clear_index) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("engine worker ", worker_id, " is not subscribed"));
  }
  const uint64_t source_id = it->second.front()->source_id;
  for (Subscription* sub : it->second) {
    if (clear_index) loop_.ClearRank({worker_id, sub->socket_rank}, *sub->counters);
    CloseSubscription(sub);
  }
  workers_.erase(it);
  loop_.RetireSource(source_id);
  return absl::OkStatus();
}

void EngineSubscriptions::CloseAll() {
  for (auto& [id, subs] : workers_) {
    for (Subscription* sub : subs) CloseSubscription(sub);
  }
  workers_.clear();
}

// Monitors `sub`'s socket for completed handshakes, over a PAIR socket of its own. libzmq
// queues a connection's handshake event before any of its messages, so the monitor is read
// after each message is received and before it is handled (Drain): a message of a new
// connection is always handled as one.
absl::Status EngineSubscriptions::WatchConnections(Subscription& sub) {
  const std::string address = absl::StrCat("inproc://kvr-engine-monitor-", next_monitor_++);
  if (zmq_socket_monitor(sub.socket, address.c_str(),
                         ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot monitor the ZMQ socket: ", zmq_strerror(zmq_errno())));
  }
  sub.monitor = zmq_socket(zmq_context_, ZMQ_PAIR);
  if (sub.monitor == nullptr || zmq_connect(sub.monitor, address.c_str()) != 0) {
    const std::string why = zmq_strerror(zmq_errno());
    if (sub.monitor != nullptr) zmq_close(sub.monitor);
    sub.monitor = nullptr;
    zmq_socket_monitor(sub.socket, nullptr, 0);
    return absl::ResourceExhaustedError(absl::StrCat("cannot monitor the ZMQ socket: ", why));
  }
  const int linger = 0;
  zmq_setsockopt(sub.monitor, ZMQ_LINGER, &linger, sizeof(linger));
  return absl::OkStatus();
}

void EngineSubscriptions::ReadConnectionEvents(Subscription& sub) {
  // [event id (2 bytes) + value (4 bytes), endpoint], read into buffers of its own: a refused
  // allocation must not lose an event (a first handshake missed would hide every later
  // disconnection) nor leave its endpoint to be read as the next event.
  uint8_t frame[6] = {};
  for (int received; (received = zmq_recv(sub.monitor, frame, sizeof frame, ZMQ_DONTWAIT)) >= 0;) {
    int more = 0;
    size_t more_size = sizeof more;
    while (zmq_getsockopt(sub.monitor, ZMQ_RCVMORE, &more, &more_size) == 0 && more != 0) {
      char endpoint[64];  // not needed: cut to fit
      // The rest of a message is there once its first part is: only a signal interrupts.
      if (zmq_recv(sub.monitor, endpoint, sizeof endpoint, 0) < 0 && zmq_errno() != EINTR) break;
    }
    uint16_t id = 0;
    if (received >= static_cast<int>(sizeof id)) std::memcpy(&id, frame, sizeof id);
    if (id == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
      Bump(sub.counters->connections);
      if (++sub.handshakes > 1) sub.sequence.Reconnected();
    } else if (id == ZMQ_EVENT_DISCONNECTED && sub.handshakes > 0) {
      sub.disconnected = true;
      sub.handshakes_at_disconnection = sub.handshakes;
      CountUnknown(sub);
    }
  }
}

void EngineSubscriptions::CloseSockets(Subscription* sub) {
  if (sub->monitor != nullptr) {
    zmq_socket_monitor(sub->socket, nullptr, 0);
    zmq_close(sub->monitor);
  }
  zmq_close(sub->socket);
  delete sub;
}

// The ZMQ fd only signals edges: read every message queued before returning. Connection events
// are read between receiving a message and handling it: read before receiving, a handshake
// that completed in between would go unseen and its connection's first message be handled as
// the old connection's next.
void EngineSubscriptions::OnReadable(Subscription& sub) {
  // ZMQ's descriptor signals edges: a drain a refusal cut short goes on, or the messages behind
  // it would wait for the next edge. Each refusal costs a message read (at most a few per
  // wakeup, so that a heap refusing everything cannot hold the loop here).
  constexpr int kRefusalsPerWakeup = 16;
  for (int refusals = 0; refusals < kRefusalsPerWakeup; ++refusals) {
    if (ContainRefusal([&] { Drain(sub); }, [&] { LostForMemory(sub); })) return;
  }
}

// A message the heap refused memory to (read, then lost while decoded or applied): what it did
// to the rank is unknown, so the rank is cleared and flagged, as after a gap without replay. A
// replay in flight ends as one that timed out: what it applied before the clear is gone, so it
// cannot make the rank exact any more (its short outcome asks for the whole history again), and
// its held messages go on in order. Allocates nothing but what the clear may.
void EngineSubscriptions::LostForMemory(Subscription& sub) {
  sub.counters->Gap(1);
  Bump(sub.counters->recoveries);
  SetUnknown(sub, true);
  // A clear of a rank the index knows allocates nothing there; the relay's copy may be refused.
  ContainRefusal([&] { ClearRank(sub); }, [] {});
  FinishReplay(sub, /*ended=*/false);
}

void EngineSubscriptions::Drain(Subscription& sub) {
  for (;;) {
    if (!Readable(sub.socket)) {
      ReadConnectionEvents(sub);  // counted even while the engine says nothing
      return;
    }
    Parts parts;
    if (!ReceiveMultipart(sub.socket, parts)) return;
    ReadConnectionEvents(sub);
    Process(sub, std::move(parts));
  }
}

// Handles a live message, or holds it while a replay is in flight. A message is counted once it
// has been handled (applied or rejected), not when it arrives, so that a reader who sees N
// messages counted also sees their effects in the index. `before_request`: a held message
// received before the replay that held it was asked for.
void EngineSubscriptions::Process(Subscription& sub, Parts parts, bool before_request) {
  if (sub.replay != nullptr) {
    sub.held.push_back(std::move(parts));
    return;
  }
  if (DropJudged(sub, parts, before_request)) return;
  if (!HandleMessage(sub, parts)) Bump(sub.counters->messages);  // not held for a replay
}

void EngineSubscriptions::SetUnknown(Subscription& sub, bool unknown) {
  sub.state_unknown = unknown;
  CountUnknown(sub);
}

void EngineSubscriptions::CountUnknown(Subscription& sub) {
  const bool unknown = sub.state_unknown || sub.disconnected;
  if (sub.counted_unknown == unknown) return;
  sub.counted_unknown = unknown;
  sub.counters->state_unknown.fetch_add(unknown ? 1 : -1);
}

void EngineSubscriptions::ClearAndFlag(Subscription& sub) {
  ClearRank(sub);
  Bump(sub.counters->recoveries);
  SetUnknown(sub, true);
}

void EngineSubscriptions::ClearRank(Subscription& sub) {
  loop_.ClearRank({sub.worker.worker_id, sub.socket_rank}, *sub.counters);
  sub.salted.Clear();
  sub.copies.Clear();
}

// Checks the message's sequence number against the rank's expectation.
EngineSubscriptions::Verdict EngineSubscriptions::TrackSequence(Subscription& sub, uint64_t seq,
                                                                uint64_t digest,
                                                                const Parts& parts) {
  SourceCounters& c = *sub.counters;
  const RankSequence::Verdict verdict = sub.sequence.Observe(seq, digest);
  switch (verdict.action) {
    case SequenceAction::kApply:
      if (verdict.joined) return Join(sub, seq, parts);
      if (verdict.from_zero) {
        // Heard from its start: a fresh engine holds nothing else, so whatever the rank holds
        // (a restored snapshot's blocks of an older engine, a worker removed without clearing
        // and added again) goes before its history applies.
        ClearRank(sub);
        // Heard first but after two connections: which one's? The reply tells.
        if (verdict.after_reconnection && StartReplay(sub, seq, /*from_start=*/true, &parts)) {
          return Verdict::kHold;
        }
      }
      return Verdict::kApply;
    case SequenceAction::kGap:
      c.Gap(verdict.missed);
      if (StartReplay(sub, seq, /*from_start=*/false, &parts)) return Verdict::kHold;
      // Lost events cannot be recovered: drop what the index believes rather than trust it.
      ClearAndFlag(sub);
      sub.sequence.SkipGap(seq, digest);
      return Verdict::kApply;
    case SequenceAction::kRestart:
      // A new engine process, with an empty cache: the old one's blocks go first, whatever
      // comes next (its lost first messages replayed, or given up on).
      Bump(c.restarts);
      Bump(c.recoveries);
      ClearRank(sub);
      if (verdict.missed == 0) {  // heard from its message 0: its state is known
        // Unless a dead engine's message 0 was still queued: the reply tells.
        if (verdict.after_reconnection && StartReplay(sub, seq, /*from_start=*/true, &parts)) {
          return Verdict::kHold;
        }
        SetUnknown(sub, false);
        return Verdict::kApply;
      }
      // Its first messages were lost: unknown until its whole history is replayed.
      Bump(c.missed_messages, verdict.missed);
      SetUnknown(sub, true);
      if (StartReplay(sub, seq, /*from_start=*/false, &parts)) return Verdict::kHold;
      sub.sequence.SkipGap(seq, digest);
      return Verdict::kApply;
    case SequenceAction::kStale:
      break;
  }
  c.Reject(IngestReject::kStaleSequence);
  return Verdict::kDrop;
}

// The engine ran before this router heard it (its first message heard is numbered above 0):
// what it stored before is unknown, so the rank is flagged. A replay of its whole history from
// 0 makes it exact (the rank cleared first: blocks a restored snapshot holds of an older
// engine must not stay); without one the rank keeps what it holds (a restored snapshot's warm
// blocks) and stays flagged until the engine clears it or restarts.
EngineSubscriptions::Verdict EngineSubscriptions::Join(Subscription& sub, uint64_t seq,
                                                       const Parts& parts) {
  SetUnknown(sub, true);
  if (sub.worker.replay_endpoint.empty()) return Verdict::kApply;
  ClearRank(sub);
  if (StartReplay(sub, seq, /*from_start=*/true, &parts)) return Verdict::kHold;
  return Verdict::kApply;
}

bool EngineSubscriptions::HandleMessage(Subscription& sub, const Parts& parts) {
  const std::optional<uint64_t> seq = parts.size() == 3 ? DecodeSequence(parts[1]) : std::nullopt;
  if (!seq) {
    sub.counters->Reject(IngestReject::kBadMessage);
    return false;
  }
  switch (TrackSequence(sub, *seq, Digest(parts[2]), parts)) {
    case Verdict::kDrop:
      return false;
    case Verdict::kHold:  // StartReplay holds it
      return true;
    case Verdict::kApply:
      ApplyPayload(sub, parts[2]);
      SettleDisconnection(sub);
      return false;
  }
  return false;
}

void EngineSubscriptions::SettleDisconnection(Subscription& sub) {
  // A message of a new connection judged (RankSequence::Reconnected): the rank is flagged or
  // known as its verdict said, the disconnection no longer counts. Cleared after that verdict's
  // own flag, so that the count never dips between the two.
  if (sub.disconnected && sub.handshakes > sub.handshakes_at_disconnection) {
    sub.disconnected = false;
    CountUnknown(sub);
  }
}

void EngineSubscriptions::ApplyPayload(Subscription& sub, const std::vector<uint8_t>& payload) {
  SourceCounters& c = *sub.counters;
  auto batch = DecodeEnginePayload(payload);
  if (!batch.ok()) {
    c.Reject(IngestReject::kBadMsgpack, std::string(batch.status().message()));
    return;
  }
  // Each rank publishes on a socket of its own, and a gap, a restart or a replay of this
  // socket's sequence clears and flags this socket's rank: a batch that names another rank
  // would put its blocks where nothing here keeps track of them. Such a batch is a
  // misconfiguration (the worker's dp_start, or its endpoint's port, not the engine's), so it
  // is dropped whole, and says why.
  if (batch->dp_rank && *batch->dp_rank != sub.socket_rank) {
    c.Reject(
        IngestReject::kBadMsgpack,
        absl::StrCat("a batch of data-parallel rank ", *batch->dp_rank, " on the socket of rank ",
                     sub.socket_rank, " (worker ", sub.worker.worker_id,
                     "): dropped; rank dp_start + r publishes on port + r, so check the "
                     "worker's dp_start and endpoint"));
    return;
  }
  const uint64_t first_event_id = loop_.next_event_id;
  loop_.next_event_id += batch->events.size();
  // Each event applies before the next is converted: a removal's Forget of a salt comes
  // before a later store in the batch records it again. An event of a type this build does not
  // know is skipped alone, the rest of the batch applies; rejects are counted in their place.
  const size_t other_groups = ApplyKvEvents(
      *batch, sub.worker.worker_id, sub.socket_rank, loop_.router->block_size(), sub.worker.eagle,
      first_event_id, &sub.salted, &sub.groups,
      [&](KvEvent& event) {
        // An engine-side clear makes its state known again.
        if (std::holds_alternative<ClearedEvent>(event.data)) SetUnknown(sub, false);
        ApplyEngineEvent(sub, event);
      },
      [&](ConversionReject& reject) {
        c.Reject(reject.kind == ConversionReject::Kind::kBlockSize ? IngestReject::kBlockSize
                                                                   : IngestReject::kBadMsgpack,
                 std::move(reject.reason));
      });
  Bump(c.events_ignored, other_groups);
  c.RecordLag(UnixNanosFromSeconds(batch->timestamp));
}

// Applies one engine event, keeping the publisher's copies in step (event by event: a batch may
// store a block and then its copy). A removal takes extra copies first, and those blocks stay
// indexed; the blocks a store repeats (the index reports them) are copies.
void EngineSubscriptions::ApplyEngineEvent(Subscription& sub, KvEvent& event) {
  SourceCounters& c = *sub.counters;
  BlockCopies& copies = sub.copies;
  if (auto* removed = std::get_if<RemovedEvent>(&event.data)) {
    std::erase_if(removed->block_hashes,
                  [&](uint64_t h) { return copies.TakeExtra(event.worker, event.tier, h); });
    // A block that left its last tier is gone, and so is its salt; one with another copy (on
    // this tier or another) keeps it.
    sub.salted.Forget(removed->block_hashes, event.tier);
    if (removed->block_hashes.empty()) {  // applied: each block it named had another copy
      Bump(c.events_applied);
      return;
    }
  } else if (std::holds_alternative<ClearedEvent>(event.data)) {
    copies.ForgetRank(event.worker);
  }
  const auto result = loop_.ApplyOne(event, c);
  if (absl::IsResourceExhausted(result.status())) {
    // Out of memory: the index dropped the rank's blocks, so what it holds is unknown now, as
    // after a gap without replay (repaired when the engine clears its cache or restarts).
    sub.salted.Clear();
    copies.Clear();
    Bump(c.recoveries);
    SetUnknown(sub, true);
    return;
  }
  if (!result.ok()) return;
  for (uint64_t h : result->repeated) copies.Add(event.worker, event.tier, h);
}

// ---- Replay (vLLM's replay ROUTER socket) -------------------------------------------------

// Asks for the messages before live message `until` from where the rank's sequence says
// (RankSequence::ReplayFrom), or, `from_start`, for the engine's whole history. False if the worker
// has no replay endpoint or the replay socket cannot be opened. Every message already queued on
// the rank's socket is held before the request goes out: what the engine had published by then
// is in its reply, which is how a held message can be told to be a dead engine's.
//
// A refused allocation leaves a consistent state: refused before the replay is under way, it
// propagates with nothing opened or changed (the caller's containment counts the trigger lost);
// once under way (its socket, poll and timer in `sub.replay`), refusals are contained, and the
// replay either runs to its end marker or deadline, or ends at once as one that timed out
// (LostForMemory), its held messages handed on in order.
bool EngineSubscriptions::StartReplay(Subscription& sub, uint64_t until, bool from_start,
                                      const Parts* trigger) {
  if (sub.worker.replay_endpoint.empty()) return false;
  const uint64_t from = from_start ? 0 : sub.sequence.ReplayFrom();
  const std::string endpoint =
      RankEndpoint(sub.worker.replay_endpoint, sub.socket_rank - sub.worker.dp_start);
  auto replay = std::make_unique<Replay>();
  // The trigger is held first (a reply already queued may end the replay at once, and the held
  // messages then go on), before the socket opens: taken back if it cannot.
  if (trigger != nullptr) sub.held.push_front(*trigger);
  sub.handshakes_at_replay = sub.handshakes;
  auto unhold = [&] {
    if (trigger != nullptr) sub.held.pop_front();
  };
  void* socket = zmq_socket(zmq_context_, ZMQ_DEALER);
  if (socket == nullptr) {
    unhold();
    return false;
  }
  const int linger = 0;
  zmq_setsockopt(socket, ZMQ_LINGER, &linger, sizeof(linger));
  if (zmq_connect(socket, endpoint.c_str()) != 0) {
    zmq_close(socket);
    unhold();
    return false;
  }
  // Under way: nothing below throws (refusals are contained), and the replay ends through
  // FinishReplay, which closes it.
  Replay* r = replay.release();
  r->sub = &sub;
  r->socket = socket;
  int fd = -1;
  size_t fd_size = sizeof(fd);
  zmq_getsockopt(r->socket, ZMQ_FD, &fd, &fd_size);
  uv_poll_init(&loop_.loop, &r->poll, fd);
  r->poll.data = r;
  uv_timer_init(&loop_.loop, &r->timer);
  r->timer.data = r;
  sub.replay = r;
  if (from_start) {
    sub.sequence.BeginReplayFromStart(until);
  } else {
    sub.sequence.BeginReplay(until);
  }
  // Held, the replay being in flight. A message the heap refuses on the way is lost: the replay
  // ends at once (LostForMemory), and so does this request (CloseReplay unset r->sub; the
  // handle is freed by libuv's close callbacks, later).
  ContainRefusal([&] { Drain(sub); }, [&] { LostForMemory(sub); });
  if (r->sub == nullptr) return true;
  sub.held_before_request = sub.held.size();
  uint8_t start[8];
  for (int i = 0; i < 8; ++i) start[i] = static_cast<uint8_t>(from >> (56 - 8 * i));
  // The empty delimiter makes the DEALER look like the REQ client vLLM expects.
  if (zmq_send(r->socket, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) != 0 ||
      zmq_send(r->socket, start, 8, ZMQ_DONTWAIT) != 8) {
    FinishReplay(sub, /*ended=*/false);  // as a replay that timed out: the held messages go on
    return true;
  }
  uv_poll_start(&r->poll, UV_READABLE, [](uv_poll_t* p, int, int) {
    auto* r = static_cast<Replay*>(p->data);
    r->sub->owner->ContainReplay(*r->sub, [r] { r->sub->owner->DrainReplay(*r->sub); });
  });
  uv_timer_start(
      &r->timer,
      [](uv_timer_t* t) {
        auto* r = static_cast<Replay*>(t->data);
        r->sub->owner->ContainReplay(
            *r->sub, [r] { r->sub->owner->FinishReplay(*r->sub, /*ended=*/false); });
      },
      loop_.options.replay_timeout_ms, 0);
  ContainReplay(sub, [&] { DrainReplay(sub); });  // the fd signals edges: look once now
  return true;
}

void EngineSubscriptions::DrainReplay(Subscription& sub) {
  while (sub.replay != nullptr && Readable(sub.replay->socket)) {
    Parts parts;
    if (!ReceiveMultipart(sub.replay->socket, parts)) return;
    // [delimiter, (topic,) seq, payload]: newer vLLM adds the topic.
    if (!parts.empty() && parts.front().empty()) parts.erase(parts.begin());
    if (parts.size() == 3) parts.erase(parts.begin());
    const std::optional<uint64_t> seq = parts.size() == 2 ? DecodeSequence(parts[0]) : std::nullopt;
    if (!seq) {
      sub.counters->Reject(IngestReject::kBadMessage);
      continue;
    }
    if (*seq == UINT64_MAX) {  // end marker (-1)
      FinishReplay(sub, /*ended=*/true);
      return;
    }
    // vLLM and SGLang replay their whole buffer from the sequence asked for, so the replies go
    // on past the hole with messages that arrived live and are held: those count when the held
    // copy is handled, and a reply counts only if it fills the hole.
    switch (sub.sequence.AcceptReplayed(*seq, Digest(parts[1]))) {
      case RankSequence::Replayed::kSkip:
        break;
      case RankSequence::Replayed::kApply:
        ApplyPayload(sub, parts[1]);
        // Past the trigger, a whole reply from 0 counts once complete (FinishReplay): short,
        // the held copies are handled and counted instead.
        if (*seq < *sub.sequence.replay_until()) Bump(sub.counters->messages);
        break;
      case RankSequence::Replayed::kRestarted:
        // Another engine answers for the rank: the one heard before is gone, and so are its
        // blocks. The rest of this replay is not applied (FinishReplay is then short).
        Bump(sub.counters->restarts);
        ClearRank(sub);
        SetUnknown(sub, true);
        break;
    }
  }
}

// Ends the replay (complete, short or timed out), then handles the held live messages. A short
// replay clears and flags the rank, then asks once for the engine's whole history from message
// 0 (the held messages wait for it): complete, it repairs the rank (unflagged); short again,
// the rank stays flagged until the engine clears its cache or restarts.
template <typename Work>
void EngineSubscriptions::ContainReplay(Subscription& sub, Work work) {
  // A reply the heap refused: the replay cannot be trusted to fill the hole. The rank is
  // cleared and flagged, and the replay ends as one that timed out (its held messages go on).
  ContainRefusal(work, [&] { LostForMemory(sub); });
}

void EngineSubscriptions::FinishReplay(Subscription& sub, bool ended) {
  Replay* replay = sub.replay;
  if (replay == nullptr) return;
  sub.replay = nullptr;
  Bump(sub.counters->recoveries);
  const std::optional<uint64_t> until = sub.sequence.replay_until();
  const bool from_start = sub.sequence.replaying_from_start();
  CloseReplay(replay);
  switch (sub.sequence.FinishReplay(ended)) {
    case RankSequence::Outcome::kComplete:
      break;
    case RankSequence::Outcome::kCompleteFromStart:  // the engine's whole history: known
      SetUnknown(sub, false);
      // Its messages past the trigger, applied from the reply (their held copies are repeats).
      if (until && sub.sequence.next() > *until) {
        Bump(sub.counters->messages, *sub.sequence.next() - *until);
      }
      break;
    case RankSequence::Outcome::kShort: {  // still missing some: fall back to the clear
      SetUnknown(sub, true);
      bool repairing = false;
      // Refused, the rank stays flagged (cleared, or holding nothing the index could keep) and
      // the held messages go on: nothing may leave them behind.
      ContainRefusal(
          [&] {
            ClearRank(sub);
            repairing = until && !from_start && StartReplay(sub, *until, /*from_start=*/true);
          },
          [] {});
      if (repairing) return;
      break;
    }
  }
  // The reply judged the message that asked for it: if that came on the next connection, the
  // disconnection is settled (a replay of the old connection's settles nothing).
  if (sub.handshakes_at_replay > sub.handshakes_at_disconnection) SettleDisconnection(sub);
  HandleHeld(sub);
}

// The live messages held during a replay, in order, until one starts another replay: that one
// holds it first, the rest after it, then what it reads from the socket. A message the heap
// refuses is lost as a live one is (LostForMemory) and the others go on, in order: none is left
// behind to be handled after later ones.
void EngineSubscriptions::HandleHeld(Subscription& sub) {
  while (sub.replay == nullptr && !sub.held.empty()) {
    const bool before_request = sub.held_before_request > 0;
    if (before_request) --sub.held_before_request;
    Parts parts = std::move(sub.held.front());
    sub.held.pop_front();
    ContainRefusal([&] { Process(sub, std::move(parts), before_request); },
                   [&] { LostForMemory(sub); });
  }
}

// After a repair that took a restarted engine's whole reply (RankSequence::JudgeHeld): whether
// the message is dropped, as a repeat of the reply (applied and counted from it: the live copy
// may come after the reply, on another connection) or as the dead engine's, still queued
// across the reconnection.
bool EngineSubscriptions::DropJudged(Subscription& sub, const Parts& parts, bool before_request) {
  if (!sub.sequence.judging_held()) return false;
  const std::optional<uint64_t> seq = parts.size() == 3 ? DecodeSequence(parts[1]) : std::nullopt;
  if (!seq) return false;
  switch (sub.sequence.JudgeHeld(*seq, Digest(parts[2]), before_request)) {
    case RankSequence::Held::kObserve:
      return false;
    case RankSequence::Held::kRepeat:
      return true;
    case RankSequence::Held::kDeadEngineRestarted:
      Bump(sub.counters->restarts);
      [[fallthrough]];
    case RankSequence::Held::kDeadEngine:
      Bump(sub.counters->messages);
      sub.counters->Reject(IngestReject::kStaleSequence,
                           absl::StrCat("message ", *seq, " of rank ", sub.socket_rank,
                                        " is the restarted engine's predecessor's, read after "
                                        "the reconnection: dropped"));
      return true;
  }
  return false;
}

// As CloseSubscription: the socket closes once libuv is done with the poll handle.
void EngineSubscriptions::CloseReplay(Replay* replay) {
  uv_poll_stop(&replay->poll);
  uv_timer_stop(&replay->timer);
  replay->sub = nullptr;
  auto closed = [](uv_handle_t* h) {
    auto* r = static_cast<Replay*>(h->data);
    if (h == reinterpret_cast<uv_handle_t*>(&r->poll)) {
      zmq_close(r->socket);
      r->socket = nullptr;
    }
    if (--r->open_handles == 0) delete r;
  };
  uv_close(reinterpret_cast<uv_handle_t*>(&replay->poll), closed);
  uv_close(reinterpret_cast<uv_handle_t*>(&replay->timer), closed);
}

}  // namespace kvrouter
